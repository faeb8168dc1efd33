//! The ggml tensor type table: ids as stored in GGUF, block size and bytes per block.
//! Invariant: `bytes_for(n)` is exact for every whole number of blocks and refuses anything else.

use serde::{Deserialize, Serialize};

/// A ggml tensor element type. Discriminants are the GGUF type ids llama.cpp writes.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
#[serde(rename_all = "UPPERCASE")]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    #[serde(rename = "Q2_K")]
    Q2K = 10,
    #[serde(rename = "Q3_K")]
    Q3K = 11,
    #[serde(rename = "Q4_K")]
    Q4K = 12,
    #[serde(rename = "Q5_K")]
    Q5K = 13,
    #[serde(rename = "Q6_K")]
    Q6K = 14,
    #[serde(rename = "Q8_K")]
    Q8K = 15,
    #[serde(rename = "IQ2_XXS")]
    Iq2Xxs = 16,
    #[serde(rename = "IQ2_XS")]
    Iq2Xs = 17,
    #[serde(rename = "IQ3_XXS")]
    Iq3Xxs = 18,
    #[serde(rename = "IQ1_S")]
    Iq1S = 19,
    #[serde(rename = "IQ4_NL")]
    Iq4Nl = 20,
    #[serde(rename = "IQ3_S")]
    Iq3S = 21,
    #[serde(rename = "IQ2_S")]
    Iq2S = 22,
    #[serde(rename = "IQ4_XS")]
    Iq4Xs = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    #[serde(rename = "IQ1_M")]
    Iq1M = 29,
    BF16 = 30,
    #[serde(rename = "TQ1_0")]
    Tq1_0 = 34,
    #[serde(rename = "TQ2_0")]
    Tq2_0 = 35,
    MXFP4 = 39,
}

/// Every type, in id order (used by tests, `--help` text and error messages).
pub const ALL_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q8K,
    GgmlType::Iq2Xxs,
    GgmlType::Iq2Xs,
    GgmlType::Iq3Xxs,
    GgmlType::Iq1S,
    GgmlType::Iq4Nl,
    GgmlType::Iq3S,
    GgmlType::Iq2S,
    GgmlType::Iq4Xs,
    GgmlType::I8,
    GgmlType::I16,
    GgmlType::I32,
    GgmlType::I64,
    GgmlType::F64,
    GgmlType::Iq1M,
    GgmlType::BF16,
    GgmlType::Tq1_0,
    GgmlType::Tq2_0,
    GgmlType::MXFP4,
];

impl GgmlType {
    /// The type for a GGUF type id, or `None` for ids llama.cpp never assigned or retired.
    pub fn from_id(id: u32) -> Option<Self> {
        ALL_TYPES.iter().copied().find(|t| *t as u32 == id)
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Elements per block (1 for plain types).
    pub fn block_elems(self) -> u64 {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | Iq4Nl | MXFP4 => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | Iq2Xxs | Iq2Xs | Iq3Xxs | Iq1S | Iq3S | Iq2S
            | Iq4Xs | Iq1M | Tq1_0 | Tq2_0 => 256,
        }
    }

    /// Bytes per block, from ggml's block structs.
    pub fn block_bytes(self) -> u64 {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            F64 => 8,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Iq4Nl => 18,
            MXFP4 => 17,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
            Iq2Xxs => 66,
            Iq2Xs => 74,
            Iq3Xxs => 98,
            Iq1S => 50,
            Iq3S => 110,
            Iq2S => 82,
            Iq4Xs => 136,
            Iq1M => 56,
            Tq1_0 => 54,
            Tq2_0 => 66,
        }
    }

    /// llama.cpp's spelling ("Q4_K", "IQ3_S", "BF16").
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            Iq2Xxs => "IQ2_XXS",
            Iq2Xs => "IQ2_XS",
            Iq3Xxs => "IQ3_XXS",
            Iq1S => "IQ1_S",
            Iq4Nl => "IQ4_NL",
            Iq3S => "IQ3_S",
            Iq2S => "IQ2_S",
            Iq4Xs => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            Iq1M => "IQ1_M",
            BF16 => "BF16",
            Tq1_0 => "TQ1_0",
            Tq2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
        }
    }

    /// Parse llama.cpp's spelling, case-insensitively.
    pub fn from_name(s: &str) -> Option<Self> {
        ALL_TYPES
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(s))
    }

    /// Bytes of one row of `n` elements: `None` when `n` is not a whole number of blocks
    /// or the product overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let be = self.block_elems();
        if n % be != 0 {
            return None;
        }
        (n / be).checked_mul(self.block_bytes())
    }

    /// Bytes of a tensor with these dims (GGUF order, ne0 contiguous): `None` when ne0 is
    /// not a whole number of blocks or any product overflows.
    pub fn tensor_bytes(self, dims: &[u64]) -> Option<u64> {
        let first = *dims.first().unwrap_or(&1);
        let row = self.bytes_for(first)?;
        dims.iter()
            .skip(1)
            .try_fold(row, |acc, d| acc.checked_mul(*d))
    }

    /// Bits per weight, for reports.
    pub fn bits_per_weight(self) -> f64 {
        self.block_bytes() as f64 * 8.0 / self.block_elems() as f64
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_names_parse() {
        for t in ALL_TYPES {
            assert_eq!(GgmlType::from_id(t.id()), Some(*t));
            assert_eq!(GgmlType::from_name(t.name()), Some(*t));
        }
        assert_eq!(GgmlType::from_id(4), None, "Q4_2 was retired");
        assert_eq!(GgmlType::from_id(31), None);
        assert_eq!(GgmlType::from_name("q4_k"), Some(GgmlType::Q4K));
    }

    #[test]
    fn design_worked_number_one_iq3s_expert() {
        // DESIGN.md: gate + up + down, 2048 x 512 each, IQ3_S at 110 B per 256 = 1.35 MB.
        let one = GgmlType::Iq3S.tensor_bytes(&[2048, 512]).unwrap();
        assert_eq!(3 * one, 1_351_680);
    }

    #[test]
    fn partial_blocks_and_overflow_are_refused() {
        assert_eq!(GgmlType::Q4K.bytes_for(255), None);
        assert_eq!(GgmlType::Q8_0.bytes_for(64), Some(68));
        assert_eq!(GgmlType::F32.tensor_bytes(&[u64::MAX, 2]), None);
        assert_eq!(GgmlType::MXFP4.bytes_for(32), Some(17));
    }

    #[test]
    fn serde_uses_llama_cpp_spelling() {
        #[derive(Deserialize)]
        struct W {
            t: GgmlType,
        }
        let w: W = toml::from_str("t = \"Q4_K\"").unwrap();
        assert_eq!(w.t, GgmlType::Q4K);
        let w: W = toml::from_str("t = \"IQ3_S\"").unwrap();
        assert_eq!(w.t, GgmlType::Iq3S);
    }
}
