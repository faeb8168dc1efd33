//! Prefill matrix-matrix launchers of the CUDA backend (kernels in `kernels/cuda/gemm.cu`):
//! the dense tensor-core GEMM `y[t][r] = W_r · x[t]` for Q8_0 (split device layout, see
//! `layout`), Q4_K (GGUF layout, columns a multiple of 256), BF16 weights and every other type
//! the CPU reference decodes except F32/F16 (`gemm_any_*`, GGUF layout), and the grouped
//! MoE form: `moe_sort` (router choices to per-expert tiles, on the device) then `moe_gemm`
//! over those tiles. Activations are f32 in and out; each product first rounds `x` into a
//! caller-provided 16-bit scratch (f16 for Q8_0 and Q4_K weights, bf16 for BF16 weights).
//! Each product picks its kernel by its own weight type, so types may be mixed per tensor.
//! IQ3_S, Q6_K, Q5_K and IQ4_XS weights may take the pipelined any-type loader
//! ([`AnyLoad::Pipelined`], `--kernel-options any-pipelined`: raw bytes fetched into registers
//! a stage ahead, decoded after the stage's mmas, the type fixed at compile time), in the
//! tiles the engine uses for them (dense M64 and M128, grouped M128W, fused gate + up M64);
//! the default and the other tiles keep the synchronous loader. Both give the same f16
//! weights bit for bit. The pipelined loader has not run on a GPU yet (written 2026-12-05
//! without one), so it is opt-in until a GPU run of tests/cuda_gemm (which holds it to the
//! CPU reference and to the synchronous loader) and its A/B make it the default.
//! Invariant: every launch's views are checked (bytes and alignment) against what the kernels
//! touch before it is queued, and no launcher reads anything back from the device, so the
//! whole MoE sequence (sort, convert, products) can be captured in a CUDA graph: its grids
//! depend only on `n_tok`, `k`, `n_expert` and the shapes.

use super::launch::{any_type, bad, int};
use super::{drv, CudaDevice, CudaError, DeviceView};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use strata_schemas::ggml::GgmlType;

/// Tokens (or expert assignments) per CTA tile, and so per MoE tile (the planner sizes the
/// MoE tile list with it: the two definitions must agree).
pub const GEMM_BN: usize = strata_kernels::consts::GM_BN;
const _: () = assert!(GEMM_BN == strata_schemas::workset::MOE_TILE_TOKENS);
/// Columns per pipeline stage.
pub const GEMM_BK: usize = strata_kernels::consts::GM_BK;
/// Pipeline depth.
pub const GEMM_STAGES: usize = strata_kernels::consts::GM_STAGES;
/// Most experts `moe_sort` handles (its shared memory holds three ints per expert).
pub const MOE_MAX_EXPERT: usize = 4096;
const SORT_THREADS: u32 = 1024;
/// The tile `moe_gemm` uses (fastest at Qwen3-30B-A3B's Q8_0 expert shapes on an H200).
/// Q4_K experts use it too.
pub const MOE_DEFAULT_TILE: GemmTile = GemmTile::M128W;

/// CTA tile over the weight rows (always `GEMM_BN` tokens): `M64` 64 rows by 4 warps of
/// 32 x 32, `M128` 128 rows by 8 such warps, `M128W` 128 rows by 4 warps of 32 rows x 64
/// tokens (fewer instructions per mma, more registers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmTile {
    M64,
    M128,
    M128W,
}

impl GemmTile {
    /// Weight rows per tile.
    pub fn rows(self) -> usize {
        match self {
            GemmTile::M64 => 64,
            GemmTile::M128 | GemmTile::M128W => 128,
        }
    }

    /// Threads per CTA.
    pub fn threads(self) -> u32 {
        match self {
            GemmTile::M64 | GemmTile::M128W => 128,
            GemmTile::M128 => 256,
        }
    }
}

/// How the any-type kernels (every weight type but Q8_0, Q4_K and BF16) load their weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AnyLoad {
    /// IQ3_S, Q6_K, Q5_K and IQ4_XS through the pipelined loader where the tile has it
    /// ([`any_load_pipelined`]; `--kernel-options any-pipelined`); every other type and tile
    /// as `Sync`. Not yet run on a GPU.
    Pipelined,
    /// Each stage's weights decoded synchronously from global memory as the stage is loaded:
    /// the default, until a GPU has measured and checked the pipelined loader.
    #[default]
    Sync,
}

/// Whether products over `ty` weights in `tile` (`moe`: grouped; `glu`: the fused gate + up,
/// always M64) take the pipelined any-type loader under `load`.
pub fn any_load_pipelined(
    load: AnyLoad,
    ty: GgmlType,
    moe: bool,
    glu: bool,
    tile: GemmTile,
) -> bool {
    load == AnyLoad::Pipelined
        && pipe_kernels(ty).is_some()
        && match (moe, glu) {
            (true, true) => true,
            (true, false) => tile == GemmTile::M128W,
            (false, _) => tile != GemmTile::M128W,
        }
}

