//! The host round trips the cost model charges a decode step that leaves the device
//! (`host_round_trip_us`, `kv_host_round_trip_us`) and the eager launch such a step pays
//! (`eager_launch_us`), timed on the live GPU with the engine's own code: the hybrid layer's
//! device side (`hybrid::{rows_back, picks_up, sum_up}`) around the host products
//! (`cpu::host_experts`), and the KV host layer's (`kv_host_attn::host_round_trip`) around the
//! host partials (`cpu::host_attn`), each from a cold thread pool, as between two layers of a
//! decode step.
//! Invariant: a round trip is the median wall time of the whole layer's host part, stream
//! synchronisations included, less the bytes its host products read at `host_matvec_gbps`
//! (which the cost model charges apart); nothing is a default: a failure is an error the
//! caller turns into a note.

use super::cost::{filled, probe_heads, HD, N_HEAD, N_HEAD_KV};
use crate::backend::cpu::host_attn::{host_partials, scratch_len, SpilledCells};
use crate::backend::cpu::host_experts::{
    host_experts, host_threads, synthetic_experts, synthetic_mats, HostPick,
};
use crate::backend::cuda::flash::KV_TY_F16;
use crate::backend::cuda::hybrid::{picks_up, rows_back, sum_up};
use crate::backend::cuda::kv_host_attn::{host_round_trip, pieces, AttnSide};
use crate::backend::cuda::kv_spill::KvHostArg;
use crate::backend::cuda::launch::attention::{KvLayer, Splits};
use crate::backend::cuda::launch::decode::rmsnorm;
use crate::backend::cuda::launch::{Launcher, ATT_MAX_SPLIT};
use crate::backend::cuda::{CudaDevice, CudaError};
use std::time::{Duration, Instant};
use strata_kernels::consts::KVH_MAX_CHUNKS;
use strata_schemas::ggml::GgmlType;

/// Timed round trips (after [`WARM`] untimed ones); the median is kept.
const TRIPS: usize = 40;
const WARM: usize = 5;
/// Idle time before each trip, so that rayon's workers are parked as they are after a
/// layer's device work (the engine's pool wakes for each host layer).
const IDLE: Duration = Duration::from_millis(2);
/// Experts the hybrid trips rotate through (distinct weights each trip, as the engine's
/// misses are).
const TRIP_EXPERTS: usize = 16;
/// The KV trip's shape: the cost probe's heads (`probe_heads`), F16 cells, a window of
/// [`WINDOW`] cells in VRAM and [`SPILLED`] on the host, one slot, one token.
const WINDOW: u64 = 512;
const SPILLED: usize = 512;
/// Launches timed eagerly for `eager_launch_us`.
const EAGER_LAUNCHES: usize = 512;

fn shape(detail: impl Into<String>) -> CudaError {
    CudaError::Shape {
        op: "round-trip probe",
        detail: detail.into(),
    }
}

/// The engine's decode launcher outside a graph (a step with host round trips runs eagerly).
fn launcher(dev: &CudaDevice) -> Launcher<'_> {
    Launcher {
        dev,
        pdl: true,
        prof: None,
        q4k_lanes: false,
    }
}

