//! `strata-exec profile PLAN --prompts FILE [-o profile.txt]`: run a file of prompts (one a
//! line: text through the model's tokenizer, or comma-separated token ids) through the plan's
//! engine and write the router's picks as the routing profile `strata-plan --expert-profile`
//! reads (`schemas/PROFILE.md`), so a user can re-plan the expert cache for their workload.
//! The profile is format v2: the counts and the LRU stack distances of the references
//! (decode steps and prefill passes apart), the curve the planner predicts the hit rate from.
//! Invariant: the profile counts only picks the engine made on these prompts (prompt tokens
//! and the `-n` greedy tokens generated after each), one row per main block; a prompt that
//! cannot run stops the command with its line number before anything is written.

use super::{fail, open_plan, start_engine, PlanArgs};
use std::path::{Path, PathBuf};
use strata_exec::engine::{Engine, EngineError};
use strata_exec::tokenizer::Tokenizer;

#[derive(clap::Args, Debug, Clone)]
#[command(
    after_help = "Example:\n  strata-exec profile tiny.plan --prompts prompts.txt -o profile.txt\n  strata-plan --model MODEL --hardware probe.toml --expert-profile profile.txt --out tuned.plan\nA line of the prompts file is token ids when it is only digits, commas and spaces\n(e.g. `1,17,42`), else text; blank lines and lines starting with '#' are skipped."
)]
pub struct ProfileArgs {
    /// The plan file written by strata-plan.
    pub plan: PathBuf,
    #[command(flatten)]
    pub common: PlanArgs,
    /// The prompts, one a line.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Where to write the profile (text encoding); default: standard output.
    #[arg(short = 'o', long)]
    pub out: Option<PathBuf>,
    /// Tokens generated (greedy) after each prompt, counted too: decode routes as serving
    /// does.
    #[arg(short = 'n', long, default_value_t = 16)]
    pub n_gen: usize,
    /// A tokenizer.json (or a folder holding one) for text lines instead of the model's own.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// One line of the prompts file, before tokenizing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptLine {
    Tokens(Vec<u32>),
    Text(String),
}

/// The prompts of `text` with their 1-based line numbers: blank and `#` lines skipped, a line
/// of only digits, commas and spaces read as token ids, anything else as text.
pub fn parse_prompts(text: &str, origin: &str) -> Result<Vec<(usize, PromptLine)>, String> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_end_matches('\r');
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let is_ids = t
            .chars()
            .all(|c| c.is_ascii_digit() || c == ',' || c.is_whitespace());
        let p = if is_ids {
            let ids = t
                .split(',')
                .map(|s| s.trim().parse::<u32>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| {
                    format!(
                        "{origin}:{}: `{t}` is not a list of token ids ({e}): write ids as 1,17,42",
                        i + 1
                    )
                })?;
            PromptLine::Tokens(ids)
        } else {
            PromptLine::Text(line.to_string())
        };
        out.push((i + 1, p));
    }
    if out.is_empty() {
        return Err(format!(
            "{origin} holds no prompt: write one prompt a line (text, or token ids like 1,17,42)"
        ));
    }
    Ok(out)
}

fn tokenizer_for(args: &ProfileArgs, model: &Path) -> Result<Option<Tokenizer>, String> {
    match &args.tokenizer {
        Some(p) => Tokenizer::from_file(p)
            .map(Some)
            .map_err(|e| format!("--tokenizer: {e}")),
        None => Tokenizer::for_model(model).map_err(|e| e.to_string()),
    }
}

/// Prefill `prompt` into slot 0 (fresh) and generate `n` greedy tokens after it.
fn run_one(e: &mut dyn Engine, prompt: &[u32], n: usize) -> Result<(), EngineError> {
    let info = e.info().clone();
    e.reset_slot(0);
    let chunks = prompt.chunks(info.ubatch.max(1));
    let last_chunk = chunks.len().saturating_sub(1);
    let mut next = [0u32];
    for (i, c) in chunks.enumerate() {
        if i == last_chunk {
            let l = e
                .prefill(0, c, true)?
                .ok_or_else(|| EngineError::Internal("prefill returned no logits".into()))?;
            next[0] = strata_exec::sampler::argmax(l);
        } else {
            e.prefill(0, c, false)?;
        }
    }
    let room = info.max_context.saturating_sub(prompt.len() as u64) as usize;
    for _ in 0..n.min(room) {
        let t = next[0];
        e.decode_greedy(&[(0, t)], &mut next)?;
    }
    Ok(())
}

