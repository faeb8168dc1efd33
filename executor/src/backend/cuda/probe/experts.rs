//! The cost model's expert coefficients measured with the engine's own expert launchers:
//! the decode expert products (`launch::decode::moe_gate_up` + `moe_down`, read through a
//! table of expert pointers as the engine and its expert cache do) at several tokens, the
//! prefill's grouped tensor-core products (`moe_sort`, `moe_gemm_from` as
//! `forward.rs` calls them), and the expert cache's miss copies: one expert matrix at a time
//! from pageable host memory, as `expert_cache.rs` fills a slot from the mapped file, and one
//! whole expert a copy from pinned memory on a copy stream, as `host_tier.rs` does.
//! Invariant: Qwen3-30B-A3B's expert shape (128 experts of 768 x 2048, Q8_0, top-8); every
//! timed pass reads experts the pass before did not (the weights are several times the L2
//! cache); every buffer is freed on return.

use super::cost::{filled, graph_ms, stream_ms};
use crate::backend::cuda::forward::mat_bytes;
use crate::backend::cuda::gemm::{
    gemm_scratch_bytes, moe_scratch_bytes, AnyLoad, ExpertSource, GemmTile, MoeInput,
    MOE_DEFAULT_TILE,
};
use crate::backend::cuda::launch::decode::{moe_down, moe_gate_up, ExpertTable};
use crate::backend::cuda::launch::Launcher;
use crate::backend::cuda::{drv, CudaDevice, CudaError};
use strata_schemas::ggml::GgmlType;

/// Experts per layer, picked per token, expert width, hidden width (Qwen3-30B-A3B).
pub const N_EXPERT: usize = 128;
pub const K: usize = 8;
pub const F: usize = 768;
pub const E: usize = 2048;
/// Tokens of the decode expert products whose times are fitted against the bytes read.
pub const DECODE_TOKENS: [usize; 3] = [1, 4, 16];
/// Tokens of one pass of the decode expert products standing for a prefill group through
/// the expert cache (which runs the decode products on groups of a pass's tokens).
pub const PASS_TOKENS: usize = 256;
/// Tokens of the grouped prefill products (as pp512).
pub const PREFILL_TOKENS: usize = 512;
/// Host bytes the miss-copy measurement cycles through (more than the host caches).
const HOST_BYTES: usize = 256 << 20;

fn shape(detail: String) -> CudaError {
    CudaError::Shape {
        op: "cost probe (experts)",
        detail,
    }
}

/// Expert `j` of token `t` in pass `p`: distinct within a token, spread over every expert,
/// and a different set each pass.
fn pick(p: usize, t: usize, j: usize) -> i32 {
    ((p * 53 + t * 37 + j * (N_EXPERT / K)) % N_EXPERT) as i32
}

/// Bytes of one Q8_0 expert's gate, up and down matrices.
pub fn expert_bytes() -> Result<u64, CudaError> {
    expert_bytes_of(GgmlType::Q8_0)
}

/// Bytes of one expert's gate, up and down matrices of `ty`.
pub fn expert_bytes_of(ty: GgmlType) -> Result<u64, CudaError> {
    Ok(2 * mat_bytes(ty, F, E)? + mat_bytes(ty, E, F)?)
}

/// The three expert stacks (gate, up, down), `N_EXPERT` matrices each, filled with small
/// finite blocks of one weight type (0x11 bytes: small finite f16 scales in every format).
struct Stacks {
    gate: crate::backend::cuda::DeviceArena,
    up: crate::backend::cuda::DeviceArena,
    down: crate::backend::cuda::DeviceArena,
    gu: u64,
    dn: u64,
}

impl Stacks {
    fn new(dev: &CudaDevice, ty: GgmlType) -> Result<Self, CudaError> {
        let gu = mat_bytes(ty, F, E)?;
        let dn = mat_bytes(ty, E, F)?;
        if gu % 16 != 0 || dn % 16 != 0 {
            return Err(shape(format!(
                "expert matrices of {gu} and {dn} bytes are not 16-byte multiples"
            )));
        }
        let n = N_EXPERT as u64;
        Ok(Self {
            gate: filled(dev, "probe-experts-gate", n * gu, 0x11)?,
            up: filled(dev, "probe-experts-up", n * gu, 0x11)?,
            down: filled(dev, "probe-experts-down", n * dn, 0x11)?,
            gu,
            dn,
        })
    }

