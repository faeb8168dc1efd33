//! Every portable kernel module compiles with hiprtc for the AMD targets we ship to — RDNA4
//! (gfx1201) and RDNA3 (gfx1100) at their wave32, and, so that wave64 code paths compile
//! too, CDNA3 (gfx942) and gfx1201 in wave64 mode — on any machine whose hiprtc loads, GPU
//! or not. Each code object must define every kernel of its module at the wave size the
//! source was told; the CUDA-only tensor-core modules must compile to no kernels.
//! Invariant: skips loudly, never silently, when libhiprtc cannot be loaded (`.ci/run`
//! installs Debian's ROCm hiprtc and runs this test through it).

#![cfg(feature = "hip")]

use strata_exec::backend::hip::{compile, ffi};

/// (target, wave): what is compile-checked.
const TARGETS: [(&str, u32); 4] = [
    ("gfx1201", 32),
    ("gfx1100", 32),
    ("gfx942", 64),
    ("gfx1201", 64),
];

#[test]
fn every_portable_kernel_module_compiles_for_rdna4_rdna3_and_wave64() {
    if let Err(e) = ffi::rtc() {
        eprintln!(
            "SKIP: hiprtc not loadable, no HIP kernel was compiled: {e}\n      (.ci/hiprtc-root installs ROCm's hiprtc from Debian and prints how to run this test with it)"
        );
        return;
    }
    let compiler = compile::compiler_id().expect("hiprtc version");
    let mut failed = Vec::new();
    let mut kernels = 0;
    for (arch, wave) in TARGETS {
        let target = compile::GfxTarget::parse(arch).unwrap();
        for src in strata_kernels::all() {
            match compile::compile(src, &target, wave, &compiler) {
                Ok(code) => {
                    if src.cuda_only {
                        assert_eq!(
                            compile::code_object_wave(&code),
                            None,
                            "CUDA-only module `{}` defines kernels on HIP",
                            src.name
                        );
                    } else {
                        assert_eq!(compile::code_object_wave(&code), Some(wave), "{}", src.name);
                        kernels += src.entry_points.len();
                    }
                }
                Err(e) => failed.push(e.to_string()),
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
    // The line .ci/run looks for: the test really compiled.
    println!(
        "hiprtc compiled {kernels} kernels ({compiler}) for {:?}",
        TARGETS
    );
}

#[test]
fn a_compile_error_carries_the_log_target_and_kernels() {
    if ffi::rtc().is_err() {
        eprintln!("SKIP: hiprtc not loadable (see the test above)");
        return;
    }
    let compiler = compile::compiler_id().unwrap();
    let mut src = strata_kernels::by_name("norm").unwrap().clone();
    src.source
        .push_str("\nST_KERNEL void broken() { undefined_thing(); }\n");
    let target = compile::GfxTarget::parse("gfx1201").unwrap();
    let e = compile::compile(&src, &target, 32, &compiler)
        .unwrap_err()
        .to_string();
    assert!(e.contains("undefined_thing"), "{e}");
    assert!(
        e.contains("gfx1201") && e.contains("`norm`") && e.contains("rmsnorm_f32"),
        "{e}"
    );
}
