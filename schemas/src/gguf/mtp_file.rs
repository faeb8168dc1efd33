//! A model whose MTP block lives in a second file. llama.cpp's `convert_hf_to_gguf.py --mtp`
//! writes `mtp-<name>.gguf`: the main model's architecture and hyperparameter keys with
//! `block_count = n_layer + nextn_predict_layers`, and only the MTP blocks' tensors
//! (`blk.{n_layer}.*`: the `nextn.*` tensors, the block's attention and MoE) plus
//! `token_embd`, `output_norm` and `output`; its `--no-mtp` main file has `block_count =
//! n_layer` and no MTP block. [`merge_mtp_file`] joins the two into the inventory a single
//! file with the block has: the same tensors in the same canonical order, so the same
//! fingerprint.
//! Invariant: a merge succeeds only when the main model has no MTP block, the MTP file's
//! hyperparameters are the main model's but for `nextn_predict_layers`, the file holds MTP-block
//! tensors and no main-block tensor, its `token_embd`/`output` have the main model's shapes,
//! and the merged table passes the architecture's full check. The block's tensors come from the
//! MTP file, every other tensor from the main model (the file's own copies of the embedding and
//! head, the same checkpoint weights, are checked and not read).

use super::model::{architecture, is_fully_checked};
use super::model::{check_and_sort, hparams_of, model_name, tensor_infos, GgufModelError};
use super::GgufFile;
use crate::inventory::{HParams, InventoryError, ModelInventory, TensorInfo, TensorRole};

/// What is wrong with an MTP-only file or its pairing with the main model; every message
/// names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum MtpFileError {
    #[error("--mtp-model: {0}")]
    Gguf(#[from] GgufModelError),
    #[error("--mtp-model {file}: nextn_predict_layers is 0, so it holds no MTP block; pass the file llama.cpp's `convert_hf_to_gguf.py --mtp` writes (mtp-<name>.gguf)")]
    NoMtpBlock { file: String },
    #[error("--mtp-model {file}: tensor `{tensor}` belongs to main block {layer}, so this is a whole model, not an MTP-only GGUF; pass it as --model (its MTP block loads with it) and drop --mtp-model")]
    NotMtpOnly {
        file: String,
        tensor: String,
        layer: u32,
    },
    #[error("--mtp-model {file}: the main model {main} already has its MTP block (nextn_predict_layers = {nextn}); drop --mtp-model")]
    MainHasMtp {
        file: String,
        main: String,
        nextn: u32,
    },
    #[error("--mtp-model {file}: architecture `{found}` but the main model {main} is `{expected}`; convert the MTP block of the same checkpoint (convert_hf_to_gguf.py --mtp)")]
    Arch {
        file: String,
        main: String,
        found: String,
        expected: String,
    },
    #[error("--mtp-model {file}: MTP-only files are read for {supported}, not `{arch}`")]
    Unsupported {
        file: String,
        arch: String,
        supported: String,
    },
    #[error("--mtp-model {file}: `{key}` is {found} but the main model {main} has {expected}: the MTP file was converted from another model; convert the MTP block of the same checkpoint (convert_hf_to_gguf.py --mtp)")]
    HParam {
        file: String,
        main: String,
        key: String,
        found: String,
        expected: String,
    },
    #[error("--mtp-model {file}: tensor `{tensor}` has shape {found:?} but the main model {main} has {expected:?}: the MTP file was converted from another model")]
    Shape {
        file: String,
        main: String,
        tensor: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("--mtp-model {file}: {source}")]
    Layout {
        file: String,
        #[source]
        source: InventoryError,
    },
}

/// An MTP-only GGUF, read from its header.
#[derive(Debug, Clone, PartialEq)]
pub struct MtpFile {
    /// The path as given.
    pub path: String,
    pub arch: String,
    /// Its hyperparameters (`n_layer` = the main model's, `nextn_predict_layers` > 0).
    pub hparams: HParams,
    /// Every tensor of the file, in file order.
    pub tensors: Vec<TensorInfo>,
    /// [`ModelInventory::fingerprint`] of the file alone (its hyperparameters and tensors).
    pub fingerprint: String,
}

impl MtpFile {
    /// The MTP blocks' tensors (block `n_layer` and up).
    pub fn block_tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        let n = self.hparams.n_layer;
        self.tensors
            .iter()
            .filter(move |t| t.layer.is_some_and(|l| l >= n))
    }
}

