//! `strata-exec bench PLAN`: prefill and decode tokens/s of a plan, like llama-bench (mean ±
//! sd over repetitions after one warm-up), plus device memory used versus planned.
//! Beside every figure it prints what the plan predicts for the same run (its cost model,
//! evaluated at this prompt length, batch 1 and these contexts) and measured / predicted.
//! Invariant: measures only; the engine is started exactly as `strata-exec PLAN` starts it,
//! and every timed step includes bringing the logits back to the host.

use super::{backend_for, fail, open_plan, Backend, PlanArgs};
use std::path::PathBuf;
use std::time::Instant;
use strata_exec::engine::{Engine, EngineStats};
use strata_exec::sampler::{Sampler, SamplingParams};

#[derive(clap::Args, Debug, Clone)]
#[command(
    after_help = "Example:\n  strata-exec bench h200.plan -p 512 -n 128 -r 3\nPrompt tokens are pseudo-random ids; decode feeds back the argmax token (batch 1, slot 0),\nor with --temperature a token drawn as `strata-exec run` and the server draw it (on the\ndevice where the engine can), e.g.\n  strata-exec bench h200.plan -p 512 -n 128 --temperature 0.8 --top-k 40 --top-p 0.95"
)]
pub struct BenchArgs {
    /// The plan file written by strata-plan.
    pub plan: PathBuf,
    #[command(flatten)]
    pub common: PlanArgs,
    /// Prompt tokens prefilled per repetition (in the plan's ubatch chunks); 0 skips.
    #[arg(short = 'p', long, default_value_t = 512)]
    pub prompt: usize,
    /// Tokens decoded per repetition, after the prompt; 0 skips.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions (each on a fresh context).
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
    /// Output: text (a table) or json (one object).
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
}

/// Expert-cache counters of the timed repetitions (warm-up excluded).
#[derive(Debug, Clone, Copy, PartialEq)]
struct ExpertCounts {
    reps: usize,
    hits: u64,
    misses_streamed: u64,
    /// Misses computed on the CPU from host memory (the hybrid path; none in this build).
    misses_cpu: u64,
    bytes_streamed: u64,
    predicted_hit_rate: f64,
}

impl ExpertCounts {
    fn between(a: &EngineStats, b: &EngineStats, reps: usize, predicted_hit_rate: f64) -> Self {
        Self {
            reps,
            hits: b.expert_hits.saturating_sub(a.expert_hits),
            misses_streamed: b.expert_misses.saturating_sub(a.expert_misses),
            misses_cpu: 0,
            bytes_streamed: b
                .expert_bytes_streamed
                .saturating_sub(a.expert_bytes_streamed),
            predicted_hit_rate,
        }
    }

    /// Hits over lookups (None without lookups: every expert read in place).
    fn hit_rate(&self) -> Option<f64> {
        let all = self.hits + self.misses_streamed + self.misses_cpu;
        (all > 0).then(|| self.hits as f64 / all as f64)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "reps": self.reps,
            "hits": self.hits,
            "misses_streamed": self.misses_streamed,
            "misses_cpu": self.misses_cpu,
            "bytes_streamed": self.bytes_streamed,
            "hit_rate": self.hit_rate(),
            "predicted_hit_rate": self.predicted_hit_rate,
        })
    }

    fn text(&self) -> String {
        let per = |x: u64| x as f64 / self.reps.max(1) as f64;
        match self.hit_rate() {
            None => format!(
                "experts: every expert read in place (no cache lookups); the plan predicts a hit rate of {:.3}",
                self.predicted_hit_rate
            ),
            Some(r) => format!(
                "experts per rep: {:.0} hits, {:.0} misses streamed ({:.1} MiB host -> device), {:.0} computed on the CPU; hit rate {r:.3}, the plan predicts {:.3}",
                per(self.hits),
                per(self.misses_streamed),
                per(self.bytes_streamed) / (1u64 << 20) as f64,
                per(self.misses_cpu),
                self.predicted_hit_rate
            ),
        }
    }
}

/// The plan's predicted tok/s for this run: (prefill of `p` tokens in `ubatch` passes, `n`
/// greedy decode steps of one slot after them).
fn predicted(plan: &strata_schemas::plan::Plan, p: usize, n: usize, ubatch: usize) -> (f64, f64) {
    let p = p.max(1) as u64;
    let pp = plan.prefill_seconds(p, ubatch as u64);
    let tg: f64 = (0..n as u64)
        .map(|i| plan.decode_step_seconds(1, p + i))
        .sum();
    let rate = |tokens: f64, s: f64| if s > 0.0 { tokens / s } else { 0.0 };
    (rate(p as f64, pp), rate(n as f64, tg))
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, var.sqrt())
}