pub fn main(args: ProfileArgs) {
    let origin = args.prompts.display().to_string();
    let text = std::fs::read_to_string(&args.prompts)
        .unwrap_or_else(|e| fail(format!("--prompts {origin}: {e}")));
    let lines = parse_prompts(&text, &origin).unwrap_or_else(|e| fail(e));
    let (plan, model_path) = open_plan(&args.plan, &args.common);
    let tokenizer = if lines.iter().any(|(_, p)| matches!(p, PromptLine::Text(_))) {
        match tokenizer_for(&args, &model_path) {
            Ok(Some(t)) => Some(t),
            Ok(None) => fail(format!(
                "{origin} has text prompts but the model {} carries no tokenizer: pass --tokenizer PATH, or write the prompts as token ids (1,17,42)",
                model_path.display()
            )),
            Err(e) => fail(format!(
                "{origin} has text prompts but the tokenizer cannot be read: {e}; pass --tokenizer PATH, or write the prompts as token ids (1,17,42)"
            )),
        }
    } else {
        None
    };
    let mut prompts = Vec::with_capacity(lines.len());
    for (n, p) in lines {
        let ids = match p {
            PromptLine::Tokens(ids) => ids,
            PromptLine::Text(t) => tokenizer
                .as_ref()
                .map(|tk| tk.encode(&t, true))
                .transpose()
                .unwrap_or_else(|e| fail(format!("{origin}:{n}: {e}")))
                .unwrap_or_default(),
        };
        if ids.is_empty() {
            fail(format!("{origin}:{n}: the prompt gives no tokens"));
        }
        prompts.push((n, ids));
    }
    let mut engine = start_engine(&plan, &model_path, &args.common);
    let info = engine.info().clone();
    for (n, ids) in &prompts {
        if let Some(bad) = ids.iter().find(|t| **t as usize >= info.n_vocab) {
            fail(format!(
                "{origin}:{n}: token {bad} is outside the model's vocabulary of {}",
                info.n_vocab
            ));
        }
        if ids.len() as u64 >= info.max_context {
            fail(format!(
                "{origin}:{n}: the prompt has {} tokens but the plan's context is {} cells: shorten it or re-plan with a larger --max-context",
                ids.len(),
                info.max_context
            ));
        }
    }
    let run = rayon::scope(|_| -> Result<(), (usize, EngineError)> {
        for (n, ids) in &prompts {
            run_one(engine.as_mut(), ids, args.n_gen).map_err(|e| (*n, e))?;
        }
        Ok(())
    });
    if let Err((n, e)) = run {
        eprintln!("strata-exec: {origin}:{n}: {e}");
        std::process::exit(2);
    }
    let profile = engine.routing_profile().unwrap_or_else(|| {
        fail("this engine does not count the router's picks yet: run `strata-exec profile` on a plan for the CPU backend (plan the same model with a CPU probe)")
    });
    let out = profile.write_text();
    match &args.out {
        Some(p) => {
            std::fs::write(p, out).unwrap_or_else(|e| fail(format!("-o {}: {e}", p.display())))
        }
        None => print!("{out}"),
    }
    if !args.common.quiet {
        let tokens: u64 = profile.counts.iter().sum();
        eprintln!(
            "strata-exec: profiled {} prompts: {} router picks over {} blocks x {} experts",
            prompts.len(),
            tokens,
            profile.layers,
            profile.experts
        );
        if let Some(r) = &profile.reuse {
            eprintln!("strata-exec: {}", curve_summary(r, profile.keys()));
        }
    }
}

/// The LRU hit rate of the decode steps at a few cache sizes (share of every expert of the
/// profiled blocks), for the user to see the curve the planner will use.
pub fn curve_summary(r: &strata_schemas::profile::Reuse, keys: u64) -> String {
    let mut s = format!(
        "LRU hit rate of the decode steps' {} expert references (+{} first uses) with a cache of",
        r.decode.reuses(),
        r.decode.first
    );
    for frac in [1.0 / 32.0, 1.0 / 16.0, 1.0 / 8.0, 1.0 / 4.0, 1.0 / 2.0] {
        if let Some(h) = r.decode.hit_rate(keys as f64 * frac) {
            s.push_str(&format!(" 1/{:.0} of the experts: {h:.3};", 1.0 / frac));
        }
    }
    s.pop();
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lines_are_ids_or_text_and_bad_ids_name_the_line() {
        let p = parse_prompts("# c\n1,17, 42\n\nhello world\r\n7\n", "f.txt").unwrap();
        assert_eq!(
            p,
            vec![
                (2, PromptLine::Tokens(vec![1, 17, 42])),
                (4, PromptLine::Text("hello world".into())),
                (5, PromptLine::Tokens(vec![7])),
            ]
        );
        let e = parse_prompts("1,2\n3,,4\n", "f.txt").unwrap_err();
        assert!(e.contains("f.txt:2") && e.contains("1,17,42"), "{e}");
        let e = parse_prompts("99999999999\n", "f.txt").unwrap_err();
        assert!(e.contains("f.txt:1"), "{e}");
        assert!(parse_prompts("# only\n\n", "f.txt")
            .unwrap_err()
            .contains("no prompt"));
    }
}
