//! `strata-exec bench PLAN`: prefill and decode tokens/s of a plan, like llama-bench (mean ±
//! sd over repetitions after one warm-up) and llama-batched-bench (`-b`: parallel sequences
//! decoding together; `-d`: a KV cache already holding DEPTH cells), one row per combination
//! of the comma lists `-p`, `-n`, `-b`, `-d`, plus device memory used versus planned.
//! Beside every figure it prints what the plan predicts for the same run (its cost model,
//! evaluated at this prompt length, batch and these contexts) and measured / predicted.
//! Invariant: measures only; the engine is started exactly as `strata-exec PLAN` starts it,
//! and every combination is checked against the plan's slots and context before loading.

mod experts;
mod measure;
mod report;

use super::{backend_for, fail, open_plan, Backend, PlanArgs};
use measure::{rep, Combo};
use report::{gib, mean_sd, params_label, ratio, sampled_label, test_label};
use std::path::PathBuf;
use std::time::Instant;
use strata_exec::engine::Engine;
use strata_exec::sampler::SamplingParams;

#[derive(clap::Args, Debug, Clone)]
#[command(
    after_help = "Examples:\n  strata-exec bench h200.plan -p 512 -n 128 -r 3\n  strata-exec bench h200.plan -p 512 -n 128 -b 1,2,4 -d 0,4096\nPrompt tokens are pseudo-random ids; decode feeds back the argmax token, or with\n--temperature a token drawn as `strata-exec run` and the server draw it (on the device\nwhere the engine can), e.g.\n  strata-exec bench h200.plan -p 512 -n 128 --temperature 0.8 --top-k 40 --top-p 0.95\nEvery combination of -p, -n, -b and -d is one pp row and one tg row (one JSON line)."
)]
pub struct BenchArgs {
    /// The plan file written by strata-plan.
    pub plan: PathBuf,
    #[command(flatten)]
    pub common: PlanArgs,
    /// Prompt tokens prefilled per sequence (in the plan's ubatch chunks), comma list; 0 skips
    /// the pp row.
    #[arg(short = 'p', long, value_delimiter = ',', default_value = "512")]
    pub prompt: Vec<usize>,
    /// Tokens decoded per sequence after the prompt, comma list; 0 skips the tg row.
    #[arg(short = 'n', long, value_delimiter = ',', default_value = "128")]
    pub n_gen: Vec<usize>,
    /// Parallel sequences, comma list: each prefills -p tokens in its own slot, then all
    /// decode -n steps together; at most the plan's slots (strata-plan --batch).
    #[arg(short = 'b', long, value_delimiter = ',', default_value = "1")]
    pub batch: Vec<usize>,
    /// Cells already in each sequence's KV cache before the timed prefill and decode (filled
    /// untimed), comma list, like llama-bench -d.
    #[arg(short = 'd', long, value_delimiter = ',', default_value = "0")]
    pub depth: Vec<usize>,
    /// Repetitions (each on fresh contexts).
    #[arg(short = 'r', long, default_value_t = 3)]
    pub reps: usize,
    /// Decode draws its tokens with this temperature (0 = greedy, the default).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// With --temperature: keep the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// With --temperature: keep the smallest set of likeliest tokens holding P of the mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Output: text (a table; with -q nothing else) or json (one object per combination,
    /// one per line).
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
}

/// The plan's predicted tok/s for `c`: (prefill of one sequence's prompt in `ubatch` passes,
/// `n_gen` decode steps of `batch` slots after depth + prompt cells, all sequences together).
fn predicted(plan: &strata_schemas::plan::Plan, c: &Combo, ubatch: usize) -> (f64, f64) {
    let p = c.prompt.max(1) as u64;
    let pp = plan.prefill_seconds(p, ubatch as u64);
    let start = (c.depth as u64) + p;
    let tg: f64 = (0..c.n_gen as u64)
        .map(|i| plan.decode_step_seconds(c.batch as u32, start + i))
        .sum();
    let rate = |tokens: f64, s: f64| if s > 0.0 { tokens / s } else { 0.0 };
    (rate(p as f64, pp), rate((c.n_gen * c.batch) as f64, tg))
}

