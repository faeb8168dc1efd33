//! `--model PATH` dispatch: a descriptor TOML, a GGUF file (split models through their first
//! part) or a safetensors folder, each reduced to the same inventory, with the MTP block of an
//! MTP-only GGUF (`--mtp-model`) merged in when given; `--vision MMPROJ` and `model-info PATH`
//! read the same sources. Invariant: only headers are read, and every error
//! names the path it is about.

use std::path::Path;
use strata_schemas::gguf::{mmproj, model, mtp_file, read_gguf};
use strata_schemas::inventory::{ModelInventory, VisionSpec};
use strata_schemas::modelinfo::{self, ModelInfo};
use strata_schemas::plan::PlanMtpFile;

/// The three forms `--model` takes, for error messages.
const FORMS: &str = "a .gguf file (the first part of a split model), a safetensors folder (config.json + *.safetensors) or a descriptor .toml (plans/models/)";

enum Kind {
    Folder,
    Toml,
    Gguf,
}

fn kind(path: &Path, flag: &str) -> Result<Kind, String> {
    if path.is_dir() {
        return Ok(Kind::Folder);
    }
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("toml") => Ok(Kind::Toml),
        Some("gguf") => Ok(Kind::Gguf),
        _ if !path.exists() => Err(format!(
            "{flag} {}: no such file or folder; expected {FORMS}",
            path.display()
        )),
        _ => Err(format!(
            "{flag} {}: unknown model format (by extension); expected {FORMS}",
            path.display()
        )),
    }
}

/// Load the inventory behind `--model PATH`.
pub fn load_model(path: &Path) -> Result<ModelInventory, String> {
    match kind(path, "--model")? {
        Kind::Folder => strata_schemas::safetensors::load_folder(path).map_err(|e| e.to_string()),
        Kind::Toml => strata_schemas::descriptor::load_descriptor(path).map_err(|e| e.to_string()),
        Kind::Gguf => {
            let g = read_gguf(path).map_err(|e| e.to_string())?;
            model::inventory_from_gguf(&g).map_err(|e| {
                if mtp_file::is_mtp_only(&g) {
                    format!("{e}\n  {} is an MTP-only GGUF (llama.cpp's convert_hf_to_gguf.py --mtp): pass the main model as --model and this file as --mtp-model", path.display())
                } else {
                    e.to_string()
                }
            })
        }
    }
}

/// Load `--model PATH` and, when given, the MTP-only GGUF `--mtp-model MTP` whose block it
/// lacks: the merged inventory (the one a single file with the block gives) and the second
/// file as the plan records it.
pub fn load_model_with_mtp(
    path: &Path,
    mtp: Option<&Path>,
) -> Result<(ModelInventory, Option<PlanMtpFile>), String> {
    let main = load_model(path)?;
    let Some(mtp) = mtp else {
        return Ok((main, None));
    };
    let g = read_gguf(mtp).map_err(|e| format!("--mtp-model: {e}"))?;
    let file = mtp_file::read_mtp_file(&g).map_err(|e| e.to_string())?;
    let merged = mtp_file::merge_mtp_file(&main, &file).map_err(|e| e.to_string())?;
    Ok((
        merged,
        Some(PlanMtpFile {
            source: mtp.display().to_string(),
            fingerprint: file.fingerprint,
        }),
    ))
}

/// Load a vision tower from an mmproj GGUF.
pub fn load_vision(path: &Path) -> Result<VisionSpec, String> {
    mmproj::read_mmproj(path).map_err(|e| format!("--vision: {e}"))
}

/// Describe the model at `path` (`strata-plan model-info`): any valid GGUF, a safetensors
/// folder or a descriptor.
pub fn model_info(path: &Path) -> Result<ModelInfo, String> {
    let source = path.display().to_string();
    match kind(path, "model-info")? {
        Kind::Gguf => {
            let g = read_gguf(path).map_err(|e| e.to_string())?;
            Ok(modelinfo::model_info_from_gguf(&g))
        }
        Kind::Folder | Kind::Toml => {
            let inv = load_model(path)?;
            Ok(modelinfo::model_info_from_inventory(&inv, &source))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_schemas::arch::QuantRecipe;
    use strata_schemas::gguf::random::{write_random_model, RandomOptions};
    use strata_schemas::gguf::split_mtp::split_mtp;
    use strata_schemas::gguf::testutil::tiny_qwen3next;
    use strata_schemas::inventory::{HParams, TensorRole};

    /// The shared tiny Qwen3-Next, two blocks and a 64-token vocabulary.
    fn tiny_next() -> HParams {
        HParams {
            n_layer: 2,
            n_vocab: 64,
            ..tiny_qwen3next()
        }
    }

    /// `--model MAIN --mtp-model MTP` plans the inventory of the single file (same fingerprint,
    /// the block's tensors in it) and records the MTP file's own fingerprint and path.
    #[test]
    fn the_merged_inventory_is_the_single_files_and_both_files_are_fingerprinted() {
        let d = tempfile::tempdir().unwrap();
        let whole = d.path().join("whole.gguf");
        let recipe = QuantRecipe::preset("F32").unwrap();
        write_random_model(
            &whole,
            "qwen3next",
            &tiny_next(),
            &recipe,
            1,
            RandomOptions::default(),
        )
        .unwrap();
        let (main, mtp) = (d.path().join("main.gguf"), d.path().join("mtp.gguf"));
        split_mtp(&whole, &main, &mtp).unwrap();

        let single = load_model(&whole).unwrap();
        let (alone, none) = load_model_with_mtp(&main, None).unwrap();
        assert!(none.is_none());
        assert_eq!(alone.hparams.nextn_predict_layers, 0);
        let (merged, file) = load_model_with_mtp(&main, Some(&mtp)).unwrap();
        let file = file.unwrap();
        assert_eq!(merged.fingerprint(), single.fingerprint());
        assert_ne!(merged.fingerprint(), alone.fingerprint());
        assert_eq!(file.source, mtp.display().to_string());
        let g = read_gguf(&mtp).unwrap();
        assert_eq!(
            file.fingerprint,
            mtp_file::read_mtp_file(&g).unwrap().fingerprint
        );
        assert_ne!(file.fingerprint, merged.fingerprint());
        let block: Vec<&str> = merged
            .tensors
            .iter()
            .filter(|t| t.layer == Some(2))
            .map(|t| t.name.as_str())
            .collect();
        assert!(block.contains(&"blk.2.nextn.eh_proj.weight"), "{block:?}");
        assert!(merged
            .tensors
            .iter()
            .any(|t| t.role == TensorRole::MtpExtra && t.layer == Some(2)));
        assert_eq!(merged.tensors.len(), single.tensors.len());

        // The MTP file as --model says what it is.
        let e = load_model(&mtp).unwrap_err();
        assert!(
            e.contains("MTP-only GGUF") && e.contains("--mtp-model"),
            "{e}"
        );
        // A missing MTP file names the flag and the path.
        let gone = d.path().join("gone.gguf");
        let e = load_model_with_mtp(&main, Some(&gone)).unwrap_err();
        assert!(e.contains("--mtp-model") && e.contains("gone.gguf"), "{e}");
    }
}
