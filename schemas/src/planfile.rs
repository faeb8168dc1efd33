//! The plan file: a fixed 160-byte little-endian header followed by an rkyv archive of `Plan`.
//! Invariant: every header byte is checked on read (magic, version, header length, schema hash,
//! payload length, payload SHA-256, fingerprints that must match the payload, zero reserve),
//! the archive is validated before any access, and a plan file on disk is only ever replaced
//! whole (temp file + rename), never written in place. Layout: `schemas/PLANFILE.md`.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;
use rkyv::rancor;
use rkyv::util::AlignedVec;
use sha2::{Digest, Sha256};

use crate::plan::{ArchivedPlan, Plan};

/// First eight bytes of every plan file.
pub const MAGIC: [u8; 8] = *b"STRATAPL";
/// The one format version this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// Header size in bytes; a multiple of `PAYLOAD_ALIGN` so the archive starts aligned.
pub const HEADER_LEN: u32 = 160;
/// Alignment the rkyv archive needs (its widest archived scalar is 8 bytes; 16 is what
/// `AlignedVec` gives and what the header length guarantees inside a page-aligned mmap).
pub const PAYLOAD_ALIGN: usize = 16;
/// Bytes of each fingerprint field in the header.
pub const FINGERPRINT_FIELD_LEN: usize = 32;

// Header field offsets (see PLANFILE.md).
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_HEADER_LEN: usize = 12;
const OFF_SCHEMA: usize = 16;
const OFF_PAYLOAD_LEN: usize = 48;
const OFF_PAYLOAD_SHA: usize = 56;
const OFF_MODEL_FP: usize = 88;
const OFF_HW_FP: usize = 120;
const OFF_RESERVED: usize = 152;
const HDR: usize = HEADER_LEN as usize;

/// The source text of the plan types; any edit to them changes the schema hash.
const PLAN_SCHEMA_SOURCE: &str = include_str!("plan.rs");

/// SHA-256 of `plan.rs` as compiled into this build. Plans written by a build with different
/// plan types carry a different hash and are refused.
pub fn schema_hash() -> [u8; 32] {
    Sha256::digest(PLAN_SCHEMA_SOURCE.as_bytes()).into()
}

/// What is wrong with a plan file. `origin` is the file path, or "plan bytes" for in-memory
/// input.
#[derive(Debug, thiserror::Error)]
pub enum PlanFileError {
    #[error("plan file {}: cannot {action}: {source}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    #[error("{origin}: not a strata plan file (starts with {found:02x?}, expected \"STRATAPL\"); pass the file strata-plan wrote")]
    BadMagic { origin: String, found: Vec<u8> },
    #[error("{origin}: truncated: {len} bytes, header says {expected}; re-run strata-plan")]
    Truncated {
        origin: String,
        len: u64,
        expected: u64,
    },
    #[error("{origin}: {len} bytes but header says {expected}: trailing bytes after the payload; re-run strata-plan")]
    TrailingBytes {
        origin: String,
        len: u64,
        expected: u64,
    },
    #[error("{origin}: plan format version {found}, this build reads version {supported} only; re-run strata-plan")]
    UnsupportedVersion {
        origin: String,
        found: u32,
        supported: u32,
    },
    #[error("{origin}: header length {found}, this build expects {expected}; the header is corrupt, re-run strata-plan")]
    BadHeaderLen {
        origin: String,
        found: u32,
        expected: u32,
    },
    #[error("{origin}: plan was written by a different strata version; re-run strata-plan")]
    SchemaMismatch { origin: String },
    #[error("{origin}: header payload length {payload_len} overflows the file size arithmetic; the header is corrupt, re-run strata-plan")]
    LengthOverflow { origin: String, payload_len: u64 },
    #[error("{origin}: payload checksum mismatch (header {expected}, payload {found}): the file is corrupt; re-run strata-plan")]
    ChecksumMismatch {
        origin: String,
        expected: String,
        found: String,
    },
    #[error("{origin}: header byte {offset} is in the reserved area and must be zero; the header is corrupt, re-run strata-plan")]
    ReservedNonZero { origin: String, offset: u64 },
    #[error("{origin}: {which} fingerprint field at header offset {offset} is not zero-padded printable ASCII; the header is corrupt, re-run strata-plan")]
    BadFingerprintField {
        origin: String,
        which: &'static str,
        offset: u64,
    },
    #[error("{origin}: header {which} fingerprint `{header}` differs from the plan's `{payload}`; the file is corrupt, re-run strata-plan")]
    FingerprintMismatch {
        origin: String,
        which: &'static str,
        header: String,
        payload: String,
    },
    #[error("{which} fingerprint `{value}` is {len} bytes; a plan file stores at most 32 printable ASCII bytes")]
    FingerprintTooLong {
        which: &'static str,
        value: String,
        len: u64,
    },
    #[error("{origin}: plan archive failed validation: {reason}; re-run strata-plan")]
    Archive { origin: String, reason: String },
    #[error("cannot serialize the plan: {reason}")]
    Serialize { reason: String },
    #[error("plan file {}: path has no file name; pass a file path such as plan.strata", path.display())]
    NoFileName { path: PathBuf },
}

