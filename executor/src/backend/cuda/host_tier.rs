//! The pinned host expert tier of a CUDA stage's expert cache: the plan's `experts` pinned
//! chunks (at most `--pinned-chunk-mib` each, never one big pinned allocation), filled at
//! load with every expert of the cached layers in the device layout (gate, up, down as a
//! slot holds them), and the copy stream that moves a miss from there into its slot in one
//! DMA at the PCIe rate, ordered against the compute stream by events.
//! Invariant: the chunks are written only while binding (before any copy is queued) and are
//! freed only after the copy stream is synchronised; a copy into a slot starts only after
//! every product that read the slot's previous expert (the group event of the slot's last
//! reader, or a host synchronisation since), and a product reads a slot only after the copy
//! that filled it (the compute stream waits on the copy event).

use super::pinned::PinnedHost;
use super::{layout, CudaDevice, CudaError, DeviceView};
use crate::load::HostModel;
use cudarc::driver::{CudaEvent, CudaStream};
use rayon::prelude::*;
use std::sync::Arc;
use strata_schemas::ggml::GgmlType;
use strata_schemas::plan::{pinned_expert_at, DevicePlan, Plan, PINNED_EXPERTS};

/// Group events kept for the copy stream to wait on (older groups are covered by the oldest).
const GROUP_EVENTS: usize = 4;

fn err(detail: impl Into<String>) -> CudaError {
    CudaError::Shape {
        op: "pinned expert tier",
        detail: detail.into(),
    }
}

/// The tier of one stage (see the file's doc).
pub(crate) struct PinnedTier {
    chunks: Vec<PinnedHost>,
    sizes: Vec<u64>,
    slot_bytes: u64,
    n_expert: u64,
    /// The cached layers, ascending: a layer's rank orders the tier.
    layers: Vec<u32>,
    copy: Arc<CudaStream>,
    /// Recorded on the copy stream after a group's copies, and after a prefetch's.
    copied: CudaEvent,
    prefetched: CudaEvent,
    /// (group, event recorded on the compute stream after that group's products).
    groups: Vec<(u64, CudaEvent)>,
    /// Per slot, the group that last read it (0: none since start-up).
    slot_read: Vec<u64>,
    /// The group being issued (groups count from 1) and the last one known finished (a
    /// host synchronisation of the compute stream since).
    pub(crate) group: u64,
    synced: u64,
    /// Bytes written into the chunks so far, and the bar that shows it.
    filled: u64,
    bar: indicatif::ProgressBar,
}

impl Drop for PinnedTier {
    fn drop(&mut self) {
        // No copy may still read a chunk when it is freed.
        self.quiesce();
    }
}

