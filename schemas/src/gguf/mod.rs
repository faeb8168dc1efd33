//! GGUF headers: the in-memory model of a GGUF file (metadata, tensor infos, split parts) and
//! its typed errors; the reader is [`read`], the writer [`write`], with random models in
//! [`random`] and HF conversion in [`convert`]. Invariant: a `GgufFile` only exists after every count, length, type id,
//! dimension, offset and size in the file was checked against the file size and the caps in
//! [`read`]; its tensors lie inside their part's data section and never overlap.

pub mod convert;
pub mod hf_sources;
pub mod metadata;
pub mod mmproj;
pub mod model;
pub mod mtp_file;
pub mod quantize;
pub mod random;
pub mod read;
pub mod split_mtp;
#[cfg(any(test, feature = "test-support"))]
pub mod testutil;
pub mod write;

pub use read::{parse_gguf_bytes, read_gguf, Caps, CAPS};

use crate::ggml::GgmlType;

/// Alignment of the data section and of every tensor offset when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// GGUF metadata value type ids, as stored in the file.
pub mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;

    /// Human name of a value type id, for error messages.
    pub fn name(id: u32) -> &'static str {
        match id {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            BOOL => "bool",
            STRING => "string",
            ARRAY => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
            _ => "unknown",
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The GGUF value type id of this value.
    pub fn type_id(&self) -> u32 {
        use value_type as t;
        match self {
            GgufValue::U8(_) => t::U8,
            GgufValue::I8(_) => t::I8,
            GgufValue::U16(_) => t::U16,
            GgufValue::I16(_) => t::I16,
            GgufValue::U32(_) => t::U32,
            GgufValue::I32(_) => t::I32,
            GgufValue::F32(_) => t::F32,
            GgufValue::Bool(_) => t::BOOL,
            GgufValue::String(_) => t::STRING,
            GgufValue::Array(_) => t::ARRAY,
            GgufValue::U64(_) => t::U64,
            GgufValue::I64(_) => t::I64,
            GgufValue::F64(_) => t::F64,
        }
    }

    /// Name of the value's type ("u32", "array of string"...), for messages.
    pub fn type_name(&self) -> String {
        match self {
            GgufValue::Array(a) => format!("array of {}", value_type::name(a.elem_type_id())),
            v => value_type::name(v.type_id()).to_string(),
        }
    }

    /// The value as an unsigned integer: any integer type that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float: either float type, or any integer type.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
}

/// A metadata array, stored compactly by element type. Nested arrays are allowed up to
/// [`Caps::max_array_depth`]; an empty array keeps its element type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    Strings(Vec<String>),
    Arrays(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::Strings(v) => v.len(),
            GgufArray::Arrays(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The GGUF value type id of the elements.
    pub fn elem_type_id(&self) -> u32 {
        use value_type as t;
        match self {
            GgufArray::U8(_) => t::U8,
            GgufArray::I8(_) => t::I8,
            GgufArray::U16(_) => t::U16,
            GgufArray::I16(_) => t::I16,
            GgufArray::U32(_) => t::U32,
            GgufArray::I32(_) => t::I32,
            GgufArray::F32(_) => t::F32,
            GgufArray::Bool(_) => t::BOOL,
            GgufArray::Strings(_) => t::STRING,
            GgufArray::Arrays(_) => t::ARRAY,
            GgufArray::U64(_) => t::U64,
            GgufArray::I64(_) => t::I64,
            GgufArray::F64(_) => t::F64,
        }
    }

    /// Integer elements widened to u64 where every element is a non-negative
    /// integer (e.g. per-layer head counts); `None` for other element types or negatives.
    pub fn to_u64_vec(&self) -> Option<Vec<u64>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<u64>) -> Option<Vec<u64>> {
            v.iter().map(|x| f(*x)).collect()
        }
        match self {
            GgufArray::U8(v) => conv(v, |x| Some(x.into())),
            GgufArray::U16(v) => conv(v, |x| Some(x.into())),
            GgufArray::U32(v) => conv(v, |x| Some(x.into())),
            GgufArray::U64(v) => Some(v.clone()),
            GgufArray::I8(v) => conv(v, |x| u64::try_from(x).ok()),
            GgufArray::I16(v) => conv(v, |x| u64::try_from(x).ok()),
            GgufArray::I32(v) => conv(v, |x| u64::try_from(x).ok()),
            GgufArray::I64(v) => conv(v, |x| u64::try_from(x).ok()),
            _ => None,
        }
    }
}

