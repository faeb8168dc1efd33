//! Test-only fixtures (this crate's tests, and other crates' through the `test-support`
//! feature): a GGUF byte builder that writes exactly the bytes it is told (including hostile
//! ones) so reader tests can hand-make every malformed file class, not a real writer (it
//! checks nothing); and [`tiny_qwen3next`], the smallest Qwen3-Next shape the tests plan,
//! split and run.

use super::value_type as t;

/// A tiny Qwen3-Next: 4 blocks of width 64 (every second full attention), 4 experts of 32
/// (top-2) with a shared expert, a linear-attention state of 2 groups of 16, one MTP block.
/// Tests change what they need with `HParams { n_layer: 2, ..tiny_qwen3next() }`.
pub fn tiny_qwen3next() -> HParams {
    HParams {
        n_layer: 4,
        n_embd: 64,
        n_vocab: 128,
        n_ctx_train: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: 16,
        head_dim_v: 16,
        n_ff: 0,
        n_expert: 4,
        n_expert_used: 2,
        n_ff_exp: 32,
        n_ff_shexp: 32,
        n_leading_dense: 0,
        full_attention_interval: Some(2),
        ssm: Some(SsmParams {
            conv_kernel: 4,
            state_size: 16,
            group_count: 2,
            time_step_rank: 4,
            inner_size: 64,
        }),
        nextn_predict_layers: 1,
        rope_theta: 10_000.0,
        rope_dim: Some(4),
        rms_eps: 1e-6,
        norm_topk_prob: true,
        tied_embeddings: false,
    }
}

/// Builds GGUF bytes field by field. `raw_*` methods write whatever they are given.
#[derive(Default, Clone)]
pub struct B {
    pub buf: Vec<u8>,
}

impl B {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn u8(mut self, v: u8) -> Self {
        self.buf.push(v);
        self
    }
    pub fn u16(mut self, v: u16) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(mut self, b: &[u8]) -> Self {
        self.buf.extend_from_slice(b);
        self
    }
    /// A GGUF string: u64 length then the bytes.
    pub fn str(self, s: &str) -> Self {
        self.raw_str(s.as_bytes())
    }
    pub fn raw_str(self, b: &[u8]) -> Self {
        self.u64(b.len() as u64).bytes(b)
    }
    /// Magic, version, n_tensors, n_kv.
    pub fn header(self, version: u32, n_tensors: u64, n_kv: u64) -> Self {
        self.bytes(b"GGUF").u32(version).u64(n_tensors).u64(n_kv)
    }
    pub fn kv_u32(self, key: &str, v: u32) -> Self {
        self.str(key).u32(t::U32).u32(v)
    }
    pub fn kv_u16(self, key: &str, v: u16) -> Self {
        self.str(key).u32(t::U16).u16(v)
    }
    pub fn kv_str(self, key: &str, v: &str) -> Self {
        self.str(key).u32(t::STRING).str(v)
    }
    pub fn kv_bool(self, key: &str, v: u8) -> Self {
        self.str(key).u32(t::BOOL).u8(v)
    }
    /// A tensor info record.
    pub fn tensor(self, name: &str, dims: &[u64], ggml_type: u32, offset: u64) -> Self {
        let mut b = self.str(name).u32(dims.len() as u32);
        for d in dims {
            b = b.u64(*d);
        }
        b.u32(ggml_type).u64(offset)
    }
    /// Zero padding up to the next multiple of `align`.
    pub fn pad(mut self, align: usize) -> Self {
        while self.buf.len() % align != 0 {
            self.buf.push(0);
        }
        self
    }
    /// `n` bytes of fake tensor data.
    pub fn data(mut self, n: usize) -> Self {
        self.buf.extend((0..n).map(|i| i as u8));
        self
    }
    pub fn done(self) -> Vec<u8> {
        self.buf
    }
}

/// A small valid file: metadata of several types and two F32 tensors (4x2 and 8 elements).
pub fn valid(version: u32) -> Vec<u8> {
    B::new()
        .header(version, 2, 4)
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        .kv_bool("general.flag", 1)
        .str("tokenizer.ggml.tokens")
        .u32(t::ARRAY)
        .u32(t::STRING)
        .u64(3)
        .str("a")
        .str("bb")
        .str("")
        .tensor("tok_embd.weight", &[4, 2], 0, 0)
        .tensor("output_norm.weight", &[8], 0, 32)
        .pad(32)
        .data(64)
        .done()
}

