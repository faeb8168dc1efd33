//! `strata-exec`: run a Strata plan (generate, `--serve`), `bench` it, `profile` its routing,
//! or `probe` this machine. Each command lives in its own file under `cli/`; this file only
//! dispatches.
//! Invariant: every check happens before the first arena is allocated; exit 0 on success, 1
//! on any bad input or mismatch (with the numbers), 2 on an engine failure mid-run.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "strata-exec",
    about = "Run a Strata plan: allocate the planned arenas, load the weights, generate tokens or serve an OpenAI-compatible API",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "Examples:\n  strata-plan --model tests/data/tiny-qwen3moe/base --hardware plans/hardware/cpu.toml --max-context 64 --out tiny.plan\n  strata-exec tiny.plan --prompt-tokens 1,17,42 -n 16 --format json\n  strata-exec tiny.plan --serve --port 8080\n  strata-exec bench tiny.plan -p 512 -n 128 -r 3\n  strata-exec probe -o probe.toml"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: cli::run::RunArgs,
}

// Parsed once per process: the size of bench's flag lists does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Cmd {
    /// Prefill and decode speed of a plan (mean +- sd over repetitions), and device memory
    /// used versus planned.
    Bench(cli::bench::BenchArgs),
    /// Measure this machine and write a probe file for `strata-plan --hardware`.
    Probe(cli::probe::ProbeArgs),
    /// Run a file of prompts and write the router's picks as a routing profile for
    /// `strata-plan --expert-profile`.
    Profile(cli::profile::ProfileArgs),
}

fn main() {
    let cli = Cli::parse();
    // One log subscriber for every command (load progress and the server's log go through
    // it); `--log-format` is a serve flag, text otherwise.
    let format = match &cli.cmd {
        None if cli.run.serve.serve => cli.run.serve.log_format.into(),
        _ => strata_exec::serve::reqlog::LogFormat::Text,
    };
    strata_exec::serve::reqlog::init(format);
    match cli.cmd {
        Some(Cmd::Bench(a)) => cli::bench::main(a),
        Some(Cmd::Probe(a)) => cli::probe::main(a),
        Some(Cmd::Profile(a)) => cli::profile::main(a),
        None if cli.run.serve.serve => cli::serve::main(cli.run),
        None => cli::run::main(cli.run),
    }
}
