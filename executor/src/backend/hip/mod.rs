//! The HIP backend for AMD GPUs, behind the `hip` feature: the HIP runtime and hiprtc opened
//! at run time (`ffi`, so the executor builds and runs without ROCm), the kernel sources of
//! `strata-kernels` compiled by hiprtc for the device's gfx target and wave size and cached
//! on disk (`compile`), and the driver operations the engine's launchers sit on (`device`:
//! device open and facts, one allocation per planned arena with bounds-checked views,
//! streams, events, async copies and memset, module load and function lookup, kernel launch
//! with a `void**` argument array, graph capture). `probe` measures a device for
//! `strata-exec probe`. The engine does not run on it yet: see the README's HIP section.
//! Invariant: a missing library, symbol or device is an error that names it and the fix,
//! never a panic; nothing here sizes memory from what is free.

pub mod compile;
pub mod device;
pub mod ffi;
pub mod probe;

pub use device::{
    arena_allocations, DeviceInfo, HipArena, HipDevice, HipEvent, HipGraph, HipModule, HipPinned,
    HipStream, HipView,
};

use crate::backend::view::ViewError;

/// Everything the HIP backend can report.
#[derive(Debug, thiserror::Error)]
pub enum HipError {
    #[error("no HIP library: {0}")]
    Library(ffi::LoadFailure),
    #[error("HIP {what} failed: {name} ({code}): {text}")]
    Call {
        what: String,
        code: i32,
        name: String,
        text: String,
    },
    #[error("HIP device {ordinal} does not exist: the runtime reports {count} device(s); pick one with --gpu N (check `rocm-smi` or `amd-smi list`, and HIP_VISIBLE_DEVICES if it is set)")]
    NoDevice { ordinal: usize, count: i32 },
    #[error("AMD target {target}: {detail}")]
    Target { target: String, detail: String },
    #[error("hiprtc {version} could not compile kernel module `{module}` (kernels {kernels:?}) for {target} at wave{wave}:\n{log}")]
    Compile {
        module: &'static str,
        kernels: &'static [&'static str],
        target: String,
        wave: u32,
        version: String,
        log: String,
    },
    #[error("kernel `{0}` is not loaded: it is defined by no module in strata-kernels, or its module is CUDA-only (tensor-core PTX); add it to kernels/src/lib.rs or use the portable kernel")]
    UnknownKernel(String),
    #[error(transparent)]
    View(#[from] ViewError),
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
}

/// Checks that libamdhip64 and libhiprtc can be loaded, naming every file looked for when
/// not (the first thing `HipDevice::open` does).
pub fn check_libraries() -> Result<(), HipError> {
    ffi::hip().map_err(HipError::Library)?;
    ffi::rtc().map_err(HipError::Library)?;
    Ok(())
}

/// Turns a HIP return code into a result, with the runtime's name and text for the code.
pub(crate) fn check(api: &ffi::HipApi, what: impl Into<String>, code: i32) -> Result<(), HipError> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: both return pointers to static NUL-terminated strings for any code.
    let (name, text) = unsafe {
        (
            ffi::c_text((api.get_error_name)(code)),
            ffi::c_text((api.get_error_string)(code)),
        )
    };
    Err(HipError::Call {
        what: what.into(),
        code,
        name,
        text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_input_and_the_fix() {
        let e = HipError::NoDevice {
            ordinal: 3,
            count: 2,
        }
        .to_string();
        assert!(e.contains("device 3") && e.contains("2 device(s)") && e.contains("--gpu"));
        let e = HipError::UnknownKernel("gemm_q8_0_m64".into()).to_string();
        assert!(
            e.contains("gemm_q8_0_m64") && e.contains("CUDA-only"),
            "{e}"
        );
        let e = HipError::Compile {
            module: "norm",
            kernels: &["rmsnorm_f32"],
            target: "gfx1201".into(),
            wave: 32,
            version: "hiprtc7.2".into(),
            log: "error: x".into(),
        }
        .to_string();
        assert!(e.contains("`norm`") && e.contains("gfx1201") && e.contains("wave32"));
        assert!(e.contains("error: x"));
    }

    #[test]
    fn without_rocm_the_libraries_are_reported_missing_not_panicking() {
        // On a machine with ROCm this passes too: then the check succeeds.
        match check_libraries() {
            Ok(()) => {}
            Err(HipError::Library(f)) => {
                let msg = f.to_string();
                assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
                assert!(
                    msg.contains("libamdhip64") || msg.contains("libhiprtc"),
                    "{msg}"
                );
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }
}
