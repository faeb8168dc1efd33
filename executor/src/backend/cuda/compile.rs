//! NVRTC compilation of the embedded kernel modules for the device's `sm_XX`, with an on-disk
//! cache: `<dir>/<module>-<source hash>-sm_XX-nvrtc<major>.<minor>.cubin`, where `<dir>` is
//! `$STRATA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/strata/kernels`, else
//! `$HOME/.cache/strata/kernels` (`STRATA_KERNEL_CACHE=off` disables it).
//! Invariant: a cache entry is keyed by exactly what determines the binary (source text,
//! arch, compiler version), is written atomically (temp file + rename), and a damaged entry is
//! recompiled, never loaded. A compile error carries NVRTC's log and the module's kernels.

use super::CudaError;
use std::ffi::CString;
use std::path::Path;
use strata_kernels::KernelSource;

/// `sm_XY` for compute capability (X, Y).
pub fn arch_name(cc: (i32, i32)) -> String {
    format!("sm_{}{}", cc.0, cc.1)
}

pub use crate::backend::kernel_cache::cache_dir;

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: nvrtcVersion writes two ints through valid pointers; the library was checked
    // to be loadable before any device is opened.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    r.result().map_err(|e| CudaError::Compile {
        module: "(none)",
        kernels: &[],
        arch: String::new(),
        version: "unknown".into(),
        log: format!("nvrtcVersion failed: {e:?}"),
    })?;
    Ok((major, minor))
}

/// The cache file name of `src` for an arch and NVRTC version.
pub fn cache_file_name(src: &KernelSource, cc: (i32, i32), nvrtc: (i32, i32)) -> String {
    format!(
        "{}-{}-{}-nvrtc{}.{}.cubin",
        src.name,
        &src.hash[..16],
        arch_name(cc),
        nvrtc.0,
        nvrtc.1
    )
}

fn looks_like_cubin(b: &[u8]) -> bool {
    b.len() > 64 && b.starts_with(b"\x7fELF")
}

/// The module's cubin from the cache, or compiled (and then cached). Returns (image, cached).
pub fn load_or_compile(
    src: &KernelSource,
    cc: (i32, i32),
    nvrtc: (i32, i32),
    dir: Option<&Path>,
) -> Result<(Vec<u8>, bool), CudaError> {
    let path = dir.map(|d| d.join(cache_file_name(src, cc, nvrtc)));
    if let Some(p) = &path {
        if let Ok(b) = std::fs::read(p) {
            if looks_like_cubin(&b) {
                let mut image = b;
                image.push(0); // cuModuleLoadData reads an image; a trailing NUL is harmless
                return Ok((image, true));
            }
        }
    }
    let mut image = compile(src, cc, nvrtc)?;
    if let (Some(d), Some(p)) = (dir, &path) {
        // The cache is an optimisation: failing to write it is not an error.
        if std::fs::create_dir_all(d).is_ok() {
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &image).is_ok() && std::fs::rename(&tmp, p).is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
        }
    }
    image.push(0);
    Ok((image, false))
}

/// Compiles `src` with NVRTC for `sm_XY` and returns the cubin.
pub fn compile(
    src: &KernelSource,
    cc: (i32, i32),
    nvrtc: (i32, i32),
) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys};
    let arch = arch_name(cc);
    let version = format!("{}.{}", nvrtc.0, nvrtc.1);
    let fail = |log: String| CudaError::Compile {
        module: src.name,
        kernels: src.entry_points,
        arch: arch.clone(),
        version: version.clone(),
        log,
    };
    let text =
        CString::new(src.source.as_str()).map_err(|_| fail("source has a NUL byte".into()))?;
    let name = CString::new(format!("{}.cu", src.name)).map_err(|_| fail("bad name".into()))?;
    let prog = result::create_program(&text, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let opts = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-default-device".to_string(),
    ];
    // SAFETY: prog was just created from `text` and `name`, which outlive it; it is destroyed
    // exactly once below.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let out = (|| {
        if let Err(e) = compiled {
            // SAFETY: prog is live.
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| {
                    let bytes: Vec<u8> =
                        l.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .unwrap_or_else(|_| "(no log)".into());
            return Err(fail(format!("{e:?}\n{log}")));
        }
        let mut size = 0usize;
        // SAFETY: prog compiled successfully; size is a valid out-pointer.
        unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))?;
        let mut cubin = vec![0u8; size];
        // SAFETY: cubin has exactly the `size` bytes NVRTC asked for.
        unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut std::ffi::c_char) }
            .result()
            .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))?;
        Ok(cubin)
    })();
    // SAFETY: prog is live and not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_names_key_on_hash_arch_and_version() {
        let src = &strata_kernels::all()[0];
        let a = cache_file_name(src, (9, 0), (13, 0));
        assert!(
            a.starts_with(&format!("{}-{}", src.name, &src.hash[..16])),
            "{a}"
        );
        assert!(a.ends_with("-sm_90-nvrtc13.0.cubin"), "{a}");
        assert_ne!(a, cache_file_name(src, (8, 6), (13, 0)));
        assert_ne!(a, cache_file_name(src, (9, 0), (12, 9)));
        assert_eq!(arch_name((12, 0)), "sm_120");
    }

    #[test]
    fn a_damaged_cache_entry_is_not_taken_for_a_cubin() {
        assert!(!looks_like_cubin(b"garbage"));
        let mut ok = b"\x7fELF".to_vec();
        ok.resize(100, 0);
        assert!(looks_like_cubin(&ok));
    }
}
