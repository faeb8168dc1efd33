//! Plan binding on the CPU backend: the start-up checks (plan vs. this machine), exactly one
//! arena per planned device and one buffer per planned pinned chunk, and bounds-checked views
//! of their regions.
//! Invariant: every byte the executor computes in lives in an allocation made here, all of
//! them made by [`Binding::allocate`] before any weight is read; `allocations()` counts them
//! and equals `devices + pinned chunks` of the plan. Nothing is sized from what is free.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use strata_schemas::plan::{Plan, RegionKind};

/// Alignment of every arena and chunk (a page: region offsets are 256-aligned inside).
pub const ARENA_ALIGN: usize = 4096;

/// Why a plan cannot be bound on this machine. Every message carries the numbers.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("device {index} ({name}) is vendor `{vendor}`: the CUDA/HIP backend is not built into this strata-exec; run a plan made for `vendor = \"cpu\"` devices (e.g. strata-plan --hardware plans/hardware/cpu.toml)")]
    NotCpu {
        index: u32,
        name: String,
        vendor: String,
    },
    #[error("device {index} was planned for arch `{planned}` but this machine is `{live}`: re-plan with a probe whose cpu devices say arch = \"{live}\"")]
    Arch {
        index: u32,
        planned: String,
        live: String,
    },
    #[error("the plan needs {needed} bytes of host memory (arenas {arenas} + pinned chunks {pinned} + experts kept in RAM from the model file {mapped}) but MemAvailable is {available}, {short} bytes short{}: free memory, or re-plan with `strata-exec probe` on this machine", planned_note(*.planned_available, *.available))]
    Memory {
        needed: u64,
        arenas: u64,
        pinned: u64,
        mapped: u64,
        available: u64,
        short: u64,
        /// `available_bytes` of the probe the plan was made for.
        planned_available: u64,
    },
    #[error("cannot read MemAvailable from /proc/meminfo: {0}")]
    MemInfo(String),
    #[error("allocating {bytes} bytes for {what} failed")]
    Alloc { what: String, bytes: u64 },
    #[error("device {device}: region {kind} [{offset}, +{bytes}) is not inside its arena of {arena} bytes (a corrupt or hand-edited plan)")]
    Region {
        device: u32,
        kind: &'static str,
        offset: u64,
        bytes: u64,
        arena: u64,
    },
    #[error("device {device}: [{offset}, +{bytes}) is outside its arena of {arena} bytes")]
    Range {
        device: u32,
        offset: u64,
        bytes: u64,
        arena: u64,
    },
    #[error("the plan has no device {0}")]
    NoDevice(u32),
    #[error("{0}")]
    Plan(String),
}

/// One zeroed, page-aligned host allocation.
#[derive(Debug)]
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: HostBuf owns its allocation exclusively (like a Box<[u8]>); views are handed out
// only through `&self`/`&mut self` methods or the documented unsafe carving below.
unsafe impl Send for HostBuf {}
// SAFETY: shared access only reads through `as_slice`.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    fn new(len: u64, what: &str) -> Result<Self, BindError> {
        let err = || BindError::Alloc {
            what: what.to_string(),
            bytes: len,
        };
        let n = usize::try_from(len).map_err(|_| err())?;
        if n == 0 {
            return Ok(Self {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        let layout = Layout::from_size_align(n, ARENA_ALIGN).map_err(|_| err())?;
        // SAFETY: layout has a non-zero size.
        let p = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(err)?;
        Ok(Self { ptr, len: n })
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialized (zeroed) bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A raw view of `[offset, offset+bytes)`, bounds-checked.
    fn raw(&self, offset: u64, bytes: u64) -> Option<RawView> {
        let end = offset.checked_add(bytes)?;
        if end > self.len as u64 {
            return None;
        }
        // SAFETY: offset <= len, so the pointer stays inside (or one past) the allocation.
        let p = unsafe { self.ptr.as_ptr().add(offset as usize) };
        Some(RawView {
            ptr: p,
            len: bytes as usize,
        })
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `new` with exactly this layout.
            unsafe {
                alloc::dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, ARENA_ALIGN),
                )
            }
        }
    }
}

