//! Device arenas: one `cuMemAlloc` (or, on HIP, one `hipMalloc` owned by a `HipArena`) of
//! exactly the planned size per arena, and `DeviceView`s, (offset, len) windows into it that
//! are checked against the arena's size when made.
//! Invariant: a view never reaches past its arena's end, never outlives it, and the count of
//! arena allocations (`arena_allocations`) is exact, so a test can assert "one per arena".

use super::{drv, CudaError};
use cudarc::driver::{sys::CUdeviceptr, CudaContext};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// How many arena allocations this process has made (freed ones included).
pub fn arena_allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Who frees an arena's allocation.
enum Owner {
    Cuda(Arc<CudaContext>),
    /// The HIP arena frees itself when dropped.
    #[cfg(feature = "hip")]
    Hip(#[allow(dead_code)] crate::backend::hip::HipArena),
}

/// One planned device arena: a single device allocation of `size` bytes.
pub struct DeviceArena {
    name: String,
    ptr: CUdeviceptr,
    size: u64,
    owner: Owner,
}

impl std::fmt::Debug for DeviceArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceArena({} bytes `{}`)", self.size, self.name)
    }
}

impl DeviceArena {
    pub(crate) fn new(ctx: &Arc<CudaContext>, name: &str, size: u64) -> Result<Self, CudaError> {
        if size == 0 {
            return Err(CudaError::Shape {
                op: "alloc_arena",
                detail: format!("arena `{name}` has size 0; the plan must give it bytes"),
            });
        }
        let bytes = usize::try_from(size).map_err(|_| CudaError::Shape {
            op: "alloc_arena",
            detail: format!("arena `{name}` of {size} bytes does not fit this host's usize"),
        })?;
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: a plain cuMemAlloc with the context bound; the pointer is owned by the
        // returned arena and freed exactly once in Drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(drv(format!(
            "cuMemAlloc of {size} bytes for arena `{name}`"
        )))?;
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            name: name.to_string(),
            ptr,
            size,
            owner: Owner::Cuda(ctx.clone()),
        })
    }

    /// An arena over a HIP allocation (counted here too: one per planned arena, whatever
    /// the vendor).
    #[cfg(feature = "hip")]
    pub(crate) fn hip(a: crate::backend::hip::HipArena) -> Self {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        Self {
            name: a.name().to_string(),
            ptr: a.all().ptr(),
            size: a.size(),
            owner: Owner::Hip(a),
        }
    }

    /// The arena's planned name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The whole arena as one view.
    pub fn all(&self) -> DeviceView<'_> {
        DeviceView {
            ptr: self.ptr,
            len: self.size,
            _arena: PhantomData,
        }
    }

    /// The window `[offset, offset + len)`, refused when it reaches past the arena's end.
    pub fn view(&self, offset: u64, len: u64) -> Result<DeviceView<'_>, CudaError> {
        self.all()
            .sub(offset, len)
            .map_err(|_| CudaError::OutOfBounds {
                arena: self.name.clone(),
                offset,
                len,
                size: self.size,
            })
    }
}

impl Drop for DeviceArena {
    fn drop(&mut self) {
        match &self.owner {
            Owner::Cuda(ctx) => {
                // Errors on teardown cannot be reported from Drop; the context records them.
                ctx.record_err(ctx.bind_to_thread());
                // SAFETY: ptr came from malloc_sync in `new` and is freed only here; no view
                // outlives the arena (their lifetime is tied to &self).
                ctx.record_err(unsafe { cudarc::driver::result::free_sync(self.ptr) });
            }
            #[cfg(feature = "hip")]
            Owner::Hip(_) => {}
        }
    }
}

/// A bounds-checked window of an arena. Copyable: several ops may read one view; which op
/// may write it is the plan's business (device writes are ordered by the stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceView<'a> {
    ptr: CUdeviceptr,
    len: u64,
    _arena: PhantomData<&'a DeviceArena>,
}

impl<'a> DeviceView<'a> {
    /// Device address of the first byte.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the view holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sub-window `[offset, offset + len)` of this view.
    pub fn sub(&self, offset: u64, len: u64) -> Result<DeviceView<'a>, CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(DeviceView {
                ptr: self.ptr + offset,
                len,
                _arena: PhantomData,
            }),
            _ => Err(CudaError::OutOfBounds {
                arena: "(view)".into(),
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Checks the view holds exactly `len` bytes.
    pub(crate) fn expect_len(&self, op: &'static str, len: u64) -> Result<(), CudaError> {
        if self.len != len {
            return Err(CudaError::Shape {
                op,
                detail: format!("view of {} bytes where {len} are needed", self.len),
            });
        }
        Ok(())
    }

    /// Checks the view holds at least `len` bytes and starts `align`-aligned.
    pub(crate) fn expect(
        &self,
        op: &'static str,
        what: &str,
        len: u64,
        align: u64,
    ) -> Result<(), CudaError> {
        if self.len < len {
            return Err(CudaError::Shape {
                op,
                detail: format!("{what}: view of {} bytes where {len} are needed", self.len),
            });
        }
        if self.ptr % align != 0 {
            return Err(CudaError::Shape {
                op,
                detail: format!(
                    "{what}: view at {:#x} is not {align}-byte aligned",
                    self.ptr
                ),
            });
        }
        Ok(())
    }
}
