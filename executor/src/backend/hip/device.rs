//! The HIP driver operations: device facts and open (kernels compiled for its target and
//! wave size), one `hipMalloc` per planned arena with bounds-checked views, pinned host
//! buffers, streams, events, async copies and memset, module load and function lookup,
//! kernel launch with a `void**` argument array, and stream capture into graphs.
//! Invariant: every call first makes the device current on the calling thread (HIP's
//! current device is per thread), every failure is an error naming the call, and every
//! handle is released exactly once by its owner's `Drop`.

use super::compile::{self, GfxTarget};
use super::ffi::{self, attr, HipApi};
use super::{check, HipError};
use crate::backend::kernel_cache;
use crate::backend::view::{View, ViewError};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// How many arena allocations this process has made (freed ones included).
pub fn arena_allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

fn api() -> Result<&'static HipApi, HipError> {
    ffi::hip().map_err(HipError::Library)
}

/// What the runtime reports about one device, read without compiling anything.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    /// Marketing name, e.g. `AMD Radeon AI PRO R9700`.
    pub name: String,
    /// Target ID, e.g. `gfx1201` or `gfx90a:sramecc+:xnack-`.
    pub target: GfxTarget,
    /// `hipDeviceTotalMem`.
    pub total_bytes: u64,
    /// `hipDeviceAttributeWarpSize`: the wave size the kernels are compiled for.
    pub warp_size: u32,
    /// Compute units.
    pub compute_units: u32,
    pub max_threads_per_block: u32,
    pub max_shared_per_block: u32,
    /// PCI address, e.g. `0000:03:00.0` (lower-case, as sysfs names it).
    pub pci_bus_id: String,
}

/// Number of HIP devices (0 when the runtime loads but finds none).
pub fn device_count() -> Result<usize, HipError> {
    let api = api()?;
    // SAFETY: hipInit takes flags 0; hipGetDeviceCount writes one int.
    let r = unsafe { (api.init)(0) };
    if r == ffi::ERROR_NO_DEVICE {
        return Ok(0);
    }
    check(api, "hipInit", r)?;
    let mut n = 0;
    // SAFETY: n is a valid out-pointer.
    let r = unsafe { (api.get_device_count)(&mut n) };
    if r == ffi::ERROR_NO_DEVICE {
        return Ok(0);
    }
    check(api, "hipGetDeviceCount", r)?;
    Ok(n.max(0) as usize)
}

fn set_device(api: &HipApi, ordinal: usize) -> Result<(), HipError> {
    // SAFETY: plain call on a checked ordinal.
    check(api, format!("hipSetDevice({ordinal})"), unsafe {
        (api.set_device)(ordinal as i32)
    })
}

impl DeviceInfo {
    /// Reads device `ordinal`'s facts (it makes the device current on this thread).
    pub fn query(ordinal: usize) -> Result<Self, HipError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(HipError::NoDevice {
                ordinal,
                count: count as i32,
            });
        }
        let api = api()?;
        set_device(api, ordinal)?;
        let dev = ordinal as i32;
        let attr_of = |a: i32, what: &str| -> Result<u32, HipError> {
            let mut v = 0;
            // SAFETY: v is a valid out-pointer; the attribute id is HIP 6/7's.
            check(api, format!("hipDeviceGetAttribute({what})"), unsafe {
                (api.device_get_attribute)(&mut v, a, dev)
            })?;
            Ok(v.max(0) as u32)
        };
        let mut name = vec![0u8; 256];
        // SAFETY: name holds 256 bytes and we pass that length.
        check(api, "hipDeviceGetName", unsafe {
            (api.device_get_name)(name.as_mut_ptr().cast(), 256, dev)
        })?;
        let mut total = 0usize;
        // SAFETY: total is a valid out-pointer.
        check(api, "hipDeviceTotalMem", unsafe {
            (api.device_total_mem)(&mut total, dev)
        })?;
        let mut bus = vec![0u8; 64];
        // SAFETY: bus holds 64 bytes and we pass that length.
        check(api, "hipDeviceGetPCIBusId", unsafe {
            (api.device_get_pci_bus_id)(bus.as_mut_ptr().cast(), 64, dev)
        })?;
        let arch = gcn_arch_name(api, dev)?;
        let target = GfxTarget::parse(&arch).ok_or_else(|| HipError::Target {
            target: arch.clone(),
            detail: "the runtime's gcnArchName is not a gfx target ID; is this libamdhip64 \
                     ROCm 6 or 7 (hipDeviceProp_tR0600)?"
                .into(),
        })?;
        Ok(Self {
            ordinal,
            name: ffi::buffer_text(&name),
            target,
            total_bytes: total as u64,
            warp_size: attr_of(attr::WARP_SIZE, "warpSize")?,
            compute_units: attr_of(attr::MULTIPROCESSOR_COUNT, "multiProcessorCount")?,
            max_threads_per_block: attr_of(attr::MAX_THREADS_PER_BLOCK, "maxThreadsPerBlock")?,
            max_shared_per_block: attr_of(attr::MAX_SHARED_MEMORY_PER_BLOCK, "sharedMemPerBlock")?,
            pci_bus_id: ffi::buffer_text(&bus).to_ascii_lowercase(),
        })
    }
}

