//! Pinned (page-locked) host memory of the CUDA backend: one `cuMemHostAlloc` per planned
//! chunk ([`super::CudaDevice::alloc_pinned`]), readable by the device's copy engines at the
//! PCIe rate, freed on drop.
//! Invariant: a `PinnedHost` is never resized; whoever queues a copy from it keeps it alive
//! until the stream that copies has passed the copy (the expert cache synchronises its copy
//! stream before dropping its chunks).

use super::{drv, CudaError};
use cudarc::driver::sys;

/// One pinned host allocation of `len` bytes.
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
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
        let n = usize::try_from(len).map_err(|_| CudaError::Shape {
            op: "pinned host memory",
            detail: format!("{len} bytes do not fit this host's address space"),
        })?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: cuMemHostAlloc writes one pointer into `ptr`; the caller bound the context.
        unsafe { sys::cuMemHostAlloc(&mut ptr, n.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .result()
            .map_err(drv(format!("cuMemHostAlloc({len} bytes)")))?;
        Ok(Self {
            ptr: ptr.cast(),
            len: n,
        })
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