    /// The engine's expert table: per expert its gate, up and down pointers.
    fn table(&self) -> Vec<u64> {
        (0..N_EXPERT as u64)
            .flat_map(|x| {
                [
                    self.gate.all().ptr() + x * self.gu,
                    self.up.all().ptr() + x * self.gu,
                    self.down.all().ptr() + x * self.dn,
                ]
            })
            .collect()
    }
}

/// The decode expert products: (latency µs, GB/s) of one gate-up plus down pair at each of
/// [`DECODE_TOKENS`], fitted against the expert bytes its uses read (every (token, expert)
/// use reads its expert, as the kernels' grids do), and the GB/s of a pair over
/// [`PASS_TOKENS`] tokens (bytes of its uses over its time).
pub fn decode_experts(dev: &CudaDevice) -> Result<(f64, f64, f64), String> {
    let counts: Vec<usize> = DECODE_TOKENS.into_iter().chain([PASS_TOKENS]).collect();
    let mut points = expert_points(dev, GgmlType::Q8_0, &counts)?;
    let (bytes, us) = points.pop().ok_or("no pass timed")?;
    let (lat, g) = super::cost::latency_and_gbps(&points)?;
    Ok((lat, g, bytes / us / 1e3))
}

/// GB/s of the decode expert products with weights of `ty`: the slope of the line fit at
/// [`DECODE_TOKENS`] (the `[device.cost.types]` `expert_gbps`).
pub fn decode_expert_gbps(dev: &CudaDevice, ty: GgmlType) -> Result<f64, String> {
    let points = expert_points(dev, ty, &DECODE_TOKENS)?;
    Ok(super::cost::latency_and_gbps(&points)?.1)
}

/// (expert bytes the uses read, µs) of one gate-up plus down pair over `ty` experts at each
/// token count of `counts`, averaged over passes that read other experts.
fn expert_points(
    dev: &CudaDevice,
    ty: GgmlType,
    counts: &[usize],
) -> Result<Vec<(f64, f64)>, String> {
    let e = |e: CudaError| e.to_string();
    let s = Stacks::new(dev, ty).map_err(e)?;
    let table = dev
        .alloc_arena("probe-experts-table", 24 * N_EXPERT as u64)
        .map_err(e)?;
    dev.htod(&s.table(), table.all()).map_err(e)?;
    let max_n = counts.iter().copied().max().unwrap_or(1);
    // One set of ids per pass, so consecutive passes read other experts.
    let passes = N_EXPERT / K;
    let ids: Vec<i32> = (0..passes)
        .flat_map(|p| (0..max_n).flat_map(move |t| (0..K).map(move |j| pick(p, t, j))))
        .collect();
    let idv = dev
        .alloc_arena("probe-experts-ids", 4 * ids.len() as u64)
        .map_err(e)?;
    dev.htod(&ids, idv.all()).map_err(e)?;
    let xn = filled(dev, "probe-experts-x", 4 * (max_n * E) as u64, 0).map_err(e)?;
    let wts = filled(dev, "probe-experts-wts", 4 * (max_n * K) as u64, 0).map_err(e)?;
    let h = dev
        .alloc_arena("probe-experts-h", 4 * (max_n * K * F) as u64)
        .map_err(e)?;
    let y = filled(dev, "probe-experts-y", 4 * (max_n * E) as u64, 0).map_err(e)?;
    let l = Launcher {
        dev,
        pdl: true,
        prof: None,
        q4k_lanes: false,
    };
    let per_expert = expert_bytes_of(ty).map_err(e)? as f64;
    let mut points = Vec::new();
    for &n in counts {
        let ms = graph_ms(dev, 5, &mut || {
            for p in 0..passes {
                let ex = ExpertTable {
                    table: table.all(),
                    ty,
                    ty_up: ty,
                    ty_down: ty,
                    n_expert: N_EXPERT,
                    f: F,
                    e: E,
                };
                let iv = idv.view((4 * p * max_n * K) as u64, (4 * n * K) as u64)?;
                let (xv, wv) = (
                    xn.view(0, 4 * (n * E) as u64)?,
                    wts.view(0, 4 * (n * K) as u64)?,
                );
                let (hv, yv) = (
                    h.view(0, 4 * (n * K * F) as u64)?,
                    y.view(0, 4 * (n * E) as u64)?,
                );
                moe_gate_up(&l, ex, iv, K, xv, hv, n, true)?;
                moe_down(&l, ex, iv, wv, K, hv, yv, n)?;
            }
            Ok(())
        })
        .map_err(e)?;
        let uses = (n * K) as f64;
        points.push((uses * per_expert, ms * 1e3 / passes as f64));
    }
    Ok(points)
}

