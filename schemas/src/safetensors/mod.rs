//! safetensors headers: the 8-byte length, the header JSON and every tensor entry, validated.
//! Invariant: no count or length read from a file is trusted before it is checked against the
//! file's size and a cap; no input panics, and none makes us allocate more than a small multiple
//! of the header bytes we were given (the header itself is capped at [`HEADER_CAP`]).
//!
//! Layout of a safetensors file: `u64` little-endian header length `n`, `n` bytes of UTF-8 JSON
//! (`{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//! "__metadata__": {"k": "v"}}`), then the data section; offsets are relative to its start.
//! The folder reader (config.json, shards, Hugging Face -> llama.cpp names) is in [`folder`].

use crate::ggml::GgmlType;
use crate::inventory::InventoryError;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::collections::HashSet;
use std::fmt;
use std::io::Read;
use std::path::Path;

pub mod folder;
pub use folder::load_folder;

/// Largest header JSON we accept (the format's own reference reader uses the same 100 MiB).
pub const HEADER_CAP: u64 = 100 << 20;
/// Largest element count of one tensor (2^50).
pub const MAX_ELEMENTS: u64 = 1 << 50;
/// Largest rank of one tensor's shape.
pub const MAX_RANK: usize = 16;

/// Element type of a safetensors tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StDtype {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
    F4,
    F6E2M3,
    F6E3M2,
}

const ALL_DTYPES: &[StDtype] = &[
    StDtype::Bool,
    StDtype::U8,
    StDtype::I8,
    StDtype::F8E5M2,
    StDtype::F8E4M3,
    StDtype::F8E8M0,
    StDtype::I16,
    StDtype::U16,
    StDtype::F16,
    StDtype::BF16,
    StDtype::I32,
    StDtype::U32,
    StDtype::F32,
    StDtype::F64,
    StDtype::I64,
    StDtype::U64,
    StDtype::F4,
    StDtype::F6E2M3,
    StDtype::F6E3M2,
];

impl StDtype {
    /// The name as written in a header (`"BF16"`, `"F8_E4M3"`, ...).
    pub fn name(self) -> &'static str {
        use StDtype::*;
        match self {
            Bool => "BOOL",
            U8 => "U8",
            I8 => "I8",
            F8E5M2 => "F8_E5M2",
            F8E4M3 => "F8_E4M3",
            F8E8M0 => "F8_E8M0",
            I16 => "I16",
            U16 => "U16",
            F16 => "F16",
            BF16 => "BF16",
            I32 => "I32",
            U32 => "U32",
            F32 => "F32",
            F64 => "F64",
            I64 => "I64",
            U64 => "U64",
            F4 => "F4",
            F6E2M3 => "F6_E2M3",
            F6E3M2 => "F6_E3M2",
        }
    }

    /// The dtype for a header name, or `None` if the name is not a safetensors dtype.
    pub fn from_name(s: &str) -> Option<Self> {
        ALL_DTYPES.iter().copied().find(|d| d.name() == s)
    }

    /// Bits per element (sub-byte types pack several elements per byte).
    pub fn bits(self) -> u64 {
        use StDtype::*;
        match self {
            F4 => 4,
            F6E2M3 | F6E3M2 => 6,
            Bool | U8 | I8 | F8E5M2 | F8E4M3 | F8E8M0 => 8,
            I16 | U16 | F16 | BF16 => 16,
            I32 | U32 | F32 => 32,
            F64 | I64 | U64 => 64,
        }
    }

    /// The ggml type with the same element layout, if ggml has one.
    pub fn ggml_type(self) -> Option<GgmlType> {
        use StDtype::*;
        match self {
            F32 => Some(GgmlType::F32),
            F16 => Some(GgmlType::F16),
            BF16 => Some(GgmlType::BF16),
            F64 => Some(GgmlType::F64),
            I8 => Some(GgmlType::I8),
            I16 => Some(GgmlType::I16),
            I32 => Some(GgmlType::I32),
            I64 => Some(GgmlType::I64),
            _ => None,
        }
    }
}

impl fmt::Display for StDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One validated tensor entry of a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StTensor {
    pub name: String,
    pub dtype: StDtype,
    /// PyTorch order (row-major: the last dim is contiguous).
    pub shape: Vec<u64>,
    /// Start of the data, relative to the data section.
    pub begin: u64,
    /// End (exclusive), relative to the data section.
    pub end: u64,
}

