//! CUDA measurements for `strata-exec probe`: per device its name, arch, total memory, free
//! memory after each step of start-up (context, our kernel modules, a cuBLAS handle that has
//! run a product, a captured CUDA graph), the PCIe link from sysfs, and timed host-to-device
//! and device-to-device copies; then the cost model's coefficients (`cost`).
//! Invariant: every number in a `DeviceMeasure` was read from the driver, sysfs or a timed
//! copy on this machine; what could not be measured is `None` with a note saying why, never a
//! default. Every buffer made here is freed before the free-memory readings that follow it.

pub mod cost;
pub mod experts;
pub mod linear;
pub mod round_trip;
pub mod types;

use super::{check_libraries, drv, no_panic, CudaDevice, CudaError};
use cudarc::driver::sys::{CUdevice_attribute, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaContext;
use std::path::Path;

/// Bytes per host-to-device copy when timing the PCIe path.
pub const H2D_BYTES: u64 = 256 << 20;
/// Timed host-to-device copies (after one untimed warm-up copy).
pub const H2D_REPEATS: u32 = 8;
/// Bytes per device-to-device copy when timing memory bandwidth.
pub const D2D_BYTES: u64 = 1 << 30;
/// Timed device-to-device copies (after one untimed warm-up copy).
pub const D2D_REPEATS: u32 = 5;

pub use crate::backend::pcie::PcieLink;

/// What was measured on one CUDA device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceMeasure {
    pub ordinal: u32,
    pub name: String,
    /// e.g. `sm_90`, from the compute capability.
    pub arch: String,
    /// `cuDeviceTotalMem`.
    pub total_bytes: u64,
    /// `cuMemGetInfo` right after the primary context was created (other processes' use of
    /// the device is in here too).
    pub free_after_context: u64,
    /// ... after every strata kernel module was loaded (`CudaDevice::open`).
    pub free_after_modules: u64,
    /// ... after a cuBLAS handle ran one SGEMM (its workspace and kernels); None: no cuBLAS.
    pub free_after_blas: Option<u64>,
    /// ... after a small graph (memset + copy) was captured, instantiated and launched.
    pub free_after_graph: Option<u64>,
    /// PCI address as sysfs names it, e.g. `0000:18:00.0`.
    pub pci_bus_id: String,
    /// None when sysfs has no link files for the device (a VM or container without /sys).
    pub pcie: Option<PcieLink>,
    /// Pinned host buffer to device, GB/s (1e9 bytes/s).
    pub h2d_gbps: Option<f64>,
    /// Device-to-device copy, counting bytes read plus bytes written, GB/s.
    pub d2d_gbps: Option<f64>,
    /// Seconds `CudaDevice::open` took (NVRTC compiles, or the kernel cache).
    pub open_seconds: f64,
    /// Kernel modules served by the disk cache at open.
    pub modules_from_cache: usize,
    /// Ordinals of the other devices whose memory this one can read directly
    /// (`cuDeviceCanAccessPeer`).
    pub peers: Vec<u32>,
    /// The `[device.cost]` coefficients timed with the engine's kernels (None: not enough
    /// free memory to run them; the reason is in `notes`).
    pub cost: Option<cost::CostMeasure>,
    /// Why something above is None, or anything odd seen while measuring.
    pub notes: Vec<String>,
}

impl DeviceMeasure {
    /// The lowest free-memory reading after start-up.
    pub fn free_after_startup(&self) -> u64 {
        [
            Some(self.free_after_context),
            Some(self.free_after_modules),
            self.free_after_blas,
            self.free_after_graph,
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(self.free_after_context)
    }

    /// Runtime reserve as measured: total memory less what is free once the context, our
    /// modules, cuBLAS and a graph exist. Includes other processes' use of the device.
    pub fn runtime_reserve(&self) -> u64 {
        self.total_bytes.saturating_sub(self.free_after_startup())
    }
}

/// How many CUDA devices the driver reports; an error when libcuda or libnvrtc is missing or
/// the driver cannot start.
pub fn device_count() -> Result<usize, CudaError> {
    check_libraries()?;
    no_panic("counting CUDA devices", || {
        cudarc::driver::result::init().map_err(drv("cuInit"))?;
        let n = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))?;
        Ok(n.max(0) as usize)
    })
}

