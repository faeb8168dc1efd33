//! `--model PATH` dispatch: a descriptor TOML, a GGUF file or a safetensors folder, each
//! reduced to the same inventory. Invariant: only headers are read to plan.

use std::path::Path;
use strata_schemas::inventory::ModelInventory;

/// Load the inventory behind `--model PATH`.
pub fn load_model(path: &Path) -> Result<ModelInventory, String> {
    if path.is_dir() {
        return strata_schemas::safetensors::load_folder(path).map_err(|e| e.to_string());
    }
    match path.extension().and_then(|e| e.to_str()) {
        Some("toml") => {
            strata_schemas::descriptor::load_descriptor(path).map_err(|e| e.to_string())
        }
        _ => Err(format!(
            "--model {}: expected a descriptor .toml, a .gguf file or a safetensors folder",
            path.display()
        )),
    }
}

/// Load a vision tower from an mmproj GGUF.
pub fn load_vision(path: &Path) -> Result<strata_schemas::inventory::VisionSpec, String> {
    Err(format!(
        "--vision {}: reading mmproj files is not supported by this build yet; use a descriptor [vision] section",
        path.display()
    ))
}
