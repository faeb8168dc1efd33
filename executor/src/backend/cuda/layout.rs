//! Device weight layouts: how a GGUF tensor's bytes are rearranged on upload so the kernels
//! read them with wide aligned loads. Q8_0 becomes the "split" layout: per matrix (one expert
//! of a 3-D expert tensor, or the whole 2-D tensor) first every row's quants as `rows x cols`
//! int8, then every block's f16 scale as `rows x cols/32` — the same byte count as the GGUF
//! layout (34 bytes per 32 quants), so a tensor keeps its planned offset and size.
//! Every other type keeps the GGUF layout.
//! Invariant: `to_device` then `from_device` gives back the input bytes exactly, and the split
//! layout never moves a byte outside its own matrix.

use strata_schemas::ggml::GgmlType;

/// Bytes of one Q8_0 block in GGUF layout: an f16 scale and 32 int8 quants.
pub const Q8_0_BLOCK: usize = 34;
/// Quants per Q8_0 block.
pub const QK8_0: usize = 32;

/// A tensor's bytes do not form whole matrices of whole blocks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ty} tensor of {len} bytes is not {mats} matrices of {rows} rows x {cols} columns (columns a multiple of 32)")]
pub struct LayoutError {
    pub ty: GgmlType,
    pub len: usize,
    pub mats: usize,
    pub rows: usize,
    pub cols: usize,
}

fn check(
    ty: GgmlType,
    len: usize,
    mats: usize,
    rows: usize,
    cols: usize,
) -> Result<(), LayoutError> {
    let err = LayoutError {
        ty,
        len,
        mats,
        rows,
        cols,
    };
    if cols % QK8_0 != 0 {
        return Err(err);
    }
    let want = mats
        .checked_mul(rows)
        .and_then(|n| n.checked_mul(cols / QK8_0 * Q8_0_BLOCK));
    if want != Some(len) {
        return Err(err);
    }
    Ok(())
}

/// Whether `ty` is stored differently on the device than in the file.
pub fn is_rearranged(ty: GgmlType) -> bool {
    ty == GgmlType::Q8_0
}

/// Rearrange `src` (GGUF layout, `mats` matrices of `rows x cols`) into `dst` (device layout).
/// Types other than Q8_0 are copied unchanged.
pub fn to_device(
    ty: GgmlType,
    src: &[u8],
    mats: usize,
    rows: usize,
    cols: usize,
    dst: &mut [u8],
) -> Result<(), LayoutError> {
    assert_eq!(
        src.len(),
        dst.len(),
        "to_device: source and destination differ in length"
    );
    if !is_rearranged(ty) {
        dst.copy_from_slice(src);
        return Ok(());
    }
    check(ty, src.len(), mats, rows, cols)?;
    let nb = cols / QK8_0;
    let mat_bytes = rows * nb * Q8_0_BLOCK;
    for m in 0..mats {
        let s = &src[m * mat_bytes..(m + 1) * mat_bytes];
        let (qs, ds) = dst[m * mat_bytes..(m + 1) * mat_bytes].split_at_mut(rows * cols);
        for (b, blk) in s.chunks_exact(Q8_0_BLOCK).enumerate() {
            ds[2 * b..2 * b + 2].copy_from_slice(&blk[..2]);
            qs[b * QK8_0..(b + 1) * QK8_0].copy_from_slice(&blk[2..]);
        }
    }
    Ok(())
}

/// The inverse of [`to_device`].
pub fn from_device(
    ty: GgmlType,
    src: &[u8],
    mats: usize,
    rows: usize,
    cols: usize,
    dst: &mut [u8],
) -> Result<(), LayoutError> {
    assert_eq!(
        src.len(),
        dst.len(),
        "from_device: source and destination differ in length"
    );
    if !is_rearranged(ty) {
        dst.copy_from_slice(src);
        return Ok(());
    }
    check(ty, src.len(), mats, rows, cols)?;
    let nb = cols / QK8_0;
    let mat_bytes = rows * nb * Q8_0_BLOCK;
    for m in 0..mats {
        let (qs, ds) = src[m * mat_bytes..(m + 1) * mat_bytes].split_at(rows * cols);
        let d = &mut dst[m * mat_bytes..(m + 1) * mat_bytes];
        for (b, blk) in d.chunks_exact_mut(Q8_0_BLOCK).enumerate() {
            blk[..2].copy_from_slice(&ds[2 * b..2 * b + 2]);
            blk[2..].copy_from_slice(&qs[b * QK8_0..(b + 1) * QK8_0]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_layout_round_trips_and_puts_quants_first() {
        let (mats, rows, cols) = (3, 5, 64);
        let len = mats * rows * cols / QK8_0 * Q8_0_BLOCK;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let mut dev = vec![0; len];
        to_device(GgmlType::Q8_0, &src, mats, rows, cols, &mut dev).unwrap();
        // Matrix 1, row 2, block 1: quants at rows*cols-relative offset, scale after them.
        let mat = rows * cols / QK8_0 * Q8_0_BLOCK;
        let blk = 2 * (cols / QK8_0) + 1;
        let gguf = &src[mat + blk * Q8_0_BLOCK..mat + (blk + 1) * Q8_0_BLOCK];
        assert_eq!(&dev[mat + blk * QK8_0..mat + (blk + 1) * QK8_0], &gguf[2..]);
        let d0 = mat + rows * cols + 2 * blk;
        assert_eq!(&dev[d0..d0 + 2], &gguf[..2]);
        let mut back = vec![0; len];
        from_device(GgmlType::Q8_0, &dev, mats, rows, cols, &mut back).unwrap();
        assert_eq!(back, src);
    }

    #[test]
    fn wrong_sizes_are_refused_and_other_types_copy() {
        let mut out = vec![0; 68];
        assert!(to_device(GgmlType::Q8_0, &[0; 68], 1, 3, 32, &mut out).is_err());
        assert!(to_device(GgmlType::Q8_0, &[0; 68], 1, 2, 32, &mut out).is_ok());
        let src: Vec<u8> = (0..68).collect();
        to_device(GgmlType::BF16, &src, 1, 2, 17, &mut out).unwrap();
        assert_eq!(out, src);
    }
}