impl StTensor {
    /// Number of elements (validated to fit and to be at most [`MAX_ELEMENTS`]).
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Bytes of data.
    pub fn byte_len(&self) -> u64 {
        self.end - self.begin
    }
}

/// A validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsHeader {
    /// Tensors in header order.
    pub tensors: Vec<StTensor>,
    /// `__metadata__` entries in header order.
    pub metadata: Vec<(String, String)>,
    /// File offset of the data section (8 + header length).
    pub data_start: u64,
    /// Size of the whole file.
    pub file_size: u64,
}

impl SafetensorsHeader {
    /// Find a tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&StTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
    /// Bytes of the data section.
    pub fn data_len(&self) -> u64 {
        self.file_size - self.data_start
    }
}

/// Everything that can be wrong with a safetensors file or a Hugging Face model folder.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: {size} bytes is too short for a safetensors file (it starts with an 8-byte header length)")]
    TooShort { file: String, size: u64 },
    #[error("{file}: header length {len} bytes is over the {cap}-byte cap; this is not a safetensors file or it is corrupt")]
    HeaderTooLarge { file: String, len: u64, cap: u64 },
    #[error("{file}: header length {len} bytes runs past the end of the {file_size}-byte file; the file is truncated or not safetensors")]
    HeaderPastEof {
        file: String,
        len: u64,
        file_size: u64,
    },
    #[error("{file}: header is not UTF-8 (bad byte at file offset {offset})")]
    HeaderNotUtf8 { file: String, offset: u64 },
    #[error("{file}: header JSON: {reason}")]
    HeaderJson { file: String, reason: String },
    #[error("{file}: `__metadata__`: {reason}")]
    BadMetadata { file: String, reason: String },
    #[error("{file}: tensor `{tensor}` appears more than once in the header")]
    DuplicateTensor { file: String, tensor: String },
    #[error("{file}: tensor `{tensor}` has unknown dtype `{dtype}`")]
    UnknownDtype {
        file: String,
        tensor: String,
        dtype: String,
    },
    #[error("{file}: tensor `{tensor}`: shape {reason}")]
    BadShape {
        file: String,
        tensor: String,
        reason: String,
    },
    #[error("{file}: tensor `{tensor}`: data_offsets {reason}")]
    BadOffsets {
        file: String,
        tensor: String,
        reason: String,
    },
    #[error("{file}: tensor `{tensor}` ends at data offset {end}, past the {data_len}-byte data section; the file is truncated")]
    OffsetsPastEnd {
        file: String,
        tensor: String,
        end: u64,
        data_len: u64,
    },
    #[error("{file}: tensors `{tensor}` and `{other}` overlap ({tensor} starts at {begin}, {other} ends at {other_end})")]
    Overlap {
        file: String,
        tensor: String,
        other: String,
        begin: u64,
        other_end: u64,
    },
    #[error("{file}: `{key}`: {reason}")]
    BadConfig {
        file: String,
        key: String,
        reason: String,
    },
    #[error("{file}: architecture `{arch}` is not supported; supported: {supported}")]
    UnsupportedArch {
        file: String,
        arch: String,
        supported: String,
    },
    #[error("{dir}: no `model.safetensors` and no `model.safetensors.index.json`; point at a Hugging Face model folder")]
    NoModelFiles { dir: String },
    #[error("{file}: {reason}")]
    BadIndex { file: String, reason: String },
    #[error(
        "{index} names shard `{shard}`, which is not in the folder; download the missing shard"
    )]
    MissingShard { index: String, shard: String },
    #[error(
        "{index} says tensor `{tensor}` is in `{shard}`, but that shard's header does not have it"
    )]
    TensorNotInShard {
        index: String,
        tensor: String,
        shard: String,
    },
    #[error("{shard}: tensor `{tensor}` is not listed for this shard in {index}")]
    TensorNotInIndex {
        index: String,
        shard: String,
        tensor: String,
    },
    #[error("{file}: tensor `{tensor}` has dtype {dtype}, which is not a weight type Strata runs (F32, F16, BF16); use a BF16/F16/F32 checkpoint or convert it to GGUF first")]
    UnsupportedDtype {
        file: String,
        tensor: String,
        dtype: StDtype,
    },
    #[error("{dir}: {source} (GGUF names and dims, ne0 first; HF shapes are reversed): check config.json against the weights, or re-download the model")]
    Layout {
        dir: String,
        #[source]
        source: Box<crate::inventory::InventoryError>,
    },
    #[error(
        "{file}: tensor `{tensor}` is not part of architecture `{arch}` (no llama.cpp name for it)"
    )]
    UnknownTensor {
        file: String,
        arch: String,
        tensor: String,
    },
    #[error("{dir}: layer {layer} `{proj}` experts: expert {expert} of {n_expert} is missing")]
    MissingExpert {
        dir: String,
        layer: u32,
        proj: String,
        expert: u64,
        n_expert: u64,
    },
    #[error("{file}: tensor `{tensor}`: {reason}")]
    ExpertMismatch {
        file: String,
        tensor: String,
        reason: String,
    },
    #[error("{file}: {source}")]
    Inventory {
        file: String,
        #[source]
        source: InventoryError,
    },
}