/// `plan` with each GPU device's miss policy and KV host policy as `policy` and `kv_host`
/// say (its prediction then prices them): stream none on the CPU, cpu every miss (or every
/// spilled cell), auto the plan's own.
fn with_miss_policy(
    plan: &strata_schemas::plan::Plan,
    policy: super::MissPolicyArg,
    kv_host: super::KvHostArg,
) -> strata_schemas::plan::Plan {
    let mut p = plan.clone();
    for d in p.devices.iter_mut().filter(|d| d.vendor != "cpu") {
        d.cost.kv_host_cpu = match kv_host {
            super::KvHostArg::Auto => d.cost.kv_host_cpu,
            super::KvHostArg::Stream => false,
            super::KvHostArg::Cpu => true,
        };
        d.cost.cpu_misses_per_token = match policy {
            super::MissPolicyArg::Auto => d.cost.cpu_misses_per_token,
            super::MissPolicyArg::Stream => 0,
            super::MissPolicyArg::Cpu => d.cost.n_expert_used,
        };
    }
    p
}

/// Every combination of the lists, in llama-bench's order (prompt, then generation, then
/// batch, then depth), after checking each fits the plan's slots and context.
fn combos(args: &BenchArgs, slots: usize, ctx: usize) -> Result<Vec<Combo>, String> {
    let mut out = Vec::new();
    for &prompt in &args.prompt {
        for &n_gen in &args.n_gen {
            for &batch in &args.batch {
                for &depth in &args.depth {
                    let c = Combo {
                        prompt,
                        n_gen,
                        batch,
                        depth,
                    };
                    if batch == 0 || batch > slots {
                        return Err(format!(
                            "-b {batch}: the plan has {slots} slot(s): pass -b between 1 and {slots}, or re-plan with strata-plan --batch {}",
                            batch.max(1)
                        ));
                    }
                    if c.cells() > ctx {
                        return Err(format!(
                            "-d {depth} plus -p {prompt} plus -n {n_gen} need {} cells per sequence, more than the plan's context of {ctx}: lower them or re-plan with a larger --max-context",
                            c.cells()
                        ));
                    }
                    out.push(c);
                }
            }
        }
    }
    Ok(out)
}

/// Per GPU in use: (ordinal, planned arena bytes on it, bytes in use on it).
type DeviceMemory = Vec<(usize, u64, u64)>;

/// What every row of a run repeats: the model, its size and where it ran.
struct Lead {
    name: String,
    model_file: String,
    size_bytes: u64,
    params: u64,
    backend_s: &'static str,
    load_s: f64,
}

/// The rates of every repetition of one combination.
#[derive(Default)]
struct Rates {
    pps: Vec<f64>,
    tgs: Vec<f64>,
    seqs: Vec<f64>,
    /// Expert bytes over PCIe in all the prefills and all the decode steps.
    pp_streamed: u64,
    tg_streamed: u64,
}

