//! GGUF v2/v3 header reader for files from strangers: magic, version, metadata of every value
//! type (nested arrays included), tensor infos, `general.alignment`, data offset, split models.
//! Invariant: no count, length, id, dimension or offset read from the file is trusted — each is
//! checked (overflow included) against the bytes left, the file size and [`CAPS`] before it is
//! used or anything is allocated for it, so no input can panic, hang or make the reader
//! allocate more than a small multiple of the input's size.

use std::path::Path;

use super::{
    value_type as vt, GgufArray, GgufError, GgufFile, GgufPart, GgufTensorInfo, GgufValue,
    DEFAULT_ALIGNMENT,
};
use crate::ggml::GgmlType;

/// Sanity caps applied on top of "fits in the file".
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Longest metadata string value.
    pub max_string_len: u64,
    /// Longest metadata key or tensor name.
    pub max_name_len: u64,
    /// Deepest nesting of arrays (an array of scalars is depth 1).
    pub max_array_depth: u32,
    /// Most dimensions of a tensor (ggml's GGML_MAX_DIMS).
    pub max_dims: u32,
    /// Most elements of one tensor.
    pub max_elements: u64,
    /// Largest `general.alignment`.
    pub max_alignment: u64,
    /// Most parts of a split model.
    pub max_split_count: u64,
}

/// The caps this reader enforces.
pub const CAPS: Caps = Caps {
    max_string_len: 16 << 20,
    max_name_len: 4096,
    max_array_depth: 8,
    max_dims: 4,
    max_elements: 1 << 50,
    max_alignment: 1 << 20,
    max_split_count: 9999,
};

/// Smallest on-disk size of one record: a key/value (8-byte key length, 4-byte type, 1-byte
/// value) and a tensor info (8-byte name length, n_dims, one dim, type, offset).
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_BYTES: u64 = 8 + 4 + 8 + 4 + 8;
/// Upper bound on a capacity hint taken from a count in the file; vectors grow past it only
/// as real elements are parsed.
const MAX_CAPACITY_HINT: u64 = 1 << 16;

/// Smallest on-disk size of one value of a type, `None` for unknown type ids.
fn min_value_bytes(ty: u32) -> Option<u64> {
    Some(match ty {
        vt::U8 | vt::I8 | vt::BOOL => 1,
        vt::U16 | vt::I16 => 2,
        vt::U32 | vt::I32 | vt::F32 => 4,
        vt::U64 | vt::I64 | vt::F64 => 8,
        vt::STRING => 8,
        vt::ARRAY => 4 + 8,
        _ => return None,
    })
}

type Field<'f> = &'f dyn Fn() -> String;

/// A bounds-checked little-endian cursor. Fields are closures so the happy path of a
/// 150k-entry vocabulary formats nothing.
struct Reader<'a> {
    b: &'a [u8],
    pos: u64,
    file: &'a str,
}

macro_rules! read_le {
    ($name:ident, $t:ty) => {
        fn $name(&mut self, field: Field) -> Result<$t, GgufError> {
            const N: usize = std::mem::size_of::<$t>();
            let s = self.take(N as u64, field)?;
            let mut a = [0u8; N];
            a.copy_from_slice(s);
            Ok(<$t>::from_le_bytes(a))
        }
    };
}

macro_rules! read_vec {
    ($self:ident, $variant:ident, $t:ty, $count:expr, $field:expr) => {{
        const N: usize = std::mem::size_of::<$t>();
        let raw = $self.take($count * N as u64, $field)?;
        GgufArray::$variant(
            raw.chunks_exact(N)
                .map(|c| {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    <$t>::from_le_bytes(a)
                })
                .collect(),
        )
    }};
}

impl<'a> Reader<'a> {
    fn len(&self) -> u64 {
        self.b.len() as u64
    }

    fn remaining(&self) -> u64 {
        self.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: u64, field: Field) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                file: self.file.to_string(),
                offset: self.pos,
                field: field(),
                need: n,
                have: self.remaining(),
            });
        }
        // Both bounds are <= b.len(), which is a usize, so the casts are exact.
        let start = self.pos as usize;
        let end = start + n as usize;
        self.pos += n;
        Ok(&self.b[start..end])
    }

    read_le!(u8, u8);
    read_le!(i8, i8);
    read_le!(u16, u16);
    read_le!(i16, i16);
    read_le!(u32, u32);
    read_le!(i32, i32);
    read_le!(u64, u64);
    read_le!(i64, i64);
    read_le!(f32, f32);
    read_le!(f64, f64);

    fn bool(&mut self, field: Field) -> Result<bool, GgufError> {
        let at = self.pos;
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(GgufError::BadBool {
                file: self.file.to_string(),
                offset: at,
                field: field(),
                value,
            }),
        }
    }

    /// A u64-length-prefixed UTF-8 string no longer than `cap`.
    fn string(&mut self, cap: u64, field: Field) -> Result<String, GgufError> {
        let at = self.pos;
        let len = self.u64(&|| format!("{} length", field()))?;
        if len > cap {
            return Err(GgufError::TooLarge {
                file: self.file.to_string(),
                offset: at,
                field: format!("{} length", field()),
                value: len,
                limit: cap,
                why: "string length cap",
            });
        }
        let bytes = self.take(len, field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError::InvalidUtf8 {
                file: self.file.to_string(),
                offset: at,
                field: field(),
                bad_at: at + 8 + e.valid_up_to() as u64,
            }),
        }
    }

    /// A value of type `ty` (whose id was read at `ty_at`); `depth` is the array nesting
    /// depth of the value's container.
    fn value(
        &mut self,
        ty: u32,
        ty_at: u64,
        depth: u32,
        field: Field,
    ) -> Result<GgufValue, GgufError> {
        Ok(match ty {
            vt::U8 => GgufValue::U8(self.u8(field)?),
            vt::I8 => GgufValue::I8(self.i8(field)?),
            vt::U16 => GgufValue::U16(self.u16(field)?),
            vt::I16 => GgufValue::I16(self.i16(field)?),
            vt::U32 => GgufValue::U32(self.u32(field)?),
            vt::I32 => GgufValue::I32(self.i32(field)?),
            vt::F32 => GgufValue::F32(self.f32(field)?),
            vt::BOOL => GgufValue::Bool(self.bool(field)?),
            vt::STRING => GgufValue::String(self.string(CAPS.max_string_len, field)?),
            vt::ARRAY => GgufValue::Array(self.array(depth + 1, field)?),
            vt::U64 => GgufValue::U64(self.u64(field)?),
            vt::I64 => GgufValue::I64(self.i64(field)?),
            vt::F64 => GgufValue::F64(self.f64(field)?),
            type_id => {
                return Err(GgufError::BadValueType {
                    file: self.file.to_string(),
                    offset: ty_at,
                    field: field(),
                    type_id,
                })
            }
        })
    }

    /// An array body (element type, count, elements) at nesting depth `depth` (>= 1).
    fn array(&mut self, depth: u32, field: Field) -> Result<GgufArray, GgufError> {
        let at = self.pos;
        if depth > CAPS.max_array_depth {
            return Err(GgufError::TooLarge {
                file: self.file.to_string(),
                offset: at,
                field: field(),
                value: depth.into(),
                limit: CAPS.max_array_depth.into(),
                why: "array nesting depth cap",
            });
        }
        let ty = self.u32(&|| format!("{} element type", field()))?;
        let Some(min) = min_value_bytes(ty) else {
            return Err(GgufError::BadValueType {
                file: self.file.to_string(),
                offset: at,
                field: format!("{} element type", field()),
                type_id: ty,
            });
        };
        let count_at = self.pos;
        let count = self.u64(&|| format!("{} count", field()))?;
        let limit = self.remaining() / min;
        if count > limit {
            return Err(GgufError::TooLarge {
                file: self.file.to_string(),
                offset: count_at,
                field: format!("{} count", field()),
                value: count,
                limit,
                why:
                    "array count times the smallest element size exceeds the bytes left in the file",
            });
        }
        // count <= remaining bytes, so it fits a usize and `count * size` cannot overflow.
        let hint = count.min(MAX_CAPACITY_HINT) as usize;
        Ok(match ty {
            vt::U8 => read_vec!(self, U8, u8, count, field),
            vt::I8 => read_vec!(self, I8, i8, count, field),
            vt::U16 => read_vec!(self, U16, u16, count, field),
            vt::I16 => read_vec!(self, I16, i16, count, field),
            vt::U32 => read_vec!(self, U32, u32, count, field),
            vt::I32 => read_vec!(self, I32, i32, count, field),
            vt::F32 => read_vec!(self, F32, f32, count, field),
            vt::U64 => read_vec!(self, U64, u64, count, field),
            vt::I64 => read_vec!(self, I64, i64, count, field),
            vt::F64 => read_vec!(self, F64, f64, count, field),
            vt::BOOL => {
                let start = self.pos;
                let raw = self.take(count, field)?;
                if let Some(i) = raw.iter().position(|b| *b > 1) {
                    return Err(GgufError::BadBool {
                        file: self.file.to_string(),
                        offset: start + i as u64,
                        field: format!("{}[{i}]", field()),
                        value: raw[i],
                    });
                }
                GgufArray::Bool(raw.iter().map(|b| *b == 1).collect())
            }
            vt::STRING => {
                let mut v = Vec::with_capacity(hint);
                for j in 0..count {
                    v.push(self.string(CAPS.max_string_len, &|| format!("{}[{j}]", field()))?);
                }
                GgufArray::Strings(v)
            }
            _ => {
                // vt::ARRAY: min_value_bytes accepted nothing else.
                let mut v = Vec::with_capacity(hint.min(1024));
                for j in 0..count {
                    v.push(self.array(depth + 1, &|| format!("{}[{j}]", field()))?);
                }
                GgufArray::Arrays(v)
            }
        })
    }
}

