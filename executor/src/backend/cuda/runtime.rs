//! The vendor runtime under one GPU engine: a [`CudaDevice`] holds either a CUDA context and
//! stream (cudarc) or an opened HIP device (`backend::hip`), and every driver call the
//! engine makes — kernel launch with a `void**` argument array, copies, memset, events,
//! stream capture into graphs, memory info — goes through the methods here, which dispatch
//! on that. The stage, launchers, forward pass and start-up above are the same for both
//! vendors; only the tensor-core modules (`gemm`, `flash`'s `fa_prefill`) and programmatic
//! dependent launch are CUDA-only, and [`CudaDevice::tensor_cores`] / [`CudaDevice::pdl_capable`]
//! say so to the code that picks them.
//! Invariant: a CUDA-only call on a HIP device is an error naming the call
//! ([`CudaError::CudaOnly`]), never a panic or a silent no-op; HIP devices run the kernels
//! only at wave32, the width the launch geometry is written for (else [`CudaError::Wave`] at
//! open).

use super::{drv, CudaDevice, CudaError};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaStream, LaunchConfig};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// The GPU vendor a device (and a plan's `vendor`) names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vendor {
    /// NVIDIA under CUDA.
    Nvidia,
    /// AMD under HIP.
    Amd,
}

impl Vendor {
    /// The vendor of a plan's `DevicePlan::vendor` (`nvidia` or `amd`; None for `cpu`).
    pub fn of_plan(vendor: &str) -> Option<Self> {
        match vendor {
            "nvidia" => Some(Vendor::Nvidia),
            "amd" => Some(Vendor::Amd),
            _ => None,
        }
    }

    /// The runtime's name, for messages (`CUDA`, `HIP`).
    pub fn runtime(self) -> &'static str {
        match self {
            Vendor::Nvidia => "CUDA",
            Vendor::Amd => "HIP",
        }
    }
}

/// The warp (wave) width the engine's launch geometry is written for: blocks of
/// `DQ_WARPS x 32` threads, one row per 32 lanes.
pub const ENGINE_WARP: u32 = 32;

/// Checks a device's wave size against [`ENGINE_WARP`].
pub fn check_wave(ordinal: usize, name: &str, wave: u32) -> Result<(), CudaError> {
    if wave == ENGINE_WARP {
        return Ok(());
    }
    Err(CudaError::Wave {
        ordinal,
        name: name.to_string(),
        wave,
    })
}

/// A CUDA context with the compute stream and every kernel loaded.
pub(crate) struct CudaRt {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub functions: HashMap<&'static str, CudaFunction>,
}

/// What a [`CudaDevice`] runs on.
pub(crate) enum Runtime {
    Cuda(CudaRt),
    #[cfg(feature = "hip")]
    Hip(Box<crate::backend::hip::HipDevice>),
}

/// A timing-capable event recorded on a device's compute stream.
pub enum GpuEvent {
    Cuda(CudaEvent),
    #[cfg(feature = "hip")]
    Hip(crate::backend::hip::HipEvent),
}

impl GpuEvent {
    /// Waits until the event has completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        match self {
            GpuEvent::Cuda(e) => e.synchronize().map_err(drv("cuEventSynchronize")),
            #[cfg(feature = "hip")]
            GpuEvent::Hip(e) => Ok(e.synchronize()?),
        }
    }

    /// Milliseconds from `self` to `end` (both recorded on one vendor's devices).
    pub fn elapsed_ms(&self, end: &GpuEvent) -> Result<f32, CudaError> {
        match (self, end) {
            (GpuEvent::Cuda(a), GpuEvent::Cuda(b)) => {
                a.elapsed_ms(b).map_err(drv("cuEventElapsedTime"))
            }
            #[cfg(feature = "hip")]
            (GpuEvent::Hip(a), GpuEvent::Hip(b)) => Ok(a.elapsed_ms(b)?),
            #[cfg(feature = "hip")]
            _ => Err(CudaError::Shape {
                op: "elapsed_ms",
                detail: "events of a CUDA and a HIP device cannot be compared".into(),
            }),
        }
    }
}

/// A captured, instantiated graph of one device's stream.
pub(crate) enum GpuGraph {
    Cuda(CudaGraph),
    #[cfg(feature = "hip")]
    Hip(crate::backend::hip::HipGraph),
}

impl CudaDevice {
    /// The vendor of this device's runtime.
    pub fn vendor(&self) -> Vendor {
        match &self.rt {
            Runtime::Cuda(_) => Vendor::Nvidia,
            #[cfg(feature = "hip")]
            Runtime::Hip(_) => Vendor::Amd,
        }
    }

