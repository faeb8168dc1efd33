//! `CudaStage`'s token picks on the device: the greedy argmax (`dq_argmax_rows`), seeded
//! sampling (`sample_rows`), and either after each row's processing (`pick::RowProc`: the
//! rows are written into the plan's `sample_proc` buffer, `sp_edits` applies the sparse
//! edits to the logits in place, the pick kernels read the mask and `min_p`), so a processed
//! row no longer brings its logits back.
//! Invariant: every pick gives the token the host's reference gives for the same draws and
//! processing (`sampler::argmax_rows`, `sampler::sample_rows`, `pick::pick_rows`; sampling up
//! to exp/log last-place near-ties, as sample.cu says); where the device cannot (`--kernel
//! host-pick`, a vocabulary past `SAMPLE_MAX_VOCAB` for a sampled step, a row the device
//! cannot process (`launch::pick::row_parts`), a plan without the `sample_proc` buffer) the
//! logits are read back and the host picks.

use super::launch::decode;
use super::launch::pick::{proc_row_words, row_parts, sp_edits, ProcRows, RowParts};
use super::launch::SAMPLE_MAX_VOCAB;
use super::stage::CudaStage;
use super::CudaError;
use crate::backend::{Stage, WorkBuf};
use crate::pick::RowProc;
use crate::sampler::Draw;
use strata_schemas::workset::{ARGMAX_BLOCKS, DRAW_BYTES};

/// Blocks per row of `sample_rows` when a draw has top-k or top-p cuts (without cuts it takes
/// `ARGMAX_BLOCKS`, the most the scratch holds).
const SAMPLE_BLOCKS_CUTS: u32 = 16;

impl CudaStage {
    /// `out[i]`: the token of logit row `i` under `draws[i]` (`None`: greedy) after
    /// `procs[i]` (`None`: no processing), picked on the device where it can be.
    pub(super) fn pick_on_device(
        &mut self,
        draws: Option<&[Draw]>,
        procs: Option<&[RowProc]>,
        scratch: &mut [f32],
        out: &mut [u32],
    ) -> Result<(), CudaError> {
        let rows = out.len();
        let v = self.d.vocab;
        let draws = draws.map(|d| &d[..rows]);
        let greedy = draws.is_none_or(|d| d.iter().all(|d| d.is_greedy()));
        let procs = procs
            .map(|p| &p[..rows])
            .filter(|p| !p.iter().all(|p| p.is_neutral()));
        // A plan made before `sample_proc` existed has no room for the rows: the host picks.
        let room = self.bufs.contains_key(&WorkBuf::SampleProc);
        let host = self.opts.host_pick
            || (!greedy && v > SAMPLE_MAX_VOCAB)
            || procs.is_some_and(|p| !room || p.iter().any(|p| row_parts(p, v).is_none()));
        if host {
            let logits = &mut scratch[..rows * v];
            self.read_logits(rows, logits)?;
            match (draws, procs) {
                (Some(d), Some(p)) => crate::pick::pick_rows(logits, v, d, p, out),
                (Some(d), None) if !greedy => crate::sampler::sample_rows(logits, v, d, out),
                _ => crate::sampler::argmax_rows(logits, v, out),
            }
            return Ok(());
        }
        let proc = match procs {
            Some(p) => Some(self.upload_procs(p)?),
            None => None,
        };
        let logits = self.buf(WorkBuf::Logits)?;
        if let (Some(pr), Some(p)) = (proc, procs) {
            if p.iter().any(|p| !p.edits.is_empty()) {
                sp_edits(&self.plain_launcher(), logits, v, rows, pr)?;
            }
        }
        let s = self.pick_scratch(rows)?;
        match draws.filter(|_| !greedy) {
            None => decode::argmax_rows(
                &self.plain_launcher(),
                logits,
                v,
                rows,
                ARGMAX_BLOCKS as u32,
                proc,
                s,
            )?,
            Some(draws) => {
                let dv = self.upload_draws(draws)?;
                // Blocks per row: every block repeats the row's threshold passes, so fewer
                // when a draw has cuts (they read the row four or eight more times).
                let cuts = draws.iter().any(|d| {
                    !d.is_greedy() && ((d.top_k > 0 && (d.top_k as usize) < v) || d.top_p < 1.0)
                });
                let blocks = if cuts {
                    SAMPLE_BLOCKS_CUTS
                } else {
                    ARGMAX_BLOCKS as u32
                };
                decode::sample_rows(&self.plain_launcher(), logits, v, rows, blocks, dv, proc, s)?
            }
        }
        self.back_u32(s.out, out)
    }

    /// The step's draws copied into the plan's `draws` buffer.
    fn upload_draws(&self, draws: &[Draw]) -> Result<super::DeviceView<'_>, CudaError> {
        let mut bytes = [0u8; 32 * 64];
        let need = draws.len() * DRAW_BYTES as usize;
        let dv = self.buf_at(WorkBuf::Draws, 0, need as u64)?;
        for (ci, ds) in draws.chunks(64).enumerate() {
            for (i, d) in ds.iter().enumerate() {
                bytes[32 * i..32 * (i + 1)].copy_from_slice(&d.to_bytes());
            }
            let at = dv.sub((ci * 64 * 32) as u64, (ds.len() * 32) as u64)?;
            // SAFETY: `at` holds exactly these draws' bytes on the device; htod_raw returns
            // once the host bytes are staged.
            unsafe {
                self.dev
                    .htod_raw("sampling draws", at.ptr(), &bytes[..ds.len() * 32])
            }?;
        }
        Ok(dv)
    }

    /// Each row's processing copied into its row of the plan's `sample_proc` buffer: the
    /// header, the mask (when it has one) and the edits, nothing else (the kernels read no
    /// further than the header says). Every row fits (checked by the caller).
    fn upload_procs(&self, procs: &[RowProc]) -> Result<ProcRows<'_>, CudaError> {
        let v = self.d.vocab;
        let words = proc_row_words(v);
        let buf = self.buf_at(WorkBuf::SampleProc, 0, 4 * (procs.len() * words) as u64)?;
        let mask_at = 4u64;
        let edits_at = 4 + super::launch::pick::mask_words(v) as u64;
        for (r, p) in procs.iter().enumerate() {
            let Some(RowParts { head, mask, edits }) = row_parts(p, v) else {
                return Err(CudaError::Shape {
                    op: "pick",
                    detail: format!("row {r}'s processing does not fit the device row"),
                });
            };
            let row = 4 * (r * words) as u64;
            let put = |at: u64, w: &[u32]| {
                let dst = buf.sub(row + 4 * at, 4 * w.len() as u64)?;
                self.dev.htod(w, dst)
            };
            put(0, &head)?;
            if let Some(m) = mask {
                put(mask_at, m)?;
            }
            if !edits.is_empty() {
                put(edits_at, edits)?;
            }
        }
        Ok(ProcRows {
            buf,
            row_words: words,
        })
    }
}