/// Measures device `ordinal`; `progress` receives one line per step.
pub fn measure_device(
    ordinal: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<DeviceMeasure, CudaError> {
    check_libraries()?;
    no_panic("probing a CUDA device", || measure_inner(ordinal, progress))
}

fn mem_free(ctx: &CudaContext) -> Result<u64, CudaError> {
    let (free, _total) = ctx.mem_get_info().map_err(drv("cuMemGetInfo"))?;
    Ok(free as u64)
}

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64)
}

fn measure_inner(
    ordinal: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<DeviceMeasure, CudaError> {
    cudarc::driver::result::init().map_err(drv("cuInit"))?;
    let mut notes = Vec::new();
    // The primary context first, alone, so its cost can be read before anything else loads.
    let ctx = CudaContext::new(ordinal).map_err(drv(format!("context for device {ordinal}")))?;
    let total_bytes = ctx.total_mem().map_err(drv("cuDeviceTotalMem"))? as u64;
    let free_after_context = mem_free(&ctx)?;
    let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
    let cc = ctx
        .compute_capability()
        .map_err(drv("cuDeviceGetAttribute(compute capability)"))?;
    let arch = super::compile::arch_name(cc);
    progress(&format!(
        "device {ordinal}: {name} ({arch}), {} total, {} free after context",
        mib(total_bytes),
        mib(free_after_context)
    ));
    let pci_bus_id = pci_bus_id(&ctx)?;

    // Our kernel modules: CudaDevice::open retains the same primary context and loads them.
    let t = std::time::Instant::now();
    let dev = CudaDevice::open(ordinal)?;
    let open_seconds = t.elapsed().as_secs_f64();
    let free_after_modules = mem_free(&ctx)?;
    progress(&format!(
        "device {ordinal}: {} kernel modules loaded in {open_seconds:.1}s ({} from cache), {} free",
        strata_kernels::all().len(),
        dev.modules_from_cache,
        mib(free_after_modules)
    ));

    let blas = blas_step(&dev);
    let free_after_blas = free_after_blas(&blas, &ctx, ordinal, progress, &mut notes)?;

    let graph = graph_step(&dev)?;
    let free_after_graph = mem_free(&ctx)?;
    progress(&format!(
        "device {ordinal}: a captured CUDA graph ran, {} free",
        mib(free_after_graph)
    ));

    let h2d_gbps = h2d_measured(&dev, ordinal, progress, &mut notes);
    // Read the link right after the copies: idle GPUs train their link down to save power.
    let pcie = pcie_measured(&pci_bus_id, ordinal, progress, &mut notes);
    let d2d_gbps = d2d_measured(&dev, &ctx, ordinal, progress, &mut notes)?;

    drop((graph, blas));
    let cost = cost_measured(&dev, &ctx, ordinal, progress, &mut notes)?;
    let peers = peers_of(ordinal)?;
    Ok(DeviceMeasure {
        ordinal: ordinal as u32,
        name,
        arch,
        total_bytes,
        free_after_context,
        free_after_modules,
        free_after_blas,
        free_after_graph: Some(free_after_graph),
        pci_bus_id,
        pcie,
        h2d_gbps,
        d2d_gbps,
        open_seconds,
        modules_from_cache: dev.modules_from_cache,
        peers,
        cost,
        notes,
    })
}

/// The device's PCI address as sysfs names it, e.g. `0000:18:00.0`.
fn pci_bus_id(ctx: &CudaContext) -> Result<String, CudaError> {
    let attr = |a: CUdevice_attribute, what: &str| -> Result<i32, CudaError> {
        ctx.attribute(a)
            .map_err(drv(format!("cuDeviceGetAttribute({what})")))
    };
    Ok(format!(
        "{:04x}:{:02x}:{:02x}.0",
        attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
            "PCI domain"
        )?,
        attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
            "PCI bus"
        )?,
        attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID,
            "PCI device"
        )?
    ))
}

