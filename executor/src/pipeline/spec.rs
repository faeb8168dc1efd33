//! MTP speculative decoding on a [`Pipeline`]: the MTP block's catch-up after every main pass
//! (its KV for the positions just computed, from the main model's hidden states and the next
//! tokens), drafting with the block, one verify pass of the pending token and its drafts, the
//! greedy acceptance rule, and the rollback of what rejected drafts left behind. Sampled
//! requests use the speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023): draft
//! `d ~ q`, accept with probability `min(1, p(d) / q(d))`, else draw from `max(0, p - q)`
//! renormalised, so every emitted token has the target distribution `p` (the request's
//! temperature, top-k and top-p applied to both). The draft length adapts per slot: a step
//! drafts one more token than the previous step accepted (all accepted: one more than it
//! drafted), between 1 and the plan's N, so a slot whose drafts keep failing verifies two
//! tokens a step instead of N + 1.
//! Invariant: after every pass a slot's MTP KV holds the pairs (hidden of position p, token
//! p + 1) for every position before its last, and `hidden` holds the main model's hidden state
//! of its last position, so a step drafts from exactly what plain decoding would have seen;
//! rejected drafts leave nothing: KV cells past the slot's length are overwritten before they
//! are read, and linear state is rolled back to its checkpoint after the last accepted token.

use super::{internal, last, Pipeline, StageOf};
use crate::backend::{Stage, StepKind, WorkBuf};
use crate::engine::{EngineError, SpecStats};
use crate::model::{Forward, MtpInput};
use crate::sampler::{probs_into, sample_into, uniform, Draw};

