//! The Qwen3-MoE forward pass on the CPU reference backend, as transformers'
//! `Qwen3MoeForCausalLM` computes it in float32: embedding, RMSNorm, Q/K per-head RMSNorm,
//! NEOX RoPE (optionally YaRN), causal GQA over per-slot KV caches, softmax router with
//! top-k (and `norm_topk_prob`), SwiGLU experts, output norm and LM head.
//! Invariant: all tensor shapes are checked once in `Model::new`; KV storage is fixed at
//! slot creation and scratch at model creation, so a decode step allocates nothing; a
//! token's logits never depend on which other tokens share its batch.

use super::{WeightSource, WeightView};
use crate::backend::cpu::{self, AttnShape, Matrix, OpError, Rope, Yarn};
use crate::quant::{self, QuantError};
use strata_schemas::ggml::GgmlType;
use strata_schemas::inventory::{HParams, LayerKind};
use strata_schemas::serve::RopeScaling;

/// A problem with the model, a slot or a request, naming the tensor, slot or token.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    #[error("tensor `{name}` is missing: a qwen3moe model needs it (was the file converted for another architecture?)")]
    MissingTensor { name: String },
    #[error("tensor `{name}` has dims {got:?} but the hyperparameters say {expected:?} (GGUF order, ne0 first)")]
    BadShape {
        name: String,
        expected: Vec<u64>,
        got: Vec<u64>,
    },
    #[error("tensor `{name}` holds {got} bytes but {ty} with dims {dims:?} needs {expected}")]
    BadBytes {
        name: String,
        ty: GgmlType,
        dims: Vec<u64>,
        expected: u64,
        got: u64,
    },
    #[error("tensor `{name}`: {source}")]
    Tensor { name: String, source: QuantError },
    #[error("hyperparameter `{key}`: {reason}")]
    HParam { key: &'static str, reason: String },
    #[error("KV cache: {0}")]
    Kv(String),
    #[error("slot {slot} does not exist (the model has {n_slots}; add one with Model::add_slot)")]
    NoSlot { slot: usize, n_slots: usize },
    #[error("slot {slot} holds {len} of {capacity} cells; {more} more do not fit (raise the context or clear the slot)")]
    ContextFull {
        slot: usize,
        len: usize,
        capacity: usize,
        more: usize,
    },
    #[error("token {token} is outside the vocabulary of {n_vocab}")]
    BadToken { token: u32, n_vocab: usize },
    #[error("{what} of {n} exceeds the model's max_batch_tokens {max} (raise ModelOptions::max_batch_tokens)")]
    BatchTooLarge {
        what: &'static str,
        n: usize,
        max: usize,
    },
    #[error("{0}")]
    Request(String),
    #[error(transparent)]
    Op(#[from] OpError),
}

/// Options fixed at model creation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelOptions {
    /// The most tokens one forward runs: the largest prefill ubatch and the largest decode
    /// batch. Scratch is sized from it once.
    pub max_batch_tokens: usize,
    /// YaRN rope scaling, when the serve settings ask for it.
    pub yarn: Option<Yarn>,
}

impl ModelOptions {
    /// `max_batch_tokens` with no rope scaling.
    pub fn new(max_batch_tokens: usize) -> Self {
        Self {
            max_batch_tokens,
            yarn: None,
        }
    }
}

/// YaRN parameters from the serve settings (`--rope-scale`, `--yarn-orig-ctx`; the original
/// context defaults to the model's trained context).
pub fn yarn_from_settings(rs: &RopeScaling, hp: &HParams) -> Result<Yarn, ModelError> {
    if rs.kind != "yarn" {
        return Err(ModelError::HParam {
            key: "rope_scaling",
            reason: format!("`{}` is not supported: use yarn", rs.kind),
        });
    }
    Ok(Yarn::new(rs.factor, rs.orig_ctx.unwrap_or(hp.n_ctx_train)))
}

fn to_usize(key: &'static str, v: u64) -> Result<usize, ModelError> {
    usize::try_from(v).map_err(|_| ModelError::HParam {
        key,
        reason: format!("{v} does not fit in memory on this machine"),
    })
}

#[derive(Debug, Clone, Copy)]
struct Dims {
    n_layer: usize,
    n_embd: usize,
    n_vocab: usize,
    n_head: usize,
    n_head_kv: usize,
    hd_k: usize,
    hd_v: usize,
    n_expert: usize,
    n_used: usize,
    n_ff_exp: usize,
    n_ff: usize,
    eps: f32,
    norm_topk: bool,
}

/// The geometry of one slot's KV region, derived from the hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KvGeom {
    ty: GgmlType,
    n_layer: usize,
    n_cells: usize,
    k_row_elems: usize,
    v_row_elems: usize,
    krb: usize,
    vrb: usize,
}

impl KvGeom {
    fn new(hp: &HParams, ty: GgmlType, n_cells: usize) -> Result<Self, ModelError> {
        Self::for_layers(hp, ty, hp.n_layer as usize, n_cells)
    }

    fn for_layers(
        hp: &HParams,
        ty: GgmlType,
        n_layer: usize,
        n_cells: usize,
    ) -> Result<Self, ModelError> {
        if !quant::is_kv_type(ty) {
            return Err(ModelError::Kv(format!(
                "type {ty} cannot hold KV rows: use f16 or q8_0 (or f32)"
            )));
        }
        let k_row_elems = to_usize("attention.head_count_kv", hp.n_head_kv * hp.head_dim_k)?;
        let v_row_elems = to_usize("attention.head_count_kv", hp.n_head_kv * hp.head_dim_v)?;
        let kv_err = |e: QuantError| {
            ModelError::Kv(format!(
                "{e} (a KV row is n_head_kv x head_dim; pick --kv f16 when it is not a multiple of the block)"
            ))
        };
        let krb = quant::row_bytes(ty, k_row_elems).map_err(kv_err)?;
        let vrb = quant::row_bytes(ty, v_row_elems).map_err(kv_err)?;
        Ok(Self {
            ty,
            n_layer,
            n_cells,
            k_row_elems,
            v_row_elems,
            krb,
            vrb,
        })
    }

    fn bytes(&self) -> Option<u64> {
        (self.n_layer as u64)
            .checked_mul(self.n_cells as u64)?
            .checked_mul((self.krb + self.vrb) as u64)
    }

    /// Bytes of one cell across every layer (K and V rows).
    fn cell_bytes(&self) -> usize {
        self.n_layer * (self.krb + self.vrb)
    }
}

#[derive(Debug)]
enum KvBuf<'a> {
    Owned(Vec<u8>),
    Region(&'a mut [u8]),
}

impl KvBuf<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            KvBuf::Owned(v) => v,
            KvBuf::Region(r) => r,
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            KvBuf::Owned(v) => v,
            KvBuf::Region(r) => r,
        }
    }
}

/// One slot's KV cache: for each layer, `n_cells` K rows then `n_cells` V rows, every row
/// `n_head_kv x head_dim` elements of the KV type. The storage is fixed at construction
/// (an owned buffer or a caller's region) and never grows.
#[derive(Debug)]
pub struct KvCache<'a> {
    g: KvGeom,
    len: usize,
    /// Cells `[0, n_res)`, layer-major: per layer `n_res` K rows then `n_res` V rows.
    buf: KvBuf<'a>,
    n_res: usize,
    /// Cells `[n_res, n_cells)`, one slice each: per layer a K row then a V row.
    spill: Vec<&'a mut [u8]>,
}

impl<'a> KvCache<'a> {
    /// Bytes a cache of `n_cells` cells of type `ty` needs for this model
    /// (`n_layer x n_cells x HParams::kv_bytes_per_cell_layer(ty)`).
    pub fn bytes_needed(hp: &HParams, ty: GgmlType, n_cells: usize) -> Result<u64, ModelError> {
        KvGeom::new(hp, ty, n_cells)?
            .bytes()
            .ok_or_else(|| ModelError::Kv(format!("{n_cells} cells overflow u64 bytes")))
    }

