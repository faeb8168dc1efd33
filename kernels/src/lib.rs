//! strata-kernels: the GPU kernel sources (`cuda/*.cu`, one file per op family, one source for
//! CUDA and HIP with the vendor specifics behind `common.cuh`'s macros), embedded for run-time
//! compilation, with the constants they share with their launchers (`consts`).
//! Invariant: each `KernelSource` is self-contained (the generated constants, the common
//! header and the module's shared headers are prepended, no `#include` is resolved at run
//! time) and its `hash` covers exactly the text compiled, so an on-disk cache keyed by it can
//! never serve a stale binary.

pub mod consts;
pub mod wave;

use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// The vendor layer every source is compiled with, prepended to each module's text.
pub const COMMON: &str = include_str!("../cuda/common.cuh");

/// What the product kernels share (`matvec`, `moe`): weight layouts, row dot products, staged
/// inputs.
pub const PRODUCTS: &str = include_str!("../cuda/products.cuh");

/// One compilation unit: a module name, its full source and the kernels it defines.
#[derive(Debug, Clone)]
pub struct KernelSource {
    /// Module name (the `.cu` file stem), used in cache file names and error messages.
    pub name: &'static str,
    /// The full text handed to NVRTC / hiprtc: the generated constants, `COMMON`, the
    /// module's shared headers, then its body.
    pub source: String,
    /// The `extern "C"` entry points the module defines.
    pub entry_points: &'static [&'static str],
    /// Hex SHA-256 of `source` (the cache key's source part).
    pub hash: String,
    /// The module is tensor-core PTX (`mma.sync`, `cp.async`) with no HIP counterpart: its
    /// whole body sits under `#ifdef ST_CUDA`, so hiprtc compiles it to no kernels, and a HIP
    /// engine uses the portable kernels instead (the matrix-vector products for prefill,
    /// `dq_attn_prefill` for prefill attention), as the CUDA engine does with its GEMM off.
    pub cuda_only: bool,
}

struct Raw {
    name: &'static str,
    /// Shared headers prepended after `COMMON`.
    headers: &'static [&'static str],
    body: &'static str,
    entry_points: &'static [&'static str],
    /// The entry points that wait for the kernel ahead before touching activations (see
    /// [`pdl_aware`]).
    pdl_aware: &'static [&'static str],
    cuda_only: bool,
}

const RAW: &[Raw] = &[
    Raw {
        name: "norm",
        headers: &[],
        body: include_str!("../cuda/norm.cu"),
        entry_points: &["rmsnorm_f32", "qk_norm_rope_f32"],
        pdl_aware: &["rmsnorm_f32", "qk_norm_rope_f32"],
        cuda_only: false,
    },
    Raw {
        name: "matvec",
        headers: &[PRODUCTS],
        body: include_str!("../cuda/matvec.cu"),
        entry_points: MATVEC,
        pdl_aware: MATVEC,
        cuda_only: false,
    },
    Raw {
        name: "moe",
        headers: &[PRODUCTS],
        body: include_str!("../cuda/moe.cu"),
        entry_points: MOE,
        pdl_aware: MOE,
        cuda_only: false,
    },
    Raw {
        name: "attention",
        headers: &[],
        body: include_str!("../cuda/attention.cu"),
        entry_points: ATTENTION,
        pdl_aware: ATTENTION,
        cuda_only: false,
    },
    Raw {
        name: "sample",
        headers: &[],
        body: include_str!("../cuda/sample.cu"),
        entry_points: &["sample_rows", "dq_argmax_rows"],
        pdl_aware: &["dq_argmax_rows"],
        cuda_only: false,
    },
    Raw {
        name: "profile",
        headers: &[],
        body: include_str!("../cuda/profile.cu"),
        entry_points: &["dq_spin"],
        pdl_aware: &[],
        cuda_only: false,
    },
    Raw {
        name: "gemm",
        headers: &[],
        body: include_str!("../cuda/gemm.cu"),
        entry_points: &[
            "gemm_q8_0_m64",
            "gemm_q8_0_m128",
            "gemm_bf16_m64",
            "gemm_bf16_m128",
            "gemm_q8_0_m128w",
            "gemm_bf16_m128w",
            "moe_gemm_q8_0_m64",
            "moe_gemm_q8_0_m128",
            "moe_gemm_bf16_m64",
            "moe_gemm_bf16_m128",
            "moe_gemm_q8_0_m128w",
            "moe_gemm_bf16_m128w",
            "moe_gemm_glu_q8_0_m64",
            "moe_gemm_glu_bf16_m64",
            "gemm_q4_k_m64",
            "gemm_q4_k_m128",
            "gemm_q4_k_m128w",
            "moe_gemm_q4_k_m64",
            "moe_gemm_q4_k_m128",
            "moe_gemm_q4_k_m128w",
            "moe_gemm_glu_q4_k_m64",
            "gemm_cvt_x",
            "moe_sort",
        ],
        pdl_aware: &[],
        cuda_only: true,
    },
    Raw {
        name: "flash",
        headers: &[],
        body: include_str!("../cuda/flash.cu"),
        entry_points: &["fa_prefill"],
        pdl_aware: &[],
        cuda_only: true,
    },
];