/// Free memory once the cuBLAS step ran; None (and a note) when it failed.
fn free_after_blas(
    blas: &Result<cudarc::cublas::CudaBlas, CudaError>,
    ctx: &CudaContext,
    ordinal: usize,
    progress: &mut dyn FnMut(&str),
    notes: &mut Vec<String>,
) -> Result<Option<u64>, CudaError> {
    Ok(match blas {
        Ok(_) => {
            let f = mem_free(ctx)?;
            progress(&format!(
                "device {ordinal}: cuBLAS handle ran one SGEMM, {} free",
                mib(f)
            ));
            Some(f)
        }
        Err(e) => {
            notes.push(format!("cuBLAS not measured: {e}"));
            progress(&format!("device {ordinal}: cuBLAS not measured: {e}"));
            None
        }
    })
}

/// Host-to-device GB/s; None (and a note) when the copies failed.
fn h2d_measured(
    dev: &CudaDevice,
    ordinal: usize,
    progress: &mut dyn FnMut(&str),
    notes: &mut Vec<String>,
) -> Option<f64> {
    match h2d_step(dev) {
        Ok(g) => {
            progress(&format!(
                "device {ordinal}: host-to-device {g:.1} GB/s ({H2D_REPEATS} x {} pinned)",
                mib(H2D_BYTES)
            ));
            Some(g)
        }
        Err(e) => {
            notes.push(format!("host-to-device not measured: {e}"));
            progress(&format!(
                "device {ordinal}: host-to-device not measured: {e}"
            ));
            None
        }
    }
}

/// The PCIe link of `pci_bus_id` from sysfs, with a note when it runs below its maximum or
/// has no link files.
fn pcie_measured(
    pci_bus_id: &str,
    ordinal: usize,
    progress: &mut dyn FnMut(&str),
    notes: &mut Vec<String>,
) -> Option<PcieLink> {
    let pcie = read_pcie_link(Path::new("/sys/bus/pci/devices"), pci_bus_id);
    match pcie {
        Some(l) => {
            progress(&format!(
                "device {ordinal}: PCIe {pci_bus_id} gen {} x{} (max gen {} x{})",
                l.gen,
                l.width,
                l.max_gen.map_or("?".into(), |g| g.to_string()),
                l.max_width.map_or("?".into(), |w| w.to_string())
            ));
            if l.max_gen.is_some_and(|m| m > l.gen) || l.max_width.is_some_and(|m| m > l.width) {
                notes.push(format!(
                    "PCIe link runs below its maximum (gen {} x{} of gen {} x{}) even after the copy test",
                    l.gen,
                    l.width,
                    l.max_gen.unwrap_or(l.gen),
                    l.max_width.unwrap_or(l.width)
                ));
            }
        }
        None => {
            notes.push(format!(
                "no PCIe link in /sys/bus/pci/devices/{pci_bus_id}/current_link_speed"
            ));
            progress(&format!(
                "device {ordinal}: no PCIe link files in sysfs for {pci_bus_id}"
            ));
        }
    }
    pcie
}

/// Device-to-device GB/s when two copy buffers fit in free memory; None (and a note)
/// otherwise or when the copies failed.
fn d2d_measured(
    dev: &CudaDevice,
    ctx: &CudaContext,
    ordinal: usize,
    progress: &mut dyn FnMut(&str),
    notes: &mut Vec<String>,
) -> Result<Option<f64>, CudaError> {
    let free_now = mem_free(ctx)?;
    Ok(if free_now > 2 * D2D_BYTES + (512 << 20) {
        match d2d_step(dev) {
            Ok(g) => {
                progress(&format!(
                    "device {ordinal}: device-to-device copy {g:.0} GB/s (read + write, {D2D_REPEATS} x {})",
                    mib(D2D_BYTES)
                ));
                Some(g)
            }
            Err(e) => {
                notes.push(format!("memory bandwidth not measured: {e}"));
                None
            }
        }
    } else {
        notes.push(format!(
            "memory bandwidth not measured: {} free is too little for two {} buffers",
            mib(free_now),
            mib(D2D_BYTES)
        ));
        None
    })
}

