//! A model of two files, as a plan made with `strata-plan --mtp-model` names it: the main model
//! (a GGUF file or a safetensors folder) without its MTP block, and the MTP-only GGUF
//! llama.cpp's `convert_hf_to_gguf.py --mtp` writes. [`open_planned`] opens what a plan needs;
//! [`WithMtpFile`] serves the block's tensors from the second file and every other tensor
//! from the main model, under the merged inventory the planner planned
//! (`strata_schemas::gguf::mtp_file`).
//! Invariant: the second file is opened only when the plan names one, and refused (naming the
//! file and the fix) when it is missing, is not the file planned (its own fingerprint), or
//! does not fit the main model; the merged fingerprint is then checked at start-up like any
//! model's, so a changed main file is refused too.

use super::{open_model, GgufModel, HostModel, LoadError};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use strata_schemas::gguf::mtp_file::{merge_mtp_file, read_mtp_file, MtpFile};
use strata_schemas::inventory::ModelInventory;
use strata_schemas::plan::Plan;

/// Why the plan's MTP-only file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum MtpFileLoadError {
    #[error("the plan loads its MTP block from {path} (made with strata-plan --mtp-model), which cannot be read: {msg}; pass --mtp-model FILE where that file is now, or re-run strata-plan")]
    Open { path: String, msg: String },
    #[error("the MTP file {path} has fingerprint {file} but the plan was made with {plan} ({planned}): it is not the file planned; pass that file with --mtp-model, or re-run strata-plan --mtp-model {path}")]
    Changed {
        path: String,
        file: String,
        plan: String,
        planned: String,
    },
    #[error("{0}; re-run strata-plan with the matching --model and --mtp-model")]
    Mismatch(String),
    #[error("--mtp-model {path}: the plan was made from one model file ({source_path}) and loads no MTP-only GGUF; drop --mtp-model, or re-plan with strata-plan --mtp-model")]
    NotPlanned { path: String, source_path: String },
}

/// The main model with the MTP block of an MTP-only file.
pub struct WithMtpFile {
    main: Box<dyn HostModel>,
    mtp: GgufModel,
    /// Names of the tensors read from `mtp`.
    block: HashSet<String>,
    inv: ModelInventory,
}

impl WithMtpFile {
    /// Join `main` (no MTP block) with the MTP-only file at `path` whose header is `g`.
    pub fn new(
        main: Box<dyn HostModel>,
        path: &Path,
        g: &strata_schemas::gguf::GgufFile,
        file: MtpFile,
    ) -> Result<Self, LoadError> {
        let inv = merge_mtp_file(main.inventory(), &file)
            .map_err(|e| MtpFileLoadError::Mismatch(e.to_string()))?;
        let block = file.block_tensors().map(|t| t.name.clone()).collect();
        let own = ModelInventory {
            arch: file.arch,
            name: path.display().to_string(),
            hparams: file.hparams,
            tensors: file.tensors,
            vision: None,
        };
        let mtp = GgufModel::from_header(path, own, g)?;
        Ok(Self {
            main,
            mtp,
            block,
            inv,
        })
    }

    /// The MTP-only file.
    pub fn mtp_path(&self) -> &Path {
        self.mtp.path()
    }
}

impl HostModel for WithMtpFile {
    fn inventory(&self) -> &ModelInventory {
        &self.inv
    }
    fn path(&self) -> &Path {
        self.main.path()
    }
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        if self.block.contains(name) {
            self.mtp.tensor_bytes(name)
        } else {
            self.main.tensor_bytes(name)
        }
    }
    fn host_bytes(&self) -> (u64, u64) {
        let (a, b) = self.main.host_bytes();
        let (c, d) = self.mtp.host_bytes();
        (a + c, b + d)
    }
}

/// Open the model `plan` runs: `model`, and the plan's MTP-only file (at `mtp_model` when
/// given, else where it was planned) when the plan names one.
pub fn open_planned(
    plan: &Plan,
    model: &Path,
    mtp_model: Option<&Path>,
) -> Result<Box<dyn HostModel>, LoadError> {
    let Some(planned) = &plan.model.mtp_file else {
        if let Some(p) = mtp_model {
            return Err(MtpFileLoadError::NotPlanned {
                path: p.display().to_string(),
                source_path: plan.model.source.clone(),
            }
            .into());
        }
        return open_model(model);
    };
    let path = mtp_model.map_or_else(|| PathBuf::from(&planned.source), Path::to_path_buf);
    let open_err = |msg: String| MtpFileLoadError::Open {
        path: path.display().to_string(),
        msg,
    };
    let g = strata_schemas::gguf::read_gguf(&path).map_err(|e| open_err(e.to_string()))?;
    let file = read_mtp_file(&g).map_err(|e| MtpFileLoadError::Mismatch(e.to_string()))?;
    if file.fingerprint != planned.fingerprint {
        return Err(MtpFileLoadError::Changed {
            path: path.display().to_string(),
            file: file.fingerprint,
            plan: planned.fingerprint.clone(),
            planned: planned.source.clone(),
        }
        .into());
    }
    let main = open_model(model)?;
    Ok(Box::new(WithMtpFile::new(main, &path, &g, file)?))
}