const MATVEC: &[&str] = &[
    "dq_mv1",
    "dq_mv8",
    "dq_qkv1",
    "dq_qkv8",
    "dq_get_rows",
    "dq_sgemm_split",
    "dq_split_sum",
];
const MOE: &[&str] = &[
    "dq_moe_gate_up",
    "dq_moe_down",
    "dq_moe_down_rows",
    "dq_router_rows",
    "dq_moe_combine",
    "dq_router_topk",
    "router_softmax_topk",
];
const ATTENTION: &[&str] = &[
    "dq_kv_store",
    "dq_rope_store",
    "dq_attn_gqa",
    "dq_attn_combine",
    "dq_attn_fused",
    "dq_ctx_from_pos",
    "dq_attn_prefill",
];

/// Hex SHA-256 of a text.
pub fn source_hash(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every kernel module, in a fixed order.
pub fn all() -> &'static [KernelSource] {
    static ALL: OnceLock<Vec<KernelSource>> = OnceLock::new();
    ALL.get_or_init(|| {
        RAW.iter()
            .map(|r| {
                let mut source = consts::prelude();
                source.push_str(COMMON);
                for h in r.headers {
                    source.push_str(h);
                }
                source.push_str(&format!("\n// ---- {}.cu ----\n{}", r.name, r.body));
                let hash = source_hash(&source);
                KernelSource {
                    name: r.name,
                    source,
                    entry_points: r.entry_points,
                    hash,
                    cuda_only: r.cuda_only,
                }
            })
            .collect()
    })
}

/// The module named `name`, if any.
pub fn by_name(name: &str) -> Option<&'static KernelSource> {
    all().iter().find(|k| k.name == name)
}

/// The module defining the kernel `entry`, if any.
pub fn module_of(entry: &str) -> Option<&'static KernelSource> {
    all().iter().find(|k| k.entry_points.contains(&entry))
}

/// Whether kernel `entry` may be launched with programmatic dependent launch: it calls
/// `st_pdl_wait()` (common.cuh) on every path before touching anything but weights (each
/// module lists them; the test below checks each one's body).
pub fn pdl_aware(entry: &str) -> bool {
    RAW.iter().any(|r| r.pdl_aware.contains(&entry))
}

/// CUDA-only constructs (inline PTX and CUDA intrinsics hiprtc lacks) that portable code
/// must reach through `common.cuh`'s macros or keep under `#ifdef ST_CUDA`.
pub const CUDA_ONLY_TOKENS: &[&str] = &[
    "asm(",
    "asm volatile",
    "__shfl_sync",
    "__shfl_xor_sync",
    "__ldcg(",
    "__syncwarp",
    "__byte_perm",
    "__nv_",
    "%globaltimer",
];