pub fn main(args: BenchArgs) {
    if args.temperature.is_nan() || args.temperature < 0.0 || !(0.0..=1.0).contains(&args.top_p) {
        fail(format!(
            "--temperature {} / --top-p {}: the temperature must be >= 0 and top-p in [0, 1]",
            args.temperature, args.top_p
        ));
    }
    let quiet = args.common.quiet;
    let say = |m: String| {
        if !quiet {
            eprintln!("{m}");
        }
    };
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: 0,
    };
    let (plan, model) = open_plan(&args.plan, &args.common);
    // The prediction of the miss policy this run uses (`--miss-policy` may override the plan's).
    let forced = with_miss_policy(&plan, args.common.miss_policy, args.common.kv_host);
    let combos = combos(
        &args,
        plan.serve.batch as usize,
        plan.serve.max_context as usize,
    )
    .unwrap_or_else(|e| fail(e));
    let backend = backend_for(&plan, &args.common);
    // (Only the CUDA engine takes the opened model here; the others open it themselves.)
    let host = strata_exec::load::open_planned(&plan, &model, args.common.mtp_model.as_deref())
        .unwrap_or_else(|e| fail(e));
    let size_bytes: u64 = host.inventory().tensors.iter().map(|t| t.bytes).sum();
    let params: u64 = host
        .inventory()
        .tensors
        .iter()
        .map(|t| t.dims.iter().product::<u64>())
        .sum();
    let model_file = model
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| model.display().to_string());
    let t_load = Instant::now();
    let (mut engine, memory) = start(backend, &plan, host, &model, &args.common, &say);
    let load_s = t_load.elapsed().as_secs_f64();
    say(format!(
        "strata-exec bench: loaded in {load_s:.1} s; warming up"
    ));
    let lead = Lead {
        name: engine.info().model_name.clone(),
        model_file,
        size_bytes,
        params,
        backend_s: match backend {
            Backend::Cuda => "cuda",
            _ => "cpu",
        },
        load_s,
    };
    let ubatch = engine.info().ubatch;
    if args.format == "text" {
        println!("{}", report::HEADER);
    }
    let mut warmed = std::collections::HashSet::new();
    let mut expert_lines = Vec::new();
    for c in &combos {
        // Warm-up, once per batch size: compiles nothing new but fills caches and captures
        // this batch's decode graph.
        if warmed.insert(c.batch) {
            warm_up(engine.as_mut(), c, ubatch, sampling);
        }
        let stats0 = engine.stats();
        let rates = repetitions(engine.as_mut(), c, args.reps, sampling, &say);
        let xc = experts::ExpertCounts::between(
            &stats0,
            &engine.stats(),
            rates.pps.len(),
            plan.predicted.expert_hit_rate,
        )
        .with_pcie(rates.pp_streamed, rates.tg_streamed, c.n_gen);
        expert_lines.push(format!(
            "{}: {}",
            test_label("tg", c.n_gen, c, ""),
            xc.text()
        ));
        let (s0, s1) = (stats0.speculation, engine.stats().speculation);
        let spec = (engine.spec_tokens() > 0).then(|| {
            let (drafted, accepted) = (s1.drafted - s0.drafted, s1.accepted - s0.accepted);
            expert_lines.push(format!(
                "{}: speculation (--spec {}): {accepted} of {drafted} drafts accepted in {} steps",
                test_label("tg", c.n_gen, c, ""),
                engine.spec_tokens(),
                s1.steps - s0.steps
            ));
            serde_json::json!({
                "spec": engine.spec_tokens(),
                "steps": s1.steps - s0.steps,
                "drafted": drafted,
                "accepted": accepted,
            })
        });
        let pred = predicted(&forced, c, ubatch);
        if args.format == "json" {
            let mut j = json_row(&args, &plan, &lead, c, &rates, pred, engine.as_ref());
            j["experts"] = xc.json();
            if let Some(s) = spec {
                j["speculation"] = s;
            }
            if let Some(m) = &memory {
                j["device_memory"] = m
                    .iter()
                    .map(|(gpu, planned, used)| {
                        serde_json::json!({"gpu": gpu, "planned_arenas": planned, "used": used})
                    })
                    .collect();
            }
            println!("{j}");
            continue;
        }
        print_text_rows(&lead, c, &rates, pred, &sampling);
    }
    if args.format == "json" || quiet {
        return;
    }
    print_summary(
        &expert_lines,
        plan.predicted.guessed,
        memory.as_deref(),
        engine.as_ref(),
    );
}

