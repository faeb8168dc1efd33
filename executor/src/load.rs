//! Weights from the model file to their planned places: the host view of a model (a GGUF
//! file mmapped, or a Hugging Face safetensors folder), the copy of every `Device`-placed
//! tensor into its arena offset (with a progress bar), and the weight source a stage reads
//! from its arena.
//! Invariant: a tensor is copied only to the `[offset, offset + bytes)` its placement names,
//! after checking that the host bytes have exactly the planned size and fit the arena;
//! routed-expert stacks placed `HostExperts` stay in host memory (the expert cache reads them).

use crate::bind::{BindError, Binding};
use crate::model::{WeightSource, WeightView};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use strata_schemas::ggml::GgmlType;
use strata_schemas::inventory::{ModelInventory, TensorRole};
use strata_schemas::plan::{Placement, Plan};

/// A model file problem, naming the path and the tensor.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {msg}")]
    Model { path: String, msg: String },
    #[error("tensor `{name}`: the plan places {planned} bytes but the model file has {got}: the plan was made for another file")]
    Size {
        name: String,
        planned: u64,
        got: u64,
    },
    #[error("tensor `{name}` is in the plan but not in the model file {path}")]
    Missing { name: String, path: String },
    #[error(transparent)]
    Bind(#[from] BindError),
}

/// A model as host memory: its inventory and every tensor's bytes (GGUF layout).
pub trait HostModel: Send + Sync {
    fn inventory(&self) -> &ModelInventory;
    fn path(&self) -> &Path;
    /// The bytes of tensor `name` (GGUF order and encoding).
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]>;
    /// Bytes mmapped from disk plus bytes held in converted host copies.
    fn host_bytes(&self) -> (u64, u64);
}

fn mmap(path: &Path) -> Result<Mmap, LoadError> {
    let f = strata_schemas::files::open_regular(path, "model file").map_err(|e| {
        LoadError::Model {
            path: path.display().to_string(),
            msg: e.to_string(),
        }
    })?;
    // SAFETY: the file is mapped read-only; like every mmap-based loader we rely on it not
    // being truncated while we run (a changed model file is the user's error).
    unsafe { Mmap::map(&f) }.map_err(|e| LoadError::Model {
        path: path.display().to_string(),
        msg: format!("mmap: {e}"),
    })
}

/// A GGUF file (all parts of a split model) mmapped.
pub struct GgufModel {
    path: PathBuf,
    inv: ModelInventory,
    maps: Vec<Mmap>,
    /// name -> (part, absolute offset, bytes)
    index: HashMap<String, (usize, u64, u64)>,
}