/// `gcnArchName` of `hipDeviceProp_tR0600` (no attribute query returns it).
fn gcn_arch_name(api: &HipApi, dev: i32) -> Result<String, HipError> {
    let mut buf = vec![0u8; ffi::DEVICE_PROP_BUFFER];
    // SAFETY: buf is larger than hipDeviceProp_tR0600 (1472 bytes in ROCm 7.2), zeroed, and
    // suitably aligned for its fields (a Vec<u8> of this size comes from the allocator).
    check(api, "hipGetDevicePropertiesR0600", unsafe {
        (api.get_device_properties)(buf.as_mut_ptr().cast(), dev)
    })?;
    let at = ffi::PROP_GCN_ARCH_NAME;
    Ok(ffi::buffer_text(&buf[at..at + 256]))
}

/// One planned device arena: a single `hipMalloc` of `size` bytes.
pub struct HipArena {
    name: String,
    ptr: u64,
    size: u64,
    ordinal: usize,
}

/// A bounds-checked window of a `HipArena`.
pub type HipView<'a> = View<'a, HipArena>;

impl std::fmt::Debug for HipArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipArena({} bytes `{}`)", self.size, self.name)
    }
}

impl HipArena {
    /// The arena's planned name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The whole arena as one view.
    pub fn all(&self) -> HipView<'_> {
        View::whole(self, self.ptr, self.size)
    }

    /// The window `[offset, offset + len)`, refused when it reaches past the arena's end.
    pub fn view(&self, offset: u64, len: u64) -> Result<HipView<'_>, HipError> {
        self.all().sub(offset, len).map_err(|_| {
            HipError::View(ViewError::OutOfBounds {
                what: format!("arena `{}`", self.name),
                offset,
                len,
                size: self.size,
            })
        })
    }
}

impl Drop for HipArena {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // Errors on teardown cannot be reported from Drop.
            let _ = set_device(api, self.ordinal);
            // SAFETY: ptr came from hipMalloc in `alloc_arena` and is freed only here; no
            // view outlives the arena (their lifetime is tied to &self).
            let _ = unsafe { (api.free)(self.ptr as *mut c_void) };
        }
    }
}

/// Page-locked host memory (`hipHostMalloc`), for async copies and bandwidth tests.
pub struct HipPinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; HIP allows any thread to use it.
unsafe impl Send for HipPinned {}

impl HipPinned {
    /// The buffer's host address (for copies queued on a stream).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr holds len bytes from hipHostMalloc, zeroed at allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HipPinned {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: ptr came from hipHostMalloc and is freed only here.
            let _ = unsafe { (api.host_free)(self.ptr.cast()) };
        }
    }
}

/// A HIP stream (non-blocking with respect to the null stream).
pub struct HipStream {
    raw: ffi::Stream,
}

// SAFETY: a HIP stream handle may be used from any thread.
unsafe impl Send for HipStream {}
// SAFETY: as above; HIP serializes calls on one stream internally.
unsafe impl Sync for HipStream {}

impl HipStream {
    /// The raw `hipStream_t`.
    pub fn raw(&self) -> ffi::Stream {
        self.raw
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), HipError> {
        let api = api()?;
        // SAFETY: raw is a live stream.
        check(api, "hipStreamSynchronize", unsafe {
            (api.stream_synchronize)(self.raw)
        })
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait(&self, event: &HipEvent) -> Result<(), HipError> {
        let api = api()?;
        // SAFETY: both handles are live.
        check(api, "hipStreamWaitEvent", unsafe {
            (api.stream_wait_event)(self.raw, event.raw, 0)
        })
    }
}

impl Drop for HipStream {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: raw came from hipStreamCreateWithFlags and is destroyed only here.
            let _ = unsafe { (api.stream_destroy)(self.raw) };
        }
    }
}

