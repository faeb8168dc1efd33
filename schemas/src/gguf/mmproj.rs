//! llama.cpp mmproj GGUF (the vision tower `llama-mtmd-cli --mmproj` loads) -> [`VisionSpec`]
//! for planning. Invariant: only a file with `general.architecture = "clip"` and a vision
//! encoder is accepted, and every size comes from a `clip.vision.*` key that was checked to be
//! nonzero and within caps.
//!
//! Keys read (llama.cpp `tools/mtmd/clip-impl.h`): `clip.vision.embedding_length`,
//! `clip.vision.block_count`, `clip.vision.attention.head_count`,
//! `clip.vision.feed_forward_length`, `clip.vision.image_size`, `clip.vision.patch_size`, and
//! the optional `clip.vision.image_max_pixels` (dynamic-resolution towers such as Qwen2-VL /
//! Qwen3-VL).
//!
//! - `max_image_tokens` = `(image_size / patch_size)^2`: the patch tokens of one image at the
//!   encoder's native size. When `image_max_pixels` is present the tower takes larger images,
//!   so the patch count of the largest one (`image_max_pixels / patch_size^2`) is used if
//!   bigger. Tokens are counted before any spatial merge (the encoder runs on all patches).
//! - `weights_bytes` = every tensor's bytes except the audio tower of a mixed
//!   vision+audio projector (`a.*`, `mm.a.*`).

use super::{read_gguf, GgufError, GgufFile};
use crate::inventory::VisionSpec;
use std::path::Path;

/// Sanity cap for widths and counts in an mmproj header.
const MAX_WIDTH: u64 = 1 << 20;
/// Sanity cap for image tokens per image.
const MAX_TOKENS: u64 = 1 << 22;

/// Why a file cannot be used as `--vision mmproj.gguf`.
#[derive(Debug, thiserror::Error)]
pub enum MmprojError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{file}: not an mmproj file: {why}; pass the mmproj-*.gguf that llama.cpp's converter writes with --mmproj")]
    NotMmproj { file: String, why: String },
    #[error("{file}: mmproj metadata key `{key}` is missing; the vision tower cannot be sized without it")]
    MissingKey { file: String, key: String },
    #[error("{file}: mmproj metadata key `{key}`: {reason}")]
    BadKey {
        file: String,
        key: String,
        reason: String,
    },
}

/// Read an mmproj file from disk.
pub fn read_mmproj(path: &Path) -> Result<VisionSpec, MmprojError> {
    vision_from_mmproj(&read_gguf(path)?)
}