/// Lines (1-based) of `text` that use a `CUDA_ONLY_TOKENS` entry outside a region only CUDA
/// compiles: `#ifdef ST_CUDA` / `#if defined(ST_CUDA) ...`, or the `#else` of the vendor
/// switch `#if defined(__HIPCC__) ...`. Comments are skipped.
pub fn unguarded_cuda_only(text: &str) -> Vec<(usize, &'static str)> {
    // Per open #if: whether its current branch is CUDA-only, and whether its #else would be.
    let mut stack: Vec<(bool, bool)> = Vec::new();
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if let Some(d) = t.strip_prefix('#') {
            let d = d.trim_start();
            if d.starts_with("ifdef ST_CUDA") || d.starts_with("if defined(ST_CUDA)") {
                stack.push((true, false));
            } else if d.starts_with("if defined(__HIPCC__)") || d.starts_with("ifdef ST_HIP") {
                stack.push((false, true));
            } else if d.starts_with("if") {
                stack.push((false, false));
            } else if d.starts_with("else") {
                if let Some(top) = stack.last_mut() {
                    *top = (top.1, top.0);
                }
            } else if d.starts_with("endif") {
                stack.pop();
            }
            continue;
        }
        let code = t.split("//").next().unwrap_or("");
        if stack.iter().any(|s| s.0) {
            continue;
        }
        for tok in CUDA_ONLY_TOKENS {
            if code.contains(tok) {
                out.push((i + 1, *tok));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_only_code_is_guarded_in_every_module() {
        for k in all() {
            let bad = unguarded_cuda_only(&k.source);
            assert!(
                bad.is_empty(),
                "module `{}` uses CUDA-only code hiprtc cannot compile outside #ifdef ST_CUDA \
                 (use common.cuh's st_/ST_ macros or guard it), at source lines {bad:?}",
                k.name
            );
        }
        // The scanner itself: guarded, vendor-switch else, and unguarded uses.
        let t = "#ifdef ST_CUDA\nasm(\"x\");\n#else\nint a;\n#endif\n__ldcg(p);\n";
        assert_eq!(unguarded_cuda_only(t), vec![(6, "__ldcg(")]);
        let v =
            "#if defined(__HIPCC__)\n__shfl_xor(v, 1);\n#else\n__shfl_xor_sync(m, v, 1);\n#endif\n";
        assert!(unguarded_cuda_only(v).is_empty());
        assert_eq!(
            unguarded_cuda_only("#if X\n#else\n__syncwarp(); // asm(\n#endif\n"),
            vec![(3, "__syncwarp")]
        );
    }

    #[test]
    fn cuda_only_modules_are_wholly_guarded() {
        for k in all().iter().filter(|k| k.cuda_only) {
            let body = k
                .source
                .split(&format!("// ---- {}.cu ----", k.name))
                .nth(1)
                .unwrap();
            let first = body
                .lines()
                .find(|l| l.starts_with('#'))
                .unwrap_or_default();
            assert_eq!(first, "#ifdef ST_CUDA", "{}", k.name);
            let last = body.lines().rev().find(|l| !l.trim().is_empty()).unwrap();
            assert!(last.starts_with("#endif"), "{}: {last}", k.name);
        }
        let names: Vec<_> = all()
            .iter()
            .filter(|k| k.cuda_only)
            .map(|k| k.name)
            .collect();
        assert_eq!(names, ["gemm", "flash"]);
    }

    /// The text of kernel `e`'s body in `src`: from its declaration to the next kernel's.
    fn body<'a>(src: &'a str, e: &str) -> &'a str {
        let start = src.find(&format!("ST_KERNEL void {e}(")).unwrap();
        let rest = &src[start + 10..];
        let end = rest.find("ST_KERNEL void ").map_or(rest.len(), |i| i);
        &rest[..end]
    }

    /// Whether a kernel body waits: itself, or through the `dq_*_body` template it calls.
    fn waits(src: &str, b: &str) -> bool {
        if b.contains("st_pdl_enter()") || b.contains("st_pdl_wait()") {
            return true;
        }
        let Some(i) = b.find("_body<") else {
            return false;
        };
        let name_start = b[..i]
            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap()
            + 1;
        let helper = &b[name_start..i + 5];
        let def = src.find(&format!("void {helper}(")).unwrap();
        let end = src[def..].find("\n}\n").unwrap();
        let hb = &src[def..def + end];
        hb.contains("st_pdl_enter()") || hb.contains("st_pdl_wait()")
    }

    #[test]
    fn every_pdl_aware_kernel_waits_for_the_kernel_ahead() {
        let mut aware = 0;
        for k in all() {
            for e in k.entry_points {
                let b = body(&k.source, e);
                if pdl_aware(e) {
                    aware += 1;
                    // The wait comes before the body's first statement that could read
                    // activations: it is one of the first calls, after at most a prefetch.
                    assert!(
                        waits(&k.source, b),
                        "{e} is launched with PDL but never waits"
                    );
                } else {
                    assert!(
                        !b.contains("st_pdl_"),
                        "{e} waits but is not listed as PDL-aware"
                    );
                }
            }
        }
        assert!(aware >= 20, "{aware} PDL-aware kernels");
        assert!(pdl_aware("dq_qkv1") && pdl_aware("rmsnorm_f32"));
        assert!(!pdl_aware("dq_spin") && !pdl_aware("fa_prefill") && !pdl_aware("nope"));
    }

    #[test]
    fn every_entry_point_is_defined_once_in_its_source() {
        let mut seen = Vec::new();
        for k in all() {
            assert!(
                k.source.starts_with(&consts::prelude()) && k.source.contains(COMMON),
                "{} lacks the generated constants or the common header",
                k.name
            );
            for e in k.entry_points {
                let decl = format!("ST_KERNEL void {e}(");
                assert_eq!(k.source.matches(&decl).count(), 1, "{e} in {}", k.name);
                assert!(!seen.contains(e), "{e} defined twice");
                seen.push(*e);
            }
            // Every kernel the text declares is listed.
            assert_eq!(
                k.source.matches("ST_KERNEL void ").count(),
                k.entry_points.len(),
                "{} declares kernels it does not list",
                k.name
            );
        }
        assert_eq!(module_of("dq_mv1").map(|k| k.name), Some("matvec"));
        assert!(module_of("nope").is_none());
    }

    /// No kernel source defines a shared constant itself: each comes from `consts` only.
    #[test]
    fn shared_constants_are_defined_once_in_rust() {
        let texts: Vec<&str> = RAW
            .iter()
            .map(|r| r.body)
            .chain([COMMON, PRODUCTS])
            .collect();
        for (name, _) in consts::all() {
            for t in &texts {
                assert!(
                    !t.contains(&format!("#define {name} ")),
                    "{name} is defined in a kernel source; it comes from consts.rs"
                );
            }
        }
        assert!(consts::prelude().contains("#define GM_BN 64"));
    }

    #[test]
    fn hashes_are_stable_hex_and_distinct() {
        let a = all();
        for k in a {
            assert_eq!(k.hash.len(), 64);
            assert_eq!(k.hash, source_hash(&k.source));
        }
        assert_ne!(a[0].hash, a[1].hash);
        assert_eq!(
            source_hash("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(by_name("norm").is_some());
    }
}
