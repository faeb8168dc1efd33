//! The GPU engine: the CUDA backend on cudarc with dynamic loading (it builds with no
//! toolkit; libcuda and libnvrtc are opened at run time), and with the `hip` feature the same
//! engine on AMD GPUs — a `CudaDevice` runs on either runtime (`runtime`: launches, copies,
//! events, graphs dispatched by vendor). Device open (context + stream), one device
//! allocation per planned arena with bounds-checked views, copies, events, NVRTC- or
//! hiprtc-compiled kernels cached on disk; one launcher per kernel (`launch`, `gemm`,
//! `flash`), the seam's ops on them (`forward`), weight binding (`bind`), the stage a
//! pipeline drives (`stage`) and start-up (`start`).
//! Invariant: no call here sizes memory from what is free, every launch's views are checked
//! against the op's shape first, and a missing CUDA or HIP library is an error, never a
//! panic.

pub mod arena;
pub mod bind;
pub mod compile;
pub mod expert_cache;
pub mod flash;
pub mod forward;
pub mod gemm;
pub mod handoff;
pub mod host_tier;
pub mod hybrid;
mod int8_products;
pub mod kv_host_attn;
pub mod kv_spill;
pub mod launch;
pub mod layout;
pub mod memlock;
pub mod options;
pub mod pick;
pub mod pinned;
pub mod probe;
pub mod quants;
pub mod runtime;
pub mod stage;
pub mod start;

pub use arena::{arena_allocations, DeviceArena, DeviceView};
pub use runtime::{GpuEvent, Vendor};

use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError};
use runtime::{CudaRt, Runtime};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Everything the CUDA backend can report.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA library: could not load {lib} (looked for {candidates:?}); install the NVIDIA driver (libcuda) and the CUDA NVRTC library (libnvrtc), or add their folder to LD_LIBRARY_PATH")]
    LibraryMissing {
        lib: &'static str,
        candidates: Vec<String>,
    },
    #[error("CUDA {what} failed: {source}")]
    Driver {
        what: String,
        #[source]
        source: DriverError,
    },
    #[error("CUDA device {ordinal} does not exist: the driver reports {count} device(s); pick one with --gpu N (every planned device on GPU N) or give one existing GPU per planned device with --device-map (a plan over several GPUs runs on its own device indices by default)")]
    NoDevice { ordinal: usize, count: i32 },
    #[error("NVRTC {version} could not compile kernel module `{module}` (kernels {kernels:?}) for {arch}:\n{log}")]
    Compile {
        module: &'static str,
        kernels: &'static [&'static str],
        arch: String,
        version: String,
        log: String,
    },
    #[error(
        "kernel `{0}` is defined by no module in strata-kernels; add it to kernels/src/lib.rs"
    )]
    UnknownKernel(String),
    #[error("view {offset}+{len} lies outside arena `{arena}` of {size} bytes")]
    OutOfBounds {
        arena: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("a CUDA library panicked while {what}: {message}")]
    Panic { what: &'static str, message: String },
    #[cfg(feature = "hip")]
    #[error(transparent)]
    Hip(#[from] crate::backend::hip::HipError),
    #[error("{what} is CUDA-only, but GPU {ordinal} is an AMD GPU under HIP; the engine takes the portable kernels there (a CUDA-only path was asked for: report it as a bug)")]
    CudaOnly { what: &'static str, ordinal: usize },
    #[error("the plan is for AMD GPUs, but this strata-exec was built without the `hip` feature: rebuild with `cargo build --release -p strata-exec --features hip`")]
    HipNotBuilt,
    #[error("HIP device {ordinal} ({name}) runs wave{wave}: the engine's launch geometry is written for 32-wide waves (RDNA GPUs such as gfx1100 and gfx1201); CDNA/wave64 GPUs are not supported by the engine yet (`strata-exec probe` still measures them)")]
    Wave {
        ordinal: usize,
        name: String,
        wave: u32,
    },
}

pub(crate) fn drv(what: impl Into<String>) -> impl FnOnce(DriverError) -> CudaError {
    let what = what.into();
    move |source| CudaError::Driver { what, source }
}

/// Checks that libcuda and libnvrtc can be loaded, naming every file looked for when not.
/// cudarc's dynamic loader panics on a missing library at first use; this runs first.
pub fn check_libraries() -> Result<(), CudaError> {
    // SAFETY: each probe only dlopens candidate library names and closes them again.
    let cuda = unsafe { cudarc::driver::sys::is_culib_present() };
    if !cuda {
        let mut candidates = cudarc::get_lib_name_candidates("cuda");
        candidates.extend(cudarc::get_lib_name_candidates("nvcuda"));
        dedup(&mut candidates);
        return Err(CudaError::LibraryMissing {
            lib: "libcuda (the NVIDIA driver)",
            candidates,
        });
    }
    // SAFETY: as above.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !nvrtc {
        return Err(CudaError::LibraryMissing {
            lib: "libnvrtc (the CUDA runtime compiler)",
            candidates: {
                let mut c = cudarc::get_lib_name_candidates("nvrtc");
                dedup(&mut c);
                c
            },
        });
    }
    Ok(())
}

/// Drops repeated names, keeping the first of each (cudarc's candidate list repeats some).
fn dedup(names: &mut Vec<String>) {
    let mut seen = std::collections::BTreeSet::new();
    names.retain(|n| seen.insert(n.clone()));
}

/// Runs `f`, turning a panic inside cudarc (a symbol missing from an old library, say) into
/// an error that says what was being done.
pub(crate) fn no_panic<T>(
    what: &'static str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let message = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(CudaError::Panic { what, message })
        }
    }
}