/// A timing-capable event.
pub struct HipEvent {
    raw: ffi::Event,
}

// SAFETY: a HIP event handle may be used from any thread.
unsafe impl Send for HipEvent {}

impl HipEvent {
    /// Records the event on `stream`.
    pub fn record(&self, stream: &HipStream) -> Result<(), HipError> {
        let api = api()?;
        // SAFETY: both handles are live.
        check(api, "hipEventRecord", unsafe {
            (api.event_record)(self.raw, stream.raw)
        })
    }

    /// Waits until the event has completed.
    pub fn synchronize(&self) -> Result<(), HipError> {
        let api = api()?;
        // SAFETY: raw is live.
        check(api, "hipEventSynchronize", unsafe {
            (api.event_synchronize)(self.raw)
        })
    }

    /// Milliseconds from `self` to `end` (both recorded and completed).
    pub fn elapsed_ms(&self, end: &HipEvent) -> Result<f32, HipError> {
        let api = api()?;
        let mut ms = 0f32;
        // SAFETY: ms is a valid out-pointer; both events are live.
        check(api, "hipEventElapsedTime", unsafe {
            (api.event_elapsed_time)(&mut ms, self.raw, end.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: raw came from hipEventCreateWithFlags and is destroyed only here.
            let _ = unsafe { (api.event_destroy)(self.raw) };
        }
    }
}

/// A loaded code object.
pub struct HipModule {
    raw: ffi::Module,
}

impl HipModule {
    /// The kernel `name` of this module.
    pub fn function(&self, name: &str) -> Result<ffi::Function, HipError> {
        let api = api()?;
        let c = CString::new(name).map_err(|_| HipError::UnknownKernel(name.into()))?;
        let mut f: ffi::Function = std::ptr::null_mut();
        // SAFETY: f is a valid out-pointer, raw a live module, c NUL-terminated.
        check(api, format!("hipModuleGetFunction(`{name}`)"), unsafe {
            (api.module_get_function)(&mut f, self.raw, c.as_ptr())
        })?;
        Ok(f)
    }
}

impl Drop for HipModule {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: raw came from hipModuleLoadData and is unloaded only here; the device
            // owning it drops its function handles with it.
            let _ = unsafe { (api.module_unload)(self.raw) };
        }
    }
}

/// An instantiated graph (captured from a stream), launchable any number of times.
pub struct HipGraph {
    graph: ffi::Graph,
    exec: ffi::GraphExec,
}

impl HipGraph {
    /// Replays the graph on `stream`.
    pub fn launch(&self, stream: &HipStream) -> Result<(), HipError> {
        let api = api()?;
        // SAFETY: exec is a live instantiated graph, stream a live stream.
        check(api, "hipGraphLaunch", unsafe {
            (api.graph_launch)(self.exec, stream.raw)
        })
    }
}

impl Drop for HipGraph {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: both handles are owned here and destroyed once, the executable first.
            unsafe {
                let _ = (api.graph_exec_destroy)(self.exec);
                let _ = (api.graph_destroy)(self.graph);
            }
        }
    }
}

/// One opened HIP device: its facts, the compute stream and every portable kernel,
/// compiled by hiprtc for its target and wave size (or read from the on-disk cache).
pub struct HipDevice {
    api: &'static HipApi,
    info: DeviceInfo,
    stream: HipStream,
    compiler: String,
    cache_dir: Option<PathBuf>,
    modules: Vec<HipModule>,
    functions: HashMap<&'static str, ffi::Function>,
    /// How many modules came from the disk cache rather than hiprtc.
    pub modules_from_cache: usize,
}

// SAFETY: the handles a HipDevice holds (stream, modules, functions) may be used from any
// thread; every call makes the device current on the calling thread first.
unsafe impl Send for HipDevice {}
// SAFETY: as above; the HIP runtime's calls are thread-safe.
unsafe impl Sync for HipDevice {}

impl std::fmt::Debug for HipDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipDevice")
            .field("ordinal", &self.info.ordinal)
            .field("name", &self.info.name)
            .field("target", &self.info.target.id())
            .field("warp_size", &self.info.warp_size)
            .finish()
    }
}

