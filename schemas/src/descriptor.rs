//! Descriptor TOML: hyperparameters plus a quant recipe, synthesized into an inventory.
//! Invariant: a descriptor is accepted only when every key is known and every size is
//! plausible; the inventory it yields is exactly what `arch::expected_tensors` produces for it,
//! so it plans the same as the GGUF file it stands in for.
//!
//! Format:
//! ```toml
//! name = "Qwen3-30B-A3B Q4_K_M"
//! arch = "qwen3moe"
//!
//! [hparams]            # inventory::HParams, unknown keys refused
//! n_layer = 48
//! # ...
//!
//! [quant]
//! preset = "Q4_K_M"    # Q4_K_M | Q4_K | Q8_0 | IQ3_S | F16 | BF16 | F32
//! expert_down = "Q5_K" # optional per-role overrides: default, embedding, head, attention,
//!                      # expert_gate_up, expert_down, shared_expert, ssm, router, norms
//! more_bits = "none"   # optional: the use_more_bits bump type, or "none"
//! overrides = [{ pattern = "blk.*.ffn_down_exps.weight", type = "Q6_K" }]
//!
//! [vision]             # optional, inventory::VisionSpec
//! ```

use crate::arch::{self, QuantRecipe, TensorOverride, PRESETS};
use crate::ggml::GgmlType;
use crate::inventory::{HParams, InventoryError, ModelInventory, VisionSpec};
use serde::Deserialize;
use std::path::Path;

