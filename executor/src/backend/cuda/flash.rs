//! Prefill attention launchers of the CUDA backend over raw device addresses (the engine's
//! per-slot KV layout): `fa_prefill` (kernels/cuda/flash.cu, tensor cores, head sizes 64 and
//! 128) and `dq_attn_prefill` (kernels/cuda/decode.cu, f32 CUDA cores, any head size up to
//! 256, the one HIP runs), plus [`attn_prefill`], which picks the first when it applies.
//! Invariant: both kernels compute the same function from the same arguments: the `n_tok`
//! query tokens are one slot's (`slot[0]`), their K/V already stored, token `t` sees the
//! cells `0..=pos[t]`; in the engine these are consecutive positions `p0 + t` (sorted
//! ascending), though neither kernel relies on it. Every launch's scalars are checked here;
//! the addresses are the caller's promise (hence `unsafe`).

use super::kv_spill::KvHostArg;
use super::launch::{arg_ptr, bad, int};
use super::{drv, CudaDevice, CudaError};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use strata_kernels::consts as kc;

/// Query tokens per `fa_prefill` CTA.
pub const FA_BQ: usize = kc::FA_BQ;
/// KV cells per shared tile.
pub const FA_BKV: usize = kc::FA_BKV;
/// Threads per `fa_prefill` CTA (FA_WARPS warps).
pub const FA_THREADS: u32 = kc::FA_WARPS * 32;
/// Query tokens per `dq_attn_prefill` CTA.
const PF_Q: usize = kc::PF_Q;
/// Largest head size `dq_attn_prefill` takes.
const PF_MAX_HD: usize = kc::ATT_MAX_D;

/// KV row types, numbered as the kernels do.
pub const KV_TY_F32: i32 = kc::ST_TY_F32;
pub const KV_TY_F16: i32 = kc::ST_TY_F16;
pub const KV_TY_Q8_0: i32 = kc::ST_TY_Q8_0;

/// Whether `fa_prefill` handles these heads: head size 64 or 128 and GQA groups of whole
/// heads. Otherwise use `dq_attn_prefill` (what [`attn_prefill`] does).
pub fn fa_prefill_supported(hd: usize, n_head: usize, n_head_kv: usize) -> bool {
    (hd == 64 || hd == 128) && n_head > 0 && n_head_kv > 0 && n_head % n_head_kv == 0
}

/// Dynamic shared memory of one `fa_prefill` CTA: an f16 K tile `FA_BKV × (hd + 8)` (first
/// holding the Q tile) and a transposed f16 V tile `hd × (FA_BKV + 8)`. 35840 bytes at hd
/// 128, under the 48 KiB default, so no function attribute is needed.
pub fn fa_prefill_smem_bytes(hd: usize) -> u32 {
    (2 * (FA_BKV * (hd + 8) + hd * (FA_BKV + 8))) as u32
}

/// Grid, block and shared memory of `fa_prefill` for `n_tok` tokens of `n_head` heads:
/// grid `(n_head, ceil(n_tok / FA_BQ))`.
pub fn fa_prefill_config(hd: usize, n_head: usize, n_tok: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n_head as u32, n_tok.div_ceil(FA_BQ) as u32, 1),
        block_dim: (FA_THREADS, 1, 1),
        shared_mem_bytes: fa_prefill_smem_bytes(hd),
    }
}

/// Raw device addresses and geometry of one prefill attention: what the engine passes to
/// `dq_attn_prefill` (less its tile size). KV: the K row of cell `c` lies at
/// `kv + slot[0] * slot_bytes + k_off + c * row_bytes`, V at `v_off`; a row is `n_head_kv ×
/// hd` elements of `kv_ty` (`KV_TY_*`; Q8_0 in GGUF blocks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillAttn {
    /// f32 `n_tok × n_head × hd`.
    pub q: u64,
    /// The KV arena base.
    pub kv: u64,
    /// One i32: the slot all tokens belong to.
    pub slot: u64,
    /// `n_tok` i32 positions.
    pub pos: u64,
    pub slot_bytes: u64,
    pub k_off: u64,
    pub v_off: u64,
    pub row_bytes: u64,
    pub kv_ty: i32,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub hd: usize,
    pub scale: f32,
    pub n_tok: usize,
    /// f32 `n_tok × n_head × hd`.
    pub out: u64,
    /// The slot's cells past the VRAM window (`KvHostArg::none()` when all are in VRAM):
    /// only `dq_attn_prefill` reads them.
    pub host: KvHostArg,
}