/// One parsed file, with the byte offsets later checks (splits, duplicates) need.
struct Parsed {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    /// Byte offset of each metadata key and of its value.
    kv_offsets: Vec<(u64, u64)>,
    tensors: Vec<GgufTensorInfo>,
    /// Byte offset of each tensor info record.
    tensor_offsets: Vec<u64>,
    alignment: u64,
    data_offset: u64,
    file_size: u64,
}

impl Parsed {
    fn find(&self, key: &str) -> Option<(usize, &GgufValue)> {
        self.metadata
            .iter()
            .position(|(k, _)| k == key)
            .map(|i| (i, &self.metadata[i].1))
    }

    /// An integer key, with the byte offset of its value; an error for other types.
    fn int_key(&self, key: &str, file: &str) -> Result<Option<(u64, u64)>, GgufError> {
        let Some((i, v)) = self.find(key) else {
            return Ok(None);
        };
        let at = self.kv_offsets[i].1;
        match v.as_u64() {
            Some(n) => Ok(Some((n, at))),
            None => Err(GgufError::WrongType {
                file: file.to_string(),
                offset: at,
                field: format!("metadata key '{key}'"),
                expected: "a non-negative integer",
                found: v.type_name(),
            }),
        }
    }

    fn part(&self, path: &str) -> GgufPart {
        GgufPart {
            path: path.to_string(),
            version: self.version,
            alignment: self.alignment,
            data_offset: self.data_offset,
            file_size: self.file_size,
            n_tensors: self.tensors.len() as u64,
        }
    }
}

/// Sorted positions of duplicate names: `(earlier index, later index)` of the first clash in
/// file order, if any.
fn first_duplicate<'s>(names: impl Iterator<Item = &'s str>) -> Option<(usize, usize)> {
    let mut idx: Vec<(&str, usize)> = names.enumerate().map(|(i, n)| (n, i)).collect();
    idx.sort_unstable();
    idx.windows(2)
        .filter(|w| w[0].0 == w[1].0)
        .map(|w| (w[0].1, w[1].1))
        .min_by_key(|p| p.1)
}