    /// A cache that owns its storage, allocated once here.
    pub fn new_owned(hp: &HParams, ty: GgmlType, n_cells: usize) -> Result<Self, ModelError> {
        let g = KvGeom::new(hp, ty, n_cells)?;
        let n = g
            .bytes()
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| ModelError::Kv(format!("{n_cells} cells do not fit in memory")))?;
        Ok(Self {
            g,
            len: 0,
            buf: KvBuf::Owned(vec![0u8; n]),
            n_res: n_cells,
            spill: Vec::new(),
        })
    }

    /// A cache living in a caller's region (a planned arena slice) of at least
    /// `bytes_needed` bytes; extra bytes are left untouched.
    pub fn in_region(
        hp: &HParams,
        ty: GgmlType,
        n_cells: usize,
        region: &'a mut [u8],
    ) -> Result<Self, ModelError> {
        let g = KvGeom::new(hp, ty, n_cells)?;
        let need = g.bytes().unwrap_or(u64::MAX);
        if (region.len() as u64) < need {
            return Err(ModelError::Kv(format!(
                "the region holds {} bytes but {n_cells} cells of {ty} need {need}",
                region.len()
            )));
        }
        let need = need as usize;
        Ok(Self {
            g,
            len: 0,
            buf: KvBuf::Region(&mut region[..need]),
            n_res: n_cells,
            spill: Vec::new(),
        })
    }

    /// Bytes one cell takes across `n_layer` layers (a K row and a V row per layer): the
    /// size of one spilled cell, and `resident / n_res` of a resident window.
    pub fn cell_bytes(hp: &HParams, ty: GgmlType, n_layer: usize) -> Result<u64, ModelError> {
        Ok(KvGeom::for_layers(hp, ty, n_layer, 1)?.cell_bytes() as u64)
    }

    /// A cache of a stage holding `n_layer` layers, whose first `resident_cells` cells live in
    /// `resident` (a planned `kv_cache` slice, layer-major) and whose other cells each live
    /// in one slice of `spill` (planned `kv_spill` host memory); capacity is
    /// `resident_cells + spill.len()`.
    pub fn split(
        hp: &HParams,
        ty: GgmlType,
        n_layer: usize,
        resident_cells: usize,
        resident: &'a mut [u8],
        spill: Vec<&'a mut [u8]>,
    ) -> Result<Self, ModelError> {
        let g = KvGeom::for_layers(hp, ty, n_layer, resident_cells + spill.len())?;
        let need = g.cell_bytes() * resident_cells;
        if resident.len() < need {
            return Err(ModelError::Kv(format!(
                "the resident KV slice holds {} bytes but {resident_cells} cells of {n_layer} layers of {ty} need {need}",
                resident.len()
            )));
        }
        if let Some((i, c)) = spill
            .iter()
            .enumerate()
            .find(|(_, c)| c.len() < g.cell_bytes())
        {
            return Err(ModelError::Kv(format!(
                "spilled KV cell {i} holds {} bytes but a cell of {n_layer} layers of {ty} needs {}",
                c.len(),
                g.cell_bytes()
            )));
        }
        Ok(Self {
            g,
            len: 0,
            buf: KvBuf::Region(&mut resident[..need]),
            n_res: resident_cells,
            spill,
        })
    }

    /// Cells kept in the resident window (the rest are spilled).
    pub fn resident_cells(&self) -> usize {
        self.n_res
    }

    /// Cells filled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no cell is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Cells the storage holds.
    pub fn capacity(&self) -> usize {
        self.g.n_cells
    }

    /// Storage type of the rows.
    pub fn kv_type(&self) -> GgmlType {
        self.g.ty
    }

    /// Forget every cell (the storage is kept).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Forget cells from `len` on (e.g. rejected draft tokens).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    fn layer(&self, l: usize) -> KvRead<'_> {
        KvRead {
            g: self.g,
            l,
            n_res: self.n_res,
            res: self.buf.bytes(),
            spill: &self.spill,
        }
    }

    fn write(&mut self, l: usize, cell: usize, k: &[f32], v: &[f32]) -> Result<(), QuantError> {
        let g = self.g;
        let (kb, vb): (&mut [u8], &mut [u8]) = if cell < self.n_res {
            let base = l * self.n_res * (g.krb + g.vrb);
            let b = self.buf.bytes_mut();
            let (head, tail) = b[base..].split_at_mut(self.n_res * g.krb);
            (
                &mut head[cell * g.krb..(cell + 1) * g.krb],
                &mut tail[cell * g.vrb..(cell + 1) * g.vrb],
            )
        } else {
            let c = &mut self.spill[cell - self.n_res];
            let off = l * (g.krb + g.vrb);
            let (kb, vb) = c[off..off + g.krb + g.vrb].split_at_mut(g.krb);
            (kb, vb)
        };
        quant::quantize_row_into(g.ty, &k[..g.k_row_elems], kb)?;
        quant::quantize_row_into(g.ty, &v[..g.v_row_elems], vb)
    }
}

/// Read access to one layer of one slot's KV, wherever its cells live.
#[derive(Clone, Copy)]
struct KvRead<'b> {
    g: KvGeom,
    l: usize,
    n_res: usize,
    res: &'b [u8],
    spill: &'b [&'b mut [u8]],
}

impl KvRead<'_> {
    fn k_row(&self, c: usize) -> &[u8] {
        let g = &self.g;
        if c < self.n_res {
            let base = self.l * self.n_res * (g.krb + g.vrb);
            &self.res[base + c * g.krb..base + (c + 1) * g.krb]
        } else {
            let off = self.l * (g.krb + g.vrb);
            &self.spill[c - self.n_res][off..off + g.krb]
        }
    }
    fn v_row(&self, c: usize) -> &[u8] {
        let g = &self.g;
        if c < self.n_res {
            let base = self.l * self.n_res * (g.krb + g.vrb) + self.n_res * g.krb;
            &self.res[base + c * g.vrb..base + (c + 1) * g.vrb]
        } else {
            let off = self.l * (g.krb + g.vrb) + g.krb;
            &self.spill[c - self.n_res][off..off + g.vrb]
        }
    }
}

/// Causal GQA attention over KV that may be split between a resident window and spilled
/// cells; the same arithmetic, in the same order, as `backend::cpu::attention`, so a split
/// cache gives bit-identical results to a contiguous one.
fn attention_split<'b, F>(
    shape: AttnShape,
    q: &[f32],
    n_tok: usize,
    kv_of: F,
    scale: f32,
    out: &mut [f32],
) -> Result<(), ModelError>
where
    F: Fn(usize) -> (KvRead<'b>, usize) + Sync,
{
    use rayon::prelude::*;
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim_k: hdk,
        head_dim_v: hdv,
    } = shape;
    for t in 0..n_tok {
        let (kv, n_ctx) = kv_of(t);
        if n_ctx == 0 || n_ctx > kv.g.n_cells {
            return Err(OpError::KvRange {
                token: t,
                n_ctx,
                n_cells: kv.g.n_cells,
            }
            .into());
        }
    }
    let group = n_head / n_head_kv;
    out[..n_tok * n_head * hdv]
        .par_chunks_mut(hdv)
        .enumerate()
        .for_each(|(idx, o)| {
            let (t, h) = (idx / n_head, idx % n_head);
            let kvh = h / group;
            let qh = &q[idx * hdk..(idx + 1) * hdk];
            let (kv, n_ctx) = kv_of(t);
            let (ty, kre, vre) = (kv.g.ty, kv.g.k_row_elems, kv.g.v_row_elems);
            let score = |c: usize| {
                quant::dot_range(ty, kv.k_row(c), kre, kvh * hdk, qh).unwrap_or(f32::NAN) * scale
            };
            let mut m = f32::NEG_INFINITY;
            for c in 0..n_ctx {
                m = m.max(score(c));
            }
            o.fill(0.0);
            let mut sum = 0f32;
            for c in 0..n_ctx {
                let e = (score(c) - m).exp();
                sum += e;
                if quant::axpy_range(ty, kv.v_row(c), vre, kvh * hdv, e, o).is_err() {
                    o.fill(f32::NAN);
                    return;
                }
            }
            for v in o.iter_mut() {
                *v /= sum;
            }
        });
    Ok(())
}

/// A merged expert stack (`[cols, rows, n_expert]` in GGUF order).
#[derive(Debug, Clone, Copy)]
struct Experts<'a> {
    ty: GgmlType,
    cols: usize,
    rows: usize,
    per_expert: usize,
    data: &'a [u8],
}

