//! Requantize a GGUF: every tensor llama.cpp would quantize (2-D+ `*.weight` matrices but
//! norms, the MoE router and `ssm_conv1d`) is dequantized by the CPU reference and quantized
//! to the target type (one type, like `llama-quantize --pure`, or a preset's per-tensor mix);
//! everything else, and any tensor already of its target type, is copied byte for byte.
//! Metadata is kept (split keys dropped; `general.file_type` and the quantization version
//! set); the output is written through the GGUF writer (`.partial`, then renamed).
//! Invariant: every target type is checked to have a quantizer, and every source type to have
//! a decoder, before the output file is created.

use super::metadata::file_type;
use super::model::{inventory_from_gguf, GgufModelError};
use super::read::read_gguf;
use super::write::{GgufWriteError, GgufWriter, ProgressFn, WriteSummary};
use super::{GgufError, GgufFile, GgufTensorInfo};
use crate::arch::{self, classify, fallback, QuantRecipe};
use crate::ggml::GgmlType;
use crate::inventory::TensorInfo;
use crate::quant::{self, QuantError};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// What to quantize to.
#[derive(Debug, Clone)]
pub enum QuantTarget {
    /// Every quantizable tensor to this type (llama.cpp's fallback where a row does not fit).
    Type(GgmlType),
    /// A preset's per-tensor mix (see [`QuantRecipe::preset`]); the model's architecture must
    /// be one Strata knows.
    Preset(QuantRecipe),
}