impl PinnedTier {
    /// The tier of planned device `dp` over its pinned `chunks` ([`pin_chunks`]), serving
    /// `layers` (ascending); an error naming the plan when the chunks cannot hold them.
    pub(crate) fn new(
        dp: &DevicePlan,
        dev: &CudaDevice,
        chunks: Vec<PinnedHost>,
        layers: Vec<u32>,
        n_expert: u64,
    ) -> Result<Self, CudaError> {
        let sizes: Vec<u64> = chunks.iter().map(|c| c.len()).collect();
        let (slot_bytes, n) = (dp.expert_slot_bytes, layers.len() as u64 * n_expert);
        if n > 0 && pinned_expert_at(&sizes, slot_bytes, n - 1).is_none() {
            return Err(err(format!(
                "device {}: the plan's {} `{PINNED_EXPERTS}` chunks ({} bytes) cannot hold the {n} experts of {} bytes of its cached layers: re-plan with this strata-plan",
                dp.index,
                sizes.len(),
                sizes.iter().sum::<u64>(),
                slot_bytes
            )));
        }
        let total: u64 = sizes.iter().sum();
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(n * slot_bytes),
            indicatif::ProgressDrawTarget::stderr(),
        );
        bar.set_message(format!("device {}: pinned host experts", dp.index));
        eprintln!(
            "device {}: host expert tier pinned: {total} bytes in {} chunk(s); misses copy from it on a copy stream",
            dp.index,
            chunks.len()
        );
        Ok(Self {
            chunks,
            sizes,
            slot_bytes,
            n_expert,
            layers,
            copy: dev.new_stream()?,
            copied: dev.new_sync_event()?,
            prefetched: dev.new_sync_event()?,
            groups: Vec::with_capacity(GROUP_EVENTS),
            slot_read: vec![0; dp.expert_cache_slots as usize],
            group: 1,
            synced: 0,
            filled: 0,
            bar,
        })
    }

    /// Wait for every copy queued on the copy stream.
    pub(crate) fn quiesce(&self) {
        let _ = self.copy.synchronize();
    }

    /// The pinned chunks and their bytes.
    pub(crate) fn chunks(&self) -> (u64, u64) {
        (self.chunks.len() as u64, self.sizes.iter().sum())
    }

    /// (chunk, byte offset) of expert `x` of `layer`.
    fn locate(&self, layer: u32, x: u32) -> Result<(usize, u64), CudaError> {
        let rank = self
            .layers
            .binary_search(&layer)
            .map_err(|_| err(format!("layer {layer} is not in the tier")))?;
        let index = rank as u64 * self.n_expert + u64::from(x);
        pinned_expert_at(&self.sizes, self.slot_bytes, index)
            .ok_or_else(|| err(format!("expert {x} of layer {layer} is in no chunk")))
    }

    /// Copy every expert of `layer` from the host stacks into the tier, in the device layout
    /// (`mats`: gate, up, down as (type, rows, cols, bytes of one expert)).
    pub(crate) fn fill_layer(
        &mut self,
        host: &dyn HostModel,
        layer: u32,
        mats: [(GgmlType, usize, usize, u64); 3],
    ) -> Result<(), CudaError> {
        let mut stacks = Vec::with_capacity(3);
        for part in ["gate", "up", "down"] {
            let name = format!("blk.{layer}.ffn_{part}_exps.weight");
            stacks.push(
                host.tensor_bytes(&name)
                    .ok_or_else(|| err(format!("`{name}` is missing from the model")))?,
            );
        }
        let sb = self.slot_bytes as usize;
        let per: u64 = mats.iter().map(|m| m.3).sum();
        // The layer's experts are consecutive in the tier: fill each chunk's run in parallel.
        let mut x = 0u32;
        while u64::from(x) < self.n_expert {
            let (c, at) = self.locate(layer, x)?;
            let room = ((self.sizes[c] - at) / self.slot_bytes).min(self.n_expert - u64::from(x));
            let run =
                &mut self.chunks[c].as_mut_slice()[at as usize..at as usize + room as usize * sb];
            run.par_chunks_mut(sb)
                .enumerate()
                .try_for_each(|(j, dst)| {
                    write_expert(&stacks, mats, x as usize + j, &mut dst[..per as usize])
                })?;
            x += room as u32;
        }
        self.filled += self.n_expert * self.slot_bytes;
        self.bar.set_position(self.filled);
        if self.filled >= self.layers.len() as u64 * self.n_expert * self.slot_bytes {
            self.bar.finish_and_clear();
        }
        Ok(())
    }

    /// Before a group's copies: make the copy stream wait for the products that last read
    /// `slots` (the group events), unless a host synchronisation already covered them.
    pub(crate) fn order_after_readers(
        &self,
        dev: &CudaDevice,
        slots: impl Iterator<Item = u32>,
    ) -> Result<(), CudaError> {
        let need = slots
            .map(|s| self.slot_read.get(s as usize).copied().unwrap_or(0))
            .max()
            .unwrap_or(0);
        if need <= self.synced {
            return Ok(());
        }
        // The earliest recorded group at or after `need` (stream order: it implies `need`),
        // else the oldest kept, which is later than `need`'s.
        let ev = self
            .groups
            .iter()
            .filter(|(g, _)| *g >= need)
            .min_by_key(|(g, _)| *g)
            .or_else(|| self.groups.iter().min_by_key(|(g, _)| *g))
            .ok_or_else(|| err("a slot read by a group with no recorded event"))?;
        dev.wait_on(&self.copy, &ev.1)
    }

    /// Queue the copy of expert `x` of `layer` (`bytes` of it) into `dst` on the copy
    /// stream.
    pub(crate) fn copy_expert(
        &self,
        dev: &CudaDevice,
        layer: u32,
        x: u32,
        dst: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        let (c, at) = self.locate(layer, x)?;
        // SAFETY: the chunk lives as long as `self`, whose Drop synchronises the copy stream
        // first, and it is never written after binding (the file's invariant).
        unsafe { dev.copy_pinned_async(&self.chunks[c], at, dst, &self.copy) }
    }

    /// After a group's copies: the compute stream waits for them.
    pub(crate) fn copies_done(&self, dev: &CudaDevice) -> Result<(), CudaError> {
        dev.record_on(&self.copied, &self.copy)?;
        dev.wait_on(dev.stream()?, &self.copied)
    }

    /// After a prefetch's copies: recorded, the compute stream waits only at
    /// [`Self::await_prefetch`] (before the products of the layer fetched).
    pub(crate) fn prefetch_done(&self, dev: &CudaDevice) -> Result<(), CudaError> {
        dev.record_on(&self.prefetched, &self.copy)
    }

    pub(crate) fn await_prefetch(&self, dev: &CudaDevice) -> Result<(), CudaError> {
        dev.wait_on(dev.stream()?, &self.prefetched)
    }

    /// The group being issued reads `slot`.
    pub(crate) fn reads(&mut self, slot: u32) {
        if let Some(r) = self.slot_read.get_mut(slot as usize) {
            *r = self.group;
        }
    }

    /// After a group's products: record its event on the compute stream, start the next.
    pub(crate) fn group_done(&mut self, dev: &CudaDevice) -> Result<(), CudaError> {
        if self.groups.len() < GROUP_EVENTS {
            self.groups.push((self.group, dev.new_sync_event()?));
        } else if let Some(oldest) = self.groups.iter_mut().min_by_key(|(g, _)| *g) {
            oldest.0 = self.group;
        }
        let ev = self
            .groups
            .iter()
            .find(|(g, _)| *g == self.group)
            .ok_or_else(|| err("group event"))?;
        dev.record_on(&ev.1, dev.stream()?)?;
        self.group += 1;
        Ok(())
    }

    /// The host waited for the compute stream: every group issued so far has finished.
    pub(crate) fn synchronised(&mut self) {
        self.synced = self.group - 1;
    }
}