/// One repetition: prefill `p` tokens, then decode `n` (greedy, or drawn with `sampling`'s
/// temperature); returns (prefill tok/s, decode tok/s).
fn rep(
    e: &mut dyn Engine,
    p: usize,
    n: usize,
    seed: u64,
    sampling: SamplingParams,
) -> Result<(f64, f64), String> {
    let info = e.info().clone();
    e.reset_slot(0);
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let prompt: Vec<u32> = (0..p.max(1))
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % info.n_vocab as u64) as u32
        })
        .collect();
    let t0 = Instant::now();
    let mut last = 0u32;
    for (i, chunk) in prompt.chunks(info.ubatch).enumerate() {
        let want = (i + 1) * info.ubatch >= prompt.len();
        if let Some(l) = e.prefill(0, chunk, want).map_err(|e| e.to_string())? {
            last = strata_exec::sampler::argmax(l);
        }
    }
    let pp = prompt.len() as f64 / t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut next = [0u32];
    let mut sampler = Sampler::new(SamplingParams { seed, ..sampling });
    for _ in 0..n {
        // Picked by the engine (on the device where it can).
        if sampling.temperature > 0.0 {
            e.decode_sample(&[(0, last)], &[sampler.next_draw()], &mut next)
        } else {
            e.decode_greedy(&[(0, last)], &mut next)
        }
        .map_err(|e| e.to_string())?;
        last = next[0];
    }
    let tg = n as f64 / t1.elapsed().as_secs_f64().max(1e-12);
    Ok((pp, tg))
}

/// The decode row's suffix naming its sampling (empty for greedy).
fn sampled_label(s: &SamplingParams) -> String {
    if s.temperature <= 0.0 {
        return String::new();
    }
    let mut l = format!(" T{}", s.temperature);
    if s.top_k > 0 {
        l += &format!(" top-k {}", s.top_k);
    }
    if s.top_p < 1.0 {
        l += &format!(" top-p {}", s.top_p);
    }
    l
}