/// Errors loading a descriptor; each names the file and, where there is one, the key.
#[derive(Debug, thiserror::Error)]
pub enum DescriptorError {
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    #[error("model descriptor {file}: {message}")]
    Parse { file: String, message: String },
    #[error("model descriptor {file}: key `{key}`: {reason}")]
    BadValue {
        file: String,
        key: String,
        reason: String,
    },
    #[error("model descriptor {file}: {source}")]
    Inventory {
        file: String,
        #[source]
        source: InventoryError,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorFile {
    name: String,
    arch: String,
    hparams: HParams,
    quant: QuantSection,
    #[serde(default)]
    vision: Option<VisionSpec>,
}

/// The `[quant]` table: a preset plus optional per-role overrides.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuantSection {
    preset: String,
    default: Option<GgmlType>,
    embedding: Option<GgmlType>,
    head: Option<GgmlType>,
    attention: Option<GgmlType>,
    expert_gate_up: Option<GgmlType>,
    expert_down: Option<GgmlType>,
    shared_expert: Option<GgmlType>,
    ssm: Option<GgmlType>,
    router: Option<GgmlType>,
    norms: Option<GgmlType>,
    /// A type name or "none".
    more_bits: Option<String>,
    #[serde(default)]
    overrides: Vec<TensorOverride>,
}

impl QuantSection {
    fn into_recipe(self, file: &str) -> Result<QuantRecipe, DescriptorError> {
        let bad = |key: &str, reason: String| DescriptorError::BadValue {
            file: file.to_string(),
            key: key.to_string(),
            reason,
        };
        let mut r = QuantRecipe::preset(&self.preset).ok_or_else(|| {
            bad(
                "quant.preset",
                format!(
                    "unknown preset `{}`; use one of {}",
                    self.preset,
                    PRESETS.join(", ")
                ),
            )
        })?;
        let set = |slot: &mut GgmlType, v: Option<GgmlType>| {
            if let Some(t) = v {
                *slot = t;
            }
        };
        set(&mut r.default, self.default);
        set(&mut r.embedding, self.embedding);
        set(&mut r.head, self.head);
        set(&mut r.attention, self.attention);
        set(&mut r.expert_gate_up, self.expert_gate_up);
        set(&mut r.expert_down, self.expert_down);
        set(&mut r.shared_expert, self.shared_expert);
        set(&mut r.ssm, self.ssm);
        set(&mut r.router, self.router);
        set(&mut r.norms, self.norms);
        if !matches!(r.norms, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(bad(
                "quant.norms",
                format!(
                    "{} is not a float type; llama.cpp keeps 1-D tensors F32",
                    r.norms
                ),
            ));
        }
        if let Some(m) = self.more_bits {
            r.more_bits = if m.eq_ignore_ascii_case("none") {
                None
            } else {
                Some(GgmlType::from_name(&m).ok_or_else(|| {
                    bad(
                        "quant.more_bits",
                        format!("unknown ggml type `{m}`; use a type such as Q6_K, or \"none\""),
                    )
                })?)
            };
        }
        for (i, o) in self.overrides.iter().enumerate() {
            if o.pattern.is_empty() {
                return Err(bad(
                    &format!("quant.overrides[{i}].pattern"),
                    "is empty".into(),
                ));
            }
        }
        r.overrides = self.overrides;
        Ok(r)
    }
}

fn check_vision(v: &VisionSpec, file: &str) -> Result<(), DescriptorError> {
    let bad = |key: &str, reason: &str| DescriptorError::BadValue {
        file: file.to_string(),
        key: format!("vision.{key}"),
        reason: reason.to_string(),
    };
    for (key, val) in [
        ("weights_bytes", v.weights_bytes),
        ("n_embd", v.n_embd),
        ("n_head", v.n_head),
        ("n_ff", v.n_ff),
        ("max_image_tokens", v.max_image_tokens),
    ] {
        if val == 0 {
            return Err(bad(key, "must be greater than 0"));
        }
    }
    if v.n_layer == 0 {
        return Err(bad("n_layer", "must be greater than 0"));
    }
    if v.n_embd % v.n_head != 0 {
        return Err(bad("n_head", "must divide vision n_embd"));
    }
    if v.n_embd > 1 << 20 || v.n_ff > 1 << 20 || v.max_image_tokens > 1 << 20 {
        return Err(bad("n_embd", "a size is above the sanity limit 2^20"));
    }
    Ok(())
}

/// Parse descriptor text; `origin` names it in errors (usually the file path).
pub fn from_toml_str(text: &str, origin: &str) -> Result<ModelInventory, DescriptorError> {
    let d: DescriptorFile = toml::from_str(text).map_err(|e| DescriptorError::Parse {
        file: origin.to_string(),
        message: e.to_string().trim_end().to_string(),
    })?;
    if d.name.trim().is_empty() {
        return Err(DescriptorError::BadValue {
            file: origin.to_string(),
            key: "name".into(),
            reason: "is empty".into(),
        });
    }
    if !arch::SUPPORTED.contains(&d.arch.as_str()) {
        return Err(DescriptorError::BadValue {
            file: origin.to_string(),
            key: "arch".into(),
            reason: format!(
                "unsupported architecture `{}`; supported: {}",
                d.arch,
                arch::SUPPORTED.join(", ")
            ),
        });
    }
    arch::validate_hparams(&d.arch, &d.hparams).map_err(|e| match e {
        InventoryError::BadHParam { key, reason } => DescriptorError::BadValue {
            file: origin.to_string(),
            key: format!("hparams.{key}"),
            reason,
        },
        other => DescriptorError::Inventory {
            file: origin.to_string(),
            source: other,
        },
    })?;
    let recipe = d.quant.into_recipe(origin)?;
    if let Some(v) = &d.vision {
        check_vision(v, origin)?;
    }
    let tensors = arch::expected_tensors(&d.arch, &d.hparams, &recipe).map_err(|source| {
        DescriptorError::Inventory {
            file: origin.to_string(),
            source,
        }
    })?;
    Ok(ModelInventory {
        arch: d.arch,
        name: d.name,
        hparams: d.hparams,
        tensors,
        vision: d.vision,
    })
}

/// Read and synthesize a descriptor file.
pub fn load_descriptor(path: &Path) -> Result<ModelInventory, DescriptorError> {
    let file = path.display().to_string();
    let text =
        crate::files::read_text_limited(path, crate::files::limit::TOML, "model descriptor")?;
    from_toml_str(&text, &file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::TensorRole;
    use std::path::PathBuf;

    fn models_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../plans/models")
    }

    const SHIPPED: &[&str] = &[
        "qwen3-30b-a3b-q4_k_m.toml",
        "qwen3-30b-a3b-q8_0.toml",
        "qwen3-next-80b-a3b-iq3_s.toml",
        "qwen3-next-80b-a3b-q4_k_m.toml",
    ];

    const MINIMAL: &str = r#"
name = "tiny"
arch = "qwen3moe"
[hparams]
n_layer = 2
n_embd = 256
n_vocab = 1024
n_ctx_train = 4096
n_head = 4
n_head_kv = 2
head_dim_k = 64
head_dim_v = 64
n_expert = 8
n_expert_used = 2
n_ff_exp = 256
[quant]
preset = "Q4_K_M"
"#;

    #[test]
    fn minimal_descriptor_synthesizes() {
        let inv = from_toml_str(MINIMAL, "tiny.toml").unwrap();
        assert_eq!(inv.arch, "qwen3moe");
        assert_eq!(inv.tensors.len(), 3 + 2 * 12);
        assert!(inv.vision.is_none());
        assert!(arch::check_tensors("qwen3moe", &inv.hparams, &inv.tensors).is_ok());
    }

    #[test]
    fn unknown_keys_are_named() {
        let cases = [
            (MINIMAL.replace("n_layer = 2", "n_layers = 2"), "n_layers"),
            (format!("{MINIMAL}colour = \"red\"\n"), "colour"),
            (MINIMAL.replace("name = \"tiny\"", "name = \"tiny\"\nflavour = 1"), "flavour"),
            (MINIMAL.replace("preset = \"Q4_K_M\"", "preset = \"Q4_K_M\"\nexperts = \"Q4_K\""), "experts"),
            (format!("{MINIMAL}[vision]\nweights_bytes = 1\nn_embd = 8\nn_layer = 1\nn_head = 1\nn_ff = 8\nmax_image_tokens = 4\npatch = 14\n"), "patch"),
        ];
        for (text, key) in cases {
            let err = from_toml_str(&text, "models/x.toml").unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("models/x.toml"), "{msg}");
            assert!(msg.contains(key), "{key}: {msg}");
        }
    }