/// Parse one GGUF file held in memory.
fn parse_part(bytes: &[u8], file: &str, part: u32) -> Result<Parsed, GgufError> {
    let mut r = Reader {
        b: bytes,
        pos: 0,
        file,
    };
    let err_file = || file.to_string();

    let magic = r.take(4, &|| "magic".into())?;
    if magic != b"GGUF" {
        let mut found = [0u8; 4];
        found.copy_from_slice(magic);
        return Err(GgufError::BadMagic {
            file: err_file(),
            offset: 0,
            field: "magic".into(),
            found,
        });
    }
    let version = r.u32(&|| "version".into())?;
    let bad_version = |why| GgufError::UnsupportedVersion {
        file: err_file(),
        offset: 4,
        field: "version".into(),
        version,
        why,
    };
    match version {
        2 | 3 => {}
        1 => return Err(bad_version(
            "GGUF v1 (32-bit counts) is obsolete; re-convert the model with a current llama.cpp",
        )),
        v if v & 0xFFFF == 0 && matches!(v.swap_bytes(), 2 | 3) => {
            return Err(bad_version(
                "this is a big-endian GGUF file; only little-endian files are read",
            ))
        }
        _ => return Err(bad_version("this reader knows GGUF v2 and v3")),
    }
    let n_tensors = r.u64(&|| "tensor count".into())?;
    let n_kv_at = r.pos;
    let n_kv = r.u64(&|| "metadata count".into())?;

    // Every record takes at least a fixed number of bytes: bound both counts by what is left.
    let kv_limit = r.remaining() / MIN_KV_BYTES;
    if n_kv > kv_limit {
        return Err(GgufError::TooLarge {
            file: err_file(),
            offset: n_kv_at,
            field: "metadata count".into(),
            value: n_kv,
            limit: kv_limit,
            why: "each key/value takes at least 13 bytes and the file is not that long",
        });
    }
    let tensor_limit = (r.remaining() - n_kv * MIN_KV_BYTES) / MIN_TENSOR_BYTES;
    if n_tensors > tensor_limit {
        return Err(GgufError::TooLarge {
            file: err_file(),
            offset: 8,
            field: "tensor count".into(),
            value: n_tensors,
            limit: tensor_limit,
            why: "each tensor info takes at least 32 bytes and the file is not that long",
        });
    }

    // Metadata.
    let hint = n_kv.min(MAX_CAPACITY_HINT) as usize;
    let mut metadata: Vec<(String, GgufValue)> = Vec::with_capacity(hint);
    let mut kv_offsets = Vec::with_capacity(hint);
    for i in 0..n_kv {
        let key_at = r.pos;
        let key = r.string(CAPS.max_name_len, &|| format!("metadata[{i}] key"))?;
        if key.is_empty() {
            return Err(GgufError::BadTensor {
                file: err_file(),
                offset: key_at,
                field: format!("metadata[{i}] key"),
                problem: "empty key".into(),
            });
        }
        let field = || format!("metadata[{i}] '{key}'");
        let ty_at = r.pos;
        let ty = r.u32(&|| format!("{} type", field()))?;
        let value_at = r.pos;
        let value = r.value(ty, ty_at, 0, &field)?;
        kv_offsets.push((key_at, value_at));
        metadata.push((key, value));
    }
    if let Some((a, b)) = first_duplicate(metadata.iter().map(|(k, _)| k.as_str())) {
        return Err(GgufError::Duplicate {
            file: err_file(),
            offset: kv_offsets[b].0,
            field: format!("metadata[{b}] key '{}'", metadata[b].0),
            first_offset: kv_offsets[a].0,
        });
    }

    // Alignment.
    let mut alignment = DEFAULT_ALIGNMENT;
    if let Some((i, v)) = metadata
        .iter()
        .enumerate()
        .find(|(_, (k, _))| k == "general.alignment")
    {
        let at = kv_offsets[i].1;
        let field = || "metadata key 'general.alignment'".to_string();
        let Some(a) = v.1.as_u64() else {
            return Err(GgufError::WrongType {
                file: err_file(),
                offset: at,
                field: field(),
                expected: "an unsigned integer",
                found: v.1.type_name(),
            });
        };
        if a == 0 || !a.is_power_of_two() || a > CAPS.max_alignment {
            return Err(GgufError::BadAlignment {
                file: err_file(),
                offset: at,
                field: field(),
                value: a,
                max: CAPS.max_alignment,
            });
        }
        alignment = a;
    }

    // Tensor infos.
    let hint = n_tensors.min(MAX_CAPACITY_HINT) as usize;
    let mut tensors: Vec<GgufTensorInfo> = Vec::with_capacity(hint);
    let mut tensor_offsets = Vec::with_capacity(hint);
    for i in 0..n_tensors {
        let rec_at = r.pos;
        let name = r.string(CAPS.max_name_len, &|| format!("tensor[{i}] name"))?;
        let field = |what: &str| format!("tensor[{i}] '{name}' {what}");
        let bad = |offset, what: &str, problem: String| GgufError::BadTensor {
            file: err_file(),
            offset,
            field: field(what),
            problem,
        };
        if name.is_empty() {
            return Err(bad(rec_at, "name", "empty tensor name".into()));
        }
        let nd_at = r.pos;
        let n_dims = r.u32(&|| field("n_dims"))?;
        if n_dims == 0 || n_dims > CAPS.max_dims {
            return Err(bad(
                nd_at,
                "n_dims",
                format!("{n_dims} dimensions, must be 1..={}", CAPS.max_dims),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut elems: u64 = 1;
        for j in 0..n_dims {
            let d_at = r.pos;
            let d = r.u64(&|| field(&format!("dims[{j}]")))?;
            if d == 0 {
                return Err(bad(
                    d_at,
                    &format!("dims[{j}]"),
                    "dimension is 0; a tensor must hold at least one element".into(),
                ));
            }
            elems = match elems.checked_mul(d) {
                Some(e) if e <= CAPS.max_elements => e,
                other => {
                    return Err(GgufError::TooLarge {
                        file: err_file(),
                        offset: d_at,
                        field: field(&format!("dims[{j}]")),
                        value: other.unwrap_or(u64::MAX),
                        limit: CAPS.max_elements,
                        why: "element count cap (2^50)",
                    })
                }
            };
            dims.push(d);
        }
        let ty_at = r.pos;
        let type_id = r.u32(&|| field("type"))?;
        let Some(ggml_type) = GgmlType::from_id(type_id) else {
            return Err(GgufError::BadGgmlType {
                file: err_file(),
                offset: ty_at,
                field: field("type"),
                type_id,
            });
        };
        if dims[0] % ggml_type.block_elems() != 0 {
            return Err(bad(
                nd_at + 4,
                "dims[0]",
                format!(
                    "row of {} elements is not a whole number of {ggml_type} blocks ({} elements each)",
                    dims[0],
                    ggml_type.block_elems()
                ),
            ));
        }
        let Some(bytes) = ggml_type.tensor_bytes(&dims) else {
            return Err(GgufError::TooLarge {
                file: err_file(),
                offset: nd_at,
                field: field("size"),
                value: elems,
                limit: CAPS.max_elements,
                why: "element count times type size overflows u64",
            });
        };
        let off_at = r.pos;
        let offset = r.u64(&|| field("offset"))?;
        if offset % alignment != 0 {
            return Err(bad(
                off_at,
                "offset",
                format!("data offset {offset} is not a multiple of the alignment {alignment}"),
            ));
        }
        tensor_offsets.push(rec_at);
        tensors.push(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            bytes,
            part,
        });
    }
    if let Some((a, b)) = first_duplicate(tensors.iter().map(|t| t.name.as_str())) {
        return Err(GgufError::Duplicate {
            file: err_file(),
            offset: tensor_offsets[b],
            field: format!("tensor[{b}] name '{}'", tensors[b].name),
            first_offset: tensor_offsets[a],
        });
    }

    // Data section: starts at the next multiple of the alignment after the header.
    let file_size = r.len();
    let header_end = r.pos;
    let data_offset = header_end
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| GgufError::TooLarge {
            file: err_file(),
            offset: header_end,
            field: "data section offset".into(),
            value: header_end,
            limit: u64::MAX - alignment,
            why: "header end rounded up to the alignment overflows u64",
        })?;
    let section = file_size.saturating_sub(data_offset);
    let mut total: u64 = 0;
    for (i, t) in tensors.iter().enumerate() {
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.bytes));
        if end.is_none_or(|e| e > file_size) {
            return Err(GgufError::BadTensor {
                file: err_file(),
                offset: tensor_offsets[i],
                field: format!("tensor[{i}] '{}' offset", t.name),
                problem: format!(
                    "data [{data_offset} + {}, + {} bytes) runs past the end of the file ({file_size} bytes); the file is truncated or corrupt",
                    t.offset, t.bytes
                ),
            });
        }
        total = match total.checked_add(t.bytes) {
            Some(s) if s <= section => s,
            other => {
                return Err(GgufError::TooLarge {
                    file: err_file(),
                    offset: tensor_offsets[i],
                    field: format!("sum of tensor sizes up to tensor[{i}] '{}'", t.name),
                    value: other.unwrap_or(u64::MAX),
                    limit: section,
                    why: "tensors need more bytes than the data section holds",
                })
            }
        };
    }
    let mut by_offset: Vec<usize> = (0..tensors.len()).collect();
    by_offset.sort_unstable_by_key(|&i| (tensors[i].offset, i));
    for w in by_offset.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        // a.offset + a.bytes <= file size was checked above.
        if a.offset + a.bytes > b.offset {
            return Err(GgufError::BadTensor {
                file: err_file(),
                offset: tensor_offsets[w[1]],
                field: format!("tensor[{}] '{}' offset", w[1], b.name),
                problem: format!(
                    "data at {} overlaps tensor '{}' at [{}, {})",
                    b.offset,
                    a.name,
                    a.offset,
                    a.offset + a.bytes
                ),
            });
        }
    }

    Ok(Parsed {
        version,
        metadata,
        kv_offsets,
        tensors,
        tensor_offsets,
        alignment,
        data_offset,
        file_size,
    })
}

