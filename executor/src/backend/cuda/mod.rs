//! The CUDA backend on cudarc with dynamic loading (it builds with no toolkit; libcuda and
//! libnvrtc are opened at run time): device open (context + stream), one device allocation
//! per planned arena with bounds-checked views, copies, events, NVRTC-compiled kernels cached
//! on disk; one launcher per kernel (`launch`, `gemm`, `flash`), the seam's ops on them
//! (`forward`), weight binding (`bind`), the stage a pipeline drives (`stage`) and start-up
//! (`start`).
//! Invariant: no call here sizes memory from what is free, every launch's views are checked
//! against the op's shape first, and a missing CUDA library is an error, never a panic.

pub mod arena;
pub mod bind;
pub mod compile;
pub mod expert_cache;
pub mod flash;
pub mod forward;
pub mod gemm;
pub mod handoff;
pub mod launch;
pub mod layout;
pub mod memlock;
pub mod options;
pub mod probe;
pub mod quants;
pub mod stage;
pub mod start;

pub use arena::{arena_allocations, DeviceArena, DeviceView};

use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError};
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

/// One opened CUDA device: its context, the compute stream and every kernel, compiled for
/// its architecture (or read from the on-disk cache).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    name: String,
    cc: (i32, i32),
    nvrtc: (i32, i32),
    cache_dir: Option<PathBuf>,
    functions: HashMap<&'static str, CudaFunction>,
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
        Ok(Self {
            ctx,
            stream,
            ordinal,
            name,
            cc,
            nvrtc,
            cache_dir,
            functions,
            modules_from_cache,
        })
    }

    /// The CUDA ordinal this device was opened as.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's context (the primary context of its ordinal, shared by every
    /// `CudaDevice` opened on that ordinal).
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// The architecture the kernels were compiled for, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        compile::arch_name(self.cc)
    }

    /// NVRTC's version as (major, minor).
    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.nvrtc
    }

    /// Where compiled kernels are cached (None: caching is off).
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.cache_dir.as_deref()
    }

    /// Total device memory in bytes.
    pub fn total_mem(&self) -> Result<u64, CudaError> {
        let b = self.ctx.total_mem().map_err(drv("cuDeviceTotalMem"))?;
        Ok(b as u64)
    }

    /// The compute stream every op is launched on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The loaded kernel `name` (public so op tests can launch a kernel directly).
    pub fn function(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::UnknownKernel(name.to_string()))
    }

    /// One device allocation of exactly `size` bytes for the planned arena `name`.
    pub fn alloc_arena(&self, name: &str, size: u64) -> Result<DeviceArena, CudaError> {
        DeviceArena::new(&self.ctx, name, size)
    }

    /// Copies `src` to `dst` (whose length must equal `src`'s byte size) and waits.
    pub fn htod<T: Pod>(&self, src: &[T], dst: DeviceView<'_>) -> Result<(), CudaError> {
        let bytes = pod_bytes(src);
        dst.expect_len("htod", bytes.len() as u64)?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: dst is a checked view of a live arena holding exactly bytes.len() bytes; the
        // host slice outlives the copy because we synchronize the stream before returning.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.ptr(), bytes, self.stream.cu_stream())
        }
        .map_err(drv("cuMemcpyHtoDAsync"))?;
        self.synchronize()
    }

    /// Copies `src` into `dst` (whose byte size must equal `src`'s length) and waits.
    pub fn dtoh<T: Pod>(&self, src: DeviceView<'_>, dst: &mut [T]) -> Result<(), CudaError> {
        let bytes = pod_bytes_mut(dst);
        src.expect_len("dtoh", bytes.len() as u64)?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: src is a checked view of exactly bytes.len() bytes; the host buffer stays
        // borrowed until the stream is synchronized below.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(bytes, src.ptr(), self.stream.cu_stream())
        }
        .map_err(drv("cuMemcpyDtoHAsync"))?;
        self.synchronize()
    }

    /// Copies `src` into `dst` on the device (same length; asynchronous on the stream, so
    /// every later op on it sees the bytes).
    pub fn dtod(&self, src: DeviceView<'_>, dst: DeviceView<'_>) -> Result<(), CudaError> {
        dst.expect_len("dtod", src.len())?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: both are checked views of live arenas of this context, of equal length; the
        // copy is ordered on the stream every pass runs on.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.ptr(),
                src.ptr(),
                src.len() as usize,
                self.stream.cu_stream(),
            )
        }
        .map_err(drv("cuMemcpyDtoDAsync"))
    }

    /// Sets every byte of `dst` to `value` (asynchronous on the stream).
    pub fn memset(&self, dst: DeviceView<'_>, value: u8) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: dst is a checked view of a live arena; exactly dst.len() bytes are written.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                dst.ptr(),
                value,
                dst.len() as usize,
                self.stream.cu_stream(),
            )
        }
        .map_err(drv("cuMemsetD8Async"))
    }

    /// Makes this device's context current on the calling thread.
    pub(crate) fn ctx_bind(&self) -> Result<(), CudaError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(drv("cuStreamSynchronize"))
    }

    /// A new stream of this context (for copies that overlap compute).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        self.ctx.new_stream().map_err(drv("cuStreamCreate"))
    }

    /// Records a timing-capable event on the compute stream.
    pub fn record_event(&self) -> Result<CudaEvent, CudaError> {
        let ev = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("cuEventCreate"))?;
        ev.record(&self.stream).map_err(drv("cuEventRecord"))?;
        Ok(ev)
    }
}
