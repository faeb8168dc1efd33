//! Mixed steps ([`Engine::step_mixed`] on a [`Pipeline`]): one slot's prompt chunk and one
//! decode token of each of several other slots in one pass ([`StepKind::Mixed`]), so every
//! stage reads its weights once for both; the chunk's rows come first, so the head runs over
//! one contiguous range (the chunk's last row when its logits are wanted, then the decode
//! rows). Plans with MTP speculation run the two apart (the block's catch-up after a pass
//! follows one slot's rows; mixing it is not built).
//! Invariant: the whole step (both parts, the pick's arguments, the pass's size) is checked
//! before any op runs, so a refused step leaves every slot as it was; slot lengths advance
//! only after the pass and the picks succeeded.

use super::{internal, last, Pipeline};
use crate::backend::{Stage, StepKind};
use crate::engine::{check_mixed_args, DecodePick, EngineError, MixedPrefill};
use crate::model::Forward;

impl<B: Stage, M: Forward<B>> Pipeline<B, M> {
    /// The most prompt tokens a mixed pass carries beside `decode_rows` decode rows: the
    /// planned pass less the decode rows, at most the plan's `ubatch`; 0 when the plan
    /// speculates (mixed steps then run as two steps, each of the usual size).
    pub(super) fn mixed_room(&self, decode_rows: usize) -> usize {
        if self.mtp.is_some() {
            return 0;
        }
        self.max_tok
            .saturating_sub(decode_rows)
            .min(self.info.ubatch)
    }

    /// Check a mixed step: the chunk fits the pass beside the decode rows and its slot's
    /// context, the decode slots are distinct, other than the chunk's and have room, every
    /// token is in the vocabulary.
    fn check_mixed(
        &self,
        prefill: &MixedPrefill<'_>,
        row: usize,
        batch: &[(usize, u32)],
        pick: &DecodePick<'_>,
    ) -> Result<(), EngineError> {
        let (c, d) = (prefill.tokens.len(), batch.len());
        if d == 0 || d >= self.info.n_slots {
            return Err(EngineError::Request(format!(
                "a mixed step decodes 1..{} slots beside its prompt chunk, got {d}",
                self.info.n_slots
            )));
        }
        let room = self.mixed_room(d);
        if c == 0 || c > room {
            return Err(EngineError::Request(format!(
                "a mixed step's prompt chunk of {c} tokens: give 1..={room} beside {d} decode rows (passes of {} tokens)",
                self.max_tok
            )));
        }
        if d + 1 > self.logit_rows {
            return Err(internal(format!(
                "a mixed step needs {} logit rows, the plan has {}",
                d + 1,
                self.logit_rows
            )));
        }
        check_mixed_args(self.info.n_vocab, prefill, row, batch, pick)?;
        self.check_slot(prefill.slot, c)?;
        self.check_tokens(prefill.tokens.iter().copied())?;
        for (i, &(slot, _)) in batch.iter().enumerate() {
            self.check_slot(slot, 1)?;
            if batch[..i].iter().any(|(s, _)| *s == slot) {
                return Err(EngineError::Request(format!(
                    "slot {slot} appears twice in one decode step; a step takes one token per slot"
                )));
            }
        }
        self.check_tokens(batch.iter().map(|(_, t)| *t))
    }

    /// Run a checked mixed step as one pass; see [`Engine::step_mixed`].
    pub(super) fn mixed_step(
        &mut self,
        prefill: MixedPrefill<'_>,
        row: &mut [f32],
        batch: &[(usize, u32)],
        pick: DecodePick<'_>,
    ) -> Result<Option<&[f32]>, EngineError> {
        self.check_mixed(&prefill, row.len(), batch, &pick)?;
        let (c, d) = (prefill.tokens.len(), batch.len());
        let slot = prefill.slot;
        let base = self.lens[slot] as usize;
        self.tok.clear();
        self.slot.clear();
        self.pos.clear();
        self.tok.extend_from_slice(prefill.tokens);
        self.slot.resize(c, slot as u32);
        self.pos.extend((0..c).map(|i| (base + i) as u32));
        for &(s, t) in batch {
            self.tok.push(t);
            self.slot.push(s as u32);
            self.pos.push(self.lens[s] as u32);
        }
        // The head over the chunk's last row (when asked) and the decode rows: logit row 0
        // is then the prompt's, rows 1.. the decode rows.
        let off = usize::from(prefill.want_logits);
        let rows = d + off;
        self.pass(StepKind::Mixed { prefill: c }, c + d, Some((c - off, rows)))?;
        let v = self.info.n_vocab;
        let logits = &mut self.logits;
        let st = &mut last(&mut self.stages).backend;
        let returned = match pick {
            DecodePick::Logits => {
                st.read_logits(rows, &mut logits[..rows * v])
                    .map_err(internal)?;
                true
            }
            DecodePick::Sample { draws, out } => {
                let greedy = draws[..d].iter().all(|g| g.is_greedy());
                if off == 1 {
                    // The prompt's row comes back anyway (once per request): pick the decode
                    // rows from the same copy, on the host.
                    st.read_logits(rows, &mut logits[..rows * v])
                        .map_err(internal)?;
                    let dec = &logits[v..rows * v];
                    if greedy {
                        crate::sampler::argmax_rows(dec, v, &mut out[..d]);
                    } else {
                        crate::sampler::sample_rows(dec, v, &draws[..d], &mut out[..d]);
                    }
                } else if greedy {
                    st.pick_greedy(&mut logits[..d * v], &mut out[..d])
                        .map_err(internal)?;
                } else {
                    st.pick_sample(&draws[..d], &mut logits[..d * v], &mut out[..d])
                        .map_err(internal)?;
                }
                false
            }
            DecodePick::Proc { draws, procs, out } => {
                if off == 1 {
                    // As for Sample: the prompt's row comes back, the decode rows are
                    // processed and picked from the same copy on the host (the reference).
                    st.read_logits(rows, &mut logits[..rows * v])
                        .map_err(internal)?;
                    crate::pick::pick_rows(
                        &mut logits[v..rows * v],
                        v,
                        &draws[..d],
                        &procs[..d],
                        &mut out[..d],
                    );
                } else {
                    st.pick_proc(
                        &draws[..d],
                        &procs[..d],
                        &mut logits[..d * v],
                        &mut out[..d],
                    )
                    .map_err(internal)?;
                }
                false
            }
        };
        if off == 1 {
            row[..v].copy_from_slice(&self.logits[..v]);
        }
        self.lens[slot] += c as u64;
        for &(s, _) in batch {
            self.lens[s] += 1;
        }
        Ok(returned.then(|| &self.logits[off * v..rows * v]))
    }
}