impl B {
    /// A key/value with a raw type id and raw value bytes.
    pub fn kv_raw(self, key: &str, ty: u32, value: &[u8]) -> Self {
        self.str(key).u32(ty).bytes(value)
    }
}

/// One part of a split model written by gguf-split: `split.*` keys, one F32 tensor of 8
/// elements named `name`, and its data.
pub fn split_part(no: u16, count: u16, name: &str, extra_kv: bool) -> Vec<u8> {
    let n_kv = if extra_kv { 4 } else { 2 };
    let mut b = B::new()
        .header(3, 1, n_kv)
        .kv_u16("split.no", no)
        .kv_u16("split.count", count);
    if extra_kv {
        b = b
            .kv_raw(
                "split.tensors.count",
                t::I32,
                &i32::from(count).to_le_bytes(),
            )
            .kv_str("general.architecture", "llama");
    }
    b.tensor(name, &[8], 0, 0).pad(32).data(32).done()
}

// Shared helpers of the writer, random-model and conversion tests.

use super::read_gguf;
use crate::inventory::{HParams, SsmParams};
use crate::quant;
use std::path::Path;

/// A fresh temporary folder.
pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// A qwen3moe small enough for debug-build tests; widths hold 32-element blocks.
pub fn small_moe() -> HParams {
    HParams {
        n_layer: 2,
        n_embd: 64,
        n_vocab: 32,
        n_ctx_train: 4096,
        n_head: 2,
        n_head_kv: 1,
        head_dim_k: 32,
        head_dim_v: 32,
        n_ff: 0,
        n_expert: 2,
        n_expert_used: 1,
        n_ff_exp: 32,
        n_ff_shexp: 0,
        n_leading_dense: 0,
        full_attention_interval: None,
        ssm: None,
        nextn_predict_layers: 0,
        rope_theta: 1e6,
        rope_dim: None,
        rms_eps: 1e-6,
        norm_topk_prob: true,
        tied_embeddings: false,
    }
}

/// A qwen3next (linear block, full block, MTP block) of the same size.
pub fn small_next() -> HParams {
    HParams {
        n_ff_shexp: 32,
        full_attention_interval: Some(2),
        ssm: Some(SsmParams {
            conv_kernel: 4,
            state_size: 16,
            group_count: 2,
            time_step_rank: 4,
            inner_size: 64,
        }),
        nextn_predict_layers: 1,
        rope_dim: Some(16),
        ..small_moe()
    }
}

/// The same models with every quantized row a multiple of 256, so Q4_K never falls back
/// (and one block of each kind only: debug-build Q4_K quantization is slow).
pub fn q4k_shapes(mut hp: HParams) -> HParams {
    hp.n_layer = hp.full_attention_interval.unwrap_or(1);
    hp.nextn_predict_layers = 0;
    hp.n_embd = 256;
    hp.head_dim_k = 128;
    hp.head_dim_v = 128;
    hp.n_ff_exp = 256;
    hp.n_expert = 1;
    if hp.ssm.is_some() {
        hp.n_ff_shexp = 256;
        hp.rope_dim = Some(64);
        hp.ssm = Some(SsmParams {
            conv_kernel: 4,
            state_size: 64,
            group_count: 2,
            time_step_rank: 4,
            inner_size: 256,
        });
    }
    hp
}

/// Every value of tensor `name` of the GGUF at `path`, dequantized.
pub fn tensor_f32(path: &Path, name: &str) -> Vec<f32> {
    let f = read_gguf(path).unwrap();
    let t = f.tensor(name).unwrap();
    let bytes = std::fs::read(path).unwrap();
    let at = f.tensor_file_offset(t).unwrap() as usize;
    let raw = &bytes[at..at + t.bytes as usize];
    let mut out = vec![0f32; t.n_elements() as usize];
    let ne0 = t.dims[0] as usize;
    let rb = t.ggml_type.bytes_for(ne0 as u64).unwrap() as usize;
    for (r, o) in raw.chunks_exact(rb).zip(out.chunks_exact_mut(ne0)) {
        quant::dequantize_row(t.ggml_type, r, o).unwrap();
    }
    out
}