impl<'a> Experts<'a> {
    fn expert(&self, e: usize) -> Result<Matrix<'a>, OpError> {
        Matrix::new(
            self.ty,
            self.cols,
            self.rows,
            &self.data[e * self.per_expert..(e + 1) * self.per_expert],
        )
    }
}

/// One routed expert's three matrices as a fetcher hands them out: (type, bytes) of gate
/// (`n_ff_exp` rows of `n_embd`), up (same) and down (`n_embd` rows of `n_ff_exp`).
#[derive(Debug, Clone, Copy)]
pub struct ExpertBytes<'b> {
    pub gate: (GgmlType, &'b [u8]),
    pub up: (GgmlType, &'b [u8]),
    pub down: (GgmlType, &'b [u8]),
}

/// Where a stage built without expert stacks gets routed experts (an expert cache). Called
/// once per (layer, expert) a forward step uses, in increasing expert order; the bytes need
/// only stay valid until the next call.
pub trait ExpertFetch {
    fn fetch(&mut self, layer: u32, expert: u32) -> Result<ExpertBytes<'_>, ModelError>;
}

/// Which part of the model a [`Model`] holds: blocks `[layer_first, layer_end)`, and the
/// embedding / output head when it is the first / last stage of a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageSpec {
    pub layer_first: u32,
    pub layer_end: u32,
    pub embedding: bool,
    pub head: bool,
    /// Read routed experts from the merged stacks (`true`) or through an [`ExpertFetch`].
    pub expert_stacks: bool,
}

impl StageSpec {
    /// The whole model, experts from their stacks.
    pub fn whole(hp: &HParams) -> Self {
        Self {
            layer_first: 0,
            layer_end: hp.n_layer,
            embedding: true,
            head: true,
            expert_stacks: true,
        }
    }
}

#[derive(Debug)]
enum Ffn<'a> {
    Moe {
        gate_inp: Matrix<'a>,
        /// gate, up, down stacks; `None` when experts come through an [`ExpertFetch`].
        stacks: Option<(Experts<'a>, Experts<'a>, Experts<'a>)>,
    },
    Dense {
        gate: Matrix<'a>,
        up: Matrix<'a>,
        down: Matrix<'a>,
    },
}

#[derive(Debug)]
struct Layer<'a> {
    attn_norm: Vec<f32>,
    q: Matrix<'a>,
    k: Matrix<'a>,
    v: Matrix<'a>,
    o: Matrix<'a>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    ffn: Ffn<'a>,
}

/// Per-forward working memory, sized once for `max_batch_tokens`.
#[derive(Debug, Default)]
struct Scratch {
    tok: Vec<u32>,
    slot_of: Vec<usize>,
    pos: Vec<u32>,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    tmp: Vec<f32>,
    router: Vec<f32>,
    top_idx: Vec<usize>,
    top_w: Vec<f32>,
    ex_tok: Vec<usize>,
    ex_w: Vec<f32>,
    ex_x: Vec<f32>,
    ex_g: Vec<f32>,
    ex_u: Vec<f32>,
    ex_d: Vec<f32>,
}

/// A Qwen3-MoE model over borrowed weights, with its slots' KV caches.
#[derive(Debug)]
pub struct Model<'a> {
    d: Dims,
    max_tok: usize,
    stage: StageSpec,
    embd: Option<Matrix<'a>>,
    layers: Vec<Layer<'a>>,
    out_norm: Vec<f32>,
    output: Option<Matrix<'a>>,
    rope: Rope,
    slots: Vec<KvCache<'a>>,
    s: Scratch,
    logits: Vec<f32>,
}

struct Loader<'a, S: WeightSource + ?Sized> {
    src: &'a S,
}

impl<'a, S: WeightSource + ?Sized> Loader<'a, S> {
    fn view(&self, name: &str, dims: &[u64]) -> Result<WeightView<'a>, ModelError> {
        let v = self
            .src
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        if v.dims != dims {
            return Err(ModelError::BadShape {
                name: name.into(),
                expected: dims.to_vec(),
                got: v.dims.to_vec(),
            });
        }
        if !quant::is_supported(v.ggml_type) {
            return Err(ModelError::Tensor {
                name: name.into(),
                source: QuantError::Unsupported { ty: v.ggml_type },
            });
        }
        let expected = v.ggml_type.tensor_bytes(dims);
        if expected != Some(v.data.len() as u64) {
            return Err(ModelError::BadBytes {
                name: name.into(),
                ty: v.ggml_type,
                dims: dims.to_vec(),
                expected: expected.unwrap_or(u64::MAX),
                got: v.data.len() as u64,
            });
        }
        Ok(v)
    }

    fn matrix(&self, name: &str, cols: usize, rows: usize) -> Result<Matrix<'a>, ModelError> {
        let v = self.view(name, &[cols as u64, rows as u64])?;
        Matrix::new(v.ggml_type, cols, rows, v.data).map_err(|e| match e {
            OpError::Quant(source) => ModelError::Tensor {
                name: name.into(),
                source,
            },
            other => ModelError::Op(other),
        })
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let v = self.view(name, &[n as u64])?;
        let mut out = vec![0f32; n];
        quant::dequantize_row(v.ggml_type, v.data, &mut out).map_err(|source| {
            ModelError::Tensor {
                name: name.into(),
                source,
            }
        })?;
        Ok(out)
    }

    fn experts(
        &self,
        name: &str,
        cols: usize,
        rows: usize,
        n: usize,
    ) -> Result<Experts<'a>, ModelError> {
        let v = self.view(name, &[cols as u64, rows as u64, n as u64])?;
        let rb = quant::row_bytes(v.ggml_type, cols).map_err(|source| ModelError::Tensor {
            name: name.into(),
            source,
        })?;
        Ok(Experts {
            ty: v.ggml_type,
            cols,
            rows,
            per_expert: rb * rows,
            data: v.data,
        })
    }
}

impl<'a> Model<'a> {
    /// Check every tensor against `hp` and build the model; scratch is allocated here for
    /// `opts.max_batch_tokens` tokens. Slots are added with [`Model::add_slot`].
    pub fn new<S: WeightSource + ?Sized>(
        hp: &HParams,
        source: &'a S,
        opts: ModelOptions,
    ) -> Result<Self, ModelError> {
        Self::new_stage(hp, source, opts, StageSpec::whole(hp))
    }

