//! GGUF v3 writer: header, metadata of every value type, tensor infos, alignment padding and
//! streamed tensor data; plus the two producers built on it — deterministic random-weight
//! models in llama.cpp's layout ([`write_random_model`]) and Hugging Face safetensors
//! conversion ([`convert_hf_folder`]).
//! Invariant: the layout (every tensor offset a multiple of the alignment, the data section
//! aligned) is computed before the first byte is written, every tensor receives exactly its
//! block-table byte count or the write fails naming it, and tensor data is streamed, never held
//! whole. A file appears under its final name only once it is complete (written to
//! `<name>.partial`, then renamed).

use super::read::CAPS;
use super::{GgufArray, GgufValue, DEFAULT_ALIGNMENT};
use crate::arch::{self, QuantRecipe};
use crate::ggml::GgmlType;
use crate::inventory::{HParams, InventoryError, TensorInfo};
use crate::quant::{self, QuantError};
use crate::safetensors::{self, SafetensorsError, StDtype, StTensor};
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// GGUF format version this writer produces.
pub const GGUF_VERSION: u32 = 3;

/// Everything that can go wrong writing a GGUF file. Messages name the file and the key,
/// tensor or byte offset, and the fix.
#[derive(Debug, thiserror::Error)]
pub enum GgufWriteError {
    #[error("{file}: cannot write ({what}, byte {offset}): {source}; check the path, free disk space and permissions")]
    Io {
        file: String,
        offset: u64,
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{file}: metadata key '{key}': {problem}")]
    BadKey {
        file: String,
        key: String,
        problem: String,
    },
    #[error("{file}: tensor '{name}': {problem}")]
    BadTensor {
        file: String,
        name: String,
        problem: String,
    },
    #[error("{file}: tensor '{name}': {got} bytes of data were written but a {ty} tensor of dims {dims:?} takes exactly {expected}")]
    ByteCount {
        file: String,
        name: String,
        ty: GgmlType,
        dims: Vec<u64>,
        expected: u64,
        got: u64,
    },
    #[error("{file}: tensor '{name}': {source}")]
    Quant {
        file: String,
        name: String,
        #[source]
        source: QuantError,
    },
    #[error("{file}: tensor '{name}' has type {ty}, which this writer cannot quantize (it writes F32, F16, BF16, Q8_0 and Q4_K); use one of those presets, keep every quantized row a multiple of 256 for Q4_K (else llama.cpp's fallback picks Q5_0), or allow zero-filled blocks (--zero-unsupported)")]
    Unsupported {
        file: String,
        name: String,
        ty: GgmlType,
    },
    #[error("{file}: {source}")]
    Inventory {
        file: String,
        #[source]
        source: InventoryError,
    },
    #[error("{source}")]
    Safetensors {
        #[source]
        source: SafetensorsError,
    },
    #[error("{file}: {problem}")]
    Convert { file: String, problem: String },
}

// ---------------------------------------------------------------------------------------------
// Low-level writer
// ---------------------------------------------------------------------------------------------

/// A tensor record with its place in the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedTensor {
    pub name: String,
    /// GGUF order: `dims[0]` is contiguous.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Exact bytes from the block table.
    pub bytes: u64,
    /// Offset relative to the data section (a multiple of the alignment).
    pub offset: u64,
}

/// What a finished write produced.
#[derive(Debug, Clone, PartialEq)]
pub struct WriteSummary {
    pub path: PathBuf,
    /// Size of the file.
    pub file_bytes: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    pub n_tensors: usize,
    pub seconds: f64,
}

/// Called with (bytes written so far, total bytes of the file).
pub type ProgressFn = Box<dyn FnMut(u64, u64)>;

/// Collects metadata and tensor infos, then writes the file in one pass.
///
/// ```no_run
/// use strata_schemas::gguf::{write::GgufWriter, GgufValue};
/// use strata_schemas::ggml::GgmlType;
/// let mut w = GgufWriter::new("out.gguf");
/// w.kv("general.architecture", GgufValue::String("qwen3moe".into())).unwrap();
/// w.tensor_info("output_norm.weight", &[8], GgmlType::F32).unwrap();
/// w.write_with(|_i, _t, out| out.write_all(&[0u8; 32])).unwrap();
/// ```
pub struct GgufWriter {
    path: PathBuf,
    metadata: Vec<(String, GgufValue)>,
    keys: HashSet<String>,
    tensors: Vec<(String, Vec<u64>, GgmlType, u64)>,
    names: HashSet<String>,
    alignment: u64,
    progress: Option<ProgressFn>,
}

impl std::fmt::Debug for GgufWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufWriter")
            .field("path", &self.path)
            .field("keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish()
    }
}

impl GgufWriter {
    /// A writer for `path` with no metadata and no tensors (alignment 32).
    pub fn new(path: impl AsRef<Path>) -> Self {
        Self {
            path: path.as_ref().to_path_buf(),
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            alignment: DEFAULT_ALIGNMENT,
            progress: None,
        }
    }

    fn file(&self) -> String {
        self.path.display().to_string()
    }

    fn bad_key(&self, key: &str, problem: impl Into<String>) -> GgufWriteError {
        GgufWriteError::BadKey {
            file: self.file(),
            key: key.to_string(),
            problem: problem.into(),
        }
    }

    fn bad_tensor(&self, name: &str, problem: impl Into<String>) -> GgufWriteError {
        GgufWriteError::BadTensor {
            file: self.file(),
            name: name.to_string(),
            problem: problem.into(),
        }
    }

    /// Add a metadata key. Keys are unique; `general.alignment` must be a u32 power of two
    /// (at most 1 MiB) and sets the alignment of the data section and every tensor.
    pub fn kv(&mut self, key: &str, value: GgufValue) -> Result<&mut Self, GgufWriteError> {
        if key.is_empty() || key.len() as u64 > CAPS.max_name_len {
            return Err(self.bad_key(
                key,
                format!("keys must be 1..={} bytes long", CAPS.max_name_len),
            ));
        }
        if self.keys.contains(key) {
            return Err(self.bad_key(key, "given twice; metadata keys must be unique"));
        }
        check_value(&value, 1).map_err(|p| self.bad_key(key, p))?;
        if key == "general.alignment" {
            match value {
                GgufValue::U32(a) if a.is_power_of_two() && u64::from(a) <= CAPS.max_alignment => {
                    self.alignment = u64::from(a);
                }
                _ => {
                    return Err(self.bad_key(
                        key,
                        format!(
                            "must be a u32 power of two at most {} (llama.cpp reads it as u32)",
                            CAPS.max_alignment
                        ),
                    ))
                }
            }
        }
        self.keys.insert(key.to_string());
        self.metadata.push((key.to_string(), value));
        Ok(self)
    }

    /// Add a tensor record (GGUF dims: `dims[0]` contiguous, 1..=4 dims, each >= 1). Data is
    /// written later, in the order the tensors were added.
    pub fn tensor_info(
        &mut self,
        name: &str,
        dims: &[u64],
        ggml_type: GgmlType,
    ) -> Result<&mut Self, GgufWriteError> {
        if name.is_empty() || name.len() as u64 > CAPS.max_name_len {
            return Err(self.bad_tensor(
                name,
                format!("names must be 1..={} bytes long", CAPS.max_name_len),
            ));
        }
        if self.names.contains(name) {
            return Err(self.bad_tensor(name, "given twice; tensor names must be unique"));
        }
        if dims.is_empty() || dims.len() as u32 > CAPS.max_dims || dims.contains(&0) {
            return Err(self.bad_tensor(
                name,
                format!(
                    "dims {dims:?}: need 1..={} dims, each at least 1",
                    CAPS.max_dims
                ),
            ));
        }
        let elems = dims
            .iter()
            .try_fold(1u64, |a, d| a.checked_mul(*d))
            .filter(|n| *n <= CAPS.max_elements);
        let bytes = elems.and_then(|_| ggml_type.tensor_bytes(dims)).ok_or_else(|| {
            self.bad_tensor(
                name,
                format!(
                    "dims {dims:?} do not fit type {ggml_type} (ne0 must be a multiple of {} and at most 2^50 elements)",
                    ggml_type.block_elems()
                ),
            )
        })?;
        self.names.insert(name.to_string());
        self.tensors
            .push((name.to_string(), dims.to_vec(), ggml_type, bytes));
        Ok(self)
    }

    /// Report progress while writing data.
    pub fn on_progress(&mut self, f: ProgressFn) -> &mut Self {
        self.progress = Some(f);
        self
    }

    /// The data-section alignment (`general.alignment` or 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Tensors in file order with their data offsets.
    pub fn planned(&self) -> Vec<PlannedTensor> {
        let mut off = 0u64;
        self.tensors
            .iter()
            .map(|(name, dims, ty, bytes)| {
                let t = PlannedTensor {
                    name: name.clone(),
                    dims: dims.clone(),
                    ggml_type: *ty,
                    bytes: *bytes,
                    offset: off,
                };
                off = align_up(off + bytes, self.alignment);
                t
            })
            .collect()
    }