/// The pipelined kernels of the types the pipelined loader covers: dense M64, dense M128,
/// grouped M128W, fused gate + up M64.
fn pipe_kernels(ty: GgmlType) -> Option<[&'static str; 4]> {
    Some(match ty {
        GgmlType::Iq3S => [
            "gemm_iq3_s_p_m64",
            "gemm_iq3_s_p_m128",
            "moe_gemm_iq3_s_p_m128w",
            "moe_gemm_glu_iq3_s_p_m64",
        ],
        GgmlType::Q6K => [
            "gemm_q6_k_p_m64",
            "gemm_q6_k_p_m128",
            "moe_gemm_q6_k_p_m128w",
            "moe_gemm_glu_q6_k_p_m64",
        ],
        GgmlType::Q5K => [
            "gemm_q5_k_p_m64",
            "gemm_q5_k_p_m128",
            "moe_gemm_q5_k_p_m128w",
            "moe_gemm_glu_q5_k_p_m64",
        ],
        GgmlType::Iq4Xs => [
            "gemm_iq4_xs_p_m64",
            "gemm_iq4_xs_p_m128",
            "moe_gemm_iq4_xs_p_m128w",
            "moe_gemm_glu_iq4_xs_p_m64",
        ],
        _ => return None,
    })
}

/// Where a grouped expert product reads expert e's matrices.
#[derive(Debug, Clone, Copy)]
pub enum ExpertSource<'a> {
    /// At byte `e * stride` of `w` (and of `wu`, the fused up product's); stride 0 = the
    /// matrix's bytes.
    Strided {
        w: DeviceView<'a>,
        wu: Option<DeviceView<'a>>,
        stride: u64,
    },
    /// At the pointer in column `col` (0 gate, 1 up, 2 down) of row e of an expert table of
    /// `n_expert x 3` u64 device addresses (the expert cache's); `fused_up`: gate (col 0) and
    /// up (col 1) in one fused product. Every pointer must address a whole matrix of the
    /// product's type and shape.
    Table {
        table: DeviceView<'a>,
        col: usize,
        fused_up: bool,
    },
}

/// Where a MoE product's input row for assignment `a = t * k + j` comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeInput {
    /// `x[a / k]`: x has one row per token (gate and up projections).
    Gather,
    /// `x[a]`: x has one row per assignment (the down projection).
    Direct,
}

/// Bytes of the 16-bit copy of `x_rows` rows of `cols` that a product needs as scratch.
pub fn gemm_scratch_bytes(x_rows: usize, cols: usize) -> u64 {
    2 * x_rows as u64 * cols as u64
}

/// Where `moe_sort` puts its outputs inside one scratch view (the layout is the planner's
/// too, so it lives with the engine's working set in `strata_schemas::workset`).
pub use strata_schemas::workset::MoeScratch;

/// Bytes of the scratch `moe_sort` writes and `moe_gemm` reads.
pub fn moe_scratch_bytes(n_tok: usize, k: usize, n_expert: usize) -> u64 {
    MoeScratch::new(n_tok, k, n_expert).bytes
}

/// Bytes of one `rows × cols` weight matrix of `ty` on the device, with the column rule the
/// kernels need.
fn matrix_bytes(
    op: &'static str,
    ty: GgmlType,
    rows: usize,
    cols: usize,
) -> Result<u64, CudaError> {
    let (r, c) = (rows as u64, cols as u64);
    let m = gemm_col_multiple(ty);
    match ty {
        GgmlType::Q8_0 if cols % 32 == 0 && cols > 0 => Ok(r * c / 32 * 34),
        GgmlType::Q4K if cols % 256 == 0 && cols > 0 => Ok(r * c / 256 * 144),
        GgmlType::BF16 if cols % 8 == 0 && cols > 0 => Ok(r * c * 2),
        _ if m != 0 && cols % m == 0 && cols > 0 => crate::quant::row_bytes(ty, cols)
            .map(|rb| rb as u64 * r)
            .map_err(|e| bad(op, e.to_string())),
        _ if m != 0 => Err(bad(
            op,
            format!("{ty} weights of {rows} x {cols}: the columns must be a positive multiple of {m} for {ty} (Q8_0 32, Q4_K 256, BF16 8, other types their block, at least 32); use the matvec kernels for this matrix"),
        )),
        other => Err(bad(
            op,
            format!("no tensor-core kernel for {other} weights (every type the CPU reference decodes has one); use matvec"),
        )),
    }
}

/// The column multiple the tensor-core kernels need for weights of `ty` (0: no kernel):
/// Q8_0 32, Q4_K 256, BF16 8, and every other type the any-type decoders read its block
/// width, at least 32 (`gemm_any_*`: 32 columns decoded at a time).
pub fn gemm_col_multiple(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 => 32,
        GgmlType::Q4K => 256,
        GgmlType::BF16 => 8,
        t if any_type(t) => (t.block_elems() as usize).max(32),
        _ => 0,
    }
}