/// The decoded header of a plan file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanHeader {
    pub format_version: u32,
    pub header_len: u32,
    pub schema_hash: [u8; 32],
    pub payload_len: u64,
    pub payload_sha256: [u8; 32],
    /// `Plan.model.fingerprint` as stored (ASCII, zero padding stripped).
    pub model_fingerprint: String,
    /// `Plan.hardware_fingerprint` as stored.
    pub hardware_fingerprint: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn arr32(b: &[u8], at: usize) -> [u8; 32] {
    let mut a = [0u8; 32];
    a.copy_from_slice(&b[at..at + 32]);
    a
}

fn encode_fingerprint(which: &'static str, value: &str) -> Result<[u8; 32], PlanFileError> {
    let bytes = value.as_bytes();
    if bytes.len() > FINGERPRINT_FIELD_LEN || !bytes.iter().all(|b| b.is_ascii_graphic()) {
        return Err(PlanFileError::FingerprintTooLong {
            which,
            value: value.to_string(),
            len: bytes.len() as u64,
        });
    }
    let mut out = [0u8; 32];
    out[..bytes.len()].copy_from_slice(bytes);
    Ok(out)
}

fn decode_fingerprint(
    origin: &str,
    which: &'static str,
    header: &[u8],
    at: usize,
) -> Result<String, PlanFileError> {
    let field = &header[at..at + FINGERPRINT_FIELD_LEN];
    let len = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    let ok =
        field[..len].iter().all(|b| b.is_ascii_graphic()) && field[len..].iter().all(|&b| b == 0);
    if !ok {
        return Err(PlanFileError::BadFingerprintField {
            origin: origin.to_string(),
            which,
            offset: at as u64,
        });
    }
    // Printable ASCII is valid UTF-8.
    Ok(field[..len].iter().map(|&b| b as char).collect())
}

