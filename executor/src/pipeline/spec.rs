//! MTP speculative decoding on a [`Pipeline`]: the MTP block's catch-up after every main pass
//! (its KV for the positions just computed, from the main model's hidden states and the next
//! tokens), drafting with the block, one verify pass of the pending token and its drafts, the
//! greedy acceptance rule, and the rollback of what rejected drafts left behind.
//! Invariant: after every pass a slot's MTP KV holds the pairs (hidden of position p, token
//! p + 1) for every position before its last, and `hidden` holds the main model's hidden state
//! of its last position, so a step drafts from exactly what plain decoding would have seen;
//! rejected drafts leave nothing: KV cells past the slot's length are overwritten before they
//! are read, and linear state is rolled back to its checkpoint after the last accepted token.

use super::{internal, last, Pipeline, StageOf};
use crate::backend::{Stage, StepKind, WorkBuf};
use crate::engine::{EngineError, SpecStats};
use crate::model::{Forward, MtpInput};

/// A pipeline's speculation state: the plan's draft count, each slot's last main hidden
/// state, host staging (allocated at start-up, sized by the planned pass) and the counters.
pub(super) struct MtpState {
    pub(super) spec: usize,
    e: usize,
    /// Per slot: the main model's hidden state of its last position (`e` floats each).
    hidden: Vec<f32>,
    has_hidden: Vec<bool>,
    /// Rows of `x` read back after a pass, and the MTP pass's hidden rows (`max_tok x e`).
    rows: Vec<f32>,
    mh: Vec<f32>,
    /// The MTP pass's inputs.
    mtok: Vec<u32>,
    mslot: Vec<u32>,
    mpos: Vec<u32>,
    drafts: Vec<u32>,
    picks: Vec<u32>,
    pub(super) stats: SpecStats,
}

impl<B: Stage, M: Forward<B>> Pipeline<B, M> {
    /// This pipeline drafting `spec` tokens per step with the MTP block its last stage holds
    /// (hidden width `e`).
    pub fn with_mtp(mut self, spec: usize, e: usize) -> Result<Self, EngineError> {
        if !last(&mut self.stages).model.holds_mtp() {
            return Err(internal(
                "speculation needs the MTP block on the last stage: re-plan with --mtp --spec N",
            ));
        }
        if self.max_tok < spec + 1 || self.logit_rows < spec + 1 {
            return Err(internal(format!(
                "passes of {} tokens and {} logit rows cannot verify {spec} drafts: re-plan with this strata-plan",
                self.max_tok, self.logit_rows
            )));
        }
        let (slots, t) = (self.info.n_slots, self.max_tok);
        self.mtp = Some(MtpState {
            spec,
            e,
            hidden: vec![0.0; slots * e],
            has_hidden: vec![false; slots],
            rows: vec![0.0; t * e],
            mh: vec![0.0; t * e],
            mtok: Vec::with_capacity(t),
            mslot: Vec::with_capacity(t),
            mpos: Vec::with_capacity(t),
            drafts: vec![0; spec],
            picks: vec![0; spec + 1],
            stats: SpecStats::default(),
        });
        Ok(self)
    }

    /// Forget `slot`'s MTP hidden state (a new sequence).
    pub(super) fn mtp_reset(&mut self, slot: usize) {
        if let Some(m) = self.mtp.as_mut() {
            if let Some(h) = m.has_hidden.get_mut(slot) {
                *h = false;
            }
        }
    }

    /// One pass of the MTP block on the last stage over the `n` tokens staged in `mtok`,
    /// `mslot`, `mpos` with hidden rows `mh` (from `input`); the logits of row 0 when `head`.
    fn mtp_pass(
        &mut self,
        kind: StepKind,
        n: usize,
        input: MtpInput,
        head: bool,
    ) -> Result<(), EngineError> {
        let m = self.mtp.as_mut().ok_or_else(|| internal("no MTP block"))?;
        let StageOf { backend, model } = last(&mut self.stages);
        backend
            .write_buf(WorkBuf::MtpHidden, &m.mh[..n * m.e])
            .map_err(internal)?;
        backend
            .upload_inputs(kind, &m.mtok[..n], &m.mslot[..n], &m.mpos[..n])
            .map_err(internal)?;
        let rows = head.then_some((0, 1));
        backend
            .run(kind, n, &mut |b| model.mtp(b, n, input, rows))
            .map_err(internal)
    }

    /// After a main pass over the `n` tokens staged in `tok`/`slot`/`pos`, of which the first
    /// `keep` stand: run the MTP block over (hidden of position p - 1, token at p) for each
    /// kept token past position 0, writing its KV, and remember each slot's last hidden state.
    pub(super) fn mtp_catch_up(&mut self, keep: usize) -> Result<(), EngineError> {
        let Some(m) = self.mtp.as_mut() else {
            return Ok(());
        };
        let e = m.e;
        last(&mut self.stages)
            .backend
            .read_buf(WorkBuf::X, &mut m.rows[..keep * e])
            .map_err(internal)?;
        m.mtok.clear();
        m.mslot.clear();
        m.mpos.clear();
        for i in 0..keep {
            let (s, p, t) = (self.slot[i] as usize, self.pos[i], self.tok[i]);
            let prev_row = i > 0 && self.slot[i - 1] as usize == s && self.pos[i - 1] + 1 == p;
            let src = if prev_row {
                &m.rows[(i - 1) * e..i * e]
            } else if p > 0 && m.has_hidden[s] {
                &m.hidden[s * e..(s + 1) * e]
            } else {
                // Position 0 (no hidden state before it), or a slot whose earlier positions
                // the block never saw.
                continue;
            };
            let j = m.mtok.len();
            m.mh[j * e..(j + 1) * e].copy_from_slice(src);
            m.mtok.push(t);
            m.mslot.push(s as u32);
            m.mpos.push(p - 1);
        }
        for i in 0..keep {
            let s = self.slot[i] as usize;
            m.hidden[s * e..(s + 1) * e].copy_from_slice(&m.rows[i * e..(i + 1) * e]);
            m.has_hidden[s] = true;
        }
        let n = m.mtok.len();
        if n == 0 {
            return Ok(());
        }
        self.mtp_pass(StepKind::Prefill, n, MtpInput::Main, false)
    }