    /// The header bytes (magic through the last tensor info, without padding).
    pub fn header_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        put_u32(&mut b, GGUF_VERSION);
        put_u64(&mut b, self.tensors.len() as u64);
        put_u64(&mut b, self.metadata.len() as u64);
        for (k, v) in &self.metadata {
            put_str(&mut b, k);
            put_u32(&mut b, v.type_id());
            put_value(&mut b, v);
        }
        for t in self.planned() {
            put_str(&mut b, &t.name);
            put_u32(&mut b, t.dims.len() as u32);
            for d in &t.dims {
                put_u64(&mut b, *d);
            }
            put_u32(&mut b, t.ggml_type.id());
            put_u64(&mut b, t.offset);
        }
        b
    }

    /// Write the header, then start streaming tensor data (see [`GgufStream`]).
    pub fn begin(self) -> Result<GgufStream, GgufWriteError> {
        let started = Instant::now();
        let header = self.header_bytes();
        let planned = self.planned();
        let data_offset = align_up(header.len() as u64, self.alignment);
        let data_len = planned
            .last()
            .map(|t| align_up(t.offset + t.bytes, self.alignment))
            .unwrap_or(0);
        let file = self.file();
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".partial");
        let tmp = PathBuf::from(tmp);
        let f = File::create(&tmp).map_err(|source| GgufWriteError::Io {
            file: tmp.display().to_string(),
            offset: 0,
            what: "create".into(),
            source,
        })?;
        let mut s = GgufStream {
            out: Some(BufWriter::with_capacity(8 << 20, f)),
            path: self.path,
            tmp,
            file,
            planned,
            alignment: self.alignment,
            data_offset,
            total: data_offset + data_len,
            pos: 0,
            cur: 0,
            in_cur: 0,
            progress: self.progress,
            last_progress: 0,
            started,
        };
        s.raw(&header, "header")?;
        s.pad_to(data_offset, "header padding")?;
        s.skip_empty();
        Ok(s)
    }

    /// Write everything: `data(i, tensor, out)` is called once per tensor in order and must
    /// write exactly `tensor.bytes` bytes to `out`.
    pub fn write_with<F>(self, mut data: F) -> Result<WriteSummary, GgufWriteError>
    where
        F: FnMut(usize, &PlannedTensor, &mut dyn Write) -> io::Result<()>,
    {
        let mut s = self.begin()?;
        let planned = s.planned.clone();
        for (i, t) in planned.iter().enumerate() {
            let mut w = TensorWriter { s: &mut s };
            if let Err(e) = data(i, t, &mut w) {
                return Err(
                    match e.get_ref().and_then(|r| r.downcast_ref::<Overrun>()) {
                        Some(o) => GgufWriteError::ByteCount {
                            file: s.file.clone(),
                            name: t.name.clone(),
                            ty: t.ggml_type,
                            dims: t.dims.clone(),
                            expected: t.bytes,
                            got: o.got,
                        },
                        None => GgufWriteError::Io {
                            file: s.file.clone(),
                            offset: s.pos,
                            what: format!("data of tensor '{}'", t.name),
                            source: e,
                        },
                    },
                );
            }
            if s.cur == i {
                return Err(GgufWriteError::ByteCount {
                    file: s.file.clone(),
                    name: t.name.clone(),
                    ty: t.ggml_type,
                    dims: t.dims.clone(),
                    expected: t.bytes,
                    got: s.in_cur,
                });
            }
        }
        s.finish()
    }
}

/// Marker error: a data callback wrote past the end of its tensor.
#[derive(Debug)]
struct Overrun {
    got: u64,
}
impl std::fmt::Display for Overrun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes is more than the tensor holds", self.got)
    }
}
impl std::error::Error for Overrun {}

/// `io::Write` over one tensor of a stream; refuses bytes past the tensor's end.
struct TensorWriter<'a> {
    s: &'a mut GgufStream,
}

impl Write for TensorWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let idx = self.s.cur;
        let Some(t) = self.s.planned.get(idx) else {
            return Err(io::Error::other(Overrun {
                got: buf.len() as u64,
            }));
        };
        let left = t.bytes - self.s.in_cur;
        if buf.len() as u64 > left {
            return Err(io::Error::other(Overrun {
                got: self.s.in_cur + buf.len() as u64,
            }));
        }
        self.s.data(buf).map_err(|e| match e {
            GgufWriteError::Io { source, .. } => source,
            other => io::Error::other(other.to_string()),
        })?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// An open file past its header: tensor data is appended in file order with [`data`]
/// (any split into calls), padding between tensors is inserted automatically.
///
/// [`data`]: GgufStream::data
pub struct GgufStream {
    /// `None` once finished.
    out: Option<BufWriter<File>>,
    path: PathBuf,
    tmp: PathBuf,
    file: String,
    planned: Vec<PlannedTensor>,
    alignment: u64,
    data_offset: u64,
    total: u64,
    /// Absolute bytes written.
    pos: u64,
    /// Tensor being written.
    cur: usize,
    /// Bytes of it written.
    in_cur: u64,
    progress: Option<ProgressFn>,
    last_progress: u64,
    started: Instant,
}

impl GgufStream {
    /// The tensor the next bytes belong to (`None` when all are complete).
    pub fn current(&self) -> Option<&PlannedTensor> {
        self.planned.get(self.cur)
    }