/// Serialize a plan to the full file image (header + archive). Identical plans give
/// identical bytes.
pub fn plan_to_bytes(plan: &Plan) -> Result<Vec<u8>, PlanFileError> {
    let model_fp = encode_fingerprint("model", &plan.model.fingerprint)?;
    let hw_fp = encode_fingerprint("hardware", &plan.hardware_fingerprint)?;
    let payload = rkyv::to_bytes::<rancor::Error>(plan).map_err(|e| PlanFileError::Serialize {
        reason: e.to_string(),
    })?;
    let mut out = Vec::with_capacity(HDR + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&HEADER_LEN.to_le_bytes());
    out.extend_from_slice(&schema_hash());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(payload.as_slice()));
    out.extend_from_slice(&model_fp);
    out.extend_from_slice(&hw_fp);
    out.resize(HDR, 0);
    debug_assert_eq!(out.len(), HDR);
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Parse and check the header, and the file length against it. Does not check the payload
/// checksum or the archive.
pub fn parse_header(bytes: &[u8], origin: &str) -> Result<PlanHeader, PlanFileError> {
    let o = || origin.to_string();
    let magic_len = bytes.len().min(MAGIC.len());
    if bytes[..magic_len] != MAGIC[..magic_len] {
        return Err(PlanFileError::BadMagic {
            origin: o(),
            found: bytes[..magic_len].to_vec(),
        });
    }
    if bytes.len() < HDR {
        return Err(PlanFileError::Truncated {
            origin: o(),
            len: bytes.len() as u64,
            expected: HEADER_LEN as u64,
        });
    }
    debug_assert_eq!(OFF_MAGIC, 0);
    let format_version = le_u32(bytes, OFF_VERSION);
    if format_version != FORMAT_VERSION {
        return Err(PlanFileError::UnsupportedVersion {
            origin: o(),
            found: format_version,
            supported: FORMAT_VERSION,
        });
    }
    let header_len = le_u32(bytes, OFF_HEADER_LEN);
    if header_len != HEADER_LEN {
        return Err(PlanFileError::BadHeaderLen {
            origin: o(),
            found: header_len,
            expected: HEADER_LEN,
        });
    }
    let schema = arr32(bytes, OFF_SCHEMA);
    if schema != schema_hash() {
        return Err(PlanFileError::SchemaMismatch { origin: o() });
    }
    if let Some(i) = bytes[OFF_RESERVED..HDR].iter().position(|&b| b != 0) {
        return Err(PlanFileError::ReservedNonZero {
            origin: o(),
            offset: (OFF_RESERVED + i) as u64,
        });
    }
    let model_fingerprint = decode_fingerprint(origin, "model", bytes, OFF_MODEL_FP)?;
    let hardware_fingerprint = decode_fingerprint(origin, "hardware", bytes, OFF_HW_FP)?;
    let payload_len = le_u64(bytes, OFF_PAYLOAD_LEN);
    let expected = (HEADER_LEN as u64)
        .checked_add(payload_len)
        .ok_or_else(|| PlanFileError::LengthOverflow {
            origin: o(),
            payload_len,
        })?;
    let len = bytes.len() as u64;
    if len < expected {
        return Err(PlanFileError::Truncated {
            origin: o(),
            len,
            expected,
        });
    }
    if len > expected {
        return Err(PlanFileError::TrailingBytes {
            origin: o(),
            len,
            expected,
        });
    }
    Ok(PlanHeader {
        format_version,
        header_len,
        schema_hash: schema,
        payload_len,
        payload_sha256: arr32(bytes, OFF_PAYLOAD_SHA),
        model_fingerprint,
        hardware_fingerprint,
    })
}

/// Check everything: header, checksum, archive validation, fingerprints against the payload.
/// `payload` must be `PAYLOAD_ALIGN`-aligned. Returns the validated archive.
fn check_payload<'a>(
    header: &PlanHeader,
    payload: &'a [u8],
    origin: &str,
) -> Result<&'a ArchivedPlan, PlanFileError> {
    let sha: [u8; 32] = Sha256::digest(payload).into();
    if sha != header.payload_sha256 {
        return Err(PlanFileError::ChecksumMismatch {
            origin: origin.to_string(),
            expected: hex(&header.payload_sha256),
            found: hex(&sha),
        });
    }
    let archived = access_archive(payload, origin)?;
    let pairs = [
        (
            "model",
            &header.model_fingerprint,
            archived.model.fingerprint.as_str(),
        ),
        (
            "hardware",
            &header.hardware_fingerprint,
            archived.hardware_fingerprint.as_str(),
        ),
    ];
    for (which, h, p) in pairs {
        if h != p {
            return Err(PlanFileError::FingerprintMismatch {
                origin: origin.to_string(),
                which,
                header: h.clone(),
                payload: p.to_string(),
            });
        }
    }
    Ok(archived)
}

