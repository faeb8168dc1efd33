//! hiprtc compilation of the embedded kernel modules for an AMD device's target (gfx arch,
//! its target features and the wave size), with the on-disk cache of `kernel_cache`:
//! `<dir>/<module>-<source hash>-<target>-w<wave>-hiprtc<version>.co`.
//! Invariant: a cache entry is keyed by exactly what determines the code object (source
//! text, target ID, wave size, compiler version) and is used only when it is an AMDGPU ELF
//! that defines every kernel of the module (a damaged entry is recompiled, never loaded). A
//! compile error carries hiprtc's log, the module's kernels and the target.

use super::ffi::{self, c_text, Program};
use super::HipError;
use crate::backend::kernel_cache;
use std::ffi::{c_char, CString};
use std::path::Path;
use strata_kernels::KernelSource;

/// An AMD GPU target as HIP names it (`hipDeviceProp_t::gcnArchName`), e.g.
/// `gfx90a:sramecc+:xnack-`: the processor and its target features.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GfxTarget {
    /// The processor, e.g. `gfx1201`.
    pub processor: String,
    /// Target features with their sign, e.g. `["sramecc+", "xnack-"]`.
    pub features: Vec<String>,
}

impl GfxTarget {
    /// Parses a target ID; None unless it is `gfx` + a hex-digit version (+ `:feature±`...).
    pub fn parse(id: &str) -> Option<Self> {
        let id = id.trim();
        let mut parts = id.split(':');
        let processor = parts.next()?.to_string();
        let digits = processor.strip_prefix("gfx")?;
        if digits.len() < 3 || !digits.chars().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        let features: Vec<String> = parts.map(str::to_string).collect();
        if features
            .iter()
            .any(|f| f.len() < 2 || !(f.ends_with('+') || f.ends_with('-')))
        {
            return None;
        }
        Some(Self {
            processor,
            features,
        })
    }

    /// The GFX major version: 9 for `gfx90a`/`gfx942`, 11 for `gfx1100`, 12 for `gfx1201`
    /// (the processor's digits less the minor and stepping digits).
    pub fn major(&self) -> u32 {
        let d = &self.processor[3..];
        d[..d.len() - 2].parse().unwrap_or(0)
    }

    /// The wave size the hardware always offers: 64 before RDNA (GFX 9 and older, CDNA
    /// included); RDNA (GFX 10 and later) runs wave32 by default and wave64 on request.
    pub fn default_wave(&self) -> u32 {
        if self.major() >= 10 {
            32
        } else {
            64
        }
    }

    /// The full target ID handed to `--offload-arch` (features included: a code object built
    /// for another xnack/sramecc mode does not load).
    pub fn id(&self) -> String {
        let mut s = self.processor.clone();
        for f in &self.features {
            s.push(':');
            s.push_str(f);
        }
        s
    }

    /// The target ID as a file-name part (`:` becomes `_`).
    pub fn file_part(&self) -> String {
        self.id().replace(':', "_")
    }
}

/// hiprtc's options for a target and wave size: the target, C++17, the source's wave size
/// (`common.cuh` needs `ST_WARP`), and `-mwavefrontsize64` for wave64 on RDNA.
pub fn options(target: &GfxTarget, wave: u32) -> Result<Vec<String>, HipError> {
    let bad = |why: &str| HipError::Target {
        target: target.id(),
        detail: format!("wave size {wave}: {why}"),
    };
    match (wave, target.major() >= 10) {
        (32, true) | (64, _) => {}
        (32, false) => return Err(bad("GFX 9 and older GPUs run only wave64")),
        _ => return Err(bad("the kernels are written for wave32 or wave64")),
    }
    let mut o = vec![
        format!("--offload-arch={}", target.id()),
        "-std=c++17".to_string(),
        "-O3".to_string(),
        format!("-DST_WARP={wave}"),
    ];
    if wave == 64 && target.major() >= 10 {
        o.push("-mwavefrontsize64".to_string());
    }
    Ok(o)
}

