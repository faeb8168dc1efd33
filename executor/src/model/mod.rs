//! Model forward passes, one module per architecture written once over the backend seam
//! (`backend::Ops`), and the weight-source abstraction a CPU backend binds tensors through.
//! Invariant: a forward pass names weights only by llama.cpp's tensor names and shapes;
//! where the bytes live (mmap, arena, device) is the backend's business, and every tensor is
//! checked (presence, dims, type, byte count) before the first pass.

pub mod arch;
pub mod qwen3moe;
pub mod qwen3next;

#[cfg(test)]
mod hf_reference;

use crate::backend::Ops;
use crate::quant::{self, QuantError};
use std::collections::HashMap;
use strata_schemas::ggml::GgmlType;

/// A problem with the model's tensors or hyperparameters, naming the tensor or key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    #[error("tensor `{name}` is missing: the {arch} forward pass needs it (was the file converted for another architecture?)")]
    MissingTensor { name: String, arch: &'static str },
    #[error("tensor `{name}` is in the model but not on this stage: {why}")]
    NotOnStage { name: String, why: String },
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
}

/// Where the hidden states an MTP pass drafts from (the `mtp_hidden` buffer) come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MtpInput {
    /// The main model's last stage (`x` after its last block, before the output norm).
    Main,
    /// The MTP block's own output (`x` after the block, before its head norm): chained drafts.
    Chained,
}

/// A model's forward pass over one stage of a pipeline (its layers, and the embedding and
/// head where the stage holds them), as a pipeline drives it.
pub trait Forward<B: Ops> {
    /// Run the stage's layers over the `n` tokens of a pass whose inputs are uploaded: the
    /// first stage embeds its tokens into `x`, the others start from the `x` the previous
    /// stage handed on; the final hidden states are left in `x`.
    fn forward(&self, b: &mut B, n: usize) -> Result<(), B::Error>;
    /// The output norm and head over rows `first..first + rows` of `x`, into the logits
    /// buffer's rows `0..rows` (last stage only).
    fn head(&self, b: &mut B, first: usize, rows: usize) -> Result<(), B::Error>;
    /// Whether this stage holds the output head.
    fn holds_head(&self) -> bool;
    /// Whether this stage keeps per-slot state that summarises every token so far
    /// (linear attention), so a slot's context cannot be cut back to a shorter prefix.
    fn recurrent(&self) -> bool {
        false
    }
    /// Whether this stage holds the MTP draft block (bound when the plan speculates).
    fn holds_mtp(&self) -> bool {
        false
    }
    /// The MTP draft block over the `n` tokens of a pass whose inputs are uploaded (token i is
    /// `x_{t+1}`, `mtp_hidden` row i the hidden state of position t, the pass position t):
    /// its output hidden states are left in `x`, and with `head` the draft logits of rows
    /// `first..first + rows` in the logits buffer's rows `0..rows`. Nothing on a stage
    /// without the block (see [`Forward::holds_mtp`]).
    fn mtp(
        &self,
        b: &mut B,
        n: usize,
        input: MtpInput,
        head: Option<(usize, usize)>,
    ) -> Result<(), B::Error> {
        let _ = (b, n, input, head);
        Ok(())
    }
}

/// The ends of a stage every architecture shares: the token embedding (first stage) and the
/// output norm and LM head (last stage; the embedding again when the model ties them and has
/// no `output.weight`).
pub struct Ends<B: Ops> {
    embd: Option<B::Mat>,
    out_norm: Option<B::Vector>,
    head: Option<B::Mat>,
}

impl<B: crate::backend::Bind> Ends<B> {
    /// Bind the embedding when `embedding`, the output norm and head when `head`.
    pub fn bind(
        b: &mut B,
        d: &strata_schemas::dims::Dims,
        hp: &strata_schemas::inventory::HParams,
        embedding: bool,
        head: bool,
    ) -> Result<Self, B::Error> {
        let embd = if embedding {
            Some(b.matrix("token_embd.weight", d.vocab, d.e)?)
        } else {
            None
        };
        if !head {
            return Ok(Self {
                embd,
                out_norm: None,
                head: None,
            });
        }
        let norm = b.vector("output_norm.weight", d.e)?;
        let name = if b.has("output.weight") || !hp.tied_embeddings {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        Ok(Self {
            embd,
            out_norm: Some(norm),
            head: Some(b.matrix(name, d.vocab, d.e)?),
        })
    }
}

impl<B: Ops> Ends<B> {
    /// `X = embedding[tokens]` on the first stage; nothing elsewhere.
    pub fn embed(&self, b: &mut B, n: usize) -> Result<(), B::Error> {
        match self.embd {
            Some(e) => b.embed(e, crate::backend::WorkBuf::X, n),
            None => Ok(()),
        }
    }