/// An rkyv error with its whole trace, innermost first: "invalid UTF-8, while checking
/// field `name` of struct `Device`, ...". `BoxedError` keeps the trace in release builds
/// too (`rancor::Error` drops it there).
fn archive_reason(e: &rancor::BoxedError) -> String {
    let mut msg = String::new();
    let mut traces = Vec::new();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(rancor::BoxedError::inner(e));
    while let Some(c) = cur {
        let plain = c.to_string();
        let full = format!("{c:#}");
        match full
            .strip_prefix(&plain)
            .and_then(|t| t.strip_prefix("trace: "))
        {
            Some(t) => traces.push(t.to_string()),
            None => msg = plain,
        }
        cur = c.source();
    }
    if msg.is_empty() {
        msg = e.to_string();
    }
    for t in traces.iter().rev() {
        msg.push_str(", ");
        msg.push_str(t);
    }
    msg
}

/// Validate (bytecheck) a `PAYLOAD_ALIGN`-aligned archive and return its root.
fn access_archive<'a>(payload: &'a [u8], origin: &str) -> Result<&'a ArchivedPlan, PlanFileError> {
    rkyv::access::<ArchivedPlan, rancor::BoxedError>(payload).map_err(|e| PlanFileError::Archive {
        origin: origin.to_string(),
        reason: archive_reason(&e),
    })
}

fn deserialize(archived: &ArchivedPlan, origin: &str) -> Result<Plan, PlanFileError> {
    rkyv::deserialize::<Plan, rancor::BoxedError>(archived).map_err(|e| PlanFileError::Archive {
        origin: origin.to_string(),
        reason: archive_reason(&e),
    })
}

/// Read a whole plan file image from memory (pure; the fuzzer's entry point). The payload is
/// accessed in place when it happens to be 16-aligned, else copied once into an `AlignedVec`.
pub fn read_plan_bytes(bytes: &[u8]) -> Result<Plan, PlanFileError> {
    read_plan_bytes_from(bytes, "plan bytes")
}

/// `read_plan_bytes` with errors naming `origin`.
pub fn read_plan_bytes_from(bytes: &[u8], origin: &str) -> Result<Plan, PlanFileError> {
    let header = parse_header(bytes, origin)?;
    with_aligned(&bytes[HDR..], |p| {
        deserialize(check_payload(&header, p, origin)?, origin)
    })
}

/// Run `f` on `bytes` at `PAYLOAD_ALIGN` alignment: in place when it already is, else on a
/// single aligned copy.
fn with_aligned<T>(bytes: &[u8], f: impl FnOnce(&[u8]) -> T) -> T {
    if (bytes.as_ptr() as usize) & (PAYLOAD_ALIGN - 1) == 0 {
        f(bytes)
    } else {
        let mut aligned = AlignedVec::<PAYLOAD_ALIGN>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        f(aligned.as_slice())
    }
}

/// Validate and decode a bare rkyv payload (the bytes after the 160-byte header) with no
/// header, checksum or fingerprint check: the archive validator is the only guard. Meant for
/// the `plan_payload` fuzz target, which must reach the validator that the payload checksum
/// otherwise shields from mutated input; readers of plan files use `read_plan_bytes` or
/// `open_plan`. Unaligned input is copied once.
pub fn read_plan_payload(payload: &[u8]) -> Result<Plan, PlanFileError> {
    let origin = "plan payload";
    with_aligned(payload, |p| deserialize(access_archive(p, origin)?, origin))
}

/// Read and fully decode a plan file (copying; use `open_plan` for zero-copy access).
pub fn read_plan(path: &Path) -> Result<Plan, PlanFileError> {
    open_plan(path)?.to_plan()
}

/// A validated plan file mapped read-only; `archived()` reads it in place.
pub struct MappedPlan {
    path: PathBuf,
    header: PlanHeader,
    map: Mmap,
}