/// The `[device.cost]` coefficients when two cost arenas fit in free memory; None (and a
/// note) otherwise.
fn cost_measured(
    dev: &CudaDevice,
    ctx: &CudaContext,
    ordinal: usize,
    progress: &mut dyn FnMut(&str),
    notes: &mut Vec<String>,
) -> Result<Option<cost::CostMeasure>, CudaError> {
    let free_now = mem_free(ctx)?;
    Ok(if free_now > 2 * cost::COST_ARENA_BYTES + (512 << 20) {
        progress(&format!(
            "device {ordinal}: timing the engine's kernels for [device.cost]"
        ));
        let c = cost::measure_cost(dev, &mut |l| progress(&format!("device {ordinal}: {l}")));
        for n in &c.notes {
            progress(&format!("device {ordinal}: note: {n}"));
        }
        Some(c)
    } else {
        notes.push(format!(
            "[device.cost] not measured: {} free is too little for two {} buffers",
            mib(free_now),
            mib(cost::COST_ARENA_BYTES)
        ));
        None
    })
}

/// Ordinals of the other CUDA devices that device `ordinal` can read directly.
fn peers_of(ordinal: usize) -> Result<Vec<u32>, CudaError> {
    use cudarc::driver::sys;
    let n = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))?;
    let handle = |o: usize| -> Result<sys::CUdevice, CudaError> {
        let mut d = 0;
        // SAFETY: writes one device handle; `o` is below the driver's device count.
        unsafe { sys::cuDeviceGet(&mut d, o as i32) }
            .result()
            .map_err(drv(format!("cuDeviceGet({o})")))?;
        Ok(d)
    };
    let me = handle(ordinal)?;
    let mut out = Vec::new();
    for o in (0..n.max(0) as usize).filter(|&o| o != ordinal) {
        let mut ok = 0;
        // SAFETY: writes one int; both handles come from cuDeviceGet above.
        unsafe { sys::cuDeviceCanAccessPeer(&mut ok, me, handle(o)?) }
            .result()
            .map_err(drv("cuDeviceCanAccessPeer"))?;
        if ok != 0 {
            out.push(o as u32);
        }
    }
    Ok(out)
}

/// A cuBLAS handle on the compute stream runs one 256x256 SGEMM, which makes it allocate its
/// workspace and load its kernels. The handle is returned so that it (and its workspace)
/// stays alive through the readings after it; the operand buffers are freed on return.
fn blas_step(dev: &CudaDevice) -> Result<cudarc::cublas::CudaBlas, CudaError> {
    // SAFETY: only dlopens candidate names of libcublas and closes them again.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(CudaError::LibraryMissing {
            lib: "libcublas",
            candidates: cudarc::get_lib_name_candidates("cublas"),
        });
    }
    let blas_err = |e: cudarc::cublas::result::CublasError| CudaError::Shape {
        op: "cuBLAS",
        detail: format!("{e:?}"),
    };
    let n = 256usize;
    let bytes = (n * n * 4) as u64;
    let a = dev.alloc_arena("probe-gemm-a", bytes)?;
    let c = dev.alloc_arena("probe-gemm-c", bytes)?;
    dev.memset(a.all(), 0)?;
    let blas = cudarc::cublas::CudaBlas::new(dev.stream()?.clone()).map_err(blas_err)?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let op = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
    // SAFETY: a and c are live arenas of n*n f32 each on this context; the product reads a
    // twice and writes c, all n x n with leading dimension n; alpha and beta outlive the call
    // because the stream is synchronized before they go out of scope.
    unsafe {
        cudarc::cublas::result::sgemm(
            *blas.handle(),
            op,
            op,
            n as i32,
            n as i32,
            n as i32,
            &alpha,
            a.all().ptr() as *const f32,
            n as i32,
            a.all().ptr() as *const f32,
            n as i32,
            &beta,
            c.all().ptr() as *mut f32,
            n as i32,
        )
    }
    .map_err(blas_err)?;
    dev.synchronize()?;
    Ok(blas)
}