/// Whether `g` looks like an MTP-only file: `nextn_predict_layers` > 0 and no tensor of a main
/// block (for the hint when such a file is given as `--model`).
pub fn is_mtp_only(g: &GgufFile) -> bool {
    let Ok(arch) = architecture(g) else {
        return false;
    };
    let key = |k: &str| format!("{arch}.{k}");
    let (Ok(Some(blocks)), Ok(Some(nextn))) = (
        g.get_u64(&key("block_count")),
        g.get_u64(&key("nextn_predict_layers")),
    ) else {
        return false;
    };
    let n_layer = blocks.saturating_sub(nextn);
    nextn > 0
        && g.tensors.iter().all(|t| {
            crate::arch::classify(&t.name)
                .1
                .is_none_or(|l| u64::from(l) >= n_layer)
        })
}

/// Read an MTP-only file's header: its hyperparameters, tensors and fingerprint; refused when
/// it has no MTP block or holds a main block's tensor.
pub fn read_mtp_file(g: &GgufFile) -> Result<MtpFile, MtpFileError> {
    let file = g.path.clone();
    let arch = architecture(g)?.to_string();
    if !is_fully_checked(&arch) {
        return Err(MtpFileError::Unsupported {
            file,
            arch,
            supported: crate::arch::SUPPORTED.join(", "),
        });
    }
    let tensors = tensor_infos(g)?;
    let hparams = hparams_of(g, &arch, &tensors)?;
    if hparams.nextn_predict_layers == 0 {
        return Err(MtpFileError::NoMtpBlock { file });
    }
    if let Some(t) = tensors
        .iter()
        .find(|t| t.layer.is_some_and(|l| l < hparams.n_layer))
    {
        return Err(MtpFileError::NotMtpOnly {
            file,
            tensor: t.name.clone(),
            layer: t.layer.unwrap_or(0),
        });
    }
    let fingerprint = ModelInventory {
        arch: arch.clone(),
        name: model_name(g)?,
        hparams: hparams.clone(),
        tensors: tensors.clone(),
        vision: None,
    }
    .fingerprint();
    Ok(MtpFile {
        path: file,
        arch,
        hparams,
        tensors,
        fingerprint,
    })
}

/// The first hyperparameter (by its JSON name) where `a` and `b` differ: (key, a's, b's).
fn first_difference(a: &HParams, b: &HParams) -> Option<(String, String, String)> {
    let (serde_json::Value::Object(a), serde_json::Value::Object(b)) = (
        serde_json::to_value(a).expect("hparams serialize to JSON infallibly"),
        serde_json::to_value(b).expect("hparams serialize to JSON infallibly"),
    ) else {
        return None;
    };
    a.iter().find_map(|(k, va)| {
        let vb = b.get(k).cloned().unwrap_or(serde_json::Value::Null);
        (*va != vb).then(|| (k.clone(), va.to_string(), vb.to_string()))
    })
}

/// The main model `main` (no MTP block) with the MTP block of `mtp`: the main model's tensors
/// and the file's block tensors, `nextn_predict_layers` set, checked and in canonical order.
pub fn merge_mtp_file(
    main: &ModelInventory,
    mtp: &MtpFile,
) -> Result<ModelInventory, MtpFileError> {
    let file = mtp.path.clone();
    let main_name = main.name.clone();
    if main.hparams.nextn_predict_layers > 0 {
        return Err(MtpFileError::MainHasMtp {
            file,
            main: main_name,
            nextn: main.hparams.nextn_predict_layers,
        });
    }
    if mtp.arch != main.arch {
        return Err(MtpFileError::Arch {
            file,
            main: main_name,
            found: mtp.arch.clone(),
            expected: main.arch.clone(),
        });
    }
    let hparams = HParams {
        nextn_predict_layers: mtp.hparams.nextn_predict_layers,
        ..main.hparams.clone()
    };
    // Whether the file carries its own `output` copy says nothing about the model: the block
    // uses the main model's head.
    let own = HParams {
        tied_embeddings: hparams.tied_embeddings,
        ..mtp.hparams.clone()
    };
    if let Some((key, found, expected)) = first_difference(&own, &hparams) {
        return Err(MtpFileError::HParam {
            file,
            main: main_name,
            key,
            found,
            expected,
        });
    }
    for t in mtp
        .tensors
        .iter()
        .filter(|t| t.layer.is_none() && matches!(t.role, TensorRole::Embedding | TensorRole::Head))
    {
        if let Some(m) = main.tensor(&t.name) {
            if m.dims != t.dims {
                return Err(MtpFileError::Shape {
                    file,
                    main: main_name,
                    tensor: t.name.clone(),
                    found: t.dims.clone(),
                    expected: m.dims.clone(),
                });
            }
        }
    }
    let mut tensors = main.tensors.clone();
    tensors.extend(mtp.block_tensors().cloned());
    check_and_sort(&main.arch, &hparams, &mut tensors)
        .map_err(|source| MtpFileError::Layout { file, source })?;
    Ok(ModelInventory {
        arch: main.arch.clone(),
        name: main.name.clone(),
        hparams,
        tensors,
        vision: main.vision.clone(),
    })
}
