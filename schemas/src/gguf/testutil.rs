//! Test-only GGUF byte builder: writes exactly the bytes it is told (including hostile ones)
//! so reader tests can hand-make every malformed file class. Not a real writer: it checks
//! nothing.

use super::value_type as t;

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