/// The checked kernel scalars shared by both kernels.
struct Scalars {
    slot_bytes: i64,
    k_off: i64,
    v_off: i64,
    row_bytes: i64,
    n_head: i32,
    n_head_kv: i32,
    hd: i32,
    n_tok: i32,
}

fn check(op: &'static str, a: &PrefillAttn) -> Result<Scalars, CudaError> {
    if a.n_head_kv == 0 || a.n_head == 0 || a.n_head % a.n_head_kv != 0 {
        return Err(bad(
            op,
            format!(
                "n_head {} must be a positive multiple of n_head_kv {}",
                a.n_head, a.n_head_kv
            ),
        ));
    }
    // A row holds n_head_kv heads; q8_0 blocks of 32 may straddle heads (head size 16), so
    // only the whole row must be whole blocks.
    let width = (a.n_head_kv * a.hd) as u64;
    let (row, align) = match a.kv_ty {
        KV_TY_F32 => (4 * width, 4),
        KV_TY_F16 => (2 * width, 2),
        KV_TY_Q8_0 if width % 32 == 0 => (width / 32 * 34, 2),
        other => {
            return Err(bad(
                op,
                format!(
                    "KV type {other} with rows of {width} (F32 = 0, F16 = 1, Q8_0 = 3 with rows a multiple of 32)"
                ),
            ))
        }
    };
    if a.row_bytes < row {
        return Err(bad(
            op,
            format!(
                "row_bytes {} is less than a row of {} heads of {} ({row} bytes)",
                a.row_bytes, a.n_head_kv, a.hd
            ),
        ));
    }
    if (a.kv | a.slot_bytes | a.k_off | a.v_off | a.row_bytes) % align != 0 {
        return Err(bad(
            op,
            format!("KV base, slot_bytes, k_off, v_off and row_bytes must be {align}-byte aligned"),
        ));
    }
    // The kernels index q and out with 64-bit offsets but count rows in 32 bits.
    int(op, "n_tok * n_head", a.n_tok.saturating_mul(a.n_head))?;
    let i64_of = |what: &str, v: u64| {
        i64::try_from(v).map_err(|_| bad(op, format!("{what} = {v} exceeds i64")))
    };
    Ok(Scalars {
        slot_bytes: i64_of("slot_bytes", a.slot_bytes)?,
        k_off: i64_of("k_off", a.k_off)?,
        v_off: i64_of("v_off", a.v_off)?,
        row_bytes: i64_of("row_bytes", a.row_bytes)?,
        n_head: int(op, "n_head", a.n_head)?,
        n_head_kv: int(op, "n_head_kv", a.n_head_kv)?,
        hd: int(op, "hd", a.hd)?,
        n_tok: int(op, "n_tok", a.n_tok)?,
    })
}

/// Launches `fa_prefill` (grid and shared memory from [`fa_prefill_config`]) on the device's
/// stream. Errors (nothing launched) unless [`fa_prefill_supported`] holds, `q` and `out` are
/// 16-byte aligned and the KV geometry is consistent.
///
/// # Safety
/// Every address must be a live device allocation of the device's context: `q` and `out`
/// `n_tok × n_head × hd` f32 each, `slot` one i32 naming a slot whose rows
/// `0..=max(pos[..n_tok])` of K and V lie inside the KV allocation, `pos` `n_tok` i32 that
/// are all `>= 0`.
pub unsafe fn launch_fa_prefill(dev: &CudaDevice, a: &PrefillAttn) -> Result<(), CudaError> {
    const OP: &str = "fa_prefill";
    let s = check(OP, a)?;
    if !fa_prefill_supported(a.hd, a.n_head, a.n_head_kv) {
        return Err(bad(
            OP,
            format!(
                "head size {} (n_head {}, n_head_kv {}) needs dq_attn_prefill; fa_prefill takes 64 or 128",
                a.hd, a.n_head, a.n_head_kv
            ),
        ));
    }
    if (a.q | a.out) % 16 != 0 {
        return Err(bad(OP, "q and out must be 16-byte aligned".into()));
    }
    if a.host.spills() {
        return Err(bad(
            OP,
            "fa_prefill reads every cell from VRAM; a slot with cells beyond --kv-resident in host memory needs dq_attn_prefill".into(),
        ));
    }
    if a.n_tok == 0 {
        return Ok(());
    }
    if a.n_tok.div_ceil(FA_BQ) > 65535 {
        return Err(bad(
            OP,
            format!("n_tok {} needs more than 65535 token tiles", a.n_tok),
        ));
    }
    let f = dev.function(OP)?;
    let mut b = dev.stream()?.launch_builder(f);
    b.arg(&a.q)
        .arg(&a.kv)
        .arg(&a.slot)
        .arg(&a.pos)
        .arg(&s.slot_bytes)
        .arg(&s.k_off)
        .arg(&s.v_off)
        .arg(&a.kv_ty)
        .arg(&s.n_head)
        .arg(&s.n_head_kv)
        .arg(&s.hd)
        .arg(&s.row_bytes)
        .arg(&a.scale)
        .arg(&s.n_tok)
        .arg(&a.out);
    // SAFETY: the arguments match fa_prefill's parameter list in type and order; the
    // addresses are live allocations of the sizes the kernel touches (this function's
    // contract) and the scalars were checked above (head size, alignment, 32-bit counts).
    unsafe { b.launch(fa_prefill_config(a.hd, a.n_head, a.n_tok)) }
        .map_err(drv("launch fa_prefill"))?;
    Ok(())
}

