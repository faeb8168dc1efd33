//! The memlock probe: whether CUDA's pinned host memory counts against `ulimit -l`
//! (RLIMIT_MEMLOCK), measured by pinning more than the limit three ways — `cuMemHostAlloc`,
//! `cuMemHostRegister` of anonymous memory, and `cuMemHostRegister` (read-only) of a mapped
//! file, as the host expert tier would register the model file — and reading the process's
//! locked memory (`VmLck` in /proc/self/status) while each is held.
//! Invariant: reports what it saw (the driver's result and VmLck), never infers; every buffer
//! it pins is unpinned and freed before it returns.

use super::{drv, CudaError};
use cudarc::driver::sys;

/// What one way of pinning did.
#[derive(Debug, Clone, PartialEq)]
pub struct PinTrial {
    /// `cuMemHostAlloc`, `cuMemHostRegister(anonymous)`, `cuMemHostRegister(file, read-only)`.
    pub how: &'static str,
    pub bytes: u64,
    /// Ok, or the driver's error.
    pub result: Result<(), String>,
    /// VmLck before and while the memory is pinned (None: unreadable).
    pub vmlck_before: Option<u64>,
    pub vmlck_pinned: Option<u64>,
}

/// The probe's findings.
#[derive(Debug, Clone, PartialEq)]
pub struct MemlockReport {
    /// The soft RLIMIT_MEMLOCK (None: unlimited or unreadable).
    pub limit: Option<u64>,
    pub trials: Vec<PinTrial>,
}

/// `VmLck` of a /proc/self/status text, in bytes.
pub fn parse_vmlck(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmLck:"))?;
    let mut it = line["VmLck:".len()..].split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    match it.next() {
        Some("kB") => Some(n * 1024),
        None => Some(n),
        _ => None,
    }
}

fn vmlck() -> Option<u64> {
    parse_vmlck(&std::fs::read_to_string("/proc/self/status").ok()?)
}

fn memlock_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max locked memory"))?;
    line["Max locked memory".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Pin `bytes` three ways on GPU `ordinal`'s primary context (see the file's doc).
pub fn probe_memlock(ordinal: usize, bytes: u64) -> Result<MemlockReport, CudaError> {
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(drv("cuDevicePrimaryCtxRetain"))?;
    ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
    let len = bytes as usize;
    let mut trials = Vec::new();

    // 1. cuMemHostAlloc.
    let before = vmlck();
    let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: cuMemHostAlloc writes one pointer into `ptr`; the context is bound above.
    let r = unsafe { sys::cuMemHostAlloc(&mut ptr, len, 0) };
    let pinned = vmlck();
    if r == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: ptr came from cuMemHostAlloc just above and is freed once.
        unsafe { sys::cuMemFreeHost(ptr) };
    }
    trials.push(trial("cuMemHostAlloc", bytes, r, before, pinned));

    // 2. cuMemHostRegister of anonymous memory.
    let mut anon = memmap2::MmapMut::map_anon(len).map_err(|e| CudaError::Shape {
        op: "memlock probe",
        detail: format!("mmap of {len} anonymous bytes: {e}"),
    })?;
    anon.fill(1);
    let before = vmlck();
    // SAFETY: `anon` is a live mapping of `len` bytes that outlives the registration, which is
    // undone below before it is dropped.
    let r = unsafe { sys::cuMemHostRegister_v2(anon.as_mut_ptr().cast(), len, 0) };
    let pinned = vmlck();
    if r == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: registered just above; unregistered once.
        unsafe { sys::cuMemHostUnregister(anon.as_mut_ptr().cast()) };
    }
    trials.push(trial(
        "cuMemHostRegister(anonymous)",
        bytes,
        r,
        before,
        pinned,
    ));
    drop(anon);

    // 3. cuMemHostRegister (read-only) of a mapped file, as the model file would be.
    let path = std::env::temp_dir().join(format!("strata-memlock-{}", std::process::id()));
    let io = |what: &str, e: std::io::Error| CudaError::Shape {
        op: "memlock probe",
        detail: format!("{what} {}: {e}", path.display()),
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| io("create", e))?;
    let _ = std::fs::remove_file(&path);
    file.set_len(bytes).map_err(|e| io("extend", e))?;
    // SAFETY: the file was unlinked above, so only this process sees it, and it is not
    // resized while mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io("mmap", e))?;
    let before = vmlck();
    // SAFETY: `map` is a live read-only mapping of `len` bytes that outlives the
    // registration, which is undone below; READ_ONLY promises the device never writes it.
    let r = unsafe {
        sys::cuMemHostRegister_v2(
            map.as_ptr() as *mut std::ffi::c_void,
            len,
            sys::CU_MEMHOSTREGISTER_READ_ONLY,
        )
    };
    let pinned = vmlck();
    if r == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: registered just above; unregistered once.
        unsafe { sys::cuMemHostUnregister(map.as_ptr() as *mut std::ffi::c_void) };
    }
    trials.push(trial(
        "cuMemHostRegister(file, read-only)",
        bytes,
        r,
        before,
        pinned,
    ));
    Ok(MemlockReport {
        limit: memlock_limit(),
        trials,
    })
}

fn trial(
    how: &'static str,
    bytes: u64,
    r: sys::CUresult,
    vmlck_before: Option<u64>,
    vmlck_pinned: Option<u64>,
) -> PinTrial {
    PinTrial {
        how,
        bytes,
        result: if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{r:?}"))
        },
        vmlck_before,
        vmlck_pinned,
    }
}

impl MemlockReport {
    /// One line per trial and a verdict a person can act on.
    pub fn text(&self) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let mut s = format!(
            "memlock limit (ulimit -l): {}\n",
            self.limit
                .map_or("unlimited".to_string(), |l| format!("{:.1} MiB", mib(l)))
        );
        for t in &self.trials {
            let lck = match (t.vmlck_before, t.vmlck_pinned) {
                (Some(a), Some(b)) => format!("VmLck {:.1} -> {:.1} MiB", mib(a), mib(b)),
                _ => "VmLck unreadable".into(),
            };
            let over = self.limit.is_some_and(|l| t.bytes > l);
            s.push_str(&format!(
                "{}: {:.1} MiB{}: {}; {lck}\n",
                t.how,
                mib(t.bytes),
                if over { " (over the limit)" } else { "" },
                match &t.result {
                    Ok(()) => "pinned".to_string(),
                    Err(e) => format!("refused ({e})"),
                }
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmlck_reads_kib_lines() {
        assert_eq!(
            parse_vmlck("Name:\tx\nVmLck:\t    8192 kB\nVmPin:\t0 kB\n"),
            Some(8192 * 1024)
        );
        assert_eq!(parse_vmlck("Name:\tx\n"), None);
        assert_eq!(parse_vmlck("VmLck:\t12 MB\n"), None);
    }
}
