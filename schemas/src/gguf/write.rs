//! GGUF v3 writer: header, metadata of every value type, tensor infos, alignment padding and
//! streamed tensor data. The producers built on it live beside it: random-weight models in
//! [`super::random`], Hugging Face conversion in [`super::convert`], llama.cpp's metadata
//! keys in [`super::metadata`].
//! Invariant: the layout (every tensor offset a multiple of the alignment, the data section
//! aligned) is computed before the first byte is written, every tensor receives exactly its
//! block-table byte count or the write fails naming it, and tensor data is streamed, never held
//! whole. A file appears under its final name only once it is complete (written to
//! `<name>.partial`, then renamed).

use super::read::CAPS;
use super::{GgufArray, GgufValue, DEFAULT_ALIGNMENT};
use crate::ggml::GgmlType;
use crate::inventory::InventoryError;
use crate::quant::QuantError;
use crate::safetensors::SafetensorsError;
use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Write};
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
    #[error("{file}: tensor '{name}' has type {ty}, which the CPU reference cannot decode (it decodes {}); pick another type for it, or allow zero-filled blocks (--zero-unsupported)", crate::quant::SUPPORTED.iter().map(|t| t.name()).collect::<Vec<_>>().join(", "))]
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::read_gguf;
    use crate::gguf::testutil::tmp;

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
}
