//! `strata-exec PLAN --serve`: the OpenAI-compatible server over the plan's engine.
//! Invariant: the server binds before the model loads; bad flags exit 1 before binding.

use super::run::RunArgs;

/// Flags of `--serve` (flattened into the run command's arguments).
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Serve an OpenAI-compatible HTTP API over the planned slots instead of generating once.
    #[arg(long)]
    pub serve: bool,
}

pub fn main(args: RunArgs) -> ! {
    let _ = args;
    super::fail("--serve is not wired yet")
}