    /// Opens device `ordinal` of `vendor`'s runtime (HIP needs the `hip` feature).
    pub fn open_vendor(vendor: Vendor, ordinal: usize) -> Result<Self, CudaError> {
        match vendor {
            Vendor::Nvidia => Self::open(ordinal),
            #[cfg(feature = "hip")]
            Vendor::Amd => Self::open_hip(ordinal),
            #[cfg(not(feature = "hip"))]
            Vendor::Amd => Err(CudaError::HipNotBuilt),
        }
    }

    /// Opens HIP device `ordinal` for the engine: the runtime and hiprtc loaded, every
    /// portable kernel module compiled for its gfx target (or read from the disk cache),
    /// refused unless it runs wave32.
    #[cfg(feature = "hip")]
    pub fn open_hip(ordinal: usize) -> Result<Self, CudaError> {
        use crate::backend::hip::{DeviceInfo, HipDevice};
        crate::backend::hip::check_libraries()?;
        let info = DeviceInfo::query(ordinal)?;
        check_wave(ordinal, &info.name, info.warp_size)?;
        let dev = HipDevice::open(ordinal)?;
        let sm = dev.info().compute_units.max(1) as usize;
        Ok(Self {
            ordinal,
            name: dev.info().name.clone(),
            cc: (0, 0),
            nvrtc: (0, 0),
            cache_dir: crate::backend::kernel_cache::cache_dir(),
            sm,
            modules_from_cache: dev.modules_from_cache,
            rt: Runtime::Hip(Box::new(dev)),
        })
    }

    /// The CUDA runtime under this device, or an error naming `what` on HIP.
    #[cfg_attr(not(feature = "hip"), allow(unused_variables))]
    pub(crate) fn cuda(&self, what: &'static str) -> Result<&CudaRt, CudaError> {
        match &self.rt {
            Runtime::Cuda(c) => Ok(c),
            #[cfg(feature = "hip")]
            Runtime::Hip(_) => Err(CudaError::CudaOnly {
                what,
                ordinal: self.ordinal,
            }),
        }
    }

    /// Whether the tensor-core modules (`gemm`, `fa_prefill`) are loaded: CUDA devices only
    /// (their PTX is `mma.sync`/`cp.async`); elsewhere prefill takes the matrix-vector
    /// kernels and `dq_attn_prefill`.
    pub fn tensor_cores(&self) -> bool {
        matches!(self.rt, Runtime::Cuda(_))
    }

    /// Whether programmatic dependent launch is available: CUDA devices of compute
    /// capability 9.0 or later.
    pub fn pdl_capable(&self) -> bool {
        matches!(self.rt, Runtime::Cuda(_)) && self.cc.0 >= 9
    }

    /// The warp (wave) width the kernels run at.
    pub fn warp_size(&self) -> u32 {
        match &self.rt {
            Runtime::Cuda(_) => 32,
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => h.info().warp_size,
        }
    }

    /// Device memory (free, total) now, in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64), CudaError> {
        match &self.rt {
            Runtime::Cuda(c) => {
                c.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
                let (free, total) =
                    cudarc::driver::result::mem_get_info().map_err(drv("cuMemGetInfo"))?;
                Ok((free as u64, total as u64))
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => Ok(h.mem_info()?),
        }
    }

