//! `--model PATH` dispatch: a descriptor TOML, a GGUF file (split models through their first
//! part) or a safetensors folder, each reduced to the same inventory; `--vision MMPROJ` and
//! `model-info PATH` read the same sources. Invariant: only headers are read, and every error
//! names the path it is about.

use std::path::Path;
use strata_schemas::gguf::{mmproj, model, read_gguf};
use strata_schemas::inventory::{ModelInventory, VisionSpec};
use strata_schemas::modelinfo::{self, ModelInfo};

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
            model::inventory_from_gguf(&g).map_err(|e| e.to_string())
        }
    }
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
