//! Independent checks of a finished layout: scratch packing and device/host regions.
//! Invariant: this file shares no code with the packer or the region planner; it accepts a
//! layout only if every buffer/region lies inside its container, scratch offsets are
//! aligned to `SCRATCH_ALIGN`, and no two buffers that are live at the same op (no two
//! regions at all) share a byte. Zero-byte buffers and regions take no bytes and never
//! overlap anything.

use strata_schemas::graph::{BufferSpec, SCRATCH_ALIGN};

/// A layout the verifier rejects; each names the buffers or regions and their byte ranges.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("scratch: {buffers} buffers but {offsets} offsets; the packer must give one offset per buffer")]
    LengthMismatch { buffers: u64, offsets: u64 },
    #[error("scratch buffer `{name}` has first_op {first_op} > last_op {last_op}; fix its lifetime in the forward graph")]
    BadLifetime {
        name: String,
        first_op: u32,
        last_op: u32,
    },
    #[error("scratch size {total} is not a multiple of {align} B; round the scratch region up")]
    TotalMisaligned { total: u64, align: u64 },
    #[error("scratch buffer `{name}` at offset {offset} is not aligned to {align} B; the packer must align offsets")]
    Misaligned {
        name: String,
        offset: u64,
        align: u64,
    },
    #[error("scratch buffer `{name}` at [{start}, {end}) ends past the scratch size {total}; grow the scratch region or repack")]
    OutOfBounds {
        name: String,
        start: u64,
        end: u64,
        total: u64,
    },
    #[error("scratch buffers `{a}` [{a_start}, {a_end}) and `{b}` [{b_start}, {b_end}) share bytes while both live at ops {first_op}..={last_op}; the packing is wrong")]
    Overlap {
        a: String,
        a_start: u64,
        a_end: u64,
        b: String,
        b_start: u64,
        b_end: u64,
        first_op: u32,
        last_op: u32,
    },
    #[error("region `{name}` at [{start}, {end}) ends past the capacity {capacity}; shrink it or plan less into this memory")]
    RegionOutOfBounds {
        name: String,
        start: u64,
        end: u64,
        capacity: u64,
    },
    #[error("regions `{a}` [{a_start}, {a_end}) and `{b}` [{b_start}, {b_end}) overlap; the layout is wrong")]
    RegionOverlap {
        a: String,
        a_start: u64,
        a_end: u64,
        b: String,
        b_start: u64,
        b_end: u64,
    },
}

/// Byte range `[start, end)` of `bytes` at `start`; `None` when the end overflows u64.
fn range(start: u64, bytes: u64) -> Option<(u64, u64)> {
    start.checked_add(bytes).map(|end| (start, end))
}

/// Check a scratch packing: `offsets[i]` belongs to `buffers[i]`, `total` is the scratch size.
pub fn verify_scratch(
    buffers: &[BufferSpec],
    offsets: &[u64],
    total: u64,
) -> Result<(), VerifyError> {
    if buffers.len() != offsets.len() {
        return Err(VerifyError::LengthMismatch {
            buffers: buffers.len() as u64,
            offsets: offsets.len() as u64,
        });
    }
    if total % SCRATCH_ALIGN != 0 {
        return Err(VerifyError::TotalMisaligned {
            total,
            align: SCRATCH_ALIGN,
        });
    }
    // Bounds, alignment and lifetimes, buffer by buffer.
    let mut spans = Vec::with_capacity(buffers.len());
    for (i, (b, &off)) in buffers.iter().zip(offsets).enumerate() {
        if b.first_op > b.last_op {
            return Err(VerifyError::BadLifetime {
                name: b.name.clone(),
                first_op: b.first_op,
                last_op: b.last_op,
            });
        }
        if off % SCRATCH_ALIGN != 0 {
            return Err(VerifyError::Misaligned {
                name: b.name.clone(),
                offset: off,
                align: SCRATCH_ALIGN,
            });
        }
        let Some((start, end)) = range(off, b.bytes).filter(|&(_, end)| end <= total) else {
            return Err(VerifyError::OutOfBounds {
                name: b.name.clone(),
                start: off,
                end: off.saturating_add(b.bytes),
                total,
            });
        };
        if b.bytes > 0 {
            spans.push((start, end, i));
        }
    }
    // Sweep in address order: for each buffer, only later-starting buffers that begin before
    // it ends can share bytes with it; among those, any lifetime intersection is an error.
    spans.sort_unstable();
    for (k, &(a_start, a_end, ia)) in spans.iter().enumerate() {
        for &(b_start, b_end, ib) in spans[k + 1..].iter() {
            if b_start >= a_end {
                break;
            }
            let (a, b) = (&buffers[ia], &buffers[ib]);
            let first_op = a.first_op.max(b.first_op);
            let last_op = a.last_op.min(b.last_op);
            if first_op <= last_op {
                return Err(VerifyError::Overlap {
                    a: a.name.clone(),
                    a_start,
                    a_end,
                    b: b.name.clone(),
                    b_start,
                    b_end,
                    first_op,
                    last_op,
                });
            }
        }
    }
    Ok(())
}

