//! Every kernel module compiles with NVRTC for the architectures we ship to — on any machine
//! that has libnvrtc, GPU or not (CI installs NVRTC from its Python wheel for this).
//! Invariant: skips loudly, never silently, when libnvrtc cannot be loaded.

#![cfg(feature = "cuda")]

use strata_exec::backend::cuda::compile;

#[test]
fn every_kernel_module_compiles_for_ampere_and_hopper() {
    // SAFETY: only dlopens candidate library names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("SKIP: libnvrtc not found (set LD_LIBRARY_PATH to a folder holding libnvrtc.so; .ci/run installs the nvidia-cuda-nvrtc wheel)");
        return;
    }
    let nvrtc = compile::nvrtc_version().expect("NVRTC version");
    let mut failed = Vec::new();
    for cc in [(8, 6), (9, 0)] {
        for src in strata_kernels::all() {
            if let Err(e) = compile::compile(src, cc, nvrtc) {
                failed.push(e.to_string());
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}
