//! Qwen3-Next's ops on the CUDA backend: not written yet. Each answers with one error that
//! names the op and the way out (`--backend cpu`), so a qwen3next model never half-runs on a
//! GPU; the CUDA preflight refuses qwen3next plans with the same message before this is reached.
//! Invariant: nothing here touches the device.

use super::CudaError;

/// Why a Qwen3-Next op cannot run on the CUDA backend.
pub fn not_yet(op: &'static str) -> CudaError {
    CudaError::Shape {
        op,
        detail: format!("{NOT_YET} ({op})"),
    }
}

/// The message of every refusal.
pub const NOT_YET: &str =
    "Qwen3-Next (qwen3next) is not in the CUDA engine yet; run with --backend cpu";