/// At most 200 characters of a name from a file, for error messages.
fn short(s: &str) -> String {
    if s.chars().count() <= 200 {
        s.to_string()
    } else {
        let head: String = s.chars().take(200).collect();
        format!("{head}...")
    }
}

/// Parse and validate a whole safetensors file held in memory (length + JSON + data).
/// Pure: the fuzz target. `origin` names the file in errors.
pub fn parse_header_bytes(
    bytes: &[u8],
    origin: &str,
) -> Result<SafetensorsHeader, SafetensorsError> {
    let file_size = bytes.len() as u64;
    let Some(len_bytes) = bytes.first_chunk::<8>() else {
        return Err(SafetensorsError::TooShort {
            file: origin.to_string(),
            size: file_size,
        });
    };
    let len = u64::from_le_bytes(*len_bytes);
    check_header_len(origin, len, file_size)?;
    // `len <= file_size - 8`, so the range is inside `bytes`.
    let json = bytes
        .get(8..8 + len as usize)
        .ok_or_else(|| SafetensorsError::HeaderPastEof {
            file: origin.to_string(),
            len,
            file_size,
        })?;
    parse_json(json, origin, file_size)
}

/// Read and validate the header of the safetensors file at `path`: only the first
/// 8 + header length bytes are read, after the length is checked against the file size.
pub fn read_header(path: &Path) -> Result<SafetensorsHeader, SafetensorsError> {
    let origin = path.display().to_string();
    let io = |source| SafetensorsError::Io {
        file: origin.clone(),
        source,
    };
    let mut f = crate::files::open_regular(path, "safetensors file").map_err(|e| match e {
        crate::files::FileError::Io { source, .. } => io(source),
        other => io(std::io::Error::other(other.to_string())),
    })?;
    let file_size = f.metadata().map_err(io)?.len();
    if file_size < 8 {
        return Err(SafetensorsError::TooShort {
            file: origin,
            size: file_size,
        });
    }
    let mut len_bytes = [0u8; 8];
    f.read_exact(&mut len_bytes).map_err(io)?;
    let len = u64::from_le_bytes(len_bytes);
    check_header_len(&origin, len, file_size)?;
    let len_usize = usize::try_from(len).map_err(|_| SafetensorsError::HeaderTooLarge {
        file: origin.clone(),
        len,
        cap: HEADER_CAP,
    })?;
    // Bounded by HEADER_CAP and by the file's size.
    let mut json = vec![0u8; len_usize];
    f.read_exact(&mut json).map_err(io)?;
    parse_json(&json, &origin, file_size)
}

fn check_header_len(origin: &str, len: u64, file_size: u64) -> Result<(), SafetensorsError> {
    if len > HEADER_CAP {
        return Err(SafetensorsError::HeaderTooLarge {
            file: origin.to_string(),
            len,
            cap: HEADER_CAP,
        });
    }
    if len > file_size.saturating_sub(8) {
        return Err(SafetensorsError::HeaderPastEof {
            file: origin.to_string(),
            len,
            file_size,
        });
    }
    Ok(())
}