    /// Tensors in file order.
    pub fn planned(&self) -> &[PlannedTensor] {
        &self.planned
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    fn raw(&mut self, b: &[u8], what: &str) -> Result<(), GgufWriteError> {
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        out.write_all(b).map_err(|source| GgufWriteError::Io {
            file: self.file.clone(),
            offset: self.pos,
            what: what.to_string(),
            source,
        })?;
        self.pos += b.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, target: u64, what: &str) -> Result<(), GgufWriteError> {
        const ZEROS: [u8; 64] = [0; 64];
        while self.pos < target {
            let n = (target - self.pos).min(ZEROS.len() as u64) as usize;
            self.raw(&ZEROS[..n], what)?;
        }
        Ok(())
    }

    /// Move past zero-byte tensors (none exist: dims are >= 1) and report progress.
    fn skip_empty(&mut self) {
        while let Some(t) = self.planned.get(self.cur) {
            if self.in_cur < t.bytes {
                break;
            }
            self.cur += 1;
            self.in_cur = 0;
        }
    }

    /// Append bytes of the current tensor; a call may not cross the tensor's end. When a
    /// tensor completes, the padding to the next one is written.
    pub fn data(&mut self, mut b: &[u8]) -> Result<(), GgufWriteError> {
        while !b.is_empty() {
            let Some(t) = self.planned.get(self.cur) else {
                return Err(GgufWriteError::Convert {
                    file: self.file.clone(),
                    problem: format!(
                        "{} bytes of tensor data after the last tensor; the producer wrote too much",
                        b.len()
                    ),
                });
            };
            let left = t.bytes - self.in_cur;
            let n = (b.len() as u64).min(left) as usize;
            let what = format!("data of tensor '{}'", t.name);
            let end_rel = t.offset + t.bytes;
            self.raw(&b[..n], &what)?;
            self.in_cur += n as u64;
            b = &b[n..];
            if self.in_cur == self.planned[self.cur].bytes {
                let target = self.data_offset + align_up(end_rel, self.alignment);
                self.pad_to(target, "tensor padding")?;
                self.cur += 1;
                self.in_cur = 0;
            }
        }
        if let Some(p) = self.progress.as_mut() {
            if self.pos - self.last_progress >= (16 << 20) || self.pos == self.total {
                self.last_progress = self.pos;
                p(self.pos, self.total);
            }
        }
        Ok(())
    }

    /// Check every tensor is complete, flush, and move the file to its final name.
    pub fn finish(mut self) -> Result<WriteSummary, GgufWriteError> {
        if let Some(t) = self.planned.get(self.cur) {
            return Err(GgufWriteError::ByteCount {
                file: self.file.clone(),
                name: t.name.clone(),
                ty: t.ggml_type,
                dims: t.dims.clone(),
                expected: t.bytes,
                got: self.in_cur,
            });
        }
        debug_assert_eq!(self.pos, self.total);
        let pos = self.pos;
        let io = |file: &str, what: &str, source| GgufWriteError::Io {
            file: file.to_string(),
            offset: pos,
            what: what.to_string(),
            source,
        };
        if let Some(mut out) = self.out.take() {
            out.flush().map_err(|e| io(&self.file, "flush", e))?;
            let f = out
                .into_inner()
                .map_err(|e| io(&self.file, "flush", e.into_error()))?;
            f.sync_all().map_err(|e| io(&self.file, "sync", e))?;
        }
        std::fs::rename(&self.tmp, &self.path).map_err(|e| {
            io(
                &self.file,
                &format!("rename from {}", self.tmp.display()),
                e,
            )
        })?;
        if let Some(p) = self.progress.as_mut() {
            if self.last_progress != self.pos {
                p(self.pos, self.total);
            }
        }
        Ok(WriteSummary {
            path: self.path.clone(),
            file_bytes: self.pos,
            data_offset: self.data_offset,
            n_tensors: self.planned.len(),
            seconds: self.started.elapsed().as_secs_f64(),
        })
    }
}

impl Drop for GgufStream {
    /// An unfinished file is removed: no `.partial` is left behind by an error.
    fn drop(&mut self) {
        if let Some(out) = self.out.take() {
            drop(out);
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_str(b: &mut Vec<u8>, s: &str) {
    put_u64(b, s.len() as u64);
    b.extend_from_slice(s.as_bytes());
}

/// Strings within the reader's caps, arrays not nested deeper than it accepts.
fn check_value(v: &GgufValue, depth: u32) -> Result<(), String> {
    match v {
        GgufValue::String(s) if s.len() as u64 > CAPS.max_string_len => Err(format!(
            "a string of {} bytes is over the {}-byte limit",
            s.len(),
            CAPS.max_string_len
        )),
        GgufValue::Array(a) => check_array(a, depth),
        _ => Ok(()),
    }
}

fn check_array(a: &GgufArray, depth: u32) -> Result<(), String> {
    if depth > CAPS.max_array_depth {
        return Err(format!(
            "arrays nested deeper than {}",
            CAPS.max_array_depth
        ));
    }
    match a {
        GgufArray::Strings(v) => v
            .iter()
            .try_for_each(|s| check_value(&GgufValue::String(s.clone()), depth)),
        GgufArray::Arrays(v) => v.iter().try_for_each(|x| check_array(x, depth + 1)),
        _ => Ok(()),
    }
}

fn put_value(b: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => b.push(*x),
        GgufValue::I8(x) => b.push(*x as u8),
        GgufValue::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => b.push(u8::from(*x)),
        GgufValue::String(s) => put_str(b, s),
        GgufValue::Array(a) => put_array(b, a),
        GgufValue::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(b: &mut Vec<u8>, a: &GgufArray) {
    put_u32(b, a.elem_type_id());
    put_u64(b, a.len() as u64);
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                b.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => b.extend_from_slice(v),
        GgufArray::I8(v) => b.extend(v.iter().map(|x| *x as u8)),
        GgufArray::U16(v) => each!(v),
        GgufArray::I16(v) => each!(v),
        GgufArray::U32(v) => each!(v),
        GgufArray::I32(v) => each!(v),
        GgufArray::F32(v) => each!(v),
        GgufArray::Bool(v) => b.extend(v.iter().map(|x| u8::from(*x))),
        GgufArray::Strings(v) => v.iter().for_each(|s| put_str(b, s)),
        GgufArray::Arrays(v) => v.iter().for_each(|x| put_array(b, x)),
        GgufArray::U64(v) => each!(v),
        GgufArray::I64(v) => each!(v),
        GgufArray::F64(v) => each!(v),
    }
}

// ---------------------------------------------------------------------------------------------
// llama.cpp metadata
// ---------------------------------------------------------------------------------------------

/// A tokenizer vocabulary in llama.cpp's `tokenizer.ggml.*` form (BPE, "gpt2").
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Vocab {
    /// Token strings by id; must have `n_vocab` entries.
    pub tokens: Vec<String>,
    /// llama.cpp token types by id (1 normal, 3 control, 4 user defined, 5 unused...).
    pub token_type: Vec<i32>,
    /// BPE merges, "left right".
    pub merges: Vec<String>,
    /// `tokenizer.ggml.pre` (e.g. "qwen2"); omitted when `None`.
    pub pre: Option<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
    pub chat_template: Option<String>,
}

impl Vocab {
    /// The `tokenizer.*` metadata entries.
    pub fn metadata(&self) -> Vec<(String, GgufValue)> {
        let mut kv = vec![(
            "tokenizer.ggml.model".to_string(),
            GgufValue::String("gpt2".into()),
        )];
        if let Some(p) = &self.pre {
            kv.push(("tokenizer.ggml.pre".into(), GgufValue::String(p.clone())));
        }
        kv.push((
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(GgufArray::Strings(self.tokens.clone())),
        ));
        kv.push((
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(GgufArray::I32(self.token_type.clone())),
        ));
        kv.push((
            "tokenizer.ggml.merges".into(),
            GgufValue::Array(GgufArray::Strings(self.merges.clone())),
        ));
        for (k, v) in [
            ("tokenizer.ggml.bos_token_id", self.bos),
            ("tokenizer.ggml.eos_token_id", self.eos),
            ("tokenizer.ggml.padding_token_id", self.pad),
        ] {
            if let Some(id) = v {
                kv.push((k.into(), GgufValue::U32(id)));
            }
        }
        if let Some(t) = &self.chat_template {
            kv.push((
                "tokenizer.chat_template".into(),
                GgufValue::String(t.clone()),
            ));
        }
        kv
    }

    /// Check the vocabulary fits a model of `n_vocab` rows.
    pub fn check(&self, n_vocab: u64) -> Result<(), String> {
        if self.tokens.len() as u64 != n_vocab {
            return Err(format!(
                "{} tokens but the model has n_vocab = {n_vocab} embedding rows",
                self.tokens.len()
            ));
        }
        if self.token_type.len() != self.tokens.len() {
            return Err(format!(
                "{} token types for {} tokens",
                self.token_type.len(),
                self.tokens.len()
            ));
        }
        for (what, id) in [("bos", self.bos), ("eos", self.eos), ("pad", self.pad)] {
            if let Some(id) = id {
                if u64::from(id) >= n_vocab {
                    return Err(format!(
                        "{what} token id {id} is not below n_vocab {n_vocab}"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// llama.cpp's `general.file_type` (`LLAMA_FTYPE_*`) for a preset name or, failing that, the
/// type most matrix bytes have.
pub fn file_type(preset: &str, tensors: &[TensorInfo]) -> u32 {
    match preset.to_ascii_uppercase().as_str() {
        "F32" => return 0,
        "F16" => return 1,
        "Q8_0" => return 7,
        "Q4_K" | "Q4_K_S" => return 14,
        "Q4_K_M" => return 15,
        "IQ3_S" => return 26,
        "BF16" => return 32,
        _ => {}
    }
    let mut by: BTreeMap<GgmlType, u64> = BTreeMap::new();
    for t in tensors.iter().filter(|t| t.dims.len() >= 2) {
        *by.entry(t.ggml_type).or_default() += t.bytes;
    }
    let main = by.into_iter().max_by_key(|(_, b)| *b).map(|(t, _)| t);
    use GgmlType::*;
    match main {
        Some(F16) => 1,
        Some(Q4_0) => 2,
        Some(Q4_1) => 3,
        Some(Q8_0) => 7,
        Some(Q5_0) => 8,
        Some(Q5_1) => 9,
        Some(Q2K) => 10,
        Some(Q3K) => 12,
        Some(Q4K) => 14,
        Some(Q5K) => 16,
        Some(Q6K) => 18,
        Some(Iq2Xxs) => 19,
        Some(Iq2Xs) => 20,
        Some(Iq3Xxs) => 23,
        Some(Iq1S) => 24,
        Some(Iq4Nl) => 25,
        Some(Iq3S) => 26,
        Some(Iq2S) => 28,
        Some(Iq4Xs) => 30,
        Some(Iq1M) => 31,
        Some(BF16) => 32,
        _ => 0,
    }
}

fn u32_of(key: &str, v: u64) -> Result<GgufValue, String> {
    u32::try_from(v)
        .map(GgufValue::U32)
        .map_err(|_| format!("{key} = {v} does not fit the u32 llama.cpp stores"))
}

/// llama.cpp's metadata for `arch` with `hp` (names from llama-arch.cpp's `LLM_KV_NAMES`).
/// `block_count` counts every block, MTP blocks included (llama.cpp's convention, with
/// `nextn_predict_layers` saying how many of them are MTP); `rope.dimension_count` is the
/// rotated dims (the whole head unless `hp.rope_dim`); `expert_weights_norm` carries
/// `norm_topk_prob`.
pub fn arch_metadata(
    arch: &str,
    name: &str,
    hp: &HParams,
) -> Result<Vec<(String, GgufValue)>, String> {
    let k = |s: &str| format!("{arch}.{s}");
    let mut kv: Vec<(String, GgufValue)> = vec![
        (
            "general.architecture".into(),
            GgufValue::String(arch.into()),
        ),
        ("general.name".into(), GgufValue::String(name.into())),
    ];
    let push_u32 = |kv: &mut Vec<(String, GgufValue)>, key: String, v: u64| {
        let val = u32_of(&key, v)?;
        kv.push((key, val));
        Ok::<(), String>(())
    };
    push_u32(&mut kv, k("block_count"), u64::from(hp.n_blocks_total()))?;
    push_u32(&mut kv, k("context_length"), hp.n_ctx_train)?;
    push_u32(&mut kv, k("embedding_length"), hp.n_embd)?;
    push_u32(&mut kv, k("feed_forward_length"), hp.n_ff)?;
    push_u32(&mut kv, k("attention.head_count"), hp.n_head)?;
    push_u32(&mut kv, k("attention.head_count_kv"), hp.n_head_kv)?;
    push_u32(&mut kv, k("attention.key_length"), hp.head_dim_k)?;
    push_u32(&mut kv, k("attention.value_length"), hp.head_dim_v)?;
    kv.push((
        k("attention.layer_norm_rms_epsilon"),
        GgufValue::F32(hp.rms_eps as f32),
    ));
    kv.push((k("rope.freq_base"), GgufValue::F32(hp.rope_theta as f32)));
    push_u32(
        &mut kv,
        k("rope.dimension_count"),
        hp.rope_dim.unwrap_or(hp.head_dim_k),
    )?;
    push_u32(&mut kv, k("expert_count"), hp.n_expert)?;
    push_u32(&mut kv, k("expert_used_count"), hp.n_expert_used)?;
    push_u32(&mut kv, k("expert_feed_forward_length"), hp.n_ff_exp)?;
    if hp.n_ff_shexp > 0 {
        push_u32(
            &mut kv,
            k("expert_shared_feed_forward_length"),
            hp.n_ff_shexp,
        )?;
    }
    kv.push((k("expert_weights_norm"), GgufValue::Bool(hp.norm_topk_prob)));
    if let Some(s) = &hp.ssm {
        push_u32(&mut kv, k("ssm.conv_kernel"), s.conv_kernel)?;
        push_u32(&mut kv, k("ssm.state_size"), s.state_size)?;
        push_u32(&mut kv, k("ssm.group_count"), s.group_count)?;
        push_u32(&mut kv, k("ssm.time_step_rank"), s.time_step_rank)?;
        push_u32(&mut kv, k("ssm.inner_size"), s.inner_size)?;
    }
    if let Some(i) = hp.full_attention_interval {
        kv.push((k("full_attention_interval"), GgufValue::U32(i)));
    }
    if hp.nextn_predict_layers > 0 {
        kv.push((
            k("nextn_predict_layers"),
            GgufValue::U32(hp.nextn_predict_layers),
        ));
    }
    Ok(kv)
}

// ---------------------------------------------------------------------------------------------
// Random weights
// ---------------------------------------------------------------------------------------------

/// splitmix64's output function.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A splitmix64 generator: tiny, fast, deterministic across platforms.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Approximately standard normal: the sum of four 16-bit uniforms (Irwin-Hall),
    /// centred and scaled to unit variance; bounded by +-3.46, so never infinite.
    pub fn normalish(&mut self) -> f32 {
        let r = self.next_u64();
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        // Mean 4 * 32767.5, variance 4 * (65536^2 - 1) / 12.
        const MEAN: f32 = 131_070.0;
        const INV_STD: f32 = 1.0 / 37_837.227;
        (s as f32 - MEAN) * INV_STD
    }
}

/// FNV-1a of a tensor name: the per-tensor seed, so a tensor's values do not depend on its
/// position or type.
fn name_hash(name: &str) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// How a tensor's random values are drawn, from its name.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Dist {
    Normal {
        mean: f32,
        std: f32,
    },
    /// Uniform in [lo, hi).
    Uniform {
        lo: f32,
        hi: f32,
    },
}

fn dist_for(name: &str) -> Dist {
    let base = name.strip_suffix(".weight").unwrap_or(name);
    if base.ends_with("ssm_a") {
        // -exp(A_log) with A in [1, 16): always negative, as the converter stores it.
        Dist::Uniform {
            lo: -16.0,
            hi: -1.0,
        }
    } else if base.contains("norm") {
        Dist::Normal {
            mean: 1.0,
            std: 0.02,
        }
    } else if base.ends_with("ssm_dt.bias")
        || base.ends_with("ssm_dt")
        || base.ends_with("ssm_conv1d")
    {
        Dist::Normal {
            mean: 0.0,
            std: 0.1,
        }
    } else {
        Dist::Normal {
            mean: 0.0,
            std: 0.02,
        }
    }
}

/// Fill `out` with draws from `dist`, in order.
fn fill(dist: Dist, rng: &mut SplitMix64, out: &mut [f32]) {
    match dist {
        Dist::Normal { mean, std } => {
            for v in out.iter_mut() {
                *v = mean + std * rng.normalish();
            }
        }
        Dist::Uniform { lo, hi } => {
            for v in out.iter_mut() {
                *v = lo + (hi - lo) * rng.unit();
            }
        }
    }
}

/// Elements per generation chunk (rounded to whole rows): chunks are the unit of both
/// parallelism and seeding, so the bytes do not depend on the thread count.
const CHUNK_ELEMS: u64 = 1 << 20;

fn rows_per_chunk(ne0: u64) -> u64 {
    (CHUNK_ELEMS / ne0).max(1)
}

fn chunk_seed(seed: u64, name: &str, chunk: u64) -> u64 {
    mix64(seed ^ mix64(name_hash(name) ^ mix64(chunk.wrapping_add(0x5851_F42D_4C95_7F2D))))
}

/// The f32 values the random writer draws for a tensor named `name` with row length `ne0`,
/// rows `[row0, row0 + n_rows)` (before quantization). Same seed, same values, whatever the
/// tensor's type: an F32 file holds exactly these.
pub fn random_values(seed: u64, name: &str, ne0: u64, row0: u64, n_rows: u64) -> Vec<f32> {
    let per = rows_per_chunk(ne0);
    let dist = dist_for(name);
    let mut out = Vec::with_capacity((n_rows * ne0) as usize);
    let mut buf = Vec::new();
    let mut row = row0;
    while row < row0 + n_rows {
        let c = row / per;
        let c0 = c * per;
        let take = (c0 + per).min(row0 + n_rows) - row;
        buf.resize(((row - c0 + take) * ne0) as usize, 0.0);
        let mut rng = SplitMix64::new(chunk_seed(seed, name, c));
        fill(dist, &mut rng, &mut buf);
        out.extend_from_slice(&buf[((row - c0) * ne0) as usize..]);
        row += take;
    }
    out
}

/// Options of [`write_random_model`].
pub struct RandomOptions {
    /// `general.name`.
    pub name: String,
    /// Generator threads (0: the machine's available parallelism minus one, for the writer).
    pub threads: usize,
    /// Tokenizer metadata to include.
    pub vocab: Option<Vocab>,
    /// Write all-zero blocks (scale 0: valid and finite) for types the quantizers do not
    /// produce (Q6_K, IQ3_S, fallback Q5_0...) instead of failing.
    pub zero_fill_unsupported: bool,
    /// `general.alignment` to write (None: the default 32, key omitted).
    pub alignment: Option<u32>,
    /// Progress callback (bytes written, total).
    pub progress: Option<ProgressFn>,
}

impl Default for RandomOptions {
    fn default() -> Self {
        Self {
            name: "random".into(),
            threads: 0,
            vocab: None,
            zero_fill_unsupported: false,
            alignment: None,
            progress: None,
        }
    }
}

/// Write a random-weight `arch` model with `hp`, its tensors exactly
/// [`arch::expected_tensors`]`(arch, hp, recipe)` in that order, values deterministic from
/// `seed` (see [`random_values`]): matrices ~N(0, 0.02), norms ~1, `ssm_a` in [-16, -1),
/// quantized with the reference Q8_0 / Q4_K quantizers (finite scales always).
pub fn write_random_model(
    path: &Path,
    arch: &str,
    hp: &HParams,
    recipe: &QuantRecipe,
    seed: u64,
    opts: RandomOptions,
) -> Result<WriteSummary, GgufWriteError> {
    let file = path.display().to_string();
    let tensors =
        arch::expected_tensors(arch, hp, recipe).map_err(|source| GgufWriteError::Inventory {
            file: file.clone(),
            source,
        })?;
    let ftype = file_type(&recipe.preset, &tensors);
    write_random_tensors(path, arch, hp, &tensors, ftype, seed, opts)
}

/// [`write_random_model`] for a given tensor table (a descriptor's inventory): the table is
/// first checked against the architecture's layout.
pub fn write_random_tensors(
    path: &Path,
    arch: &str,
    hp: &HParams,
    tensors: &[TensorInfo],
    file_type: u32,
    seed: u64,
    mut opts: RandomOptions,
) -> Result<WriteSummary, GgufWriteError> {
    let file = path.display().to_string();
    arch::check_tensors(arch, hp, tensors).map_err(|source| GgufWriteError::Inventory {
        file: file.clone(),
        source,
    })?;
    for t in tensors {
        if !quant::is_supported(t.ggml_type) && !opts.zero_fill_unsupported {
            return Err(GgufWriteError::Unsupported {
                file,
                name: t.name.clone(),
                ty: t.ggml_type,
            });
        }
    }
    let mut w = GgufWriter::new(path);
    let meta = arch_metadata(arch, &opts.name, hp).map_err(|p| GgufWriteError::Convert {
        file: file.clone(),
        problem: p,
    })?;
    for (k, v) in meta {
        w.kv(&k, v)?;
    }
    if let Some(a) = opts.alignment {
        w.kv("general.alignment", GgufValue::U32(a))?;
    }
    w.kv("general.file_type", GgufValue::U32(file_type))?;
    w.kv("general.quantization_version", GgufValue::U32(2))?;
    if let Some(v) = &opts.vocab {
        v.check(hp.n_vocab).map_err(|p| GgufWriteError::BadKey {
            file: file.clone(),
            key: "tokenizer.ggml.tokens".into(),
            problem: p,
        })?;
        for (k, val) in v.metadata() {
            w.kv(&k, val)?;
        }
    }
    for t in tensors {
        w.tensor_info(&t.name, &t.dims, t.ggml_type)?;
    }
    if let Some(p) = opts.progress.take() {
        w.on_progress(p);
    }
    let threads = match opts.threads {
        // One core is left to the thread that writes (and to the kernel's page-cache copy).
        0 => std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1)),
        n => n,
    };
    let mut s = w.begin()?;
    stream_random(&mut s, seed, threads, &file)?;
    s.finish()
}

/// One chunk of generation work: `rows` rows of tensor `t`, chunk index `chunk`.
#[derive(Clone, Copy)]
struct Job {
    t: usize,
    chunk: u64,
    rows: u64,
}

/// Generate, quantize and write every tensor: batches of `threads` chunks are computed in
/// parallel while the previous batch is written (double buffering), so memory stays at
/// about 2 x threads x one chunk.
fn stream_random(
    s: &mut GgufStream,
    seed: u64,
    threads: usize,
    file: &str,
) -> Result<(), GgufWriteError> {
    let planned = s.planned().to_vec();
    let mut jobs = Vec::new();
    for (i, t) in planned.iter().enumerate() {
        let ne0 = t.dims[0];
        let rows: u64 = t.dims[1..].iter().product();
        let per = rows_per_chunk(ne0);
        let mut r = 0;
        let mut c = 0;
        while r < rows {
            let n = per.min(rows - r);
            jobs.push(Job {
                t: i,
                chunk: c,
                rows: n,
            });
            r += n;
            c += 1;
        }
    }
    let threads = threads.max(1);
    let mut scratch: Vec<Vec<f32>> = vec![Vec::new(); threads];
    let mut cur: Vec<Vec<u8>> = vec![Vec::new(); threads];
    let mut next: Vec<Vec<u8>> = vec![Vec::new(); threads];
    let mut cur_n = 0usize;
    let run = |job: &Job, x: &mut Vec<f32>, out: &mut Vec<u8>| -> Result<(), GgufWriteError> {
        let t = &planned[job.t];
        let ne0 = t.dims[0] as usize;
        let n = job.rows as usize * ne0;
        x.resize(n, 0.0);
        let mut rng = SplitMix64::new(chunk_seed(seed, &t.name, job.chunk));
        fill(dist_for(&t.name), &mut rng, x);
        let row_bytes = t.ggml_type.bytes_for(ne0 as u64).unwrap_or(0) as usize;
        out.clear();
        out.resize(row_bytes * job.rows as usize, 0);
        if quant::is_supported(t.ggml_type) {
            for (xr, or) in x.chunks_exact(ne0).zip(out.chunks_exact_mut(row_bytes)) {
                quant::quantize_row_into(t.ggml_type, xr, or).map_err(|source| {
                    GgufWriteError::Quant {
                        file: file.to_string(),
                        name: t.name.clone(),
                        source,
                    }
                })?;
            }
        }
        Ok(())
    };
    let mut at = 0usize;
    loop {
        let batch = &jobs[at..(at + threads).min(jobs.len())];
        if batch.is_empty() && cur_n == 0 {
            break;
        }
        let (write_res, results) = std::thread::scope(|sc| {
            let mut handles = Vec::new();
            for ((job, x), out) in batch.iter().zip(scratch.iter_mut()).zip(next.iter_mut()) {
                let run = &run;
                handles.push(sc.spawn(move || run(job, x, out)));
            }
            let mut wr = Ok(());
            for b in &cur[..cur_n] {
                if let Err(e) = s.data(b) {
                    wr = Err(e);
                    break;
                }
            }
            let res: Vec<_> = handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(GgufWriteError::Convert {
                            file: file.to_string(),
                            problem: "a generator thread panicked".into(),
                        })
                    })
                })
                .collect();
            (wr, res)
        });
        write_res?;
        for r in results {
            r?;
        }
        std::mem::swap(&mut cur, &mut next);
        cur_n = batch.len();
        at += batch.len();
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Hugging Face conversion
// ---------------------------------------------------------------------------------------------

/// Where a GGUF tensor's data comes from: HF tensors concatenated in order (one for a 1:1
/// tensor, one per expert for a stack).
struct Source {
    shard: String,
    data_start: u64,
    t: StTensor,
}

/// The HF tensor names a qwen3moe GGUF tensor is made of.
fn qwen3moe_sources(name: &str, n_expert: u64) -> Option<Vec<String>> {
    let one = |s: &str| Some(vec![s.to_string()]);
    match name {
        "token_embd.weight" => return one("model.embed_tokens.weight"),
        "output.weight" => return one("lm_head.weight"),
        "output_norm.weight" => return one("model.norm.weight"),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (l, tail) = rest.split_once('.')?;
    let p = format!("model.layers.{l}");
    let m = |s: &str| Some(vec![format!("{p}.{s}")]);
    match tail {
        "attn_norm.weight" => m("input_layernorm.weight"),
        "ffn_norm.weight" => m("post_attention_layernorm.weight"),
        "attn_q.weight" => m("self_attn.q_proj.weight"),
        "attn_k.weight" => m("self_attn.k_proj.weight"),
        "attn_v.weight" => m("self_attn.v_proj.weight"),
        "attn_output.weight" => m("self_attn.o_proj.weight"),
        "attn_q_norm.weight" => m("self_attn.q_norm.weight"),
        "attn_k_norm.weight" => m("self_attn.k_norm.weight"),
        "ffn_gate_inp.weight" => m("mlp.gate.weight"),
        _ => {
            let proj = match tail {
                "ffn_gate_exps.weight" => "gate_proj",
                "ffn_up_exps.weight" => "up_proj",
                "ffn_down_exps.weight" => "down_proj",
                _ => return None,
            };
            Some(
                (0..n_expert)
                    .map(|e| format!("{p}.mlp.experts.{e}.{proj}.weight"))
                    .collect(),
            )
        }
    }
}

/// Every HF tensor of the folder with its shard: `model.safetensors.index.json`'s shards, or
/// the single `model.safetensors`.
fn folder_tensors(dir: &Path) -> Result<BTreeMap<String, Source>, GgufWriteError> {
    let index = dir.join("model.safetensors.index.json");
    let shards: Vec<String> = if index.is_file() {
        let file = index.display().to_string();
        let bytes = std::fs::read(&index).map_err(|source| GgufWriteError::Io {
            file: file.clone(),
            offset: 0,
            what: "read the index".into(),
            source,
        })?;
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| GgufWriteError::Convert {
                file: file.clone(),
                problem: format!("not JSON: {e}"),
            })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| GgufWriteError::Convert {
                file: file.clone(),
                problem: "has no `weight_map` object".into(),
            })?;
        let mut seen = Vec::<String>::new();
        for s in map.values() {
            let s = s.as_str().ok_or_else(|| GgufWriteError::Convert {
                file: file.clone(),
                problem: "`weight_map` values must be shard file names".into(),
            })?;
            if !seen.iter().any(|x| x == s) {
                seen.push(s.to_string());
            }
        }
        seen
    } else {
        vec!["model.safetensors".to_string()]
    };
    let mut out = BTreeMap::new();
    for shard in shards {
        let h = safetensors::read_header(&dir.join(&shard))
            .map_err(|source| GgufWriteError::Safetensors { source })?;
        for t in h.tensors {
            out.insert(
                t.name.clone(),
                Source {
                    shard: shard.clone(),
                    data_start: h.data_start,
                    t,
                },
            );
        }
    }
    Ok(out)
}

/// The recipe for converting to one type: every matrix `ty`; norms and the router F32.
fn convert_recipe(ty: GgmlType) -> Option<QuantRecipe> {
    let name = match ty {
        GgmlType::F32 => "F32",
        GgmlType::F16 => "F16",
        GgmlType::BF16 => "BF16",
        GgmlType::Q8_0 => "Q8_0",
        GgmlType::Q4K => "Q4_K",
        _ => return None,
    };
    QuantRecipe::preset(name)
}

/// Convert a Hugging Face qwen3moe folder (F32/F16/BF16 safetensors, one file or sharded)
/// to a GGUF in llama.cpp's layout: names mapped as llama.cpp's converter does, dims the
/// PyTorch shape reversed with the same row-major bytes (no q/k permutation: Qwen uses NeoX
/// RoPE), per-expert tensors stacked into `ffn_*_exps` `[in, out, n_expert]` in expert order,
/// 1-D tensors and `ffn_gate_inp` kept F32, matrices stored as `ty` (F32, F16, BF16, Q8_0,
/// Q4_K; a row Q4_K cannot hold — llama.cpp would fall back to Q5_0 — is stored F16). The
/// config's hyperparameters are written as metadata; a `tokenizer.json` next to it adds the
/// vocabulary.
pub fn convert_hf_folder(
    dir: &Path,
    out_path: &Path,
    ty: GgmlType,
    progress: Option<ProgressFn>,
) -> Result<WriteSummary, GgufWriteError> {
    let out_file = out_path.display().to_string();
    let dir_s = dir.display().to_string();
    let inv =
        safetensors::load_folder(dir).map_err(|source| GgufWriteError::Safetensors { source })?;
    if inv.arch != "qwen3moe" {
        return Err(GgufWriteError::Convert {
            file: dir_s,
            problem: format!(
                "architecture {} is not converted yet (only qwen3moe; qwen3next needs llama.cpp's value transforms: norms +1, A_log -> -exp, qkvz reordering)",
                inv.arch
            ),
        });
    }
    let recipe = convert_recipe(ty).ok_or_else(|| GgufWriteError::Unsupported {
        file: out_file.clone(),
        name: "(all matrices)".into(),
        ty,
    })?;
    let hp = inv.hparams.clone();
    let mut tensors = arch::expected_tensors("qwen3moe", &hp, &recipe).map_err(|source| {
        GgufWriteError::Inventory {
            file: dir_s.clone(),
            source,
        }
    })?;
    for t in tensors.iter_mut() {
        if !quant::is_supported(t.ggml_type) {
            *t = TensorInfo::new(
                t.name.clone(),
                t.dims.clone(),
                GgmlType::F16,
                t.role,
                t.layer,
            )
            .map_err(|source| GgufWriteError::Inventory {
                file: dir_s.clone(),
                source,
            })?;
        }
    }
    let mut src = folder_tensors(dir)?;
    // Resolve every GGUF tensor to its sources before writing a byte.
    let mut plan: Vec<Vec<Source>> = Vec::with_capacity(tensors.len());
    for t in &tensors {
        let names =
            qwen3moe_sources(&t.name, hp.n_expert).ok_or_else(|| GgufWriteError::Convert {
                file: dir_s.clone(),
                problem: format!("no Hugging Face source is known for tensor '{}'", t.name),
            })?;
        let per_src_rows: u64 = t.dims[1..].iter().product::<u64>() / names.len() as u64;
        let mut v = Vec::with_capacity(names.len());
        for n in names {
            let s = src.remove(&n).ok_or_else(|| GgufWriteError::Convert {
                file: dir_s.clone(),
                problem: format!("tensor `{n}` (for '{}') is missing", t.name),
            })?;
            let want: Vec<u64> = if t.dims.len() == 1 {
                vec![t.dims[0]]
            } else {
                vec![per_src_rows, t.dims[0]]
            };
            if s.t.shape != want {
                return Err(GgufWriteError::Convert {
                    file: dir.join(&s.shard).display().to_string(),
                    problem: format!(
                        "tensor `{n}` has shape {:?}, expected {want:?} for '{}' {:?}",
                        s.t.shape, t.name, t.dims
                    ),
                });
            }
            if !matches!(s.t.dtype, StDtype::F32 | StDtype::F16 | StDtype::BF16) {
                return Err(GgufWriteError::Convert {
                    file: dir.join(&s.shard).display().to_string(),
                    problem: format!(
                        "tensor `{n}` is {}; only F32, F16 and BF16 folders convert",
                        s.t.dtype
                    ),
                });
            }
            v.push(s);
        }
        plan.push(v);
    }
    if let Some(extra) = src.keys().next() {
        return Err(GgufWriteError::Convert {
            file: dir_s,
            problem: format!(
                "tensor `{extra}` has no place in a qwen3moe GGUF; it would be dropped"
            ),
        });
    }

    let mut w = GgufWriter::new(out_path);
    let meta = arch_metadata("qwen3moe", &inv.name, &hp).map_err(|p| GgufWriteError::Convert {
        file: dir_s.clone(),
        problem: p,
    })?;
    for (k, v) in meta {
        w.kv(&k, v)?;
    }
    w.kv(
        "general.file_type",
        GgufValue::U32(file_type(&recipe.preset, &tensors)),
    )?;
    w.kv("general.quantization_version", GgufValue::U32(2))?;
    if let Some(v) = vocab_from_folder(dir, hp.n_vocab)? {
        for (k, val) in v.metadata() {
            w.kv(&k, val)?;
        }
    }
    for t in &tensors {
        w.tensor_info(&t.name, &t.dims, t.ggml_type)?;
    }
    if let Some(p) = progress {
        w.on_progress(p);
    }
    let mut s = w.begin()?;
    let mut files: BTreeMap<String, File> = BTreeMap::new();
    let mut raw = Vec::new();
    let mut x = Vec::new();
    let mut q = Vec::new();
    for (t, sources) in tensors.iter().zip(&plan) {
        let ne0 = t.dims[0];
        let in_rb = |d: StDtype| ne0 * d.bits() / 8;
        let out_rb = t.ggml_type.bytes_for(ne0).unwrap_or(0) as usize;
        for so in sources {
            let path = dir.join(&so.shard);
            let path_s = path.display().to_string();
            if !files.contains_key(&so.shard) {
                let f = File::open(&path).map_err(|source| GgufWriteError::Io {
                    file: path_s.clone(),
                    offset: 0,
                    what: "open".into(),
                    source,
                })?;
                files.insert(so.shard.clone(), f);
            }
            let Some(f) = files.get_mut(&so.shard) else {
                continue;
            };
            let rows = so.t.elements() / ne0;
            let rb = in_rb(so.t.dtype);
            let per = rows_per_chunk(ne0);
            let mut r = 0;
            while r < rows {
                let n = per.min(rows - r);
                let at = so.data_start + so.t.begin + r * rb;
                raw.resize((n * rb) as usize, 0);
                f.seek(SeekFrom::Start(at))
                    .and_then(|_| f.read_exact(&mut raw))
                    .map_err(|source| GgufWriteError::Io {
                        file: path_s.clone(),
                        offset: at,
                        what: format!("read `{}`", so.t.name),
                        source,
                    })?;
                decode(so.t.dtype, &raw, &mut x);
                q.clear();
                q.resize(out_rb * n as usize, 0);
                for (xr, or) in x.chunks_exact(ne0 as usize).zip(q.chunks_exact_mut(out_rb)) {
                    quant::quantize_row_into(t.ggml_type, xr, or).map_err(|source| {
                        GgufWriteError::Quant {
                            file: out_file.clone(),
                            name: t.name.clone(),
                            source,
                        }
                    })?;
                }
                s.data(&q)?;
                r += n;
            }
        }
    }
    s.finish()
}

/// Little-endian F32/F16/BF16 bytes to f32.
fn decode(dtype: StDtype, raw: &[u8], out: &mut Vec<f32>) {
    out.clear();
    match dtype {
        StDtype::F32 => out.extend(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        StDtype::F16 => out.extend(
            raw.chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        StDtype::BF16 => out.extend(
            raw.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        _ => {}
    }
}

/// The vocabulary of `dir/tokenizer.json` (a byte-level BPE), padded to `n_vocab` with
/// unused `[PAD{i}]` tokens as llama.cpp's converter does; `None` when there is no file.
/// `tokenizer_config.json`'s `chat_template` and the config's bos/eos ids come along.
pub fn vocab_from_folder(dir: &Path, n_vocab: u64) -> Result<Option<Vocab>, GgufWriteError> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    let file = path.display().to_string();
    let bad = |problem: String| GgufWriteError::Convert {
        file: file.clone(),
        problem,
    };
    let read_json = |p: &Path| -> Result<serde_json::Value, GgufWriteError> {
        let f = p.display().to_string();
        let bytes = std::fs::read(p).map_err(|source| GgufWriteError::Io {
            file: f.clone(),
            offset: 0,
            what: "read".into(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|e| GgufWriteError::Convert {
            file: f,
            problem: format!("not JSON: {e}"),
        })
    };
    let j = read_json(&path)?;
    let model = &j["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(bad(format!(
            "tokenizer model type {} is not BPE",
            model["type"]
        )));
    }
    let n = usize::try_from(n_vocab).map_err(|_| bad("n_vocab too large".into()))?;
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![1i32; n];
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| bad("model.vocab is not an object".into()))?;
    let mut place = |tok: &str, id: u64, ty: i32| -> Result<(), GgufWriteError> {
        let slot = tokens
            .get_mut(id as usize)
            .ok_or_else(|| bad(format!("token id {id} is not below n_vocab {n_vocab}")))?;
        *slot = Some(tok.to_string());
        types[id as usize] = ty;
        Ok(())
    };
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("model.vocab[{tok}] is not an id")))?;
        place(tok, id, 1)?;
    }
    if let Some(added) = j["added_tokens"].as_array() {
        for a in added {
            let (Some(id), Some(c)) = (a["id"].as_u64(), a["content"].as_str()) else {
                return Err(bad("added_tokens entries need `id` and `content`".into()));
            };
            let ty = if a["special"].as_bool() == Some(true) {
                3
            } else {
                4
            };
            place(c, id, ty)?;
        }
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                types[i] = 5;
                format!("[PAD{i}]")
            })
        })
        .collect();
    let merges = match model["merges"].as_array() {
        None => Vec::new(),
        Some(m) => m
            .iter()
            .map(|e| match e {
                serde_json::Value::String(s) => Ok(s.clone()),
                serde_json::Value::Array(p) if p.len() == 2 => Ok(format!(
                    "{} {}",
                    p[0].as_str().unwrap_or(""),
                    p[1].as_str().unwrap_or("")
                )),
                _ => Err(bad("model.merges entries must be strings or pairs".into())),
            })
            .collect::<Result<_, _>>()?,
    };
    let cfg = read_json(&dir.join("config.json"))?;
    let id = |k: &str| cfg[k].as_u64().and_then(|v| u32::try_from(v).ok());
    let tcfg = dir.join("tokenizer_config.json");
    let chat_template = if tcfg.is_file() {
        read_json(&tcfg)?["chat_template"]
            .as_str()
            .map(str::to_string)
    } else {
        None
    };
    Ok(Some(Vocab {
        tokens,
        token_type: types,
        merges,
        pre: Some("qwen2".into()),
        bos: id("bos_token_id"),
        eos: id("eos_token_id"),
        pad: None,
        chat_template,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::read_gguf;
    use crate::inventory::SsmParams;

    fn tmp() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    fn every_value() -> Vec<(String, GgufValue)> {
        use GgufArray as A;
        use GgufValue as V;
        let v = vec![
            V::U8(250),
            V::I8(-7),
            V::U16(65_000),
            V::I16(-30_000),
            V::U32(4_000_000_000),
            V::I32(-2_000_000_000),
            V::F32(1.5e-6),
            V::Bool(true),
            V::String("héllo".into()),
            V::U64(1 << 60),
            V::I64(-(1 << 60)),
            V::F64(-2.5e300),
            V::Array(A::U8(vec![1, 2, 3])),
            V::Array(A::I8(vec![-1, 0, 1])),
            V::Array(A::U16(vec![7, 8])),
            V::Array(A::I16(vec![-9])),
            V::Array(A::U32(vec![1, 2, 3, 4])),
            V::Array(A::I32(vec![-5, 5])),
            V::Array(A::F32(vec![0.25, -0.5])),
            V::Array(A::Bool(vec![true, false, true])),
            V::Array(A::Strings(vec!["a".into(), "".into(), "Ġthe".into()])),
            V::Array(A::Arrays(vec![
                A::U32(vec![1, 2]),
                A::Strings(vec!["x".into()]),
            ])),
            V::Array(A::U64(vec![u64::MAX])),
            V::Array(A::I64(vec![i64::MIN])),
            V::Array(A::F64(vec![1e-300])),
            V::Array(A::Strings(vec![])),
        ];
        v.into_iter()
            .enumerate()
            .map(|(i, v)| (format!("test.key{i}"), v))
            .collect()
    }

    #[test]
    fn every_value_type_round_trips() {
        let d = tmp();
        let path = d.path().join("kv.gguf");
        let mut w = GgufWriter::new(&path);
        let kvs = every_value();
        for (k, v) in &kvs {
            w.kv(k, v.clone()).unwrap();
        }
        w.tensor_info("a", &[3], GgmlType::F32).unwrap();
        w.tensor_info("b", &[2, 3], GgmlType::F16).unwrap();
        let sum = w
            .write_with(|i, t, out| {
                let b: Vec<u8> = (0..t.bytes).map(|j| (j as u8) ^ (i as u8 * 0x55)).collect();
                out.write_all(&b)
            })
            .unwrap();
        assert!(!d.path().join("kv.gguf.partial").exists());
        let f = read_gguf(&path).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.metadata, kvs);
        assert_eq!(sum.file_bytes, std::fs::metadata(&path).unwrap().len());
        assert_eq!(sum.data_offset, f.data_offset);
        let names: Vec<_> = f
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dims.clone(), t.ggml_type))
            .collect();
        assert_eq!(
            names,
            vec![
                ("a", vec![3], GgmlType::F32),
                ("b", vec![2, 3], GgmlType::F16)
            ]
        );
        let bytes = std::fs::read(&path).unwrap();
        let b = f.tensor("b").unwrap();
        let at = (f.data_offset + b.offset) as usize;
        let want: Vec<u8> = (0..12u64).map(|j| (j as u8) ^ 0x55).collect();
        assert_eq!(&bytes[at..at + 12], &want[..]);
    }

    #[test]
    fn alignment_pads_every_tensor() {
        let d = tmp();
        let path = d.path().join("al.gguf");
        let mut w = GgufWriter::new(&path);
        w.kv("general.alignment", GgufValue::U32(64)).unwrap();
        w.tensor_info("t0", &[3], GgmlType::F32).unwrap();
        w.tensor_info("t1", &[32, 3], GgmlType::Q8_0).unwrap();
        w.tensor_info("t2", &[5, 1, 1], GgmlType::BF16).unwrap();
        assert_eq!(w.alignment(), 64);
        let planned = w.planned();
        assert_eq!(
            planned
                .iter()
                .map(|t| (t.offset, t.bytes))
                .collect::<Vec<_>>(),
            vec![(0, 12), (64, 102), (192, 10)]
        );
        w.write_with(|i, t, out| out.write_all(&vec![i as u8 + 1; t.bytes as usize]))
            .unwrap();
        let f = read_gguf(&path).unwrap();
        assert_eq!(f.alignment, 64);
        assert_eq!(f.data_offset % 64, 0);
        let bytes = std::fs::read(&path).unwrap();
        for (i, t) in f.tensors.iter().enumerate() {
            assert_eq!(t.offset % 64, 0, "{}", t.name);
            let at = (f.data_offset + t.offset) as usize;
            assert!(bytes[at..at + t.bytes as usize]
                .iter()
                .all(|b| *b == i as u8 + 1));
        }
        assert_eq!(bytes.len() as u64 % 64, 0);
    }

    #[test]
    fn bad_records_and_byte_counts_are_refused() {
        let d = tmp();
        let path = d.path().join("bad.gguf");
        let mut w = GgufWriter::new(&path);
        w.kv("k", GgufValue::U8(1)).unwrap();
        assert!(matches!(
            w.kv("k", GgufValue::U8(2)),
            Err(GgufWriteError::BadKey { .. })
        ));
        for bad in [GgufValue::U32(48), GgufValue::U64(64), GgufValue::U32(0)] {
            let e = w.kv("general.alignment", bad).unwrap_err();
            assert!(e.to_string().contains("power of two"), "{e}");
        }
        assert!(w.tensor_info("x", &[], GgmlType::F32).is_err());
        assert!(w.tensor_info("x", &[4, 0], GgmlType::F32).is_err());
        assert!(w.tensor_info("x", &[1, 1, 1, 1, 1], GgmlType::F32).is_err());
        let e = w.tensor_info("x", &[33], GgmlType::Q8_0).unwrap_err();
        assert!(e.to_string().contains("multiple of 32"), "{e}");
        w.tensor_info("x", &[32], GgmlType::Q8_0).unwrap();
        assert!(w.tensor_info("x", &[32], GgmlType::Q8_0).is_err());
        w.tensor_info("y", &[4], GgmlType::F32).unwrap();
        // Too few bytes for x.
        let e = w
            .write_with(|_, _, out| out.write_all(&[0u8; 3]))
            .unwrap_err();
        match e {
            GgufWriteError::ByteCount {
                name,
                expected,
                got,
                ..
            } => {
                assert_eq!((name.as_str(), expected, got), ("x", 34, 3))
            }
            other => panic!("{other}"),
        }
        assert!(!path.exists());
        assert!(
            !d.path().join("bad.gguf.partial").exists(),
            "partial file removed"
        );
        // Too many bytes.
        let mut w = GgufWriter::new(&path);
        w.tensor_info("y", &[4], GgmlType::F32).unwrap();
        let e = w
            .write_with(|_, _, out| out.write_all(&[0u8; 17]))
            .unwrap_err();
        assert!(
            matches!(
                e,
                GgufWriteError::ByteCount {
                    got: 17,
                    expected: 16,
                    ..
                }
            ),
            "{e}"
        );
        assert!(!path.exists());
    }

    /// A qwen3moe small enough for debug-build tests; widths hold 32-element blocks.
    pub(crate) fn small_moe() -> HParams {
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
    pub(crate) fn small_next() -> HParams {
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
    fn q4k_shapes(mut hp: HParams) -> HParams {
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

    #[test]
    fn random_models_match_expected_tensors_tensor_for_tensor() {
        let d = tmp();
        for (arch, small) in [("qwen3moe", small_moe()), ("qwen3next", small_next())] {
            for preset in ["F32", "F16", "BF16", "Q8_0", "Q4_K"] {
                let hp = if preset == "Q4_K" {
                    q4k_shapes(small.clone())
                } else {
                    small.clone()
                };
                let mut recipe = QuantRecipe::preset(preset).unwrap();
                if preset == "Q4_K" {
                    // Routed experts Q8_0 (a custom mix): debug-build Q4_K is slow.
                    recipe.expert_gate_up = GgmlType::Q8_0;
                    recipe.expert_down = GgmlType::Q8_0;
                }
                let want = arch::expected_tensors(arch, &hp, &recipe).unwrap();
                let path = d.path().join(format!("{arch}-{preset}.gguf"));
                let opts = RandomOptions {
                    name: format!("{arch} {preset}"),
                    ..Default::default()
                };
                write_random_model(&path, arch, &hp, &recipe, 7, opts).unwrap();
                let f = read_gguf(&path).unwrap();
                assert_eq!(f.tensors.len(), want.len(), "{arch} {preset}");
                for (g, e) in f.tensors.iter().zip(&want) {
                    assert_eq!(
                        (&g.name, &g.dims, g.ggml_type, g.bytes),
                        (&e.name, &e.dims, e.ggml_type, e.bytes),
                        "{arch} {preset}"
                    );
                    assert_eq!(g.offset % f.alignment, 0);
                }
                if preset == "Q4_K" {
                    // The shapes were chosen so no Q4_K tensor falls back.
                    assert!(want
                        .iter()
                        .filter(|t| t.dims.len() > 1
                            && !t.name.contains("gate_inp")
                            && !t.name.contains("conv1d")
                            && !t.name.contains("_exps"))
                        .all(|t| t.ggml_type == GgmlType::Q4K));
                    // Every tensor decodes to finite values; a matrix is close to its draws.
                    for t in &f.tensors {
                        let v = tensor_f32(&path, &t.name);
                        assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
                    }
                    let name = "token_embd.weight";
                    let exact = random_values(7, name, 256, 0, hp.n_vocab);
                    let q4 = tensor_f32(&path, name);
                    let mse = exact
                        .iter()
                        .zip(&q4)
                        .map(|(x, y)| (x - y).powi(2))
                        .sum::<f32>()
                        / exact.len() as f32;
                    assert!(mse.sqrt() < 0.1 * 0.02, "Q4_K rms error {}", mse.sqrt());
                }
                // Metadata llama.cpp reads.
                let k = |s: &str| format!("{arch}.{s}");
                assert_eq!(f.get_str("general.architecture").unwrap(), Some(arch));
                assert_eq!(
                    f.get_u64(&k("block_count")).unwrap(),
                    Some(u64::from(hp.n_blocks_total()))
                );
                assert_eq!(f.get_u64(&k("embedding_length")).unwrap(), Some(hp.n_embd));
                assert_eq!(f.get_u64(&k("expert_count")).unwrap(), Some(hp.n_expert));
                assert_eq!(
                    f.get_u64(&k("attention.key_length")).unwrap(),
                    Some(hp.head_dim_k)
                );
                assert_eq!(f.get_u64("general.quantization_version").unwrap(), Some(2));
                assert_eq!(
                    f.get_f64(&k("attention.layer_norm_rms_epsilon")).unwrap(),
                    Some(1e-6f32 as f64)
                );
                let ftype = f.get_u64("general.file_type").unwrap().unwrap();
                let want_ftype = match preset {
                    "F32" => 0,
                    "F16" => 1,
                    "Q8_0" => 7,
                    "Q4_K" => 14,
                    _ => 32,
                };
                assert_eq!(ftype, want_ftype);
                if arch == "qwen3next" {
                    assert_eq!(
                        f.get_u64(&k("ssm.inner_size")).unwrap(),
                        hp.ssm.as_ref().map(|s| s.inner_size)
                    );
                    assert_eq!(f.get_u64(&k("ssm.group_count")).unwrap(), Some(2));
                    assert_eq!(f.get_u64(&k("full_attention_interval")).unwrap(), Some(2));
                    assert_eq!(
                        f.get_u64(&k("nextn_predict_layers")).unwrap(),
                        (hp.nextn_predict_layers > 0).then_some(1)
                    );
                    assert_eq!(f.get_u64(&k("rope.dimension_count")).unwrap(), hp.rope_dim);
                    assert_eq!(
                        f.get_u64(&k("expert_shared_feed_forward_length")).unwrap(),
                        Some(hp.n_ff_shexp)
                    );
                } else {
                    assert!(f.get("qwen3moe.ssm.inner_size").is_none());
                }
            }
        }
    }

    fn tensor_f32(path: &Path, name: &str) -> Vec<f32> {
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

    #[test]
    fn random_values_are_deterministic_plausible_and_finite() {
        let d = tmp();
        let hp = small_next();
        let write = |name: &str, preset: &str, seed: u64, threads: usize| {
            let p = d.path().join(name);
            let opts = RandomOptions {
                threads,
                ..Default::default()
            };
            write_random_model(
                &p,
                "qwen3next",
                &hp,
                &QuantRecipe::preset(preset).unwrap(),
                seed,
                opts,
            )
            .unwrap();
            p
        };
        let a = write("a.gguf", "Q8_0", 42, 1);
        let b = write("b.gguf", "Q8_0", 42, 3);
        let c = write("c.gguf", "Q8_0", 43, 2);
        let (ba, bb, bc) = (
            std::fs::read(&a).unwrap(),
            std::fs::read(&b).unwrap(),
            std::fs::read(&c).unwrap(),
        );
        assert_eq!(ba, bb, "same seed, any thread count: same bytes");
        assert_eq!(ba.len(), bc.len());
        assert_ne!(ba, bc, "another seed changes the weights");
        // F32 holds exactly random_values; Q8_0 is within its half step of them.
        let f = write("f.gguf", "F32", 42, 2);
        let name = "blk.0.ffn_up_exps.weight";
        let exact = random_values(42, name, 64, 0, 32 * 2);
        assert_eq!(tensor_f32(&f, name), exact);
        let q = tensor_f32(&a, name);
        for (x, y) in exact.iter().zip(&q) {
            assert!((x - y).abs() <= 0.07 / 127.0 + 1e-6, "{x} vs {y}");
        }
        let mean = exact.iter().sum::<f32>() / exact.len() as f32;
        let std =
            (exact.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / exact.len() as f32).sqrt();
        assert!(
            mean.abs() < 0.002 && (0.018..0.022).contains(&std),
            "{mean} {std}"
        );
        // A slice from the middle agrees with the whole.
        assert_eq!(random_values(42, name, 64, 10, 7), exact[10 * 64..17 * 64]);
        // Across chunk boundaries too (rows of 2^19 elements: two rows per chunk).
        let wide = random_values(42, name, 1 << 19, 0, 4);
        assert_eq!(
            random_values(42, name, 1 << 19, 1, 2),
            wide[1 << 19..3 << 19]
        );
        assert_ne!(wide[..1 << 19], wide[2 << 19..3 << 19]);
        let ssm_a = tensor_f32(&f, "blk.0.ssm_a");
        assert!(ssm_a.iter().all(|v| (-16.0..-1.0).contains(v)), "{ssm_a:?}");
        let norm = tensor_f32(&f, "blk.1.attn_q_norm.weight");
        assert!(norm.iter().all(|v| (0.9..1.1).contains(v)));
    }

    #[test]
    fn unsupported_types_fail_or_zero_fill() {
        let d = tmp();
        let p = d.path().join("m.gguf");
        let hp = q4k_shapes(small_moe());
        let r = QuantRecipe::preset("Q4_K_M").unwrap();
        let e =
            write_random_model(&p, "qwen3moe", &hp, &r, 1, RandomOptions::default()).unwrap_err();
        assert!(
            matches!(
                &e,
                GgufWriteError::Unsupported {
                    ty: GgmlType::Q6K,
                    ..
                }
            ),
            "{e}"
        );
        assert!(!p.exists());
        let opts = RandomOptions {
            zero_fill_unsupported: true,
            ..Default::default()
        };
        write_random_model(&p, "qwen3moe", &hp, &r, 1, opts).unwrap();
        let f = read_gguf(&p).unwrap();
        let head = f.tensor("output.weight").unwrap();
        assert_eq!(head.ggml_type, GgmlType::Q6K);
        let bytes = std::fs::read(&p).unwrap();
        let at = f.tensor_file_offset(head).unwrap() as usize;
        assert!(bytes[at..at + head.bytes as usize].iter().all(|b| *b == 0));
        assert_eq!(f.get_u64("general.file_type").unwrap(), Some(15));
    }

    #[test]
    fn vocabulary_and_bad_vocabulary() {
        let d = tmp();
        let p = d.path().join("v.gguf");
        let hp = small_moe();
        let mut vocab = Vocab {
            tokens: (0..32).map(|i| format!("t{i}")).collect(),
            token_type: vec![1; 32],
            merges: vec!["t 1".into()],
            pre: Some("qwen2".into()),
            bos: None,
            eos: Some(31),
            pad: None,
            chat_template: Some("{{ messages }}".into()),
        };
        let r = QuantRecipe::preset("F16").unwrap();
        let opts = |v: &Vocab| RandomOptions {
            vocab: Some(v.clone()),
            alignment: Some(128),
            ..Default::default()
        };
        write_random_model(&p, "qwen3moe", &hp, &r, 1, opts(&vocab)).unwrap();
        let f = read_gguf(&p).unwrap();
        assert_eq!(f.alignment, 128);
        assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
        match f.get_array("tokenizer.ggml.tokens").unwrap() {
            Some(GgufArray::Strings(t)) => assert_eq!(t, &vocab.tokens),
            other => panic!("{other:?}"),
        }
        assert_eq!(f.get_u64("tokenizer.ggml.eos_token_id").unwrap(), Some(31));
        assert_eq!(
            f.get_str("tokenizer.chat_template").unwrap(),
            Some("{{ messages }}")
        );
        vocab.tokens.pop();
        let e = write_random_model(&p, "qwen3moe", &hp, &r, 1, opts(&vocab)).unwrap_err();
        assert!(e.to_string().contains("n_vocab = 32"), "{e}");
    }

    /// The F32 values of an HF tensor, read straight from the safetensors file.
    fn st_values(file: &Path, name: &str) -> Vec<f32> {
        let h = crate::safetensors::read_header(file).unwrap();
        let t = h.tensor(name).unwrap();
        let bytes = std::fs::read(file).unwrap();
        let raw = &bytes[(h.data_start + t.begin) as usize..(h.data_start + t.end) as usize];
        let mut out = Vec::new();
        decode(t.dtype, raw, &mut out);
        out
    }

    #[test]
    fn converting_the_tiny_hf_model_keeps_every_value() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen3moe/base");
        let st = dir.join("model.safetensors");
        let d = tmp();
        let out = d.path().join("tiny-f32.gguf");
        convert_hf_folder(&dir, &out, GgmlType::F32, None).unwrap();
        let f = read_gguf(&out).unwrap();
        let hp = crate::safetensors::load_folder(&dir).unwrap().hparams;
        let want =
            arch::expected_tensors("qwen3moe", &hp, &QuantRecipe::preset("F32").unwrap()).unwrap();
        let got: Vec<_> = f
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
            .collect();
        let exp: Vec<_> = want
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
            .collect();
        assert_eq!(got, exp);
        assert_eq!(f.get_u64("qwen3moe.expert_count").unwrap(), Some(8));
        assert_eq!(f.get_u64("qwen3moe.block_count").unwrap(), Some(2));
        assert_eq!(f.get_f64("qwen3moe.rope.freq_base").unwrap(), Some(10000.0));
        for (gguf, hf) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.1.attn_q.weight",
                "model.layers.1.self_attn.q_proj.weight",
            ),
            (
                "blk.0.attn_k_norm.weight",
                "model.layers.0.self_attn.k_norm.weight",
            ),
            (
                "blk.1.ffn_gate_inp.weight",
                "model.layers.1.mlp.gate.weight",
            ),
            ("output_norm.weight", "model.norm.weight"),
        ] {
            assert_eq!(tensor_f32(&out, gguf), st_values(&st, hf), "{gguf}");
        }
        // Expert 5 of layer 0's down stack: [32, 64, 8], one [64 x 32] slice per expert.
        let down = tensor_f32(&out, "blk.0.ffn_down_exps.weight");
        let e5 = st_values(&st, "model.layers.0.mlp.experts.5.down_proj.weight");
        assert_eq!(&down[5 * 64 * 32..6 * 64 * 32], &e5[..]);
        let up = tensor_f32(&out, "blk.1.ffn_up_exps.weight");
        assert_eq!(
            &up[7 * 32 * 64..],
            &st_values(&st, "model.layers.1.mlp.experts.7.up_proj.weight")[..]
        );

        // Q8_0: the router and norms stay F32, matrices are Q8_0 and close.
        let q = d.path().join("tiny-q8.gguf");
        convert_hf_folder(&dir, &q, GgmlType::Q8_0, None).unwrap();
        let fq = read_gguf(&q).unwrap();
        assert_eq!(
            fq.tensor("blk.0.ffn_gate_inp.weight").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(
            fq.tensor("blk.0.attn_norm.weight").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(
            fq.tensor("blk.0.ffn_down_exps.weight").unwrap().ggml_type,
            GgmlType::Q8_0
        );
        let qd = tensor_f32(&q, "blk.0.ffn_down_exps.weight");
        let amax = down.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(down
            .iter()
            .zip(&qd)
            .all(|(a, b)| (a - b).abs() <= amax / 127.0));
        // Unsupported target types are named.
        let e = convert_hf_folder(&dir, &q, GgmlType::Q6K, None).unwrap_err();
        assert!(e.to_string().contains("Q6_K"), "{e}");
    }
}
