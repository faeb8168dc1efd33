//! `strata-serve-test`: the OpenAI-compatible server over the test-support `TinyEngine`
//! (random weights, timed steps) and a tokenizer folder, for the Python client test and the
//! shutdown test where a controllable engine helps (slow steps, slow loading); the real
//! program is `strata-exec PLAN --serve`. Invariant: prints `listening on http://ADDR` on
//! stderr once bound; exits 0 after SIGINT/SIGTERM, 2 on bad arguments.

use std::time::Duration;
use strata_exec::serve::test_engine::{TinyConfig, TinyEngine};
use strata_exec::serve::{serve_with_loader_blocking, ServeOptions};
use strata_exec::tokenizer::Tokenizer;

const USAGE: &str = "usage: strata-serve-test [--tokenizer DIR|tokenizer.json] [--host H] [--port P (0 = any)] [--api-key K] [--slots N] [--ctx N] [--ubatch N] [--queue N] [--delay-ms N] [--load-ms N] [--grace-ms N] [--max-body N]";

fn main() {
    let mut opts = ServeOptions::default();
    let mut cfg = TinyConfig::default();
    let mut tok_path: Option<String> = None;
    let mut load_ms = 0u64;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    let bad = |m: String| -> ! {
        eprintln!("strata-serve-test: {m}\n{USAGE}");
        std::process::exit(2)
    };
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            return;
        }
        let Some(v) = args.get(i + 1).cloned() else {
            bad(format!("{flag} needs a value"))
        };
        let num = |v: &str| -> u64 {
            v.parse()
                .unwrap_or_else(|_| bad(format!("{flag} takes a number, got `{v}`")))
        };
        match flag {
            "--tokenizer" => tok_path = Some(v),
            "--host" => opts.host = v,
            "--port" => {
                opts.port = u16::try_from(num(&v))
                    .unwrap_or_else(|_| bad(format!("--port {v} is not a port")))
            }
            "--api-key" => opts.api_key = Some(v),
            "--slots" => cfg.n_slots = num(&v) as usize,
            "--ctx" => cfg.max_context = num(&v),
            "--ubatch" => cfg.ubatch = num(&v) as usize,
            "--queue" => opts.queue = num(&v) as usize,
            "--delay-ms" => cfg.step_delay = Duration::from_millis(num(&v)),
            "--load-ms" => load_ms = num(&v),
            "--grace-ms" => opts.shutdown_grace = Duration::from_millis(num(&v)),
            "--max-body" => opts.max_body_bytes = num(&v) as usize,
            _ => bad(format!("unknown flag {flag}")),
        }
        i += 2;
    }
    let loader = Box::new(move || {
        std::thread::sleep(Duration::from_millis(load_ms));
        let tok = match tok_path {
            Some(p) => Some(Tokenizer::from_file(&p).map_err(|e| e.to_string())?),
            None => None,
        };
        if let Some(t) = &tok {
            cfg.n_vocab = t.vocab_size() as u64;
        }
        let engine = TinyEngine::new(&cfg).map_err(|e| e.to_string())?;
        Ok((
            Box::new(engine) as Box<dyn strata_exec::engine::Engine>,
            tok,
        ))
    });
    if let Err(e) = serve_with_loader_blocking(loader, opts) {
        eprintln!("strata-serve-test: {e}");
        std::process::exit(1);
    }
}
