//! The hand-off of the hidden state from one stage of a layer split to the next. Stages that
//! share one device object (every planned device on one `--gpu`) copy on their common
//! stream. Stages on device objects of their own (`--device-map`) order the copy with an
//! event: a peer copy (`cuMemcpyPeerAsync`, or on HIP a `hipMemcpyAsync` between the two
//! devices' addresses; direct when the GPUs can reach each other), or a copy staged through
//! pinned host memory, which the plan's `staging` chunks of the receiving device must hold.
//! Invariant: the receiving stream starts nothing that reads the copied state before the
//! sending stream's writes to it are complete, and a staged buffer is reused only after the
//! host has synchronised the step that filled it.

use super::runtime::Runtime;
use super::{drv, CudaDevice, CudaError};
use cudarc::driver::sys;

/// How stages on separate device objects hand over the hidden state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HandoffPolicy {
    /// What the plan chose for the receiving device (`handoff_in`: a peer copy where the
    /// probe said the GPUs reach each other, else pinned host memory); a peer copy when both
    /// stages are on the same GPU.
    #[default]
    Auto,
    /// Always a peer copy (the driver stages it itself when there is no direct path).
    Peer,
    /// Always through pinned host memory (what a machine without peer access does; on one
    /// GPU it exercises that path).
    Host,
}

/// Pinned host memory for a staged hand-off, usable from every context (CUDA) or device
/// (HIP).
pub(crate) struct PinnedBuf {
    ptr: *mut std::ffi::c_void,
    bytes: usize,
    /// On HIP the buffer frees itself.
    #[cfg(feature = "hip")]
    hip: Option<crate::backend::hip::HipPinned>,
}

// SAFETY: the buffer is plain host memory owned by this value alone; the engine that holds it
// uses it from one thread at a time (`&mut self` steps), and the driver accepts it from any
// thread because it was allocated portable.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    fn new(to: &CudaDevice, bytes: usize) -> Result<Self, CudaError> {
        #[cfg(feature = "hip")]
        if let Runtime::Hip(h) = &to.rt {
            let mut b = h.alloc_pinned_portable(bytes)?;
            return Ok(Self {
                ptr: b.as_mut_slice().as_mut_ptr().cast(),
                bytes,
                hip: Some(b),
            });
        }
        to.ctx_bind()?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: cuMemHostAlloc writes one pointer into `ptr`; the context is bound above.
        // PORTABLE makes the memory pinned for every context, not only this one.
        unsafe { sys::cuMemHostAlloc(&mut ptr, bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .result()
            .map_err(drv(format!(
                "cuMemHostAlloc({bytes} bytes of hand-off staging)"
            )))?;
        Ok(Self {
            ptr,
            bytes,
            #[cfg(feature = "hip")]
            hip: None,
        })
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        #[cfg(feature = "hip")]
        if self.hip.is_some() {
            return;
        }
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once; the engine synchronises
        // its streams before it drops, so no copy still reads or writes it.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr) };
    }
}

/// How one stage boundary hands over.
pub(crate) enum Link {
    /// Both stages on one device object: a copy on its stream.
    Same,
    /// A peer copy on the receiving stream after an event of the sending one.
    Peer,
    /// Device to pinned host on the sending stream, host to device on the receiving one.
    Host(PinnedBuf),
}

impl Link {
    /// The link from `from` to `to` for hand-offs of up to `bytes`. `shared`: both stages use
    /// the same device object; `planned`: the plan's `handoff_in` of the receiving device.
    pub(crate) fn choose(
        policy: HandoffPolicy,
        from: &CudaDevice,
        to: &CudaDevice,
        shared: bool,
        planned: &str,
        bytes: u64,
    ) -> Result<Self, CudaError> {
        if shared {
            return Ok(Link::Same);
        }
        let same_gpu = from.ordinal() == to.ordinal();
        let peer = match policy {
            HandoffPolicy::Host => false,
            HandoffPolicy::Peer => true,
            HandoffPolicy::Auto => same_gpu || planned == "peer",
        };
        if !peer {
            return Ok(Link::Host(pinned(to, bytes)?));
        }
        // Direct access where the GPUs allow it; else the driver stages the peer copy.
        if !same_gpu && can_access_peer(to, from)? {
            enable_peer_access(to, from)?;
        }
        Ok(Link::Peer)
    }