impl HipDevice {
    /// Opens device `ordinal` and loads every portable kernel module (compiled by hiprtc for
    /// its target at its wave size, cached under `kernel_cache::cache_dir()`).
    pub fn open(ordinal: usize) -> Result<Self, HipError> {
        let mut d = Self::open_bare(ordinal)?;
        d.load_kernels()?;
        Ok(d)
    }

    /// Opens device `ordinal` with its stream but no kernels (for the probe).
    pub fn open_bare(ordinal: usize) -> Result<Self, HipError> {
        super::check_libraries()?;
        let info = DeviceInfo::query(ordinal)?;
        let api = api()?;
        let stream = new_stream(api)?;
        Ok(Self {
            api,
            info,
            stream,
            compiler: compile::compiler_id()?,
            cache_dir: kernel_cache::cache_dir(),
            modules: Vec::new(),
            functions: HashMap::new(),
            modules_from_cache: 0,
        })
    }

    /// Compiles (or reads from the cache) and loads every module that is not CUDA-only.
    pub fn load_kernels(&mut self) -> Result<(), HipError> {
        let wave = self.info.warp_size;
        for src in strata_kernels::all().iter().filter(|s| !s.cuda_only) {
            let (code, cached) = compile::load_or_compile(
                src,
                &self.info.target,
                wave,
                &self.compiler,
                self.cache_dir.as_deref(),
            )?;
            self.modules_from_cache += cached as usize;
            let module = self.load_module(&code, src.name)?;
            for &e in src.entry_points {
                self.functions.insert(e, module.function(e)?);
            }
            self.modules.push(module);
        }
        Ok(())
    }

    fn bind(&self) -> Result<(), HipError> {
        set_device(self.api, self.info.ordinal)
    }

    /// The device's facts.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The target the kernels were compiled for, e.g. `gfx1201`.
    pub fn arch(&self) -> String {
        self.info.target.id()
    }

    /// hiprtc's identity as used in cache keys.
    pub fn compiler(&self) -> &str {
        &self.compiler
    }