/// Whether the tensor-core products take weights of `ty` (with the column rule of
/// [`gemm_col_multiple`]).
pub fn gemm_supports(ty: GgmlType) -> bool {
    gemm_col_multiple(ty) != 0
}

/// Dynamic shared memory of a product (`pipelined`: the pipelined any-type loader's layout,
/// GEMM_STAGES X slots and two W buffers).
fn smem_bytes(ty: GgmlType, tile: GemmTile, n_weights: usize, pipelined: bool) -> usize {
    let bm = tile.rows();
    if pipelined {
        return GEMM_STAGES * GEMM_BN * 160 + 2 * n_weights * bm * 160;
    }
    let w = match ty {
        // GM_Q8_WSTRIDE bytes of quants and two f16 scales per row.
        GgmlType::Q8_0 => bm * 80 + bm * 4,
        // GM_Q4_WSTRIDE: the block header and 32 bytes of nibbles per row.
        GgmlType::Q4K => bm * 48,
        _ => bm * 160,
    };
    GEMM_STAGES * (n_weights * w + GEMM_BN * 160)
}

/// The kernel of a product (`glu`: the fused gate + up form, 64-row tile only), and whether
/// it is a pipelined any-type kernel.
fn kernel(
    moe: bool,
    glu: bool,
    ty: GgmlType,
    tile: GemmTile,
    load: AnyLoad,
) -> (&'static str, bool) {
    match pipe_kernels(ty) {
        Some([m64, m128, moe_m128w, glu_m64]) if any_load_pipelined(load, ty, moe, glu, tile) => {
            let name = match (moe, glu, tile) {
                (true, true, _) => glu_m64,
                (true, false, _) => moe_m128w,
                (false, _, GemmTile::M64) => m64,
                (false, _, _) => m128,
            };
            (name, true)
        }
        _ => (kernel_name(moe, glu, ty, tile), false),
    }
}

/// The synchronous-loader kernel of a product.
fn kernel_name(moe: bool, glu: bool, ty: GgmlType, tile: GemmTile) -> &'static str {
    use GemmTile::*;
    use GgmlType::{Q4K, Q8_0};
    if any_type(ty) {
        return match (moe, glu, tile) {
            (true, true, _) => "moe_gemm_glu_any_m64",
            (false, _, M64) => "gemm_any_m64",
            (false, _, M128) => "gemm_any_m128",
            (false, _, M128W) => "gemm_any_m128w",
            (true, false, M64) => "moe_gemm_any_m64",
            (true, false, M128) => "moe_gemm_any_m128",
            (true, false, M128W) => "moe_gemm_any_m128w",
        };
    }
    match (moe, glu, ty, tile) {
        (true, true, Q8_0, _) => "moe_gemm_glu_q8_0_m64",
        (true, true, Q4K, _) => "moe_gemm_glu_q4_k_m64",
        (true, true, _, _) => "moe_gemm_glu_bf16_m64",
        (false, _, Q8_0, M64) => "gemm_q8_0_m64",
        (false, _, Q8_0, M128) => "gemm_q8_0_m128",
        (false, _, Q8_0, M128W) => "gemm_q8_0_m128w",
        (false, _, Q4K, M64) => "gemm_q4_k_m64",
        (false, _, Q4K, M128) => "gemm_q4_k_m128",
        (false, _, Q4K, M128W) => "gemm_q4_k_m128w",
        (false, _, _, M64) => "gemm_bf16_m64",
        (false, _, _, M128) => "gemm_bf16_m128",
        (false, _, _, M128W) => "gemm_bf16_m128w",
        (true, false, Q8_0, M64) => "moe_gemm_q8_0_m64",
        (true, false, Q8_0, M128) => "moe_gemm_q8_0_m128",
        (true, false, Q8_0, M128W) => "moe_gemm_q8_0_m128w",
        (true, false, Q4K, M64) => "moe_gemm_q4_k_m64",
        (true, false, Q4K, M128) => "moe_gemm_q4_k_m128",
        (true, false, Q4K, M128W) => "moe_gemm_q4_k_m128w",
        (true, false, _, M64) => "moe_gemm_bf16_m64",
        (true, false, _, M128) => "moe_gemm_bf16_m128",
        (true, false, _, M128W) => "moe_gemm_bf16_m128w",
    }
}

impl CudaDevice {
    /// The tile the dense product uses by default for `ty`: when 128-row tiles still give
    /// at least half a CTA per multiprocessor, `M128W` for Q8_0 and Q4_K and `M128` for BF16, else
    /// `M64` (the fastest of each on an H200 at pp512).
    pub fn gemm_default_tile(&self, ty: GgmlType, rows: usize, n_tok: usize) -> GemmTile {
        if 2 * rows.div_ceil(128) * n_tok.div_ceil(GEMM_BN) < self.sm_count() {
            GemmTile::M64
        } else if matches!(ty, GgmlType::Q8_0 | GgmlType::Q4K) {
            GemmTile::M128W
        } else {
            GemmTile::M128
        }
    }

