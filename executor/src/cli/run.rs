//! `strata-exec PLAN`: generate from a prompt (text through the model's tokenizer, or token
//! ids) once and print the tokens and their text (text or JSON).
//! With a plan that speculates (`--mtp --spec N`) runs decode by MTP speculative steps: greedy
//! ones give the tokens of plain greedy decoding, sampled ones the same distribution; `--spec-oracle` (a test mode) first decodes
//! without speculation, then again with every draft forced to that run's tokens.
//! Invariant: the prompt is tokenized and checked against the vocabulary and the planned
//! context before the first token is computed; the run itself allocates nothing per token.

use super::{fail, open_plan, start_engine, PlanArgs};
use std::path::{Path, PathBuf};
use std::time::Instant;
use strata_exec::engine::{Engine, EngineError, EngineInfo};
use strata_exec::sampler::{non_finite_message, Sampler, SamplingParams, NON_FINITE};
use strata_exec::tokenizer::Tokenizer;

#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// The plan file written by strata-plan.
    #[arg(required = true)]
    pub plan: Option<PathBuf>,
    #[command(flatten)]
    pub common: PlanArgs,
    /// Prompt text, tokenized with the model's tokenizer (tokenizer.json in the model
    /// folder, or the vocabulary embedded in the GGUF) or --tokenizer.
    #[arg(long, conflicts_with = "prompt_tokens")]
    pub prompt: Option<String>,
    /// A tokenizer.json (or a folder holding one) to use instead of the model's own.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Keep generating after an end-of-sequence token (EOS or an end-of-turn token of the
    /// tokenizer) instead of stopping there.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Prompt as token ids, e.g. 1,17,42.
    #[arg(long, value_delimiter = ',')]
    pub prompt_tokens: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 16)]
    pub n: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// 1 = off.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output: text or json.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
    /// With --format json: add "prompt_logits", one row of vocabulary logits per prompt
    /// position.
    #[arg(long)]
    pub logits: bool,
    /// Test mode for a plan that speculates: decode once without speculation, then again with
    /// the MTP drafts forced to that run's tokens (every draft agrees), and report both
    /// decode speeds; greedy only.
    #[arg(long, hide = true)]
    pub spec_oracle: bool,
    #[command(flatten)]
    pub serve: super::serve::ServeArgs,
}

/// What one run produced: the generated ids, the prompt's logit rows (when asked for) and
/// the prefill and decode times.
struct Generated {
    out: Vec<u32>,
    rows: Vec<f32>,
    prefill_s: f64,
    decode_s: f64,
    /// `--spec-oracle`: the run without speculation (its tokens are the forced drafts).
    reference: Option<Box<Generated>>,
}

/// How a run decodes.
#[derive(Clone, Copy)]
enum Decoding<'a> {
    /// One token per step.
    Plain,
    /// MTP speculative steps (greedy), drafts forced to `forced`'s tokens when given.
    Speculative { forced: Option<&'a [u32]> },
}

pub fn main(cli: RunArgs) {
    let plan_path = cli.plan.clone().unwrap_or_else(|| fail("give a plan file"));
    let (plan, model_path) = open_plan(&plan_path, &cli.common);
    let tokenizer = load_tokenizer(&cli, &model_path);
    let prompt = prompt_ids(&cli, tokenizer.as_ref(), &model_path);
    let t0 = Instant::now();
    let mut engine = start_engine(&plan, &model_path, &cli.common);
    let load_s = t0.elapsed().as_secs_f64();
    let info = engine.info().clone();
    check_prompt(&cli, &prompt, &info);
    let eos: &[u32] = match (&tokenizer, cli.ignore_eos) {
        (Some(t), false) => t.eos_ids(),
        _ => &[],
    };
    let greedy = cli.temperature <= 0.0;
    if cli.spec_oracle && (engine.spec_tokens() == 0 || !greedy) {
        fail("--spec-oracle needs a plan that speculates (strata-plan --mtp --spec N) and greedy decoding (--temperature 0)");
    }
    let run = |engine: &mut dyn Engine| -> Result<Generated, EngineError> {
        if cli.spec_oracle {
            let reference = generate(&cli, engine, &prompt, eos, Decoding::Plain)?;
            engine.reset_slot(0);
            let forced = Some(&reference.out[..]);
            let mut g = generate(&cli, engine, &prompt, eos, Decoding::Speculative { forced })?;
            g.reference = Some(Box::new(reference));
            return Ok(g);
        }
        let mode = if engine.spec_tokens() > 0 {
            Decoding::Speculative { forced: None }
        } else {
            Decoding::Plain
        };
        generate(&cli, engine, &prompt, eos, mode)
    };
    let g = match run(engine.as_mut()) {
        Ok(v) => v,
        Err(e) => {
            eprintln!(
                "strata-exec: {}",
                strata_schemas::text::for_terminal(&e.to_string())
            );
            std::process::exit(2)
        }
    };
    report(
        &cli,
        engine.as_ref(),
        tokenizer.as_ref(),
        &prompt,
        eos,
        &g,
        load_s,
    );
}

