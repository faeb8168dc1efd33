//! Kernel launchers: exactly one Rust function per kernel of `kernels/cuda`, used by the CUDA
//! backend's ops and by the GPU tests alike. Each takes bounds-checked views of the memory the
//! kernel touches, checks them (bytes and alignment) and the scalar arguments against the
//! kernel's limits, then queues the launch on the device's stream — with programmatic
//! dependent launch when the [`Launcher`] asks for it and the kernel is PDL-aware (CUDA
//! only), and timed when profiling. One `launch!` path for both vendors: the arguments go as
//! a `void**` array to `cuLaunchKernel` or `hipModuleLaunchKernel` (`CudaDevice::launch_raw`).
//! Invariant: nothing is launched with a view smaller than the kernel will touch, and no
//! launcher reads anything back from the device, so every launch can be captured in a graph.

pub mod attention;
pub mod decode;
pub mod dp4a;
pub mod linear;
pub mod pick;

use super::{CudaDevice, CudaError, DeviceView, GpuEvent};
use cudarc::driver::LaunchConfig;
use strata_schemas::ggml::GgmlType;

use strata_kernels::consts as kc;
pub use strata_kernels::consts::{
    ATT_MAX_D, DA_MAXG as ATT_MAX_GROUP, DA_MAX_SPLIT as ATT_MAX_SPLIT, DQ_DOWN_MAXK, DQ_MAX_TOK,
    DQ_WARPS, SP_MAX_VOCAB as SAMPLE_MAX_VOCAB,
};

/// The widest rows of the register path of the one-token products (`DQ_XR_PIECES` 16-column
/// pieces per lane of a 32-wide warp).
pub const DQ_XR_COLS: usize = kc::DQ_XR_PIECES * 32 * 16;

/// Blocks per SM of the register path of the one-token products (about 100 registers a
/// thread allow 4 blocks of 128 threads an SM).
const XR_BLOCKS_PER_SM: u32 = 4;
/// Rows per warp below which a one-token product keeps a warp per row (the register path's
/// capped grid measured slower for Q/K/V and the experts, 1-3 rows a warp, on the H200).
const XR_MIN_ROWS: u32 = 8;

/// Kernel type numbers (`consts::ST_TY_*`): the five types with dedicated paths, and every
/// other type the CPU reference decodes as `ST_TY_GGML + its GGUF id` (quants.cuh has a
/// decoder for each of them; the any-type path in products.cuh reads it). KV caches use only
/// the first five.
pub fn kty(ty: GgmlType) -> Option<i32> {
    Some(match ty {
        GgmlType::F32 => kc::ST_TY_F32,
        GgmlType::F16 => kc::ST_TY_F16,
        GgmlType::BF16 => kc::ST_TY_BF16,
        GgmlType::Q8_0 => kc::ST_TY_Q8_0,
        GgmlType::Q4K => kc::ST_TY_Q4_K,
        t if crate::quant::is_supported(t) => kc::ST_TY_GGML + t.id() as i32,
        _ => return None,
    })
}

/// Whether the kernels read `ty` through the any-type decoders (rows of a multiple of 32).
pub fn any_type(ty: GgmlType) -> bool {
    kty(ty).is_some_and(|c| c >= kc::ST_TY_GGML)
}

/// Whether `ty` is one of the types the `*_kq` kernels read (products.cuh's
/// `dq_kq_row_dot`: the K-quants Q4_K, Q5_K, Q6_K, and IQ3_S, whose 256-value blocks split
/// over a warp's lanes the same way: 8 values a lane).
pub fn kq_type(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::Iq3S
    )
}

/// `v` as a kernel's 32-bit index, or a shape error naming `what`.
pub(crate) fn int(op: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        detail: format!("{what} = {v} exceeds the kernel's 32-bit index"),
    })
}

/// A shape error of `op`.
pub(crate) fn bad(op: &'static str, detail: String) -> CudaError {
    CudaError::Shape { op, detail }
}

/// Bytes of `n` f32 values.
pub(crate) fn f32s(n: usize) -> u64 {
    4 * n as u64
}

/// A weight matrix on the device: `rows x cols` of `ty` (Q8_0 in the split layout of
/// `layout`, every other type in the GGUF layout), each matrix its own type.
#[derive(Debug, Clone, Copy)]
pub struct Mat<'a> {
    pub w: DeviceView<'a>,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
}

