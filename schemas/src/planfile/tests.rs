//! Tests of the plan file: round trips, header checks, corruption caught before any access.

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