/// Starts the engine for `backend` as `strata-exec PLAN` does; with the CUDA engine also
/// its device memory (the others' is not read).
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn start(
    backend: Backend,
    plan: &strata_schemas::plan::Plan,
    host: Box<dyn strata_exec::load::HostModel>,
    model: &std::path::Path,
    common: &PlanArgs,
    say: &dyn Fn(String),
) -> (Box<dyn Engine>, Option<DeviceMemory>) {
    match backend {
        #[cfg(feature = "cuda")]
        Backend::Cuda => start_cuda(plan, host, common, say),
        _ => (super::start_engine(plan, model, common), None),
    }
}

/// The CUDA engine, after saying how it prefills, its stages and its arenas.
#[cfg(feature = "cuda")]
fn start_cuda(
    plan: &strata_schemas::plan::Plan,
    host: Box<dyn strata_exec::load::HostModel>,
    common: &PlanArgs,
    say: &dyn Fn(String),
) -> (Box<dyn Engine>, Option<DeviceMemory>) {
    let e = super::start_cuda_engine(plan, host, common).unwrap_or_else(|e| fail(e));
    say(format!(
        "strata-exec bench: prefill in passes of up to {} tokens ({})",
        e.pass_tokens(),
        if e.grouped_prefill() {
            "tensor-core products"
        } else {
            "matrix-vector kernels"
        }
    ));
    let links = e.handoffs();
    if !links.is_empty() {
        say(format!(
            "strata-exec bench: {} stages, hand-offs: {}",
            links.len() + 1,
            links.join(", ")
        ));
    }
    for (i, ((gpu, bytes), dp)) in e.arenas().iter().zip(&plan.devices).enumerate() {
        say(format!(
            "strata-exec bench: planned device {i} (index {}) on GPU {gpu}: arena {bytes} bytes allocated, {} planned",
            dp.index, dp.arena_bytes
        ));
    }
    let memory = Some(e.device_memory().unwrap_or_else(|e| fail(e)));
    (Box::new(e), memory)
}

/// One untimed repetition of `c` (short prompt, a few decode steps, no depth); exits 2 on
/// an engine error.
fn warm_up(engine: &mut dyn Engine, c: &Combo, ubatch: usize, sampling: SamplingParams) {
    let warm = Combo {
        prompt: c.prompt.min(ubatch),
        n_gen: 4.min(c.n_gen),
        depth: 0,
        ..*c
    };
    if let Err(e) = rep(engine, warm, 99, sampling) {
        eprintln!("strata-exec: {e}");
        std::process::exit(2);
    }
}

/// The timed repetitions of `c` (at least one), each said as it ends; exits 2 on an engine
/// error.
fn repetitions(
    engine: &mut dyn Engine,
    c: &Combo,
    reps: usize,
    sampling: SamplingParams,
    say: &dyn Fn(String),
) -> Rates {
    let mut rates = Rates::default();
    for r in 0..reps.max(1) {
        match rep(engine, *c, r as u64, sampling) {
            Ok(s) => {
                say(format!(
                    "  rep {}: {} {:.1} tok/s, {} {:.1} tok/s ({:.1} per sequence)",
                    r + 1,
                    test_label("pp", c.prompt, c, ""),
                    s.pp,
                    test_label("tg", c.n_gen, c, ""),
                    s.tg,
                    s.tg_seq
                ));
                rates.pps.push(s.pp);
                rates.tgs.push(s.tg);
                rates.seqs.push(s.tg_seq);
                rates.pp_streamed += s.pp_streamed;
                rates.tg_streamed += s.tg_streamed;
            }
            Err(e) => {
                eprintln!("strata-exec: {e}");
                std::process::exit(2);
            }
        }
    }
    rates
}