    #[test]
    fn zero_and_inconsistent_sizes_name_the_key() {
        let cases = [
            ("n_layer = 2", "n_layer = 0", "hparams.n_layer"),
            ("n_embd = 256", "n_embd = 0", "hparams.n_embd"),
            (
                "n_expert_used = 2",
                "n_expert_used = 9",
                "hparams.n_expert_used",
            ),
            ("n_head_kv = 2", "n_head_kv = 3", "hparams.n_head_kv"),
            ("n_ff_exp = 256", "n_ff_exp = 0", "hparams.n_ff_exp"),
            (
                "preset = \"Q4_K_M\"",
                "preset = \"Q3_K_XL\"",
                "quant.preset",
            ),
            (
                "preset = \"Q4_K_M\"",
                "preset = \"Q4_K_M\"\nnorms = \"Q4_K\"",
                "quant.norms",
            ),
            (
                "preset = \"Q4_K_M\"",
                "preset = \"Q4_K_M\"\nmore_bits = \"Q9\"",
                "quant.more_bits",
            ),
            ("arch = \"qwen3moe\"", "arch = \"llama\"", "arch"),
        ];
        for (from, to, key) in cases {
            let text = MINIMAL.replace(from, to);
            match from_toml_str(&text, "m.toml") {
                Err(DescriptorError::BadValue { file, key: k, .. }) => {
                    assert_eq!(file, "m.toml");
                    assert_eq!(k, key);
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        // A zero vision size names the vision key.
        let text = format!("{MINIMAL}[vision]\nweights_bytes = 0\nn_embd = 8\nn_layer = 1\nn_head = 1\nn_ff = 8\nmax_image_tokens = 4\n");
        match from_toml_str(&text, "m.toml") {
            Err(DescriptorError::BadValue { key, .. }) => assert_eq!(key, "vision.weights_bytes"),
            other => panic!("{other:?}"),
        }
        // A negative number is a parse error that names the key.
        let msg = from_toml_str(&MINIMAL.replace("n_vocab = 1024", "n_vocab = -1"), "m.toml")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("n_vocab"), "{msg}");
    }

    #[test]
    fn quant_overrides_apply() {
        let text = MINIMAL.replace(
            "preset = \"Q4_K_M\"",
            "preset = \"Q4_K_M\"\nexpert_gate_up = \"Q5_K\"\nmore_bits = \"none\"\noverrides = [{ pattern = \"blk.1.*\", type = \"Q8_0\" }]",
        );
        let inv = from_toml_str(&text, "m.toml").unwrap();
        let ty = |n: &str| inv.tensor(n).unwrap().ggml_type;
        assert_eq!(ty("blk.0.ffn_gate_exps.weight"), GgmlType::Q5K);
        assert_eq!(ty("blk.0.ffn_down_exps.weight"), GgmlType::Q4K); // no bump
        assert_eq!(ty("blk.1.ffn_down_exps.weight"), GgmlType::Q8_0);
        assert_eq!(ty("blk.1.ffn_norm.weight"), GgmlType::F32); // 1-D never quantized
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = load_descriptor(Path::new("/nonexistent/model.toml")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/model.toml"));
    }

    #[test]
    fn shipped_descriptors_load_and_check() {
        for f in SHIPPED {
            let path = models_dir().join(f);
            let inv = load_descriptor(&path).unwrap_or_else(|e| panic!("{e}"));
            arch::check_tensors(&inv.arch, &inv.hparams, &inv.tensors).unwrap();
            let next = inv.arch == "qwen3next";
            assert_eq!(inv.vision.is_some(), next, "{f}");
        }
    }

    #[test]
    fn shipped_next_iq3s_matches_design_numbers() {
        let inv = load_descriptor(&models_dir().join("qwen3-next-80b-a3b-iq3_s.toml")).unwrap();
        assert_eq!(inv.expert_bytes(0), 1_351_680);
        assert_eq!(inv.expert_bytes(48), 1_351_680);
        assert_eq!(512 * inv.expert_bytes(5), 692_060_160);
        let experts: u64 = inv
            .tensors
            .iter()
            .filter(|t| t.role == TensorRole::ExpertStack)
            .map(|t| t.bytes)
            .sum();
        assert!((33.85e9..33.95e9).contains(&(experts as f64)), "{experts}");
        assert_eq!(inv.hparams.n_blocks_total(), 49);
        let v = inv.vision.as_ref().unwrap();
        assert_eq!(
            (v.n_embd, v.n_layer, v.n_head, v.n_ff),
            (1152, 27, 16, 4304)
        );
    }

    #[test]
    fn shipped_qwen3_30b_q8_0_is_the_real_size() {
        let inv = load_descriptor(&models_dir().join("qwen3-30b-a3b-q8_0.toml")).unwrap();
        let real = 32.48e9;
        let total = inv.total_bytes() as f64;
        assert!((total - real).abs() / real < 0.01, "{total}");
        assert_eq!(inv.hparams.n_ctx_train, 40960);
    }

    /// Prints each shipped descriptor's total (for plans/models/README.md):
    /// `cargo test -p strata-schemas print_shipped_totals -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn print_shipped_totals() {
        for f in SHIPPED {
            let inv = load_descriptor(&models_dir().join(f)).unwrap();
            let experts: u64 = inv
                .tensors
                .iter()
                .filter(|t| t.role == TensorRole::ExpertStack)
                .map(|t| t.bytes)
                .sum();
            println!(
                "{f}: tensors {} total {} experts {} vision {:?}",
                inv.tensors.len(),
                inv.total_bytes(),
                experts,
                inv.vision.as_ref().map(|v| v.weights_bytes)
            );
            assert!(inv.total_bytes() > experts);
        }
    }
}
