//! Weights from the model file to their planned places: the host view of a model (a GGUF
//! file mmapped, or a Hugging Face safetensors folder, with an MTP-only GGUF beside it where
//! the plan names one: `load/mtp_file.rs`), the copy of every `Device`-placed
//! tensor into its arena offset (with progress: a bar on a terminal, log lines otherwise),
//! and the weight source a stage reads from its arena.
//! Invariant: a tensor is copied only to the `[offset, offset + bytes)` its placement names,
//! after checking that the host bytes have exactly the planned size and fit the arena;
//! routed-expert stacks placed `HostExperts` stay in host memory (the expert cache reads them).

mod mtp_file;

pub use mtp_file::{open_planned, MtpFileLoadError, WithMtpFile};

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
    #[error(transparent)]
    MtpFile(#[from] MtpFileLoadError),
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
    let f =
        strata_schemas::files::open_regular(path, "model file").map_err(|e| LoadError::Model {
            path: path.display().to_string(),
            msg: e.to_string(),
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
    pub(crate) fn from_header(
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
/// per-expert tensors are stacked once into host copies of the llama.cpp expert stacks, and
/// tensors whose values the GGUF layout changes (Qwen3-Next's) are converted once into host
/// copies, as `strata-gguf convert` converts them.
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
            use strata_schemas::gguf::hf_sources::{self, Transform};
            let src = hf_sources::sources(&inv.arch, &inv.hparams, &t.name, &t.dims);
            // Stored 1:1 but with other values (Qwen3-Next's zero-centred norms, `A_log`).
            let changed = src.as_ref().is_some_and(|s| s.transform != Transform::Copy);
            let main_stack =
                t.role == TensorRole::ExpertStack && header.tensor(&expert_name(t, 0)).is_some();
            match (changed, t.file_offset) {
                (false, Some(o)) => {
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
                (false, None) if main_stack => {}
                _ => {
                    // Values the GGUF layout changes (the above, the regrouped
                    // `in_proj_qkvz`) or experts outside the main layers (Qwen3-Next's MTP
                    // block, `mtp.layers.K`): built once here, as `strata-gguf convert`
                    // writes them.
                    let buf = converted(t, src.as_ref(), &header, &map).map_err(merr)?;
                    stacks.insert(t.name.clone(), buf);
                    continue;
                }
            }
            let mut buf = Vec::with_capacity(t.bytes as usize);
            for e in 0..n_expert {
                let hf = expert_name(t, e);
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

/// The Hugging Face name of expert `e`'s matrix in main-layer expert stack `t`.
fn expert_name(t: &strata_schemas::inventory::TensorInfo, e: u64) -> String {
    let proj = if t.name.contains("ffn_gate_exps") {
        "gate_proj"
    } else if t.name.contains("ffn_up_exps") {
        "up_proj"
    } else {
        "down_proj"
    };
    format!(
        "model.layers.{}.mlp.experts.{e}.{proj}.weight",
        t.layer.unwrap_or(0)
    )
}

/// The bytes of GGUF tensor `t` built from its pieces in the folder's one safetensors file
/// (`header`, mapped as `map`): rows gathered in order, decoded to f32, transformed, and
/// stored as `t`'s type — the values `strata-gguf convert` writes for it.
fn converted(
    t: &strata_schemas::inventory::TensorInfo,
    src: Option<&strata_schemas::gguf::hf_sources::Sources>,
    header: &strata_schemas::safetensors::SafetensorsHeader,
    map: &Mmap,
) -> Result<Vec<u8>, String> {
    use strata_schemas::safetensors::StDtype;
    let src = src.ok_or_else(|| {
        format!(
            "tensor `{}` has no Hugging Face source this loader knows; convert the model to GGUF",
            t.name
        )
    })?;
    let ne0 = t.dims[0] as usize;
    let mut x: Vec<f32> = Vec::new();
    for p in &src.pieces {
        let st = header
            .tensor(&p.hf)
            .ok_or_else(|| format!("`{}` (for `{}`) is missing", p.hf, t.name))?;
        let width = match st.dtype {
            StDtype::F32 => 4,
            StDtype::F16 | StDtype::BF16 => 2,
            other => {
                return Err(format!(
                    "`{}` is {other}; only F32, F16 and BF16 tensors are converted on load",
                    p.hf
                ))
            }
        };
        let a = (header.data_start + st.begin) as usize + p.row0 as usize * ne0 * width;
        let n = p.rows as usize * ne0 * width;
        let raw = map
            .get(a..a + n)
            .ok_or_else(|| format!("`{}` runs past the end of the file", p.hf))?;
        x.extend(raw.chunks_exact(width).map(|b| match st.dtype {
            StDtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            StDtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            _ => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        }));
    }
    src.transform.apply(&mut x);
    let rb = t.ggml_type.bytes_for(ne0 as u64).ok_or_else(|| {
        format!(
            "tensor `{}`: rows of {ne0} do not fit {}",
            t.name, t.ggml_type
        )
    })? as usize;
    if ne0 == 0 || x.len() % ne0 != 0 || (x.len() / ne0) as u64 * rb as u64 != t.bytes {
        return Err(format!(
            "tensor `{}`: its pieces hold {} values, the inventory says {} bytes of {}",
            t.name,
            x.len(),
            t.bytes,
            t.ggml_type
        ));
    }
    let mut out = vec![0u8; t.bytes as usize];
    for (row, o) in x.chunks_exact(ne0).zip(out.chunks_exact_mut(rb)) {
        crate::quant::quantize_row_into(t.ggml_type, row, o)
            .map_err(|e| format!("tensor `{}`: {e}", t.name))?;
    }
    Ok(out)
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

/// A weight tensor holding NaN or infinite values (or, for a quantized tensor, blocks whose
/// scale is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFinite {
    pub tensor: String,
    /// Values (F32/F16/BF16) or blocks (Q8_0/Q4_K) that are not finite.
    pub count: u64,
    /// "values" or "blocks".
    pub unit: &'static str,
}

/// Non-finite values in `bytes` of a tensor of type `ty`: (count, unit); `None` for types
/// this check does not decode.
fn count_non_finite(ty: GgmlType, bytes: &[u8]) -> Option<(u64, &'static str)> {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).is_finite();
    let n = match ty {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .filter(|b| !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite())
            .count(),
        GgmlType::F16 => bytes.chunks_exact(2).filter(|b| !f16(b)).count(),
        GgmlType::BF16 => bytes
            .chunks_exact(2)
            .filter(|b| !half::bf16::from_le_bytes([b[0], b[1]]).is_finite())
            .count(),
        // Blocks of an f16 scale and 32 int8 quants: only the scale can be non-finite.
        GgmlType::Q8_0 => {
            return Some((
                bytes.chunks_exact(34).filter(|b| !f16(b)).count() as u64,
                "blocks",
            ))
        }
        // Blocks of f16 d, f16 dmin, 12 bytes of 6-bit scales and 128 bytes of quants.
        GgmlType::Q4K => {
            let bad = bytes
                .chunks_exact(144)
                .filter(|b| !f16(&b[0..2]) || !f16(&b[2..4]))
                .count();
            return Some((bad as u64, "blocks"));
        }
        _ => return None,
    };
    Some((n as u64, "values"))
}

/// Every weight tensor of `host` with NaN or infinite values, in inventory order; the
/// tensors are scanned in parallel. Types other than F32, F16, BF16, Q8_0 and Q4_K are not
/// decoded here (their scales are checked nowhere yet).
pub fn non_finite_weights(host: &dyn HostModel) -> Vec<NonFinite> {
    use rayon::prelude::*;
    host.inventory()
        .tensors
        .par_iter()
        .filter_map(|t| {
            let bytes = host.tensor_bytes(&t.name)?;
            let (count, unit) = count_non_finite(t.ggml_type, bytes)?;
            (count > 0).then(|| NonFinite {
                tensor: t.name.clone(),
                count,
                unit,
            })
        })
        .collect()
}

/// One line naming the broken tensors (the first few, and how many more).
pub fn non_finite_summary(found: &[NonFinite]) -> String {
    let mut parts: Vec<String> = found
        .iter()
        .take(5)
        .map(|n| format!("`{}` ({} {})", n.tensor, n.count, n.unit))
        .collect();
    if found.len() > 5 {
        parts.push(format!("and {} more tensors", found.len() - 5));
    }
    format!(
        "the model has NaN or infinite weights: {}; such a model generates garbage (a damaged download or a bad conversion): re-download or re-convert it",
        parts.join(", ")
    )
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
    let bar = progress_bar(progress, total, "loading");
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

/// A model held in memory (tests, references, op checks): an inventory built from its
/// tensors and the hyperparameters given.
pub struct MemModel {
    inv: ModelInventory,
    weights: crate::model::MemWeights,
    path: PathBuf,
}

impl MemModel {
    /// `weights` as a model of architecture `arch` with hyperparameters `hp`.
    pub fn new(
        arch: &str,
        hp: strata_schemas::inventory::HParams,
        weights: crate::model::MemWeights,
    ) -> Result<Self, LoadError> {
        let mut tensors = Vec::new();
        for name in weights.names() {
            let t = weights.get(name).ok_or_else(|| LoadError::Missing {
                name: name.into(),
                path: "memory".into(),
            })?;
            let (role, layer) = strata_schemas::arch::classify(name);
            let info = strata_schemas::inventory::TensorInfo::new(
                name,
                t.dims.clone(),
                t.ggml_type,
                role,
                layer,
            )
            .map_err(|e| LoadError::Model {
                path: "memory".into(),
                msg: e.to_string(),
            })?;
            tensors.push(info);
        }
        Ok(Self {
            inv: ModelInventory {
                arch: arch.into(),
                name: "in-memory".into(),
                hparams: hp,
                tensors,
                vision: None,
            },
            weights,
            path: PathBuf::from("(memory)"),
        })
    }
}

impl HostModel for MemModel {
    fn inventory(&self) -> &ModelInventory {
        &self.inv
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.weights.get(name).map(|t| &t.data[..])
    }
    fn host_bytes(&self) -> (u64, u64) {
        (0, self.inv.tensors.iter().map(|t| t.bytes).sum())
    }
}

/// Load progress of `total` bytes labelled `what` on stderr, when asked for: a bar on a
/// terminal, else a `tracing` info line (target `strata_exec::load`) at each tenth and at
/// the end (so a server's log, text or JSON, shows how far loading is).
pub fn progress_bar(progress: bool, total: u64, what: &str) -> Progress {
    let hidden = Progress {
        bar: indicatif::ProgressBar::hidden(),
        lines: None,
    };
    if !progress {
        return hidden;
    }
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return Progress {
            lines: Some(Lines {
                what: what.to_string(),
                total,
                done: std::cell::Cell::new(0),
                tenths: std::cell::Cell::new(0),
                t0: std::time::Instant::now(),
            }),
            ..hidden
        };
    }
    let b = indicatif::ProgressBar::new(total);
    if let Ok(style) = indicatif::ProgressStyle::with_template(&format!(
        "{what} {{bar:40}} {{bytes}}/{{total_bytes}} {{binary_bytes_per_sec}} eta {{eta}}"
    )) {
        b.set_style(style);
    }
    Progress {
        bar: b,
        lines: None,
    }
}

/// Load progress: an `indicatif` bar, or log lines when stderr is not a terminal.
pub struct Progress {
    bar: indicatif::ProgressBar,
    lines: Option<Lines>,
}

struct Lines {
    what: String,
    total: u64,
    done: std::cell::Cell<u64>,
    /// Tenths already reported.
    tenths: std::cell::Cell<u64>,
    t0: std::time::Instant,
}

impl Progress {
    /// `n` more bytes are done.
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
        if let Some(l) = &self.lines {
            l.done.set(l.done.get() + n);
            let tenths = (l.done.get() * 10).checked_div(l.total).unwrap_or(10);
            if tenths > l.tenths.get() && tenths < 10 {
                l.tenths.set(tenths);
                tracing::info!(
                    target: "strata_exec::load",
                    "{} {}% ({} of {} MiB, {:.1} s)",
                    l.what,
                    tenths * 10,
                    l.done.get() >> 20,
                    l.total >> 20,
                    l.t0.elapsed().as_secs_f64()
                );
            }
        }
    }

    /// Loading ended: the bar goes away; the log says how much took how long.
    pub fn finish_and_clear(&self) {
        self.bar.finish_and_clear();
        if let Some(l) = &self.lines {
            tracing::info!(
                target: "strata_exec::load",
                "{} done: {} MiB in {:.1} s",
                l.what,
                l.done.get() >> 20,
                l.t0.elapsed().as_secs_f64()
            );
        }
    }
}

/// The tensors of one device as a [`WeightSource`] over its arena.
pub struct ArenaWeights<'a> {
    map: HashMap<String, (GgmlType, Vec<u64>, &'a [u8])>,
    /// The device these views are on.
    device: u32,
    /// Where the plan puts each tensor this device does not hold (device indexes; empty when
    /// it leaves the tensor in host memory).
    elsewhere: HashMap<String, Vec<u32>>,
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
        let mut elsewhere: HashMap<String, Vec<u32>> = HashMap::new();
        for t in &plan.tensors {
            let Placement::Device { device: d, offset } = t.placement else {
                elsewhere.entry(t.name.clone()).or_default();
                continue;
            };
            if d != device {
                elsewhere.entry(t.name.clone()).or_default().push(d);
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
        for name in map.keys() {
            elsewhere.remove(name);
        }
        Ok(Self {
            map,
            device,
            elsewhere,
        })
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

    fn absent_why(&self, name: &str) -> Option<String> {
        let on = self.elsewhere.get(name)?;
        let place = if on.is_empty() {
            "leaves it in host memory".to_string()
        } else {
            let list: Vec<String> = on.iter().map(u32::to_string).collect();
            format!("places it on device {} only", list.join(", "))
        };
        Some(format!(
            "the plan {place}, and device {}'s stage needs it: re-plan with this build's strata-plan",
            self.device
        ))
    }
}

#[cfg(test)]
mod nan_tests {
    #[test]
    fn non_finite_values_and_scales_are_counted() {
        use super::count_non_finite;
        use strata_schemas::ggml::GgmlType;
        let f32s: Vec<u8> = [1.0f32, f32::NAN, f32::INFINITY, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(GgmlType::F32, &f32s), Some((2, "values")));
        let f16s: Vec<u8> = [half::f16::ONE, half::f16::NAN, half::f16::NEG_INFINITY]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(GgmlType::F16, &f16s), Some((2, "values")));
        let bf: Vec<u8> = [half::bf16::ONE, half::bf16::NAN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(GgmlType::BF16, &bf), Some((1, "values")));
        let mut q8 = vec![0u8; 34 * 3];
        q8[34..36].copy_from_slice(&half::f16::NAN.to_le_bytes());
        assert_eq!(count_non_finite(GgmlType::Q8_0, &q8), Some((1, "blocks")));
        let mut q4k = vec![0u8; 144 * 2];
        q4k[144 + 2..144 + 4].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
        assert_eq!(count_non_finite(GgmlType::Q4K, &q4k), Some((1, "blocks")));
        assert_eq!(count_non_finite(GgmlType::Q4_0, &q8), None);
    }
}