impl GgufModel {
    /// Map `path` (and its split parts) and index its tensors; `inv` is the file's inventory.
    pub fn open_with_inventory(path: &Path, inv: ModelInventory) -> Result<Self, LoadError> {
        let g = strata_schemas::gguf::read_gguf(path).map_err(|e| LoadError::Model {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        Self::from_header(path, inv, &g)
    }

    /// Map the parts of an already-read header `g` and index its tensors.
    fn from_header(
        path: &Path,
        inv: ModelInventory,
        g: &strata_schemas::gguf::GgufFile,
    ) -> Result<Self, LoadError> {
        let mut maps = Vec::with_capacity(g.parts.len());
        for p in &g.parts {
            maps.push(mmap(Path::new(&p.path))?);
        }
        let mut index = HashMap::new();
        for t in &g.tensors {
            let off = g.tensor_file_offset(t).ok_or_else(|| LoadError::Model {
                path: path.display().to_string(),
                msg: format!(
                    "tensor `{}` names part {} that does not exist",
                    t.name, t.part
                ),
            })?;
            let part = t.part as usize;
            let end = off.checked_add(t.bytes);
            if end.is_none_or(|e| e > maps[part].len() as u64) {
                return Err(LoadError::Model {
                    path: g.parts[part].path.clone(),
                    msg: format!(
                        "tensor `{}` at [{off}, +{}) runs past the end of the file ({} bytes): truncated download?",
                        t.name,
                        t.bytes,
                        maps[part].len()
                    ),
                });
            }
            index.insert(t.name.clone(), (part, off, t.bytes));
        }
        Ok(Self {
            path: path.to_path_buf(),
            inv,
            maps,
            index,
        })
    }

    /// Open a GGUF file, building its inventory from the header (the same mapping the
    /// planner's `--model x.gguf` uses, so the plan's fingerprint matches).
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let (inv, g) =
            strata_schemas::gguf::model::load_gguf_model(path).map_err(|e| LoadError::Model {
                path: path.display().to_string(),
                msg: e.to_string(),
            })?;
        Self::from_header(path, inv, &g)
    }
}

impl HostModel for GgufModel {
    fn inventory(&self) -> &ModelInventory {
        &self.inv
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        let (p, off, n) = *self.index.get(name)?;
        self.maps[p].get(off as usize..(off + n) as usize)
    }
    fn host_bytes(&self) -> (u64, u64) {
        (self.maps.iter().map(|m| m.len() as u64).sum(), 0)
    }
}

/// A Hugging Face folder with one `model.safetensors`: 1:1 tensors are read from the mmap;
/// per-expert tensors are stacked once into host copies of the llama.cpp expert stacks.
pub struct SafetensorsModel {
    path: PathBuf,
    inv: ModelInventory,
    map: Mmap,
    /// name -> (absolute offset, bytes) in the mmap
    index: HashMap<String, (u64, u64)>,
    stacks: HashMap<String, Vec<u8>>,
}

impl SafetensorsModel {
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let merr = |msg: String| LoadError::Model {
            path: dir.display().to_string(),
            msg,
        };
        let inv = strata_schemas::safetensors::load_folder(dir).map_err(|e| merr(e.to_string()))?;
        let file = dir.join("model.safetensors");
        if !file.is_file() {
            return Err(merr(
                "only single-file folders (model.safetensors) can be run; convert a sharded model to GGUF".into(),
            ));
        }
        let header =
            strata_schemas::safetensors::read_header(&file).map_err(|e| merr(e.to_string()))?;
        let map = mmap(&file)?;
        let mut index = HashMap::new();
        let mut stacks = HashMap::new();
        let n_expert = inv.hparams.n_expert;
        for t in &inv.tensors {
            if let Some(o) = t.file_offset {
                let at = header.data_start + o;
                if at + t.bytes > map.len() as u64 {
                    return Err(merr(format!(
                        "tensor `{}` runs past the end of the file",
                        t.name
                    )));
                }
                index.insert(t.name.clone(), (at, t.bytes));
                continue;
            }
            if t.role != TensorRole::ExpertStack {
                return Err(merr(format!(
                    "tensor `{}` is not stored 1:1 in the folder (converted values); convert the model to GGUF",
                    t.name
                )));
            }
            let layer = t.layer.unwrap_or(0);
            let proj = if t.name.contains("ffn_gate_exps") {
                "gate_proj"
            } else if t.name.contains("ffn_up_exps") {
                "up_proj"
            } else {
                "down_proj"
            };
            let mut buf = Vec::with_capacity(t.bytes as usize);
            for e in 0..n_expert {
                let hf = format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight");
                let st = header
                    .tensor(&hf)
                    .ok_or_else(|| merr(format!("`{hf}` missing for stack `{}`", t.name)))?;
                let a = (header.data_start + st.begin) as usize;
                let b = (header.data_start + st.end) as usize;
                buf.extend_from_slice(
                    map.get(a..b)
                        .ok_or_else(|| merr(format!("`{hf}` runs past the end of the file")))?,
                );
            }
            if buf.len() as u64 != t.bytes {
                return Err(merr(format!(
                    "stack `{}` has {} bytes from its experts, the inventory says {}",
                    t.name,
                    buf.len(),
                    t.bytes
                )));
            }
            stacks.insert(t.name.clone(), buf);
        }
        Ok(Self {
            path: dir.to_path_buf(),
            inv,
            map,
            index,
            stacks,
        })
    }
}

impl HostModel for SafetensorsModel {
    fn inventory(&self) -> &ModelInventory {
        &self.inv
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        if let Some(v) = self.stacks.get(name) {
            return Some(v);
        }
        let (off, n) = *self.index.get(name)?;
        self.map.get(off as usize..(off + n) as usize)
    }
    fn host_bytes(&self) -> (u64, u64) {
        (
            self.map.len() as u64,
            self.stacks.values().map(|v| v.len() as u64).sum(),
        )
    }
}

/// Open `--model PATH`: a folder is a safetensors model, anything else a GGUF file.
pub fn open_model(path: &Path) -> Result<Box<dyn HostModel>, LoadError> {
    if path.is_dir() {
        Ok(Box::new(SafetensorsModel::open(path)?))
    } else {
        Ok(Box::new(GgufModel::open(path)?))
    }
}