    /// Queues kernel `name` on the compute stream with `c` and one pointer per parameter.
    ///
    /// # Safety
    /// `params` must hold one pointer per kernel parameter, in order, each to a live value
    /// of that parameter's type, and every address passed must be memory the kernel may
    /// touch for the launch's shapes.
    pub(crate) unsafe fn launch_raw(
        &self,
        name: &str,
        c: LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        match &self.rt {
            Runtime::Cuda(rt) => {
                let f = rt
                    .functions
                    .get(name)
                    .ok_or_else(|| CudaError::UnknownKernel(name.to_string()))?;
                rt.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
                // SAFETY: the caller's contract; f is a live function of this context.
                unsafe {
                    cudarc::driver::result::launch_kernel(
                        f.cu_function(),
                        c.grid_dim,
                        c.block_dim,
                        c.shared_mem_bytes,
                        rt.stream.cu_stream(),
                        params,
                    )
                }
                .map_err(drv(format!("cuLaunchKernel {name}")))
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => {
                let f = h.function(name)?;
                // SAFETY: the caller's contract; f is a live function of this device.
                unsafe {
                    h.launch(
                        f,
                        c.grid_dim,
                        c.block_dim,
                        c.shared_mem_bytes,
                        h.stream(),
                        params,
                    )
                }
                .map_err(CudaError::from)
            }
        }
    }

    /// Lets kernel `name` take `bytes` of dynamic shared memory beyond the 48 KiB CUDA gives
    /// without opting in. HIP has no opt-in: its launch checks the device's limit.
    pub(crate) fn allow_shared(&self, name: &str, bytes: u32) -> Result<(), CudaError> {
        match &self.rt {
            Runtime::Cuda(rt) => {
                let f = rt
                    .functions
                    .get(name)
                    .ok_or_else(|| CudaError::UnknownKernel(name.to_string()))?;
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(drv(format!("cuFuncSetAttribute({name}, {bytes} bytes shared)")))
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(_) => Ok(()),
        }
    }

    /// Queues a copy of `src` to device address `dst` on the compute stream. `src` may be
    /// pageable: CUDA stages it before returning; on HIP this waits for the stream, so the
    /// host bytes may change as soon as it returns on both.
    ///
    /// # Safety
    /// `dst` must address at least `src.len()` bytes of a live allocation of this device.
    pub(crate) unsafe fn htod_raw(
        &self,
        what: &str,
        dst: u64,
        src: &[u8],
    ) -> Result<(), CudaError> {
        match &self.rt {
            Runtime::Cuda(rt) => {
                rt.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
                // SAFETY: the caller's contract for dst; a copy from pageable memory returns
                // once the host bytes are staged.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(dst, src, rt.stream.cu_stream())
                }
                .map_err(drv(format!("cuMemcpyHtoDAsync({what})")))
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => {
                use crate::backend::hip::ffi::memcpy_kind;
                // SAFETY: the caller's contract for dst; src stays borrowed until the stream
                // is synchronized below.
                unsafe {
                    h.copy_raw_async(
                        what,
                        dst as *mut c_void,
                        src.as_ptr().cast(),
                        src.len(),
                        memcpy_kind::HOST_TO_DEVICE,
                        h.stream(),
                    )
                }?;
                Ok(h.stream().synchronize()?)
            }
        }
    }

    /// Copies `dst.len()` bytes from device address `src` after everything queued, and waits.
    ///
    /// # Safety
    /// `src` must address at least `dst.len()` bytes of a live allocation of this device.
    pub(crate) unsafe fn dtoh_raw(
        &self,
        what: &str,
        src: u64,
        dst: &mut [u8],
    ) -> Result<(), CudaError> {
        match &self.rt {
            Runtime::Cuda(rt) => {
                rt.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
                // SAFETY: the caller's contract for src; dst stays borrowed until the
                // synchronize below.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(dst, src, rt.stream.cu_stream())
                }
                .map_err(drv(format!("cuMemcpyDtoHAsync({what})")))?;
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => {
                use crate::backend::hip::ffi::memcpy_kind;
                // SAFETY: as above.
                unsafe {
                    h.copy_raw_async(
                        what,
                        dst.as_mut_ptr().cast(),
                        src as *const c_void,
                        dst.len(),
                        memcpy_kind::DEVICE_TO_HOST,
                        h.stream(),
                    )
                }?;
            }
        }
        self.synchronize()
    }

    /// Queues a copy of `bytes` bytes between device addresses of this device on the
    /// compute stream.
    ///
    /// # Safety
    /// Both ranges must lie in live allocations of this device.
    pub(crate) unsafe fn dtod_raw(
        &self,
        what: &str,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), CudaError> {
        match &self.rt {
            Runtime::Cuda(rt) => {
                rt.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
                // SAFETY: the caller's contract.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        dst,
                        src,
                        bytes,
                        rt.stream.cu_stream(),
                    )
                }
                .map_err(drv(format!("cuMemcpyDtoDAsync({what})")))
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => {
                use crate::backend::hip::ffi::memcpy_kind;
                // SAFETY: the caller's contract.
                Ok(unsafe {
                    h.copy_raw_async(
                        what,
                        dst as *mut c_void,
                        src as *const c_void,
                        bytes,
                        memcpy_kind::DEVICE_TO_DEVICE,
                        h.stream(),
                    )
                }?)
            }
        }
    }

    /// Records a timing-capable event on the compute stream.
    pub fn record_event(&self) -> Result<GpuEvent, CudaError> {
        match &self.rt {
            Runtime::Cuda(rt) => {
                let ev = rt
                    .ctx
                    .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(drv("cuEventCreate"))?;
                ev.record(&rt.stream).map_err(drv("cuEventRecord"))?;
                Ok(GpuEvent::Cuda(ev))
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => {
                let ev = h.new_event()?;
                ev.record(h.stream())?;
                Ok(GpuEvent::Hip(ev))
            }
        }
    }

    /// Makes later work on the compute stream wait for `ev` (recorded on any device of the
    /// same vendor).
    pub(crate) fn wait_event(&self, ev: &GpuEvent) -> Result<(), CudaError> {
        match (&self.rt, ev) {
            (Runtime::Cuda(rt), GpuEvent::Cuda(e)) => {
                rt.stream.wait(e).map_err(drv("cuStreamWaitEvent"))
            }
            #[cfg(feature = "hip")]
            (Runtime::Hip(h), GpuEvent::Hip(e)) => Ok(h.stream().wait(e)?),
            #[cfg(feature = "hip")]
            _ => Err(CudaError::Shape {
                op: "wait_event",
                detail: "a stream of one vendor cannot wait for another vendor's event".into(),
            }),
        }
    }

    /// Starts capturing the compute stream (thread-local mode). Always follow with
    /// [`CudaDevice::end_capture`], also when recording failed.
    pub(crate) fn begin_capture(&self) -> Result<(), CudaError> {
        match &self.rt {
            Runtime::Cuda(rt) => rt
                .stream
                .begin_capture(
                    cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
                .map_err(drv("cuStreamBeginCapture")),
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => Ok(h.begin_capture(h.stream())?),
        }
    }

    /// Ends the capture and instantiates the graph it recorded.
    pub(crate) fn end_capture(&self) -> Result<GpuGraph, CudaError> {
        match &self.rt {
            Runtime::Cuda(rt) => {
                let g = rt
                    .stream
                    .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags_enum(0))
                    .map_err(drv("cuStreamEndCapture"))?;
                g.map(GpuGraph::Cuda).ok_or_else(|| CudaError::Shape {
                    op: "capture",
                    detail: "CUDA graph capture produced no graph".into(),
                })
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => Ok(GpuGraph::Hip(h.end_capture(h.stream())?)),
        }
    }

    /// Replays `g` (captured on this device) on the compute stream.
    pub(crate) fn launch_graph(&self, g: &GpuGraph) -> Result<(), CudaError> {
        match (&self.rt, g) {
            (Runtime::Cuda(rt), GpuGraph::Cuda(g)) => {
                rt.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
                g.launch().map_err(drv("cuGraphLaunch"))
            }
            #[cfg(feature = "hip")]
            (Runtime::Hip(h), GpuGraph::Hip(g)) => Ok(g.launch(h.stream())?),
            #[cfg(feature = "hip")]
            _ => Err(CudaError::Shape {
                op: "graph launch",
                detail: "a graph replays only on the vendor it was captured on".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_vendors_map_to_runtimes() {
        assert_eq!(Vendor::of_plan("nvidia"), Some(Vendor::Nvidia));
        assert_eq!(Vendor::of_plan("amd"), Some(Vendor::Amd));
        assert_eq!(Vendor::of_plan("cpu"), None);
        assert_eq!(Vendor::Amd.runtime(), "HIP");
    }

    #[test]
    fn wave64_is_refused_with_the_device_named() {
        assert!(check_wave(0, "AMD Radeon AI PRO R9700", 32).is_ok());
        let e = check_wave(1, "AMD Instinct MI300X", 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("MI300X") && e.contains("wave64"), "{e}");
        assert!(e.contains("RDNA"), "{e}");
    }

    #[cfg(not(feature = "hip"))]
    #[test]
    fn an_amd_device_without_the_hip_feature_names_the_feature() {
        let e = CudaDevice::open_vendor(Vendor::Amd, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--features hip"), "{e}");
    }

    #[cfg(feature = "hip")]
    #[test]
    fn an_amd_device_without_rocm_names_libamdhip64() {
        match CudaDevice::open_vendor(Vendor::Amd, 0) {
            // A machine with ROCm and an RDNA GPU opens it.
            Ok(d) => assert_eq!(d.vendor(), Vendor::Amd),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("libamdhip64")
                        || e.contains("libhiprtc")
                        || e.contains("HIP device 0 does not exist")
                        || e.contains("wave64"),
                    "{e}"
                );
            }
        }
    }
}