/// Plain values that cross between host and device as raw bytes.
pub trait Pod: Copy + Default + 'static {}
impl Pod for u8 {}
impl Pod for u16 {}
impl Pod for i32 {}
impl Pod for u32 {}
impl Pod for u64 {}
impl Pod for f32 {}

fn pod_bytes<T: Pod>(s: &[T]) -> &[u8] {
    // SAFETY: T is a plain integer or float type (sealed by `Pod`'s impls above): every byte
    // is initialised and any alignment of u8 is satisfied; the length covers exactly `s`.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

fn pod_bytes_mut<T: Pod>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `pod_bytes`; every bit pattern is a valid value of these types, so the
    // device may write any bytes into them.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

/// One opened GPU: on CUDA its context, the compute stream and every kernel, compiled for its
/// architecture (or read from the on-disk cache); on HIP the opened `HipDevice` with the
/// same (see `runtime`). The name stays `CudaDevice` for the code written against it.
pub struct CudaDevice {
    rt: Runtime,
    ordinal: usize,
    name: String,
    /// Compute capability; (0, 0) on HIP.
    cc: (i32, i32),
    /// NVRTC's version; (0, 0) on HIP.
    nvrtc: (i32, i32),
    cache_dir: Option<PathBuf>,
    /// Multiprocessors (CUDA SMs, HIP compute units).
    sm: usize,
    /// How many modules came from the disk cache rather than NVRTC at open.
    pub modules_from_cache: usize,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("arch", &self.arch())
            .finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: checks the libraries, creates the context and a stream, and
    /// loads every kernel module (compiled by NVRTC for this device's `sm_XX`, cached under
    /// `compile::cache_dir()`).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        check_libraries()?;
        no_panic("opening the CUDA device", || Self::open_inner(ordinal))
    }

    fn open_inner(ordinal: usize) -> Result<Self, CudaError> {
        cudarc::driver::result::init().map_err(drv("cuInit"))?;
        let count = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx =
            CudaContext::new(ordinal).map_err(drv(format!("context for device {ordinal}")))?;
        let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
        let cc = ctx
            .compute_capability()
            .map_err(drv("cuDeviceGetAttribute(compute capability)"))?;
        let nvrtc = compile::nvrtc_version()?;
        let cache_dir = compile::cache_dir();
        let mut functions = HashMap::new();
        let mut modules_from_cache = 0;
        for src in strata_kernels::all() {
            let (image, cached) = compile::load_or_compile(src, cc, nvrtc, cache_dir.as_deref())?;
            modules_from_cache += cached as usize;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(image))
                .map_err(drv(format!("cuModuleLoadData(module `{}`)", src.name)))?;
            for &e in src.entry_points {
                let f = module
                    .load_function(e)
                    .map_err(drv(format!("cuModuleGetFunction(`{e}` in `{}`)", src.name)))?;
                functions.insert(e, f);
            }
        }
        let sm = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_or(132, |n| n.max(1) as usize);
        Ok(Self {
            rt: Runtime::Cuda(CudaRt {
                ctx,
                stream,
                functions,
            }),
            ordinal,
            name,
            cc,
            nvrtc,
            cache_dir,
            sm,
            modules_from_cache,
        })
    }

    /// The ordinal this device was opened as (CUDA's or HIP's).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's compute capability (major, minor); (0, 0) on HIP.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// The architecture the kernels were compiled for, e.g. `sm_90` or `gfx1201`.
    pub fn arch(&self) -> String {
        match &self.rt {
            Runtime::Cuda(_) => compile::arch_name(self.cc),
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => h.arch(),
        }
    }

    /// NVRTC's version as (major, minor); (0, 0) on HIP.
    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.nvrtc
    }

    /// Where compiled kernels are cached (None: caching is off).
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.cache_dir.as_deref()
    }

    /// The device's number of multiprocessors (CUDA SMs, HIP compute units).
    pub(crate) fn sm_count(&self) -> usize {
        self.sm
    }

    /// Total device memory in bytes.
    pub fn total_mem(&self) -> Result<u64, CudaError> {
        match &self.rt {
            Runtime::Cuda(c) => Ok(c.ctx.total_mem().map_err(drv("cuDeviceTotalMem"))? as u64),
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => Ok(h.info().total_bytes),
        }
    }

    /// The CUDA compute stream every op is launched on (CUDA only: the engine's own
    /// launches and copies go through the vendor-neutral methods of `runtime`).
    pub fn stream(&self) -> Result<&Arc<CudaStream>, CudaError> {
        Ok(&self.cuda("the CUDA stream")?.stream)
    }

    /// The loaded CUDA kernel `name` (CUDA only; launches go through `launch::launch!`).
    pub fn function(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.cuda("a CUDA function handle")?
            .functions
            .get(name)
            .ok_or_else(|| CudaError::UnknownKernel(name.to_string()))
    }

    /// One device allocation of exactly `size` bytes for the planned arena `name`.
    pub fn alloc_arena(&self, name: &str, size: u64) -> Result<DeviceArena, CudaError> {
        match &self.rt {
            Runtime::Cuda(c) => DeviceArena::new(&c.ctx, name, size),
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => Ok(DeviceArena::hip(h.alloc_arena(name, size)?)),
        }
    }

    /// Copies `src` to `dst` (whose length must equal `src`'s byte size) and waits.
    pub fn htod<T: Pod>(&self, src: &[T], dst: DeviceView<'_>) -> Result<(), CudaError> {
        let bytes = pod_bytes(src);
        dst.expect_len("htod", bytes.len() as u64)?;
        // SAFETY: dst is a checked view of a live arena holding exactly bytes.len() bytes; the
        // host slice outlives the copy because we synchronize the stream before returning.
        unsafe { self.htod_raw("htod", dst.ptr(), bytes) }?;
        self.synchronize()
    }

    /// Copies `src` into `dst` (whose byte size must equal `src`'s length) and waits.
    pub fn dtoh<T: Pod>(&self, src: DeviceView<'_>, dst: &mut [T]) -> Result<(), CudaError> {
        let bytes = pod_bytes_mut(dst);
        src.expect_len("dtoh", bytes.len() as u64)?;
        // SAFETY: src is a checked view of exactly bytes.len() bytes; dtoh_raw waits.
        unsafe { self.dtoh_raw("dtoh", src.ptr(), bytes) }
    }

    /// Copies `src` into `dst` on the device (same length; asynchronous on the stream, so
    /// every later op on it sees the bytes).
    pub fn dtod(&self, src: DeviceView<'_>, dst: DeviceView<'_>) -> Result<(), CudaError> {
        dst.expect_len("dtod", src.len())?;
        // SAFETY: both are checked views of live arenas of this device, of equal length; the
        // copy is ordered on the stream every pass runs on.
        unsafe { self.dtod_raw("dtod", dst.ptr(), src.ptr(), src.len() as usize) }
    }

    /// Sets every byte of `dst` to `value` (asynchronous on the stream).
    pub fn memset(&self, dst: DeviceView<'_>, value: u8) -> Result<(), CudaError> {
        match &self.rt {
            Runtime::Cuda(c) => {
                c.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
                // SAFETY: dst is a checked view of a live arena; exactly dst.len() bytes are
                // written.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        dst.ptr(),
                        value,
                        dst.len() as usize,
                        c.stream.cu_stream(),
                    )
                }
                .map_err(drv("cuMemsetD8Async"))
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => {
                let len = dst.len() as usize;
                // SAFETY: dst is a checked view of a live arena of this device.
                unsafe { h.memset_raw_async(dst.ptr(), len, value, h.stream()) }?;
                Ok(())
            }
        }
    }

    /// Makes this device's context current on the calling thread (HIP's calls make their
    /// device current themselves).
    pub(crate) fn ctx_bind(&self) -> Result<(), CudaError> {
        match &self.rt {
            Runtime::Cuda(c) => c.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent")),
            #[cfg(feature = "hip")]
            Runtime::Hip(_) => Ok(()),
        }
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        match &self.rt {
            Runtime::Cuda(c) => c.stream.synchronize().map_err(drv("cuStreamSynchronize")),
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => Ok(h.stream().synchronize()?),
        }
    }

    /// A new CUDA stream of this context (for copies that overlap compute; CUDA only).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        self.cuda("a second CUDA stream")?
            .ctx
            .new_stream()
            .map_err(drv("cuStreamCreate"))
    }

    /// Pins `bytes` of host memory (one planned chunk; CUDA only, a HIP device answers with
    /// an error and the caller falls back to the mapped file): an error when the driver
    /// refuses (a memlock limit, `ulimit -l`, or no memory it can lock).
    pub fn alloc_pinned(&self, bytes: u64) -> Result<pinned::PinnedHost, CudaError> {
        self.cuda("pinned host chunks")?;
        self.ctx_bind()?;
        pinned::PinnedHost::new(bytes)
    }

    /// Pins `bytes` of host memory mapped into this device's address space (one planned
    /// `kv_spill` chunk): an error when the driver refuses (a memlock limit, `ulimit -l`, or
    /// no memory it can lock).
    pub fn alloc_pinned_mapped(&self, bytes: u64) -> Result<pinned::MappedHost, CudaError> {
        match &self.rt {
            Runtime::Cuda(_) => {
                self.ctx_bind()?;
                Ok(pinned::MappedHost::Cuda(pinned::PinnedHost::new_mapped(
                    bytes,
                )?))
            }
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => {
                let n = usize::try_from(bytes).map_err(|_| CudaError::Shape {
                    op: "pinned host memory",
                    detail: format!("{bytes} bytes do not fit this host's address space"),
                })?;
                let (p, d) = h.alloc_pinned_mapped(n)?;
                Ok(pinned::MappedHost::Hip(p, d))
            }
        }
    }

    /// A new event without timing, for ordering work between this device's streams (CUDA
    /// only).
    pub fn new_sync_event(&self) -> Result<CudaEvent, CudaError> {
        self.cuda("an event between streams")?
            .ctx
            .new_event(None)
            .map_err(drv("cuEventCreate"))
    }

    /// Records `ev` on `stream` (the work queued there so far).
    pub fn record_on(&self, ev: &CudaEvent, stream: &CudaStream) -> Result<(), CudaError> {
        ev.record(stream).map_err(drv("cuEventRecord"))
    }

    /// Makes `stream` wait (on the device) for the work recorded in `ev`.
    pub fn wait_on(&self, stream: &CudaStream, ev: &CudaEvent) -> Result<(), CudaError> {
        stream.wait(ev).map_err(drv("cuStreamWaitEvent"))
    }

    /// Queues a copy of `src[at..at + dst.len()]` (pinned host memory) into `dst` on
    /// `stream`, without waiting: at the PCIe rate, overlapping work on other streams.
    ///
    /// # Safety
    /// `src` must stay alive and unchanged until `stream` has passed the copy (synchronise
    /// it, or wait on an event recorded after it, before dropping or writing `src`).
    pub unsafe fn copy_pinned_async(
        &self,
        src: &pinned::PinnedHost,
        at: u64,
        dst: DeviceView<'_>,
        stream: &CudaStream,
    ) -> Result<(), CudaError> {
        let n = dst.len();
        let bytes = at
            .checked_add(n)
            .and_then(|end| src.as_slice().get(at as usize..end as usize))
            .ok_or(CudaError::OutOfBounds {
                arena: "pinned host chunk".into(),
                offset: at,
                len: n,
                size: src.len(),
            })?;
        self.ctx_bind()?;
        // SAFETY: `dst` is a checked view of exactly bytes.len() bytes of a live arena;
        // `bytes` is pinned memory the caller keeps alive until the stream has passed the
        // copy (this function's contract), so the driver's DMA reads it asynchronously.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.ptr(), bytes, stream.cu_stream()) }
            .map_err(drv("cuMemcpyHtoDAsync(pinned)"))
    }
}