    /// [`Forward::head`]: the output norm of `X[first..first + rows]` and the LM head into
    /// the logits (nothing on a stage without the head; the pipeline checks
    /// [`Ends::holds_head`] of its last stage at start-up).
    pub fn head(&self, b: &mut B, first: usize, rows: usize) -> Result<(), B::Error> {
        use crate::backend::WorkBuf;
        let (Some(norm), Some(head)) = (self.out_norm, self.head) else {
            return Ok(());
        };
        b.rms_norm(WorkBuf::X, first, norm, WorkBuf::Xn, rows)?;
        b.project(WorkBuf::Xn, &[(head, WorkBuf::Logits)], rows)
    }

    pub fn holds_head(&self) -> bool {
        self.head.is_some()
    }
}

/// `name` from `src`, checked: present, the given dims, a supported type, its exact bytes.
pub fn check_view<'a, S: WeightSource + ?Sized>(
    src: &'a S,
    arch: &'static str,
    name: &str,
    dims: &[u64],
) -> Result<WeightView<'a>, ModelError> {
    let v = src.tensor(name).ok_or_else(|| match src.absent_why(name) {
        Some(why) => ModelError::NotOnStage {
            name: name.into(),
            why,
        },
        None => ModelError::MissingTensor {
            name: name.into(),
            arch,
        },
    })?;
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

/// One tensor's bytes as stored in GGUF: `dims[0]` is contiguous, so `[ne0, ne1]` is `ne1`
/// rows of `ne0` elements (a PyTorch weight of shape `[ne1, ne0]`).
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub ggml_type: GgmlType,
    pub dims: &'a [u64],
    pub data: &'a [u8],
}

/// Where a forward pass gets its tensors by llama.cpp name.
pub trait WeightSource {
    /// The tensor called `name` (e.g. `blk.0.attn_q.weight`), or `None` if absent.
    fn tensor(&self, name: &str) -> Option<WeightView<'_>>;
    /// Why `name` is absent when the model has it but this source (one stage's share of a
    /// plan) does not; `None` when the model lacks it too.
    fn absent_why(&self, name: &str) -> Option<String> {
        let _ = name;
        None
    }
}

impl<T: WeightSource + ?Sized> WeightSource for &T {
    fn tensor(&self, name: &str) -> Option<WeightView<'_>> {
        (**self).tensor(name)
    }
    fn absent_why(&self, name: &str) -> Option<String> {
        (**self).absent_why(name)
    }
}

/// An owned tensor of [`MemWeights`].
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedTensor {
    pub ggml_type: GgmlType,
    pub dims: Vec<u64>,
    pub data: Vec<u8>,
}

/// An in-memory weight source (tests, small converted models).
#[derive(Debug, Clone, Default)]
pub struct MemWeights {
    tensors: HashMap<String, OwnedTensor>,
}

impl MemWeights {
    pub fn new() -> Self {
        Self::default()
    }

    /// Insert already-encoded bytes.
    pub fn insert(&mut self, name: impl Into<String>, t: OwnedTensor) {
        self.tensors.insert(name.into(), t);
    }

    /// Encode f32 values (GGUF dims order, `dims[0]` contiguous) as `ty` row by row and insert.
    pub fn insert_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        values: &[f32],
        ty: GgmlType,
    ) -> Result<(), QuantError> {
        let ne0 = *dims.first().unwrap_or(&1) as usize;
        let n: u64 = dims.iter().product();
        if values.len() as u64 != n || ne0 == 0 {
            return Err(QuantError::ByteLength {
                ty: GgmlType::F32,
                n: n as usize,
                expected: n as usize * 4,
                got: values.len() * 4,
            });
        }
        let mut data = Vec::with_capacity(quant::row_bytes(ty, ne0)? * (values.len() / ne0));
        for row in values.chunks_exact(ne0) {
            quant::quantize_row(ty, row, &mut data)?;
        }
        self.insert(
            name,
            OwnedTensor {
                ggml_type: ty,
                dims: dims.to_vec(),
                data,
            },
        );
        Ok(())
    }

    /// Take the tensor called `name` out.
    pub fn remove(&mut self, name: &str) -> Option<OwnedTensor> {
        self.tensors.remove(name)
    }

    /// Names in sorted order.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(|s| s.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&OwnedTensor> {
        self.tensors.get(name)
    }
}

impl WeightSource for MemWeights {
    fn tensor(&self, name: &str) -> Option<WeightView<'_>> {
        self.tensors.get(name).map(|t| WeightView {
            ggml_type: t.ggml_type,
            dims: &t.dims,
            data: &t.data,
        })
    }
}