/// The model file is not the one the plan was made for.
#[derive(Debug, thiserror::Error)]
#[error("the model {path} has fingerprint {file} but the plan was made for {plan} ({source_path}): re-run strata-plan on this model")]
pub struct FingerprintMismatch {
    pub path: String,
    pub file: String,
    pub plan: String,
    pub source_path: String,
}

/// Check, before anything is allocated, that `host` is the model `plan` was made for.
pub fn check_fingerprint(plan: &Plan, host: &dyn HostModel) -> Result<(), FingerprintMismatch> {
    let file = host.inventory().fingerprint();
    if file != plan.model.fingerprint {
        return Err(FingerprintMismatch {
            path: host.path().display().to_string(),
            file,
            plan: plan.model.fingerprint.clone(),
            source_path: plan.model.source.clone(),
        });
    }
    Ok(())
}

/// Check, before touching an arena, that every planned tensor exists in `host` with the
/// planned size.
pub fn check_tensors(plan: &Plan, host: &dyn HostModel) -> Result<(), LoadError> {
    for t in &plan.tensors {
        if matches!(t.placement, Placement::Host) {
            continue;
        }
        let got = host
            .tensor_bytes(&t.name)
            .ok_or_else(|| LoadError::Missing {
                name: t.name.clone(),
                path: host.path().display().to_string(),
            })?;
        if got.len() as u64 != t.bytes {
            return Err(LoadError::Size {
                name: t.name.clone(),
                planned: t.bytes,
                got: got.len() as u64,
            });
        }
    }
    Ok(())
}

/// What loading did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadStats {
    pub tensors: u64,
    pub bytes: u64,
}

/// Copy every `Device`-placed tensor into its arena offset. A progress bar (bytes, bytes/s)
/// is drawn on stderr when `progress` and stderr is a terminal.
pub fn load_weights(
    plan: &Plan,
    binding: &mut Binding,
    host: &dyn HostModel,
    progress: bool,
) -> Result<LoadStats, LoadError> {
    check_tensors(plan, host)?;
    let total: u64 = plan
        .tensors
        .iter()
        .filter(|t| matches!(t.placement, Placement::Device { .. }))
        .map(|t| t.bytes)
        .sum();
    let bar = if progress && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let b = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "loading {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        ) {
            b.set_style(style);
        }
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut stats = LoadStats {
        tensors: 0,
        bytes: 0,
    };
    for t in &plan.tensors {
        if let Placement::Device { device, offset } = t.placement {
            let data = host
                .tensor_bytes(&t.name)
                .ok_or_else(|| LoadError::Missing {
                    name: t.name.clone(),
                    path: host.path().display().to_string(),
                })?;
            binding.write(device, offset, data)?;
            stats.tensors += 1;
            stats.bytes += t.bytes;
            bar.inc(t.bytes);
        }
    }
    bar.finish_and_clear();
    Ok(stats)
}

/// The tensors of one device as a [`WeightSource`] over its arena.
pub struct ArenaWeights<'a> {
    map: HashMap<String, (GgmlType, Vec<u64>, &'a [u8])>,
}

impl<'a> ArenaWeights<'a> {
    /// Every tensor placed on `device`, each viewed at its own planned bytes of the arena.
    ///
    /// # Safety
    /// `binding` must outlive `'a`, and nothing may write those bytes while the views live
    /// (load first, then build this).
    pub unsafe fn from_binding(
        plan: &Plan,
        inv: &ModelInventory,
        device: u32,
        binding: &Binding,
    ) -> Result<Self, LoadError> {
        let mut map = HashMap::new();
        for t in &plan.tensors {
            let Placement::Device { device: d, offset } = t.placement else {
                continue;
            };
            if d != device {
                continue;
            }
            let info = inv.tensor(&t.name).ok_or_else(|| LoadError::Missing {
                name: t.name.clone(),
                path: "the model inventory".into(),
            })?;
            let view = binding.arena_view(device, offset, t.bytes)?;
            // SAFETY: bounds checked by `arena_view`; liveness and no-writes are this
            // function's contract.
            let data: &'a [u8] = unsafe { view.slice() };
            map.insert(t.name.clone(), (info.ggml_type, info.dims.clone(), data));
        }
        Ok(Self { map })
    }
}

impl WeightSource for ArenaWeights<'_> {
    fn tensor(&self, name: &str) -> Option<WeightView<'_>> {
        self.map.get(name).map(|(ty, dims, data)| WeightView {
            ggml_type: *ty,
            dims,
            data,
        })
    }
}