/// The prompt as token ids: `--prompt` through the tokenizer, or `--prompt-tokens`.
fn prompt_ids(cli: &RunArgs, tokenizer: Option<&Tokenizer>, model: &Path) -> Vec<u32> {
    match (&cli.prompt, &cli.prompt_tokens) {
        (Some(text), _) => {
            let tok = tokenizer.unwrap_or_else(|| fail(no_tokenizer(model)));
            let ids = tok
                .encode(text, true)
                .unwrap_or_else(|e| fail(format!("--prompt: {e}")));
            if ids.is_empty() {
                fail("--prompt: the text gives no tokens; give a non-empty prompt");
            }
            ids
        }
        (None, Some(t)) if !t.is_empty() => t.clone(),
        _ => fail("give a prompt: --prompt TEXT or --prompt-tokens 1,17,42"),
    }
}

/// Exit 1 unless every prompt token is in the model's vocabulary and the prompt leaves room
/// in the planned context.
fn check_prompt(cli: &RunArgs, prompt: &[u32], info: &EngineInfo) {
    if let Some(bad) = prompt.iter().find(|t| **t as usize >= info.n_vocab) {
        fail(format!(
            "{}: token {bad} is outside the model's vocabulary of {}",
            if cli.prompt.is_some() {
                "--prompt (the tokenizer has more tokens than the model)"
            } else {
                "--prompt-tokens"
            },
            info.n_vocab
        ));
    }
    if prompt.len() as u64 >= info.max_context {
        fail(format!(
            "the prompt has {} tokens but the plan's context is {} cells: re-plan with a larger --max-context",
            prompt.len(),
            info.max_context
        ));
    }
}

/// Prefill the prompt in slot 0 (in `ubatch` chunks), then draw up to `-n` tokens, stopping
/// after an end-of-sequence id in `eos`.
fn generate(
    cli: &RunArgs,
    engine: &mut dyn Engine,
    prompt: &[u32],
    eos: &[u32],
    mode: Decoding,
) -> Result<Generated, EngineError> {
    let info = engine.info().clone();
    let n = cli.n.min((info.max_context - prompt.len() as u64) as usize);
    let params = SamplingParams {
        temperature: cli.temperature,
        top_k: cli.top_k,
        top_p: cli.top_p,
        seed: cli.seed,
    };
    let want_rows = cli.logits && cli.format == "json";
    // Run on a rayon worker so the parallel ops start without going through the pool's
    // injector queue (which allocates).
    rayon::scope(|_| {
        let mut sampler = Sampler::new(params);
        let mut rows: Vec<f32> = Vec::new();
        let mut last: Vec<f32> = vec![0.0; info.n_vocab];
        let tp = Instant::now();
        for chunk in prompt.chunks(info.ubatch) {
            if want_rows {
                let l = engine.prefill_all(0, chunk)?;
                rows.extend_from_slice(l);
                last.copy_from_slice(&l[l.len() - info.n_vocab..]);
            } else if let Some(l) = engine.prefill(0, chunk, true)? {
                last.copy_from_slice(l);
            }
        }
        let prefill_s = tp.elapsed().as_secs_f64();
        let mut out = Vec::with_capacity(n);
        let td = Instant::now();
        let broken = |at: String| EngineError::Request(non_finite_message(&at));
        if n > 0 {
            let mut next = sampler.sample(&last);
            if next == NON_FINITE {
                return Err(broken("the last prompt position".into()));
            }
            out.push(next);
            let mut tok = vec![0u32; engine.spec_tokens() + 1];
            while out.len() < n && !eos.contains(&next) {
                let got = match mode {
                    Decoding::Plain => {
                        let draw = [sampler.next_draw()];
                        engine.decode_sample(&[(0, next)], &draw, &mut tok[..1])?;
                        1
                    }
                    Decoding::Speculative { forced } => {
                        // The drafts forced for the next positions (a test mode).
                        let f = forced.map(|f| &f[out.len().min(f.len())..]);
                        let draw = sampler.next_draw();
                        if draw.is_greedy() {
                            engine.decode_spec_greedy(0, next, f, &mut tok)?
                        } else {
                            engine.decode_spec_sample(0, next, &draw, f, &mut tok)?
                        }
                    }
                };
                for &t in &tok[..got] {
                    if t == NON_FINITE {
                        return Err(broken(format!("generated token {}", out.len() + 1)));
                    }
                    if out.len() < n && !eos.contains(&next) {
                        out.push(t);
                        next = t;
                    }
                }
            }
        }
        let decode_s = td.elapsed().as_secs_f64();
        Ok(Generated {
            out,
            rows,
            prefill_s,
            decode_s,
            reference: None,
        })
    })
}