/// A bounds-checked window into an arena or chunk, turned into a slice by the owner of the
/// [`Binding`] (which guarantees the binding outlives it and that mutable windows are
/// disjoint from every other live window).
#[derive(Debug, Clone, Copy)]
pub struct RawView {
    ptr: *mut u8,
    len: usize,
}

impl RawView {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// # Safety
    /// The binding this came from must outlive `'x`, and no `&mut` to these bytes may exist
    /// while the returned slice lives.
    pub unsafe fn slice<'x>(self) -> &'x [u8] {
        // SAFETY: bounds were checked when the view was made; liveness and aliasing are the
        // caller's contract above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// # Safety
    /// The binding this came from must outlive `'x`, and no other reference to these bytes
    /// may exist while the returned slice lives.
    pub unsafe fn slice_mut<'x>(self) -> &'x mut [u8] {
        // SAFETY: as for `slice`, with exclusivity promised by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// One planned device's arena.
#[derive(Debug)]
pub struct Arena {
    pub device: u32,
    buf: HostBuf,
}

/// One planned pinned chunk (on the CPU backend, ordinary page-aligned host memory).
#[derive(Debug)]
pub struct Chunk {
    pub purpose: String,
    pub device: u32,
    buf: HostBuf,
}

/// Every allocation of a bound plan.
#[derive(Debug)]
pub struct Binding {
    arenas: Vec<Arena>,
    chunks: Vec<Chunk>,
    regions: Vec<(u32, RegionKind, u64, u64)>,
    allocations: u64,
}

/// The part of the memory error that says when the plan was made for more memory.
fn planned_note(planned: u64, live: u64) -> String {
    if planned > live {
        format!(" (the plan was made for a probe with {planned} bytes available)")
    } else {
        String::new()
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
pub fn mem_available() -> Result<u64, BindError> {
    let text =
        std::fs::read_to_string("/proc/meminfo").map_err(|e| BindError::MemInfo(e.to_string()))?;
    parse_mem_available(&text).ok_or_else(|| BindError::MemInfo("no MemAvailable line".into()))
}

fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Bytes a plan makes this backend allocate: (arenas, pinned chunks).
pub fn planned_host_bytes(plan: &Plan) -> (u64, u64) {
    let arenas = plan.devices.iter().map(|d| d.arena_bytes).sum();
    let pinned = plan.host.pinned_chunks.iter().map(|c| c.bytes).sum();
    (arenas, pinned)
}

/// Checks that the plan's devices form one pipeline: contiguous layer ranges from 0 to
/// `n_layer`, the embedding on the first device and the head on the last. Every backend runs
/// a plan as one stage per device in this order.
pub fn check_pipeline(plan: &Plan, n_layer: u32) -> Result<(), String> {
    let mut next = 0u32;
    for (i, d) in plan.devices.iter().enumerate() {
        let first = i == 0;
        let last = i + 1 == plan.devices.len();
        if d.layer_first != next
            || d.layer_end <= d.layer_first
            || d.holds_embedding != first
            || d.holds_head != last
        {
            return Err(format!(
                "device {} holds layers [{}, {}) (embedding {}, head {}), which does not continue a pipeline at layer {next}",
                d.index, d.layer_first, d.layer_end, d.holds_embedding, d.holds_head
            ));
        }
        next = d.layer_end;
    }
    if next != n_layer {
        return Err(format!("the devices cover layers [0, {next}) of {n_layer}"));
    }
    Ok(())
}

/// The start-up check of a CPU plan against this machine: every device is a `cpu` device of
/// this arch, and `available` (MemAvailable) holds every arena and chunk plus the expert
/// bytes the plan keeps in RAM from the mmapped model file (unless the plan already lets
/// them page from disk).
pub fn check_hardware(plan: &Plan, available: u64) -> Result<(), BindError> {
    for d in &plan.devices {
        if d.vendor != "cpu" {
            return Err(BindError::NotCpu {
                index: d.index,
                name: d.name.clone(),
                vendor: d.vendor.clone(),
            });
        }
        if d.arch != std::env::consts::ARCH {
            return Err(BindError::Arch {
                index: d.index,
                planned: d.arch.clone(),
                live: std::env::consts::ARCH.into(),
            });
        }
    }
    let (arenas, pinned) = planned_host_bytes(plan);
    let mapped = if plan.host.experts_page_from_disk {
        0
    } else {
        plan.host.ram_required_bytes.saturating_sub(pinned)
    };
    let needed = arenas.saturating_add(pinned).saturating_add(mapped);
    if needed > available {
        return Err(BindError::Memory {
            needed,
            arenas,
            pinned,
            mapped,
            available,
            short: needed - available,
            planned_available: plan.host.ram_available_bytes,
        });
    }
    Ok(())
}

impl Binding {
    /// Allocate exactly the plan's arenas (one per device, `arena_bytes` each) and pinned
    /// chunks, after checking that every arena region lies inside its arena.
    pub fn allocate(plan: &Plan) -> Result<Self, BindError> {
        let mut regions = Vec::new();
        for d in &plan.devices {
            for r in d.regions.iter().filter(|r| r.kind.in_arena()) {
                let inside = r
                    .offset
                    .checked_add(r.bytes)
                    .is_some_and(|end| end <= d.arena_bytes);
                if !inside {
                    return Err(BindError::Region {
                        device: d.index,
                        kind: r.kind.as_str(),
                        offset: r.offset,
                        bytes: r.bytes,
                        arena: d.arena_bytes,
                    });
                }
                regions.push((d.index, r.kind, r.offset, r.bytes));
            }
        }
        let mut b = Binding {
            arenas: Vec::with_capacity(plan.devices.len()),
            chunks: Vec::with_capacity(plan.host.pinned_chunks.len()),
            regions,
            allocations: 0,
        };
        for d in &plan.devices {
            let buf = HostBuf::new(d.arena_bytes, &format!("the arena of device {}", d.index))?;
            b.allocations += 1;
            b.arenas.push(Arena {
                device: d.index,
                buf,
            });
        }
        for (i, c) in plan.host.pinned_chunks.iter().enumerate() {
            let buf = HostBuf::new(
                c.bytes,
                &format!("pinned chunk {i} ({} of device {})", c.purpose, c.device),
            )?;
            b.allocations += 1;
            b.chunks.push(Chunk {
                purpose: c.purpose.clone(),
                device: c.device,
                buf,
            });
        }
        Ok(b)
    }

    /// Allocations made: one per arena and one per chunk.
    pub fn allocations(&self) -> u64 {
        self.allocations
    }

    /// Bytes allocated in all.
    pub fn allocated_bytes(&self) -> u64 {
        self.arenas.iter().map(|a| a.buf.len()).sum::<u64>()
            + self.chunks.iter().map(|c| c.buf.len()).sum::<u64>()
    }

    pub fn arenas(&self) -> &[Arena] {
        &self.arenas
    }

    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    fn arena(&self, device: u32) -> Result<&HostBuf, BindError> {
        self.arenas
            .iter()
            .find(|a| a.device == device)
            .map(|a| &a.buf)
            .ok_or(BindError::NoDevice(device))
    }

    /// Arena bytes of `device`.
    pub fn arena_bytes(&self, device: u32) -> Result<&[u8], BindError> {
        Ok(self.arena(device)?.as_slice())
    }

    /// `[offset, offset+bytes)` of its arena as planned for `kind` on `device`, or `None`
    /// when the plan gives the device no such region.
    pub fn region(&self, device: u32, kind: RegionKind) -> Option<(u64, u64)> {
        self.regions
            .iter()
            .find(|r| r.0 == device && r.1 == kind)
            .map(|r| (r.2, r.3))
    }

    /// A checked raw window of `device`'s arena.
    pub fn arena_view(&self, device: u32, offset: u64, bytes: u64) -> Result<RawView, BindError> {
        let a = self.arena(device)?;
        a.raw(offset, bytes).ok_or(BindError::Range {
            device,
            offset,
            bytes,
            arena: a.len(),
        })
    }

    /// A checked raw window of a region (empty when the plan has no such region).
    pub fn region_view(&self, device: u32, kind: RegionKind) -> Result<RawView, BindError> {
        let (off, bytes) = self.region(device, kind).unwrap_or((0, 0));
        self.arena_view(device, off, bytes)
    }

    /// Raw windows of every chunk of `purpose` serving `device`, in plan order.
    pub fn chunk_views(&self, device: u32, purpose: &str) -> Vec<RawView> {
        self.chunks
            .iter()
            .filter(|c| c.device == device && c.purpose == purpose)
            .filter_map(|c| c.buf.raw(0, c.buf.len()))
            .collect()
    }

    /// Copy `data` into `device`'s arena at `offset` (weights at start-up).
    pub fn write(&mut self, device: u32, offset: u64, data: &[u8]) -> Result<(), BindError> {
        let a = self
            .arenas
            .iter_mut()
            .find(|a| a.device == device)
            .ok_or(BindError::NoDevice(device))?;
        let len = a.buf.len();
        let end = offset.checked_add(data.len() as u64).filter(|e| *e <= len);
        let Some(end) = end else {
            return Err(BindError::Range {
                device,
                offset,
                bytes: data.len() as u64,
                arena: len,
            });
        };
        a.buf.as_mut_slice()[offset as usize..end as usize].copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parses_kib() {
        let t = "MemTotal:  100 kB\nMemFree: 5 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(t), Some(2048 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert!(mem_available().unwrap() > 0);
    }

    #[test]
    fn a_plan_made_for_more_memory_is_refused_with_numbers() {
        const GIB: u64 = 1 << 30;
        let mut p = strata_schemas::planfile::testing::sample_plan();
        for d in &mut p.devices {
            d.vendor = "cpu".into();
            d.arch = std::env::consts::ARCH.into();
        }
        let (arenas, pinned) = planned_host_bytes(&p);
        // Planned on a probe with 8 GiB to spare, keeping 6 GiB of experts in RAM from the
        // model file; run where only 4 GiB are to spare.
        let planned = arenas + pinned + 8 * GIB;
        p.host.ram_available_bytes = planned;
        p.host.ram_required_bytes = pinned + 6 * GIB;
        p.host.experts_page_from_disk = false;
        let live = arenas + pinned + 4 * GIB;
        let e = check_hardware(&p, live).unwrap_err();
        assert!(
            matches!(e, BindError::Memory { mapped, short, .. } if mapped == 6 * GIB && short == 2 * GIB),
            "{e}"
        );
        let m = e.to_string();
        assert!(
            m.contains(&live.to_string())
                && m.contains(&format!("a probe with {planned} bytes available"))
                && m.contains("strata-exec probe"),
            "{m}"
        );
        // Enough memory: fine.
        assert!(check_hardware(&p, arenas + pinned + 6 * GIB).is_ok());
        // A plan that lets its experts page from disk needs only arenas and chunks.
        p.host.experts_page_from_disk = true;
        assert!(check_hardware(&p, arenas + pinned).is_ok());
    }

    #[test]
    fn views_are_bounds_checked() {
        let b = HostBuf::new(8192, "t").unwrap();
        assert_eq!(b.as_slice().len(), 8192);
        assert!(b.as_slice().iter().all(|x| *x == 0));
        assert_eq!(b.as_slice().as_ptr() as usize % ARENA_ALIGN, 0);
        assert!(b.raw(8000, 192).is_some());
        assert!(b.raw(8000, 193).is_none());
        assert!(b.raw(u64::MAX, 2).is_none());
        assert!(HostBuf::new(0, "empty").unwrap().is_empty());
    }
}