fn into_file(p: Parsed, origin: &str) -> GgufFile {
    let part = p.part(origin);
    GgufFile {
        path: origin.to_string(),
        version: p.version,
        metadata: p.metadata,
        tensors: p.tensors,
        alignment: p.alignment,
        data_offset: p.data_offset,
        file_size: p.file_size,
        parts: vec![part],
    }
}

/// Parse a single GGUF file held in memory (`origin` names it in errors). Pure: split models
/// are not followed (the `split.*` keys are kept as metadata); use [`read_gguf`] for those.
pub fn parse_gguf_bytes(bytes: &[u8], origin: &str) -> Result<GgufFile, GgufError> {
    parse_part(bytes, origin, 0).map(|p| into_file(p, origin))
}

/// Map a file and parse its header.
fn read_part(path: &Path, part: u32) -> Result<Parsed, GgufError> {
    let file = path.display().to_string();
    let io = |field: &str, source| GgufError::Io {
        file: file.clone(),
        offset: 0,
        field: field.into(),
        source,
    };
    let f = crate::files::open_regular(path, "GGUF file").map_err(|e| match e {
        crate::files::FileError::Io { source, .. } => io("open", source),
        other => io("open", std::io::Error::other(other.to_string())),
    })?;
    let len = f.metadata().map_err(|e| io("metadata", e))?.len();
    if len == 0 {
        // mmap of an empty file fails on some platforms; the parser reports the truncation.
        return parse_part(&[], &file, part);
    }
    // SAFETY: the map is read-only and private to this call. Another process could still
    // change or truncate the file while it is mapped; the parser treats the bytes as hostile
    // anyway, copies everything it keeps into owned values and drops the map before
    // returning, so no reference into the mapping outlives this function. (A truncation
    // underneath can raise SIGBUS; that is the accepted cost of not reading multi-GB files.)
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| io("mmap", e))?;
    parse_part(&map, &file, part)
}

/// `(prefix, index, total)` of a `PREFIX-00001-of-00003.gguf` file name (1-based index).
fn split_name(path: &Path) -> Option<(String, u64, u64)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (head, total) = stem.rsplit_once("-of-")?;
    let (prefix, index) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit());
    if prefix.is_empty() || !digits(index) || !digits(total) {
        return None;
    }
    Some((prefix.to_string(), index.parse().ok()?, total.parse().ok()?))
}