/// TFLOP/s of the prefill's grouped expert products over [`PREFILL_TOKENS`] tokens: the
/// sort, the input conversions, the fused gate-up product and the down product, as
/// `forward.rs`'s `experts_grouped` queues them (2 flops per weight per use).
pub fn prefill_experts(dev: &CudaDevice, ty: GgmlType, reps: usize) -> Result<f64, CudaError> {
    let s = Stacks::new(dev, ty)?;
    let n = PREFILL_TOKENS;
    let ids: Vec<i32> = (0..n)
        .flat_map(|t| (0..K).map(move |j| pick(0, t, j)))
        .collect();
    let idv = dev.alloc_arena("probe-pexperts-ids", 4 * ids.len() as u64)?;
    dev.htod(&ids, idv.all())?;
    let sorted = dev.alloc_arena(
        "probe-pexperts-sorted",
        moe_scratch_bytes(n, K, N_EXPERT).div_ceil(16) * 16,
    )?;
    let xh = dev.alloc_arena(
        "probe-pexperts-xh",
        gemm_scratch_bytes(n * K, F.max(E)).max(gemm_scratch_bytes(n, E)),
    )?;
    let x = filled(dev, "probe-pexperts-x", 4 * (n * E) as u64, 0)?;
    let h = filled(dev, "probe-pexperts-h", 4 * (n * K * F) as u64, 0)?;
    let yd = dev.alloc_arena("probe-pexperts-yd", 4 * (n * K * E) as u64)?;
    let gu_span = s.gu * N_EXPERT as u64;
    let dn_span = s.dn * N_EXPERT as u64;
    let ms = stream_ms(dev, reps, &mut || {
        dev.moe_sort(idv.all(), n, K, N_EXPERT, sorted.all())?;
        dev.gemm_convert_x(x.all(), n, E, ty, xh.all())?;
        let gate_up = ExpertSource::Strided {
            w: s.gate.view(0, gu_span)?,
            wu: Some(s.up.view(0, gu_span)?),
            stride: s.gu,
        };
        dev.moe_gemm_from(
            GemmTile::M64,
            AnyLoad::default(),
            gate_up,
            ty,
            N_EXPERT,
            F,
            E,
            xh.all(),
            MoeInput::Gather,
            n,
            K,
            sorted.all(),
            h.all(),
        )?;
        dev.gemm_convert_x(h.all(), n * K, F, ty, xh.all())?;
        let down = ExpertSource::Strided {
            w: s.down.view(0, dn_span)?,
            wu: None,
            stride: s.dn,
        };
        dev.moe_gemm_from(
            MOE_DEFAULT_TILE,
            AnyLoad::default(),
            down,
            ty,
            N_EXPERT,
            E,
            F,
            xh.all(),
            MoeInput::Direct,
            n,
            K,
            sorted.all(),
            yd.all(),
        )
    })?;
    let flops = 2.0 * (n * K) as f64 * 3.0 * (F * E) as f64;
    Ok(flops / (ms * 1e-3) / 1e12)
}