    /// Rounds `x` (`x_rows × cols` f32, 16-byte aligned) into `xh` (`x_rows × cols` 16-bit:
    /// f16 when `ty` is Q8_0 or Q4_K, bf16 when BF16), the input form of the tensor-core
    /// products.
    pub fn gemm_convert_x(
        &self,
        x: DeviceView<'_>,
        x_rows: usize,
        cols: usize,
        ty: GgmlType,
        xh: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "gemm_convert_x";
        if cols % 8 != 0 {
            return Err(bad(OP, format!("cols {cols} must be a multiple of 8")));
        }
        let n = x_rows as u64 * cols as u64;
        x.expect(OP, "x", 4 * n, 16)?;
        xh.expect(OP, "xh (scratch)", 2 * n, 16)?;
        if n == 0 {
            return Ok(());
        }
        let bf16 = match ty {
            GgmlType::BF16 => 1i32,
            t if gemm_supports(t) => 0,
            other => return Err(bad(OP, format!("no tensor-core kernel for {other}"))),
        };
        let f = self.function("gemm_cvt_x")?;
        let (xp, hp, nl) = (x.ptr(), xh.ptr(), n as i64);
        let blocks = (n / 4).div_ceil(256).min(16 * self.sm_count() as u64) as u32;
        let mut b = self.stream()?.launch_builder(f);
        b.arg(&xp).arg(&hp).arg(&nl).arg(&bf16);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x holds n f32 and xh n 16-bit values, both 16-byte aligned; n is a multiple
        // of 8, so the kernel's float4 / uint2 accesses stay inside.
        unsafe { b.launch(cfg) }.map_err(drv("launch gemm_cvt_x"))?;
        Ok(())
    }