/// Read a GGUF file's header through a memory map. When the file is the first part of a split
/// model (`PREFIX-00001-of-0000N.gguf` or `split.count` > 1) every part is read from the same
/// folder and merged: metadata from the first part, tensors from all parts in order, each
/// tensor recording its part.
pub fn read_gguf(path: &Path) -> Result<GgufFile, GgufError> {
    let file = path.display().to_string();
    let first = read_part(path, 0)?;
    let split_err = |offset, field: &str, problem: String| GgufError::Split {
        file: file.clone(),
        offset,
        field: field.into(),
        problem,
    };
    let count_key = first.int_key("split.count", &file)?;
    let no_key = first.int_key("split.no", &file)?;
    let name = split_name(path);

    let count = match (count_key, &name) {
        (Some((c, at)), _) => {
            if c == 0 || c > CAPS.max_split_count {
                return Err(split_err(at, "split.count", format!("{c} parts; must be 1..={}", CAPS.max_split_count)));
            }
            c
        }
        (None, Some((_, _, total))) if *total > 1 => {
            return Err(split_err(
                0,
                "split.count",
                format!("the file name says this is one of {total} parts but the file has no split.count key; give the first part of a split made by gguf-split"),
            ))
        }
        _ => 1,
    };
    if let Some((no, at)) = no_key {
        if no != 0 {
            return Err(split_err(
                at,
                "split.no",
                format!(
                    "this is part {} of {count}; give the first part (split.no = 0)",
                    no + 1
                ),
            ));
        }
    }
    if count == 1 {
        return Ok(into_file(first, &file));
    }
    let Some((prefix, index, total)) = name else {
        return Err(split_err(
            count_key.map_or(0, |c| c.1),
            "split.count",
            format!("the model is split into {count} parts but the file name does not follow PREFIX-00001-of-{count:05}.gguf, so the other parts cannot be found; rename the parts as gguf-split wrote them"),
        ));
    };
    if index != 1 || total != count {
        return Err(split_err(
            count_key.map_or(0, |c| c.1),
            "split.count",
            format!(
                "the file name says part {index} of {total} but the file says part 1 of {count}"
            ),
        ));
    }
    if no_key.is_none() {
        return Err(split_err(
            0,
            "split.no",
            "missing in a split model's first part".into(),
        ));
    }

    let tensors_count_key = first.int_key("split.tensors.count", &file)?;
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut parts = vec![first.part(&file)];
    let mut tensor_offsets: Vec<(u32, u64)> =
        first.tensor_offsets.iter().map(|o| (0, *o)).collect();
    let mut tensors = first.tensors;
    for i in 1..count {
        let p_path = dir.join(format!("{prefix}-{:05}-of-{count:05}.gguf", i + 1));
        let p_file = p_path.display().to_string();
        if !p_path.is_file() {
            return Err(GgufError::Split {
                file: p_file,
                offset: 0,
                field: "split part".into(),
                problem: format!("part {} of {count} is missing (the first part is {file}); download every part into the same folder", i + 1),
            });
        }
        let part_index = u32::try_from(i).unwrap_or(u32::MAX);
        let p = read_part(&p_path, part_index)?;
        let p_err = |offset, field: &str, problem: String| GgufError::Split {
            file: p_file.clone(),
            offset,
            field: field.into(),
            problem,
        };
        match p.int_key("split.no", &p_file)? {
            Some((no, _)) if no == i => {}
            Some((no, at)) => {
                return Err(p_err(
                    at,
                    "split.no",
                    format!("is {no}, expected {i} from the file name"),
                ))
            }
            None => return Err(p_err(0, "split.no", "missing in a split part".into())),
        }
        match p.int_key("split.count", &p_file)? {
            Some((c, _)) if c == count => {}
            Some((c, at)) => {
                return Err(p_err(
                    at,
                    "split.count",
                    format!("is {c}, but the first part says {count}"),
                ))
            }
            None => return Err(p_err(0, "split.count", "missing in a split part".into())),
        }
        parts.push(p.part(&p_file));
        tensor_offsets.extend(p.tensor_offsets.iter().map(|o| (part_index, *o)));
        tensors.extend(p.tensors);
    }
    if let Some((a, b)) = first_duplicate(tensors.iter().map(|t| t.name.as_str())) {
        let (pb, ob) = tensor_offsets[b];
        return Err(GgufError::Duplicate {
            file: parts[pb as usize].path.clone(),
            offset: ob,
            field: format!(
                "tensor '{}' (also in part {} at byte {})",
                tensors[b].name,
                tensor_offsets[a].0 + 1,
                tensor_offsets[a].1
            ),
            first_offset: tensor_offsets[a].1,
        });
    }
    if let Some((n, at)) = tensors_count_key {
        if n != tensors.len() as u64 {
            return Err(split_err(
                at,
                "split.tensors.count",
                format!("says {n} tensors but the parts hold {}", tensors.len()),
            ));
        }
    }
    Ok(GgufFile {
        path: file.clone(),
        version: first.version,
        metadata: first.metadata,
        tensors,
        alignment: first.alignment,
        data_offset: first.data_offset,
        file_size: first.file_size,
        parts,
    })
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{split_part, valid, B};
    use super::*;

    const F32: u32 = 0;

    fn parse(b: &[u8]) -> Result<GgufFile, GgufError> {
        parse_gguf_bytes(b, "t.gguf")
    }

    fn err(b: &[u8]) -> GgufError {
        match parse(b) {
            Ok(f) => panic!("expected an error, parsed {f:?}"),
            Err(e) => e,
        }
    }

    /// A file with the given metadata entries (already encoded) and no tensors.
    fn with_kvs(n_kv: u64, kvs: B) -> Vec<u8> {
        B {
            buf: B::new().header(3, 0, n_kv).buf,
        }
        .bytes(&kvs.buf)
        .done()
    }

    /// A file with no metadata and the given tensor records (already encoded), then padding
    /// and `data` bytes of tensor data.
    fn with_tensors(n: u64, recs: B, data: usize) -> Vec<u8> {
        B::new()
            .header(3, n, 0)
            .bytes(&recs.buf)
            .pad(32)
            .data(data)
            .done()
    }

    #[test]
    fn valid_v2_and_v3_files_parse() {
        for version in [2, 3] {
            let bytes = valid(version);
            let f = parse(&bytes).unwrap();
            assert_eq!(f.version, version);
            assert_eq!(f.alignment, 32);
            assert_eq!(f.data_offset % 32, 0);
            assert_eq!(f.file_size, bytes.len() as u64);
            assert_eq!(f.data_offset + 64, f.file_size);
            assert_eq!(f.metadata.len(), 4);
            assert_eq!(f.metadata[0].0, "general.architecture", "file order kept");
            assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
            assert_eq!(f.get_u64("llama.block_count").unwrap(), Some(2));
            assert_eq!(f.get_f64("llama.block_count").unwrap(), Some(2.0));
            assert_eq!(f.get_bool("general.flag").unwrap(), Some(true));
            assert_eq!(
                f.get_array("tokenizer.ggml.tokens").unwrap(),
                Some(&GgufArray::Strings(vec![
                    "a".into(),
                    "bb".into(),
                    "".into()
                ]))
            );
            assert_eq!(f.get_u64("absent").unwrap(), None);
            assert_eq!(f.tensors.len(), 2);
            let t = f.tensor("tok_embd.weight").unwrap();
            assert_eq!(
                (t.dims.clone(), t.ggml_type, t.offset, t.bytes, t.part),
                (vec![4, 2], GgmlType::F32, 0, 32, 0)
            );
            assert_eq!(t.n_elements(), 8);
            assert_eq!(
                f.tensor_file_offset(&f.tensors[1]),
                Some(f.data_offset + 32)
            );
            assert_eq!(f.parts.len(), 1);
            assert_eq!(f.parts[0].n_tensors, 2);
        }
    }

    #[test]
    fn typed_getters_refuse_wrong_types_naming_the_key() {
        let b = with_kvs(
            3,
            B::new()
                .kv_raw("neg", vt::I32, &(-5i32).to_le_bytes())
                .kv_raw("small", vt::I8, &[7])
                .kv_str("s", "x"),
        );
        let f = parse(&b).unwrap();
        assert_eq!(f.get_u64("small").unwrap(), Some(7));
        assert_eq!(f.get_f64("neg").unwrap(), Some(-5.0));
        let e = f.get_u64("neg").unwrap_err();
        assert!(matches!(e, GgufError::WrongType { .. }));
        assert!(
            e.to_string().contains("'neg'") && e.to_string().contains("t.gguf"),
            "{e}"
        );
        assert!(f.get_str("small").is_err());
        assert!(f.get_bool("s").is_err());
        assert!(f.get_array("s").is_err());
        assert!(f.get_f64("s").is_err());
    }

    #[test]
    fn every_scalar_type_and_nested_arrays_round_trip() {
        let kvs = B::new()
            .kv_raw("u8", vt::U8, &[200])
            .kv_raw("i8", vt::I8, &[0xFF])
            .kv_raw("u16", vt::U16, &500u16.to_le_bytes())
            .kv_raw("i16", vt::I16, &(-500i16).to_le_bytes())
            .kv_raw("f32", vt::F32, &1.5f32.to_le_bytes())
            .kv_raw("u64", vt::U64, &u64::MAX.to_le_bytes())
            .kv_raw("i64", vt::I64, &(-1i64).to_le_bytes())
            .kv_raw("f64", vt::F64, &2.25f64.to_le_bytes())
            // [[1u32, 2u32], ["x"], []: i64, [[true]]]
            .str("nested")
            .u32(vt::ARRAY)
            .u32(vt::ARRAY)
            .u64(4)
            .u32(vt::U32)
            .u64(2)
            .u32(1)
            .u32(2)
            .u32(vt::STRING)
            .u64(1)
            .str("x")
            .u32(vt::I64)
            .u64(0)
            .u32(vt::ARRAY)
            .u64(1)
            .u32(vt::BOOL)
            .u64(1)
            .u8(1);
        let f = parse(&with_kvs(9, kvs)).unwrap();
        assert_eq!(f.get("u8"), Some(&GgufValue::U8(200)));
        assert_eq!(f.get("i8"), Some(&GgufValue::I8(-1)));
        assert_eq!(f.get("u16"), Some(&GgufValue::U16(500)));
        assert_eq!(f.get("i16"), Some(&GgufValue::I16(-500)));
        assert_eq!(f.get("f32"), Some(&GgufValue::F32(1.5)));
        assert_eq!(f.get_u64("u64").unwrap(), Some(u64::MAX));
        assert_eq!(f.get("i64"), Some(&GgufValue::I64(-1)));
        assert_eq!(f.get_f64("f64").unwrap(), Some(2.25));
        let want = GgufArray::Arrays(vec![
            GgufArray::U32(vec![1, 2]),
            GgufArray::Strings(vec!["x".into()]),
            GgufArray::I64(vec![]),
            GgufArray::Arrays(vec![GgufArray::Bool(vec![true])]),
        ]);
        let got = f.get_array("nested").unwrap().unwrap();
        assert_eq!(got, &want);
        assert_eq!(got.len(), 4);
        assert_eq!(got.elem_type_id(), vt::ARRAY);
        assert_eq!(GgufArray::U32(vec![1, 2]).to_u64_vec(), Some(vec![1, 2]));
        assert_eq!(GgufArray::I32(vec![1, -2]).to_u64_vec(), None);
    }

    #[test]
    fn nesting_deeper_than_the_cap_is_refused() {
        let mut kvs = B::new().str("deep").u32(vt::ARRAY);
        for _ in 0..CAPS.max_array_depth {
            kvs = kvs.u32(vt::ARRAY).u64(1);
        }
        kvs = kvs.u32(vt::U8).u64(0);
        // Every level up to the cap is fine: check the cap itself with one fewer level.
        let mut ok = B::new().str("deep").u32(vt::ARRAY);
        for _ in 0..CAPS.max_array_depth - 1 {
            ok = ok.u32(vt::ARRAY).u64(1);
        }
        ok = ok.u32(vt::U8).u64(0);
        assert!(parse(&with_kvs(1, ok)).is_ok());
        let e = err(&with_kvs(1, kvs));
        assert!(
            matches!(
                e,
                GgufError::TooLarge {
                    why: "array nesting depth cap",
                    ..
                }
            ),
            "{e}"
        );
    }

    // ---- one hand-made file per hostile class ----

    #[test]
    fn hostile_unchecked_string_length() {
        // A key claiming u64::MAX bytes, a value claiming more than the cap, and one that
        // is under the cap but past the end of the file.
        let e = err(&B::new()
            .header(3, 0, 1)
            .u64(u64::MAX)
            .bytes(&[0; 16])
            .done());
        assert!(matches!(e, GgufError::TooLarge { offset: 24, .. }), "{e}");
        let e = err(&with_kvs(
            1,
            B::new()
                .str("k")
                .u32(vt::STRING)
                .u64(CAPS.max_string_len + 1)
                .bytes(&[0; 8]),
        ));
        assert!(
            matches!(
                e,
                GgufError::TooLarge {
                    why: "string length cap",
                    ..
                }
            ),
            "{e}"
        );
        let e = err(&with_kvs(
            1,
            B::new().str("k").u32(vt::STRING).u64(1000).bytes(b"short"),
        ));
        assert!(
            matches!(
                e,
                GgufError::Truncated {
                    need: 1000,
                    have: 5,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.field().contains("'k'"), "{}", e.field());
    }

    #[test]
    fn hostile_unchecked_array_count() {
        let e = err(&with_kvs(
            1,
            B::new()
                .str("a")
                .u32(vt::ARRAY)
                .u32(vt::U32)
                .u64(u64::MAX)
                .bytes(&[0; 16]),
        ));
        match e {
            GgufError::TooLarge {
                offset,
                value,
                limit,
                ..
            } => {
                assert_eq!(offset, 24 + 9 + 4 + 4);
                assert_eq!(value, u64::MAX);
                assert_eq!(limit, 4);
            }
            e => panic!("{e}"),
        }
        // Strings: each takes at least 8 bytes, so 3 strings cannot fit in 16 bytes.
        let e = err(&with_kvs(
            1,
            B::new()
                .str("a")
                .u32(vt::ARRAY)
                .u32(vt::STRING)
                .u64(3)
                .bytes(&[0; 16]),
        ));
        assert!(matches!(e, GgufError::TooLarge { limit: 2, .. }), "{e}");
        // Nested arrays: each inner array takes at least 12 bytes.
        let e = err(&with_kvs(
            1,
            B::new()
                .str("a")
                .u32(vt::ARRAY)
                .u32(vt::ARRAY)
                .u64(1 << 40)
                .bytes(&[0; 24]),
        ));
        assert!(matches!(e, GgufError::TooLarge { limit: 2, .. }), "{e}");
    }

    #[test]
    fn hostile_tensor_and_kv_counts() {
        let e = err(&B::new().header(3, u64::MAX, 0).bytes(&[0; 64]).done());
        assert!(
            matches!(
                e,
                GgufError::TooLarge {
                    offset: 8,
                    limit: 2,
                    ..
                }
            ),
            "{e}"
        );
        let e = err(&B::new().header(3, 0, u64::MAX).bytes(&[0; 64]).done());
        assert!(
            matches!(
                e,
                GgufError::TooLarge {
                    offset: 16,
                    limit: 4,
                    ..
                }
            ),
            "{e}"
        );
        // Together: 4 kv x 13 + 1 tensor x 32 > 64.
        let e = err(&B::new().header(3, 1, 4).bytes(&[0; 64]).done());
        assert!(
            matches!(
                e,
                GgufError::TooLarge {
                    offset: 8,
                    limit: 0,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn hostile_n_dims() {
        let e = err(&with_tensors(
            1,
            B::new().tensor("t", &[1, 1, 1, 1, 1], F32, 0),
            32,
        ));
        assert!(
            matches!(&e, GgufError::BadTensor { field, .. } if field.contains("n_dims")),
            "{e}"
        );
        let e = err(&with_tensors(
            1,
            B::new().str("t").u32(u32::MAX).bytes(&[0; 64]),
            0,
        ));
        assert!(matches!(&e, GgufError::BadTensor { offset: 33, .. }), "{e}");
        let e = err(&with_tensors(1, B::new().tensor("t", &[], F32, 0), 32));
        assert!(
            matches!(&e, GgufError::BadTensor { field, .. } if field.contains("n_dims")),
            "{e}"
        );
        // Four dims is the most ggml has and is fine.
        assert!(parse(&with_tensors(
            1,
            B::new().tensor("t", &[1, 2, 1, 2], F32, 0),
            32
        ))
        .is_ok());
    }

    #[test]
    fn hostile_zero_dimension() {
        let e = err(&with_tensors(1, B::new().tensor("t", &[8, 0], F32, 0), 32));
        assert!(
            matches!(&e, GgufError::BadTensor { field, .. } if field.contains("dims[1]")),
            "{e}"
        );
    }

    #[test]
    fn hostile_element_count_times_type_size_overflow() {
        // 2^32 x 2^32 elements overflows u64; 2^40 x 2^20 is past the 2^50 cap; both would
        // wrap a naive `elements * 4`.
        for dims in [
            &[1u64 << 32, 1 << 32][..],
            &[1 << 40, 1 << 20],
            &[u64::MAX],
            &[1 << 63, 2, 2, 2],
        ] {
            let e = err(&with_tensors(1, B::new().tensor("t", dims, F32, 0), 32));
            assert!(
                matches!(
                    e,
                    GgufError::TooLarge {
                        why: "element count cap (2^50)",
                        ..
                    }
                ),
                "{dims:?}: {e}"
            );
        }
        // At the cap with the largest type: no overflow, just far past the end of the file.
        let e = err(&with_tensors(
            1,
            B::new().tensor("t", &[1 << 25, 1 << 25], 28, 0),
            32,
        ));
        assert!(
            matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("past the end")),
            "{e}"
        );
    }

    #[test]
    fn hostile_summed_tensor_sizes() {
        // Each tensor fits in the 64-byte data section alone; together they need 96 bytes.
        let recs = B::new()
            .tensor("a", &[8], F32, 0)
            .tensor("b", &[16], F32, 0);
        let e = err(&with_tensors(2, recs, 64));
        assert!(
            matches!(&e, GgufError::TooLarge { value: 96, limit: 64, field, .. } if field.contains("sum")),
            "{e}"
        );
    }

    #[test]
    fn hostile_alignment() {
        let file = |v: u32| {
            B::new()
                .header(3, 1, 1)
                .kv_u32("general.alignment", v)
                .tensor("t", &[8], F32, 0)
                .pad(64)
                .data(64)
                .done()
        };
        for bad in [0, 3, 48, 1 << 21, u32::MAX] {
            let e = err(&file(bad));
            assert!(
                matches!(e, GgufError::BadAlignment { offset, .. } if offset == 24 + 8 + 17 + 4),
                "{bad}: {e}"
            );
        }
        let f = parse(&file(64)).unwrap();
        assert_eq!(f.alignment, 64);
        assert_eq!(f.data_offset, 128);
        let e = err(&with_kvs(1, B::new().kv_str("general.alignment", "32")));
        assert!(matches!(e, GgufError::WrongType { .. }), "{e}");
    }

    #[test]
    fn hostile_offsets_past_end_of_file() {
        let e = err(&with_tensors(
            1,
            B::new().tensor("t", &[8], F32, 1 << 40),
            32,
        ));
        assert!(
            matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("past the end")),
            "{e}"
        );
        // data_offset + offset overflows u64.
        let e = err(&with_tensors(
            1,
            B::new().tensor("t", &[8], F32, u64::MAX - 31),
            32,
        ));
        assert!(
            matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("past the end")),
            "{e}"
        );
        // One byte short.
        let e = err(&with_tensors(1, B::new().tensor("t", &[8], F32, 0), 31));
        assert!(matches!(&e, GgufError::BadTensor { .. }), "{e}");
    }

    #[test]
    fn hostile_misaligned_offset() {
        let e = err(&with_tensors(1, B::new().tensor("t", &[4], F32, 16), 64));
        assert!(
            matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("multiple")),
            "{e}"
        );
    }

    #[test]
    fn hostile_overlapping_tensors() {
        let recs = B::new()
            .tensor("a", &[8], F32, 32)
            .tensor("b", &[16], F32, 0);
        let e = err(&with_tensors(2, recs, 96));
        match &e {
            GgufError::BadTensor {
                field,
                problem,
                offset,
                ..
            } => {
                assert!(field.contains("'a'"), "{field}");
                assert!(problem.contains("overlaps tensor 'b'"), "{problem}");
                assert_eq!(*offset, 24);
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn hostile_duplicate_keys_and_tensor_names() {
        let e = err(&with_kvs(
            3,
            B::new().kv_u32("a", 1).kv_u32("b", 2).kv_u32("a", 3),
        ));
        match &e {
            GgufError::Duplicate {
                offset,
                first_offset,
                field,
                ..
            } => {
                assert_eq!(*first_offset, 24);
                assert_eq!(*offset, 24 + 2 * 17);
                assert!(field.contains("'a'"));
            }
            e => panic!("{e}"),
        }
        let recs = B::new()
            .tensor("w", &[8], F32, 0)
            .tensor("w", &[8], F32, 32);
        let e = err(&with_tensors(2, recs, 64));
        assert!(
            matches!(
                &e,
                GgufError::Duplicate {
                    first_offset: 24,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn hostile_type_ids() {
        let e = err(&with_kvs(1, B::new().str("k").u32(13).u32(0)));
        assert!(
            matches!(
                e,
                GgufError::BadValueType {
                    type_id: 13,
                    offset: 33,
                    ..
                }
            ),
            "{e}"
        );
        let e = err(&with_kvs(
            1,
            B::new().str("k").u32(vt::ARRAY).u32(99).u64(0),
        ));
        assert!(
            matches!(e, GgufError::BadValueType { type_id: 99, .. }),
            "{e}"
        );
        for id in [4, 31, u32::MAX] {
            let e = err(&with_tensors(1, B::new().tensor("t", &[256], id, 0), 1024));
            assert!(
                matches!(e, GgufError::BadGgmlType { type_id, offset, .. } if type_id == id && offset == 24 + 9 + 4 + 8),
                "{e}"
            );
        }
        // A known block type whose row is not a whole number of blocks.
        let e = err(&with_tensors(
            1,
            B::new().tensor("t", &[100], GgmlType::Q4K.id(), 0),
            1024,
        ));
        assert!(
            matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("Q4_K")),
            "{e}"
        );
        let f = parse(&with_tensors(
            1,
            B::new().tensor("t", &[256, 2], GgmlType::Q4K.id(), 0),
            288,
        ))
        .unwrap();
        assert_eq!(f.tensors[0].bytes, 288);
    }

    #[test]
    fn hostile_invalid_utf8() {
        let e = err(&with_kvs(1, B::new().raw_str(b"ke\xffy").u32(vt::U8).u8(0)));
        assert!(
            matches!(
                e,
                GgufError::InvalidUtf8 {
                    offset: 24,
                    bad_at: 34,
                    ..
                }
            ),
            "{e}"
        );
        let e = err(&with_kvs(
            1,
            B::new().str("k").u32(vt::STRING).raw_str(b"\xc3\x28"),
        ));
        assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e}");
        let e = err(&with_kvs(
            1,
            B::new()
                .str("k")
                .u32(vt::ARRAY)
                .u32(vt::STRING)
                .u64(2)
                .str("ok")
                .raw_str(b"\x80"),
        ));
        assert!(
            matches!(&e, GgufError::InvalidUtf8 { field, .. } if field.ends_with("[1]")),
            "{e}"
        );
        let e = err(&with_tensors(
            1,
            B::new().raw_str(b"\xfe").u32(1).u64(8).u32(F32).u64(0),
            32,
        ));
        assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e}");
    }

    #[test]
    fn hostile_bool_bytes() {
        let e = err(&with_kvs(1, B::new().kv_bool("b", 2)));
        assert!(
            matches!(
                e,
                GgufError::BadBool {
                    value: 2,
                    offset: 37,
                    ..
                }
            ),
            "{e}"
        );
        let e = err(&with_kvs(
            1,
            B::new()
                .str("b")
                .u32(vt::ARRAY)
                .u32(vt::BOOL)
                .u64(3)
                .bytes(&[1, 0, 0xff]),
        ));
        assert!(
            matches!(&e, GgufError::BadBool { value: 0xff, field, .. } if field.ends_with("[2]")),
            "{e}"
        );
    }

    #[test]
    fn hostile_truncated_files() {
        let full = valid(3);
        for cut in 0..full.len() {
            let e = err(&full[..cut]);
            if cut < 24 {
                assert!(matches!(e, GgufError::Truncated { .. }), "cut {cut}: {e}");
            }
        }
    }

    #[test]
    fn hostile_magic_and_versions() {
        let mut b = valid(3);
        b[0] = b'X';
        assert!(matches!(err(&b), GgufError::BadMagic { offset: 0, .. }));
        for (v, why) in [
            (1u32, "obsolete"),
            (0x0300_0000, "big-endian"),
            (4, "v2 and v3"),
            (0, "v2 and v3"),
        ] {
            let e = err(&valid(v));
            assert!(
                matches!(&e, GgufError::UnsupportedVersion { version, .. } if *version == v),
                "{e}"
            );
            assert!(e.to_string().contains(why), "{e}");
        }
    }

    #[test]
    fn messages_name_file_offset_and_field() {
        let e = err(&with_kvs(1, B::new().kv_bool("my.flag", 7)));
        let s = e.to_string();
        assert!(
            s.contains("t.gguf") && s.contains("byte 43") && s.contains("my.flag"),
            "{s}"
        );
        assert_eq!((e.file(), e.offset()), ("t.gguf", 43));
        assert!(e.field().contains("my.flag"));
    }

    #[test]
    fn empty_keys_and_names_are_refused() {
        assert!(parse(&with_kvs(1, B::new().kv_u32("", 1))).is_err());
        assert!(parse(&with_tensors(1, B::new().tensor("", &[8], F32, 0), 32)).is_err());
    }

    // ---- files on disk: mmap and split models ----

    #[test]
    fn read_gguf_maps_a_single_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, valid(3)).unwrap();
        let f = read_gguf(&p).unwrap();
        assert_eq!(
            f,
            parse_gguf_bytes(&valid(3), &p.display().to_string()).unwrap()
        );
        std::fs::write(&p, b"").unwrap();
        assert!(matches!(
            read_gguf(&p),
            Err(GgufError::Truncated { offset: 0, .. })
        ));
        let e = read_gguf(&dir.path().join("absent.gguf")).unwrap_err();
        assert!(
            matches!(e, GgufError::Io { .. }) && e.to_string().contains("absent.gguf"),
            "{e}"
        );
    }

    fn write_split(dir: &Path, count: u16) -> std::path::PathBuf {
        for i in 0..count {
            let name = format!("m-{:05}-of-{:05}.gguf", i + 1, count);
            let t = format!("t{i}");
            std::fs::write(dir.join(name), split_part(i, count, &t, i == 0)).unwrap();
        }
        dir.join(format!("m-00001-of-{count:05}.gguf"))
    }

    #[test]
    fn split_model_reads_as_one() {
        let dir = tempfile::tempdir().unwrap();
        let first = write_split(dir.path(), 3);
        let f = read_gguf(&first).unwrap();
        assert_eq!(f.parts.len(), 3);
        assert_eq!(
            f.tensors
                .iter()
                .map(|t| (t.name.as_str(), t.part))
                .collect::<Vec<_>>(),
            [("t0", 0), ("t1", 1), ("t2", 2)]
        );
        assert!(f.parts[2].path.ends_with("m-00003-of-00003.gguf"));
        assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
        assert_eq!(
            f.tensor_file_offset(&f.tensors[2]),
            Some(f.parts[2].data_offset)
        );
        assert_eq!(f.metadata.len(), 4, "metadata comes from the first part");
    }

    #[test]
    fn split_model_errors_name_the_part() {
        let dir = tempfile::tempdir().unwrap();
        let first = write_split(dir.path(), 3);
        // Giving the second part.
        let e = read_gguf(&dir.path().join("m-00002-of-00003.gguf")).unwrap_err();
        assert!(
            matches!(&e, GgufError::Split { field, .. } if field == "split.no"),
            "{e}"
        );
        // Missing part.
        std::fs::remove_file(dir.path().join("m-00002-of-00003.gguf")).unwrap();
        let e = read_gguf(&first).unwrap_err();
        assert!(
            matches!(&e, GgufError::Split { file, .. } if file.ends_with("m-00002-of-00003.gguf")),
            "{e}"
        );
        assert!(e.to_string().contains("part 2 of 3 is missing"), "{e}");
        // A part that says it is a different part.
        std::fs::write(
            dir.path().join("m-00002-of-00003.gguf"),
            split_part(2, 3, "t1", false),
        )
        .unwrap();
        let e = read_gguf(&first).unwrap_err();
        assert!(
            matches!(&e, GgufError::Split { field, .. } if field == "split.no"),
            "{e}"
        );
        // A tensor name repeated across parts.
        std::fs::write(
            dir.path().join("m-00002-of-00003.gguf"),
            split_part(1, 3, "t0", false),
        )
        .unwrap();
        let e = read_gguf(&first).unwrap_err();
        assert!(
            matches!(&e, GgufError::Duplicate { file, .. } if file.ends_with("m-00002-of-00003.gguf")),
            "{e}"
        );
        // split.count without the naming scheme.
        let renamed = dir.path().join("renamed.gguf");
        std::fs::copy(&first, &renamed).unwrap();
        let e = read_gguf(&renamed).unwrap_err();
        assert!(e.to_string().contains("PREFIX-00001-of-00003.gguf"), "{e}");
        // Split naming without split.count.
        let named = dir.path().join("x-00001-of-00002.gguf");
        std::fs::write(&named, valid(3)).unwrap();
        assert!(matches!(read_gguf(&named), Err(GgufError::Split { .. })));
        // A single-part "split" is just a file.
        let one = dir.path().join("y-00001-of-00001.gguf");
        std::fs::write(&one, split_part(0, 1, "w", true)).unwrap();
        assert_eq!(read_gguf(&one).unwrap().parts.len(), 1);
    }

    #[test]
    fn split_names_parse() {
        assert_eq!(
            split_name(Path::new("/a/Qwen3-Next-00001-of-00003.gguf")),
            Some(("Qwen3-Next".into(), 1, 3))
        );
        assert_eq!(split_name(Path::new("m-1-of-3.gguf")), None);
        assert_eq!(split_name(Path::new("m.gguf")), None);
        assert_eq!(split_name(Path::new("-00001-of-00003.gguf")), None);
    }

    // ---- mutation fuzzing (bounded; complements the cargo-fuzz targets in fuzz/) ----

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        #[test]
        fn mutated_valid_files_never_panic(
            version in 2u32..=3,
            flips in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 0..8),
            cut in proptest::option::of(0usize..4096),
        ) {
            let mut b = valid(version);
            for (i, v) in flips {
                let n = b.len();
                b[i % n] = v;
            }
            if let Some(c) = cut {
                b.truncate(c % (b.len() + 1));
            }
            // Must return (Ok or Err) without panicking; an Ok file must satisfy the invariants.
            if let Ok(f) = parse(&b) {
                for t in &f.tensors {
                    proptest::prop_assert!(f.data_offset + t.offset + t.bytes <= f.file_size);
                    proptest::prop_assert!((1..=4).contains(&t.dims.len()));
                    proptest::prop_assert_eq!(t.offset % f.alignment, 0);
                }
            }
        }
    }

    /// Writes the fuzz seed corpus when STRATA_GGUF_SEED_DIR is set (see FUZZING.md);
    /// otherwise only checks that every seed parses.
    #[test]
    fn seed_corpus() {
        let dir = tempfile::tempdir().unwrap();
        let split = write_split(dir.path(), 2);
        let seeds: Vec<(&str, Vec<u8>)> = vec![
            ("valid_v2", valid(2)),
            ("valid_v3", valid(3)),
            ("split_first", std::fs::read(&split).unwrap()),
            (
                "aligned_64_q4k",
                B::new()
                    .header(3, 1, 1)
                    .kv_u32("general.alignment", 64)
                    .tensor("t", &[256, 2], GgmlType::Q4K.id(), 0)
                    .pad(64)
                    .data(288)
                    .done(),
            ),
        ];
        for (name, bytes) in &seeds {
            assert!(parse(bytes).is_ok(), "{name}");
        }
        if let Some(out) = std::env::var_os("STRATA_GGUF_SEED_DIR") {
            let out = std::path::PathBuf::from(out);
            std::fs::create_dir_all(&out).unwrap();
            for (name, bytes) in &seeds {
                std::fs::write(out.join(name), bytes).unwrap();
            }
        }
    }
}
