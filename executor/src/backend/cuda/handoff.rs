//! The hand-off of the hidden state from one stage of a layer split to the next. Stages that
//! share one device object (every planned device on one `--gpu`) copy on their common
//! stream. Stages on device objects of their own (`--device-map`) order the copy with an
//! event: a peer copy (`cuMemcpyPeerAsync`, direct when the GPUs can reach each other), or a
//! copy staged through pinned host memory, which the plan's `staging` chunks of the receiving
//! device must hold.
//! Invariant: the receiving stream starts nothing that reads the copied state before the
//! sending stream's writes to it are complete, and a staged buffer is reused only after the
//! host has synchronised the step that filled it.

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

/// Pinned host memory for a staged hand-off, usable from every context.
pub(crate) struct PinnedBuf {
    ptr: *mut std::ffi::c_void,
    bytes: usize,
}

// SAFETY: the buffer is plain host memory owned by this value alone; the engine that holds it
// uses it from one thread at a time (`&mut self` steps), and the driver accepts it from any
// thread because it was allocated portable.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    fn new(bytes: usize) -> Result<Self, CudaError> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: cuMemHostAlloc writes one pointer into `ptr`; a context is bound by the
        // caller. PORTABLE makes the memory pinned for every context, not only this one.
        unsafe { sys::cuMemHostAlloc(&mut ptr, bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .result()
            .map_err(drv(format!(
                "cuMemHostAlloc({bytes} bytes of hand-off staging)"
            )))?;
        Ok(Self { ptr, bytes })
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
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
            Link::Same => {
                from.ctx_bind()?;
                // SAFETY: both ranges lie in live arenas of this device (the engine's buffers
                // of max_tok tokens); the copy is ordered on the one stream both stages use.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        dst,
                        src,
                        n,
                        from.stream().cu_stream(),
                    )
                }
                .map_err(drv("cuMemcpyDtoDAsync(stage hand-off)"))
            }
            Link::Peer => {
                let done = from.record_event()?;
                to.stream()
                    .wait(&done)
                    .map_err(drv("cuStreamWaitEvent(stage hand-off)"))?;
                to.ctx_bind()?;
                // SAFETY: src lies in a live arena of `from`'s context and dst in one of
                // `to`'s; the receiving stream waits for the sender's event above, so the
                // source is complete, and later work on that stream is ordered after it.
                unsafe {
                    cudarc::driver::result::memcpy_peer_async(
                        to.context().cu_ctx(),
                        dst,
                        from.context().cu_ctx(),
                        src,
                        n,
                        to.stream().cu_stream(),
                    )
                }
                .map_err(drv("cuMemcpyPeerAsync(stage hand-off)"))
            }
            Link::Host(buf) => {
                if n > buf.bytes {
                    return Err(CudaError::Shape {
                        op: "stage hand-off",
                        detail: format!("{n} bytes for a staging buffer of {}", buf.bytes),
                    });
                }
                from.ctx_bind()?;
                // SAFETY: the pinned buffer holds n bytes (checked above) and is not in use:
                // the previous step was synchronised by the host before this one was queued.
                unsafe { sys::cuMemcpyDtoHAsync_v2(buf.ptr, src, n, from.stream().cu_stream()) }
                    .result()
                    .map_err(drv("cuMemcpyDtoHAsync(stage hand-off)"))?;
                let done = from.record_event()?;
                to.stream()
                    .wait(&done)
                    .map_err(drv("cuStreamWaitEvent(stage hand-off)"))?;
                to.ctx_bind()?;
                // SAFETY: the receiving stream waits for the device-to-host copy above, so the
                // buffer holds the state; dst lies in a live arena of `to` of n bytes or more.
                unsafe { sys::cuMemcpyHtoDAsync_v2(dst, buf.ptr, n, to.stream().cu_stream()) }
                    .result()
                    .map_err(drv("cuMemcpyHtoDAsync(stage hand-off)"))
            }
        }
    }
}

fn pinned(to: &CudaDevice, bytes: u64) -> Result<PinnedBuf, CudaError> {
    to.ctx_bind()?;
    PinnedBuf::new(bytes as usize)
}

/// Whether `to` can read `from`'s memory directly.
fn can_access_peer(to: &CudaDevice, from: &CudaDevice) -> Result<bool, CudaError> {
    let mut ok = 0;
    // SAFETY: writes one int; both handles name devices the driver enumerated.
    unsafe {
        sys::cuDeviceCanAccessPeer(
            &mut ok,
            to.context().cu_device(),
            from.context().cu_device(),
        )
    }
    .result()
    .map_err(drv("cuDeviceCanAccessPeer"))?;
    Ok(ok != 0)
}

/// Let `to`'s context read `from`'s memory directly (already enabled is fine).
fn enable_peer_access(to: &CudaDevice, from: &CudaDevice) -> Result<(), CudaError> {
    to.ctx_bind()?;
    // SAFETY: both contexts are live primary contexts of devices that can access each other
    // (checked by the caller).
    match unsafe { sys::cuCtxEnablePeerAccess(from.context().cu_ctx(), 0) }.result() {
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
