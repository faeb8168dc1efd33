//! gemm.cu's pipelined any-type decoders (`GmRaw`: IQ3_S, Q6_K, Q5_K, IQ4_XS from registers)
//! against quants.cuh's reference decoders, bit for bit, built for the host with the system's
//! C++ compiler: `gemm_decoders_host.cpp` models the device built-ins they use exactly, so
//! this holds the pipelined loader to the synchronous one's weights without a GPU.
//! Invariant: skips loudly, never silently, when no C++17 compiler (`c++`, `g++`, `clang++`)
//! is on the PATH.

use std::path::Path;
use std::process::Command;

/// The decoders' text in gemm.cu: from `gm_ld16` to the f16 store that follows them.
fn decoders(gemm: &str) -> &str {
    let start = gemm
        .find("__device__ __forceinline__ u32 gm_ld16")
        .expect("gemm.cu: gm_ld16, the first of the pipelined loader's helpers, is gone; update gemm_decoders_host.rs to the new layout");
    let end = gemm[start..]
        .find("// 32 values -> f16")
        .expect("gemm.cu: the comment of gm_store_h32, which ends the decoders, is gone; update gemm_decoders_host.rs");
    &gemm[start..start + end]
}

#[test]
fn pipelined_any_type_decoders_equal_the_reference_decoders_bit_for_bit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cuda = root.join("cuda");
    let gemm = std::fs::read_to_string(cuda.join("gemm.cu")).unwrap();
    let dir = std::env::temp_dir().join(format!("strata-gemm-decoders-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("gemm_pipe.inc"), decoders(&gemm)).unwrap();
    let exe = dir.join("decoders");
    let src = root.join("tests/gemm_decoders_host.cpp");
    let mut built = None;
    for cxx in ["c++", "g++", "clang++"] {
        let out = Command::new(cxx)
            .args(["-std=c++17", "-O1", "-ffp-contract=off", "-I"])
            .arg(&cuda)
            .arg("-I")
            .arg(&dir)
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .output();
        if let Ok(out) = out {
            built = Some((cxx, out));
            break;
        }
    }
    let Some((cxx, out)) = built else {
        eprintln!("SKIP: no C++ compiler (c++, g++ or clang++) on the PATH to build gemm_decoders_host.cpp; install one (build-essential) to check the pipelined decoders without a GPU");
        return;
    };
    assert!(
        out.status.success(),
        "{cxx} could not build {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&run.stdout);
    eprintln!("{}", text.trim_end());
    assert!(
        run.status.success(),
        "the pipelined decoders differ from quants.cuh's:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