/// Median µs of `trip` over [`TRIPS`] runs, each after [`IDLE`] with the stream drained.
fn median_trip(
    dev: &CudaDevice,
    trip: &mut dyn FnMut(usize) -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    let mut us = Vec::with_capacity(TRIPS);
    for i in 0..WARM + TRIPS {
        dev.synchronize()?;
        std::thread::sleep(IDLE);
        let t = Instant::now();
        trip(i)?;
        dev.synchronize()?;
        if i >= WARM {
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    us.sort_by(f64::total_cmp);
    Ok(us[us.len() / 2])
}

/// `host_round_trip_us`: one decode layer of one token whose one miss the host computes, as
/// `hybrid.rs` runs it (rows back, picks up, the products, the sum up and its combine, the
/// next layer's synchronisation), less the expert's bytes at `host_gbps`. Returns (µs, the
/// whole trip's µs).
pub fn hybrid_round_trip(dev: &CudaDevice, host_gbps: f64) -> Result<(f64, f64), CudaError> {
    use super::experts::{E, F, K};
    let e32 = |n: usize| 4 * n as u64;
    let xn_d = filled(dev, "probe-trip-xn", e32(E), 0)?;
    let wts_d = filled(dev, "probe-trip-wts", e32(K), 0)?;
    let ids_d = filled(dev, "probe-trip-ids", e32(K), 0)?;
    let h_d = filled(dev, "probe-trip-h", e32(E + 1), 0)?;
    let y_d = filled(dev, "probe-trip-y", e32(E), 0)?;
    let weights = synthetic_experts((E, F), TRIP_EXPERTS).map_err(|e| shape(e.to_string()))?;
    let mats = synthetic_mats(&weights, (E, F), TRIP_EXPERTS).map_err(|e| shape(e.to_string()))?;
    let (mut xn, mut wts) = (vec![0f32; E], vec![0f32; K]);
    let (ids_dev, wts_dev) = (vec![0u32; K], vec![0f32; K]);
    let (mut h, mut out) = (vec![0f32; F], vec![0f32; E + 1]);
    let pick = [HostPick {
        token: 0,
        expert: 0,
        weight: 1.0,
    }];
    let l = launcher(dev);
    let whole = median_trip(dev, &mut |i| {
        let (xv, wv) = (xn_d.view(0, e32(E))?, wts_d.view(0, e32(K))?);
        rows_back(dev, [xv, wv], [&mut xn, &mut wts])?;
        picks_up(dev, (&ids_dev, &wts_dev), [ids_d.view(0, e32(K))?, wv])?;
        let m = [mats[i % TRIP_EXPERTS]];
        host_experts(&m, &pick, &xn, 1, (E, F), &mut h, &mut out[..E])
            .map_err(|e| shape(e.to_string()))?;
        sum_up(
            &l,
            &mut out,
            h_d.view(0, e32(E + 1))?,
            y_d.view(0, e32(E))?,
            (1, E),
        )
    })?;
    let bytes = (weights.len() / TRIP_EXPERTS) as f64;
    Ok(((whole - bytes / (host_gbps * 1e3)).max(0.0), whole))
}

/// `kv_host_round_trip_us`: one attention layer of one token over a [`WINDOW`]-cell window
/// with [`SPILLED`] cells attended on the host, as `kv_host_attn.rs` runs it, less the
/// spilled cells' bytes at `host_gbps`. Returns (µs, the whole trip's µs).
pub fn kv_round_trip(dev: &CudaDevice, host_gbps: f64) -> Result<(f64, f64), CudaError> {
    let row_bytes = (N_HEAD_KV * HD * 2) as u64;
    let layer = 2 * WINDOW * row_bytes;
    let kv = filled(dev, "probe-trip-kv", layer, 0x11)?;
    let small = filled(dev, "probe-trip-small", 4 * (N_HEAD * HD) as u64, 0)?;
    let q = filled(dev, "probe-trip-q", 4 * (N_HEAD * HD) as u64, 0)?;
    let out = dev.alloc_arena("probe-trip-out", 4 * (N_HEAD * HD) as u64)?;
    let part_o = dev.alloc_arena(
        "probe-trip-part-o",
        4 * (N_HEAD * ATT_MAX_SPLIT * HD) as u64,
    )?;
    let part_ms = dev.alloc_arena(
        "probe-trip-part-ms",
        4 * (N_HEAD * ATT_MAX_SPLIT * 2) as u64,
    )?;
    let host_part = dev.alloc_arena("probe-trip-host-part", 4 * (N_HEAD * (HD + 2)) as u64)?;
    let ints = dev.alloc_arena("probe-trip-ints", 256)?;
    let n_ctx = WINDOW as i32 + SPILLED as i32;
    // slot 0, position n_ctx - 1, n_ctx cells.
    dev.htod(&[0i32, n_ctx - 1, n_ctx], ints.view(0, 12)?)?;
    let heads = probe_heads(&small)?;
    // The spilled cells: one chunk, each cell this layer's K row then its V row (F16 0.5).
    let cell_bytes = 2 * row_bytes as usize;
    let chunk: Vec<u8> = [0x00u8, 0x38]
        .into_iter()
        .cycle()
        .take(SPILLED * cell_bytes)
        .collect();
    let chunks = [&chunk[..]];
    let cells = SpilledCells {
        chunks: &chunks,
        ty: GgmlType::F16,
        cell_bytes,
        per_chunk: SPILLED,
        resident: WINDOW as usize,
        per_slot: SPILLED,
        k_off: 0,
        v_off: row_bytes as usize,
        row_bytes: row_bytes as usize,
    };
    let kvl = KvLayer {
        kv: kv.all(),
        slot_bytes: layer,
        k_off: 0,
        v_off: WINDOW * row_bytes,
        row_bytes,
        cells: WINDOW,
        ty: KV_TY_F16,
        host: KvHostArg {
            chunk: [0; KVH_MAX_CHUNKS],
            cell_bytes: cell_bytes as i64,
            k_off: 0,
            v_off: row_bytes as i64,
            resident: WINDOW as i32,
            per_slot: SPILLED as i32,
            per_chunk: SPILLED as i32,
            cpu_part: 1,
        },
        slot: ints.view(0, 4)?,
        pos: ints.view(4, 4)?,
    };
    let side = AttnSide {
        h: heads,
        q: q.all(),
        kv: kvl,
        n_ctx: ints.view(8, 4)?,
        sp: Splits {
            n: strata_schemas::workset::att_splits(WINDOW as usize).min(ATT_MAX_SPLIT),
            part_o: part_o.all(),
            part_ms: part_ms.all(),
        },
        out: out.all(),
        part: host_part.all(),
        n: 1,
    };
    let threads = host_threads().max(1);
    let np = pieces(threads, N_HEAD_KV, SPILLED);
    let mut scratch = vec![0f32; scratch_len(1, N_HEAD, HD, np)];
    let (mut q_host, mut part) = (vec![0f32; N_HEAD * HD], vec![0f32; N_HEAD * (HD + 2)]);
    let (slot, ctx) = ([0u32], [n_ctx as u32]);
    let scale = 1.0 / (HD as f32).sqrt();
    let l = launcher(dev);
    let whole = median_trip(dev, &mut |_| {
        let mut partials = |qh: &[f32], p: &mut [f32]| {
            let (o, ms) = p.split_at_mut(N_HEAD * HD);
            let dims = (N_HEAD, N_HEAD_KV, HD);
            host_partials(
                &cells,
                dims,
                &slot,
                &ctx,
                qh,
                scale,
                np,
                &mut scratch,
                o,
                ms,
            )
            .map_err(|e| shape(e.to_string()))
        };
        host_round_trip(&l, side, (&mut q_host, &mut part), &mut partials)
    })?;
    let bytes = (SPILLED * cell_bytes) as f64;
    Ok(((whole - bytes / (host_gbps * 1e3)).max(0.0), whole))
}

/// `eager_launch_us`: µs per launch of [`EAGER_LAUNCHES`] one-row RMSNorms queued one by one
/// outside a graph (as a step with a host round trip launches its kernels) and waited for,
/// the best of five.
pub fn eager_launch_us(dev: &CudaDevice, cols: usize) -> Result<f64, CudaError> {
    let x = filled(dev, "probe-eager-x", 4 * cols as u64, 0)?;
    let w = filled(dev, "probe-eager-w", 4 * cols as u64, 0)?;
    let out = dev.alloc_arena("probe-eager-out", 4 * cols as u64)?;
    let l = launcher(dev);
    let mut best = f64::INFINITY;
    for _ in 0..6 {
        dev.synchronize()?;
        let t = Instant::now();
        for _ in 0..EAGER_LAUNCHES {
            rmsnorm(&l, x.all(), None, None, w.all(), out.all(), cols, 1e-6, 1)?;
        }
        dev.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64() * 1e6 / EAGER_LAUNCHES as f64);
    }
    Ok(best)
}