/// Parse the header JSON (`json.len()` is the checked header length) and validate it.
fn parse_json(
    json: &[u8],
    origin: &str,
    file_size: u64,
) -> Result<SafetensorsHeader, SafetensorsError> {
    let text = std::str::from_utf8(json).map_err(|e| SafetensorsError::HeaderNotUtf8 {
        file: origin.to_string(),
        offset: 8 + e.valid_up_to() as u64,
    })?;
    let mut de = serde_json::Deserializer::from_str(text);
    let raw = RawHeader::deserialize(&mut de)
        .and_then(|r| de.end().map(|()| r))
        .map_err(|e| SafetensorsError::HeaderJson {
            file: origin.to_string(),
            reason: e.to_string(),
        })?;
    let data_start = 8 + json.len() as u64;
    validate(raw, origin, data_start, file_size)
}

fn validate(
    raw: RawHeader,
    origin: &str,
    data_start: u64,
    file_size: u64,
) -> Result<SafetensorsHeader, SafetensorsError> {
    let file = || origin.to_string();
    let data_len = file_size - data_start;

    if raw.metadata.len() > 1 {
        return Err(SafetensorsError::BadMetadata {
            file: file(),
            reason: format!(
                "appears {} times; a header has at most one",
                raw.metadata.len()
            ),
        });
    }
    let metadata = raw.metadata.into_iter().next().unwrap_or_default();
    {
        // A sorted list of exact capacity (16 bytes a key), not a growing HashSet: `"a":"",`
        // is 7 input bytes, and a set's bucket overshoot on top of the 48-byte pairs broke
        // the 16x allocation bound (see FUZZING.md).
        let mut keys: Vec<&str> = metadata.iter().map(|(k, _)| k.as_str()).collect();
        keys.sort_unstable();
        if let Some(w) = keys.windows(2).find(|w| w[0] == w[1]) {
            return Err(SafetensorsError::BadMetadata {
                file: file(),
                reason: format!("key `{}` appears more than once", short(w[0])),
            });
        }
    }

    let mut seen = HashSet::with_capacity(raw.entries.len());
    for (name, _) in &raw.entries {
        if !seen.insert(name.as_str()) {
            return Err(SafetensorsError::DuplicateTensor {
                file: file(),
                tensor: short(name),
            });
        }
    }
    drop(seen);

    let mut tensors = Vec::with_capacity(raw.entries.len());
    for (name, t) in raw.entries {
        let dtype = StDtype::from_name(&t.dtype).ok_or_else(|| SafetensorsError::UnknownDtype {
            file: file(),
            tensor: short(&name),
            dtype: short(&t.dtype),
        })?;
        let shape = t.shape.0;
        let elements = shape
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| SafetensorsError::BadShape {
                file: file(),
                tensor: short(&name),
                reason: format!("{shape:?}: the element count overflows u64"),
            })?;
        if elements > MAX_ELEMENTS {
            return Err(SafetensorsError::BadShape {
                file: file(),
                tensor: short(&name),
                reason: format!("{shape:?}: {elements} elements is over the 2^50 limit"),
            });
        }
        // elements <= 2^50 and bits <= 64: no overflow.
        let bits = elements * dtype.bits();
        if bits % 8 != 0 {
            return Err(SafetensorsError::BadShape {
                file: file(),
                tensor: short(&name),
                reason: format!("{shape:?} of {dtype} is {bits} bits, not a whole number of bytes"),
            });
        }
        let need = bits / 8;
        let (begin, end) = t.data_offsets;
        if begin > end {
            return Err(SafetensorsError::BadOffsets {
                file: file(),
                tensor: short(&name),
                reason: format!("[{begin}, {end}]: begin is after end"),
            });
        }
        if end - begin != need {
            return Err(SafetensorsError::BadOffsets {
                file: file(),
                tensor: short(&name),
                reason: format!(
                    "[{begin}, {end}] span {} bytes, but shape {shape:?} of {dtype} needs {need}",
                    end - begin
                ),
            });
        }
        if end > data_len {
            return Err(SafetensorsError::OffsetsPastEnd {
                file: file(),
                tensor: short(&name),
                end,
                data_len,
            });
        }
        tensors.push(StTensor {
            name,
            dtype,
            shape,
            begin,
            end,
        });
    }

    // Overlap: sort the non-empty spans by start; each must start at or after the previous end.
    let mut order: Vec<usize> = (0..tensors.len())
        .filter(|&i| tensors[i].begin < tensors[i].end)
        .collect();
    order.sort_by_key(|&i| (tensors[i].begin, tensors[i].end));
    for w in order.windows(2) {
        let (prev, cur) = (&tensors[w[0]], &tensors[w[1]]);
        if cur.begin < prev.end {
            return Err(SafetensorsError::Overlap {
                file: file(),
                tensor: short(&cur.name),
                other: short(&prev.name),
                begin: cur.begin,
                other_end: prev.end,
            });
        }
    }

    Ok(SafetensorsHeader {
        tensors,
        metadata,
        data_start,
        file_size,
    })
}

