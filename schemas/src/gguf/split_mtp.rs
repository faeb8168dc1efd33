//! Split a GGUF that holds its MTP block into the two files llama.cpp's converter writes for
//! the same checkpoint: the main model as `convert_hf_to_gguf.py --no-mtp` writes it
//! (`block_count = n_layer`, no `nextn_predict_layers`, per-layer arrays cut to `n_layer`, no
//! `blk.{n_layer}.*`) and the MTP-only file as `--mtp` writes it (every metadata key kept, the
//! MTP blocks' tensors plus `token_embd`, `output_norm` and `output`). `strata-gguf split-mtp`
//! is its command line; the tests make their two-file models with it.
//! Invariant: the input is checked as a whole model with an MTP block before either output is
//! created; tensor bytes are copied unchanged (same types, same order), each output through
//! the GGUF writer (`.partial`, then renamed).

use super::model::{inventory_from_gguf, GgufModelError};
use super::read::read_gguf;
use super::write::{GgufWriteError, GgufWriter, WriteSummary};
use super::{GgufArray, GgufFile, GgufTensorInfo, GgufValue};
use crate::inventory::TensorRole;
use std::path::Path;

/// Why a split failed; every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum SplitMtpError {
    #[error(transparent)]
    Model(#[from] GgufModelError),
    #[error(transparent)]
    Write(Box<GgufWriteError>),
    #[error("{file}: nextn_predict_layers is 0: the model has no MTP block to split off")]
    NoMtpBlock { file: String },
    #[error("{file}: cannot map it ({source}); check the path and permissions")]
    Map {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: tensor `{name}` lies past the end of the file: truncated download?")]
    Truncated { file: String, name: String },
}

impl From<GgufWriteError> for SplitMtpError {
    fn from(e: GgufWriteError) -> Self {
        Self::Write(Box::new(e))
    }
}

/// What was written: (main file, MTP-only file).
pub type SplitSummary = (WriteSummary, WriteSummary);

/// The first `n` elements of a per-layer array.
fn truncated(a: &GgufArray, n: usize) -> GgufArray {
    macro_rules! cut {
        ($($v:ident),*) => {
            match a {
                $(GgufArray::$v(x) => GgufArray::$v(x[..n.min(x.len())].to_vec()),)*
            }
        };
    }
    cut!(U8, I8, U16, I16, U32, I32, F32, Bool, Strings, Arrays, U64, I64, F64)
}

/// Write `input`'s main model to `main_out` and its MTP block to `mtp_out` (see the module
/// docs for what each holds).
pub fn split_mtp(
    input: &Path,
    main_out: &Path,
    mtp_out: &Path,
) -> Result<SplitSummary, SplitMtpError> {
    let g = read_gguf(input).map_err(GgufModelError::from)?;
    let inv = inventory_from_gguf(&g)?;
    let (n_layer, nextn) = (inv.hparams.n_layer, inv.hparams.nextn_predict_layers);
    if nextn == 0 {
        return Err(SplitMtpError::NoMtpBlock { file: g.path });
    }
    let arch = inv.arch.as_str();
    let blocks = (n_layer + nextn) as usize;
    let in_block = |t: &GgufTensorInfo| {
        let (role, layer) = crate::arch::classify(&t.name);
        (role, layer.map(|l| l >= n_layer))
    };

    let mut main = GgufWriter::new(main_out);
    let mut mtp = GgufWriter::new(mtp_out);
    for (k, v) in &g.metadata {
        if k.starts_with("split.") {
            continue;
        }
        mtp.kv(k, v.clone())?;
        if *k == format!("{arch}.nextn_predict_layers") {
            continue;
        }
        let v = match v {
            _ if *k == format!("{arch}.block_count") => GgufValue::U32(n_layer),
            GgufValue::Array(a) if k.starts_with(&format!("{arch}.")) && a.len() == blocks => {
                GgufValue::Array(truncated(a, n_layer as usize))
            }
            other => other.clone(),
        };
        main.kv(k, v)?;
    }
    let (mut to_main, mut to_mtp) = (Vec::new(), Vec::new());
    for t in &g.tensors {
        match in_block(t) {
            (_, Some(true)) => to_mtp.push(t),
            (TensorRole::Embedding | TensorRole::OutputNorm | TensorRole::Head, None) => {
                to_main.push(t);
                to_mtp.push(t);
            }
            _ => to_main.push(t),
        }
    }
    let maps = map_parts(&g)?;
    Ok((
        write_tensors(main, &g, &maps, &to_main)?,
        write_tensors(mtp, &g, &maps, &to_mtp)?,
    ))
}

/// Map every part of `g` read-only.
fn map_parts(g: &GgufFile) -> Result<Vec<memmap2::Mmap>, SplitMtpError> {
    let mut maps = Vec::with_capacity(g.parts.len());
    for p in &g.parts {
        let map_err = |source| SplitMtpError::Map {
            file: p.path.clone(),
            source,
        };
        let f = std::fs::File::open(&p.path).map_err(map_err)?;
        // SAFETY: the map is read-only and lives until the split returns; a concurrent writer
        // truncating the input is the one hazard, as for every mmapped model reader.
        maps.push(unsafe { memmap2::Mmap::map(&f) }.map_err(map_err)?);
    }
    Ok(maps)
}

/// Declare `tensors` in `w` and copy their bytes from `maps`.
fn write_tensors(
    mut w: GgufWriter,
    g: &GgufFile,
    maps: &[memmap2::Mmap],
    tensors: &[&GgufTensorInfo],
) -> Result<WriteSummary, SplitMtpError> {
    for t in tensors {
        w.tensor_info(&t.name, &t.dims, t.ggml_type)?;
    }
    let mut s = w.begin()?;
    for t in tensors {
        let at = g.tensor_file_offset(t).unwrap_or(u64::MAX) as usize;
        let bytes = maps[t.part as usize]
            .get(at..at.saturating_add(t.bytes as usize))
            .ok_or_else(|| SplitMtpError::Truncated {
                file: g.parts[t.part as usize].path.clone(),
                name: t.name.clone(),
            })?;
        s.data(bytes)?;
    }
    Ok(s.finish()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::QuantRecipe;
    use crate::gguf::mtp_file::{is_mtp_only, merge_mtp_file, read_mtp_file, MtpFileError};
    use crate::gguf::random::{write_random_model, RandomOptions};
    use crate::gguf::testutil::tiny_qwen3next;
    use crate::inventory::HParams;

    /// A tiny F32 Qwen3-Next with one MTP block, split into main and MTP files.
    fn split_tiny(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
        let hp = HParams {
            n_expert: 8,
            ..tiny_qwen3next()
        };
        let whole = dir.join("whole.gguf");
        let recipe = QuantRecipe::preset("F32").unwrap();
        write_random_model(
            &whole,
            "qwen3next",
            &hp,
            &recipe,
            3,
            RandomOptions::default(),
        )
        .unwrap();
        let (main, mtp) = (dir.join("main.gguf"), dir.join("mtp-main.gguf"));
        split_mtp(&whole, &main, &mtp).unwrap();
        (whole, main, mtp)
    }

    #[test]
    fn the_two_files_merge_into_the_single_file_inventory() {
        let d = tempfile::tempdir().unwrap();
        let (whole, main, mtp) = split_tiny(d.path());
        let whole_inv = inventory_from_gguf(&read_gguf(&whole).unwrap()).unwrap();
        let main_g = read_gguf(&main).unwrap();
        let main_inv = inventory_from_gguf(&main_g).unwrap();
        assert_eq!(main_inv.hparams.nextn_predict_layers, 0);
        assert_eq!(main_g.get_u64("qwen3next.block_count").unwrap(), Some(4));
        assert!(main_inv
            .tensors
            .iter()
            .all(|t| t.layer.is_none_or(|l| l < 4)));
        assert!(!is_mtp_only(&main_g));

        let mtp_g = read_gguf(&mtp).unwrap();
        assert!(is_mtp_only(&mtp_g));
        assert_eq!(mtp_g.get_u64("qwen3next.block_count").unwrap(), Some(5));
        assert_eq!(
            mtp_g.get_u64("qwen3next.nextn_predict_layers").unwrap(),
            Some(1)
        );
        let names: Vec<&str> = mtp_g.tensors.iter().map(|t| t.name.as_str()).collect();
        for n in ["token_embd.weight", "output_norm.weight", "output.weight"] {
            assert!(names.contains(&n), "{n} in {names:?}");
        }
        assert!(names.contains(&"blk.4.nextn.eh_proj.weight"));
        assert!(names.contains(&"blk.4.ffn_up_exps.weight"));
        assert!(names
            .iter()
            .all(|n| !n.starts_with("blk.") || n.starts_with("blk.4.")));

        let file = read_mtp_file(&mtp_g).unwrap();
        let merged = merge_mtp_file(&main_inv, &file).unwrap();
        assert_eq!(merged.hparams, whole_inv.hparams);
        assert_eq!(merged.fingerprint(), whole_inv.fingerprint());
        assert_ne!(file.fingerprint, main_inv.fingerprint());
        assert_ne!(file.fingerprint, whole_inv.fingerprint());
        // Every tensor's bytes are the original's.
        let (wg, mg) = (read_gguf(&whole).unwrap(), mtp_g);
        let (wb, mb) = (std::fs::read(&whole).unwrap(), std::fs::read(&mtp).unwrap());
        for t in &mg.tensors {
            let w = wg.tensor(&t.name).unwrap();
            let (a, b) = (
                wg.tensor_file_offset(w).unwrap() as usize,
                mg.tensor_file_offset(t).unwrap() as usize,
            );
            assert_eq!(
                wb[a..a + w.bytes as usize],
                mb[b..b + t.bytes as usize],
                "{}",
                t.name
            );
        }
    }

    #[test]
    fn mismatched_pairs_are_refused_naming_the_file_and_the_fix() {
        let d = tempfile::tempdir().unwrap();
        let (whole, main, mtp) = split_tiny(d.path());
        let whole_g = read_gguf(&whole).unwrap();
        let whole_inv = inventory_from_gguf(&whole_g).unwrap();
        let main_inv = inventory_from_gguf(&read_gguf(&main).unwrap()).unwrap();
        let file = read_mtp_file(&read_gguf(&mtp).unwrap()).unwrap();

        let e = merge_mtp_file(&whole_inv, &file).unwrap_err();
        assert!(matches!(e, MtpFileError::MainHasMtp { .. }), "{e}");
        assert!(e.to_string().contains("drop --mtp-model"), "{e}");

        let e = read_mtp_file(&whole_g).unwrap_err();
        assert!(matches!(e, MtpFileError::NotMtpOnly { .. }), "{e}");
        assert!(e.to_string().contains("pass it as --model"), "{e}");

        let e = read_mtp_file(&read_gguf(&main).unwrap()).unwrap_err();
        assert!(matches!(e, MtpFileError::NoMtpBlock { .. }), "{e}");

        let mut other = main_inv.clone();
        other.hparams.rms_eps = 1e-5;
        let e = merge_mtp_file(&other, &file).unwrap_err();
        assert!(e.to_string().contains("`rms_eps`"), "{e}");
        assert!(e.to_string().contains(&file.path), "{e}");

        // A file without its own head copy (it reads as tied) still fits: the block uses the
        // main model's head.
        let mut headless = file.clone();
        headless.tensors.retain(|t| t.name != "output.weight");
        headless.hparams.tied_embeddings = true;
        let merged = merge_mtp_file(&main_inv, &headless).unwrap();
        assert_eq!(merged.fingerprint(), whole_inv.fingerprint());

        let mut short = file.clone();
        short
            .tensors
            .retain(|t| t.name != "blk.4.nextn.eh_proj.weight");
        let e = merge_mtp_file(&main_inv, &short).unwrap_err();
        assert!(e.to_string().contains("blk.4.nextn.eh_proj.weight"), "{e}");

        let e = split_mtp(&main, &d.path().join("a.gguf"), &d.path().join("b.gguf")).unwrap_err();
        assert!(matches!(e, SplitMtpError::NoMtpBlock { .. }), "{e}");
    }
}
