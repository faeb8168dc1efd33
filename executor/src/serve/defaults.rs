//! Sampling defaults a request gets for the fields it leaves out: OpenAI's, replaced by the
//! model folder's `generation_config.json`, replaced by the server's flags.
//! Invariant: every value held is in the range a request may give (out-of-range values in
//! the model's file are skipped with a warning, never served).

use serde_json::Value;
use std::path::Path;

/// Defaults for `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    pub min_p: f64,
    pub repetition_penalty: f64,
}

impl Default for SamplingDefaults {
    /// OpenAI's: temperature 1, no cuts, no penalty.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingDefaults {
    /// These defaults with the values of a `generation_config.json` body (transformers'
    /// keys; `do_sample: false` means greedy). Returns the keys skipped as out of range.
    pub fn with_generation_config(mut self, v: &Value) -> (Self, Vec<String>) {
        let mut skipped = Vec::new();
        let mut num = |k: &str, lo: f64, hi: f64| -> Option<f64> {
            let x = v.get(k)?.as_f64()?;
            if (lo..=hi).contains(&x) {
                Some(x)
            } else {
                skipped.push(format!("{k} = {x}"));
                None
            }
        };
        if let Some(x) = num("temperature", 0.0, 2.0) {
            self.temperature = x;
        }
        if let Some(x) = num("top_p", 1e-9, 1.0) {
            self.top_p = x;
        }
        if let Some(x) = num("top_k", 0.0, (1u64 << 31) as f64) {
            self.top_k = x as usize;
        }
        if let Some(x) = num("min_p", 0.0, 1.0) {
            self.min_p = x;
        }
        if let Some(x) = num("repetition_penalty", 1e-9, 10.0) {
            self.repetition_penalty = x;
        }
        if v.get("do_sample") == Some(&Value::Bool(false)) {
            self.temperature = 0.0;
        }
        (self, skipped)
    }

    /// The defaults for a model at `model` (a file or folder): its folder's
    /// `generation_config.json` when there is one and it parses; else these.
    pub fn for_model(self, model: &Path) -> Self {
        let dir = if model.is_dir() {
            model
        } else {
            model.parent().unwrap_or(model)
        };
        let p = dir.join("generation_config.json");
        let Ok(text) = std::fs::read_to_string(&p) else {
            return self;
        };
        match serde_json::from_str::<Value>(&text) {
            Ok(v) => {
                let (d, skipped) = self.with_generation_config(&v);
                for s in skipped {
                    tracing_warn(&format!(
                        "{}: `{s}` is out of range; the default is kept",
                        p.display()
                    ));
                }
                d
            }
            Err(e) => {
                tracing_warn(&format!("{}: not valid JSON ({e}); ignored", p.display()));
                self
            }
        }
    }
}

fn tracing_warn(msg: &str) {
    eprintln!(
        "strata-exec serve: warning: {}",
        strata_schemas::text::for_terminal(msg)
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn generation_config_overrides_and_skips_bad_values() {
        let (d, skipped) = SamplingDefaults::default().with_generation_config(
            &json!({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 7, "do_sample": true}),
        );
        assert_eq!(d.temperature, 0.6);
        assert_eq!(d.top_p, 0.95);
        assert_eq!(d.top_k, 20);
        assert_eq!(d.min_p, 0.0, "out-of-range min_p is skipped");
        assert_eq!(skipped, ["min_p = 7"]);
        let (g, _) = d.with_generation_config(&json!({"do_sample": false}));
        assert_eq!(g.temperature, 0.0);
    }

    #[test]
    fn reads_the_model_folders_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"temperature": 0.7, "repetition_penalty": 1.05}"#,
        )
        .unwrap();
        let d = SamplingDefaults::default().for_model(&dir.path().join("model.gguf"));
        assert_eq!(d.temperature, 0.7);
        assert_eq!(d.repetition_penalty, 1.05);
        let none = SamplingDefaults::default().for_model(&dir.path().join("x/y.gguf"));
        assert_eq!(none, SamplingDefaults::default());
    }
}