/// GB/s of the expert cache's miss copies: one expert matrix at a time from pageable host
/// memory into device memory on the stream, as a slot is filled, cycling through
/// [`HOST_BYTES`] of host memory.
pub fn miss_copies(dev: &CudaDevice) -> Result<f64, CudaError> {
    dev.stream()?
        .context()
        .bind_to_thread()
        .map_err(drv("cuCtxSetCurrent"))?;
    let chunk = mat_bytes(GgmlType::Q8_0, F, E)? as usize;
    let host = vec![0x11u8; HOST_BYTES];
    let dst = dev.alloc_arena("probe-miss-dst", HOST_BYTES as u64)?;
    let n = HOST_BYTES / chunk;
    let copy_all = || -> Result<(), CudaError> {
        for i in 0..n {
            let src = &host[i * chunk..(i + 1) * chunk];
            let d = dst.view((i * chunk) as u64, chunk as u64)?;
            // SAFETY: `d` is `chunk` bytes of a live arena and `src` as many bytes of a live
            // Vec; a pageable source is staged by the driver before the call returns, and
            // the arena outlives the copy (the caller synchronizes before dropping it).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(d.ptr(), src, dev.stream()?.cu_stream())
            }
            .map_err(drv("cuMemcpyHtoDAsync(pageable expert matrix)"))?;
        }
        Ok(())
    };
    copy_all()?;
    dev.synchronize()?;
    let t = std::time::Instant::now();
    const ROUNDS: usize = 4;
    for _ in 0..ROUNDS {
        copy_all()?;
    }
    dev.synchronize()?;
    let s = t.elapsed().as_secs_f64();
    if s <= 0.0 || !s.is_finite() {
        return Err(shape(format!("{ROUNDS} rounds of copies took {s} s")));
    }
    Ok((ROUNDS * n * chunk) as f64 / s / 1e9)
}

/// GB/s of the expert cache's misses from the pinned host expert tier: one whole expert
/// (gate, up and down, as a slot holds them) a copy from pinned memory on a second stream,
/// as `host_tier.rs` copies a miss, cycling through [`HOST_BYTES`] of pinned memory; host
/// wall time from the first copy queued to the copy stream synchronised.
pub fn pinned_miss_copies(dev: &CudaDevice) -> Result<f64, CudaError> {
    let slot = expert_bytes()?;
    let mut host = dev.alloc_pinned(HOST_BYTES as u64)?;
    host.as_mut_slice().fill(0x11);
    let dst = dev.alloc_arena("probe-pinned-miss-dst", HOST_BYTES as u64)?;
    let copy = dev.new_stream()?;
    let n = HOST_BYTES as u64 / slot;
    let copy_all = || -> Result<(), CudaError> {
        for i in 0..n {
            // SAFETY: `host` outlives the copies: the copy stream is synchronised below
            // before it is dropped, and nothing writes it meanwhile.
            unsafe { dev.copy_pinned_async(&host, i * slot, dst.view(i * slot, slot)?, &copy) }?;
        }
        Ok(())
    };
    let r = (|| {
        copy_all()?;
        copy.synchronize()
            .map_err(drv("cuStreamSynchronize(copy)"))?;
        let t = std::time::Instant::now();
        const ROUNDS: u64 = 8;
        for _ in 0..ROUNDS {
            copy_all()?;
        }
        copy.synchronize()
            .map_err(drv("cuStreamSynchronize(copy)"))?;
        let s = t.elapsed().as_secs_f64();
        if s <= 0.0 || !s.is_finite() {
            return Err(shape(format!("{ROUNDS} rounds of copies took {s} s")));
        }
        Ok((ROUNDS * n * slot) as f64 / s / 1e9)
    })();
    // Whatever happened, no copy may still read `host` when it is freed.
    let _ = copy.synchronize();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_are_distinct_within_a_token_and_cover_every_expert_over_the_passes() {
        for p in 0..N_EXPERT / K {
            for t in 0..16 {
                let row: Vec<i32> = (0..K).map(|j| pick(p, t, j)).collect();
                let mut d = row.clone();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), K, "pass {p} token {t}: {row:?}");
                assert!(row.iter().all(|&x| (0..N_EXPERT as i32).contains(&x)));
            }
        }
        let mut seen = [false; N_EXPERT];
        for p in 0..N_EXPERT / K {
            for j in 0..K {
                seen[pick(p, 0, j) as usize] = true;
            }
        }
        assert!(
            seen.iter().all(|&s| s),
            "one token's picks over the passes miss experts"
        );
    }
}