    /// (free, total) device memory now, in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64), HipError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers.
        check(self.api, "hipMemGetInfo", unsafe {
            (self.api.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    /// Whether this device can read `peer`'s memory directly.
    pub fn can_access_peer(&self, peer: usize) -> Result<bool, HipError> {
        let mut v = 0;
        // SAFETY: v is a valid out-pointer.
        check(self.api, "hipDeviceCanAccessPeer", unsafe {
            (self.api.device_can_access_peer)(&mut v, self.info.ordinal as i32, peer as i32)
        })?;
        Ok(v != 0)
    }

    /// The compute stream.
    pub fn stream(&self) -> &HipStream {
        &self.stream
    }

    /// A new stream of this device (for copies that overlap compute).
    pub fn new_stream(&self) -> Result<HipStream, HipError> {
        self.bind()?;
        new_stream(self.api)
    }

    /// A new timing-capable event.
    pub fn new_event(&self) -> Result<HipEvent, HipError> {
        self.bind()?;
        let mut raw: ffi::Event = std::ptr::null_mut();
        // SAFETY: raw is a valid out-pointer.
        check(self.api, "hipEventCreateWithFlags", unsafe {
            (self.api.event_create)(&mut raw, ffi::EVENT_DEFAULT)
        })?;
        Ok(HipEvent { raw })
    }

    /// One device allocation of exactly `size` bytes for the planned arena `name`.
    pub fn alloc_arena(&self, name: &str, size: u64) -> Result<HipArena, HipError> {
        if size == 0 {
            return Err(HipError::Shape {
                op: "alloc_arena",
                detail: format!("arena `{name}` has size 0; the plan must give it bytes"),
            });
        }
        let bytes = usize::try_from(size).map_err(|_| HipError::Shape {
            op: "alloc_arena",
            detail: format!("arena `{name}` of {size} bytes does not fit this host's usize"),
        })?;
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: p is a valid out-pointer; the allocation is owned by the returned arena.
        let r = unsafe { (self.api.malloc)(&mut p, bytes) };
        check(
            self.api,
            format!("hipMalloc of {size} bytes for arena `{name}`"),
            r,
        )?;
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        Ok(HipArena {
            name: name.to_string(),
            ptr: p as u64,
            size,
            ordinal: self.info.ordinal,
        })
    }

    /// `len` bytes of zeroed page-locked host memory.
    pub fn alloc_pinned(&self, len: usize) -> Result<HipPinned, HipError> {
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: p is a valid out-pointer; the buffer is owned by the returned value.
        check(self.api, format!("hipHostMalloc of {len} bytes"), unsafe {
            (self.api.host_malloc)(&mut p, len.max(1), ffi::HOST_MALLOC_DEFAULT)
        })?;
        // SAFETY: p holds at least len bytes just allocated.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
        Ok(HipPinned { ptr: p.cast(), len })
    }

    /// `len` bytes of zeroed page-locked host memory pinned for every device and mapped into
    /// their address space, with its device address (KV cells beyond `--kv-resident`, which
    /// kernels read and write in place).
    pub fn alloc_pinned_mapped(&self, len: usize) -> Result<(HipPinned, u64), HipError> {
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = ffi::HOST_MALLOC_PORTABLE | ffi::HOST_MALLOC_MAPPED;
        // SAFETY: p is a valid out-pointer; the buffer is owned by the value made below.
        let r = unsafe { (self.api.host_malloc)(&mut p, len.max(1), flags) };
        check(self.api, format!("hipHostMalloc(mapped) of {len} bytes"), r)?;
        // SAFETY: p holds at least len bytes just allocated.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
        let buf = HipPinned { ptr: p.cast(), len };
        let mut d: *mut c_void = std::ptr::null_mut();
        // SAFETY: p is a live mapped allocation; the call writes one device address into d.
        let r = unsafe { (self.api.host_get_device_pointer)(&mut d, p, 0) };
        check(
            self.api,
            format!("hipHostGetDevicePointer of {len} bytes"),
            r,
        )?;
        Ok((buf, d as u64))
    }

    /// Queues a copy of `src` into `dst` (equal lengths) on `stream`.
    ///
    /// # Safety
    /// `src` must stay alive and unchanged until the stream has passed the copy (pinned
    /// memory for a truly asynchronous copy; pageable memory is staged by the runtime).
    pub unsafe fn htod_async(
        &self,
        src: &[u8],
        dst: HipView<'_>,
        stream: &HipStream,
    ) -> Result<(), HipError> {
        dst.expect_len("htod", src.len() as u64)?;
        self.bind()?;
        // SAFETY: dst is a checked view of exactly src.len() bytes; the caller keeps src
        // alive until the copy completes.
        check(self.api, "hipMemcpyAsync(host to device)", unsafe {
            (self.api.memcpy_async)(
                dst.ptr() as *mut c_void,
                src.as_ptr().cast(),
                src.len(),
                ffi::memcpy_kind::HOST_TO_DEVICE,
                stream.raw,
            )
        })
    }

    /// Queues a copy of `src` into `dst` (equal lengths) on `stream`.
    ///
    /// # Safety
    /// `dst` must stay alive and unread until the stream has passed the copy.
    pub unsafe fn dtoh_async(
        &self,
        src: HipView<'_>,
        dst: &mut [u8],
        stream: &HipStream,
    ) -> Result<(), HipError> {
        src.expect_len("dtoh", dst.len() as u64)?;
        self.bind()?;
        // SAFETY: src is a checked view of exactly dst.len() bytes; the caller keeps dst
        // borrowed until the copy completes.
        check(self.api, "hipMemcpyAsync(device to host)", unsafe {
            (self.api.memcpy_async)(
                dst.as_mut_ptr().cast(),
                src.ptr() as *const c_void,
                dst.len(),
                ffi::memcpy_kind::DEVICE_TO_HOST,
                stream.raw,
            )
        })
    }

    /// Queues a device-to-device copy of equal-length views on `stream`.
    pub fn dtod_async(
        &self,
        src: HipView<'_>,
        dst: HipView<'_>,
        stream: &HipStream,
    ) -> Result<(), HipError> {
        dst.expect_len("dtod", src.len())?;
        self.bind()?;
        // SAFETY: both are checked views of live arenas of the same length.
        check(self.api, "hipMemcpyAsync(device to device)", unsafe {
            (self.api.memcpy_async)(
                dst.ptr() as *mut c_void,
                src.ptr() as *const c_void,
                src.len() as usize,
                ffi::memcpy_kind::DEVICE_TO_DEVICE,
                stream.raw,
            )
        })
    }

    /// Copies `src` into `dst` (equal lengths) on the compute stream and waits.
    pub fn htod(&self, src: &[u8], dst: HipView<'_>) -> Result<(), HipError> {
        // SAFETY: the stream is synchronized before src's borrow ends.
        unsafe { self.htod_async(src, dst, &self.stream)? };
        self.stream.synchronize()
    }

    /// Copies `src` into `dst` (equal lengths) on the compute stream and waits.
    pub fn dtoh(&self, src: HipView<'_>, dst: &mut [u8]) -> Result<(), HipError> {
        // SAFETY: the stream is synchronized before dst's borrow ends.
        unsafe { self.dtoh_async(src, dst, &self.stream)? };
        self.stream.synchronize()
    }

    /// Queues setting every byte of `dst` to `value` on `stream`.
    pub fn memset_async(
        &self,
        dst: HipView<'_>,
        value: u8,
        stream: &HipStream,
    ) -> Result<(), HipError> {
        // SAFETY: dst is a checked view of a live arena; exactly dst.len() bytes are written.
        unsafe { self.memset_raw_async(dst.ptr(), dst.len() as usize, value, stream) }
    }

    /// Queues setting `len` bytes from device address `dst` to `value` on `stream`.
    ///
    /// # Safety
    /// `[dst, dst + len)` must lie in a live allocation of this device.
    pub unsafe fn memset_raw_async(
        &self,
        dst: u64,
        len: usize,
        value: u8,
        stream: &HipStream,
    ) -> Result<(), HipError> {
        self.bind()?;
        // SAFETY: the caller's contract.
        check(self.api, "hipMemsetAsync", unsafe {
            (self.api.memset_async)(dst as *mut c_void, value as i32, len, stream.raw)
        })
    }

    /// Loads a code object (for the engine: every strata module is loaded by `open`).
    pub fn load_module(&self, code: &[u8], what: &str) -> Result<HipModule, HipError> {
        self.bind()?;
        let mut raw: ffi::Module = std::ptr::null_mut();
        // SAFETY: code is a whole code object that outlives the call (HIP copies it).
        let r = unsafe { (self.api.module_load_data)(&mut raw, code.as_ptr().cast()) };
        check(self.api, format!("hipModuleLoadData(module `{what}`)"), r)?;
        Ok(HipModule { raw })
    }

    /// The loaded strata kernel `name`.
    pub fn function(&self, name: &str) -> Result<ffi::Function, HipError> {
        self.functions
            .get(name)
            .copied()
            .ok_or_else(|| HipError::UnknownKernel(name.to_string()))
    }

    /// Queues kernel `f` on `stream`: `grid` blocks of `block` threads with `shared` bytes of
    /// dynamic shared memory; `args` holds one pointer to each parameter's value, in order.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list in number, order and types, every
    /// pointer it passes must address memory the kernel may touch for as long as it runs,
    /// and the values pointed to must stay alive until this call returns.
    pub unsafe fn launch(
        &self,
        f: ffi::Function,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        stream: &HipStream,
        args: &mut [*mut c_void],
    ) -> Result<(), HipError> {
        let threads = block.0 as u64 * block.1 as u64 * block.2 as u64;
        if threads == 0 || threads > self.info.max_threads_per_block as u64 {
            return Err(HipError::Shape {
                op: "launch",
                detail: format!(
                    "block {block:?} has {threads} threads; this device takes 1..={}",
                    self.info.max_threads_per_block
                ),
            });
        }
        if shared > self.info.max_shared_per_block {
            return Err(HipError::Shape {
                op: "launch",
                detail: format!(
                    "{shared} bytes of shared memory; this device gives a block at most {}",
                    self.info.max_shared_per_block
                ),
            });
        }
        self.bind()?;
        // SAFETY: the caller guarantees args matches the kernel; f is a live function.
        check(self.api, "hipModuleLaunchKernel", unsafe {
            (self.api.module_launch_kernel)(
                f,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared,
                stream.raw,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Captures what `record` queues on `stream` into an instantiated graph. The capture is
    /// thread-local: other threads' calls do not break it. `record` must only queue work.
    pub fn capture(
        &self,
        stream: &HipStream,
        record: impl FnOnce() -> Result<(), HipError>,
    ) -> Result<HipGraph, HipError> {
        self.begin_capture(stream)?;
        let recorded = record();
        let graph = self.end_capture(stream);
        recorded?;
        graph
    }

    /// Starts capturing what is queued on `stream` (thread-local mode); every begin must be
    /// followed by [`HipDevice::end_capture`], also when recording failed, so the stream is
    /// usable again.
    pub fn begin_capture(&self, stream: &HipStream) -> Result<(), HipError> {
        self.bind()?;
        // SAFETY: stream is live and not capturing.
        check(self.api, "hipStreamBeginCapture", unsafe {
            (self.api.stream_begin_capture)(stream.raw, ffi::CAPTURE_MODE_THREAD_LOCAL)
        })
    }

    /// Ends the capture begun on `stream` and instantiates what it recorded.
    pub fn end_capture(&self, stream: &HipStream) -> Result<HipGraph, HipError> {
        self.bind()?;
        let mut graph: ffi::Graph = std::ptr::null_mut();
        // SAFETY: ends a capture begun on this stream; graph is a valid out-pointer.
        check(self.api, "hipStreamEndCapture", unsafe {
            (self.api.stream_end_capture)(stream.raw, &mut graph)
        })?;
        if graph.is_null() {
            return Err(HipError::Shape {
                op: "capture",
                detail: "HIP graph capture produced no graph".into(),
            });
        }
        let mut exec: ffi::GraphExec = std::ptr::null_mut();
        let mut log = vec![0u8; 1024];
        // SAFETY: graph is a captured graph; log holds 1024 bytes and we say so.
        let r = unsafe {
            (self.api.graph_instantiate)(
                &mut exec,
                graph,
                std::ptr::null_mut(),
                log.as_mut_ptr().cast(),
                log.len(),
            )
        };
        if let Err(mut e) = check(self.api, "hipGraphInstantiate", r) {
            // SAFETY: graph is not used again.
            let _ = unsafe { (self.api.graph_destroy)(graph) };
            if let HipError::Call { text, .. } = &mut e {
                text.push_str(&format!(" ({})", ffi::buffer_text(&log)));
            }
            return Err(e);
        }
        Ok(HipGraph { graph, exec })
    }

    /// Queues a copy of `bytes` bytes between raw addresses on `stream`; `kind` is a
    /// `ffi::memcpy_kind` (`DEFAULT` lets the runtime tell host, device and peer apart).
    ///
    /// # Safety
    /// Both ranges must be live memory of at least `bytes` bytes of the kinds `kind` names
    /// until the stream has passed the copy (host memory: pinned, or pageable that the
    /// caller keeps alive until the stream is synchronized).
    pub unsafe fn copy_raw_async(
        &self,
        what: &str,
        dst: *mut c_void,
        src: *const c_void,
        bytes: usize,
        kind: i32,
        stream: &HipStream,
    ) -> Result<(), HipError> {
        self.bind()?;
        // SAFETY: the caller's contract.
        check(self.api, format!("hipMemcpyAsync({what})"), unsafe {
            (self.api.memcpy_async)(dst, src, bytes, kind, stream.raw)
        })
    }

    /// Lets this device read `peer`'s memory directly (already enabled is fine).
    pub fn enable_peer_access(&self, peer: usize) -> Result<(), HipError> {
        self.bind()?;
        // SAFETY: plain call on an enumerated peer ordinal.
        let r = unsafe { (self.api.device_enable_peer_access)(peer as i32, 0) };
        if r == ffi::ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check(
            self.api,
            format!(
                "hipDeviceEnablePeerAccess(GPU {} reading GPU {peer})",
                self.info.ordinal
            ),
            r,
        )
    }

    /// `len` bytes of zeroed page-locked host memory pinned for every device (hand-offs
    /// between GPUs).
    pub fn alloc_pinned_portable(&self, len: usize) -> Result<HipPinned, HipError> {
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let what = format!("hipHostMalloc(portable) of {len} bytes");
        // SAFETY: p is a valid out-pointer; the buffer is owned by the returned value.
        let r = unsafe { (self.api.host_malloc)(&mut p, len.max(1), ffi::HOST_MALLOC_PORTABLE) };
        check(self.api, what, r)?;
        // SAFETY: p holds at least len bytes just allocated.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
        Ok(HipPinned { ptr: p.cast(), len })
    }
}

fn new_stream(api: &HipApi) -> Result<HipStream, HipError> {
    let mut raw: ffi::Stream = std::ptr::null_mut();
    // SAFETY: raw is a valid out-pointer.
    check(api, "hipStreamCreateWithFlags", unsafe {
        (api.stream_create)(&mut raw, ffi::STREAM_NON_BLOCKING)
    })?;
    Ok(HipStream { raw })
}