    /// Like [`Model::new`] for one pipeline stage: only the stage's tensors are read (blocks
    /// `[layer_first, layer_end)`, the embedding and the head only where `stage` says).
    /// Slots hold KV for the stage's blocks only.
    pub fn new_stage<S: WeightSource + ?Sized>(
        hp: &HParams,
        source: &'a S,
        opts: ModelOptions,
        stage: StageSpec,
    ) -> Result<Self, ModelError> {
        let hperr = |key: &'static str, reason: String| ModelError::HParam { key, reason };
        let d = Dims {
            n_layer: hp.n_layer as usize,
            n_embd: to_usize("embedding_length", hp.n_embd)?,
            n_vocab: to_usize("vocab_size", hp.n_vocab)?,
            n_head: to_usize("attention.head_count", hp.n_head)?,
            n_head_kv: to_usize("attention.head_count_kv", hp.n_head_kv)?,
            hd_k: to_usize("attention.key_length", hp.head_dim_k)?,
            hd_v: to_usize("attention.value_length", hp.head_dim_v)?,
            n_expert: to_usize("expert_count", hp.n_expert)?,
            n_used: to_usize("expert_used_count", hp.n_expert_used)?,
            n_ff_exp: to_usize("expert_feed_forward_length", hp.n_ff_exp)?,
            n_ff: to_usize("feed_forward_length", hp.n_ff)?,
            eps: hp.rms_eps as f32,
            norm_topk: hp.norm_topk_prob,
        };
        if d.n_embd == 0 || d.n_vocab == 0 || d.hd_k == 0 || d.hd_v == 0 {
            return Err(hperr(
                "embedding_length",
                "n_embd, n_vocab and head dims must be non-zero".into(),
            ));
        }
        if d.n_head_kv == 0 || d.n_head % d.n_head_kv != 0 {
            return Err(hperr(
                "attention.head_count_kv",
                format!("{} must divide head_count {}", d.n_head_kv, d.n_head),
            ));
        }
        if d.n_expert > 0 && (d.n_used == 0 || d.n_used > d.n_expert) {
            return Err(hperr(
                "expert_used_count",
                format!("{} must be in 1..={}", d.n_used, d.n_expert),
            ));
        }
        if hp.n_ff_shexp > 0 {
            return Err(hperr(
                "expert_shared_feed_forward_length",
                "qwen3moe has no shared expert; this model is another architecture".into(),
            ));
        }
        if (0..hp.n_layer).any(|l| hp.layer_kind(l) != LayerKind::FullAttention) {
            return Err(hperr(
                "full_attention_interval",
                "qwen3moe layers are all full attention; linear attention needs the qwen3next forward".into(),
            ));
        }
        let n_rot = match hp.rope_dim {
            Some(r) => to_usize("rope.dimension_count", r)?,
            None => d.hd_k,
        };
        if n_rot % 2 != 0 || n_rot > d.hd_k || n_rot == 0 {
            return Err(hperr(
                "rope.dimension_count",
                format!("{n_rot} must be even and in 2..={}", d.hd_k),
            ));
        }
        if let Some(y) = opts.yarn {
            if !(y.factor.is_finite() && y.factor >= 1.0) || y.orig_ctx == 0 {
                return Err(hperr(
                    "rope_scaling",
                    format!(
                        "YaRN factor {} must be >= 1 and orig ctx {} >= 1",
                        y.factor, y.orig_ctx
                    ),
                ));
            }
        }
        if opts.max_batch_tokens == 0 {
            return Err(ModelError::BatchTooLarge {
                what: "max_batch_tokens",
                n: 0,
                max: 0,
            });
        }
        if stage.layer_first > stage.layer_end || stage.layer_end > hp.n_layer {
            return Err(hperr(
                "block_count",
                format!(
                    "stage layers [{}, {}) are not inside the model's {} blocks",
                    stage.layer_first, stage.layer_end, hp.n_layer
                ),
            ));
        }
        let ld = Loader { src: source };
        let embd = if stage.embedding {
            Some(ld.matrix("token_embd.weight", d.n_embd, d.n_vocab)?)
        } else {
            None
        };
        let (out_norm, output) = if stage.head {
            let out_norm = ld.vector("output_norm.weight", d.n_embd)?;
            let output = if source.tensor("output.weight").is_some() || !hp.tied_embeddings {
                ld.matrix("output.weight", d.n_embd, d.n_vocab)?
            } else {
                ld.matrix("token_embd.weight", d.n_embd, d.n_vocab)?
            };
            (out_norm, Some(output))
        } else {
            (Vec::new(), None)
        };
        let (q_out, kv_k, kv_v) = (
            d.n_head * d.hd_k,
            d.n_head_kv * d.hd_k,
            d.n_head_kv * d.hd_v,
        );
        let mut layers = Vec::with_capacity(d.n_layer);
        for l in stage.layer_first as usize..stage.layer_end as usize {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let ffn = if hp.layer_has_experts(l as u32) {
                let stacks = if stage.expert_stacks {
                    Some((
                        ld.experts(&n("ffn_gate_exps"), d.n_embd, d.n_ff_exp, d.n_expert)?,
                        ld.experts(&n("ffn_up_exps"), d.n_embd, d.n_ff_exp, d.n_expert)?,
                        ld.experts(&n("ffn_down_exps"), d.n_ff_exp, d.n_embd, d.n_expert)?,
                    ))
                } else {
                    None
                };
                Ffn::Moe {
                    gate_inp: ld.matrix(&n("ffn_gate_inp"), d.n_embd, d.n_expert)?,
                    stacks,
                }
            } else {
                if d.n_ff == 0 {
                    return Err(hperr(
                        "feed_forward_length",
                        format!("layer {l} has a dense FFN but the width is 0"),
                    ));
                }
                Ffn::Dense {
                    gate: ld.matrix(&n("ffn_gate"), d.n_embd, d.n_ff)?,
                    up: ld.matrix(&n("ffn_up"), d.n_embd, d.n_ff)?,
                    down: ld.matrix(&n("ffn_down"), d.n_ff, d.n_embd)?,
                }
            };
            layers.push(Layer {
                attn_norm: ld.vector(&n("attn_norm"), d.n_embd)?,
                q: ld.matrix(&n("attn_q"), d.n_embd, q_out)?,
                k: ld.matrix(&n("attn_k"), d.n_embd, kv_k)?,
                v: ld.matrix(&n("attn_v"), d.n_embd, kv_v)?,
                o: ld.matrix(&n("attn_output"), d.n_head * d.hd_v, d.n_embd)?,
                q_norm: ld.vector(&n("attn_q_norm"), d.hd_k)?,
                k_norm: ld.vector(&n("attn_k_norm"), d.hd_k)?,
                ffn_norm: ld.vector(&n("ffn_norm"), d.n_embd)?,
                ffn,
            });
        }
        let t = opts.max_batch_tokens;
        let ff = d.n_ff_exp.max(d.n_ff);
        let widest = [d.n_embd, q_out, kv_k, kv_v, d.n_expert, ff, d.n_vocab]
            .into_iter()
            .max()
            .unwrap_or(0);
        let s = Scratch {
            tok: vec![0; t],
            slot_of: vec![0; t],
            pos: vec![0; t],
            x: vec![0.0; t * d.n_embd],
            xn: vec![0.0; t * d.n_embd],
            q: vec![0.0; t * q_out],
            k: vec![0.0; t * kv_k],
            v: vec![0.0; t * kv_v],
            att: vec![0.0; t * d.n_head * d.hd_v],
            proj: vec![0.0; t * d.n_embd],
            tmp: vec![0.0; t * widest],
            router: vec![0.0; t * d.n_expert],
            top_idx: vec![0; t * d.n_used],
            top_w: vec![0.0; t * d.n_used],
            ex_tok: vec![0; t],
            ex_w: vec![0.0; t],
            ex_x: vec![0.0; t * d.n_embd],
            ex_g: vec![0.0; t * ff],
            ex_u: vec![0.0; t * ff],
            ex_d: vec![0.0; t * d.n_embd],
        };
        Ok(Self {
            d,
            max_tok: t,
            stage,
            embd,
            layers,
            out_norm,
            output,
            rope: Rope::new(n_rot, hp.rope_theta, opts.yarn),
            slots: Vec::new(),
            s,
            logits: vec![0.0; t * d.n_vocab],
        })
    }

    /// Vocabulary size (the length of one logits row).
    pub fn n_vocab(&self) -> usize {
        self.d.n_vocab
    }

    /// The rotary embedding in use (for inspection and tests).
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// The largest number of tokens one forward step takes.
    pub fn max_batch_tokens(&self) -> usize {
        self.max_tok
    }

    /// Hidden size.
    pub fn n_embd(&self) -> usize {
        self.d.n_embd
    }

    /// The part of the model this holds.
    pub fn stage(&self) -> StageSpec {
        self.stage
    }

    /// Attach a slot's KV cache (built for these hyperparameters); returns its slot id.
    pub fn add_slot(&mut self, kv: KvCache<'a>) -> Result<usize, ModelError> {
        let d = &self.d;
        if kv.g.n_layer != self.layers.len()
            || kv.g.k_row_elems != d.n_head_kv * d.hd_k
            || kv.g.v_row_elems != d.n_head_kv * d.hd_v
        {
            return Err(ModelError::Kv(format!(
                "cache built for {} layers x {}/{} KV row elements, model has {} x {}/{}",
                kv.g.n_layer,
                kv.g.k_row_elems,
                kv.g.v_row_elems,
                self.layers.len(),
                d.n_head_kv * d.hd_k,
                d.n_head_kv * d.hd_v
            )));
        }
        self.slots.push(kv);
        Ok(self.slots.len() - 1)
    }