/// Everything `quantize_gguf` can report.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(transparent)]
    Read(#[from] GgufError),
    #[error(transparent)]
    Model(#[from] GgufModelError),
    #[error(transparent)]
    Write(Box<GgufWriteError>),
    #[error("{file}: {problem}")]
    Refused { file: String, problem: String },
    #[error("{file}: tensor '{name}': {source}")]
    Tensor {
        file: String,
        name: String,
        #[source]
        source: QuantError,
    },
    #[error("{file}: cannot map it ({source}); check the path and permissions")]
    Map {
        file: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<GgufWriteError> for QuantizeError {
    fn from(e: GgufWriteError) -> Self {
        Self::Write(Box::new(e))
    }
}

/// What was done, for the caller's report.
#[derive(Debug)]
pub struct QuantizeReport {
    pub summary: WriteSummary,
    /// Tensors per output type.
    pub types: BTreeMap<GgmlType, usize>,
    /// Tensors dequantized and quantized again.
    pub requantized: usize,
    /// Tensors copied unchanged.
    pub copied: usize,
}

/// llama.cpp's `tensor_allows_quantization` for the tensors of our architectures.
pub fn allows_quantization(t: &GgufTensorInfo) -> bool {
    let n_dims = t.dims.iter().rposition(|d| *d != 1).map_or(1, |p| p + 1);
    n_dims >= 2
        && t.name.ends_with("weight")
        && !t.name.contains("_norm.weight")
        && !t.name.contains("ffn_gate_inp.weight")
        && !t.name.contains("ssm_conv1d")
}

/// The output type of every tensor of `g`, in file order.
fn plan_types(g: &GgufFile, target: &QuantTarget) -> Result<Vec<GgmlType>, QuantizeError> {
    let by_name: HashMap<String, GgmlType> = match target {
        QuantTarget::Type(_) => HashMap::new(),
        QuantTarget::Preset(r) => {
            let inv = inventory_from_gguf(g)?;
            let want = arch::expected_tensors(&inv.arch, &inv.hparams, r).map_err(|e| {
                QuantizeError::Refused {
                    file: g.path.clone(),
                    problem: e.to_string(),
                }
            })?;
            want.into_iter().map(|t| (t.name, t.ggml_type)).collect()
        }
    };
    Ok(g.tensors
        .iter()
        .map(|t| {
            if !allows_quantization(t) {
                return t.ggml_type;
            }
            let ne0 = t.dims[0];
            match target {
                QuantTarget::Type(ty) => fallback(*ty, ne0),
                QuantTarget::Preset(r) => by_name
                    .get(&t.name)
                    .copied()
                    .unwrap_or_else(|| fallback(r.default, ne0)),
            }
        })
        .collect())
}

/// Options of [`quantize_gguf`].
#[derive(Default)]
pub struct QuantizeOptions {
    /// Worker threads (0: the machine's available parallelism).
    pub threads: usize,
    /// Progress callback (bytes written, total).
    pub progress: Option<ProgressFn>,
}

/// Requantize `input` (any GGUF Strata reads, split or not) into `output` (see the module
/// docs). `--type`-style targets quantize every quantizable tensor; preset targets follow the
/// preset's llama.cpp rules for the file's architecture and shapes.
pub fn quantize_gguf(
    input: &Path,
    output: &Path,
    target: &QuantTarget,
    mut opts: QuantizeOptions,
) -> Result<QuantizeReport, QuantizeError> {
    let g = read_gguf(input)?;
    let in_file = g.path.clone();
    let types = plan_types(&g, target)?;
    let mut need = Vec::new();
    for (t, ty) in g.tensors.iter().zip(&types) {
        if *ty == t.ggml_type {
            continue;
        }
        if !quant::can_quantize(*ty) {
            need.push(format!("'{}' -> {ty}", t.name));
        } else if !quant::is_supported(t.ggml_type) {
            return Err(QuantizeError::Tensor {
                file: in_file,
                name: t.name.clone(),
                source: QuantError::Unsupported { ty: t.ggml_type },
            });
        }
    }
    if !need.is_empty() {
        let names: Vec<_> = quant::QUANTIZABLE.iter().map(|t| t.name()).collect();
        return Err(QuantizeError::Refused {
            file: output.display().to_string(),
            problem: format!(
                "{} tensor(s) would need a type without a quantizer here ({}{}); quantizable types: {}",
                need.len(),
                need[..need.len().min(3)].join(", "),
                if need.len() > 3 { ", ..." } else { "" },
                names.join(", ")
            ),
        });
    }
    // Map every part before creating the output.
    let mut maps = Vec::with_capacity(g.parts.len());
    for p in &g.parts {
        let f = std::fs::File::open(&p.path).map_err(|source| QuantizeError::Map {
            file: p.path.clone(),
            source,
        })?;
        // SAFETY: the map is read-only and lives until this function returns; a concurrent
        // writer truncating the input is the one hazard, as for every mmapped model reader.
        let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|source| QuantizeError::Map {
            file: p.path.clone(),
            source,
        })?;
        maps.push(m);
    }
    let mut w = GgufWriter::new(output);
    for (k, v) in &g.metadata {
        if k.starts_with("split.")
            || k == "general.file_type"
            || k == "general.quantization_version"
        {
            continue;
        }
        w.kv(k, v.clone())?;
    }
    let infos: Vec<TensorInfo> = g
        .tensors
        .iter()
        .zip(&types)
        .filter_map(|(t, ty)| {
            let (role, layer) = classify(&t.name);
            TensorInfo::new(t.name.clone(), t.dims.clone(), *ty, role, layer).ok()
        })
        .collect();
    let label = match target {
        QuantTarget::Type(t) => t.name().to_string(),
        QuantTarget::Preset(r) => r.preset.clone(),
    };
    w.kv(
        "general.file_type",
        super::GgufValue::U32(file_type(&label, &infos)),
    )?;
    w.kv("general.quantization_version", super::GgufValue::U32(2))?;
    for (t, ty) in g.tensors.iter().zip(&types) {
        w.tensor_info(&t.name, &t.dims, *ty)?;
    }
    if let Some(p) = opts.progress.take() {
        w.on_progress(p);
    }
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let mut s = w.begin()?;
    let (mut by_type, mut requantized, mut copied) = (BTreeMap::new(), 0, 0);
    let mut out = Vec::new();
    for (t, ty) in g.tensors.iter().zip(&types) {
        *by_type.entry(*ty).or_default() += 1;
        let at = g.tensor_file_offset(t).unwrap_or(0) as usize;
        let src = maps[t.part as usize]
            .get(at..at + t.bytes as usize)
            .ok_or_else(|| QuantizeError::Refused {
                file: g.parts[t.part as usize].path.clone(),
                problem: format!("tensor '{}' lies past the end of the file", t.name),
            })?;
        if *ty == t.ggml_type {
            s.data(src)?;
            copied += 1;
            continue;
        }
        let tensor_err = |source| QuantizeError::Tensor {
            file: in_file.clone(),
            name: t.name.clone(),
            source,
        };
        let ne0 = t.dims[0] as usize;
        let rows = (t.n_elements() / t.dims[0]) as usize;
        let (rb_in, rb_out) = (
            quant::row_bytes(t.ggml_type, ne0).map_err(tensor_err)?,
            quant::row_bytes(*ty, ne0).map_err(tensor_err)?,
        );
        // Chunks of about 4M elements per thread bound memory whatever the tensor's size.
        let per_chunk = ((threads << 22) / ne0.max(1)).max(threads).max(1);
        let mut r0 = 0;
        while r0 < rows {
            let n = per_chunk.min(rows - r0);
            out.clear();
            out.resize(n * rb_out, 0);
            let input = &src[r0 * rb_in..(r0 + n) * rb_in];
            requantize_rows(t.ggml_type, *ty, ne0, input, &mut out, threads).map_err(tensor_err)?;
            s.data(&out)?;
            r0 += n;
        }
        requantized += 1;
    }
    Ok(QuantizeReport {
        summary: s.finish()?,
        types: by_type,
        requantized,
        copied,
    })
}

/// Dequantize `input` (rows of `from`) and quantize into `out` (rows of `to`), rows split
/// over `threads` scoped threads.
fn requantize_rows(
    from: GgmlType,
    to: GgmlType,
    ne0: usize,
    input: &[u8],
    out: &mut [u8],
    threads: usize,
) -> Result<(), QuantError> {
    let (rb_in, rb_out) = (quant::row_bytes(from, ne0)?, quant::row_bytes(to, ne0)?);
    let rows = input.len() / rb_in.max(1);
    let per = rows.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|sc| {
        let handles: Vec<_> = input
            .chunks(per * rb_in)
            .zip(out.chunks_mut(per * rb_out))
            .map(|(src, dst)| {
                sc.spawn(move || -> Result<(), QuantError> {
                    let mut x = vec![0f32; ne0];
                    for (r, o) in src.chunks_exact(rb_in).zip(dst.chunks_exact_mut(rb_out)) {
                        quant::dequantize_row(from, r, &mut x)?;
                        quant::quantize_row_into(to, &x, o)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or(Err(QuantError::Unsupported { ty: to })))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::random::{write_random_model, RandomOptions};
    use crate::gguf::testutil::{q4k_shapes, small_moe, small_next, tensor_f32, tmp};

    /// Relative RMS difference of two tensors.
    fn rel_rms(a: &[f32], b: &[f32]) -> f32 {
        let se: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
        let sa: f32 = a.iter().map(|x| x * x).sum();
        (se / sa.max(1e-30)).sqrt()
    }

    #[test]
    fn quantized_models_stay_within_each_types_tolerance() {
        let d = tmp();
        for (arch, small) in [("qwen3moe", small_moe()), ("qwen3next", small_next())] {
            let hp = q4k_shapes(small);
            let src = d.path().join(format!("{arch}-f32.gguf"));
            let r = QuantRecipe::preset("F32").unwrap();
            write_random_model(&src, arch, &hp, &r, 5, RandomOptions::default()).unwrap();
            let g = read_gguf(&src).unwrap();
            // Tolerances: relative RMS error of each type's round trip (see quant's tests).
            for (ty, tol) in [
                (GgmlType::Q8_0, 0.008),
                (GgmlType::Q6K, 0.025),
                (GgmlType::Q4K, 0.1),
            ] {
                let out = d.path().join(format!("{arch}-{ty}.gguf"));
                let rep = quantize_gguf(
                    &src,
                    &out,
                    &QuantTarget::Type(ty),
                    QuantizeOptions::default(),
                )
                .unwrap();
                assert!(rep.requantized > 0 && rep.copied > 0, "{rep:?}");
                let q = read_gguf(&out).unwrap();
                assert_eq!(q.tensors.len(), g.tensors.len());
                for (a, b) in g.tensors.iter().zip(&q.tensors) {
                    assert_eq!((&a.name, &a.dims), (&b.name, &b.dims));
                    let want_ty = if allows_quantization(a) {
                        ty
                    } else {
                        GgmlType::F32
                    };
                    assert_eq!(b.ggml_type, want_ty, "{}", a.name);
                    let (x, y) = (tensor_f32(&src, &a.name), tensor_f32(&out, &b.name));
                    if want_ty == GgmlType::F32 {
                        assert_eq!(x, y, "{} copied unchanged", a.name);
                    } else {
                        let e = rel_rms(&x, &y);
                        assert!(e <= tol, "{arch} {ty} {}: relative error {e}", a.name);
                    }
                }
                // Metadata kept, file type set.
                assert_eq!(
                    q.get_str("general.architecture").unwrap(),
                    Some(arch),
                    "{arch}"
                );
                assert_eq!(
                    q.get_u64(&format!("{arch}.block_count")).unwrap(),
                    g.get_u64(&format!("{arch}.block_count")).unwrap()
                );
                let ft = q.get_u64("general.file_type").unwrap().unwrap();
                assert_eq!(ft, if ty == GgmlType::Q8_0 { 7 } else { ft });
                assert!(!out.with_extension("gguf.partial").exists());
            }
        }
    }

    #[test]
    fn presets_requantize_and_missing_quantizers_are_refused_up_front() {
        let d = tmp();
        let hp = q4k_shapes(small_moe());
        let src = d.path().join("q8.gguf");
        let r = QuantRecipe::preset("Q8_0").unwrap();
        write_random_model(&src, "qwen3moe", &hp, &r, 9, RandomOptions::default()).unwrap();
        let out = d.path().join("q4km.gguf");
        let p = QuantRecipe::preset("Q4_K_M").unwrap();
        quantize_gguf(
            &src,
            &out,
            &QuantTarget::Preset(p.clone()),
            QuantizeOptions::default(),
        )
        .unwrap();
        let want = arch::expected_tensors("qwen3moe", &hp, &p).unwrap();
        let q = read_gguf(&out).unwrap();
        for (a, b) in want.iter().zip(&q.tensors) {
            assert_eq!((&a.name, a.ggml_type), (&b.name, b.ggml_type));
        }
        assert_eq!(q.get_u64("general.file_type").unwrap(), Some(15));
        // IQ3_S has no quantizer: refused before anything is written.
        let bad = d.path().join("iq3s.gguf");
        let e = quantize_gguf(
            &src,
            &bad,
            &QuantTarget::Type(GgmlType::Iq3S),
            QuantizeOptions::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("quantizable types: F32"), "{e}");
        assert!(!bad.exists());
        assert!(!bad.with_extension("gguf.partial").exists());
    }
}
