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
pub mod testing {
    use crate::ggml::GgmlType;
    use crate::plan::*;

    pub fn sample_plan() -> Plan {
        let dev = |index: u32, first: u32, end: u32| DevicePlan {
            index,
            name: format!("Test GPU {index}"),
            vendor: "nvidia".into(),
            arch: "sm_90".into(),
            vram_bytes: 80 << 30,
            free_bytes: 79 << 30,
            arena_bytes: 70 << 30,
            layer_first: first,
            layer_end: end,
            holds_embedding: index == 0,
            holds_head: index == 1,
            holds_mtp: index == 1,
            holds_vision: false,
            regions: vec![
                Region {
                    kind: RegionKind::DenseWeights,
                    offset: 0,
                    bytes: 10 << 30,
                },
                Region {
                    kind: RegionKind::KvCache,
                    offset: 10 << 30,
                    bytes: 4 << 30,
                },
                Region {
                    kind: RegionKind::ExpertCache,
                    offset: 14 << 30,
                    bytes: 56 << 30,
                },
                Region {
                    kind: RegionKind::RuntimeReserve,
                    offset: (80u64 << 30) - (512 << 20),
                    bytes: 512 << 20,
                },
            ],
            expert_slot_bytes: 3 << 20,
            expert_cache_slots: 19114,
            resident_experts: vec![
                ResidentExpert {
                    layer: first,
                    expert: 7,
                    slot: 0,
                },
                ResidentExpert {
                    layer: first + 1,
                    expert: 3,
                    slot: 1,
                },
            ],
            scratch: vec![ScratchBuffer {
                name: "attn_out".into(),
                offset: 0,
                bytes: 1 << 20,
                first_op: 2,
                last_op: 9,
            }],
            work_pass: WorkPass::default(),
            kv_layers: (first..end).step_by(4).collect(),
            linear_layers: (first..end).filter(|l| l % 4 != 0).collect(),
            free_bytes_probed: index == 0,
            cost: DeviceCost {
                step_s: 0.0002,
                dense_read_s: 0.004,
                rows_per_read: 8,
                expert_layers: end - first,
                n_expert: 512,
                n_expert_used: 10,
                expert_read_s: 1e-6,
                expert_read_per_use: true,
                hit_rate: 0.83,
                kv_resident: 65536,
                ..DeviceCost::default()
            },
            handoff_in: if index == 0 { "none" } else { "peer" }.into(),
        };
        Plan {
            model: PlanModel {
                arch: "qwen3next".into(),
                name: "Sample-80B-A3B".into(),
                fingerprint: "0123456789abcdef0123456789abcdef".into(),
                source: "/models/sample.gguf".into(),
                n_layer: 48,
                n_expert: 512,
                n_expert_used: 10,
                total_bytes: 160 << 30,
                dense_ffn_layers: 0,
                shape: ModelShape {
                    n_embd: 2048,
                    n_ff_exp: 512,
                    n_head: 16,
                    n_head_kv: 2,
                    head_dim_k: 256,
                    head_dim_v: 256,
                },
            },
            hardware_fingerprint: "fedcba9876543210fedcba9876543210".into(),
            serve: PlanServe {
                max_context: 262144,
                requested_batch: 4,
                batch: 2,
                kv: crate::serve::KvType::F16,
                requested_kv_resident: 0,
                kv_resident: 65536,
                ubatch: 512,
                mtp: true,
                spec: 2,
                vision: false,
                vram_reserve_bytes: 512 << 20,
                expert_cache: crate::serve::ExpertCache::Auto,
                layer_split: vec![24],
                layer_split_requested: "auto".into(),
                gpu: vec![0, 1],
                pinned_chunk_bytes: 256 << 20,
                yarn: Some(crate::plan::PlanYarn {
                    factor: 4.0,
                    orig_ctx: 65536,
                }),
                expert_profile: String::new(),
            },
            devices: vec![dev(0, 0, 24), dev(1, 24, 48)],
            tensors: vec![
                TensorPlacement {
                    name: "token_embd.weight".into(),
                    bytes: 1 << 30,
                    ggml_type: GgmlType::Q4K,
                    placement: Placement::Device {
                        device: 0,
                        offset: 0,
                    },
                },
                TensorPlacement {
                    name: "blk.30.ffn_gate_exps.weight".into(),
                    bytes: 2 << 30,
                    ggml_type: GgmlType::Iq3S,
                    placement: Placement::HostExperts { device: 1 },
                },
                TensorPlacement {
                    name: "blk.48.nextn.eh_proj.weight".into(),
                    bytes: 64 << 20,
                    ggml_type: GgmlType::Q8_0,
                    placement: Placement::Host,
                },
            ],
            host: HostPlan {
                ram_bytes: 256 << 30,
                ram_available_bytes: 200 << 30,
                memlock_limit_bytes: None,
                pinned_chunks: vec![PinnedChunk {
                    purpose: "staging".into(),
                    device: 0,
                    bytes: 256 << 20,
                }],
                pinned_bytes: 256 << 20,
                pinned_chunk_max_bytes: 256 << 20,
                kv_host_bytes: 3 << 30,
                experts_host_bytes: 100 << 30,
                ram_required_bytes: 101 << 30,
                experts_page_from_disk: false,
            },
            degradations: vec![Degradation {
                what: "batch".into(),
                requested: "4".into(),
                planned: "2".into(),
                reason: "KV for 4 slots does not fit".into(),
            }],
            suggestions: vec!["add a GPU".into()],
            predicted: Predicted {
                decode_tok_s: 41.5,
                expert_hit_rate: 0.83,
                decode_empty: DecodePoint {
                    batch: 2,
                    context: 0,
                    per_slot_tok_s: 41.5,
                    aggregate_tok_s: 83.0,
                },
                decode_full: DecodePoint {
                    batch: 2,
                    context: 262144,
                    per_slot_tok_s: 12.5,
                    aggregate_tok_s: 25.0,
                },
                prefill_tok_s: 900.0,
                guessed: true,
                basis: "bandwidth model".into(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::sample_plan;
    use super::*;
    use crate::plan::Degradation;
    use proptest::prelude::*;

    fn valid() -> Vec<u8> {
        plan_to_bytes(&sample_plan()).unwrap()
    }

    /// Recompute the payload checksum so a payload edit reaches the archive validator.
    fn reseal(bytes: &mut [u8]) {
        let sha = Sha256::digest(&bytes[HDR..]);
        bytes[OFF_PAYLOAD_SHA..OFF_PAYLOAD_SHA + 32].copy_from_slice(&sha);
    }

    #[test]
    fn corrupted_resealed_payloads_say_what_failed_validation() {
        // Every single-byte corruption that rkyv refuses names what failed (in release
        // builds too: the error type keeps its context without debug assertions).
        let good = valid();
        let mut refused = 0;
        let mut named = 0;
        for i in (HDR..good.len()).step_by(3) {
            let mut b = good.clone();
            b[i] ^= 0xa5;
            reseal(&mut b);
            if let Err(e @ PlanFileError::Archive { .. }) = read_plan_bytes(&b) {
                let m = e.to_string();
                assert!(!m.contains("without error information"), "{m}");
                refused += 1;
                if m.contains("while checking field") {
                    named += 1;
                }
            }
        }
        assert!(refused > 0, "some corruption must reach the validator");
        assert!(
            named * 2 > refused,
            "{named} of {refused} messages name the failing part"
        );
    }

    #[test]
    fn round_trip_in_memory_and_on_disk() {
        let plan = sample_plan();
        let bytes = plan_to_bytes(&plan).unwrap();
        assert_eq!(&bytes[..8], b"STRATAPL");
        assert_eq!(read_plan_bytes(&bytes).unwrap(), plan);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.plan");
        write_plan(&plan, &path).unwrap();
        assert_eq!(fs::read(&path).unwrap(), bytes);
        assert_eq!(read_plan(&path).unwrap(), plan);
        let mapped = open_plan(&path).unwrap();
        let a = mapped.archived();
        assert_eq!(a.devices.len(), 2);
        assert_eq!(a.devices[1].layer_first, 24);
        assert_eq!(a.model.fingerprint.as_str(), plan.model.fingerprint);
        assert_eq!(
            mapped.header().hardware_fingerprint,
            plan.hardware_fingerprint
        );
        assert_eq!(mapped.header().payload_len, (bytes.len() - HDR) as u64);
        assert_eq!(mapped.to_plan().unwrap(), plan);
        // No temp file left behind.
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn overwrite_replaces_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p");
        let mut plan = sample_plan();
        write_plan(&plan, &path).unwrap();
        let old = open_plan(&path).unwrap();
        plan.suggestions.push("another".into());
        write_plan(&plan, &path).unwrap();
        // The old mapping still sees the old, valid plan (rename, not in-place write).
        assert_eq!(old.archived().suggestions.len(), 1);
        assert_eq!(read_plan(&path).unwrap().suggestions.len(), 2);
    }

    #[test]
    fn serialization_is_byte_identical() {
        let a = plan_to_bytes(&sample_plan()).unwrap();
        let b = plan_to_bytes(&sample_plan().clone()).unwrap();
        assert_eq!(a, b);
        let mut other = sample_plan();
        other.predicted.decode_tok_s = 1.0;
        assert_ne!(plan_to_bytes(&other).unwrap(), a);
    }

    #[test]
    fn unaligned_input_is_copied_and_read() {
        let bytes = valid();
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        assert_eq!(read_plan_bytes(&shifted[1..]).unwrap(), sample_plan());
    }

    #[test]
    fn truncation_anywhere_is_a_clean_error() {
        let bytes = valid();
        for n in 0..HDR {
            let e = read_plan_bytes(&bytes[..n]).unwrap_err();
            assert!(
                matches!(e, PlanFileError::Truncated { len, expected: 160, .. } if len == n as u64),
                "{n}: {e}"
            );
        }
        let total = bytes.len() as u64;
        for n in [HDR, HDR + 1, HDR + 100, bytes.len() - 1] {
            let e = read_plan_bytes(&bytes[..n]).unwrap_err();
            assert!(
                matches!(e, PlanFileError::Truncated { len, expected, .. } if len == n as u64 && expected == total),
                "{n}: {e}"
            );
            assert!(e
                .to_string()
                .contains(&format!("truncated: {n} bytes, header says {total}")));
        }
    }

    #[test]
    fn truncated_file_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = valid();
        for n in [0usize, 5, 100, HDR + 3] {
            let path = dir.path().join(format!("t{n}"));
            fs::write(&path, &bytes[..n]).unwrap();
            let e = open_plan(&path).unwrap_err();
            assert!(matches!(e, PlanFileError::Truncated { .. }), "{n}: {e}");
            assert!(e.to_string().contains(&path.display().to_string()));
        }
        let e = open_plan(&dir.path().join("missing")).unwrap_err();
        assert!(matches!(
            e,
            PlanFileError::File(crate::files::FileError::Io { .. })
        ));
        assert!(e.to_string().contains("plan file"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn endless_files_and_links_to_them_are_refused_without_reading() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("zero.plan");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        for p in [Path::new("/dev/zero"), link.as_path()] {
            let e = open_plan(p).unwrap_err().to_string();
            assert!(
                e.contains("character device") && e.contains("plan file"),
                "{e}"
            );
        }
    }

    #[test]
    fn payload_flip_is_checksum_error() {
        let mut bytes = valid();
        let i = HDR + (bytes.len() - HDR) / 2;
        bytes[i] ^= 0x40;
        assert!(matches!(
            read_plan_bytes(&bytes),
            Err(PlanFileError::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn header_corruptions() {
        let base = valid();
        let mut b = base.clone();
        b[0] = b'X';
        assert!(matches!(
            read_plan_bytes(&b),
            Err(PlanFileError::BadMagic { .. })
        ));
        assert!(matches!(
            read_plan_bytes(b"GGUF\x03\0\0\0"),
            Err(PlanFileError::BadMagic { .. })
        ));

        let mut b = base.clone();
        b[OFF_VERSION..OFF_VERSION + 4].copy_from_slice(&7u32.to_le_bytes());
        let e = read_plan_bytes(&b).unwrap_err();
        assert!(matches!(
            e,
            PlanFileError::UnsupportedVersion {
                found: 7,
                supported: 1,
                ..
            }
        ));
        assert!(e.to_string().contains("reads version 1"));

        let mut b = base.clone();
        b[OFF_HEADER_LEN] = 64;
        assert!(matches!(
            read_plan_bytes(&b),
            Err(PlanFileError::BadHeaderLen { found: 64, .. })
        ));

        let mut b = base.clone();
        b[OFF_SCHEMA + 5] ^= 1;
        let e = read_plan_bytes(&b).unwrap_err();
        assert!(matches!(e, PlanFileError::SchemaMismatch { .. }));
        assert!(e
            .to_string()
            .contains("different strata version; re-run strata-plan"));

        let mut b = base.clone();
        b[OFF_PAYLOAD_LEN..OFF_PAYLOAD_LEN + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            read_plan_bytes(&b),
            Err(PlanFileError::LengthOverflow {
                payload_len: u64::MAX,
                ..
            })
        ));
        let mut b = base.clone();
        b[OFF_PAYLOAD_LEN..OFF_PAYLOAD_LEN + 8]
            .copy_from_slice(&(u64::MAX - HEADER_LEN as u64).to_le_bytes());
        assert!(matches!(
            read_plan_bytes(&b),
            Err(PlanFileError::Truncated { .. })
        ));

        let mut b = base.clone();
        b.push(0);
        assert!(matches!(
            read_plan_bytes(&b),
            Err(PlanFileError::TrailingBytes { .. })
        ));

        let mut b = base.clone();
        b[OFF_RESERVED + 3] = 1;
        assert!(matches!(
            read_plan_bytes(&b),
            Err(PlanFileError::ReservedNonZero { offset: 155, .. })
        ));

        let mut b = base.clone();
        b[OFF_MODEL_FP] = b'z';
        assert!(matches!(
            read_plan_bytes(&b),
            Err(PlanFileError::FingerprintMismatch { which: "model", .. })
        ));
        let mut b = base.clone();
        b[OFF_HW_FP + 1] = 0;
        assert!(matches!(
            read_plan_bytes(&b),
            Err(PlanFileError::BadFingerprintField {
                which: "hardware",
                ..
            })
        ));
        let mut b = base.clone();
        b[OFF_PAYLOAD_SHA] ^= 0xff;
        assert!(matches!(
            read_plan_bytes(&b),
            Err(PlanFileError::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn garbage_payload_with_valid_checksum_fails_validation() {
        let mut b = valid();
        let n = b.len();
        // Scramble the tail where the root and relative pointers live.
        for (i, x) in b[n - 64..].iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(37).wrapping_add(0x91);
        }
        reseal(&mut b);
        let e = read_plan_bytes(&b).unwrap_err();
        assert!(matches!(e, PlanFileError::Archive { .. }), "{e}");
    }

    #[test]
    fn empty_and_tiny_payloads_fail_validation() {
        for n in [0usize, 1, 7, 16] {
            let mut b = valid();
            b.truncate(HDR + n);
            b[OFF_PAYLOAD_LEN..OFF_PAYLOAD_LEN + 8].copy_from_slice(&(n as u64).to_le_bytes());
            reseal(&mut b);
            let e = read_plan_bytes(&b).unwrap_err();
            assert!(matches!(e, PlanFileError::Archive { .. }), "{n}: {e}");
        }
    }

    #[test]
    fn bare_payload_reads_aligned_and_unaligned() {
        let plan = sample_plan();
        let b = valid();
        let payload = &b[HDR..];
        assert_eq!(read_plan_payload(payload).unwrap(), plan);
        // Shift by one byte so the slice is surely unaligned: the copy path.
        let mut shifted = vec![0u8; payload.len() + 1];
        shifted[1..].copy_from_slice(payload);
        assert_ne!((shifted[1..].as_ptr() as usize) % PAYLOAD_ALIGN, 0);
        assert_eq!(read_plan_payload(&shifted[1..]).unwrap(), plan);
        // rkyv puts the root at the end and ignores bytes no pointer reaches, so a whole
        // file also decodes as a payload (the header is never read here; that is why real
        // readers check `payload_len` and the checksum first).
        assert_eq!(read_plan_payload(&b).unwrap(), plan);
        for n in [0usize, 1, 8, 16] {
            let e = read_plan_payload(&payload[..n]).unwrap_err();
            assert!(matches!(e, PlanFileError::Archive { .. }), "{n}: {e}");
        }
    }

    /// The fuzz seed corpora (see FUZZING.md): when STRATA_PLAN_SEED_DIR is set (to
    /// `fuzz/seeds`), writes `plan_file/*` (whole files) and `plan_payload/*` (their rkyv
    /// payloads); always checks that every seed reads back.
    #[test]
    fn seed_corpus() {
        let mut small = sample_plan();
        small.devices.truncate(1);
        small.tensors.truncate(1);
        small.degradations.clear();
        small.suggestions.clear();
        small.host.memlock_limit_bytes = Some(64 << 30);
        small.devices[0].scratch.clear();
        // Many short strings: the densest owned-vs-archived growth (an 8-byte archived
        // string becomes 24 bytes + heap); the allocation bound is measured on this one.
        let mut dense = sample_plan();
        dense.suggestions = (0..64).map(|i| format!("s{i:07}")).collect();
        dense.degradations = (0..32)
            .map(|i| Degradation {
                what: format!("w{i}"),
                requested: String::new(),
                planned: "12345678".into(),
                reason: format!("r{i:07}"),
            })
            .collect();
        let seeds = [
            ("sample", sample_plan()),
            ("small", small),
            ("dense_strings", dense),
        ];
        let mut total = 0;
        for (name, plan) in &seeds {
            let file = plan_to_bytes(plan).unwrap();
            assert_eq!(&read_plan_bytes(&file).unwrap(), plan, "{name}");
            assert_eq!(&read_plan_payload(&file[HDR..]).unwrap(), plan, "{name}");
            total += 2 * file.len() - HDR;
            if let Some(out) = std::env::var_os("STRATA_PLAN_SEED_DIR") {
                let out = PathBuf::from(out);
                for (target, bytes) in [("plan_file", &file[..]), ("plan_payload", &file[HDR..])] {
                    fs::create_dir_all(out.join(target)).unwrap();
                    fs::write(out.join(target).join(name), bytes).unwrap();
                }
            }
        }
        assert!(total < 32 << 10, "seeds are {total} bytes; keep them small");
    }

    #[test]
    fn long_fingerprint_refused_on_write() {
        let mut plan = sample_plan();
        plan.model.fingerprint = "a".repeat(33);
        assert!(matches!(
            plan_to_bytes(&plan),
            Err(PlanFileError::FingerprintTooLong {
                which: "model",
                len: 33,
                ..
            })
        ));
        plan.model.fingerprint = String::new();
        assert_eq!(
            read_plan_bytes(&plan_to_bytes(&plan).unwrap()).unwrap(),
            plan
        );
    }

    #[test]
    fn write_to_missing_dir_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope").join("p.plan");
        assert!(matches!(
            write_plan(&sample_plan(), &path),
            Err(PlanFileError::Io { .. })
        ));
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Every byte of the file is covered by a check, so any single-byte change is an
        /// error, never a panic and never a silently different plan.
        #[test]
        fn single_byte_flip_is_an_error(pos in any::<prop::sample::Index>(), xor in 1u8..=255) {
            let mut b = valid();
            let i = pos.index(b.len());
            b[i] ^= xor;
            prop_assert!(read_plan_bytes(&b).is_err());
        }

        #[test]
        fn truncation_is_an_error(pos in any::<prop::sample::Index>()) {
            let b = valid();
            let n = pos.index(b.len());
            prop_assert!(read_plan_bytes(&b[..n]).is_err());
        }

        /// Payload edits that bypass the checksum reach rkyv's validator: it must reject or
        /// accept cleanly, never panic.
        #[test]
        fn resealed_payload_edits_never_panic(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)
        ) {
            let mut b = valid();
            let payload_len = b.len() - HDR;
            for (pos, v) in edits {
                b[HDR + pos.index(payload_len)] = v;
            }
            reseal(&mut b);
            match read_plan_bytes(&b) {
                Ok(p) => {
                    // Accepted: it must be a real plan that writes and reads back stably
                    // (compared as bytes, since an edited f64 may be NaN).
                    let again = plan_to_bytes(&p).unwrap();
                    let back = read_plan_bytes(&again).unwrap();
                    prop_assert_eq!(plan_to_bytes(&back).unwrap(), again);
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}