/// Check regions `(name, offset, bytes)` laid out in a memory of `capacity` bytes: each lies
/// in `[0, capacity)` and no two share a byte. Zero-byte regions are allowed anywhere.
pub fn verify_regions(capacity: u64, regions: &[(String, u64, u64)]) -> Result<(), VerifyError> {
    let mut spans = Vec::with_capacity(regions.len());
    for (i, (name, off, bytes)) in regions.iter().enumerate() {
        if *bytes == 0 {
            continue;
        }
        match range(*off, *bytes) {
            Some((start, end)) if end <= capacity => spans.push((start, end, i)),
            _ => {
                return Err(VerifyError::RegionOutOfBounds {
                    name: name.clone(),
                    start: *off,
                    end: off.saturating_add(*bytes),
                    capacity,
                })
            }
        }
    }
    spans.sort_unstable();
    // In address order, overlapping regions are always neighbours of some earlier-ending one:
    // compare each with the previous region that reaches furthest.
    let mut reach: Option<(u64, u64, usize)> = None;
    for &(start, end, i) in &spans {
        if let Some((p_start, p_end, p)) = reach {
            if start < p_end {
                return Err(VerifyError::RegionOverlap {
                    a: regions[p].0.clone(),
                    a_start: p_start,
                    a_end: p_end,
                    b: regions[i].0.clone(),
                    b_start: start,
                    b_end: end,
                });
            }
        }
        if reach.is_none_or(|(_, p_end, _)| end > p_end) {
            reach = Some((start, end, i));
        }
    }
    Ok(())
}

