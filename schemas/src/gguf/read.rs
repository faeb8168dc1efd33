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

/// Parse one GGUF file held in memory: header, metadata, alignment, tensor infos, data section.
fn parse_part(bytes: &[u8], file: &str, part: u32) -> Result<Parsed, GgufError> {
    let mut r = Reader {
        b: bytes,
        pos: 0,
        file,
    };
    let version = read_magic_and_version(&mut r)?;
    let (n_tensors, n_kv) = read_counts(&mut r)?;
    let (metadata, kv_offsets) = read_metadata(&mut r, n_kv)?;
    let alignment = find_alignment(file, &metadata, &kv_offsets)?;
    let (tensors, tensor_offsets) = read_tensor_infos(&mut r, n_tensors, alignment, part)?;
    let (data_offset, file_size) = check_data_section(&r, &tensors, &tensor_offsets, alignment)?;

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

/// Check the magic and return the version, refusing v1, big-endian files and unknown versions.
fn read_magic_and_version(r: &mut Reader) -> Result<u32, GgufError> {
    let file = r.file;
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
    Ok(version)
}

/// Read the tensor and metadata counts, each bounded by what the rest of the file can hold.
fn read_counts(r: &mut Reader) -> Result<(u64, u64), GgufError> {
    let file = r.file;
    let err_file = || file.to_string();
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

    Ok((n_tensors, n_kv))
}

/// Read `n_kv` key/value records; keys must be non-empty and unique. Returns the records and,
/// for each, the offsets of its key and its value.
#[allow(clippy::type_complexity)]
fn read_metadata(
    r: &mut Reader,
    n_kv: u64,
) -> Result<(Vec<(String, GgufValue)>, Vec<(u64, u64)>), GgufError> {
    let file = r.file;
    let err_file = || file.to_string();
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

    Ok((metadata, kv_offsets))
}

/// `general.alignment` if present (an unsigned power of two up to the cap), else the default.
fn find_alignment(
    file: &str,
    metadata: &[(String, GgufValue)],
    kv_offsets: &[(u64, u64)],
) -> Result<u64, GgufError> {
    let err_file = || file.to_string();
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

    Ok(alignment)
}

/// Read `n_tensors` tensor infos; names must be unique. Returns them with their record offsets.
fn read_tensor_infos(
    r: &mut Reader,
    n_tensors: u64,
    alignment: u64,
    part: u32,
) -> Result<(Vec<GgufTensorInfo>, Vec<u64>), GgufError> {
    let file = r.file;
    let err_file = || file.to_string();
    let hint = n_tensors.min(MAX_CAPACITY_HINT) as usize;
    let mut tensors: Vec<GgufTensorInfo> = Vec::with_capacity(hint);
    let mut tensor_offsets = Vec::with_capacity(hint);
    for i in 0..n_tensors {
        let rec_at = r.pos;
        tensors.push(read_tensor_info(r, i, alignment, part)?);
        tensor_offsets.push(rec_at);
    }
    if let Some((a, b)) = first_duplicate(tensors.iter().map(|t| t.name.as_str())) {
        return Err(GgufError::Duplicate {
            file: err_file(),
            offset: tensor_offsets[b],
            field: format!("tensor[{b}] name '{}'", tensors[b].name),
            first_offset: tensor_offsets[a],
        });
    }

    Ok((tensors, tensor_offsets))
}

/// Read tensor info `i`: name, dimensions (each non-zero, element count capped), ggml type
/// (rows whole blocks), and a data offset that is a multiple of the alignment.
fn read_tensor_info(
    r: &mut Reader,
    i: u64,
    alignment: u64,
    part: u32,
) -> Result<GgufTensorInfo, GgufError> {
    let file = r.file;
    let err_file = || file.to_string();
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
    Ok(GgufTensorInfo {
        name,
        dims,
        ggml_type,
        offset,
        bytes,
        part,
    })
}

/// The data section starts at the next multiple of the alignment after the header; every
/// tensor's data must lie inside the file, fit the section in total, and overlap no other.
/// Returns the data offset and the file size.
fn check_data_section(
    r: &Reader,
    tensors: &[GgufTensorInfo],
    tensor_offsets: &[u64],
    alignment: u64,
) -> Result<(u64, u64), GgufError> {
    let file = r.file;
    let err_file = || file.to_string();
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

    Ok((data_offset, file_size))
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
        let part_index = u32::try_from(i).unwrap_or(u32::MAX);
        let (p, p_file) = read_split_part(dir, &prefix, i, count, &file)?;
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

/// Read part `i` (0-based, `i >= 1`) of a `count`-part split model named `prefix` in `dir`,
/// checking that it exists and that its `split.no` and `split.count` agree with its name.
/// Returns the part and its path for messages.
fn read_split_part(
    dir: &Path,
    prefix: &str,
    i: u64,
    count: u64,
    file: &str,
) -> Result<(Parsed, String), GgufError> {
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
    let p = read_part(&p_path, u32::try_from(i).unwrap_or(u32::MAX))?;
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
    Ok((p, p_file))
}

#[cfg(test)]
mod tests;