    /// `y[t][r] = W_r · x[t]` for `n_tok` tokens: W `rows × cols` of `ty` (Q8_0 in the split
    /// device layout, Q4_K in the GGUF layout, or BF16 row-major) 16-byte aligned, x `n_tok × cols` f32 (16-byte
    /// aligned), y `n_tok × rows` f32; `scratch` holds `gemm_scratch_bytes(n_tok, cols)`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        w: DeviceView<'_>,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        x: DeviceView<'_>,
        n_tok: usize,
        y: DeviceView<'_>,
        scratch: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        matrix_bytes("gemm", ty, rows, cols)?;
        self.gemm_convert_x(x, n_tok, cols, ty, scratch)?;
        let tile = self.gemm_default_tile(ty, rows, n_tok);
        self.gemm_converted(
            tile,
            AnyLoad::default(),
            w,
            ty,
            rows,
            cols,
            scratch,
            n_tok,
            y,
            false,
        )
    }

    /// How many K parts the dense product splits into by default: 2 when the tiles fill less
    /// than three quarters of the multiprocessors and the columns give each part at least 8
    /// pipeline stages (measured: helps 768 x 2048 and 512 x 2048 at pp512, hurts 2048 x 768).
    pub fn gemm_default_kparts(
        &self,
        tile: GemmTile,
        rows: usize,
        cols: usize,
        n_tok: usize,
    ) -> usize {
        let ctas = rows.div_ceil(tile.rows()) * n_tok.div_ceil(GEMM_BN);
        if 4 * ctas < 3 * self.sm_count() && cols.div_ceil(GEMM_BK) >= 16 {
            2
        } else {
            1
        }
    }

    /// The product of [`CudaDevice::gemm`] on an input already converted by
    /// [`CudaDevice::gemm_convert_x`] (`xh`), with an explicit tile and any-type loader and
    /// the default K split; `acc`: add the product into `y` instead of overwriting it (one K
    /// part then, so each element has one writer and the sum is deterministic).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_converted(
        &self,
        tile: GemmTile,
        load: AnyLoad,
        w: DeviceView<'_>,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        xh: DeviceView<'_>,
        n_tok: usize,
        y: DeviceView<'_>,
        acc: bool,
    ) -> Result<(), CudaError> {
        let kparts = if acc {
            1
        } else {
            self.gemm_default_kparts(tile, rows, cols, n_tok)
        };
        self.gemm_converted_kparts(tile, load, kparts, w, ty, rows, cols, xh, n_tok, y, acc)
    }

    /// [`CudaDevice::gemm_converted`] with an explicit K split: `kparts` 1 (plain stores, or
    /// additions into `y` with `acc`) or 2 (y zeroed, then both halves of the columns added
    /// atomically; 0 + a + b is the same in either order, so the result stays deterministic;
    /// not with `acc`).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_converted_kparts(
        &self,
        tile: GemmTile,
        load: AnyLoad,
        kparts: usize,
        w: DeviceView<'_>,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        xh: DeviceView<'_>,
        n_tok: usize,
        y: DeviceView<'_>,
        acc: bool,
    ) -> Result<(), CudaError> {
        const OP: &str = "gemm";
        if kparts != 1 && (kparts != 2 || acc) {
            return Err(bad(
                OP,
                format!("kparts {kparts} must be 1 or 2, and 1 when adding into y"),
            ));
        }
        let wb = matrix_bytes(OP, ty, rows, cols)?;
        w.expect(OP, "w", wb, 16)?;
        xh.expect(OP, "xh", gemm_scratch_bytes(n_tok, cols), 16)?;
        y.expect(OP, "y", 4 * n_tok as u64 * rows as u64, 4)?;
        let (ri, ci, ni) = (
            int(OP, "rows", rows)?,
            int(OP, "cols", cols)?,
            int(OP, "n_tok", n_tok)?,
        );
        int(OP, "n_tok * cols", n_tok * cols)?;
        int(OP, "rows * cols", rows * cols)?;
        if rows == 0 || n_tok == 0 {
            return Ok(());
        }
        let gy = n_tok.div_ceil(GEMM_BN);
        if gy > 65535 {
            return Err(bad(
                OP,
                format!("n_tok {n_tok} needs more than 65535 token tiles"),
            ));
        }
        let (name, pipelined) = kernel(false, false, ty, tile, load);
        let f = self.function(name)?;
        let smem = smem_bytes(ty, tile, 1, pipelined);
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(drv(format!(
            "cuFuncSetAttribute({name}, {smem} bytes shared)"
        )))?;
        let (wp, xp, yp, acc) = (w.ptr(), xh.ptr(), y.ptr(), acc as i32);
        let mut b = self.stream()?.launch_builder(f);
        let gt = ty.id() as i32;
        b.arg(&wp)
            .arg(&xp)
            .arg(&yp)
            .arg(&ri)
            .arg(&ci)
            .arg(&ni)
            .arg(&acc);
        if any_type(ty) {
            // gemm_any_*: the weights' GGUF type id last.
            b.arg(&gt);
        }
        // (the K part is blockIdx.z; the grid below sets the count)
        if kparts > 1 {
            self.memset(y.sub(0, 4 * n_tok as u64 * rows as u64)?, 0)?;
        }
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(tile.rows()) as u32, gy as u32, kparts as u32),
            block_dim: (tile.threads(), 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: w holds one rows × cols matrix of ty, xh n_tok rows of cols 16-bit values,
        // y n_tok × rows f32, all checked above; the kernel guards rows, tokens and columns.
        unsafe { b.launch(cfg) }.map_err(drv(format!("launch {name}")))?;
        Ok(())
    }

    /// Groups the router's choices by expert: `ids` is `n_tok × k` i32 expert ids; writes the
    /// [`MoeScratch`] layout into `sorted` (at least `moe_scratch_bytes(n_tok, k, n_expert)`
    /// bytes, 16-byte aligned). One single-block launch, no host sync. Ids outside
    /// `[0, n_expert)` are left out (their output rows are not written).
    pub fn moe_sort(
        &self,
        ids: DeviceView<'_>,
        n_tok: usize,
        k: usize,
        n_expert: usize,
        sorted: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe_sort";
        if n_expert == 0 || n_expert > MOE_MAX_EXPERT || k == 0 {
            return Err(bad(
                OP,
                format!("n_expert {n_expert} must be 1..={MOE_MAX_EXPERT} and k {k} at least 1"),
            ));
        }
        let lay = MoeScratch::new(n_tok, k, n_expert);
        ids.expect(OP, "ids", 4 * lay.n_assign as u64, 4)?;
        sorted.expect(OP, "sorted (scratch)", lay.bytes, 16)?;
        let (na, ne, bn) = (
            int(OP, "n_tok * k", lay.n_assign)?,
            n_expert as i32,
            GEMM_BN as i32,
        );
        let f = self.function("moe_sort")?;
        let smem = 12 * n_expert as u32;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(drv(format!(
            "cuFuncSetAttribute(moe_sort, {smem} bytes shared)"
        )))?;
        let base = sorted.ptr();
        let (ip, op, pp, tp, cp) = (
            ids.ptr(),
            base + lay.offsets,
            base + lay.perm,
            base + lay.tiles,
            base + lay.n_tiles,
        );
        let mut b = self.stream()?.launch_builder(f);
        b.arg(&ip)
            .arg(&na)
            .arg(&ne)
            .arg(&bn)
            .arg(&op)
            .arg(&pp)
            .arg(&tp)
            .arg(&cp);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (SORT_THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: ids holds n_assign i32; sorted holds the whole MoeScratch layout (offsets
        // n_expert + 1, perm n_assign, tiles max_tiles pairs — the kernel writes at most
        // sum ceil(count_e / bn) <= max_tiles — and n_tiles); shared memory 3 * n_expert ints
        // (<= 48 KiB as n_expert <= 4096).
        unsafe { b.launch(cfg) }.map_err(drv("launch moe_sort"))?;
        Ok(())
    }

    /// Grouped product over experts: for every assignment `a = t * k + j` (expert `ids[a]`,
    /// as sorted into `sorted` by [`CudaDevice::moe_sort`] with the same `n_tok, k,
    /// n_expert`), `y[a][r] = W_e,r · xrow(a)`, xrow(a) = `x[a / k]` (Gather: x is `n_tok ×
    /// cols`) or `x[a]` (Direct: x is `n_tok·k × cols`). W is the 3-D expert tensor,
    /// `n_expert` matrices of `rows × cols` (Q8_0 split layout per matrix, Q4_K, or BF16), matrix e
    /// at byte `e · matrix bytes` (which must be a multiple of 16); y is `n_tok·k × rows` f32;
    /// `scratch` holds `gemm_scratch_bytes(x rows, cols)`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemm(
        &self,
        w: DeviceView<'_>,
        ty: GgmlType,
        n_expert: usize,
        rows: usize,
        cols: usize,
        x: DeviceView<'_>,
        input: MoeInput,
        n_tok: usize,
        k: usize,
        sorted: DeviceView<'_>,
        y: DeviceView<'_>,
        scratch: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        let x_rows = match input {
            MoeInput::Gather => n_tok,
            MoeInput::Direct => n_tok * k,
        };
        matrix_bytes("moe_gemm", ty, rows, cols)?;
        self.gemm_convert_x(x, x_rows, cols, ty, scratch)?;
        self.moe_gemm_converted(
            MOE_DEFAULT_TILE,
            AnyLoad::default(),
            w,
            None,
            ty,
            n_expert,
            rows,
            cols,
            scratch,
            input,
            n_tok,
            k,
            sorted,
            y,
        )
    }

    /// Fused SwiGLU expert product: `y[a][r] = silu(Wg_e,r · xrow(a)) * (Wu_e,r · xrow(a))`,
    /// `wg` and `wu` two expert tensors as in [`CudaDevice::moe_gemm`] (same type and shape);
    /// saves the separate up product, its output and the SwiGLU pass.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemm_glu(
        &self,
        wg: DeviceView<'_>,
        wu: DeviceView<'_>,
        ty: GgmlType,
        n_expert: usize,
        rows: usize,
        cols: usize,
        x: DeviceView<'_>,
        input: MoeInput,
        n_tok: usize,
        k: usize,
        sorted: DeviceView<'_>,
        y: DeviceView<'_>,
        scratch: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        let x_rows = match input {
            MoeInput::Gather => n_tok,
            MoeInput::Direct => n_tok * k,
        };
        matrix_bytes("moe_gemm_glu", ty, rows, cols)?;
        self.gemm_convert_x(x, x_rows, cols, ty, scratch)?;
        self.moe_gemm_converted(
            GemmTile::M64,
            AnyLoad::default(),
            wg,
            Some(wu),
            ty,
            n_expert,
            rows,
            cols,
            scratch,
            input,
            n_tok,
            k,
            sorted,
            y,
        )
    }

    /// The product of [`CudaDevice::moe_gemm`] (`wu` None) or [`CudaDevice::moe_gemm_glu`]
    /// (`w` the gate and `wu` the up tensor; always the 64-row tile) on an input already
    /// converted by [`CudaDevice::gemm_convert_x`] (`xh`), with an explicit tile and
    /// any-type loader.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemm_converted(
        &self,
        tile: GemmTile,
        load: AnyLoad,
        w: DeviceView<'_>,
        wu: Option<DeviceView<'_>>,
        ty: GgmlType,
        n_expert: usize,
        rows: usize,
        cols: usize,
        xh: DeviceView<'_>,
        input: MoeInput,
        n_tok: usize,
        k: usize,
        sorted: DeviceView<'_>,
        y: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        let src = ExpertSource::Strided { w, wu, stride: 0 };
        self.moe_gemm_from(
            tile, load, src, ty, n_expert, rows, cols, xh, input, n_tok, k, sorted, y,
        )
    }

    /// [`CudaDevice::moe_gemm_converted`] reading expert e's matrices where `src` says:
    /// strided stacks (experts held in cache slots of `stride` bytes each; `stride` 0 means
    /// the matrix size, else at least that and a multiple of 16), or an expert table (the
    /// expert cache's slots, in any order).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemm_from(
        &self,
        tile: GemmTile,
        load: AnyLoad,
        src: ExpertSource<'_>,
        ty: GgmlType,
        n_expert: usize,
        rows: usize,
        cols: usize,
        xh: DeviceView<'_>,
        input: MoeInput,
        n_tok: usize,
        k: usize,
        sorted: DeviceView<'_>,
        y: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe_gemm";
        if n_expert == 0 || n_expert > MOE_MAX_EXPERT || k == 0 {
            return Err(bad(
                OP,
                format!("n_expert {n_expert} must be 1..={MOE_MAX_EXPERT} and k {k} at least 1"),
            ));
        }
        let mb = matrix_bytes(OP, ty, rows, cols)?;
        if mb % 16 != 0 {
            return Err(bad(
                OP,
                format!("one {rows} x {cols} {ty} expert matrix is {mb} bytes, not a multiple of 16, so later experts would be misaligned for 16-byte loads"),
            ));
        }
        let lay = MoeScratch::new(n_tok, k, n_expert);
        let x_rows = match input {
            MoeInput::Gather => n_tok,
            MoeInput::Direct => lay.n_assign,
        };
        // (W, W_up, stride) for strided stacks; (table column, its up column) for a table.
        let (wp, up, mbl, tab, tab2, fused) = match src {
            ExpertSource::Strided { w, wu, stride } => {
                let stride = if stride == 0 { mb } else { stride };
                if stride < mb || stride % 16 != 0 {
                    return Err(bad(
                        OP,
                        format!("expert stride {stride} must be a multiple of 16 and at least the {mb}-byte matrix"),
                    ));
                }
                let span = stride * (n_expert as u64 - 1) + mb;
                w.expect(OP, "w", span, 16)?;
                if let Some(u) = wu {
                    u.expect(OP, "w_up", span, 16)?;
                }
                let up = wu.map_or(0, |v| v.ptr());
                (w.ptr(), up, stride as i64, 0u64, 0u64, wu.is_some())
            }
            ExpertSource::Table {
                table,
                col,
                fused_up,
            } => {
                if col > 2 || (fused_up && col != 0) {
                    return Err(bad(
                        OP,
                        format!("expert table column {col} (fused up: {fused_up}): gate 0 (with its up), up 1 or down 2"),
                    ));
                }
                table.expect(OP, "expert table", 24 * n_expert as u64, 8)?;
                let t = table.ptr() + 8 * col as u64;
                let t2 = if fused_up { t + 8 } else { t };
                // The kernel reads every matrix through the table; W and the stride are unused.
                (table.ptr(), 0, mb as i64, t, t2, fused_up)
            }
        };
        xh.expect(OP, "xh", gemm_scratch_bytes(x_rows, cols), 16)?;
        y.expect(OP, "y", 4 * lay.n_assign as u64 * rows as u64, 4)?;
        sorted.expect(OP, "sorted", lay.bytes, 16)?;
        let (ri, ci, ki) = (
            int(OP, "rows", rows)?,
            int(OP, "cols", cols)?,
            int(OP, "k", k)?,
        );
        int(OP, "x rows * cols", x_rows * cols)?;
        int(OP, "rows * cols", rows * cols)?;
        if rows == 0 || lay.n_assign == 0 {
            return Ok(());
        }
        if lay.max_tiles > 65535 {
            return Err(bad(
                OP,
                format!("{} tiles exceed the grid's 65535", lay.max_tiles),
            ));
        }
        let gather = (input == MoeInput::Gather) as i32;
        let tile = if fused { GemmTile::M64 } else { tile };
        let (name, pipelined) = kernel(true, fused, ty, tile, load);
        let f = self.function(name)?;
        let smem = smem_bytes(ty, tile, 1 + fused as usize, pipelined);
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(drv(format!(
            "cuFuncSetAttribute({name}, {smem} bytes shared)"
        )))?;
        let base = sorted.ptr();
        let (xp, yp) = (xh.ptr(), y.ptr());
        let (op, pp, tp, cp) = (
            base + lay.offsets,
            base + lay.perm,
            base + lay.tiles,
            base + lay.n_tiles,
        );
        let mut b = self.stream()?.launch_builder(f);
        if fused {
            b.arg(&up);
        }
        b.arg(&wp).arg(&mbl).arg(&xp).arg(&yp).arg(&ri).arg(&ci);
        b.arg(&op).arg(&pp).arg(&tp).arg(&cp).arg(&ki).arg(&gather);
        b.arg(&tab).arg(&tab2);
        let gt = ty.id() as i32;
        if any_type(ty) {
            // moe_gemm_*any*: the weights' GGUF type id last.
            b.arg(&gt);
        }
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(tile.rows()) as u32, lay.max_tiles as u32, 1),
            block_dim: (tile.threads(), 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: w holds n_expert matrices (or the table holds n_expert rows of pointers to
        // whole matrices of this shape: its maker's contract), xh x_rows rows, y n_assign rows
        // and sorted the moe_sort layout, all checked above. moe_sort wrote only experts < n_expert and
        // assignments < n_assign into perm and tiles, so every gathered row is < x_rows
        // (a / k < n_tok) and every scattered row < n_assign; CTAs past n_tiles exit.
        unsafe { b.launch(cfg) }.map_err(drv(format!("launch {name}")))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel a launcher can name is an entry point of the gemm module (a missing one
    /// only shows at launch, on a GPU), and the pipelined any-type kernels are exactly the
    /// four covered types' in the engine's four tiles.
    #[test]
    fn every_launched_kernel_is_a_gemm_entry_point() {
        let mut n = 0;
        let mut pipelined = std::collections::BTreeSet::new();
        for (moe, glu) in [(false, false), (true, false), (true, true)] {
            for ty in [
                GgmlType::Q8_0,
                GgmlType::Q4K,
                GgmlType::BF16,
                GgmlType::Q6K,
                GgmlType::Iq3S,
                GgmlType::Q5K,
                GgmlType::Iq4Xs,
                GgmlType::Q3K,
            ] {
                for tile in [GemmTile::M64, GemmTile::M128, GemmTile::M128W] {
                    for load in [AnyLoad::Pipelined, AnyLoad::Sync] {
                        let (name, p) = kernel(moe, glu, ty, tile, load);
                        let m = strata_kernels::module_of(name);
                        assert!(m.is_some_and(|m| m.name == "gemm"), "{name}");
                        assert_eq!(p, name.contains("_p_m"), "{name}");
                        assert_eq!(p, any_load_pipelined(load, ty, moe, glu, tile), "{name}");
                        if p {
                            pipelined.insert(name);
                        } else if any_type(ty) {
                            assert!(name.contains("_any_"), "{name}");
                        }
                        n += 1;
                    }
                }
            }
        }
        assert_eq!(n, 144);
        assert_eq!(pipelined.len(), 16);
        for ty in [
            GgmlType::Iq3S,
            GgmlType::Q6K,
            GgmlType::Q5K,
            GgmlType::Iq4Xs,
        ] {
            assert!(pipe_kernels(ty).is_some_and(|k| k.iter().all(|n| pipelined.contains(n))));
        }
        // The engine's tiles take them under `any-pipelined`: the fused gate + up, the down
        // product's default tile and both dense defaults; the default loader is the
        // synchronous one (the pipelined has not run on a GPU yet).
        let ty = GgmlType::Iq3S;
        assert!(any_load_pipelined(
            AnyLoad::Pipelined,
            ty,
            true,
            true,
            GemmTile::M64
        ));
        assert!(any_load_pipelined(
            AnyLoad::Pipelined,
            ty,
            true,
            false,
            MOE_DEFAULT_TILE
        ));
        for tile in [GemmTile::M64, GemmTile::M128] {
            assert!(any_load_pipelined(
                AnyLoad::Pipelined,
                ty,
                false,
                false,
                tile
            ));
        }
        assert_eq!(AnyLoad::default(), AnyLoad::Sync);
        assert!(!any_load_pipelined(
            AnyLoad::default(),
            ty,
            true,
            true,
            GemmTile::M64
        ));
    }

    /// The pipelined layout (X stages and two W buffers) is smaller than the synchronous
    /// one's (X and W in every stage), which is what buys the fused tile its third CTA.
    #[test]
    fn pipelined_tiles_take_less_shared_memory() {
        for (tile, nw) in [
            (GemmTile::M64, 2),
            (GemmTile::M128W, 1),
            (GemmTile::M128, 1),
        ] {
            let sync = smem_bytes(GgmlType::Iq3S, tile, nw, false);
            let pipe = smem_bytes(GgmlType::Iq3S, tile, nw, true);
            assert_eq!(
                pipe,
                GEMM_STAGES * GEMM_BN * 160 + 2 * nw * tile.rows() * 160
            );
            assert!(pipe < sync, "{tile:?}: {pipe} vs {sync}");
        }
        // Three fused IQ3_S tiles a multiprocessor on Hopper (228 KiB): each with its static
        // shared memory (the 2 KiB grid copy and the 512 bytes of row indices, by ptxas) and
        // the 1 KiB the driver reserves per CTA.
        let fused = smem_bytes(GgmlType::Iq3S, GemmTile::M64, 2, true) + 2560 + 1024;
        assert!(3 * fused <= 228 * 1024, "{fused}");
    }

    #[test]
    fn q4_k_matrices_need_whole_256_column_blocks() {
        assert_eq!(
            matrix_bytes("t", GgmlType::Q4K, 3, 512).unwrap(),
            3 * 2 * 144
        );
        let e = matrix_bytes("t", GgmlType::Q4K, 3, 384)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 x 384") && e.contains("256"), "{e}");
        // Every other decoded type through the any-type kernels, in whole blocks.
        assert_eq!(matrix_bytes("t", GgmlType::Q6K, 3, 256).unwrap(), 3 * 210);
        assert!(matrix_bytes("t", GgmlType::Iq3S, 3, 96).is_err());
        assert_eq!(
            matrix_bytes("t", GgmlType::Q4_0, 3, 96).unwrap(),
            3 * 3 * 18
        );
        assert!(matrix_bytes("t", GgmlType::Tq1_0, 3, 256).is_err());
        assert!(gemm_supports(GgmlType::Q4K) && gemm_supports(GgmlType::Q6K));
        assert!(!gemm_supports(GgmlType::F32) && !gemm_supports(GgmlType::Tq1_0));
        assert_eq!(gemm_col_multiple(GgmlType::Iq4Nl), 32);
    }
}