/// Check one planned device end to end: its regions fit its memory without overlapping, and
/// its scratch buffers are a valid lifetime packing of its scratch region.
pub fn verify_device(d: &strata_schemas::plan::DevicePlan) -> Result<(), VerifyError> {
    let regions: Vec<(String, u64, u64)> = d
        .regions
        .iter()
        .map(|r| (r.kind.as_str().to_string(), r.offset, r.bytes))
        .collect();
    verify_regions(d.vram_bytes, &regions)?;
    let specs: Vec<BufferSpec> = d
        .scratch
        .iter()
        .map(|b| BufferSpec {
            name: b.name.clone(),
            bytes: b.bytes,
            first_op: b.first_op,
            last_op: b.last_op,
        })
        .collect();
    let offsets: Vec<u64> = d.scratch.iter().map(|b| b.offset).collect();
    verify_scratch(
        &specs,
        &offsets,
        d.region_bytes(strata_schemas::plan::RegionKind::Scratch),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: u64 = SCRATCH_ALIGN;

    fn b(name: &str, bytes: u64, first_op: u32, last_op: u32) -> BufferSpec {
        BufferSpec {
            name: name.to_string(),
            bytes,
            first_op,
            last_op,
        }
    }

    fn r(name: &str, off: u64, bytes: u64) -> (String, u64, u64) {
        (name.to_string(), off, bytes)
    }

    #[test]
    fn accepts_reuse_across_disjoint_lifetimes() {
        let bufs = vec![b("x", 2 * A, 0, 1), b("y", A, 2, 3), b("z", A, 0, 3)];
        verify_scratch(&bufs, &[0, 0, 2 * A], 3 * A).unwrap();
        // y also fits at A: still inside x's bytes, but x is dead by then.
        verify_scratch(&bufs, &[0, A, 2 * A], 3 * A).unwrap();
    }

    #[test]
    fn rejects_planted_overlap_and_names_both() {
        let bufs = vec![b("x", 2 * A, 0, 2), b("y", A, 2, 3), b("z", A, 0, 3)];
        let err = verify_scratch(&bufs, &[0, A, 2 * A], 3 * A).unwrap_err();
        assert_eq!(
            err,
            VerifyError::Overlap {
                a: "x".into(),
                a_start: 0,
                a_end: 2 * A,
                b: "y".into(),
                b_start: A,
                b_end: 2 * A,
                first_op: 2,
                last_op: 2,
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("`x`") && msg.contains("`y`") && msg.contains("[256, 512)"));
        // A buffer overlapping one that starts far earlier but reaches past it.
        let bufs = vec![
            b("long", 8 * A, 0, 5),
            b("mid", A, 0, 5),
            b("late", A, 3, 4),
        ];
        assert!(verify_scratch(&bufs, &[0, 8 * A, 6 * A], 9 * A).is_err());
    }

    #[test]
    fn rejects_bounds_alignment_and_shape_errors() {
        let bufs = vec![b("x", A, 0, 1), b("y", A, 0, 1)];
        assert!(matches!(
            verify_scratch(&bufs, &[0, A], A),
            Err(VerifyError::OutOfBounds { name, start, end, total })
                if name == "y" && start == A && end == 2 * A && total == A
        ));
        assert!(matches!(
            verify_scratch(&bufs, &[0, u64::MAX - 255], 2 * A),
            Err(VerifyError::OutOfBounds { .. })
        ));
        assert!(matches!(
            verify_scratch(&bufs, &[0, A + 8], 4 * A),
            Err(VerifyError::Misaligned { offset, .. }) if offset == A + 8
        ));
        assert!(matches!(
            verify_scratch(&bufs, &[0, A], 2 * A + 1),
            Err(VerifyError::TotalMisaligned { .. })
        ));
        assert!(matches!(
            verify_scratch(&bufs, &[0], 2 * A),
            Err(VerifyError::LengthMismatch {
                buffers: 2,
                offsets: 1
            })
        ));
        let inverted = vec![b("x", A, 3, 1)];
        assert!(matches!(
            verify_scratch(&inverted, &[0], A),
            Err(VerifyError::BadLifetime { .. })
        ));
        // Zero-byte buffers take no bytes but must still sit inside the scratch.
        let zero = vec![b("x", A, 0, 1), b("e", 0, 0, 1)];
        verify_scratch(&zero, &[0, 0], A).unwrap();
        verify_scratch(&zero, &[0, A], A).unwrap();
        assert!(verify_scratch(&zero, &[0, 2 * A], A).is_err());
    }

    #[test]
    fn regions_inside_and_disjoint() {
        let ok = vec![r("weights", 0, 100), r("kv", 100, 50), r("empty", 500, 0)];
        verify_regions(150, &ok).unwrap();
        let err = verify_regions(149, &ok).unwrap_err();
        assert!(matches!(
            &err,
            VerifyError::RegionOutOfBounds { name, start: 100, end: 150, capacity: 149 }
                if name == "kv"
        ));
        assert!(err.to_string().contains("`kv`"));
        let overlap = vec![r("a", 0, 100), r("b", 40, 10), r("c", 60, 100)];
        assert_eq!(
            verify_regions(1000, &overlap).unwrap_err(),
            VerifyError::RegionOverlap {
                a: "a".into(),
                a_start: 0,
                a_end: 100,
                b: "b".into(),
                b_start: 40,
                b_end: 50,
            }
        );
        // c overlaps a, hidden behind the shorter b in address order.
        let hidden = vec![
            r("a", 0, 100),
            r("b", 100, 10),
            r("c", 50, 5),
            r("d", 99, 2),
        ];
        assert!(verify_regions(1000, &hidden).is_err());
        assert!(verify_regions(1000, &[r("a", 0, 100), r("c", 99, 2)]).is_err());
        assert!(verify_regions(u64::MAX, &[r("huge", u64::MAX, 1)]).is_err());
        verify_regions(0, &[r("z", 7, 0)]).unwrap();
    }

    /// Brute force reference for the sweep: any pair of live-together buffers sharing bytes.
    fn pairwise_overlap(bufs: &[BufferSpec], offs: &[u64]) -> bool {
        (0..bufs.len()).any(|i| {
            (i + 1..bufs.len()).any(|j| {
                let (a, b) = (&bufs[i], &bufs[j]);
                a.bytes > 0
                    && b.bytes > 0
                    && a.first_op <= b.last_op
                    && b.first_op <= a.last_op
                    && offs[i] < offs[j] + b.bytes
                    && offs[j] < offs[i] + a.bytes
            })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn sweep_agrees_with_pairwise(
            v in prop::collection::vec((0u64..4, 0u64..8, 0u32..6, 0u32..3), 1..24)
        ) {
            let bufs: Vec<BufferSpec> = v.iter().enumerate()
                .map(|(i, &(units, _, first, len))| b(&format!("b{i}"), units * A, first, first + len))
                .collect();
            let offs: Vec<u64> = v.iter().map(|&(_, slot, _, _)| slot * A).collect();
            let res = verify_scratch(&bufs, &offs, 16 * A);
            prop_assert_eq!(res.is_err(), pairwise_overlap(&bufs, &offs));
        }

        #[test]
        fn region_sweep_agrees_with_pairwise(
            v in prop::collection::vec((0u64..50, 0u64..20), 1..16)
        ) {
            let regions: Vec<_> = v.iter().enumerate()
                .map(|(i, &(off, bytes))| r(&format!("r{i}"), off, bytes)).collect();
            let brute = (0..v.len()).any(|i| (i + 1..v.len()).any(|j| {
                let ((oa, ba), (ob, bb)) = (v[i], v[j]);
                ba > 0 && bb > 0 && oa < ob + bb && ob < oa + ba
            }));
            prop_assert_eq!(verify_regions(100, &regions).is_err(), brute);
        }
    }
}