    /// A slot's cache.
    pub fn slot(&self, slot: usize) -> Option<&KvCache<'a>> {
        self.slots.get(slot)
    }

    /// A slot's cache, mutably (to clear or truncate it).
    pub fn slot_mut(&mut self, slot: usize) -> Option<&mut KvCache<'a>> {
        self.slots.get_mut(slot)
    }

    fn check_slot(&self, slot: usize, more: usize) -> Result<(), ModelError> {
        let kv = self.slots.get(slot).ok_or(ModelError::NoSlot {
            slot,
            n_slots: self.slots.len(),
        })?;
        if kv.len + more > kv.capacity() {
            return Err(ModelError::ContextFull {
                slot,
                len: kv.len,
                capacity: kv.capacity(),
                more,
            });
        }
        Ok(())
    }

    fn check_token(&self, token: u32) -> Result<(), ModelError> {
        if token as usize >= self.d.n_vocab {
            return Err(ModelError::BadToken {
                token,
                n_vocab: self.d.n_vocab,
            });
        }
        Ok(())
    }

    /// Run `tokens` through slot `slot` in chunks of `ubatch`, appending them to its cache.
    /// Returns the logits of every token (`tokens.len() x n_vocab`) when `want_all_logits`,
    /// else of the last token only (`n_vocab`).
    pub fn prefill(
        &mut self,
        slot: usize,
        tokens: &[u32],
        ubatch: usize,
        want_all_logits: bool,
    ) -> Result<&[f32], ModelError> {
        self.check_whole()?;
        if tokens.is_empty() {
            return Err(ModelError::Request("prefill of no tokens".into()));
        }
        if ubatch == 0 || ubatch > self.max_tok {
            return Err(ModelError::BatchTooLarge {
                what: "ubatch",
                n: ubatch,
                max: self.max_tok,
            });
        }
        self.check_slot(slot, tokens.len())?;
        for &t in tokens {
            self.check_token(t)?;
        }
        let v = self.d.n_vocab;
        let n_out = if want_all_logits { tokens.len() } else { 1 };
        if self.logits.len() < n_out * v {
            // Only a prompt longer than any before asks for more logits memory.
            self.logits.resize(n_out * v, 0.0);
        }
        let n_chunks = tokens.len().div_ceil(ubatch);
        for (ci, chunk) in tokens.chunks(ubatch).enumerate() {
            let n = chunk.len();
            let start = self.slots[slot].len;
            for (i, &t) in chunk.iter().enumerate() {
                self.s.tok[i] = t;
                self.s.slot_of[i] = slot;
                self.s.pos[i] = (start + i) as u32;
            }
            self.forward(n, None, None)?;
            self.slots[slot].len += n;
            if want_all_logits {
                self.head(0, n, ci * ubatch)?;
            } else if ci + 1 == n_chunks {
                self.head(n - 1, 1, 0)?;
            }
        }
        Ok(&self.logits[..n_out * v])
    }

    /// One decode step for every listed slot together: each `(slot, token)` appends one
    /// token. Returns `batch.len() x n_vocab` logits, row `i` for `batch[i]`.
    pub fn decode(&mut self, batch: &[(usize, u32)]) -> Result<&[f32], ModelError> {
        self.check_whole()?;
        let n = batch.len();
        if n == 0 {
            return Err(ModelError::Request("decode of an empty batch".into()));
        }
        if n > self.max_tok {
            return Err(ModelError::BatchTooLarge {
                what: "decode batch",
                n,
                max: self.max_tok,
            });
        }
        for (i, &(slot, token)) in batch.iter().enumerate() {
            self.check_slot(slot, 1)?;
            self.check_token(token)?;
            if batch[..i].iter().any(|(s, _)| *s == slot) {
                return Err(ModelError::Request(format!(
                    "slot {slot} appears twice in one decode batch; a step takes one token per slot"
                )));
            }
        }
        for (i, &(slot, token)) in batch.iter().enumerate() {
            self.s.tok[i] = token;
            self.s.slot_of[i] = slot;
            self.s.pos[i] = self.slots[slot].len as u32;
        }
        self.forward(n, None, None)?;
        for &(slot, _) in batch {
            self.slots[slot].len += 1;
        }
        self.head(0, n, 0)?;
        Ok(&self.logits[..n * self.d.n_vocab])
    }

    fn check_whole(&self) -> Result<(), ModelError> {
        let st = self.stage;
        if !(st.embedding && st.head && st.expert_stacks)
            || st.layer_first != 0
            || st.layer_end as usize != self.d.n_layer
        {
            return Err(ModelError::Request(
                "prefill/decode run a whole model; drive a pipeline stage with Model::step".into(),
            ));
        }
        Ok(())
    }

    /// One forward step of a pipeline stage over `n = slots.len()` tokens: token `i` of slot
    /// `slots[i]` at position `pos[i]` (its K/V are written at that cell). The first stage
    /// embeds `tokens`; the others take `hidden_in` (`n x n_embd`, the previous stage's
    /// [`Model::hidden`]). Routed experts come from the stacks or from `experts`. Slot
    /// lengths are not advanced: call [`Model::advance`] when every stage has run.
    pub fn step(
        &mut self,
        tokens: &[u32],
        slots: &[usize],
        pos: &[u32],
        hidden_in: Option<&[f32]>,
        experts: Option<&mut dyn ExpertFetch>,
    ) -> Result<(), ModelError> {
        let n = slots.len();
        if n == 0 || n > self.max_tok || pos.len() != n {
            return Err(ModelError::BatchTooLarge {
                what: "stage step",
                n,
                max: self.max_tok,
            });
        }
        if self.stage.embedding {
            if tokens.len() != n {
                return Err(ModelError::Request(format!(
                    "stage step of {n} slots got {} tokens",
                    tokens.len()
                )));
            }
            for &t in tokens {
                self.check_token(t)?;
            }
        } else if hidden_in.is_none_or(|h| h.len() < n * self.d.n_embd) {
            return Err(ModelError::Request(format!(
                "stage [{}, {}) needs the previous stage's hidden states ({} values)",
                self.stage.layer_first,
                self.stage.layer_end,
                n * self.d.n_embd
            )));
        }
        for i in 0..n {
            let kv = self.slots.get(slots[i]).ok_or(ModelError::NoSlot {
                slot: slots[i],
                n_slots: self.slots.len(),
            })?;
            if pos[i] as usize >= kv.capacity() {
                return Err(ModelError::ContextFull {
                    slot: slots[i],
                    len: pos[i] as usize,
                    capacity: kv.capacity(),
                    more: 1,
                });
            }
            self.s.tok[i] = tokens.get(i).copied().unwrap_or(0);
            self.s.slot_of[i] = slots[i];
            self.s.pos[i] = pos[i];
        }
        self.forward(n, hidden_in, experts)
    }

    /// The hidden states the last [`Model::step`] left (`n x n_embd`).
    pub fn hidden(&self, n: usize) -> &[f32] {
        &self.s.x[..(n * self.d.n_embd).min(self.s.x.len())]
    }

    /// Mark `n` more cells of `slot` as filled (after a step wrote them).
    pub fn advance(&mut self, slot: usize, n: usize) -> Result<(), ModelError> {
        let cap = self.check_slot(slot, n);
        cap?;
        self.slots[slot].len += n;
        Ok(())
    }

    /// Output norm and LM head over rows `first..first+n` of the last step (last stage
    /// only): `n x n_vocab` logits.
    pub fn head_rows(&mut self, first: usize, n: usize) -> Result<&[f32], ModelError> {
        if first + n > self.max_tok {
            return Err(ModelError::BatchTooLarge {
                what: "head rows",
                n: first + n,
                max: self.max_tok,
            });
        }
        self.head(first, n, 0)?;
        Ok(&self.logits[..n * self.d.n_vocab])
    }

    /// Output norm and LM head for tokens `first..first+n` of the last forward, into logits
    /// rows `out_row..out_row+n`.
    fn head(&mut self, first: usize, n: usize, out_row: usize) -> Result<(), ModelError> {
        let (e, v) = (self.d.n_embd, self.d.n_vocab);
        let Some(output) = self.output.as_ref() else {
            return Err(ModelError::Request(
                "this stage does not hold the output head".into(),
            ));
        };
        let s = &mut self.s;
        cpu::rmsnorm_rows(
            &s.x[first * e..(first + n) * e],
            &self.out_norm,
            self.d.eps,
            n,
            &mut s.xn,
        )?;
        cpu::matmul(
            output,
            &s.xn,
            n,
            &mut self.logits[out_row * v..(out_row + n) * v],
            &mut s.tmp,
        )?;
        Ok(())
    }

    /// Run the `n` tokens staged in scratch (`tok`, `slot_of`, `pos`) through every layer,
    /// writing their K/V into their slots; the final hidden states are left in `s.x`.
    fn forward(
        &mut self,
        n: usize,
        hidden_in: Option<&[f32]>,
        mut experts: Option<&mut dyn ExpertFetch>,
    ) -> Result<(), ModelError> {
        let d = self.d;
        let Model {
            embd,
            layers,
            rope,
            slots,
            s,
            stage,
            ..
        } = self;
        let e = d.n_embd;
        match (embd.as_ref(), hidden_in) {
            (Some(embd), _) => {
                for t in 0..n {
                    embd.dequantize_row(s.tok[t] as usize, &mut s.x[t * e..(t + 1) * e])?;
                }
            }
            (None, Some(h)) if h.len() >= n * e => s.x[..n * e].copy_from_slice(&h[..n * e]),
            _ => {
                return Err(ModelError::Request(
                    "a stage without the embedding needs hidden states".into(),
                ))
            }
        }
        let (qw, kw, vw) = (
            d.n_head * d.hd_k,
            d.n_head_kv * d.hd_k,
            d.n_head_kv * d.hd_v,
        );
        let shape = AttnShape {
            n_head: d.n_head,
            n_head_kv: d.n_head_kv,
            head_dim_k: d.hd_k,
            head_dim_v: d.hd_v,
        };
        let scale = 1.0 / (d.hd_k as f32).sqrt();
        for (l, layer) in layers.iter().enumerate() {
            cpu::rmsnorm_rows(&s.x, &layer.attn_norm, d.eps, n, &mut s.xn)?;
            cpu::matmul(&layer.q, &s.xn, n, &mut s.q, &mut s.tmp)?;
            cpu::matmul(&layer.k, &s.xn, n, &mut s.k, &mut s.tmp)?;
            cpu::matmul(&layer.v, &s.xn, n, &mut s.v, &mut s.tmp)?;
            cpu::rmsnorm_heads_inplace(&mut s.q[..n * qw], &layer.q_norm, d.eps)?;
            cpu::rmsnorm_heads_inplace(&mut s.k[..n * kw], &layer.k_norm, d.eps)?;
            for t in 0..n {
                rope.apply(&mut s.q[t * qw..(t + 1) * qw], d.hd_k, s.pos[t])?;
                rope.apply(&mut s.k[t * kw..(t + 1) * kw], d.hd_k, s.pos[t])?;
                slots[s.slot_of[t]]
                    .write(
                        l,
                        s.pos[t] as usize,
                        &s.k[t * kw..(t + 1) * kw],
                        &s.v[t * vw..(t + 1) * vw],
                    )
                    .map_err(OpError::from)?;
            }
            {
                let slots = &*slots;
                let (slot_of, pos) = (&s.slot_of, &s.pos);
                attention_split(
                    shape,
                    &s.q,
                    n,
                    |t| (slots[slot_of[t]].layer(l), pos[t] as usize + 1),
                    scale,
                    &mut s.att,
                )?;
            }
            cpu::matmul(&layer.o, &s.att, n, &mut s.proj, &mut s.tmp)?;
            add_into(&mut s.x[..n * e], &s.proj[..n * e]);
            cpu::rmsnorm_rows(&s.x, &layer.ffn_norm, d.eps, n, &mut s.xn)?;
            match &layer.ffn {
                Ffn::Moe { gate_inp, stacks } => {
                    let src = match (stacks, experts.as_deref_mut()) {
                        (Some(st), _) => ExpertSrc::Stacks(st),
                        (None, Some(f)) => ExpertSrc::Fetch(f),
                        (None, None) => {
                            return Err(ModelError::Request(
                                "this stage reads experts through an expert cache; pass one".into(),
                            ))
                        }
                    };
                    moe(&d, s, n, gate_inp, src, stage.layer_first + l as u32)?
                }
                Ffn::Dense { gate, up, down } => {
                    let f = d.n_ff;
                    cpu::matmul(gate, &s.xn, n, &mut s.ex_g, &mut s.tmp)?;
                    cpu::matmul(up, &s.xn, n, &mut s.ex_u, &mut s.tmp)?;
                    for (g, u) in s.ex_g[..n * f].iter_mut().zip(&s.ex_u[..n * f]) {
                        *g = cpu::silu(*g) * u;
                    }
                    cpu::matmul(down, &s.ex_g, n, &mut s.proj, &mut s.tmp)?;
                }
            }
            add_into(&mut s.x[..n * e], &s.proj[..n * e]);
        }
        Ok(())
    }

    #[cfg(test)]
    fn scratch_addrs(&self) -> Vec<(usize, usize)> {
        let s = &self.s;
        let f = |v: &Vec<f32>| (v.as_ptr() as usize, v.capacity());
        vec![
            f(&s.x),
            f(&s.xn),
            f(&s.q),
            f(&s.k),
            f(&s.v),
            f(&s.att),
            f(&s.proj),
            f(&s.tmp),
            f(&s.router),
            f(&s.ex_x),
            f(&s.ex_g),
            f(&s.ex_d),
            f(&self.logits),
        ]
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// The sparse MoE block: router softmax over all experts, top-k (renormalized when
/// `norm_topk_prob`), then each expert runs once over the tokens that picked it; a token's
/// output sums its experts in increasing expert index (as HF's loop does). Result in `s.proj`.
fn expert_matrix<'b>(
    ex: usize,
    layer: u32,
    what: &str,
    (ty, data): (GgmlType, &'b [u8]),
    cols: usize,
    rows: usize,
) -> Result<Matrix<'b>, ModelError> {
    Matrix::new(ty, cols, rows, data).map_err(|err| {
        ModelError::Request(format!(
            "expert {ex} of layer {layer}: {what} from the expert cache: {err}"
        ))
    })
}

