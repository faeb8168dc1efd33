//! KV cells beyond `--kv-resident` on a GPU stage: the layout of the device's planned
//! `kv_spill` pinned chunks ([`SpillLayout`]: spilled cell `i = slot * (ctx - W) + (c - W)`
//! of cell `c >= W`, whole planner cells per chunk), the chunks pinned and mapped into the
//! device's address space ([`KvSpill`]), and [`KvHostArg`], the kernel argument through which
//! the KV store and attention kernels read and write those cells in place (kernels/cuda
//! common.cuh's `KvHost` and `kvh_row`). Under `--kv-host cpu` the host CPU attends them
//! instead in decode passes (`kv_host_attn.rs`).
//! Invariant: the chunks are exactly the plan's (count and bytes, pinned before any weight is
//! read) and outlive every kernel that addresses them (the stage owns them and synchronises
//! before dropping); [`SpillLayout::cell`] is the host mirror of `kvh_row`'s arithmetic.

use super::launch::KernelArg;
use super::pinned::MappedHost;
use super::{CudaDevice, CudaError};
use strata_kernels::consts::KVH_MAX_CHUNKS;

const MIB: u64 = 1 << 20;

/// The kernels' `KvHost` (common.cuh), field for field: passed by value to `dq_kv_store`,
/// `dq_rope_store`, `dq_attn_gqa` and `dq_attn_prefill`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvHostArg {
    /// Device addresses of the mapped chunks (unused entries 0).
    pub chunk: [u64; KVH_MAX_CHUNKS],
    /// Bytes of one spilled cell (every KV layer of the stage, plus the planner's MTP tail).
    pub cell_bytes: i64,
    /// This launch's layer's K and V rows inside a spilled cell.
    pub k_off: i64,
    pub v_off: i64,
    /// Cells `[0, resident)` of a slot live in VRAM.
    pub resident: i32,
    /// Spilled cells per slot (0: none).
    pub per_slot: i32,
    /// Cells per chunk (every chunk but the last holds exactly this many).
    pub per_chunk: i32,
    /// 1: the host CPU attends the cells past `resident` (`--kv-host cpu`, set by
    /// `kv_host_attn` for its `dq_attn_gqa` launch only): the kernel walks the window alone.
    pub cpu_part: i32,
}

impl KernelArg for KvHostArg {}

impl KvHostArg {
    /// Nothing spilled: every cell of a slot is in its VRAM rows.
    pub fn none() -> Self {
        Self {
            chunk: [0; KVH_MAX_CHUNKS],
            cell_bytes: 0,
            k_off: 0,
            v_off: 0,
            resident: i32::MAX,
            per_slot: 0,
            per_chunk: 1,
            cpu_part: 0,
        }
    }

    /// Whether some cells live in host memory.
    pub fn spills(&self) -> bool {
        self.per_slot > 0
    }
}

/// Where a stage's spilled KV cells lie in its planned `kv_spill` chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpillLayout {
    /// Cells per slot in VRAM (`W`).
    pub resident: u64,
    /// Cells per slot in host memory (`ctx - W`).
    pub per_slot: u64,
    /// Bytes of one spilled cell (the planner's granule).
    pub cell_bytes: u64,
    /// Cells of every chunk but the last.
    pub per_chunk: u64,
    /// The planned chunks' bytes, in plan order.
    pub chunk_bytes: Vec<u64>,
}

impl SpillLayout {
    /// The layout of `slots` slots of `ctx` cells with `resident` in VRAM over the planned
    /// `chunk_bytes`, whose cells each hold at least `main_cell` bytes (K and V rows of every
    /// full-attention layer of the stage). `None` when nothing spills; an error naming the fix
    /// when the chunks do not hold the cells as this engine lays them out.
    pub fn new(
        chunk_bytes: Vec<u64>,
        slots: u64,
        ctx: u64,
        resident: u64,
        main_cell: u64,
    ) -> Result<Option<Self>, String> {
        if resident >= ctx || slots == 0 {
            return Ok(None);
        }
        let per_slot = ctx - resident;
        let cells = slots * per_slot;
        let total: u64 = chunk_bytes.iter().sum();
        let stale = "re-plan with this build's strata-plan";
        if total == 0 || total % cells != 0 {
            return Err(format!(
                "the plan's kv_spill chunks hold {total} bytes, not a whole number of cells for {slots} slots x {per_slot} cells beyond --kv-resident {resident}: {stale}"
            ));
        }
        let cell_bytes = total / cells;
        if cell_bytes < main_cell || cell_bytes % 2 != 0 {
            return Err(format!(
                "the plan's kv_spill cells hold {cell_bytes} bytes but a cell of this stage's KV layers needs {main_cell} (2-byte aligned): {stale}"
            ));
        }
        let per_chunk = chunk_bytes[0] / cell_bytes;
        let n = chunk_bytes.len();
        let whole = chunk_bytes.iter().all(|b| b % cell_bytes == 0 && *b > 0);
        let even = chunk_bytes[..n - 1].iter().all(|b| *b == chunk_bytes[0]);
        if !whole || !even || chunk_bytes[n - 1] > chunk_bytes[0] {
            return Err(format!(
                "the plan's kv_spill chunks ({chunk_bytes:?} bytes) are not equal runs of whole {cell_bytes}-byte cells: {stale}"
            ));
        }
        if n > KVH_MAX_CHUNKS {
            let mib = total.div_ceil(KVH_MAX_CHUNKS as u64 * MIB);
            return Err(format!(
                "the plan pins this device's KV beyond --kv-resident {resident} in {n} kv_spill chunks; the GPU kernels address at most {KVH_MAX_CHUNKS}: re-plan with --pinned-chunk-mib {mib} or more, or a larger --kv-resident"
            ));
        }
        let i32_ok = |v: u64| i32::try_from(v).is_ok();
        if !(i32_ok(resident)
            && i32_ok(per_slot)
            && i32_ok(per_chunk)
            && i64::try_from(total).is_ok())
        {
            return Err(format!(
                "--kv-resident {resident} of a context of {ctx}: the GPU kernels count cells in 32 bits"
            ));
        }
        Ok(Some(Self {
            resident,
            per_slot,
            cell_bytes,
            per_chunk,
            chunk_bytes,
        }))
    }

