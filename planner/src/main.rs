//! `strata-plan`: the command line over the planner library. Exit codes are the contract of
//! DESIGN.md: 0 plan written (or report printed), 1 bad input, 2 infeasible, 3 `--strict` and
//! degraded or not runnable by any backend of this build; `check` exits 4 on catalogue drift.

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use strata_plan::report;
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_schemas::capability::{runnable, runnable_model, runnable_workload, Workload};
use strata_schemas::probe::HardwareProbe;
use strata_schemas::serve::{
    ExpertCache, KvType, LayerSplit, RopeScaling, ServeSettings, ServeToml,
};
use strata_schemas::text::for_terminal;

const AFTER_HELP: &str = "\
Examples:
  # Plan the shipped Qwen3-Next example for two 32 GB Radeon cards (no GPU needed):
  strata-plan --hardware plans/hardware/r9700-x2.toml \\
      --model plans/models/qwen3-next-80b-a3b-iq3_s.toml \\
      --max-context 1048576 --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 262144 \\
      --kv q8_0 --kv-resident 32768 --batch 4 --mtp --spec 4 --vision --vram-reserve-mib 500 \\
      -o seed000.plan
  # A main GGUF without its MTP block plus llama.cpp's MTP-only file (convert --mtp):
  strata-plan --hardware probe.toml --model Qwen3-Next.gguf --mtp-model mtp-Qwen3-Next.gguf \
      --spec 3 -o next.plan
  # Print the report of a plan file again, as JSON:
  strata-plan inspect seed000.plan --format json
  # Regenerate and check the shipped catalogue (every GPU probe x model x preset):
  strata-plan check plans/catalogue

Reservation order: runtime reserve, --vram-reserve-mib, dense weights, embedding/head, MTP,
vision, scratch, staging, the expert cache's minimum working set and one slot are required;
then the --batch slots and --kv-resident window; the expert cache takes what is left.
When the request does not fit, the plan first streams more KV from host memory (smaller
VRAM window per slot, not below 4096 cells), then plans fewer slots; each step is listed
under degradations. MTP and vision are never dropped.

The report says which backend of this build's strata-exec runs the plan (runnable: cpu,
cuda, hip), and if none, exactly what is missing; its predicted speeds come from the probe's
[device.cost] coefficients (`strata-exec probe` measures them) or documented defaults, and
then say they are guesses.

Exit codes: 0 plan written or report printed, 1 bad input, 2 infeasible (no plan written),
3 --strict and the plan is degraded or no backend of this build runs it (no plan written),
4 `check`: the catalogue drifted or an entry became infeasible.";