/// Captures a memset and a device copy on a fresh stream into a graph, instantiates,
/// uploads and launches it, waits and checks the copy; the instantiated graph is returned so
/// that it stays alive through the readings after it.
fn graph_step(dev: &CudaDevice) -> Result<cudarc::driver::CudaGraph, CudaError> {
    let buf = dev.alloc_arena("probe-graph", 2 << 20)?;
    let half = buf.size() / 2;
    let (lo, hi) = (buf.view(0, half)?, buf.view(half, half)?);
    let stream = dev.new_stream()?;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv("cuStreamBeginCapture"))?;
    // SAFETY: lo and hi are disjoint checked views of the live arena `buf`, which outlives
    // the graph's launch (the stream is synchronized below before buf drops).
    let queued = unsafe {
        cudarc::driver::result::memset_d8_async(lo.ptr(), 7, lo.len() as usize, stream.cu_stream())
            .and_then(|()| {
                cudarc::driver::result::memcpy_dtod_async(
                    hi.ptr(),
                    lo.ptr(),
                    lo.len() as usize,
                    stream.cu_stream(),
                )
            })
    };
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    queued.map_err(drv("capturing memset + copy"))?;
    let graph = graph.map_err(drv("cuStreamEndCapture / cuGraphInstantiate"))?;
    let Some(graph) = graph else {
        return Err(CudaError::Shape {
            op: "graph capture",
            detail: "the driver captured an empty graph".into(),
        });
    };
    graph.upload().map_err(drv("cuGraphUpload"))?;
    graph.launch().map_err(drv("cuGraphLaunch"))?;
    stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
    let mut check = [0u8; 4];
    dev.dtoh(hi.sub(0, 4)?, &mut check)?;
    if check != [7; 4] {
        return Err(CudaError::Shape {
            op: "graph capture",
            detail: format!("the graph's copy gave {check:?}, expected [7, 7, 7, 7]"),
        });
    }
    Ok(graph)
}

/// A pinned host buffer from `cuMemHostAlloc`, freed on drop.
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

impl Pinned {
    fn new(len: usize) -> Result<Self, CudaError> {
        // SAFETY: a plain cuMemHostAlloc with the caller's context bound; the pointer is
        // owned by the returned value and freed once in Drop.
        let ptr = unsafe { cudarc::driver::result::malloc_host(len, 0) }
            .map_err(drv(format!("cuMemHostAlloc of {len} bytes")))?;
        let p = Self {
            ptr: ptr as *mut u8,
            len,
        };
        // SAFETY: ptr points to len writable bytes that we own; filling initialises them.
        unsafe { std::ptr::write_bytes(p.ptr, 0x5a, len) };
        Ok(p)
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr holds len bytes initialised in `new`, alive until drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemHostAlloc and is freed exactly once, here.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// Times `H2D_REPEATS` copies of a pinned `H2D_BYTES` buffer with events on the stream.
fn h2d_step(dev: &CudaDevice) -> Result<f64, CudaError> {
    dev.stream()?
        .context()
        .bind_to_thread()
        .map_err(drv("cuCtxSetCurrent"))?;
    let host = Pinned::new(H2D_BYTES as usize)?;
    let arena = dev.alloc_arena("probe-h2d", H2D_BYTES)?;
    let copy = || -> Result<(), CudaError> {
        // SAFETY: the arena holds H2D_BYTES bytes, the pinned buffer as many; both outlive
        // the copies because the caller synchronizes on the end event before dropping them.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                arena.all().ptr(),
                host.as_slice(),
                dev.stream()?.cu_stream(),
            )
        }
        .map_err(drv("cuMemcpyHtoDAsync"))
    };
    copy()?;
    dev.synchronize()?;
    let start = dev.record_event()?;
    for _ in 0..H2D_REPEATS {
        copy()?;
    }
    let end = dev.record_event()?;
    end.synchronize()?;
    let ms = start.elapsed_ms(&end)? as f64;
    gbps(H2D_BYTES * H2D_REPEATS as u64, ms)
}