    /// (chunk, byte offset) of spilled cell `c` (`c >= resident`) of `slot`: the host mirror
    /// of the kernels' `kvh_row` (before the layer's row offset).
    pub fn cell(&self, slot: u64, c: u64) -> (usize, u64) {
        let i = slot * self.per_slot + (c - self.resident);
        (
            (i / self.per_chunk) as usize,
            (i % self.per_chunk) * self.cell_bytes,
        )
    }
}

/// A stage's spilled KV: its planned chunks, pinned and mapped into the device, and the host
/// half of its decode attention when the CPU attends those cells (`--kv-host cpu`).
#[derive(Debug)]
pub struct KvSpill {
    pub layout: SpillLayout,
    chunks: Vec<MappedHost>,
    pub(crate) cpu: Option<std::sync::Mutex<super::kv_host_attn::KvHostCpu>>,
}

impl KvSpill {
    /// Pins and maps every chunk of `layout` on `dev` (zeroed), or the driver's refusal with
    /// the limits to raise.
    pub fn pin(dev: &CudaDevice, layout: SpillLayout) -> Result<Self, CudaError> {
        let n = layout.chunk_bytes.len();
        let mut chunks = Vec::with_capacity(n);
        for (i, &b) in layout.chunk_bytes.iter().enumerate() {
            let c = dev.alloc_pinned_mapped(b).map_err(|e| CudaError::Shape {
                op: "kv_spill",
                detail: format!(
                    "pinning KV chunk {i} of {n} ({b} bytes, cells beyond --kv-resident) failed: {e}; raise the locked-memory limit (`ulimit -l unlimited`), free host RAM, or re-plan with a larger --kv-resident"
                ),
            })?;
            chunks.push(c);
        }
        Ok(Self {
            layout,
            chunks,
            cpu: None,
        })
    }

    /// The kernel argument for KV layer `l` (of the stage's full-attention layers) with rows
    /// of `row_bytes`.
    pub fn arg(&self, l: usize, row_bytes: u64) -> KvHostArg {
        let mut a = KvHostArg::none();
        for (slot, c) in a.chunk.iter_mut().zip(&self.chunks) {
            *slot = c.device_ptr();
        }
        let y = &self.layout;
        a.cell_bytes = y.cell_bytes as i64;
        a.k_off = (2 * l as u64 * row_bytes) as i64;
        a.v_off = ((2 * l as u64 + 1) * row_bytes) as i64;
        a.resident = y.resident as i32;
        a.per_slot = y.per_slot as i32;
        a.per_chunk = y.per_chunk as i32;
        a
    }

    /// The chunks' host bytes, in plan order: what the host CPU reads the spilled cells from.
    /// Only kernels that read them may run meanwhile (the caller's synchronisation).
    pub fn chunk_slices(&self) -> Vec<&[u8]> {
        self.chunks.iter().map(|c| c.as_slice()).collect()
    }

    /// Chunks and bytes pinned.
    pub fn pinned(&self) -> (u64, u64) {
        (
            self.chunks.len() as u64,
            self.chunks.iter().map(|c| c.len()).sum(),
        )
    }