/// One combination's JSON object, less its expert counts and device memory.
fn json_row(
    args: &BenchArgs,
    plan: &strata_schemas::plan::Plan,
    lead: &Lead,
    c: &Combo,
    rates: &Rates,
    (pred_pp, pred_tg): (f64, f64),
    engine: &dyn Engine,
) -> serde_json::Value {
    let (pm, ps) = mean_sd(&rates.pps);
    let (tm, ts) = mean_sd(&rates.tgs);
    let (sm, ss) = mean_sd(&rates.seqs);
    serde_json::json!({
        "model": lead.name,
        "model_file": lead.model_file,
        "size_bytes": lead.size_bytes,
        "params": lead.params,
        "backend": lead.backend_s,
        "load_s": lead.load_s,
        "prompt_tokens": c.prompt,
        "gen_tokens": c.n_gen,
        "batch": c.batch,
        "depth": c.depth,
        "reps": rates.pps.len(),
        "prefill_tok_s": {"mean": pm, "sd": ps, "all": rates.pps},
        "decode_tok_s": {"mean": tm, "sd": ts, "all": rates.tgs},
        "decode_tok_s_per_seq": {"mean": sm, "sd": ss, "all": rates.seqs},
        "decode_sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p},
        "allocated_bytes": engine.allocated_bytes(),
        "predicted": {
            "prefill_tok_s": pred_pp,
            "decode_tok_s": pred_tg,
            "prefill_measured_over_predicted": ratio(pm, pred_pp),
            "decode_measured_over_predicted": ratio(tm, pred_tg),
            "guessed": plan.predicted.guessed,
            "basis": plan.predicted.basis,
        },
    })
}

/// One combination's table rows: pp (with a prompt) and tg (with decode steps).
fn print_text_rows(
    lead: &Lead,
    c: &Combo,
    rates: &Rates,
    (pred_pp, pred_tg): (f64, f64),
    sampling: &SamplingParams,
) {
    let (pm, ps) = mean_sd(&rates.pps);
    let (tm, ts) = mean_sd(&rates.tgs);
    let (sm, ss) = mean_sd(&rates.seqs);
    let size_s = format!("{:.2} GiB", gib(lead.size_bytes));
    let params_s = params_label(lead.params);
    let lead = format!(
        "| {} | {size_s} | {params_s} | {}",
        lead.model_file, lead.backend_s
    );
    if c.prompt > 0 {
        // Sequences prefill one after another: per sequence is the aggregate rate.
        println!(
            "{lead} | {} | {pm:.2} ± {ps:.2} | {pm:.2} ± {ps:.2} | {pred_pp:.2} | {:.2} |",
            test_label("pp", c.prompt, c, ""),
            ratio(pm, pred_pp)
        );
    }
    if c.n_gen > 0 {
        println!(
            "{lead} | {} | {tm:.2} ± {ts:.2} | {sm:.2} ± {ss:.2} | {pred_tg:.2} | {:.2} |",
            test_label("tg", c.n_gen, c, &sampled_label(sampling)),
            ratio(tm, pred_tg)
        );
    }
}

/// The lines under the table: expert counts per combination, whether the predictions are
/// guesses, and the memory in use.
fn print_summary(
    expert_lines: &[String],
    guessed: bool,
    memory: Option<&[(usize, u64, u64)]>,
    engine: &dyn Engine,
) {
    for l in expert_lines {
        println!("{l}");
    }
    if guessed {
        println!("predictions: guesses (the plan's probe lacks measured [device.cost] coefficients or the weight types' [device.cost.types] rates; `strata-exec probe` measures them)");
    }
    if let Some(m) = memory {
        for (gpu, planned, used) in m {
            println!(
                "device memory, GPU {gpu}: {:.2} GiB used of which {:.2} GiB are the planned arenas ({:.2} GiB runtime: context, modules, graphs)",
                gib(*used),
                gib(*planned),
                gib(used.saturating_sub(*planned))
            );
        }
    } else {
        println!(
            "host arenas: {:.2} GiB allocated as planned",
            gib(engine.allocated_bytes())
        );
    }
}
