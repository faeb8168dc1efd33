//! `strata-exec probe`: measure this machine and write the probe file the planner reads.
//! Invariant: reports what it measured; never guesses a number it could not read.

use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct ProbeArgs {
    /// Where to write the probe file (TOML); default: standard output.
    #[arg(short = 'o', long)]
    pub out: Option<PathBuf>,
}

pub fn main(args: ProbeArgs) {
    let _ = args;
    super::fail("probe is not wired yet")
}