enum ExpertSrc<'x, 'a> {
    Stacks(&'x (Experts<'a>, Experts<'a>, Experts<'a>)),
    Fetch(&'x mut dyn ExpertFetch),
}

fn moe(
    d: &Dims,
    s: &mut Scratch,
    n: usize,
    gate_inp: &Matrix<'_>,
    mut src: ExpertSrc<'_, '_>,
    layer: u32,
) -> Result<(), ModelError> {
    let (e, ne, k, f) = (d.n_embd, d.n_expert, d.n_used, d.n_ff_exp);
    cpu::matmul(gate_inp, &s.xn, n, &mut s.router, &mut s.tmp)?;
    for t in 0..n {
        let probs = &mut s.router[t * ne..(t + 1) * ne];
        cpu::softmax(probs);
        let idx = &mut s.top_idx[t * k..(t + 1) * k];
        let w = &mut s.top_w[t * k..(t + 1) * k];
        for j in 0..k {
            // Largest remaining probability; ties go to the lower expert index.
            let mut best = usize::MAX;
            for c in 0..ne {
                if idx[..j].contains(&c) {
                    continue;
                }
                if best == usize::MAX || probs[c] > probs[best] {
                    best = c;
                }
            }
            idx[j] = best;
            w[j] = probs[best];
        }
        if d.norm_topk {
            let sum: f32 = w.iter().sum();
            for v in w.iter_mut() {
                *v /= sum;
            }
        }
    }
    s.proj[..n * e].fill(0.0);
    for ex in 0..ne {
        let mut cnt = 0;
        for t in 0..n {
            if let Some(j) = s.top_idx[t * k..(t + 1) * k].iter().position(|&c| c == ex) {
                s.ex_tok[cnt] = t;
                s.ex_w[cnt] = s.top_w[t * k + j];
                s.ex_x[cnt * e..(cnt + 1) * e].copy_from_slice(&s.xn[t * e..(t + 1) * e]);
                cnt += 1;
            }
        }
        if cnt == 0 {
            continue;
        }
        let (gate, up, down) = match &mut src {
            ExpertSrc::Stacks((g, u, dn)) => (g.expert(ex)?, u.expert(ex)?, dn.expert(ex)?),
            ExpertSrc::Fetch(fe) => {
                let b = fe.fetch(layer, ex as u32)?;
                (
                    expert_matrix(ex, layer, "gate", b.gate, e, f)?,
                    expert_matrix(ex, layer, "up", b.up, e, f)?,
                    expert_matrix(ex, layer, "down", b.down, f, e)?,
                )
            }
        };
        cpu::matmul(&gate, &s.ex_x, cnt, &mut s.ex_g, &mut s.tmp)?;
        cpu::matmul(&up, &s.ex_x, cnt, &mut s.ex_u, &mut s.tmp)?;
        for (g, u) in s.ex_g[..cnt * f].iter_mut().zip(&s.ex_u[..cnt * f]) {
            *g = cpu::silu(*g) * u;
        }
        cpu::matmul(&down, &s.ex_g, cnt, &mut s.ex_d, &mut s.tmp)?;
        for i in 0..cnt {
            let (t, w) = (s.ex_tok[i], s.ex_w[i]);
            for (o, y) in s.proj[t * e..(t + 1) * e]
                .iter_mut()
                .zip(&s.ex_d[i * e..(i + 1) * e])
            {
                *o += w * y;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MemWeights;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn tiny_hp() -> HParams {
        HParams {
            n_layer: 2,
            n_embd: 64,
            n_vocab: 97,
            n_ctx_train: 256,
            n_head: 4,
            n_head_kv: 2,
            head_dim_k: 16,
            head_dim_v: 16,
            n_ff: 0,
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 32,
            n_ff_shexp: 0,
            n_leading_dense: 0,
            full_attention_interval: None,
            ssm: None,
            nextn_predict_layers: 0,
            rope_theta: 10000.0,
            rope_dim: None,
            rms_eps: 1e-6,
            norm_topk_prob: true,
            tied_embeddings: false,
        }
    }

    /// A random tiny model: every tensor as f32 values (GGUF dims), encoded as `ty` (Q8_0
    /// where a row is not whole `ty` blocks) except norms, which stay F32 as converters keep
    /// them.
    fn tiny_weights(hp: &HParams, ty: GgmlType, seed: u64) -> MemWeights {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut w = MemWeights::new();
        let (e, v) = (hp.n_embd, hp.n_vocab);
        let (qo, kvo) = (hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k);
        let mut put =
            |w: &mut MemWeights, name: String, dims: &[u64], scale: f32, off: f32, ty: GgmlType| {
                let n: u64 = dims.iter().product();
                // Like llama.cpp's quantizer, fall back to Q8_0 where rows are not whole blocks.
                let ty = if dims[0] % ty.block_elems() == 0 {
                    ty
                } else {
                    GgmlType::Q8_0
                };
                let vals: Vec<f32> = (0..n)
                    .map(|_| off + scale * (2.0 * rng.random::<f32>() - 1.0))
                    .collect();
                w.insert_f32(name, dims, &vals, ty).unwrap();
            };
        put(&mut w, "token_embd.weight".into(), &[e, v], 1.0, 0.0, ty);
        put(
            &mut w,
            "output_norm.weight".into(),
            &[e],
            0.2,
            1.0,
            GgmlType::F32,
        );
        put(&mut w, "output.weight".into(), &[e, v], 0.2, 0.0, ty);
        for l in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            put(&mut w, n("attn_norm"), &[e], 0.2, 1.0, GgmlType::F32);
            put(&mut w, n("ffn_norm"), &[e], 0.2, 1.0, GgmlType::F32);
            put(
                &mut w,
                n("attn_q_norm"),
                &[hp.head_dim_k],
                0.2,
                1.0,
                GgmlType::F32,
            );
            put(
                &mut w,
                n("attn_k_norm"),
                &[hp.head_dim_k],
                0.2,
                1.0,
                GgmlType::F32,
            );
            put(&mut w, n("attn_q"), &[e, qo], 0.2, 0.0, ty);
            put(&mut w, n("attn_k"), &[e, kvo], 0.2, 0.0, ty);
            put(&mut w, n("attn_v"), &[e, kvo], 0.2, 0.0, ty);
            put(&mut w, n("attn_output"), &[qo, e], 0.2, 0.0, ty);
            put(&mut w, n("ffn_gate_inp"), &[e, hp.n_expert], 0.3, 0.0, ty);
            let (f, x) = (hp.n_ff_exp, hp.n_expert);
            put(&mut w, n("ffn_gate_exps"), &[e, f, x], 0.2, 0.0, ty);
            put(&mut w, n("ffn_up_exps"), &[e, f, x], 0.2, 0.0, ty);
            put(&mut w, n("ffn_down_exps"), &[f, e, x], 0.2, 0.0, ty);
        }
        w
    }

    /// The same tensors with every quantized one replaced by its F32 dequantization.
    fn dequantized_copy(w: &MemWeights) -> MemWeights {
        let mut out = MemWeights::new();
        for name in w.names() {
            let t = w.get(name).unwrap();
            let n: u64 = t.dims.iter().product();
            let mut vals = vec![0f32; n as usize];
            let ne0 = t.dims[0] as usize;
            let rb = quant::row_bytes(t.ggml_type, ne0).unwrap();
            for (row, o) in t.data.chunks_exact(rb).zip(vals.chunks_exact_mut(ne0)) {
                quant::dequantize_row(t.ggml_type, row, o).unwrap();
            }
            out.insert_f32(name, &t.dims, &vals, GgmlType::F32).unwrap();
        }
        out
    }

    fn model<'a>(hp: &HParams, w: &'a MemWeights, slots: usize, kv: GgmlType) -> Model<'a> {
        let mut m = Model::new(hp, w, ModelOptions::new(8)).unwrap();
        for _ in 0..slots {
            m.add_slot(KvCache::new_owned(hp, kv, 64).unwrap()).unwrap();
        }
        m
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    }

    const PROMPT: [u32; 11] = [5, 17, 42, 3, 96, 0, 61, 61, 8, 33, 70];

    #[test]
    fn prefill_then_decode_equals_longer_prefill() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 1);
        let mut a = model(&hp, &w, 1, GgmlType::F32);
        let full = a.prefill(0, &PROMPT, 8, true).unwrap().to_vec();
        assert!(full.iter().all(|v| v.is_finite()));
        let mut b = model(&hp, &w, 1, GgmlType::F32);
        let last = b.prefill(0, &PROMPT[..8], 8, false).unwrap().to_vec();
        assert_eq!(max_diff(&last, &full[7 * 97..8 * 97]), 0.0);
        for (i, &t) in PROMPT[8..].iter().enumerate() {
            let got = b.decode(&[(0, t)]).unwrap().to_vec();
            let want = &full[(8 + i) * 97..(9 + i) * 97];
            assert!(
                max_diff(&got, want) <= 1e-5,
                "step {i}: {}",
                max_diff(&got, want)
            );
        }
        assert_eq!(b.slot(0).unwrap().len(), PROMPT.len());
        // Logits vary with the input (a model that ignores it would pass the checks above).
        assert!(max_diff(&full[..97], &full[97..194]) > 1e-3);
    }

    #[test]
    fn batched_decode_equals_one_at_a_time() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 2);
        let prompts: [&[u32]; 3] = [&PROMPT[..3], &PROMPT[2..9], &PROMPT[5..6]];
        let steps: [[u32; 3]; 3] = [[1, 2, 3], [50, 60, 70], [96, 0, 11]];
        let mut batched = model(&hp, &w, 3, GgmlType::F16);
        for (s, p) in prompts.iter().enumerate() {
            batched.prefill(s, p, 4, false).unwrap();
        }
        let mut single = model(&hp, &w, 3, GgmlType::F16);
        for (s, p) in prompts.iter().enumerate() {
            single.prefill(s, p, 4, false).unwrap();
        }
        let before = batched.scratch_addrs();
        for step in steps {
            let batch: Vec<(usize, u32)> = (0..3).map(|s| (s, step[s])).collect();
            let got = batched.decode(&batch).unwrap().to_vec();
            for s in 0..3 {
                let one = single.decode(&[(s, step[s])]).unwrap();
                assert_eq!(&got[s * 97..(s + 1) * 97], one, "slot {s}: batch-invariant");
            }
        }
        // No scratch was reallocated by the decode steps.
        assert_eq!(before, batched.scratch_addrs());
        assert!(
            batched.decode(&[(0, 1), (0, 2)]).is_err(),
            "one token per slot per step"
        );
    }

    #[test]
    fn ubatch_chunking_matches_one_pass() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 3);
        let mut a = model(&hp, &w, 1, GgmlType::F32);
        let one = a.prefill(0, &PROMPT[..8], 8, true).unwrap().to_vec();
        let mut b = model(&hp, &w, 1, GgmlType::F32);
        let chunked = b.prefill(0, &PROMPT[..8], 3, true).unwrap().to_vec();
        assert!(max_diff(&one, &chunked) <= 1e-5);
        let mut c = model(&hp, &w, 1, GgmlType::F32);
        let last = c.prefill(0, &PROMPT[..8], 3, false).unwrap();
        assert_eq!(last, &one[7 * 97..]);
    }

    #[test]
    fn quantized_weights_and_kv_stay_close_to_f32() {
        let hp = tiny_hp();
        // Same underlying f32 values (same seed), encoded as F32 and as Q8_0.
        let wf = tiny_weights(&hp, GgmlType::F32, 4);
        let wq = tiny_weights(&hp, GgmlType::Q8_0, 4);
        let mut mf = model(&hp, &wf, 1, GgmlType::F32);
        let lf = mf.prefill(0, &PROMPT, 4, true).unwrap().to_vec();
        let mut mq = model(&hp, &wq, 1, GgmlType::F32);
        let lq = mq.prefill(0, &PROMPT, 4, true).unwrap().to_vec();
        let scale = lf.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Bound: Q8_0 weights move every logit by at most 2% of the largest |logit|, and the
        // argmax of every position agrees.
        let diff = max_diff(&lf, &lq);
        assert!(
            diff <= 0.02 * scale,
            "Q8_0 weights: {diff} vs scale {scale}"
        );
        assert!(diff > 0.0, "the Q8_0 copy really is quantized");
        let argmax = |r: &[f32]| {
            r.iter()
                .enumerate()
                .fold(
                    (0, f32::MIN),
                    |b, (i, v)| if *v > b.1 { (i, *v) } else { b },
                )
                .0
        };
        for p in 0..PROMPT.len() {
            assert_eq!(
                argmax(&lf[p * 97..(p + 1) * 97]),
                argmax(&lq[p * 97..(p + 1) * 97])
            );
        }
        // Q8_0 and F16 KV caches (F32 weights): within 1% of the largest |logit|.
        for kv in [GgmlType::Q8_0, GgmlType::F16] {
            let mut mk = model(&hp, &wf, 1, kv);
            let lk = mk.prefill(0, &PROMPT, 4, true).unwrap().to_vec();
            let diff = max_diff(&lf, &lk);
            assert!(diff <= 0.01 * scale, "{kv} KV: {diff} vs scale {scale}");
        }
    }

    #[test]
    fn q4_k_model_runs_close_to_f32() {
        // Q4_K rows are 256 elements: a model with n_embd 256 and n_ff_exp 256, so every
        // matrix but attn_output (rows of n_head x head_dim = 64, kept Q8_0) is Q4_K.
        let mut hp = tiny_hp();
        hp.n_embd = 256;
        hp.n_ff_exp = 256;
        hp.n_layer = 1;
        let wf = tiny_weights(&hp, GgmlType::F32, 5);
        let wq = tiny_weights(&hp, GgmlType::Q4K, 5);
        let mut mf = model(&hp, &wf, 1, GgmlType::F32);
        let lf = mf.prefill(0, &PROMPT[..5], 5, false).unwrap().to_vec();
        let mut mq = model(&hp, &wq, 1, GgmlType::F32);
        let lq = mq.prefill(0, &PROMPT[..5], 5, false).unwrap().to_vec();
        let scale = lf.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Exactness of the on-the-fly Q4_K path: an F32 model holding the dequantized Q4_K
        // values gives the same logits within 1e-4 of the largest |logit| (only the order of
        // f32 sums differs).
        let wd = dequantized_copy(&wq);
        let mut md = model(&hp, &wd, 1, GgmlType::F32);
        let ld = md.prefill(0, &PROMPT[..5], 5, false).unwrap().to_vec();
        let exact = max_diff(&ld, &lq);
        assert!(
            exact <= 1e-4 * scale,
            "Q4_K vs its dequantized copy: {exact}"
        );
        // Against the original f32 weights (uniform ±0.2, so ~7% RMS error per weight over
        // six matmuls in series plus router flips): relative RMS logit error <= 30%.
        let num: f32 = lf.iter().zip(&lq).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f32 = lf.iter().map(|a| a * a).sum();
        let rel = (num / den).sqrt();
        assert!(
            max_diff(&lf, &lq) > 0.0 && rel <= 0.30,
            "relative RMS {rel}"
        );
    }

    #[test]
    fn yarn_model_rope_and_kv_region() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 6);
        let rs = RopeScaling {
            kind: "yarn".into(),
            factor: 4.0,
            orig_ctx: Some(64),
        };
        let y = yarn_from_settings(&rs, &hp).unwrap();
        let opts = ModelOptions {
            max_batch_tokens: 4,
            yarn: Some(y),
        };
        let need = KvCache::bytes_needed(&hp, GgmlType::Q8_0, 32).unwrap();
        // DESIGN: bytes = n_layer x cells x kv_bytes_per_cell_layer.
        assert_eq!(need, 2 * 32 * hp.kv_bytes_per_cell_layer(GgmlType::Q8_0));
        let mut region = vec![0xAAu8; need as usize + 16];
        {
            let mut m = Model::new(&hp, &w, opts).unwrap();
            // Same hand values as backend::cpu's YaRN test: head_dim 16, theta 1e4, factor 4.
            assert!((m.rope().inv_freq()[1] - 0.237_170_8).abs() < 1e-6);
            assert!((m.rope().attn_factor() - 1.138_629_4).abs() < 1e-6);
            let kv = KvCache::in_region(&hp, GgmlType::Q8_0, 32, &mut region).unwrap();
            let s = m.add_slot(kv).unwrap();
            let l = m.prefill(s, &PROMPT, 4, false).unwrap();
            assert!(l.iter().all(|v| v.is_finite()));
        }
        assert!(
            region[..need as usize].iter().any(|b| *b != 0xAA),
            "KV written in the region"
        );
        assert!(
            region[need as usize..].iter().all(|b| *b == 0xAA),
            "nothing past it"
        );
        let mut small = vec![0u8; need as usize - 1];
        assert!(KvCache::in_region(&hp, GgmlType::Q8_0, 32, &mut small).is_err());
    }

    #[test]
    fn bad_inputs_are_refused_with_names() {
        let hp = tiny_hp();
        let mut w = tiny_weights(&hp, GgmlType::F32, 7);
        let mut m = model(&hp, &w, 1, GgmlType::F32);
        assert!(matches!(
            m.prefill(0, &[97], 1, false),
            Err(ModelError::BadToken { token: 97, .. })
        ));
        assert!(matches!(
            m.prefill(1, &[1], 1, false),
            Err(ModelError::NoSlot { .. })
        ));
        assert!(matches!(
            m.prefill(0, &[1; 65], 8, false),
            Err(ModelError::ContextFull { .. })
        ));
        assert!(matches!(
            m.prefill(0, &[1; 4], 9, false),
            Err(ModelError::BatchTooLarge { .. })
        ));
        assert_eq!(
            m.slot(0).unwrap().len(),
            0,
            "refused requests leave the slot alone"
        );
        // A KV row of 2 x 16 = 32 fits Q8_0; a wrong-shaped tensor is named.
        let mut bad = w.get("blk.1.attn_k.weight").unwrap().clone();
        bad.dims = vec![64, 16];
        bad.data.truncate(64 * 16 * 4);
        w.insert("blk.1.attn_k.weight", bad);
        let err = Model::new(&hp, &w, ModelOptions::new(4)).unwrap_err();
        assert!(err.to_string().contains("blk.1.attn_k.weight"), "{err}");
        let mut w2 = tiny_weights(&hp, GgmlType::F32, 7);
        w2.tensors.remove("blk.0.ffn_up_exps.weight");
        let err = Model::new(&hp, &w2, ModelOptions::new(4)).unwrap_err();
        assert_eq!(
            err,
            ModelError::MissingTensor {
                name: "blk.0.ffn_up_exps.weight".into()
            }
        );
    }

    #[test]
    fn norm_topk_prob_changes_the_output() {
        let mut hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 8);
        let a = model(&hp, &w, 1, GgmlType::F32)
            .prefill(0, &PROMPT[..4], 4, false)
            .unwrap()
            .to_vec();
        hp.norm_topk_prob = false;
        let mut mb = model(&hp, &w, 1, GgmlType::F32);
        let b = mb.prefill(0, &PROMPT[..4], 4, false).unwrap();
        assert!(max_diff(&a, b) > 1e-4);
    }
}