// ---- raw JSON shapes (duplicates kept, so validation can name them) ----

struct RawHeader {
    entries: Vec<(String, RawTensor)>,
    metadata: Vec<Vec<(String, String)>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTensor {
    dtype: String,
    shape: RawShape,
    data_offsets: (u64, u64),
}

/// A shape whose rank is capped while it is read.
struct RawShape(Vec<u64>);

impl<'de> Deserialize<'de> for RawShape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawShape;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "an array of at most {MAX_RANK} non-negative integers")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawShape, A::Error> {
                let mut dims = Vec::new();
                while let Some(d) = seq.next_element::<u64>()? {
                    if dims.len() == MAX_RANK {
                        return Err(de::Error::custom(format!(
                            "shape has more than {MAX_RANK} dims"
                        )));
                    }
                    dims.push(d);
                }
                Ok(RawShape(dims))
            }
        }
        d.deserialize_seq(V)
    }
}

/// `__metadata__`: string -> string, duplicates kept.
struct RawMeta(Vec<(String, String)>);

impl<'de> Deserialize<'de> for RawMeta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawMeta;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("`__metadata__` as an object of string values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawMeta, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    let v = map.next_value::<String>().map_err(|e| {
                        de::Error::custom(format!("`__metadata__` key `{}`: {e}", short(&k)))
                    })?;
                    out.push((k, v));
                }
                // Give back the doubling overshoot: 48 bytes a pair, from as little as 6
                // bytes of input (`"":"",`), must not be held twice over.
                out.shrink_to_fit();
                Ok(RawMeta(out))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
                let mut entries = Vec::new();
                let mut metadata = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    if k == "__metadata__" {
                        metadata.push(map.next_value::<RawMeta>()?.0);
                    } else {
                        let t = map.next_value::<RawTensor>().map_err(|e| {
                            de::Error::custom(format!("tensor `{}`: {e}", short(&k)))
                        })?;
                        entries.push((k, t));
                    }
                }
                Ok(RawHeader { entries, metadata })
            }
        }
        d.deserialize_map(V)
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    //! A tiny safetensors writer for tests: 8-byte length + JSON + zero data.

    /// `(name, dtype, shape)` laid out back to back; data is zeros.
    pub fn st_file(entries: &[(&str, &str, &[u64])]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut off = 0u64;
        for (name, dtype, shape) in entries {
            let bits = match *dtype {
                "F64" | "I64" | "U64" => 64,
                "F32" | "I32" | "U32" => 32,
                "F16" | "BF16" | "I16" | "U16" => 16,
                _ => 8,
            };
            let n: u64 = shape.iter().product::<u64>() * bits / 8;
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}),
            );
            off += n;
        }
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        raw_file(&serde_json::to_string(&header).unwrap(), off)
    }

    /// A file from literal header JSON and `data_len` zero bytes of data.
    pub fn raw_file(json: &str, data_len: u64) -> Vec<u8> {
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        out.resize(out.len() + data_len as usize, 0);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;
    use proptest::prelude::*;

    fn parse(bytes: &[u8]) -> Result<SafetensorsHeader, SafetensorsError> {
        parse_header_bytes(bytes, "t.safetensors")
    }

    fn one(json: &str, data: u64) -> SafetensorsError {
        parse(&raw_file(json, data)).unwrap_err()
    }

    #[test]
    fn valid_file_round_trips() {
        let bytes = st_file(&[
            ("a", "BF16", &[2, 3]),
            ("b", "F32", &[4]),
            ("c", "F16", &[]),
        ]);
        let h = parse(&bytes).unwrap();
        assert_eq!(h.tensors.len(), 3);
        assert_eq!(h.tensors[0].name, "a");
        assert_eq!(h.tensors[0].dtype, StDtype::BF16);
        assert_eq!((h.tensors[0].begin, h.tensors[0].end), (0, 12));
        assert_eq!((h.tensors[1].begin, h.tensors[1].end), (12, 28));
        assert_eq!(h.tensors[2].elements(), 1);
        assert_eq!(h.metadata, vec![("format".to_string(), "pt".to_string())]);
        assert_eq!(h.file_size, bytes.len() as u64);
        assert_eq!(h.data_len(), 30);
        assert_eq!(h.data_start + h.data_len(), h.file_size);
    }

    #[test]
    fn read_header_matches_parse_and_reads_from_disk() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        let bytes = st_file(&[("x", "BF16", &[8, 8])]);
        std::fs::write(&p, &bytes).unwrap();
        let a = read_header(&p).unwrap();
        let b = parse(&bytes).unwrap();
        assert_eq!(a.tensors, b.tensors);
        assert_eq!(a.file_size, b.file_size);
        // A header length past EOF is refused before any allocation of that size.
        let mut bad = bytes.clone();
        bad[..8].copy_from_slice(&(HEADER_CAP - 1).to_le_bytes());
        std::fs::write(&p, &bad).unwrap();
        let e = read_header(&p).unwrap_err();
        assert!(matches!(e, SafetensorsError::HeaderPastEof { .. }), "{e}");
        assert!(e.to_string().contains("m.safetensors"));
        std::fs::write(&p, [1u8, 2, 3]).unwrap();
        assert!(matches!(
            read_header(&p),
            Err(SafetensorsError::TooShort { size: 3, .. })
        ));
    }

    #[test]
    fn too_short() {
        assert!(matches!(
            parse(&[0; 7]),
            Err(SafetensorsError::TooShort { size: 7, .. })
        ));
    }

    #[test]
    fn header_len_past_eof() {
        let mut b = raw_file("{}", 0);
        b[..8].copy_from_slice(&3u64.to_le_bytes());
        let e = parse(&b).unwrap_err();
        assert!(
            matches!(
                e,
                SafetensorsError::HeaderPastEof {
                    len: 3,
                    file_size: 10,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn header_len_over_cap() {
        let mut b = raw_file("{}", 0);
        b[..8].copy_from_slice(&(HEADER_CAP + 1).to_le_bytes());
        assert!(matches!(
            parse(&b),
            Err(SafetensorsError::HeaderTooLarge { .. })
        ));
        b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            parse(&b),
            Err(SafetensorsError::HeaderTooLarge { .. })
        ));
    }

    #[test]
    fn invalid_json() {
        let e = one(
            r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]"#,
            4,
        );
        assert!(matches!(e, SafetensorsError::HeaderJson { .. }), "{e}");
        let e = one(r#"[1, 2]"#, 0);
        assert!(matches!(e, SafetensorsError::HeaderJson { .. }), "{e}");
        // trailing garbage after the object
        let e = one(r#"{} x"#, 0);
        assert!(matches!(e, SafetensorsError::HeaderJson { .. }), "{e}");
        // unknown field in an entry, named with its tensor
        let e = one(
            r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}"#,
            4,
        );
        assert!(e.to_string().contains("tensor `a`"), "{e}");
        // negative offset
        let e = one(
            r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}"#,
            4,
        );
        assert!(matches!(e, SafetensorsError::HeaderJson { .. }), "{e}");
    }

    #[test]
    fn invalid_utf8() {
        let mut b = raw_file(r#"{"ab": 1}"#, 0);
        b[8 + 3] = 0xff;
        let e = parse(&b).unwrap_err();
        assert!(
            matches!(e, SafetensorsError::HeaderNotUtf8 { offset: 11, .. }),
            "{e}"
        );
    }

    #[test]
    fn unknown_dtype() {
        let e = one(
            r#"{"w": {"dtype": "F12", "shape": [1], "data_offsets": [0, 4]}}"#,
            4,
        );
        match e {
            SafetensorsError::UnknownDtype { tensor, dtype, .. } => {
                assert_eq!((tensor.as_str(), dtype.as_str()), ("w", "F12"))
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn shape_product_overflow_and_cap() {
        let e = one(
            r#"{"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 2], "data_offsets": [0, 4]}}"#,
            4,
        );
        assert!(
            matches!(&e, SafetensorsError::BadShape { tensor, .. } if tensor == "w"),
            "{e}"
        );
        assert!(e.to_string().contains("overflows"));
        let e = one(
            r#"{"w": {"dtype": "U8", "shape": [1125899906842625], "data_offsets": [0, 4]}}"#,
            4,
        );
        assert!(e.to_string().contains("2^50"), "{e}");
        let dims = vec!["1"; MAX_RANK + 1].join(",");
        let e = one(
            &format!(r#"{{"w": {{"dtype": "U8", "shape": [{dims}], "data_offsets": [0, 1]}}}}"#),
            1,
        );
        assert!(e.to_string().contains("more than 16 dims"), "{e}");
    }

    #[test]
    fn offsets_mismatch_shape() {
        let e = one(
            r#"{"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}"#,
            8,
        );
        assert!(
            matches!(&e, SafetensorsError::BadOffsets { tensor, .. } if tensor == "w"),
            "{e}"
        );
        assert!(e.to_string().contains("needs 6"), "{e}");
        // sub-byte dtype that does not fill whole bytes
        let e = one(
            r#"{"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}"#,
            2,
        );
        assert!(matches!(e, SafetensorsError::BadShape { .. }), "{e}");
    }

    #[test]
    fn end_past_eof() {
        let e = one(
            r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}"#,
            7,
        );
        assert!(
            matches!(
                e,
                SafetensorsError::OffsetsPastEnd {
                    end: 8,
                    data_len: 7,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn begin_after_end() {
        let e = one(
            r#"{"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}}"#,
            8,
        );
        assert!(matches!(e, SafetensorsError::BadOffsets { .. }), "{e}");
        assert!(e.to_string().contains("begin is after end"));
    }

    #[test]
    fn overlapping_tensors() {
        let e = one(
            r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}"#,
            12,
        );
        match e {
            SafetensorsError::Overlap { tensor, other, .. } => {
                assert_eq!((tensor.as_str(), other.as_str()), ("b", "a"))
            }
            e => panic!("{e}"),
        }
        // Empty tensors occupy no bytes and never overlap.
        let ok = parse(&raw_file(
            r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}"#,
            8,
        ));
        assert!(ok.is_ok());
    }

    #[test]
    fn duplicate_names() {
        let e = one(
            r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}"#,
            8,
        );
        assert!(
            matches!(&e, SafetensorsError::DuplicateTensor { tensor, .. } if tensor == "a"),
            "{e}"
        );
        let e = one(r#"{"__metadata__": {"k": "1", "k": "2"}}"#, 0);
        assert!(matches!(e, SafetensorsError::BadMetadata { .. }), "{e}");
        let e = one(r#"{"__metadata__": {}, "__metadata__": {}}"#, 0);
        assert!(matches!(e, SafetensorsError::BadMetadata { .. }), "{e}");
    }

    #[test]
    fn metadata_must_be_strings() {
        let e = one(r#"{"__metadata__": {"k": 1}}"#, 0);
        assert!(matches!(e, SafetensorsError::HeaderJson { .. }), "{e}");
        assert!(e.to_string().contains("`__metadata__` key `k`"), "{e}");
    }

    #[test]
    fn dtype_table() {
        for d in ALL_DTYPES {
            assert_eq!(StDtype::from_name(d.name()), Some(*d));
        }
        assert_eq!(StDtype::BF16.ggml_type(), Some(GgmlType::BF16));
        assert_eq!(StDtype::F8E4M3.ggml_type(), None);
        assert_eq!(StDtype::F4.bits(), 4);
    }

    /// Regression (allocation bound, found by hand while sizing the fuzz target's bound):
    /// 4097 metadata pairs with 1- and 2-character keys, 32,709 bytes, made the reader hold
    /// 610,245 bytes (18.7x; the fuzz bound is 16x + 64 KiB): the pairs' Vec at twice its
    /// length plus a HashSet of the keys at up to 2.3 buckets a key. Now the pairs are shrunk
    /// to fit and duplicates are found by sorting; the fuzz target replays it at 12.4x.
    #[test]
    fn many_short_metadata_keys_are_held_compactly() {
        let chars: Vec<char> = (0x20u8..0x7f)
            .map(char::from)
            .filter(|c| *c != '"' && *c != '\\')
            .collect();
        let mut keys: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
        for a in &chars {
            keys.extend(chars.iter().map(|b| format!("{a}{b}")));
        }
        keys.truncate(4097);
        let pairs: Vec<String> = keys.iter().map(|k| format!("\"{k}\":\"\"")).collect();
        let bytes = raw_file(&format!("{{\"__metadata__\":{{{}}}}}", pairs.join(",")), 0);
        assert_eq!(bytes.len(), 32_709);
        let h = parse(&bytes).unwrap();
        assert_eq!(h.metadata.len(), 4097);
        assert_eq!(h.metadata.capacity(), 4097, "metadata not shrunk to fit");
        // A duplicate among them is still found.
        let mut dup = pairs.clone();
        dup.push(r#""A~":"""#.to_string());
        let bytes = raw_file(&format!("{{\"__metadata__\":{{{}}}}}", dup.join(",")), 0);
        let Err(e) = parse(&bytes) else {
            panic!("a duplicate metadata key was accepted")
        };
        assert!(
            e.to_string().contains("key `A~` appears more than once"),
            "{e}"
        );
    }

    /// The fuzz seed corpus (see FUZZING.md): when STRATA_SAFETENSORS_SEED_DIR is set (to
    /// `fuzz/seeds/safetensors_header`), writes the seeds there; always checks they parse.
    #[test]
    fn seed_corpus() {
        let seeds: Vec<(&str, Vec<u8>)> = vec![
            (
                "two_tensors",
                st_file(&[("a.weight", "BF16", &[2, 3]), ("b", "F32", &[4])]),
            ),
            (
                "many_dtypes",
                st_file(&[
                    ("x", "F16", &[]),
                    ("y", "I8", &[3, 1]),
                    ("z", "F8_E4M3", &[2]),
                    ("w", "BOOL", &[2, 2]),
                    ("v", "U64", &[1]),
                    ("e", "F32", &[0, 5]),
                ]),
            ),
            (
                // Out-of-order offsets, gaps, a 4-bit dtype, padded JSON, two metadata keys.
                "padded_gap_meta",
                raw_file(
                    concat!(
                        r#"{"__metadata__":{"format":"pt","note":"é"},"#,
                        r#""late":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},"#,
                        r#""f4":{"dtype":"F4","shape":[2,2],"data_offsets":[12,14]},"#,
                        r#""early":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}   "#
                    ),
                    16,
                ),
            ),
            ("empty_header", raw_file("{}", 0)),
        ];
        let mut total = 0;
        for (name, bytes) in &seeds {
            assert!(parse(bytes).is_ok(), "{name}: {:?}", parse(bytes));
            total += bytes.len();
        }
        assert!(total < 8 << 10, "seeds are {total} bytes; keep them small");
        if let Some(out) = std::env::var_os("STRATA_SAFETENSORS_SEED_DIR") {
            let out = std::path::PathBuf::from(out);
            std::fs::create_dir_all(&out).unwrap();
            for (name, bytes) in &seeds {
                std::fs::write(out.join(name), bytes).unwrap();
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]
        /// Random byte flips, insertions and truncations of a valid file never panic, and
        /// anything accepted still satisfies the header invariants.
        #[test]
        fn mutations_never_panic(
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
            cut in any::<usize>(),
            do_cut in any::<bool>(),
        ) {
            let mut b = st_file(&[("a.weight", "BF16", &[4, 4]), ("b", "F32", &[3]), ("c", "I8", &[5])]);
            for (i, v) in flips {
                let i = i % b.len();
                b[i] = v;
            }
            if do_cut {
                b.truncate(cut % (b.len() + 1));
            }
            if let Ok(h) = parse_header_bytes(&b, "fuzz") {
                prop_assert!(h.data_start <= h.file_size);
                for t in &h.tensors {
                    prop_assert!(t.begin <= t.end && t.end <= h.data_len());
                    prop_assert!(t.elements() <= MAX_ELEMENTS);
                }
            }
        }

        /// Arbitrary bytes after a plausible length never panic.
        #[test]
        fn arbitrary_json_never_panics(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut b = (body.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(&body);
            let _ = parse_header_bytes(&b, "fuzz");
        }
    }
}
