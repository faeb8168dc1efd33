//! The device side of a pick's row processing (`executor/src/pick.rs`'s `RowProc`): the rows
//! of the plan's `sample_proc` buffer the pick kernels read ([`ProcRows`]), their layout
//! ([`proc_row_words`], [`row_parts`]), and the launcher of `sp_edits`
//! (`kernels/cuda/sample.cu`), which writes each row's sparse edits into its logits before
//! the pick.
//! Invariant: a row's words are exactly what sample.cu's layout reads (header, mask words,
//! edits at their fixed offsets), and no launch reads a row past the view it was given.

use super::{bad, cfg, f32s, int, launch, Launcher};
use crate::backend::cuda::{CudaError, DeviceView};
use crate::pick::RowProc;
use strata_schemas::workset::{sample_proc_row_bytes, SAMPLE_EDITS};

/// Consecutive rows of processing, `row_words` u32 words each (the pick kernels' `proc`,
/// `proc_words`).
#[derive(Debug, Clone, Copy)]
pub struct ProcRows<'a> {
    pub buf: DeviceView<'a>,
    pub row_words: usize,
}

impl ProcRows<'_> {
    /// Checks the view holds `rows` rows of a `vocab`-token row layout; returns the kernel
    /// arguments (pointer, words a row).
    pub(crate) fn check(
        &self,
        op: &'static str,
        rows: usize,
        vocab: usize,
    ) -> Result<(u64, i64), CudaError> {
        if self.row_words < proc_row_words(vocab) - SAMPLE_EDITS as usize * 4 {
            return Err(bad(
                op,
                format!(
                    "rows of {} words cannot hold a {vocab}-token mask",
                    self.row_words
                ),
            ));
        }
        self.buf
            .expect(op, "proc", 4 * (rows * self.row_words) as u64, 16)?;
        Ok((self.buf.ptr(), self.row_words as i64))
    }
}

/// The kernels' (pointer, words a row) of an optional `proc`: (0, 0) for none.
pub(crate) fn proc_args(
    op: &'static str,
    proc: Option<ProcRows<'_>>,
    rows: usize,
    vocab: usize,
) -> Result<(u64, i64), CudaError> {
    match proc {
        None => Ok((0, 0)),
        Some(p) => p.check(op, rows, vocab),
    }
}

/// Words of one planned row at a vocabulary of `vocab` (the plan's `sample_proc` row).
pub fn proc_row_words(vocab: usize) -> usize {
    (sample_proc_row_bytes(vocab as u64) / 4) as usize
}

/// Words of the mask of a `vocab`-token row (sample.cu's `sp_mask_words`).
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(128) * 4
}

/// The words of one row of processing: see [`row_parts`].
#[derive(Debug, Clone, Copy)]
pub struct RowParts<'a> {
    pub head: [u32; 4],
    pub mask: Option<&'a [u32]>,
    pub edits: &'a [u32],
}

/// What row `p` puts in its row of a `vocab`-token layout: the header, the mask's first
/// `ceil(vocab / 32)` words (at word 4), the edits as words (at word 4 + [`mask_words`]).
/// `None` when the device cannot apply `p` (host-only `typical_p`, more than
/// [`SAMPLE_EDITS`] edits, or a mask shorter than the row, whose missing words the host
/// reads as disallowed): that step is picked on the host.
pub fn row_parts(p: &RowProc, vocab: usize) -> Option<RowParts<'_>> {
    if !p.fits_device(SAMPLE_EDITS as usize) {
        return None;
    }
    let mask = match &p.mask {
        None => None,
        Some(m) => Some(m.get(..vocab.div_ceil(32))?),
    };
    Some(RowParts {
        head: p.header(),
        mask,
        edits: crate::pick::edit_words(&p.edits),
    })
}

/// `sp_edits`: each of `rows` rows of `cols` logits (`x`) gets its row's edits of `proc`.
pub fn sp_edits(
    l: &Launcher<'_>,
    x: DeviceView<'_>,
    cols: usize,
    rows: usize,
    proc: ProcRows<'_>,
) -> Result<(), CudaError> {
    const OP: &str = "sp_edits";
    x.expect(OP, "x", f32s(rows * cols), 4)?;
    if proc.row_words < proc_row_words(cols) {
        return Err(bad(
            OP,
            format!(
                "rows of {} words: a {cols}-token row with {SAMPLE_EDITS} edits needs {}",
                proc.row_words,
                proc_row_words(cols)
            ),
        ));
    }
    let (pp, pw) = proc.check(OP, rows, cols)?;
    let (xp, c) = (x.ptr(), int(OP, "cols", cols)?);
    launch!(l, "sp_edits", cfg((rows as u32, 1, 1), 256, 0); &xp, &c, &pp, &pw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pick::Edit;

    #[test]
    fn rows_follow_the_planned_layout() {
        let v = 151_936;
        assert_eq!(mask_words(v), 4748);
        assert_eq!(proc_row_words(v), 4 + 4748 + 4 * SAMPLE_EDITS as usize);
        let p = RowProc {
            mask: Some(vec![u32::MAX; 3]),
            edits: vec![Edit::none(7)],
            min_p_off: Some(-1.5),
            ..Default::default()
        };
        let RowParts {
            head: h,
            mask: m,
            edits: e,
        } = row_parts(&p, 70).unwrap();
        assert_eq!(h, [3, 1, (-1.5f32).to_bits(), 0]);
        assert_eq!(m, Some(&[u32::MAX; 3][..]));
        assert_eq!(e, Edit::none(7).to_words());
        assert!(
            row_parts(&p, 200).is_none(),
            "a short mask goes to the host"
        );
        let big = RowProc {
            edits: vec![Edit::none(1); SAMPLE_EDITS as usize + 1],
            ..Default::default()
        };
        assert!(row_parts(&big, 70).is_none());
    }
}