    /// What the link does, for reports: `same stream`, `peer copy` or `pinned host`.
    pub fn kind(&self) -> &'static str {
        match self {
            Link::Same => "same stream",
            Link::Peer => "peer copy",
            Link::Host(_) => "pinned host",
        }
    }

    /// Queue the copy of `bytes` from `src` (on `from`) to `dst` (on `to`). Everything queued
    /// on `to`'s stream afterwards sees the copied bytes.
    pub(crate) fn copy(
        &self,
        from: &CudaDevice,
        to: &CudaDevice,
        src: u64,
        dst: u64,
        bytes: u64,
    ) -> Result<(), CudaError> {
        let n = bytes as usize;
        match self {
            // SAFETY: both ranges lie in live arenas of this device (the engine's buffers of
            // max_tok tokens); the copy is ordered on the one stream both stages use.
            Link::Same => unsafe { from.dtod_raw("stage hand-off", dst, src, n) },
            Link::Peer => {
                let done = from.record_event()?;
                to.wait_event(&done)?;
                // SAFETY: src lies in a live arena of `from` and dst in one of `to`; the
                // receiving stream waits for the sender's event above, so the source is
                // complete, and later work on that stream is ordered after it.
                unsafe { peer_copy(from, to, src, dst, n) }
            }
            Link::Host(buf) => {
                if n > buf.bytes {
                    return Err(CudaError::Shape {
                        op: "stage hand-off",
                        detail: format!("{n} bytes for a staging buffer of {}", buf.bytes),
                    });
                }
                // SAFETY: the pinned buffer holds n bytes (checked above) and is not in use:
                // the previous step was synchronised by the host before this one was queued.
                unsafe { pinned_copy(from, buf.ptr, src, n, true) }?;
                let done = from.record_event()?;
                to.wait_event(&done)?;
                // SAFETY: the receiving stream waits for the device-to-host copy above, so the
                // buffer holds the state; dst lies in a live arena of `to` of n bytes or more.
                unsafe { pinned_copy(to, buf.ptr, dst, n, false) }
            }
        }
    }
}

/// Queues a copy of `n` bytes from `src` on `from` to `dst` on `to`, on `to`'s stream.
///
/// # Safety
/// `src` and `dst` must lie in live allocations of `from` and `to` of `n` bytes or more.
unsafe fn peer_copy(
    from: &CudaDevice,
    to: &CudaDevice,
    src: u64,
    dst: u64,
    n: usize,
) -> Result<(), CudaError> {
    match (&from.rt, &to.rt) {
        (Runtime::Cuda(f), Runtime::Cuda(t)) => {
            t.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
            // SAFETY: the caller's contract; both contexts are live.
            unsafe {
                cudarc::driver::result::memcpy_peer_async(
                    t.ctx.cu_ctx(),
                    dst,
                    f.ctx.cu_ctx(),
                    src,
                    n,
                    t.stream.cu_stream(),
                )
            }
            .map_err(drv("cuMemcpyPeerAsync(stage hand-off)"))
        }
        #[cfg(feature = "hip")]
        (Runtime::Hip(_), Runtime::Hip(t)) => {
            use crate::backend::hip::ffi::memcpy_kind;
            // SAFETY: the caller's contract; with unified addressing the runtime tells the
            // two devices' memory apart by address (a peer copy, staged where no direct
            // path exists).
            Ok(unsafe {
                t.copy_raw_async(
                    "stage hand-off (peer)",
                    dst as *mut std::ffi::c_void,
                    src as *const std::ffi::c_void,
                    n,
                    memcpy_kind::DEFAULT,
                    t.stream(),
                )
            }?)
        }
        #[cfg(feature = "hip")]
        _ => Err(mixed()),
    }
}