/// Times `D2D_REPEATS` copies between two `D2D_BYTES` arenas; counts read plus write bytes.
fn d2d_step(dev: &CudaDevice) -> Result<f64, CudaError> {
    let src = dev.alloc_arena("probe-d2d-src", D2D_BYTES)?;
    let dst = dev.alloc_arena("probe-d2d-dst", D2D_BYTES)?;
    dev.memset(src.all(), 1)?;
    let copy = || -> Result<(), CudaError> {
        // SAFETY: two distinct live arenas of D2D_BYTES each; both outlive the copies
        // because the end event is synchronized before they drop.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.all().ptr(),
                src.all().ptr(),
                D2D_BYTES as usize,
                dev.stream()?.cu_stream(),
            )
        }
        .map_err(drv("cuMemcpyDtoDAsync"))
    };
    copy()?;
    dev.synchronize()?;
    let start = dev.record_event()?;
    for _ in 0..D2D_REPEATS {
        copy()?;
    }
    let end = dev.record_event()?;
    end.synchronize()?;
    let ms = start.elapsed_ms(&end)? as f64;
    gbps(2 * D2D_BYTES * D2D_REPEATS as u64, ms)
}

fn gbps(bytes: u64, ms: f64) -> Result<f64, CudaError> {
    if !(ms.is_finite() && ms > 0.0) {
        return Err(CudaError::Shape {
            op: "timing",
            detail: format!("events measured {ms} ms for {bytes} bytes"),
        });
    }
    Ok(bytes as f64 / (ms * 1e-3) / 1e9)
}

pub use crate::backend::pcie::gen_of_speed as pcie_gen_of_speed;

/// Reads `current_link_speed`/`current_link_width` (and the `max_` pair where present) of
/// `bus_id` under `root` (normally `/sys/bus/pci/devices`). None when the current pair is
/// missing or unreadable (a width of 0 counts as missing).
pub fn read_pcie_link(root: &Path, bus_id: &str) -> Option<PcieLink> {
    crate::backend::pcie::read_link(&root.join(bus_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_speeds_map_to_generations() {
        assert_eq!(pcie_gen_of_speed("2.5 GT/s PCIe\n"), Some(1));
        assert_eq!(pcie_gen_of_speed("8.0 GT/s PCIe"), Some(3));
        assert_eq!(pcie_gen_of_speed("16.0 GT/s PCIe"), Some(4));
        assert_eq!(pcie_gen_of_speed("32.0 GT/s PCIe"), Some(5));
        assert_eq!(pcie_gen_of_speed("Unknown"), None);
        assert_eq!(pcie_gen_of_speed("3.0 GT/s"), None);
    }

    #[test]
    fn link_files_are_read_from_sysfs_layout() {
        let root = tempfile::tempdir().unwrap();
        let dev = root.path().join("0000:18:00.0");
        std::fs::create_dir(&dev).unwrap();
        std::fs::write(dev.join("current_link_speed"), "16.0 GT/s PCIe\n").unwrap();
        std::fs::write(dev.join("current_link_width"), "8\n").unwrap();
        std::fs::write(dev.join("max_link_speed"), "32.0 GT/s PCIe\n").unwrap();
        std::fs::write(dev.join("max_link_width"), "16\n").unwrap();
        let l = read_pcie_link(root.path(), "0000:18:00.0").unwrap();
        assert_eq!(
            l,
            PcieLink {
                gen: 4,
                width: 8,
                max_gen: Some(5),
                max_width: Some(16)
            }
        );
        assert_eq!(read_pcie_link(root.path(), "0000:19:00.0"), None);
        std::fs::write(dev.join("current_link_width"), "0\n").unwrap();
        assert_eq!(read_pcie_link(root.path(), "0000:18:00.0"), None);
    }
}
