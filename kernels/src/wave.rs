//! A CPU model of how the kernels use a warp (a wavefront on AMD), run for both widths the
//! sources are compiled with: `ST_WARP` 32 (NVIDIA, RDNA's default wave32) and 64 (CDNA,
//! RDNA with `-mwavefrontsize64`). Nothing here runs on a GPU: it checks the *patterns* the
//! sources use (`common.cuh`'s xor-butterfly warp reductions, the block reductions through
//! `red[32]`, the one-row-per-warp mapping of the matrix-vector kernels) so that a 64-wide
//! wave is caught here before the day the kernels run on one. The tests also check that
//! the sources still spell those patterns the way modelled.
//! Invariant: `lanes` of a modelled warp hold one value per lane, and a shuffle reads the
//! value another lane held *before* the step, as the hardware does.

/// One xor-butterfly step: lane `l` receives lane `l ^ m`'s value (`ST_SHFL_XOR`).
pub fn shfl_xor<T: Copy>(lanes: &[T], m: usize) -> Vec<T> {
    (0..lanes.len()).map(|l| lanes[l ^ m]).collect()
}

/// `st_warp_sum`/`st_warp_max`'s loop: `for (m = ST_WARP / 2; m > 0; m >>= 1) v = f(v,
/// shfl_xor(v, m))`, over a warp of `lanes.len()` lanes.
pub fn warp_reduce<T: Copy>(lanes: &[T], f: impl Fn(T, T) -> T) -> Vec<T> {
    let mut v = lanes.to_vec();
    let mut m = lanes.len() / 2;
    while m > 0 {
        let o = shfl_xor(&v, m);
        v = v.iter().zip(&o).map(|(a, b)| f(*a, *b)).collect();
        m >>= 1;
    }
    v
}

/// `st_block_sum`'s pattern for a block of `vals.len()` threads and warps of `wave`: reduce
/// each warp, lane 0 stores to `red[warp]` (32 slots), then every warp reduces
/// `lane < nw ? red[lane] : identity`. Returns every thread's result, or None when the block
/// has more warps than `red` holds.
pub fn block_reduce<T: Copy>(
    vals: &[T],
    wave: usize,
    identity: T,
    f: impl Fn(T, T) -> T + Copy,
) -> Option<Vec<T>> {
    assert_eq!(
        vals.len() % wave,
        0,
        "blockDim must be a multiple of the warp"
    );
    let nw = vals.len() / wave;
    if nw > 32 {
        return None;
    }
    let mut red = [identity; 32];
    for (w, chunk) in vals.chunks(wave).enumerate() {
        red[w] = warp_reduce(chunk, f)[0];
    }
    let second: Vec<T> = (0..wave)
        .map(|l| if l < nw { red[l] } else { identity })
        .collect();
    // Every warp runs the second reduction on the same values.
    let r = warp_reduce(&second, f);
    Some((0..vals.len()).map(|i| r[i % wave]).collect())
}