pub fn main(args: BenchArgs) {
    if args.temperature.is_nan() || args.temperature < 0.0 || !(0.0..=1.0).contains(&args.top_p) {
        fail(format!(
            "--temperature {} / --top-p {}: the temperature must be >= 0 and top-p in [0, 1]",
            args.temperature, args.top_p
        ));
    }
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: 0,
    };
    let (plan, model) = open_plan(&args.plan, &args.common);
    let ctx = plan.serve.max_context as usize;
    if args.prompt + args.n_gen >= ctx {
        fail(format!(
            "-p {} plus -n {} do not fit the plan's context of {ctx} cells: lower them or re-plan with a larger --max-context",
            args.prompt, args.n_gen
        ));
    }
    let backend = backend_for(&plan, &args.common);
    // (Only the CUDA engine takes the opened model here; the others open it themselves.)
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let host = strata_exec::load::open_model(&model).unwrap_or_else(|e| fail(e));
    let t_load = Instant::now();
    // Per GPU in use: (ordinal, planned arena bytes on it, bytes in use on it).
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut memory: Option<Vec<(usize, u64, u64)>> = None;
    let mut engine: Box<dyn Engine> = match backend {
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            let e = super::start_cuda_engine(&plan, host, &args.common).unwrap_or_else(|e| fail(e));
            eprintln!(
                "strata-exec bench: prefill in passes of up to {} tokens ({})",
                e.pass_tokens(),
                if e.grouped_prefill() {
                    "tensor-core products"
                } else {
                    "matrix-vector kernels"
                }
            );
            let links = e.handoffs();
            if !links.is_empty() {
                eprintln!(
                    "strata-exec bench: {} stages, hand-offs: {}",
                    links.len() + 1,
                    links.join(", ")
                );
            }
            for (i, ((gpu, bytes), dp)) in e.arenas().iter().zip(&plan.devices).enumerate() {
                eprintln!(
                    "strata-exec bench: planned device {i} (index {}) on GPU {gpu}: arena {bytes} bytes allocated, {} planned",
                    dp.index, dp.arena_bytes
                );
            }
            memory = Some(e.device_memory().unwrap_or_else(|e| fail(e)));
            Box::new(e)
        }
        _ => super::start_engine(&plan, &model, &args.common),
    };
    let load_s = t_load.elapsed().as_secs_f64();
    eprintln!("strata-exec bench: loaded in {load_s:.1} s; warming up");
    // Warm-up: compiles nothing new but fills caches and captures the batch-1 decode graph.
    let warm_p = args.prompt.min(engine.info().ubatch);
    if let Err(e) = rep(engine.as_mut(), warm_p, 4.min(args.n_gen), 99, sampling) {
        eprintln!("strata-exec: {e}");
        std::process::exit(2);
    }
    let stats0 = engine.stats();
    let mut pps = Vec::new();
    let mut tgs = Vec::new();
    for r in 0..args.reps.max(1) {
        match rep(engine.as_mut(), args.prompt, args.n_gen, r as u64, sampling) {
            Ok((pp, tg)) => {
                eprintln!(
                    "  rep {}: pp{} {pp:.1} tok/s, tg{} {tg:.1} tok/s",
                    r + 1,
                    args.prompt,
                    args.n_gen
                );
                pps.push(pp);
                tgs.push(tg);
            }
            Err(e) => {
                eprintln!("strata-exec: {e}");
                std::process::exit(2);
            }
        }
    }
    let stats1 = engine.stats();
    let xc = ExpertCounts::between(&stats0, &stats1, pps.len(), plan.predicted.expert_hit_rate);
    let (pm, ps) = mean_sd(&pps);
    let (tm, ts) = mean_sd(&tgs);
    let name = engine.info().model_name.clone();
    let (pred_pp, pred_tg) = predicted(&plan, args.prompt, args.n_gen, engine.info().ubatch);
    let ratio = |m: f64, p: f64| if p > 0.0 { m / p } else { 0.0 };
    let guessed = plan.predicted.guessed;
    let backend_s = match backend {
        Backend::Cuda => "cuda",
        _ => "cpu",
    };
    if args.format == "json" {
        let mut j = serde_json::json!({
            "model": name,
            "backend": backend_s,
            "load_s": load_s,
            "prompt_tokens": args.prompt,
            "gen_tokens": args.n_gen,
            "reps": pps.len(),
            "prefill_tok_s": {"mean": pm, "sd": ps, "all": pps},
            "decode_tok_s": {"mean": tm, "sd": ts, "all": tgs},
            "decode_sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p},
            "allocated_bytes": engine.allocated_bytes(),
            "predicted": {
                "prefill_tok_s": pred_pp,
                "decode_tok_s": pred_tg,
                "prefill_measured_over_predicted": ratio(pm, pred_pp),
                "decode_measured_over_predicted": ratio(tm, pred_tg),
                "guessed": guessed,
                "basis": plan.predicted.basis,
            },
        });
        j["experts"] = xc.json();
        if let Some(m) = &memory {
            j["device_memory"] = m
                .iter()
                .map(|(gpu, planned, used)| {
                    serde_json::json!({"gpu": gpu, "planned_arenas": planned, "used": used})
                })
                .collect();
        }
        println!("{j}");
    } else {
        println!("| model | backend | test | t/s | plan predicts t/s | measured / predicted |");
        println!("| --- | --- | --- | --- | --- | --- |");
        if args.prompt > 0 {
            println!(
                "| {name} | {backend_s} | pp{} | {pm:.2} ± {ps:.2} | {pred_pp:.2} | {:.2} |",
                args.prompt,
                ratio(pm, pred_pp)
            );
        }
        if args.n_gen > 0 {
            println!(
                "| {name} | {backend_s} | tg{}{} | {tm:.2} ± {ts:.2} | {pred_tg:.2} | {:.2} |",
                args.n_gen,
                sampled_label(&sampling),
                ratio(tm, pred_tg)
            );
        }
        println!("{}", xc.text());
        if guessed {
            println!("predictions: guesses (the plan's probe has no measured [device.cost] coefficients; `strata-exec probe` measures them)");
        }
        if let Some(m) = &memory {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
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
                engine.allocated_bytes() as f64 / (1u64 << 30) as f64
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_counts_are_the_timed_reps_difference() {
        let a = EngineStats {
            expert_hits: 10,
            expert_misses: 4,
            expert_bytes_streamed: 1 << 20,
            kv_cells_in_use: vec![],
        };
        let b = EngineStats {
            expert_hits: 40,
            expert_misses: 14,
            expert_bytes_streamed: 5 << 20,
            kv_cells_in_use: vec![3],
        };
        let c = ExpertCounts::between(&a, &b, 2, 0.5);
        assert_eq!(
            (c.hits, c.misses_streamed, c.bytes_streamed),
            (30, 10, 4 << 20)
        );
        assert_eq!(c.hit_rate(), Some(0.75));
        let t = c.text();
        assert!(
            t.contains("15 hits") && t.contains("5 misses") && t.contains("2.0 MiB"),
            "{t}"
        );
        assert_eq!(c.json()["hit_rate"], 0.75);
        let none = ExpertCounts::between(&a, &a, 1, 0.9);
        assert_eq!(none.hit_rate(), None);
        assert!(none.text().contains("in place"));
    }
}