/// Print the run: JSON (`--format json`) or the text on stdout and a summary on stderr.
fn report(
    cli: &RunArgs,
    engine: &dyn Engine,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    eos: &[u32],
    g: &Generated,
    load_s: f64,
) {
    let stats = engine.stats();
    let out = &g.out;
    // Decode steps = generated tokens after the first (which comes from the prefill).
    let decode_steps = out.len().saturating_sub(1);
    let prefill_tps = prompt.len() as f64 / g.prefill_s.max(1e-9);
    let decode_tps = decode_steps as f64 / g.decode_s.max(1e-9);
    let stopped_at_eos = out.last().is_some_and(|t| eos.contains(t));
    // The generated text without special tokens (the EOS that ended it is not shown).
    let text: Option<String> = tokenizer.map(|t| {
        t.decode(out, true)
            .unwrap_or_else(|e| fail(format!("decoding the generated tokens: {e}")))
    });
    if cli.format == "json" {
        let mut j = serde_json::json!({
            "generated_token_ids": out,
            "text": text,
            "stop": if stopped_at_eos { "eos" } else { "length" },
            "prompt_tokens": prompt.len(),
            "timings": {
                "load_s": load_s,
                "prefill_tok_s": prefill_tps,
                "decode_tok_s": decode_tps,
            },
            "expert_cache": {"hits": stats.expert_hits, "misses": stats.expert_misses},
            "allocations": engine.allocations(),
            "allocated_bytes": engine.allocated_bytes(),
        });
        if engine.spec_tokens() > 0 {
            j["speculation"] = speculation_json(engine, g);
        }
        if cli.logits {
            let v = engine.info().n_vocab;
            j["prompt_logits"] =
                serde_json::Value::Array(g.rows.chunks(v).map(|r| serde_json::json!(r)).collect());
        }
        println!("{j}");
        return;
    }
    let ids = out
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    match &text {
        Some(t) => println!("{t}"),
        None => println!("{ids}"),
    }
    if cli.common.quiet {
        return;
    }
    if text.is_some() {
        eprintln!("strata-exec: generated token ids {ids}");
    }
    if stopped_at_eos {
        eprintln!("strata-exec: stopped at an end-of-sequence token (--ignore-eos to go on)");
    }
    eprintln!(
        "strata-exec: {} prompt tokens at {prefill_tps:.1} tok/s, {decode_steps} decode steps at {decode_tps:.1} tok/s; expert cache {} hits / {} misses; {} allocations ({} bytes); loaded in {load_s:.2} s",
        prompt.len(),
        stats.expert_hits,
        stats.expert_misses,
        engine.allocations(),
        engine.allocated_bytes()
    );
    if engine.spec_tokens() > 0 {
        let s = stats.speculation;
        eprintln!(
            "strata-exec: speculation (--spec {}): {} steps, {} of {} drafts accepted",
            engine.spec_tokens(),
            s.steps,
            s.accepted,
            s.drafted
        );
    }
}

/// The `speculation` object of `run --format json`: the plan's drafts per step, the steps,
/// drafted and accepted counts since start-up; with `--spec-oracle` the reference run's
/// decode speed and whether its tokens equal the speculative run's.
fn speculation_json(engine: &dyn Engine, g: &Generated) -> serde_json::Value {
    let s = engine.stats().speculation;
    let mut j = serde_json::json!({
        "spec": engine.spec_tokens(),
        "steps": s.steps,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "acceptance": s.accepted as f64 / (s.drafted as f64).max(1.0),
        "accepted_per_step": s.accepted as f64 / (s.steps as f64).max(1.0),
    });
    if let Some(r) = &g.reference {
        let steps = r.out.len().saturating_sub(1) as f64;
        j["oracle"] = serde_json::json!({
            "reference_decode_tok_s": steps / r.decode_s.max(1e-9),
            "identical": r.out == g.out,
        });
    }
    j
}

/// The tokenizer for this run: `--tokenizer PATH`, else the model's own (`None` when the
/// model carries none). A tokenizer that cannot be read is fatal when the prompt is text,
/// and a warning (no text output) when it is given as token ids.
fn load_tokenizer(cli: &RunArgs, model: &Path) -> Option<Tokenizer> {
    let got = match &cli.tokenizer {
        Some(p) => Tokenizer::from_file(p).map(Some),
        None => Tokenizer::for_model(model),
    };
    match got {
        Ok(t) => t,
        Err(e) if cli.prompt.is_some() || cli.tokenizer.is_some() => {
            fail(format!("--prompt needs a tokenizer: {e}"))
        }
        Err(e) => {
            if !cli.common.quiet {
                eprintln!("strata-exec: warning: no text output: {e}");
            }
            None
        }
    }
}

/// Why a text prompt cannot be tokenized for `model`, and what to do instead.
fn no_tokenizer(model: &Path) -> String {
    let why = if model.is_dir() {
        format!("there is no tokenizer.json in folder {}", model.display())
    } else {
        format!("GGUF {} has no tokenizer.ggml.model", model.display())
    };
    format!(
        "--prompt needs a tokenizer, but {why}: pass --tokenizer PATH (a tokenizer.json), or the prompt as token ids with --prompt-tokens 1,17,42"
    )
}