/// The weight rows a launch of the one-row-per-warp kernels (`mv_*`, `dq_mv*`: row =
/// `blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP`) computes, for `blocks` blocks of
/// `threads` threads.
pub fn rows_covered(
    blocks: usize,
    threads: usize,
    wave: usize,
    warps_per_block: usize,
) -> Vec<usize> {
    let mut rows: Vec<usize> = (0..blocks)
        .flat_map(|b| (0..threads).map(move |t| b * warps_per_block + t / wave))
        .collect();
    rows.sort_unstable();
    rows.dedup();
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAVES: [usize; 2] = [32, 64];

    #[test]
    fn the_warp_butterfly_gives_every_lane_the_total_at_both_widths() {
        for wave in WAVES {
            let lanes: Vec<u64> = (0..wave as u64).map(|l| l * l + 1).collect();
            let total: u64 = lanes.iter().sum();
            assert!(warp_reduce(&lanes, |a, b| a + b)
                .iter()
                .all(|&v| v == total));
            let mx = warp_reduce(&lanes, |a: u64, b| a.max(b));
            assert!(mx.iter().all(|&v| v == *lanes.iter().max().unwrap()));
            // A butterfly sized for 32 lanes on a 64-wide wave only reduces half of it:
            // what a hard-coded `for (m = 16; ...)` would get wrong.
            if wave == 64 {
                let mut v = lanes.clone();
                let mut m = 16;
                while m > 0 {
                    let o = shfl_xor(&v, m);
                    v = v.iter().zip(&o).map(|(a, b)| a + b).collect();
                    m >>= 1;
                }
                assert_ne!(v[0], total);
            }
        }
    }

    #[test]
    fn block_reductions_hold_for_every_block_size_at_both_widths() {
        for wave in WAVES {
            for threads in (wave..=1024).step_by(wave) {
                let vals: Vec<u64> = (0..threads as u64).map(|i| (i * 7919) % 1000).collect();
                let total: u64 = vals.iter().sum();
                let r = block_reduce(&vals, wave, 0, |a, b| a + b).unwrap();
                assert!(
                    r.iter().all(|&v| v == total),
                    "wave {wave} threads {threads}"
                );
                // Arg-max with the lowest index on ties, the kernels' pick rule.
                let pairs: Vec<(u64, usize)> = vals.iter().copied().zip(0..).collect();
                let pick = |a: (u64, usize), b: (u64, usize)| {
                    if b.0 > a.0 || (b.0 == a.0 && b.1 < a.1) {
                        b
                    } else {
                        a
                    }
                };
                let best = block_reduce(&pairs, wave, (0, usize::MAX), pick).unwrap()[0];
                let want = pairs.iter().copied().reduce(pick).unwrap();
                assert_eq!(best, want, "wave {wave} threads {threads}");
            }
        }
        // 1024 threads of wave32 fill red[32] exactly; more warps would not fit.
        assert!(block_reduce(&[0u8; 2048], 32, 0, |a, b| a + b).is_none());
    }

    #[test]
    fn one_row_per_warp_launches_need_warps_times_the_wave_threads() {
        const DQ_WARPS: usize = 4;
        let rows = 64;
        for wave in WAVES {
            let blocks = rows / DQ_WARPS;
            let ok = rows_covered(blocks, DQ_WARPS * wave, wave, DQ_WARPS);
            assert_eq!(ok, (0..rows).collect::<Vec<_>>(), "wave {wave}");
        }
        // A launcher that hard-codes 128 threads (4 warps of 32) leaves half the rows unwritten
        // on a 64-wide wave: HIP launchers must size blocks as DQ_WARPS * warpSize.
        let bad = rows_covered(rows / DQ_WARPS, 128, 64, DQ_WARPS);
        assert_eq!(bad.len(), rows / 2);
    }

    #[test]
    fn the_sources_still_use_the_modelled_patterns() {
        let c = crate::COMMON;
        for f in ["st_warp_sum", "st_warp_max"] {
            let at = c.find(&format!("float {f}(float v)")).unwrap();
            let body = &c[at..at + 300];
            assert!(
                body.contains("for (int m = ST_WARP / 2; m > 0; m >>= 1)"),
                "{f} no longer reduces over the whole ST_WARP: update wave.rs with it"
            );
        }
        let at = c.find("float st_block_sum(").unwrap();
        let body = &c[at..at + 500];
        assert!(body.contains("red[warp] = v") && body.contains("lane < nw ? red[lane]"));
        // No portable kernel sizes a butterfly or a lane test by a literal warp width (the
        // CUDA-only tensor-core modules are warp-32 PTX by nature).
        for k in crate::all().iter().filter(|k| !k.cuda_only) {
            for bad in [
                "m = 16;",
                "o = 16;",
                "% 32 == 0) {",
                "threadIdx.x & 31",
                "lane < 32",
            ] {
                assert!(
                    !k.source.contains(bad),
                    "module {} assumes a 32-wide warp (`{bad}`): use ST_WARP",
                    k.name
                );
            }
        }
    }
}
