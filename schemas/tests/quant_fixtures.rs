//! Every type's dequantization against gguf-py's: `scripts/make_quant_fixtures.py` wrote random
//! valid blocks and gguf-py's `dequantize` of them under `tests/data/quants/` (CI reruns the
//! script with `--check`, so the oracle really runs); here the CPU reference must decode each
//! file to the same f32 values bit for bit, and `dot_row` must agree with dequantize-then-dot.

use std::path::PathBuf;
use strata_schemas::ggml::GgmlType;
use strata_schemas::quant::{self, SUPPORTED};

fn data(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/quants")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run `python3 scripts/make_quant_fixtures.py` (pip install gguf numpy)",
            p.display()
        )
    })
}

fn fixture(ty: GgmlType) -> (Vec<u8>, Vec<f32>) {
    let stem = ty.name().to_ascii_lowercase();
    let raw = data(&format!("{stem}.bin"));
    let vals = data(&format!("{stem}.f32"))
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (raw, vals)
}

#[test]
fn every_type_dequantizes_bit_for_bit_like_gguf_py() {
    for &ty in SUPPORTED {
        let (raw, want) = fixture(ty);
        assert_eq!(want.len(), 1024, "{ty}");
        let mut got = vec![0f32; want.len()];
        quant::dequantize_row(ty, &raw, &mut got).unwrap_or_else(|e| panic!("{ty}: {e}"));
        let mut mismatches = 0;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if g.to_bits() != w.to_bits() {
                if mismatches < 5 {
                    eprintln!("{ty}[{i}]: ours {g:e}, gguf-py {w:e}");
                }
                mismatches += 1;
            }
        }
        assert_eq!(
            mismatches, 0,
            "{ty}: {mismatches} of 1024 values differ from gguf-py"
        );
        assert!(
            got.iter().any(|v| *v != 0.0),
            "{ty}: an all-zero fixture tests nothing"
        );
    }
}

#[test]
fn dot_row_matches_dequantize_then_dot_for_every_type() {
    for &ty in SUPPORTED {
        let (raw, w) = fixture(ty);
        // One row of 1024 (whole blocks of every type) and rows of a single block.
        let x: Vec<f32> = (0..w.len())
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let scale: f64 = w
            .iter()
            .zip(&x)
            .map(|(a, b)| (*a as f64 * *b as f64).abs())
            .sum();
        let got = quant::try_dot_row(ty, &raw, &x).unwrap() as f64;
        // f32 accumulation over 1024 products: relative to the sum of |products|.
        assert!(
            (got - exact).abs() <= 1e-5 * scale.max(1e-30),
            "{ty}: dot {got} vs {exact} (scale {scale})"
        );
        assert_eq!(
            got.to_bits(),
            (quant::dot_row_portable(ty, &raw, &x) as f64).to_bits(),
            "{ty}: AVX2 and portable builds round alike"
        );
        let be = ty.block_elems() as usize;
        let bb = ty.block_bytes() as usize;
        let one = quant::dot_row(ty, &raw[..bb], &x[..be]) as f64;
        let want: f64 = w[..be]
            .iter()
            .zip(&x)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum();
        let s1: f64 = w[..be]
            .iter()
            .zip(&x)
            .map(|(a, b)| (*a as f64 * *b as f64).abs())
            .sum();
        assert!(
            (one - want).abs() <= 1e-5 * s1.max(1e-30),
            "{ty}: one block"
        );
    }
}
