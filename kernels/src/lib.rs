//! strata-kernels: the GPU kernel sources (`cuda/*.cu`, one source for CUDA and HIP with the
//! vendor specifics behind `common.cuh`'s macros), embedded for run-time compilation.
//! Invariant: each `KernelSource` is self-contained (the common header is prepended, no
//! `#include` is resolved at run time) and its `hash` covers exactly the text compiled, so an
//! on-disk cache keyed by it can never serve a stale binary.

use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// The vendor layer every source is compiled with, prepended to each module's text.
pub const COMMON: &str = include_str!("../cuda/common.cuh");

/// One compilation unit: a module name, its full source and the kernels it defines.
#[derive(Debug, Clone)]
pub struct KernelSource {
    /// Module name (the `.cu` file stem), used in cache file names and error messages.
    pub name: &'static str,
    /// The full text handed to NVRTC / hiprtc: `COMMON` followed by the module body.
    pub source: String,
    /// The `extern "C"` entry points the module defines.
    pub entry_points: &'static [&'static str],
    /// Hex SHA-256 of `source` (the cache key's source part).
    pub hash: String,
}

struct Raw {
    name: &'static str,
    body: &'static str,
    entry_points: &'static [&'static str],
}

const RAW: &[Raw] = &[
    Raw {
        name: "norm",
        body: include_str!("../cuda/norm.cu"),
        entry_points: &["rmsnorm_f32", "qk_norm_rope_f32"],
    },
    Raw {
        name: "elementwise",
        body: include_str!("../cuda/elementwise.cu"),
        entry_points: &["swiglu_f32", "get_rows", "argmax_f32"],
    },
    Raw {
        name: "matvec",
        body: include_str!("../cuda/matvec.cu"),
        entry_points: &["mv_q8_0", "mv_q4_k", "mv_plain"],
    },
    Raw {
        name: "router",
        body: include_str!("../cuda/router.cu"),
        entry_points: &["router_softmax_topk"],
    },
    Raw {
        name: "decode",
        body: include_str!("../cuda/decode.cu"),
        entry_points: &[
            "dq_mv1",
            "dq_mv8",
            "dq_qkv1",
            "dq_qkv8",
            "dq_moe_gate_up",
            "dq_moe_down",
            "dq_get_rows",
            "dq_kv_store",
            "dq_rope_store",
            "dq_attn_gqa",
            "dq_attn_combine",
            "dq_attn_fused",
            "dq_argmax_rows",
            "dq_ctx_from_pos",
            "dq_attn_prefill",
            "dq_moe_combine",
            "dq_router_topk",
            "dq_spin",
            "dq_moe_down_rows",
            "dq_router_rows",
            "dq_sgemm_split",
            "dq_split_sum",
        ],
    },
    Raw {
        name: "gemm",
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
    },
    Raw {
        name: "sample",
        body: include_str!("../cuda/sample.cu"),
        entry_points: &["sample_rows"],
    },
    Raw {
        name: "dequant",
        body: concat!(
            include_str!("../cuda/quant_tables.cuh"),
            include_str!("../cuda/quants.cuh"),
            include_str!("../cuda/dequant.cu")
        ),
        entry_points: &["dequant_rows", "mv_any"],
    },
    Raw {
        name: "flash",
        body: include_str!("../cuda/flash.cu"),
        entry_points: &["fa_prefill"],
    },
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
                let source = format!("{COMMON}\n// ---- {}.cu ----\n{}", r.name, r.body);
                let hash = source_hash(&source);
                KernelSource {
                    name: r.name,
                    source,
                    entry_points: r.entry_points,
                    hash,
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
/// `st_pdl_wait()` (common.cuh) on every path before touching anything but weights. That is
/// every entry point of the `norm`, `router` and `decode` modules but the profiler's spin
/// kernel (the test below checks each one's body).
pub fn pdl_aware(entry: &str) -> bool {
    entry != "dq_spin"
        && module_of(entry).is_some_and(|m| matches!(m.name, "norm" | "router" | "decode"))
}

#[cfg(test)]
mod tests {
    use super::*;

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
                k.source.starts_with(COMMON),
                "{} lacks the common header",
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
        assert_eq!(module_of("mv_q4_k").map(|k| k.name), Some("matvec"));
        assert!(module_of("nope").is_none());
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
