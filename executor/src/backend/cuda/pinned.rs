//! Pinned (page-locked) host memory of the CUDA backend: one `cuMemHostAlloc` per planned
//! chunk ([`super::CudaDevice::alloc_pinned`]), readable by the device's copy engines at the
//! PCIe rate, or mapped into the device's address space too ([`PinnedHost::new_mapped`], the
//! KV cells beyond `--kv-resident`, which kernels read and write in place), freed on drop.
//! Invariant: a `PinnedHost` is never resized; whoever queues a copy from it keeps it alive
//! until the stream that copies has passed the copy (the expert cache synchronises its copy
//! stream before dropping its chunks).

use super::{drv, CudaError};
use cudarc::driver::sys;

/// One pinned host allocation of `len` bytes.
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    /// The device address of the first byte when mapped (`CU_MEMHOSTALLOC_DEVICEMAP`).
    dev_ptr: Option<u64>,
}

// SAFETY: the allocation is plain host memory owned by this value alone; `&self` hands out
// shared reads and `&mut self` exclusive writes, as for a `Vec<u8>`.
unsafe impl Send for PinnedHost {}
// SAFETY: as above: shared references only read.
unsafe impl Sync for PinnedHost {}

impl std::fmt::Debug for PinnedHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHost")
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedHost {
    /// Pins `len` bytes with `cuMemHostAlloc` (PORTABLE: pinned for every context) on the
    /// context current on this thread. The driver's refusal (a memlock limit, or no memory
    /// it can lock) comes back as the error.
    pub(crate) fn new(len: u64) -> Result<Self, CudaError> {
        Self::alloc(len, sys::CU_MEMHOSTALLOC_PORTABLE)
    }

    /// Pins `len` zeroed bytes mapped into the address space of the context current on this
    /// thread (PORTABLE | DEVICEMAP), so kernels of that context read and write them in place
    /// at the PCIe rate through [`PinnedHost::device_ptr`].
    pub(crate) fn new_mapped(len: u64) -> Result<Self, CudaError> {
        let mut p = Self::alloc(
            len,
            sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
        )?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: `p.ptr` is a live DEVICEMAP allocation of this context; the call writes one
        // device address into `d`.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p.ptr.cast(), 0) }
            .result()
            .map_err(drv(format!("cuMemHostGetDevicePointer({len} bytes)")))?;
        p.as_mut_slice().fill(0);
        p.dev_ptr = Some(d);
        Ok(p)
    }

    fn alloc(len: u64, flags: u32) -> Result<Self, CudaError> {
        let n = usize::try_from(len).map_err(|_| CudaError::Shape {
            op: "pinned host memory",
            detail: format!("{len} bytes do not fit this host's address space"),
        })?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: cuMemHostAlloc writes one pointer into `ptr`; the caller bound the context.
        unsafe { sys::cuMemHostAlloc(&mut ptr, n.max(1), flags) }
            .result()
            .map_err(drv(format!("cuMemHostAlloc({len} bytes)")))?;
        Ok(Self {
            ptr: ptr.cast(),
            len: n,
            dev_ptr: None,
        })
    }

    /// The device address of the first byte, when pinned with [`PinnedHost::new_mapped`].
    pub fn device_ptr(&self) -> Option<u64> {
        self.dev_ptr
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` bytes for the life of `self`; they are the driver's
        // anonymous pages (zero-filled by the OS, or written since), which any u8 may hold.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, borrowed exclusively through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once, here; the owner has
        // waited for every copy from it (the file's invariant).
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

/// Pinned host memory mapped into one device's address space, by the runtime of that device
/// (`cuMemHostAlloc` DEVICEMAP, or `hipHostMalloc` mapped): the planned `kv_spill` chunks.
pub enum MappedHost {
    Cuda(PinnedHost),
    #[cfg(feature = "hip")]
    Hip(crate::backend::hip::HipPinned, u64),
}

impl std::fmt::Debug for MappedHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedHost")
            .field("len", &self.len())
            .field("device_ptr", &self.device_ptr())
            .finish()
    }
}

impl MappedHost {
    /// The device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        match self {
            MappedHost::Cuda(p) => p.device_ptr().unwrap_or(0),
            #[cfg(feature = "hip")]
            MappedHost::Hip(_, d) => *d,
        }
    }

    pub fn len(&self) -> u64 {
        self.as_slice().len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        match self {
            MappedHost::Cuda(p) => p.as_slice(),
            #[cfg(feature = "hip")]
            MappedHost::Hip(p, _) => p.as_slice(),
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            MappedHost::Cuda(p) => p.as_mut_slice(),
            #[cfg(feature = "hip")]
            MappedHost::Hip(p, _) => p.as_mut_slice(),
        }
    }
}
