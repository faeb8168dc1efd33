//! Model forward passes and the weight-source abstraction they read tensors through.
//! Invariant: a forward pass sees weights only as (type, GGUF dims, bytes) views named with
//! llama.cpp's tensor names; where the bytes live (mmap, arena, test map) is the source's
//! business.

pub mod qwen3moe;

#[cfg(test)]
mod hf_reference;

use crate::quant::{self, QuantError};
use std::collections::HashMap;
use strata_schemas::ggml::GgmlType;

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
}

impl<T: WeightSource + ?Sized> WeightSource for &T {
    fn tensor(&self, name: &str) -> Option<WeightView<'_>> {
        (**self).tensor(name)
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