/// The draw of draft `j` of a step whose draw is `d` (its own noise key).
fn draft_draw(d: &Draw, j: usize) -> Draw {
    Draw {
        key: d
            .key
            .wrapping_add((j as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .rotate_left(17),
        ..*d
    }
}

/// A pipeline's speculation state: the plan's draft count, each slot's last main hidden
/// state, host staging (allocated at start-up, sized by the planned pass) and the counters.
pub(super) struct MtpState {
    pub(super) spec: usize,
    e: usize,
    /// Per slot: the main model's hidden state of its last position (`e` floats each).
    hidden: Vec<f32>,
    has_hidden: Vec<bool>,
    /// Per slot: `hidden` as it was at the slot's prefix checkpoint (`Engine::truncate_slot`
    /// rewinds to it).
    ck_hidden: Vec<f32>,
    ck_has_hidden: Vec<bool>,
    /// Per slot: drafts its next step makes (1..=spec).
    n_cur: Vec<usize>,
    /// Rows of `x` read back after a pass, and the MTP pass's hidden rows (`max_tok x e`).
    rows: Vec<f32>,
    mh: Vec<f32>,
    /// The MTP pass's inputs.
    mtok: Vec<u32>,
    mslot: Vec<u32>,
    mpos: Vec<u32>,
    drafts: Vec<u32>,
    picks: Vec<u32>,
    /// Sampled steps: each draft's distribution (`spec x vocab`), the target's, scratch.
    q: Vec<f32>,
    p: Vec<f32>,
    cand: Vec<(u32, u32)>,
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
            ck_hidden: vec![0.0; slots * e],
            ck_has_hidden: vec![false; slots],
            n_cur: vec![spec; slots],
            rows: vec![0.0; t * e],
            mh: vec![0.0; t * e],
            mtok: Vec::with_capacity(t),
            mslot: Vec::with_capacity(t),
            mpos: Vec::with_capacity(t),
            drafts: vec![0; spec],
            picks: vec![0; spec + 1],
            q: vec![0.0; spec * self.info.n_vocab],
            p: vec![0.0; self.info.n_vocab],
            cand: Vec::with_capacity(self.info.n_vocab),
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
            if let Some(n) = m.n_cur.get_mut(slot) {
                *n = m.spec;
            }
        }
    }

    /// Keep `slot`'s MTP hidden state with the prefix checkpoint being saved.
    pub(super) fn mtp_save_checkpoint(&mut self, slot: usize) {
        if let Some(m) = self.mtp.as_mut() {
            if slot < m.has_hidden.len() {
                let r = slot * m.e..(slot + 1) * m.e;
                m.ck_hidden[r.clone()].copy_from_slice(&m.hidden[r]);
                m.ck_has_hidden[slot] = m.has_hidden[slot];
            }
        }
    }

    /// Set `slot`'s MTP hidden state to what its prefix checkpoint kept (the MTP KV cells
    /// before the checkpoint are the ones its tokens wrote; later ones are overwritten first).
    pub(super) fn mtp_restore_checkpoint(&mut self, slot: usize) {
        if let Some(m) = self.mtp.as_mut() {
            if slot < m.has_hidden.len() {
                let r = slot * m.e..(slot + 1) * m.e;
                m.hidden[r.clone()].copy_from_slice(&m.ck_hidden[r]);
                m.has_hidden[slot] = m.ck_has_hidden[slot];
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
        draw: Option<&Draw>,
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
            let kind = StepKind::Draft { chained: j > 0 };
            self.mtp_pass(kind, 1, input, true)?;
            let logits = &mut self.logits;
            let backend = &mut last(&mut self.stages).backend;
            let m = self.mtp.as_mut().ok_or_else(|| internal("no MTP block"))?;
            t = match draw {
                None => {
                    let mut pick = [0u32];
                    backend
                        .pick_greedy(&mut logits[..v], &mut pick)
                        .map_err(internal)?;
                    forced.map_or(pick[0], |f| f[j])
                }
                Some(d) => {
                    // Drawn on the host, keeping the draft's distribution q for the rule (a
                    // forced draft is certain: q one-hot on it).
                    backend.read_logits(1, &mut logits[..v]).map_err(internal)?;
                    let q = &mut m.q[j * v..(j + 1) * v];
                    let dj = draft_draw(d, j);
                    let pick = forced
                        .map_or_else(|| sample_into(&logits[..v], &dj, &mut m.cand), |f| f[j]);
                    if forced.is_some() {
                        q.fill(0.0);
                        q[pick as usize] = 1.0;
                    } else {
                        probs_into(&logits[..v], &dj, &mut m.cand, q);
                    }
                    pick
                }
            };
            m.drafts[j] = t;
        }
        Ok(())
    }

    /// The speculative sampling rule over the verify pass's `nd + 1` logit rows (read back):
    /// `picks[..=k]` get the accepted drafts and the step's own token; returns k.
    fn accept_sampled(&mut self, nd: usize, d: &Draw) -> Result<usize, EngineError> {
        let v = self.info.n_vocab;
        let logits = &mut self.logits;
        last(&mut self.stages)
            .backend
            .read_logits(nd + 1, &mut logits[..(nd + 1) * v])
            .map_err(internal)?;
        let m = self.mtp.as_mut().ok_or_else(|| internal("no MTP block"))?;
        for j in 0..nd {
            let row = &logits[j * v..(j + 1) * v];
            probs_into(row, d, &mut m.cand, &mut m.p);
            let q = &m.q[j * v..(j + 1) * v];
            let dj = m.drafts[j] as usize;
            let (pd, qd) = (m.p[dj] as f64, q[dj] as f64);
            let coin = uniform(d.key, 2 * j as u32);
            if qd > 0.0 && coin * qd < pd {
                m.picks[j] = m.drafts[j];
                continue;
            }
            // Rejected: draw from max(0, p - q), renormalised (p itself when that is empty).
            let mut total = 0f64;
            for (pi, qi) in m.p.iter_mut().zip(q) {
                *pi = (*pi - qi).max(0.0);
                total += *pi as f64;
            }
            if total <= 0.0 {
                probs_into(row, d, &mut m.cand, &mut m.p);
                total = m.p.iter().map(|&x| x as f64).sum();
            }
            let target = uniform(d.key, 2 * j as u32 + 1) * total;
            let mut acc = 0f64;
            let mut pick = crate::sampler::argmax(&m.p);
            for (i, &pi) in m.p.iter().enumerate() {
                acc += pi as f64;
                if pi > 0.0 && acc > target {
                    pick = i as u32;
                    break;
                }
            }
            m.picks[j] = pick;
            return Ok(j);
        }
        let bonus = draft_draw(d, nd + 1000);
        m.picks[nd] = sample_into(&logits[nd * v..(nd + 1) * v], &bonus, &mut m.cand);
        Ok(nd)
    }

    /// [`crate::engine::Engine::decode_spec_greedy`] (no `draw`, or a greedy one) and
    /// [`crate::engine::Engine::decode_spec_sample`] on a pipeline with an MTP block.
    pub(super) fn spec_step(
        &mut self,
        slot: usize,
        token: u32,
        draw: Option<&Draw>,
        forced: Option<&[u32]>,
        out: &mut [u32],
    ) -> Result<usize, EngineError> {
        let draw = draw.filter(|d| !d.is_greedy());
        self.check_slot(slot, 1)?;
        self.check_tokens(std::iter::once(token).chain(forced.into_iter().flatten().copied()))?;
        let (spec, has_hidden) = match &self.mtp {
            Some(m) => (m.n_cur[slot].clamp(1, m.spec), m.has_hidden[slot]),
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
            let backend = &mut last(&mut self.stages).backend;
            match draw {
                None => backend.pick_greedy(&mut logits[..v], &mut out[..1]),
                Some(d) => {
                    backend.pick_sample(std::slice::from_ref(d), &mut logits[..v], &mut out[..1])
                }
            }
            .map_err(internal)?;
            self.lens[slot] += 1;
            return Ok(1);
        }
        self.draft(slot, len, token, nd, forced, draw)?;
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
        let k = match draw {
            Some(d) => self.accept_sampled(nd, d)?,
            None => {
                let v = self.info.n_vocab;
                let m = self.mtp.as_mut().ok_or_else(|| internal("no MTP block"))?;
                let logits = &mut self.logits;
                last(&mut self.stages)
                    .backend
                    .pick_greedy(&mut logits[..(nd + 1) * v], &mut m.picks[..nd + 1])
                    .map_err(internal)?;
                (0..nd).take_while(|&j| m.picks[j] == m.drafts[j]).count()
            }
        };
        let m = self.mtp.as_mut().ok_or_else(|| internal("no MTP block"))?;
        out[..k + 1].copy_from_slice(&m.picks[..k + 1]);
        let next = if k == nd { nd + 1 } else { k + 1 };
        m.n_cur[slot] = next.min(m.spec);
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