/// Queues a copy between pinned `host` and device address `dev_ptr` on `dev`'s stream: to
/// the host when `to_host`, else to the device.
///
/// # Safety
/// `host` must hold `n` pinned bytes and `dev_ptr` lie in a live allocation of `dev` of `n`
/// bytes or more, both until the stream has passed the copy.
unsafe fn pinned_copy(
    dev: &CudaDevice,
    host: *mut std::ffi::c_void,
    dev_ptr: u64,
    n: usize,
    to_host: bool,
) -> Result<(), CudaError> {
    match &dev.rt {
        Runtime::Cuda(c) => {
            c.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
            let s = c.stream.cu_stream();
            // SAFETY: the caller's contract.
            unsafe {
                if to_host {
                    sys::cuMemcpyDtoHAsync_v2(host, dev_ptr, n, s)
                        .result()
                        .map_err(drv("cuMemcpyDtoHAsync(stage hand-off)"))
                } else {
                    sys::cuMemcpyHtoDAsync_v2(dev_ptr, host, n, s)
                        .result()
                        .map_err(drv("cuMemcpyHtoDAsync(stage hand-off)"))
                }
            }
        }
        #[cfg(feature = "hip")]
        Runtime::Hip(h) => {
            use crate::backend::hip::ffi::memcpy_kind;
            let d = dev_ptr as *mut std::ffi::c_void;
            // SAFETY: the caller's contract.
            Ok(unsafe {
                if to_host {
                    h.copy_raw_async(
                        "stage hand-off to host",
                        host,
                        d,
                        n,
                        memcpy_kind::DEVICE_TO_HOST,
                        h.stream(),
                    )
                } else {
                    h.copy_raw_async(
                        "stage hand-off from host",
                        d,
                        host,
                        n,
                        memcpy_kind::HOST_TO_DEVICE,
                        h.stream(),
                    )
                }
            }?)
        }
    }
}

/// A hand-off between a CUDA and a HIP device (a plan is for one vendor).
#[cfg(feature = "hip")]
fn mixed() -> CudaError {
    CudaError::Shape {
        op: "stage hand-off",
        detail: "the stages run on a CUDA and a HIP device; a plan's GPUs must all be one vendor"
            .into(),
    }
}

fn pinned(to: &CudaDevice, bytes: u64) -> Result<PinnedBuf, CudaError> {
    PinnedBuf::new(to, bytes as usize)
}

/// Whether `to` can read `from`'s memory directly.
fn can_access_peer(to: &CudaDevice, from: &CudaDevice) -> Result<bool, CudaError> {
    match (&to.rt, &from.rt) {
        (Runtime::Cuda(t), Runtime::Cuda(f)) => {
            let mut ok = 0;
            // SAFETY: writes one int; both handles name devices the driver enumerated.
            unsafe { sys::cuDeviceCanAccessPeer(&mut ok, t.ctx.cu_device(), f.ctx.cu_device()) }
                .result()
                .map_err(drv("cuDeviceCanAccessPeer"))?;
            Ok(ok != 0)
        }
        #[cfg(feature = "hip")]
        (Runtime::Hip(t), Runtime::Hip(_)) => Ok(t.can_access_peer(from.ordinal())?),
        #[cfg(feature = "hip")]
        _ => Err(mixed()),
    }
}

/// Let `to` read `from`'s memory directly (already enabled is fine).
fn enable_peer_access(to: &CudaDevice, from: &CudaDevice) -> Result<(), CudaError> {
    let f = match (&to.rt, &from.rt) {
        (Runtime::Cuda(_), Runtime::Cuda(f)) => f,
        #[cfg(feature = "hip")]
        (Runtime::Hip(t), Runtime::Hip(_)) => return Ok(t.enable_peer_access(from.ordinal())?),
        #[cfg(feature = "hip")]
        _ => return Err(mixed()),
    };
    to.ctx_bind()?;
    // SAFETY: both contexts are live primary contexts of devices that can access each other
    // (checked by the caller).
    match unsafe { sys::cuCtxEnablePeerAccess(f.ctx.cu_ctx(), 0) }.result() {
        Ok(()) => Ok(()),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        Err(e) => Err(CudaError::Driver {
            what: format!(
                "cuCtxEnablePeerAccess(GPU {} reading GPU {})",
                to.ordinal(),
                from.ordinal()
            ),
            source: e,
        }),
    }
}
