//! `strata-exec bench PLAN`: prefill and decode tokens/s of a plan, like llama-bench.
//! Invariant: measures only; the engine is started exactly as `strata-exec PLAN` starts it.

use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The plan file written by strata-plan.
    pub plan: PathBuf,
    #[command(flatten)]
    pub common: super::PlanArgs,
}

pub fn main(args: BenchArgs) {
    let _ = args;
    super::fail("bench is not wired yet")
}