/// The plan's `experts` pinned chunks of planned device `dp`, pinned now (before any weight
/// is read, with the arenas); None when the plan pins none for it, or when the driver refuses
/// one (a warning then names `ulimit -l`, and the misses read the mapped model file, as a
/// plan without the tier does).
pub(crate) fn pin_chunks(
    plan: &Plan,
    dp: &DevicePlan,
    dev: &CudaDevice,
) -> Option<Vec<PinnedHost>> {
    let sizes: Vec<u64> = plan
        .host
        .pinned_chunks
        .iter()
        .filter(|c| c.device == dp.index && c.purpose == PINNED_EXPERTS)
        .map(|c| c.bytes)
        .collect();
    let total: u64 = sizes.iter().sum();
    // Live RAM against the plan's: pinning past MemAvailable would push the model file's
    // pages and everything else out (1 GiB left, as the planner's headroom).
    if let Ok(avail) = crate::bind::mem_available() {
        if total > 0 && total.saturating_add(1 << 30) > avail {
            eprintln!(
                "warning: device {}: the planned host expert tier takes {total} bytes of pinned memory but MemAvailable is {avail}; expert misses copy from the mapped model file instead (pageable memory, several times slower). Free host RAM, or re-plan with a probe of this machine (`strata-exec probe`)",
                dp.index
            );
            return None;
        }
    }
    let mut chunks = Vec::with_capacity(sizes.len());
    for (i, &b) in sizes.iter().enumerate() {
        match dev.alloc_pinned(b) {
            Ok(c) => chunks.push(c),
            Err(e) => {
                eprintln!(
                    "warning: device {}: pinning the host expert tier failed at chunk {i} of {} ({b} bytes): {e}; expert misses copy from the mapped model file instead (pageable memory, several times slower). Raise the locked-memory limit (`ulimit -l unlimited`, or memlock in /etc/security/limits.conf), free host RAM, or re-plan with a smaller --pinned-chunk-mib",
                    dp.index,
                    sizes.len()
                );
                return None;
            }
        }
    }
    (!chunks.is_empty()).then_some(chunks)
}

/// Write expert `x`'s gate, up and down (device layout) into `dst` (their bytes).
fn write_expert(
    stacks: &[&[u8]],
    mats: [(GgmlType, usize, usize, u64); 3],
    x: usize,
    dst: &mut [u8],
) -> Result<(), CudaError> {
    let mut off = 0usize;
    for (stack, (ty, rows, cols, per)) in stacks.iter().zip(mats) {
        let per = per as usize;
        let src = stack
            .get(x * per..(x + 1) * per)
            .ok_or_else(|| err(format!("an expert stack holds no expert {x}")))?;
        let out = &mut dst[off..off + per];
        if layout::is_rearranged(ty) {
            layout::to_device(ty, src, 1, rows, cols, out).map_err(|e| err(e.to_string()))?;
        } else {
            out.copy_from_slice(src);
        }
        off += per;
    }
    Ok(())
}
