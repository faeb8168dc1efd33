//! `strata-exec PLAN --serve`: the OpenAI-compatible server over the plan's engine.
//! Invariant: every flag, the plan and the paths are checked before binding (bad input exits
//! 1 before the port is taken); the server binds before the model loads, so `/health`
//! answers 503 while the loader runs; exit 0 after SIGINT/SIGTERM, 1 on a bind or load
//! failure.

use super::run::RunArgs;
use super::{fail, open_plan, try_start_engine};
use std::time::Duration;
use strata_exec::serve::{serve_with_loader_blocking, ServeOptions};
use strata_exec::tokenizer::Tokenizer;

/// Flags of `--serve` (flattened into the run command's arguments).
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Server (with --serve)")]
pub struct ServeArgs {
    /// Serve an OpenAI-compatible HTTP API over the plan's slots instead of generating once:
    /// /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, /slots,
    /// /tokenize, /detokenize. Each planned slot runs one request; more wait in a queue.
    #[arg(long)]
    pub serve: bool,
    /// Address to listen on. The default answers only this machine; 0.0.0.0 answers every
    /// interface (set --api-key then).
    #[arg(long, default_value = "127.0.0.1", requires = "serve")]
    pub host: String,
    /// TCP port to listen on; 0 picks a free one (the chosen address is printed).
    #[arg(long, default_value_t = 8080, requires = "serve")]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health (401 otherwise).
    /// A key on the command line shows in the process list; the STRATA_API_KEY environment
    /// variable does not (this flag wins when both are given).
    #[arg(long, value_name = "KEY", requires = "serve")]
    pub api_key: Option<String>,
    /// Requests that may wait for a free slot; beyond that the server answers 503 with
    /// Retry-After.
    #[arg(long, value_name = "N", default_value_t = 64, requires = "serve",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub queue: u64,
    /// Largest request body accepted, in bytes (413 beyond).
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 20, requires = "serve",
          value_parser = clap::value_parser!(u64).range(1024..=1 << 30))]
    pub max_body: u64,
    /// Model id shown on /v1/models and accepted in requests' `model` field (requests that
    /// name another model get 404); default: the plan's model name.
    #[arg(long, value_name = "NAME", requires = "serve")]
    pub model_name: Option<String>,
    /// Seconds running requests may go on after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, value_name = "SECS", default_value_t = 10.0, requires = "serve")]
    pub shutdown_grace: f64,
}

pub fn main(args: RunArgs) -> ! {
    let plan_path = args
        .plan
        .clone()
        .unwrap_or_else(|| fail("give a plan file: strata-exec PLAN --serve"));
    if args.prompt.is_some() || args.prompt_tokens.is_some() || args.logits {
        fail("--prompt, --prompt-tokens and --logits are for one-off generation; with --serve the prompts come in HTTP requests");
    }
    let s = &args.serve;
    if !(s.shutdown_grace.is_finite() && (0.0..=3600.0).contains(&s.shutdown_grace)) {
        fail(format!(
            "--shutdown-grace {}: give seconds from 0 to 3600",
            s.shutdown_grace
        ));
    }
    let (plan, model) = open_plan(&plan_path, &args.common);
    if !model.exists() {
        fail(format!(
            "the plan's model `{}` does not exist: pass --model PATH",
            model.display()
        ));
    }
    // --tokenizer (shared with one-off generation): a tokenizer.json or a folder with one
    // (and tokenizer_config.json for the chat template); default: the model's own. Without
    // any, only token-id prompts on /v1/completions are served.
    if let Some(t) = &args.tokenizer {
        if !t.exists() {
            fail(format!(
                "--tokenizer {}: no such file or folder",
                t.display()
            ));
        }
    }
    let opts = ServeOptions {
        host: s.host.clone(),
        port: s.port,
        api_key: api_key(
            s.api_key.as_deref(),
            std::env::var("STRATA_API_KEY").ok().as_deref(),
        ),
        queue: s.queue as usize,
        max_body_bytes: s.max_body as usize,
        shutdown_grace: Duration::from_secs_f64(s.shutdown_grace),
        model_name: s.model_name.clone(),
    };
    let tok_path = args.tokenizer.clone();
    let common = args.common.clone();
    let loader = Box::new(move || {
        // The tokenizer first: it is quick, and a broken one should not wait for the weights.
        let tok = match &tok_path {
            Some(p) => Some(Tokenizer::from_file(p).map_err(|e| format!("--tokenizer: {e}"))?),
            None => Tokenizer::for_model(&model).map_err(|e| e.to_string())?,
        };
        if tok.is_none() {
            eprintln!(
                "strata-exec serve: the model `{}` carries no tokenizer: only token-id prompts on /v1/completions are served (chat requests get 400); pass --tokenizer PATH for text",
                model.display()
            );
        }
        let engine = try_start_engine(&plan, &model, &common)?;
        Ok((engine, tok))
    });
    match serve_with_loader_blocking(loader, opts) {
        Ok(()) => std::process::exit(0),
        Err(e) => fail(e),
    }
}

/// The server's key: `--api-key`, else STRATA_API_KEY; an empty one means none.
fn api_key(flag: Option<&str>, env: Option<&str>) -> Option<String> {
    flag.or(env).filter(|k| !k.is_empty()).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::api_key;

    #[test]
    fn the_flag_wins_over_the_environment_and_empty_means_none() {
        assert_eq!(api_key(Some("a"), Some("b")).as_deref(), Some("a"));
        assert_eq!(api_key(None, Some("b")).as_deref(), Some("b"));
        assert_eq!(api_key(None, None), None);
        assert_eq!(api_key(Some(""), None), None);
        assert_eq!(api_key(None, Some("")), None);
    }
}