/// One tensor's header record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` (ne0) is contiguous. 1..=4 entries, each >= 1.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Relative to the data section of part `part` (a multiple of that part's alignment).
    pub offset: u64,
    /// Exact bytes of the tensor data, from the ggml block table.
    pub bytes: u64,
    /// Index into [`GgufFile::parts`].
    pub part: u32,
}

impl GgufTensorInfo {
    /// Number of elements (checked against the element cap when read, so it cannot overflow).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// One file of a (possibly split) model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufPart {
    pub path: String,
    pub version: u32,
    pub alignment: u64,
    /// Absolute file offset where this part's tensor data section starts.
    pub data_offset: u64,
    pub file_size: u64,
    /// Tensors stored in this part.
    pub n_tensors: u64,
}

/// A validated GGUF header (all parts of a split model merged).
#[derive(Debug, Clone, PartialEq)]
pub struct GgufFile {
    /// The file that was asked for (the first part of a split model).
    pub path: String,
    pub version: u32,
    /// Metadata of the first part, in file order. Keys are unique.
    pub metadata: Vec<(String, GgufValue)>,
    /// Tensors of every part, part by part in file order. Names are unique across parts.
    pub tensors: Vec<GgufTensorInfo>,
    /// Alignment of the first part (`general.alignment`, default 32).
    pub alignment: u64,
    /// Data section start of the first part.
    pub data_offset: u64,
    /// Size of the first part.
    pub file_size: u64,
    /// Every part, in order; `parts[0]` is the file itself (always present, also when not split).
    pub parts: Vec<GgufPart>,
}

impl GgufFile {
    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn wrong_type(&self, key: &str, expected: &'static str, v: &GgufValue) -> GgufError {
        GgufError::WrongType {
            file: self.path.clone(),
            offset: 0,
            field: format!("metadata key '{key}'"),
            expected,
            found: v.type_name(),
        }
    }

    /// An unsigned integer key, accepting any integer type; an error for other types or
    /// negative values.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v)),
        }
    }

    /// A float key, accepting either float type or any integer type.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a number", v)),
        }
    }

    /// A string key.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong_type(key, "a string", v)),
        }
    }

    /// A bool key.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong_type(key, "a bool", v)),
        }
    }

    /// An array key.
    pub fn get_array(&self, key: &str) -> Result<Option<&GgufArray>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.wrong_type(key, "an array", v)),
        }
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Absolute offset of a tensor's data in its part's file.
    pub fn tensor_file_offset(&self, t: &GgufTensorInfo) -> Option<u64> {
        let part = self.parts.get(t.part as usize)?;
        part.data_offset.checked_add(t.offset)
    }
}