    /// `nd` drafts for `slot` (length `len`, pending `token`) into `drafts`: the block's
    /// greedy picks, chained on its own hidden state, or `forced`'s tokens in their place.
    fn draft(
        &mut self,
        slot: usize,
        len: u64,
        token: u32,
        nd: usize,
        forced: Option<&[u32]>,
    ) -> Result<(), EngineError> {
        let v = self.info.n_vocab;
        let mut t = token;
        for j in 0..nd {
            let m = self.mtp.as_mut().ok_or_else(|| internal("no MTP block"))?;
            let e = m.e;
            if j == 0 {
                m.mh[..e].copy_from_slice(&m.hidden[slot * e..(slot + 1) * e]);
            } else {
                let MtpState { mh, .. } = m;
                last(&mut self.stages)
                    .backend
                    .read_buf(WorkBuf::X, &mut mh[..e])
                    .map_err(internal)?;
            }
            m.mtok.clear();
            m.mtok.push(t);
            m.mslot.clear();
            m.mslot.push(slot as u32);
            m.mpos.clear();
            m.mpos.push((len - 1) as u32 + j as u32);
            let input = if j == 0 {
                MtpInput::Main
            } else {
                MtpInput::Chained
            };
            self.mtp_pass(StepKind::Decode, 1, input, true)?;
            let mut pick = [0u32];
            let logits = &mut self.logits;
            last(&mut self.stages)
                .backend
                .pick_greedy(&mut logits[..v], &mut pick)
                .map_err(internal)?;
            t = forced.map_or(pick[0], |f| f[j]);
            if let Some(m) = self.mtp.as_mut() {
                m.drafts[j] = t;
            }
        }
        Ok(())
    }

    /// [`crate::engine::Engine::decode_spec_greedy`] on a pipeline with an MTP block.
    pub(super) fn spec_step_greedy(
        &mut self,
        slot: usize,
        token: u32,
        forced: Option<&[u32]>,
        out: &mut [u32],
    ) -> Result<usize, EngineError> {
        self.check_slot(slot, 1)?;
        self.check_tokens(std::iter::once(token).chain(forced.into_iter().flatten().copied()))?;
        let (spec, has_hidden) = match &self.mtp {
            Some(m) => (m.spec, m.has_hidden[slot]),
            None => return Err(internal("no MTP block")),
        };
        let len = self.lens[slot];
        let room = (self.info.max_context - len) as usize;
        let nd = spec
            .min(room.saturating_sub(1))
            .min(forced.map_or(usize::MAX, |f| f.len()))
            .min(out.len().saturating_sub(1));
        if out.is_empty() {
            return Err(EngineError::Request(
                "decode_spec_greedy: no room for the step's tokens".into(),
            ));
        }
        if nd == 0 || len == 0 || !has_hidden {
            self.decode_pass(&[(slot, token)])?;
            let v = self.info.n_vocab;
            let logits = &mut self.logits;
            last(&mut self.stages)
                .backend
                .pick_greedy(&mut logits[..v], &mut out[..1])
                .map_err(internal)?;
            self.lens[slot] += 1;
            return Ok(1);
        }
        self.draft(slot, len, token, nd, forced)?;
        // Verify the pending token and the drafts in one pass.
        let m = self.mtp.as_ref().ok_or_else(|| internal("no MTP block"))?;
        self.tok.clear();
        self.tok.push(token);
        self.tok.extend_from_slice(&m.drafts[..nd]);
        self.slot.clear();
        self.slot.resize(nd + 1, slot as u32);
        self.pos.clear();
        self.pos.extend((0..=nd).map(|i| (len + i as u64) as u32));
        self.pass(StepKind::Verify, nd + 1, Some((0, nd + 1)))?;
        let v = self.info.n_vocab;
        let m = self.mtp.as_mut().ok_or_else(|| internal("no MTP block"))?;
        let logits = &mut self.logits;
        last(&mut self.stages)
            .backend
            .pick_greedy(&mut logits[..(nd + 1) * v], &mut m.picks[..nd + 1])
            .map_err(internal)?;
        let k = (0..nd).take_while(|&j| m.picks[j] == m.drafts[j]).count();
        out[..k + 1].copy_from_slice(&m.picks[..k + 1]);
        m.stats.steps += 1;
        m.stats.drafted += nd as u64;
        m.stats.accepted += k as u64;
        if k < nd {
            for st in &mut self.stages {
                st.backend.rollback_linear(slot, k).map_err(internal)?;
            }
        }
        self.mtp_catch_up(k + 1)?;
        self.lens[slot] += k as u64 + 1;
        Ok(k + 1)
    }
}