/// Launches decode.cu's `dq_attn_prefill` (f32, any head size up to 256) with the engine's
/// tile choice: the reference `fa_prefill` must match, and the fallback for other heads.
///
/// # Safety
/// As [`launch_fa_prefill`].
pub unsafe fn launch_dq_attn_prefill(dev: &CudaDevice, a: &PrefillAttn) -> Result<(), CudaError> {
    const OP: &str = "dq_attn_prefill";
    let s = check(OP, a)?;
    if a.hd == 0 || a.hd > PF_MAX_HD {
        return Err(bad(
            OP,
            format!("head size {} must be 1..={PF_MAX_HD}", a.hd),
        ));
    }
    if a.n_tok == 0 {
        return Ok(());
    }
    let kt: i32 = if a.hd <= 128 { 32 } else { 16 };
    let smem = ((2 * kt as usize * (a.hd + 1) + PF_Q * a.hd) * 4) as u32;
    let cfg = LaunchConfig {
        grid_dim: (a.n_head as u32, a.n_tok.div_ceil(PF_Q) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    if smem > 48 << 10 {
        // hd > 128 with kt 16 needs a little over 48 KiB (49280 bytes at hd 256).
        dev.allow_shared(OP, smem)?;
    }
    // SAFETY: as in launch_fa_prefill; the arguments match dq_attn_prefill's list in type
    // and order, with kt <= 32 and hd <= 256 as the kernel requires, and its shared memory
    // allowed above when over the default.
    unsafe {
        dev.launch_raw(
            OP,
            cfg,
            &mut [
                arg_ptr(&a.q),
                arg_ptr(&a.kv),
                arg_ptr(&a.slot),
                arg_ptr(&a.pos),
                arg_ptr(&s.slot_bytes),
                arg_ptr(&s.k_off),
                arg_ptr(&s.v_off),
                arg_ptr(&a.kv_ty),
                arg_ptr(&s.n_head),
                arg_ptr(&s.n_head_kv),
                arg_ptr(&s.hd),
                arg_ptr(&s.row_bytes),
                arg_ptr(&a.scale),
                arg_ptr(&kt),
                arg_ptr(&s.n_tok),
                arg_ptr(&a.out),
                arg_ptr(&a.host),
            ],
        )
    }
}

/// Prefill attention by the fastest kernel that applies: `fa_prefill` when the device has
/// the tensor-core modules (CUDA), [`fa_prefill_supported`] holds, `q`, `out` are 16-byte
/// aligned and every cell is in VRAM, else `dq_attn_prefill` (which reads a slot's cells
/// beyond `--kv-resident` from host memory in place: the simple, correct choice for a plan
/// that spills, at CUDA-core speed).
///
/// # Safety
/// As [`launch_fa_prefill`].
pub unsafe fn attn_prefill(dev: &CudaDevice, a: &PrefillAttn) -> Result<(), CudaError> {
    if dev.tensor_cores()
        && !a.host.spills()
        && fa_prefill_supported(a.hd, a.n_head, a.n_head_kv)
        && (a.q | a.out) % 16 == 0
    {
        // SAFETY: the caller's contract is the same.
        unsafe { launch_fa_prefill(dev, a) }
    } else {
        // SAFETY: as above.
        unsafe { launch_dq_attn_prefill(dev, a) }
    }
}