/// hiprtc's identity for the cache key: `hiprtc<major>.<minor>`, plus the library file's
/// own version (`libhiprtc.so.7.2.53211` gives `-7.2.53211`) where the process maps it.
pub fn compiler_id() -> Result<String, HipError> {
    let api = ffi::rtc().map_err(HipError::Library)?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: hiprtcVersion writes two ints through valid pointers.
    let r = unsafe { (api.version)(&mut major, &mut minor) };
    if r != 0 {
        return Err(HipError::Call {
            what: "hiprtcVersion".into(),
            code: r,
            name: "hiprtc".into(),
            // SAFETY: returns a static NUL-terminated string for any code.
            text: unsafe { c_text((api.get_error_string)(r)) },
        });
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    Ok(match mapped_version(&maps, "libhiprtc.so.") {
        Some(v) => format!("hiprtc{major}.{minor}-{v}"),
        None => format!("hiprtc{major}.{minor}"),
    })
}

/// The version suffix of the first mapped file named `<stem><version>` in a
/// `/proc/self/maps` text (symlinks there are already resolved to the real file).
pub fn mapped_version(maps: &str, stem: &str) -> Option<String> {
    maps.lines().find_map(|l| {
        let path = l.split_whitespace().nth(5)?;
        let file = path.rsplit('/').next()?;
        let v = file.strip_prefix(stem)?;
        (!v.is_empty() && v.chars().all(|c| c.is_ascii_digit() || c == '.')).then(|| v.into())
    })
}

/// The cache file name of `src` for a target, wave size and compiler.
pub fn cache_file_name(
    src: &KernelSource,
    target: &GfxTarget,
    wave: u32,
    compiler: &str,
) -> String {
    format!(
        "{}-{}-{}-w{wave}-{compiler}.co",
        src.name,
        &src.hash[..16],
        target.file_part()
    )
}

/// Whether `code` is an AMDGPU ELF code object defining every kernel of `src` (a kernel has
/// a `<name>.kd` descriptor symbol). CUDA-only modules define none on HIP.
pub fn code_object_is_complete(code: &[u8], src: &KernelSource) -> bool {
    if code.len() < 64 || !code.starts_with(b"\x7fELF") {
        return false;
    }
    src.cuda_only
        || src.entry_points.iter().all(|e| {
            let kd = format!("{e}.kd\0");
            contains(code, kd.as_bytes())
        })
}

/// The wave size recorded in a code object's kernel metadata (`.wavefront_size`, a msgpack
/// small integer), if any kernel has one.
pub fn code_object_wave(code: &[u8]) -> Option<u32> {
    let key = b".wavefront_size";
    let at = code.windows(key.len()).position(|w| w == key)?;
    match code.get(at + key.len())? {
        v @ 0..=0x7f => Some(*v as u32),
        _ => None,
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The module's code object from the cache, or compiled (and then cached). Returns (code
/// object, whether it came from the cache).
pub fn load_or_compile(
    src: &KernelSource,
    target: &GfxTarget,
    wave: u32,
    compiler: &str,
    dir: Option<&Path>,
) -> Result<(Vec<u8>, bool), HipError> {
    let name = cache_file_name(src, target, wave, compiler);
    if let Some(d) = dir {
        if let Ok(b) = std::fs::read(d.join(&name)) {
            if code_object_is_complete(&b, src) {
                return Ok((b, true));
            }
        }
    }
    let code = compile(src, target, wave, compiler)?;
    if let Some(d) = dir {
        kernel_cache::store(d, &name, &code);
    }
    Ok((code, false))
}

/// Compiles `src` with hiprtc for `target` at `wave` and returns the code object, checked
/// to define every kernel of the module at that wave size.
pub fn compile(
    src: &KernelSource,
    target: &GfxTarget,
    wave: u32,
    compiler: &str,
) -> Result<Vec<u8>, HipError> {
    let api = ffi::rtc().map_err(HipError::Library)?;
    let fail = |log: String| HipError::Compile {
        module: src.name,
        kernels: src.entry_points,
        target: target.id(),
        wave,
        version: compiler.to_string(),
        log,
    };
    let opts = options(target, wave)?;
    let text =
        CString::new(src.source.as_str()).map_err(|_| fail("source has a NUL byte".into()))?;
    let file = CString::new(format!("{}.cu", src.name)).map_err(|_| fail("bad name".into()))?;
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options have no NUL"))
        .collect();
    let ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: text and file are NUL-terminated and outlive the program; no headers.
    let r = unsafe {
        (api.create_program)(
            &mut prog,
            text.as_ptr(),
            file.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != 0 {
        // SAFETY: returns a static NUL-terminated string for any code.
        let what = unsafe { c_text((api.get_error_string)(r)) };
        return Err(fail(format!("hiprtcCreateProgram: {what}")));
    }
    let out = (|| {
        // SAFETY: prog is live; ptrs holds opts.len() valid C strings that outlive the call.
        let r = unsafe { (api.compile_program)(prog, ptrs.len() as i32, ptrs.as_ptr()) };
        let log = program_log(api, prog);
        if r != 0 {
            // SAFETY: returns a static NUL-terminated string for any code.
            let what = unsafe { c_text((api.get_error_string)(r)) };
            return Err(fail(format!("{what}\n{log}")));
        }
        let mut size = 0usize;
        // SAFETY: prog compiled; size is a valid out-pointer.
        let r = unsafe { (api.get_code_size)(prog, &mut size) };
        if r != 0 || size == 0 {
            return Err(fail(format!(
                "hiprtcGetCodeSize: code {r}, {size} bytes\n{log}"
            )));
        }
        let mut code = vec![0u8; size];
        // SAFETY: code holds exactly the `size` bytes hiprtc asked for.
        let r = unsafe { (api.get_code)(prog, code.as_mut_ptr() as *mut c_char) };
        if r != 0 {
            return Err(fail(format!("hiprtcGetCode: code {r}")));
        }
        if !code_object_is_complete(&code, src) {
            return Err(fail(format!(
                "the code object lacks some of the module's kernels\n{log}"
            )));
        }
        match code_object_wave(&code) {
            Some(w) if w != wave => Err(fail(format!(
                "the code object runs wave{w}, the source was told ST_WARP={wave}"
            ))),
            _ => Ok(code),
        }
    })();
    // SAFETY: prog is live and not used after this.
    let _ = unsafe { (api.destroy_program)(&mut prog) };
    out
}

fn program_log(api: &ffi::RtcApi, prog: Program) -> String {
    let mut n = 0usize;
    // SAFETY: prog is live; n is a valid out-pointer.
    if unsafe { (api.get_program_log_size)(prog, &mut n) } != 0 || n == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; n];
    // SAFETY: buf holds the n bytes hiprtc asked for.
    if unsafe { (api.get_program_log)(prog, buf.as_mut_ptr() as *mut c_char) } != 0 {
        return String::new();
    }
    ffi::buffer_text(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_with_features_and_generation() {
        let t = GfxTarget::parse("gfx1201").unwrap();
        assert_eq!(
            (t.major(), t.default_wave(), t.id()),
            (12, 32, "gfx1201".into())
        );
        let c = GfxTarget::parse("gfx90a:sramecc+:xnack-\n").unwrap();
        assert_eq!(c.processor, "gfx90a");
        assert_eq!(c.features, ["sramecc+", "xnack-"]);
        assert_eq!((c.major(), c.default_wave()), (9, 64));
        assert_eq!(c.id(), "gfx90a:sramecc+:xnack-");
        assert_eq!(c.file_part(), "gfx90a_sramecc+_xnack-");
        assert_eq!(GfxTarget::parse("gfx1100").unwrap().major(), 11);
        assert_eq!(GfxTarget::parse("gfx942").unwrap().major(), 9);
        for bad in [
            "",
            "sm_90",
            "gfx",
            "gfx12",
            "gfx1201:xnack",
            "gfxzz01",
            "gfx1201:",
        ] {
            assert!(GfxTarget::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn options_carry_the_target_and_wave() {
        let r = GfxTarget::parse("gfx1201").unwrap();
        let o = options(&r, 32).unwrap();
        assert!(o.contains(&"--offload-arch=gfx1201".into()), "{o:?}");
        assert!(o.contains(&"-DST_WARP=32".into()));
        assert!(!o.iter().any(|x| x == "-mwavefrontsize64"));
        let o = options(&r, 64).unwrap();
        assert!(o.contains(&"-DST_WARP=64".into()) && o.contains(&"-mwavefrontsize64".into()));
        let c = GfxTarget::parse("gfx942:xnack-").unwrap();
        let o = options(&c, 64).unwrap();
        assert!(o.contains(&"--offload-arch=gfx942:xnack-".into()));
        assert!(!o.iter().any(|x| x == "-mwavefrontsize64"), "{o:?}");
        let e = options(&c, 32).unwrap_err().to_string();
        assert!(e.contains("gfx942") && e.contains("wave64"), "{e}");
        assert!(options(&r, 16).is_err());
    }

    #[test]
    fn cache_names_key_on_hash_target_wave_and_compiler() {
        let src = &strata_kernels::all()[0];
        let t = GfxTarget::parse("gfx1201").unwrap();
        let a = cache_file_name(src, &t, 32, "hiprtc7.2");
        assert_eq!(
            a,
            format!("{}-{}-gfx1201-w32-hiprtc7.2.co", src.name, &src.hash[..16])
        );
        assert_ne!(a, cache_file_name(src, &t, 64, "hiprtc7.2"));
        assert_ne!(a, cache_file_name(src, &t, 32, "hiprtc7.1"));
        let x = GfxTarget::parse("gfx1201:xnack+").unwrap();
        assert_ne!(a, cache_file_name(src, &x, 32, "hiprtc7.2"));
        assert_ne!(
            a,
            cache_file_name(&strata_kernels::all()[1], &t, 32, "hiprtc7.2")
        );
    }

    #[test]
    fn the_library_version_is_read_from_the_process_maps() {
        let maps = "7f0-7f1 r--p 0 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n\
                    7f2-7f3 r-xp 0 08:01 13 /usr/lib/x86_64-linux-gnu/libhiprtc.so.7.2.53211\n";
        assert_eq!(
            mapped_version(maps, "libhiprtc.so."),
            Some("7.2.53211".into())
        );
        assert_eq!(
            mapped_version("7f0-7f1 r--p 0 08:01 12 [heap]\n", "libhiprtc.so."),
            None
        );
    }

    #[test]
    fn only_complete_amdgpu_objects_are_taken_from_the_cache() {
        let src = strata_kernels::by_name("norm").unwrap();
        let mut code = b"\x7fELF".to_vec();
        code.resize(100, 0);
        assert!(!code_object_is_complete(&code, src), "no kernels in it");
        for e in src.entry_points {
            code.extend_from_slice(format!("{e}.kd\0").as_bytes());
        }
        assert!(code_object_is_complete(&code, src));
        assert!(!code_object_is_complete(b"garbage", src));
        let gemm = strata_kernels::by_name("gemm").unwrap();
        let mut empty = b"\x7fELF".to_vec();
        empty.resize(100, 0);
        assert!(
            code_object_is_complete(&empty, gemm),
            "CUDA-only: no kernels on HIP"
        );
    }

    #[test]
    fn the_wave_size_is_read_from_kernel_metadata() {
        let mut code = b"\x7fELF....".to_vec();
        code.extend_from_slice(b".wavefront_size\x20.workgroup");
        assert_eq!(code_object_wave(&code), Some(32));
        let w64 = b"x.wavefront_size\x40".to_vec();
        assert_eq!(code_object_wave(&w64), Some(64));
        assert_eq!(code_object_wave(b"no metadata"), None);
    }

    #[test]
    fn a_damaged_cache_entry_is_recompiled_not_loaded() {
        // With no hiprtc here the recompile fails, which proves the entry was not taken.
        let dir = tempfile::tempdir().unwrap();
        let src = strata_kernels::by_name("norm").unwrap();
        let t = GfxTarget::parse("gfx1201").unwrap();
        let name = cache_file_name(src, &t, 32, "hiprtc0.0");
        std::fs::write(dir.path().join(&name), b"\x7fELF truncated").unwrap();
        match load_or_compile(src, &t, 32, "hiprtc0.0", Some(dir.path())) {
            Ok((code, cached)) => {
                assert!(!cached, "a damaged entry was loaded");
                assert!(code_object_is_complete(&code, src));
            }
            Err(e) => assert!(
                matches!(e, HipError::Library(_) | HipError::Compile { .. }),
                "{e}"
            ),
        }
    }
}