impl Mat<'_> {
    /// Checks the view holds the matrix and the kernels read its type; returns the type code.
    fn check(&self, op: &'static str) -> Result<i32, CudaError> {
        let code = kty(self.ty).ok_or_else(|| {
            bad(
                op,
                format!(
                    "{} weights: the CUDA kernels read only the types the CPU reference decodes; requantize with `strata-gguf quantize IN OUT --type Q8_0`",
                    self.ty
                ),
            )
        })?;
        if any_type(self.ty) && self.cols % 32 != 0 {
            return Err(bad(
                op,
                format!(
                    "{} rows of {} columns: the any-type kernels read rows of a multiple of 32",
                    self.ty, self.cols
                ),
            ));
        }
        let rb = crate::quant::row_bytes(self.ty, self.cols)
            .map_err(|e| bad(op, format!("rows of {} {}: {e}", self.cols, self.ty)))?;
        self.w
            .expect(op, "weights", rb as u64 * self.rows as u64, 16)?;
        int(op, "rows", self.rows)?;
        int(op, "cols", self.cols)?;
        Ok(code)
    }
}

/// Launch count and milliseconds per (decode?, kernel label), for `--profile`.
pub type ProfTotals = std::collections::BTreeMap<(bool, &'static str), (u64, f64)>;

/// Events recorded around each launch of a profiled pass.
pub type Prof = std::cell::RefCell<Vec<(&'static str, GpuEvent, GpuEvent)>>;

/// How launches are queued on one device.
#[derive(Clone, Copy)]
pub struct Launcher<'a> {
    pub dev: &'a CudaDevice,
    /// Launch the PDL-aware kernels with programmatic dependent launch.
    pub pdl: bool,
    /// When profiling: every launch's label with events recorded around it.
    pub prof: Option<&'a Prof>,
    /// One-token Q4_K products on the `_kq` kernels ([`KernelOptions::q4k_lanes`](super::options::KernelOptions));
    /// `Launcher::new` (tests, probes) keeps Q4_K's own kernels.
    pub q4k_lanes: bool,
}

impl<'a> Launcher<'a> {
    /// Plain launches in stream order (tests, and passes that gain nothing from PDL).
    pub fn new(dev: &'a CudaDevice) -> Self {
        Self {
            dev,
            pdl: false,
            prof: None,
            q4k_lanes: false,
        }
    }

    /// When profiling: a 40 us spin kernel, then the start event. The spin keeps the GPU busy
    /// while the host queues the kernel and its end event, so the pair times the kernel alone
    /// and not the host's launch latency (which CUDA graphs hide in real decode steps).
    fn prof_start(&self) -> Result<Option<GpuEvent>, CudaError> {
        if self.prof.is_none() {
            return Ok(None);
        }
        decode::spin(self, 40_000)?;
        Ok(Some(self.dev.record_event()?))
    }

    fn prof_end(&self, label: &'static str, e0: Option<GpuEvent>) -> Result<(), CudaError> {
        if let (Some(p), Some(e0)) = (self.prof, e0) {
            let e1 = self.dev.record_event()?;
            p.borrow_mut().push((label, e0, e1));
        }
        Ok(())
    }

    /// Run `f` (which queues work on the stream) between two recorded events when profiling.
    pub fn timed<T>(
        &self,
        label: &'static str,
        f: impl FnOnce() -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        let e0 = self.prof_start()?;
        let r = f()?;
        self.prof_end(label, e0)?;
        Ok(r)
    }

    /// The device's number of multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.dev.sm_count()
    }
}

/// A launch configuration of `grid` blocks of `block` threads and `smem` bytes of dynamic
/// shared memory.
pub fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// The scalar types kernels take, passed by address in a launch's `void**` array (a
/// `DeviceView` or any other struct is refused at compile time: pass `view.ptr()`).
pub trait KernelArg: Copy {}
impl KernelArg for i32 {}
impl KernelArg for u32 {}
impl KernelArg for i64 {}
impl KernelArg for u64 {}
impl KernelArg for f32 {}

/// The address of one kernel argument, for a launch's parameter array.
#[doc(hidden)]
pub fn arg_ptr<T: KernelArg>(v: &T) -> *mut std::ffi::c_void {
    v as *const T as *mut std::ffi::c_void
}