/// Everything that can be wrong with a GGUF file. Every message names the file, the byte
/// offset where the problem was found and the field.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error(
        "{file}: cannot read (byte {offset}, {field}): {source}; check the path and permissions"
    )]
    Io {
        file: String,
        offset: u64,
        field: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: truncated at byte {offset} reading {field}: needs {need} bytes, {have} left; the file is incomplete (re-download it)")]
    Truncated {
        file: String,
        offset: u64,
        field: String,
        need: u64,
        have: u64,
    },
    #[error("{file}: byte {offset}, {field}: found {found:02x?}, expected \"GGUF\"; this is not a GGUF file")]
    BadMagic {
        file: String,
        offset: u64,
        field: String,
        found: [u8; 4],
    },
    #[error("{file}: byte {offset}, {field}: version {version} is not supported ({why})")]
    UnsupportedVersion {
        file: String,
        offset: u64,
        field: String,
        version: u32,
        why: &'static str,
    },
    #[error("{file}: byte {offset}, {field}: {value} exceeds the limit of {limit} ({why}); the file is corrupt or hostile")]
    TooLarge {
        file: String,
        offset: u64,
        field: String,
        value: u64,
        limit: u64,
        why: &'static str,
    },
    #[error("{file}: byte {offset}, {field}: not valid UTF-8 (first bad byte at {bad_at})")]
    InvalidUtf8 {
        file: String,
        offset: u64,
        field: String,
        bad_at: u64,
    },
    #[error("{file}: byte {offset}, {field}: bool byte is {value}, must be 0 or 1")]
    BadBool {
        file: String,
        offset: u64,
        field: String,
        value: u8,
    },
    #[error(
        "{file}: byte {offset}, {field}: unknown metadata value type id {type_id} (valid: 0..=12)"
    )]
    BadValueType {
        file: String,
        offset: u64,
        field: String,
        type_id: u32,
    },
    #[error("{file}: byte {offset}, {field}: unknown ggml tensor type id {type_id}; the file needs a newer reader or is corrupt")]
    BadGgmlType {
        file: String,
        offset: u64,
        field: String,
        type_id: u32,
    },
    #[error("{file}: byte {offset}, {field}: duplicate; first seen at byte {first_offset}")]
    Duplicate {
        file: String,
        offset: u64,
        field: String,
        first_offset: u64,
    },
    #[error("{file}: byte {offset}, {field}: {problem}")]
    BadTensor {
        file: String,
        offset: u64,
        field: String,
        problem: String,
    },
    #[error(
        "{file}: byte {offset}, {field}: alignment {value} must be a nonzero power of two <= {max}"
    )]
    BadAlignment {
        file: String,
        offset: u64,
        field: String,
        value: u64,
        max: u64,
    },
    #[error("{file}: byte {offset}, {field}: expected {expected}, found {found}")]
    WrongType {
        file: String,
        /// 0 when the error comes from a getter on an already parsed file.
        offset: u64,
        field: String,
        expected: &'static str,
        found: String,
    },
    #[error("{file}: byte {offset}, {field}: {problem}")]
    Split {
        file: String,
        offset: u64,
        field: String,
        problem: String,
    },
}

impl GgufError {
    /// The file the error is about.
    pub fn file(&self) -> &str {
        match self {
            GgufError::Io { file, .. }
            | GgufError::Truncated { file, .. }
            | GgufError::BadMagic { file, .. }
            | GgufError::UnsupportedVersion { file, .. }
            | GgufError::TooLarge { file, .. }
            | GgufError::InvalidUtf8 { file, .. }
            | GgufError::BadBool { file, .. }
            | GgufError::BadValueType { file, .. }
            | GgufError::BadGgmlType { file, .. }
            | GgufError::Duplicate { file, .. }
            | GgufError::BadTensor { file, .. }
            | GgufError::BadAlignment { file, .. }
            | GgufError::WrongType { file, .. }
            | GgufError::Split { file, .. } => file,
        }
    }

    /// The byte offset the error is about.
    pub fn offset(&self) -> u64 {
        match self {
            GgufError::Io { offset, .. }
            | GgufError::Truncated { offset, .. }
            | GgufError::BadMagic { offset, .. }
            | GgufError::UnsupportedVersion { offset, .. }
            | GgufError::TooLarge { offset, .. }
            | GgufError::InvalidUtf8 { offset, .. }
            | GgufError::BadBool { offset, .. }
            | GgufError::BadValueType { offset, .. }
            | GgufError::BadGgmlType { offset, .. }
            | GgufError::Duplicate { offset, .. }
            | GgufError::BadTensor { offset, .. }
            | GgufError::BadAlignment { offset, .. }
            | GgufError::WrongType { offset, .. }
            | GgufError::Split { offset, .. } => *offset,
        }
    }

    /// The field the error is about.
    pub fn field(&self) -> &str {
        match self {
            GgufError::Io { field, .. }
            | GgufError::Truncated { field, .. }
            | GgufError::BadMagic { field, .. }
            | GgufError::UnsupportedVersion { field, .. }
            | GgufError::TooLarge { field, .. }
            | GgufError::InvalidUtf8 { field, .. }
            | GgufError::BadBool { field, .. }
            | GgufError::BadValueType { field, .. }
            | GgufError::BadGgmlType { field, .. }
            | GgufError::Duplicate { field, .. }
            | GgufError::BadTensor { field, .. }
            | GgufError::BadAlignment { field, .. }
            | GgufError::WrongType { field, .. }
            | GgufError::Split { field, .. } => field,
        }
    }
}