#[derive(Parser)]
#[command(
    name = "strata-plan",
    version,
    about = "Plan every byte of an MoE model's memory on your GPUs and host RAM, before loading a weight",
    after_help = AFTER_HELP,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    plan: PlanArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the report stored in a plan file.
    Inspect {
        /// The plan file written by `strata-plan -o`.
        plan: PathBuf,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Describe a model: architecture, parameters, bytes by role (dense, experts, embedding,
    /// head, MTP), quant mix and hyperparameters. Takes any valid GGUF (also architectures
    /// Strata cannot plan), a safetensors folder or a descriptor .toml.
    ModelInfo {
        /// A .gguf file, a safetensors folder or a descriptor .toml.
        path: PathBuf,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Re-plan every entry of a plan catalogue (plans/catalogue: probe x model x serve preset,
    /// listed in its catalogue.toml) and compare with the committed reports and plan hashes;
    /// exit 4 naming each entry that drifted or became infeasible.
    Check {
        /// The catalogue folder (holds catalogue.toml).
        dir: PathBuf,
        /// Rewrite the committed reports and tables instead of failing on drift.
        #[arg(long)]
        update: bool,
    },
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Format {
    Text,
    Json,
}

#[derive(Args)]
struct PlanArgs {
    /// Hardware probe TOML ([host] and [[device]] entries; see plans/hardware/).
    #[arg(long, value_name = "PROBE.toml")]
    hardware: Option<PathBuf>,
    /// The model: a descriptor .toml (plans/models/), a .gguf file or a safetensors folder.
    #[arg(long, value_name = "PATH")]
    model: Option<PathBuf>,
    /// Serve settings TOML whose keys are these flags' names (max-context = 65536, ...);
    /// flags given on the command line win.
    #[arg(long, value_name = "SERVE.toml")]
    serve: Option<PathBuf>,
    /// Write the plan here (nothing is written when the request is infeasible).
    #[arg(short, long, value_name = "PLAN")]
    output: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Exit 3 when the plan had to degrade the request.
    #[arg(long)]
    strict: bool,

    /// Context cells per slot (prompt + generation) [default: 4096].
    #[arg(long, value_name = "CELLS", help_heading = "Serve")]
    max_context: Option<u64>,
    /// Slot sessions decoded together [default: 1].
    #[arg(long, value_name = "SLOTS", help_heading = "Serve")]
    batch: Option<u32>,
    /// KV cache type: f16 or q8_0 [default: f16].
    #[arg(long, value_name = "TYPE", help_heading = "Serve")]
    kv: Option<String>,
    /// Cells per slot kept in VRAM; the rest of each slot's context lives in pinned host
    /// memory [default: the whole context].
    #[arg(long, value_name = "CELLS", help_heading = "Serve")]
    kv_resident: Option<u64>,
    /// Tokens per prefill step; sizes the scratch [default: 512].
    #[arg(long, value_name = "TOKENS", help_heading = "Serve")]
    ubatch: Option<u32>,
    /// The MTP-only GGUF llama.cpp's `convert_hf_to_gguf.py --mtp` writes (mtp-<name>.gguf),
    /// for a --model without its MTP block (converted with --no-mtp): its block is planned in
    /// the mtp region and the plan records both files (implies --mtp).
    #[arg(long, value_name = "MTP.gguf")]
    mtp_model: Option<PathBuf>,

    /// Load the MTP (next-n) draft head.
    #[arg(long, help_heading = "Serve")]
    mtp: bool,
    /// Draft tokens per step (implies --mtp).
    #[arg(long, value_name = "N", help_heading = "Serve")]
    spec: Option<u32>,
    /// Place no prefix checkpoint: models with linear attention (Qwen3-Next) otherwise get
    /// one more copy of each slot's linear state, so the server's prefix cache can rewind a
    /// slot to the end of its last prompt (the report's notes say what it costs).
    #[arg(long, help_heading = "Serve")]
    no_prefix_checkpoint: bool,
    /// Plan the vision tower: from an mmproj .gguf, or the descriptor's [vision] section when
    /// no path is given.
    #[arg(long, value_name = "MMPROJ", num_args = 0..=1, help_heading = "Serve")]
    vision: Option<Option<String>>,
    /// MiB left untouched on every device [default: 0].
    #[arg(long, value_name = "MIB", help_heading = "Serve")]
    vram_reserve_mib: Option<u64>,
    /// Expert cache: auto (everything left over), N slots in total, or off (minimum working
    /// set only) [default: auto].
    #[arg(long, value_name = "auto|N|off", help_heading = "Serve")]
    expert_cache: Option<String>,
    /// Per-layer, per-expert routing counts choosing the resident experts (schemas/PROFILE.md).
    #[arg(long, value_name = "FILE", help_heading = "Serve")]
    expert_profile: Option<PathBuf>,
    /// Layer boundaries between devices (16,32 gives [0,16) [16,32) [32,end)), or auto to
    /// search for the fastest split [default: auto].
    #[arg(long, value_name = "auto|B1,B2,..", help_heading = "Serve")]
    layer_split: Option<String>,
    /// Probe device indices to use, in pipeline order [default: all].
    #[arg(
        long,
        value_name = "0,1,2",
        value_delimiter = ',',
        help_heading = "Serve"
    )]
    gpu: Option<Vec<u32>>,
    /// Largest single pinned host allocation, in MiB [default: 256].
    #[arg(long, value_name = "MIB", help_heading = "Serve")]
    pinned_chunk_mib: Option<u64>,
    /// RoPE scaling for context beyond the trained length: yarn.
    #[arg(long, value_name = "yarn", help_heading = "Serve")]
    rope_scaling: Option<String>,
    /// RoPE scaling factor (e.g. 4).
    #[arg(long, value_name = "F", help_heading = "Serve")]
    rope_scale: Option<f64>,
    /// The trained context YaRN scales from [default: the model's].
    #[arg(long, value_name = "CELLS", help_heading = "Serve")]
    yarn_orig_ctx: Option<u64>,
}

/// Failure classes mapped to exit codes.
enum Fail {
    Bad(String),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Some(Cmd::Inspect { plan, format }) => inspect(&plan, format),
        Some(Cmd::ModelInfo { path, format }) => model_info(&path, format),
        Some(Cmd::Check { dir, update }) => check(&dir, update),
        None => plan(&cli.plan),
    };
    match result {
        Ok(code) => code,
        Err(Fail::Bad(msg)) => {
            eprintln!("strata-plan: error: {}", for_terminal(&msg));
            ExitCode::from(1)
        }
    }
}

fn inspect(path: &std::path::Path, format: Format) -> Result<ExitCode, Fail> {
    let plan = strata_schemas::planfile::read_plan(path).map_err(|e| Fail::Bad(e.to_string()))?;
    match format {
        Format::Json => {
            let mut v = report::plan_json(&plan);
            v["scratch"] = report::scratch_json(&plan);
            println!(
                "{}",
                serde_json::to_string_pretty(&v).expect("JSON value prints")
            )
        }
        Format::Text => print!(
            "{}{}",
            for_terminal(&report::plan_text(&plan)),
            for_terminal(&report::scratch_text(&plan))
        ),
    }
    Ok(ExitCode::SUCCESS)
}

fn model_info(path: &std::path::Path, format: Format) -> Result<ExitCode, Fail> {
    let info = strata_plan::model::model_info(path).map_err(Fail::Bad)?;
    // What running the model at all asks of each backend; a GGUF of an architecture the
    // planner cannot read is judged on its architecture alone.
    let run = match strata_plan::model::load_model(path) {
        Ok(inv) => runnable_model(&inv),
        Err(_) => runnable_workload(&Workload {
            arch: info.arch.clone(),
            ..Workload::default()
        }),
    };
    match format {
        Format::Json => {
            let mut j = info.to_json();
            j["runnable"] = report::runnable_json(&run);
            println!(
                "{}",
                serde_json::to_string_pretty(&j).expect("JSON value prints")
            );
        }
        Format::Text => {
            print!("{}", for_terminal(&info.to_text()));
            println!("runnable by this build's strata-exec (the model alone; a plan adds its devices and features)");
            print!("{}", for_terminal(&report::runnable_text(&run)));
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn check(dir: &std::path::Path, update: bool) -> Result<ExitCode, Fail> {
    let t0 = std::time::Instant::now();
    let r = strata_plan::catalogue::check(dir, update).map_err(Fail::Bad)?;
    for p in &r.problems {
        eprintln!("strata-plan check: {p}");
    }
    println!(
        "strata-plan check: {} entries of {} in {:.1} s: {} problem(s){}",
        r.entries,
        dir.display(),
        t0.elapsed().as_secs_f64(),
        r.problems.len(),
        if update {
            format!(", {} file(s) written", r.written)
        } else {
            String::new()
        }
    );
    Ok(if r.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(4)
    })
}

fn settings(a: &PlanArgs) -> Result<ServeSettings, Fail> {
    let mut s = ServeSettings::default();
    if let Some(p) = &a.serve {
        let t = ServeToml::from_file(p).map_err(|e| Fail::Bad(e.to_string()))?;
        t.apply(&mut s, &format!("{}: ", p.display()))
            .map_err(|e| Fail::Bad(e.to_string()))?;
    }
    let bad = |flag: &str, r: String| Fail::Bad(format!("`{flag}`: {r}"));
    if let Some(v) = a.max_context {
        s.max_context = v;
    }
    if let Some(v) = a.batch {
        s.batch = v;
    }
    if let Some(v) = &a.kv {
        s.kv = KvType::parse(v).map_err(|r| bad("--kv", r))?;
    }
    if let Some(v) = a.kv_resident {
        s.kv_resident = Some(v);
    }
    if let Some(v) = a.ubatch {
        s.ubatch = v;
    }
    if a.mtp || a.mtp_model.is_some() {
        s.mtp = true;
    }
    if let Some(v) = a.spec {
        s.spec = v;
    }
    if a.no_prefix_checkpoint {
        s.prefix_checkpoint = false;
    }
    if let Some(v) = &a.vision {
        s.vision = Some(v.clone());
    }
    if let Some(v) = a.vram_reserve_mib {
        s.vram_reserve_mib = v;
    }
    if let Some(v) = &a.expert_cache {
        s.expert_cache = ExpertCache::parse(v).map_err(|r| bad("--expert-cache", r))?;
    }
    if let Some(v) = &a.expert_profile {
        s.expert_profile = Some(v.display().to_string());
    }
    if let Some(v) = &a.layer_split {
        s.layer_split = LayerSplit::parse(v).map_err(|r| bad("--layer-split", r))?;
    }
    if let Some(v) = &a.gpu {
        s.gpu = Some(v.clone());
    }
    if let Some(v) = a.pinned_chunk_mib {
        s.pinned_chunk_mib = v;
    }
    if a.rope_scaling.is_some() || a.rope_scale.is_some() || a.yarn_orig_ctx.is_some() {
        let prev = s.rope_scaling.clone();
        s.rope_scaling = Some(RopeScaling {
            kind: a
                .rope_scaling
                .clone()
                .or_else(|| prev.as_ref().map(|p| p.kind.clone()))
                .unwrap_or_else(|| "yarn".into()),
            factor: a
                .rope_scale
                .or(prev.as_ref().map(|p| p.factor))
                .unwrap_or(0.0),
            orig_ctx: a.yarn_orig_ctx.or(prev.and_then(|p| p.orig_ctx)),
        });
    }
    s.validate("").map_err(|e| Fail::Bad(e.to_string()))?;
    Ok(s)
}

fn plan(a: &PlanArgs) -> Result<ExitCode, Fail> {
    let hw = a.hardware.as_ref().ok_or_else(|| {
        Fail::Bad(
            "--hardware PROBE.toml is required (see plans/hardware/ or `strata-plan --help`)"
                .into(),
        )
    })?;
    let model_path = a.model.as_ref().ok_or_else(|| {
        Fail::Bad("--model PATH is required: a descriptor .toml (plans/models/), a .gguf file or a safetensors folder".into())
    })?;
    let probe = HardwareProbe::from_file(hw).map_err(|e| Fail::Bad(e.to_string()))?;
    let s = settings(a)?;
    let (inventory, mtp_file) =
        strata_plan::model::load_model_with_mtp(model_path, a.mtp_model.as_deref())
            .map_err(Fail::Bad)?;
    let profile = match &s.expert_profile {
        Some(p) => Some(
            strata_schemas::profile::read_profile(std::path::Path::new(p))
                .map_err(|e| Fail::Bad(e.to_string()))?,
        ),
        None => None,
    };
    let vision = match &s.vision {
        None => None,
        Some(None) => inventory.vision.clone(),
        Some(Some(path)) => {
            Some(strata_plan::model::load_vision(std::path::Path::new(path)).map_err(Fail::Bad)?)
        }
    };
    let req = PlanRequest {
        inventory: &inventory,
        model_source: model_path.display().to_string(),
        probe: &probe,
        probe_source: hw.display().to_string(),
        settings: &s,
        profile: profile.as_ref(),
        vision: vision.as_ref(),
        mtp_file,
    };
    let outcome = solve(&req).map_err(|e| Fail::Bad(e.to_string()))?;
    match outcome {
        Outcome::Infeasible(inf) => {
            match a.format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&report::infeasible_json(&inf))
                        .expect("JSON value prints")
                ),
                Format::Text => print!("{}", for_terminal(&report::infeasible_text(&inf))),
            }
            Ok(ExitCode::from(2))
        }
        Outcome::Planned(plan) => {
            let run = runnable(&plan);
            let refuse = a.strict && (!plan.degradations.is_empty() || !run.any());
            if let (Some(out), false) = (&a.output, refuse) {
                strata_schemas::planfile::write_plan(&plan, out)
                    .map_err(|e| Fail::Bad(format!("cannot write plan {}: {e}", out.display())))?;
            }
            match a.format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&report::plan_json(&plan))
                        .expect("JSON value prints")
                ),
                Format::Text => {
                    print!("{}", for_terminal(&report::plan_text(&plan)));
                    if let (Some(out), false) = (&a.output, refuse) {
                        println!(
                            "\n  plan written to {}",
                            for_terminal(&out.display().to_string())
                        );
                    }
                }
            }
            if refuse {
                if !plan.degradations.is_empty() {
                    eprintln!(
                        "strata-plan: --strict: the plan is degraded ({}); no plan written, exit 3",
                        plan.degradations
                            .iter()
                            .map(|d| d.what.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
                if !run.any() {
                    eprintln!("strata-plan: --strict: no backend of this build's strata-exec runs the plan; no plan written, exit 3");
                    for (b, v) in &run.0 {
                        if let Err(why) = v {
                            eprintln!("  {}: {}", b.as_str(), for_terminal(&why.join("; ")));
                        }
                    }
                }
                return Ok(ExitCode::from(3));
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