/// Launch kernel `$name` through launcher `$l` with `$cfg` and the argument references in
/// order (profiled under `$label`, default the kernel's name). The parameter array is built
/// inside the launch call's own expression, so every argument (temporaries included) lives
/// until the driver has read it.
macro_rules! launch {
    ($l:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {
        launch!($l, $name => $name, $cfg; $($arg),*)
    };
    ($l:expr, $name:expr => $label:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        use $crate::backend::cuda::launch::arg_ptr;
        let l: &$crate::backend::cuda::launch::Launcher<'_> = $l;
        let e0 = l.timed_start()?;
        if l.pdl && strata_kernels::pdl_aware($name) {
            let f = l.dev.function($name)?;
            // SAFETY: each entry points at a live argument value of the kernel's parameter
            // type (the launcher checked every buffer against what the kernel touches); the
            // kernel is PDL-aware (`strata_kernels::pdl_aware`), so it touches nothing but
            // weights before waiting for the kernel ahead.
            unsafe {
                $crate::backend::cuda::launch::launch_pdl(l.dev, f, $cfg, &mut [$(arg_ptr($arg)),*])
            }
            .map_err($crate::backend::cuda::drv(format!("cuLaunchKernelEx {}", $name)))?;
        } else {
            // SAFETY: each entry points at a live argument value of the kernel's parameter
            // type, in order; every pointer argument addresses a view the launcher checked
            // against the bytes the kernel reads or writes for these shapes.
            unsafe { l.dev.launch_raw($name, $cfg, &mut [$(arg_ptr($arg)),*]) }?;
        }
        l.timed_end($label, e0)?;
        Ok::<(), $crate::backend::cuda::CudaError>(())
    }};
}
pub(crate) use launch;

impl Launcher<'_> {
    /// The start event of a profiled launch (see [`Launcher::timed`]).
    #[doc(hidden)]
    pub fn timed_start(&self) -> Result<Option<GpuEvent>, CudaError> {
        self.prof_start()
    }

    /// The end event of a profiled launch.
    #[doc(hidden)]
    pub fn timed_end(&self, label: &'static str, e0: Option<GpuEvent>) -> Result<(), CudaError> {
        self.prof_end(label, e0)
    }
}

/// Launch `f` on `dev`'s stream with programmatic stream serialisation allowed: the driver
/// may start it while the kernel ahead is finishing (Hopper's programmatic dependent launch;
/// inside a graph capture this becomes a programmatic edge).
///
/// # Safety
/// `params` must hold one pointer per kernel parameter, each to a live value of that
/// parameter's type, and the kernel must be PDL-aware (`strata_kernels::pdl_aware`).
pub unsafe fn launch_pdl(
    dev: &CudaDevice,
    f: &cudarc::driver::CudaFunction,
    c: LaunchConfig,
    params: &mut [*mut std::ffi::c_void],
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    let Ok(stream) = dev.stream() else {
        return Err(cudarc::driver::DriverError(
            sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
        ));
    };
    stream.context().bind_to_thread()?;
    // SAFETY: an all-zero launch attribute is a valid value of this plain C union.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let lc = sys::CUlaunchConfig {
        gridDimX: c.grid_dim.0,
        gridDimY: c.grid_dim.1,
        gridDimZ: c.grid_dim.2,
        blockDimX: c.block_dim.0,
        blockDimY: c.block_dim.1,
        blockDimZ: c.block_dim.2,
        sharedMemBytes: c.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the config lives across the call; `params` as the caller guarantees.
    unsafe {
        sys::cuLaunchKernelEx(
            &lc,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// Blocks of a one-token product (`dq_mv1`) over `rows` rows: decode.cu's register path
/// (Q8_0 rows of at most DQ_XR_COLS columns) lets each warp walk several rows, reading
/// the input once, so where that gives every warp at least XR_MIN_ROWS rows (the LM head)
/// the grid stops at XR_BLOCKS_PER_SM blocks per SM; otherwise a warp per row.
pub(crate) fn mv1_blocks(l: &Launcher<'_>, rows: usize, cols: usize, q8_0: bool) -> u32 {
    if q8_0 && cols <= DQ_XR_COLS {
        walk_blocks(l, rows)
    } else {
        (rows as u32).div_ceil(DQ_WARPS)
    }
}

/// Blocks of a product whose warps walk rows (the register path above, the `*_kq`
/// matrix-vector kernels): capped at XR_BLOCKS_PER_SM blocks per SM where that still gives
/// every warp at least XR_MIN_ROWS rows, else a warp per row.
pub(crate) fn walk_blocks(l: &Launcher<'_>, rows: usize) -> u32 {
    let full = (rows as u32).div_ceil(DQ_WARPS);
    let cap = l.sm_count() as u32 * XR_BLOCKS_PER_SM;
    if full >= cap * XR_MIN_ROWS {
        cap
    } else {
        full
    }
}

/// Dynamic shared memory for a one-token product over Q8_0 rows of `cols` columns that
/// stages its input (decode.cu's dq_xs_fill): `cols` f32 (at most 48 KiB, the limit without
/// opting in), else none.
pub(crate) fn xs_bytes(stage: bool, n: usize, ty: GgmlType, cols: usize) -> u32 {
    if stage && n == 1 && ty == GgmlType::Q8_0 && cols % 4 == 0 && cols * 4 <= 48 << 10 {
        (cols * 4) as u32
    } else {
        0
    }
}