/// The vision tower of a llama.cpp mmproj file (see the module docs).
pub fn vision_from_mmproj(g: &GgufFile) -> Result<VisionSpec, MmprojError> {
    let file = g.path.clone();
    let arch = g.get_str("general.architecture")?;
    if arch != Some("clip") {
        let why = match arch {
            Some(a) => format!(
                "general.architecture is `{a}` (a language model?), an mmproj file has `clip`"
            ),
            None => "it has no general.architecture key".to_string(),
        };
        return Err(MmprojError::NotMmproj { file, why });
    }
    if g.get_bool("clip.has_vision_encoder")? == Some(false) {
        return Err(MmprojError::NotMmproj {
            file,
            why: "clip.has_vision_encoder is false (an audio-only projector)".into(),
        });
    }
    let req = |key: &str| -> Result<u64, MmprojError> {
        let v = g.get_u64(key)?.ok_or_else(|| MmprojError::MissingKey {
            file: g.path.clone(),
            key: key.into(),
        })?;
        if v == 0 || v > MAX_WIDTH {
            return Err(MmprojError::BadKey {
                file: g.path.clone(),
                key: key.into(),
                reason: format!("{v} must be between 1 and {MAX_WIDTH}"),
            });
        }
        Ok(v)
    };
    let n_embd = req("clip.vision.embedding_length")?;
    let n_layer = req("clip.vision.block_count")?;
    let n_head = req("clip.vision.attention.head_count")?;
    let n_ff = req("clip.vision.feed_forward_length")?;
    let image_size = req("clip.vision.image_size")?;
    let patch = req("clip.vision.patch_size")?;
    if image_size < patch {
        return Err(MmprojError::BadKey {
            file,
            key: "clip.vision.image_size".into(),
            reason: format!("{image_size} is smaller than clip.vision.patch_size {patch}"),
        });
    }
    let side = image_size / patch;
    let mut tokens = side * side;
    if let Some(px) = g.get_u64("clip.vision.image_max_pixels")? {
        tokens = tokens.max(px / (patch * patch));
    }
    if tokens > MAX_TOKENS {
        return Err(MmprojError::BadKey {
            file,
            key: "clip.vision.image_max_pixels".into(),
            reason: format!("{tokens} patch tokens per image is above the cap {MAX_TOKENS}"),
        });
    }
    let weights_bytes = g
        .tensors
        .iter()
        .filter(|t| !(t.name.starts_with("a.") || t.name.starts_with("mm.a.")))
        .fold(0u64, |acc, t| acc.saturating_add(t.bytes));
    Ok(VisionSpec {
        weights_bytes,
        n_embd,
        // Capped at MAX_WIDTH above, so it fits.
        n_layer: u32::try_from(n_layer).unwrap_or(u32::MAX),
        n_head,
        n_ff,
        max_image_tokens: tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::super::model::testfile::*;
    use super::*;
    use crate::ggml::GgmlType;
    use crate::gguf::parse_gguf_bytes;

    fn clip_kv(extra: &[(&str, V)]) -> Vec<(String, V)> {
        let mut p: Vec<(&str, V)> = vec![
            ("clip.has_vision_encoder", V::Bool(true)),
            ("clip.projector_type", s("qwen3vl_merger")),
            ("clip.vision.embedding_length", V::U32(64)),
            ("clip.vision.block_count", V::U32(2)),
            ("clip.vision.attention.head_count", V::U32(4)),
            ("clip.vision.feed_forward_length", V::U32(256)),
            ("clip.vision.image_size", V::U32(448)),
            ("clip.vision.patch_size", V::U32(14)),
        ];
        p.extend(extra.iter().cloned());
        kv("clip", &p)
    }

    fn tensors() -> Vec<(String, Vec<u64>, GgmlType)> {
        vec![
            (
                "v.patch_embd.weight".into(),
                vec![14, 14, 3, 64],
                GgmlType::F16,
            ),
            (
                "v.blk.0.attn_qkv.weight".into(),
                vec![64, 192],
                GgmlType::F16,
            ),
            ("mm.0.weight".into(), vec![64, 128], GgmlType::F32),
            ("a.blk.0.attn_q.weight".into(), vec![64, 64], GgmlType::F32),
        ]
    }

    #[test]
    fn mmproj_gives_a_vision_spec() {
        let g = parse_gguf_bytes(&gguf_bytes(&clip_kv(&[]), &tensors()), "mmproj.gguf").unwrap();
        let v = vision_from_mmproj(&g).unwrap();
        assert_eq!((v.n_embd, v.n_layer, v.n_head, v.n_ff), (64, 2, 4, 256));
        // 448 / 14 = 32 patches a side.
        assert_eq!(v.max_image_tokens, 1024);
        // Audio tower left out.
        assert_eq!(
            v.weights_bytes,
            (14 * 14 * 3 * 64 + 64 * 192) * 2 + 64 * 128 * 4
        );

        // Dynamic resolution: the largest image decides.
        let kv = clip_kv(&[("clip.vision.image_max_pixels", V::U32(1_003_520))]);
        let g = parse_gguf_bytes(&gguf_bytes(&kv, &tensors()), "mmproj.gguf").unwrap();
        assert_eq!(
            vision_from_mmproj(&g).unwrap().max_image_tokens,
            1_003_520 / 196
        );
    }

    #[test]
    fn non_mmproj_files_are_refused() {
        let lm = kv("qwen3moe", &[("block_count", V::U32(2))]);
        let g = parse_gguf_bytes(&gguf_bytes(&lm, &tensors()), "model.gguf").unwrap();
        let e = vision_from_mmproj(&g).unwrap_err().to_string();
        assert!(
            e.contains("not an mmproj file") && e.contains("qwen3moe") && e.contains("model.gguf"),
            "{e}"
        );

        let audio = clip_kv(&[])
            .into_iter()
            .map(|(k, v)| {
                if k == "clip.has_vision_encoder" {
                    (k, V::Bool(false))
                } else {
                    (k, v)
                }
            })
            .collect::<Vec<_>>();
        let g = parse_gguf_bytes(&gguf_bytes(&audio, &tensors()), "a.gguf").unwrap();
        assert!(vision_from_mmproj(&g)
            .unwrap_err()
            .to_string()
            .contains("audio-only"));

        let mut no_patch = clip_kv(&[]);
        no_patch.retain(|(k, _)| k != "clip.vision.patch_size");
        let g = parse_gguf_bytes(&gguf_bytes(&no_patch, &tensors()), "m.gguf").unwrap();
        let e = vision_from_mmproj(&g).unwrap_err().to_string();
        assert!(e.contains("`clip.vision.patch_size`"), "{e}");
    }
}