    /// Copies slot `from`'s spilled cells `[resident, cells)` into slot `to`'s. The caller
    /// has waited for every kernel that may touch them.
    pub fn copy_cells(&mut self, from: u64, to: u64, cells: u64) {
        let y = self.layout.clone();
        for c in y.resident..cells.min(y.resident + y.per_slot) {
            let (fc, fo) = y.cell(from, c);
            let (tc, to_) = y.cell(to, c);
            let n = y.cell_bytes as usize;
            let mut buf = vec![0u8; n];
            buf.copy_from_slice(&self.chunks[fc].as_slice()[fo as usize..fo as usize + n]);
            self.chunks[tc].as_mut_slice()[to_ as usize..to_ as usize + n].copy_from_slice(&buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The planner's chunking (`push_chunks`): runs of whole cells up to `max` bytes.
    fn chunks(bytes: u64, max: u64, cell: u64) -> Vec<u64> {
        let per = (max / cell).max(1) * cell;
        let mut out = Vec::new();
        let mut left = bytes;
        while left > 0 {
            out.push(left.min(per));
            left -= left.min(per);
        }
        out
    }

    #[test]
    fn every_spilled_cell_has_its_own_place_inside_a_chunk() {
        let (slots, ctx, w, cell) = (3u64, 200u64, 64u64, 4 * 96 + 34);
        let c = chunks(slots * (ctx - w) * cell, 50 * cell + 7, cell);
        let y = SpillLayout::new(c.clone(), slots, ctx, w, 4 * 96)
            .unwrap()
            .unwrap();
        assert_eq!((y.cell_bytes, y.per_chunk, y.per_slot), (cell, 50, ctx - w));
        let mut seen = std::collections::BTreeSet::new();
        for s in 0..slots {
            for p in w..ctx {
                let (ch, off) = y.cell(s, p);
                assert!(off + cell <= c[ch], "slot {s} cell {p} past chunk {ch}");
                assert!(seen.insert((ch, off)), "slot {s} cell {p} shares a place");
            }
        }
        assert_eq!(seen.len() as u64, slots * (ctx - w));
    }

    #[test]
    fn the_capability_table_knows_the_kernels_chunk_limit() {
        use strata_schemas::capability::{capability, Backend};
        for b in [Backend::Cuda, Backend::Hip] {
            assert_eq!(
                capability(b).kv_spill_chunks_max,
                Some(KVH_MAX_CHUNKS as u64)
            );
        }
    }

    #[test]
    fn nothing_spills_when_the_window_is_the_context() {
        assert_eq!(SpillLayout::new(vec![], 2, 128, 128, 64).unwrap(), None);
    }

    #[test]
    fn too_many_chunks_name_the_pinned_chunk_flag() {
        let cell = 1024u64;
        let c = vec![cell; KVH_MAX_CHUNKS + 1];
        let e = SpillLayout::new(c, 1, (KVH_MAX_CHUNKS + 1) as u64 + 8, 8, cell).unwrap_err();
        assert!(e.contains("--pinned-chunk-mib"), "{e}");
        let short = SpillLayout::new(vec![3 * cell], 2, 10, 8, cell).unwrap_err();
        assert!(short.contains("re-plan"), "{short}");
    }

    /// One head's attention over scores `s` and values `v` (rows of `d`), by the split
    /// partials (max, sum, unnormalised output) of `cuts` and the flash-decoding merge
    /// `dq_attn_combine` does: exp(m_i - M) weights on each partial's sum and output.
    fn split_merge(s: &[f32], v: &[Vec<f32>], cuts: &[usize]) -> Vec<f32> {
        let d = v[0].len();
        let mut parts = Vec::new();
        let bounds: Vec<usize> = std::iter::once(0)
            .chain(cuts.iter().copied())
            .chain(std::iter::once(s.len()))
            .collect();
        for w in bounds.windows(2) {
            let (a, b) = (w[0], w[1]);
            let m = s[a..b].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut o = vec![0.0f32; d];
            let mut l = 0.0f32;
            for c in a..b {
                let p = (s[c] - m).exp();
                l += p;
                for (oi, vi) in o.iter_mut().zip(&v[c]) {
                    *oi += p * vi;
                }
            }
            parts.push((m, l, o));
        }
        let mm = parts.iter().map(|p| p.0).fold(f32::NEG_INFINITY, f32::max);
        let mut out = vec![0.0f32; d];
        let mut l = 0.0f32;
        for (m, pl, o) in &parts {
            let w = (m - mm).exp();
            l += w * pl;
            for (x, oi) in out.iter_mut().zip(o) {
                *x += w * oi;
            }
        }
        out.iter().map(|x| x / l).collect()
    }

    #[test]
    fn resident_and_host_partials_merge_to_the_whole_softmax() {
        let n = 97;
        // Scores spread over a wide range, so the two ranges' maxima differ a lot.
        let s: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 1.7)
            .collect();
        let v: Vec<Vec<f32>> = (0..n)
            .map(|i| {
                (0..8)
                    .map(|j| ((i * 7 + j * 3) % 13) as f32 * 0.25 - 1.5)
                    .collect()
            })
            .collect();
        let whole = split_merge(&s, &v, &[]);
        // The window W = 40 splits the cells into the VRAM range and the host range; the
        // kernel's own splits may also straddle W.
        for cuts in [vec![40], vec![16, 40, 72], vec![25, 50, 75]] {
            let merged = split_merge(&s, &v, &cuts);
            for (a, b) in whole.iter().zip(&merged) {
                assert!(
                    (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                    "{cuts:?}: {a} vs {b}"
                );
            }
        }
        // And both equal the direct softmax.
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
        for j in 0..8 {
            let want: f32 = (0..n).map(|c| (s[c] - m).exp() / z * v[c][j]).sum();
            assert!(
                (want - whole[j]).abs() <= 1e-5,
                "dim {j}: {want} vs {}",
                whole[j]
            );
        }
    }
}