impl std::fmt::Debug for MappedPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedPlan")
            .field("path", &self.path)
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl MappedPlan {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &PlanHeader {
        &self.header
    }

    /// The archived plan, zero-copy from the mapping.
    pub fn archived(&self) -> &ArchivedPlan {
        // SAFETY: `open_plan` ran `rkyv::access` (full bytecheck validation) on exactly this
        // slice of this mapping before constructing `self`, and the mapping is read-only and
        // lives as long as `self`. Strata never writes a plan file in place (`write_plan`
        // renames a new file over the old path, leaving the mapped inode untouched).
        unsafe { rkyv::access_unchecked::<ArchivedPlan>(&self.map[HDR..]) }
    }

    /// Deserialize into an owned `Plan`.
    pub fn to_plan(&self) -> Result<Plan, PlanFileError> {
        deserialize(self.archived(), &self.path.display().to_string())
    }
}

fn io_err(path: &Path, action: &'static str) -> impl FnOnce(std::io::Error) -> PlanFileError {
    let path = path.to_path_buf();
    move |source| PlanFileError::Io {
        path,
        action,
        source,
    }
}

/// Map a plan file and validate it completely; the result reads the plan zero-copy.
pub fn open_plan(path: &Path) -> Result<MappedPlan, PlanFileError> {
    let origin = path.display().to_string();
    let file = crate::files::open_regular(path, "plan file")?;
    let len = file.metadata().map_err(io_err(path, "stat"))?.len();
    if len > crate::files::limit::PLAN {
        return Err(crate::files::FileError::TooLarge {
            path: origin,
            what: "plan file".into(),
            limit: crate::files::limit::PLAN,
        }
        .into());
    }
    if len < HEADER_LEN as u64 {
        // Too short to map usefully (and empty files cannot be mapped): read and report.
        let bytes = crate::files::read_limited(path, HEADER_LEN as u64, "plan file")?;
        parse_header(&bytes, &origin)?;
        return Err(PlanFileError::Truncated {
            origin,
            len: bytes.len() as u64,
            expected: HEADER_LEN as u64,
        });
    }
    // SAFETY: the mapping is read-only and private to this process. Undefined behaviour would
    // need another process to modify the file while it is mapped; strata only replaces plan
    // files by rename (`write_plan`), which leaves this mapping's inode unchanged, and the
    // archive is validated below before any access.
    let map = unsafe { Mmap::map(&file) }.map_err(io_err(path, "mmap"))?;
    let header = parse_header(&map, &origin)?;
    // The mapping is page-aligned and HEADER_LEN is a multiple of PAYLOAD_ALIGN, so the
    // payload is aligned and validated in place: no copy.
    debug_assert_eq!((map[HDR..].as_ptr() as usize) & (PAYLOAD_ALIGN - 1), 0);
    check_payload(&header, &map[HDR..], &origin)?;
    Ok(MappedPlan {
        path: path.to_path_buf(),
        header,
        map,
    })
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Write a plan file atomically: a temp file in the same directory, synced, then renamed over
/// `path`. On any error the temp file is removed and `path` is untouched.
pub fn write_plan(plan: &Plan, path: &Path) -> Result<(), PlanFileError> {
    let bytes = plan_to_bytes(plan)?;
    let name = path.file_name().ok_or_else(|| PlanFileError::NoFileName {
        path: path.to_path_buf(),
    })?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io_err(&tmp, "create temp file"))?;
        f.write_all(&bytes).map_err(io_err(&tmp, "write"))?;
        f.sync_all().map_err(io_err(&tmp, "sync"))?;
        drop(f);
        fs::rename(&tmp, path).map_err(io_err(path, "rename temp file onto"))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
        return result;
    }
    // Best effort: persist the rename itself. Failure here does not leave a bad file.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// A hand-built plan for tests (here and in other crates): two devices with regions, tensors
/// on both placements, a degradation.
pub mod testing;

#[cfg(test)]
mod tests;
