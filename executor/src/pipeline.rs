//! `Pipeline`: the one [`Engine`] over any backend — the planned devices' stages in order,
//! each a backend [`Stage`] with its part of the model bound ([`Forward`]), driven a pass at a
//! time: prefill in chunks of the planned pass, decode of several slots together, hidden
//! states handed from stage to stage, the head on the last, tokens picked where the backend
//! can (on its device) or from the logits on the host; a prompt chunk and other slots'
//! decode tokens in one pass (`mixed`); with an MTP block, speculative steps (`spec`).
//! Invariant: every request is checked (slot, context, tokens, batch) before any op runs, so
//! a refused request leaves every slot as it was; a pass allocates nothing; slot lengths are
//! the pipeline's, advanced only after a pass succeeded and cut back only by `truncate_slot`
//! (to a prefix the model can keep); a slot's `ckpt` position, when set, is at most its
//! length and its prefix checkpoint holds the linear state after exactly that many of its
//! tokens (set by `save_prefix_checkpoint`, cleared by `reset_slot` and `copy_slot`).

use crate::backend::{Stage, StepKind, WorkBuf};
use crate::engine::EngineStats;
use crate::engine::{
    check_greedy_args, check_sample_args, DecodePick, Engine, EngineError, EngineInfo,
    MixedPrefill, PrefixReuse,
};
use crate::model::Forward;
use crate::routing::RoutingTally;
use crate::sampler::Draw;
use strata_schemas::profile::ExpertProfile;

mod mixed;
mod spec;

/// One planned device: its backend and the part of the model bound on it.
pub struct StageOf<B, M> {
    pub backend: B,
    pub model: M,
}

/// A model bound to its stages, driven as an [`Engine`].
pub struct Pipeline<B: Stage, M: Forward<B>> {
    info: EngineInfo,
    // Dropped before `keep`, whose contents the stages may borrow.
    stages: Vec<StageOf<B, M>>,
    lens: Vec<u64>,
    /// Per slot: the position its linear-state prefix checkpoint was saved at.
    ckpt: Vec<Option<u64>>,
    /// Tokens one pass carries (prefill chunks are split to it).
    max_tok: usize,
    /// Rows of logits the head computes per pass.
    logit_rows: usize,
    logits: Vec<f32>,
    all_rows: Vec<f32>,
    tok: Vec<u32>,
    slot: Vec<u32>,
    pos: Vec<u32>,
    allocations: u64,
    allocated_bytes: u64,
    /// MTP speculation, when the plan asks for it ([`Pipeline::with_mtp`]).
    mtp: Option<spec::MtpState>,
    /// What the stages borrow (arenas, the mapped model file), dropped after them.
    #[allow(dead_code)]
    keep: Vec<Box<dyn std::any::Any + Send>>,
}

/// The sizes a pipeline runs with.
#[derive(Debug, Clone, Copy)]
pub struct PipelineShape {
    /// Tokens of the largest pass (the plan's work pass).
    pub max_tok: usize,
    /// Logit rows per pass (at least the slots).
    pub logit_rows: usize,
    /// Arena and chunk allocations made at start-up, and their bytes.
    pub allocations: u64,
    pub allocated_bytes: u64,
}

fn internal(e: impl std::fmt::Display) -> EngineError {
    EngineError::Internal(e.to_string())
}

/// The last stage (a pipeline has at least one: checked in [`Pipeline::new`]).
fn last<B, M>(stages: &mut [StageOf<B, M>]) -> &mut StageOf<B, M> {
    let i = stages.len() - 1;
    &mut stages[i]
}

impl<B: Stage, M: Forward<B>> Pipeline<B, M> {
    /// A pipeline over `stages` (in order; the last must hold the head), with `keep` alive
    /// until the stages are gone.
    pub fn new(
        info: EngineInfo,
        stages: Vec<StageOf<B, M>>,
        shape: PipelineShape,
        keep: Vec<Box<dyn std::any::Any + Send>>,
    ) -> Result<Self, EngineError> {
        let last = stages
            .last()
            .ok_or_else(|| internal("a pipeline of no stages"))?;
        if !last.model.holds_head() {
            return Err(internal("the last stage does not hold the output head"));
        }
        if shape.max_tok < info.n_slots.max(1) || shape.logit_rows < info.n_slots.max(1) {
            return Err(internal(format!(
                "passes of {} tokens and {} logit rows cannot decode {} slots together: re-plan with this strata-plan",
                shape.max_tok, shape.logit_rows, info.n_slots
            )));
        }
        let v = info.n_vocab;
        Ok(Self {
            lens: vec![0; info.n_slots],
            ckpt: vec![None; info.n_slots],
            max_tok: shape.max_tok,
            logit_rows: shape.logit_rows,
            logits: vec![0.0; shape.logit_rows * v],
            all_rows: Vec::new(),
            tok: Vec::with_capacity(shape.max_tok),
            slot: Vec::with_capacity(shape.max_tok),
            pos: Vec::with_capacity(shape.max_tok),
            allocations: shape.allocations,
            allocated_bytes: shape.allocated_bytes,
            mtp: None,
            info,
            stages,
            keep,
        })
    }

    /// The stages, in pipeline order.
    pub fn stages(&self) -> &[StageOf<B, M>] {
        &self.stages
    }

    /// Tokens one pass carries (prefill chunks longer than this are split).
    pub fn pass_tokens(&self) -> usize {
        self.max_tok
    }

    fn check_slot(&self, slot: usize, more: usize) -> Result<(), EngineError> {
        let len = *self.lens.get(slot).ok_or_else(|| {
            EngineError::Request(format!(
                "slot {slot} does not exist (the plan has {})",
                self.info.n_slots
            ))
        })?;
        if len + more as u64 > self.info.max_context {
            return Err(EngineError::Request(format!(
                "slot {slot} holds {len} of {} cells; {more} more do not fit",
                self.info.max_context
            )));
        }
        Ok(())
    }

    fn check_tokens(&self, tokens: impl Iterator<Item = u32>) -> Result<(), EngineError> {
        for t in tokens {
            if t as usize >= self.info.n_vocab {
                return Err(EngineError::Request(format!(
                    "token {t} is outside the vocabulary of {}",
                    self.info.n_vocab
                )));
            }
        }
        Ok(())
    }

    /// Every stage over the `n` tokens staged in `tok`/`slot`/`pos`; the last stage's head
    /// over rows `head` (first, rows) when given.
    fn pass(
        &mut self,
        kind: StepKind,
        n: usize,
        head: Option<(usize, usize)>,
    ) -> Result<(), EngineError> {
        let n_stages = self.stages.len();
        for i in 0..n_stages {
            let (done, rest) = self.stages.split_at_mut(i);
            let st = &mut rest[0];
            if let Some(prev) = done.last_mut() {
                prev.backend
                    .send_hidden(&mut st.backend, WorkBuf::X, n)
                    .map_err(internal)?;
            }
            let tokens: &[u32] = if i == 0 { &self.tok[..n] } else { &[] };
            st.backend
                .upload_inputs(kind, tokens, &self.slot[..n], &self.pos[..n])
                .map_err(internal)?;
            let last = i + 1 == n_stages;
            let StageOf { backend, model } = st;
            backend
                .run(kind, n, &mut |b| {
                    model.forward(b, n)?;
                    match head {
                        Some((first, rows)) if last => model.head(b, first, rows),
                        _ => Ok(()),
                    }
                })
                .map_err(internal)?;
        }
        Ok(())
    }

    /// Prefill `tokens` into `slot`; `rows`: 0 no logits, 1 the last row's, 2 every row's.
    fn prefill_rows(&mut self, slot: usize, tokens: &[u32], rows: u8) -> Result<(), EngineError> {
        let n = tokens.len();
        if n == 0 || n > self.info.ubatch {
            return Err(EngineError::Request(format!(
                "prefill of {n} tokens: give 1..={} (the plan's ubatch) per call",
                self.info.ubatch
            )));
        }
        self.check_slot(slot, n)?;
        self.check_tokens(tokens.iter().copied())?;
        self.all_rows.clear();
        let v = self.info.n_vocab;
        for (ci, chunk) in tokens.chunks(self.max_tok).enumerate() {
            let base = self.lens[slot] as usize;
            let c = chunk.len();
            self.tok.clear();
            self.tok.extend_from_slice(chunk);
            self.slot.clear();
            self.slot.resize(c, slot as u32);
            self.pos.clear();
            self.pos.extend((0..c).map(|i| (base + i) as u32));
            let last_chunk = (ci + 1) * self.max_tok >= n;
            let head = (rows == 1 && last_chunk).then_some((c - 1, 1));
            self.pass(StepKind::Prefill, c, head)?;
            if rows == 2 {
                let mut r0 = 0;
                while r0 < c {
                    let nr = (c - r0).min(self.logit_rows);
                    let logits = &mut self.logits;
                    let st = last(&mut self.stages);
                    st.model.head(&mut st.backend, r0, nr).map_err(internal)?;
                    st.backend
                        .read_logits(nr, &mut logits[..nr * v])
                        .map_err(internal)?;
                    self.all_rows.extend_from_slice(&logits[..nr * v]);
                    r0 += nr;
                }
            } else if head.is_some() {
                last(&mut self.stages)
                    .backend
                    .read_logits(1, &mut self.logits[..v])
                    .map_err(internal)?;
            } else {
                last(&mut self.stages).backend.sync().map_err(internal)?;
            }
            self.mtp_catch_up(c)?;
            self.lens[slot] += c as u64;
        }
        Ok(())
    }

    /// Check and stage a decode step, run it with the head over every row.
    fn decode_pass(&mut self, batch: &[(usize, u32)]) -> Result<(), EngineError> {
        let n = batch.len();
        if n == 0 || n > self.info.n_slots {
            return Err(EngineError::Request(format!(
                "a decode step takes 1..={} slots, got {n}",
                self.info.n_slots
            )));
        }
        for (i, &(slot, _)) in batch.iter().enumerate() {
            self.check_slot(slot, 1)?;
            if batch[..i].iter().any(|(s, _)| *s == slot) {
                return Err(EngineError::Request(format!(
                    "slot {slot} appears twice in one decode step; a step takes one token per slot"
                )));
            }
        }
        self.check_tokens(batch.iter().map(|(_, t)| *t))?;
        self.tok.clear();
        self.slot.clear();
        self.pos.clear();
        for &(slot, t) in batch {
            self.tok.push(t);
            self.slot.push(slot as u32);
            self.pos.push(self.lens[slot] as u32);
        }
        self.pass(StepKind::Decode, n, Some((0, n)))?;
        self.mtp_catch_up(n)
    }

    fn advance(&mut self, batch: &[(usize, u32)]) {
        for &(slot, _) in batch {
            self.lens[slot] += 1;
        }
    }

    /// Set `slot`'s linear state (every stage) and MTP hidden state back to its prefix
    /// checkpoint. A stage that fails or keeps none leaves the slot half restored: it is
    /// emptied (length 0, no checkpoint) and false returned.
    fn restore_prefix_checkpoint(&mut self, slot: usize) -> bool {
        for st in self.stages.iter_mut() {
            if !matches!(st.backend.restore_linear_checkpoint(slot), Ok(true)) {
                self.lens[slot] = 0;
                self.ckpt[slot] = None;
                self.mtp_reset(slot);
                return false;
            }
        }
        self.mtp_restore_checkpoint(slot);
        true
    }
}

impl<B, M> Engine for Pipeline<B, M>
where
    B: Stage + Send,
    M: Forward<B> + Send,
{
    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn prefill(
        &mut self,
        slot: usize,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, EngineError> {
        self.prefill_rows(slot, tokens, want_logits as u8)?;
        Ok(want_logits.then(|| &self.logits[..self.info.n_vocab]))
    }

    fn decode(&mut self, batch: &[(usize, u32)]) -> Result<&[f32], EngineError> {
        self.decode_pass(batch)?;
        let n = batch.len();
        let v = self.info.n_vocab;
        let logits = &mut self.logits;
        last(&mut self.stages)
            .backend
            .read_logits(n, &mut logits[..n * v])
            .map_err(internal)?;
        self.advance(batch);
        Ok(&self.logits[..n * v])
    }

    fn decode_greedy(
        &mut self,
        batch: &[(usize, u32)],
        out: &mut [u32],
    ) -> Result<(), EngineError> {
        check_greedy_args(batch.len(), out.len())?;
        self.decode_pass(batch)?;
        let n = batch.len();
        let v = self.info.n_vocab;
        let logits = &mut self.logits;
        last(&mut self.stages)
            .backend
            .pick_greedy(&mut logits[..n * v], &mut out[..n])
            .map_err(internal)?;
        self.advance(batch);
        Ok(())
    }

    fn decode_sample(
        &mut self,
        batch: &[(usize, u32)],
        draws: &[Draw],
        out: &mut [u32],
    ) -> Result<(), EngineError> {
        check_sample_args(batch.len(), draws.len(), out.len())?;
        let n = batch.len();
        if draws[..n].iter().all(|d| d.is_greedy()) {
            return self.decode_greedy(batch, out);
        }
        self.decode_pass(batch)?;
        let v = self.info.n_vocab;
        let logits = &mut self.logits;
        last(&mut self.stages)
            .backend
            .pick_sample(&draws[..n], &mut logits[..n * v], &mut out[..n])
            .map_err(internal)?;
        self.advance(batch);
        Ok(())
    }

    fn decode_proc(
        &mut self,
        batch: &[(usize, u32)],
        draws: &[Draw],
        procs: &[crate::pick::RowProc],
        out: &mut [u32],
    ) -> Result<(), EngineError> {
        crate::engine::check_proc_args(batch.len(), draws.len(), procs.len(), out.len())?;
        let n = batch.len();
        if procs[..n].iter().all(|p| p.is_neutral()) {
            return self.decode_sample(batch, draws, out);
        }
        self.decode_pass(batch)?;
        let v = self.info.n_vocab;
        let logits = &mut self.logits;
        last(&mut self.stages)
            .backend
            .pick_proc(
                &draws[..n],
                &procs[..n],
                &mut logits[..n * v],
                &mut out[..n],
            )
            .map_err(internal)?;
        self.advance(batch);
        Ok(())
    }

    fn step_mixed(
        &mut self,
        prefill: MixedPrefill<'_>,
        row: &mut [f32],
        batch: &[(usize, u32)],
        pick: DecodePick<'_>,
    ) -> Result<Option<&[f32]>, EngineError> {
        if self.mtp.is_some() {
            return crate::engine::step_separately(self, prefill, row, batch, pick);
        }
        self.mixed_step(prefill, row, batch, pick)
    }

    fn mixed_chunk(&self, decode_rows: usize) -> usize {
        match self.mixed_room(decode_rows) {
            0 => self.info.ubatch,
            n => n,
        }
    }

    fn reset_slot(&mut self, slot: usize) {
        if let Some(l) = self.lens.get_mut(slot) {
            *l = 0;
        }
        if let Some(c) = self.ckpt.get_mut(slot) {
            *c = None;
        }
        self.mtp_reset(slot);
    }

    fn spec_tokens(&self) -> usize {
        self.mtp.as_ref().map_or(0, |m| m.spec)
    }

    fn decode_spec_greedy(
        &mut self,
        slot: usize,
        token: u32,
        forced: Option<&[u32]>,
        out: &mut [u32],
    ) -> Result<usize, EngineError> {
        if self.mtp.is_none() {
            if out.is_empty() {
                return Err(EngineError::Request(
                    "decode_spec_greedy: no room for the step's tokens".into(),
                ));
            }
            self.decode_greedy(&[(slot, token)], &mut out[..1])?;
            return Ok(1);
        }
        self.spec_step(slot, token, None, forced, out)
    }

    fn decode_spec_sample(
        &mut self,
        slot: usize,
        token: u32,
        draw: &Draw,
        forced: Option<&[u32]>,
        out: &mut [u32],
    ) -> Result<usize, EngineError> {
        if self.mtp.is_none() {
            if out.is_empty() {
                return Err(EngineError::Request(
                    "decode_spec_sample: no room for the step's tokens".into(),
                ));
            }
            self.decode_sample(&[(slot, token)], std::slice::from_ref(draw), &mut out[..1])?;
            return Ok(1);
        }
        self.spec_step(slot, token, Some(draw), forced, out)
    }

    fn prefix_reuse(&self) -> PrefixReuse {
        if self.stages.iter().any(|st| st.model.recurrent()) {
            PrefixReuse::Whole
        } else {
            PrefixReuse::Any
        }
    }

    fn truncate_slot(&mut self, slot: usize, n: u64) -> bool {
        let reuse = self.prefix_reuse();
        let Some(&len) = self.lens.get(slot) else {
            return false;
        };
        // Positions (and so which KV cells a pass reads and writes) come from `lens` with
        // every pass, on every backend: shortening it is enough for a KV cache, whose
        // cells past `n` the next pass overwrites before any reads them. Recurrent state
        // has no cells to drop: the whole context is kept as it is, or the state is set back
        // to the slot's prefix checkpoint when `n` is the position it was saved at.
        let ok = match reuse {
            PrefixReuse::Any => n <= len,
            PrefixReuse::Whole if n == len => true,
            PrefixReuse::Whole if n > 0 && self.ckpt[slot] == Some(n) => {
                self.restore_prefix_checkpoint(slot)
            }
            PrefixReuse::Whole | PrefixReuse::None => false,
        };
        if ok {
            self.lens[slot] = n;
        }
        ok
    }

    fn save_prefix_checkpoint(&mut self, slot: usize) -> Result<bool, EngineError> {
        if self.prefix_reuse() != PrefixReuse::Whole || slot >= self.lens.len() {
            return Ok(false);
        }
        self.ckpt[slot] = None;
        for st in self.stages.iter_mut() {
            if !st.backend.save_linear_checkpoint(slot).map_err(internal)? {
                return Ok(false);
            }
        }
        self.mtp_save_checkpoint(slot);
        self.ckpt[slot] = Some(self.lens[slot]);
        Ok(true)
    }

    fn prefix_checkpoint(&self, slot: usize) -> Option<u64> {
        self.ckpt.get(slot).copied().flatten()
    }

    fn copy_slot(&mut self, from: usize, to: usize) -> Result<bool, EngineError> {
        let n = self.lens.len();
        if from == to || from >= n || to >= n {
            return Ok(false);
        }
        let cells = self.lens[from] as usize;
        self.ckpt[to] = None;
        for st in self.stages.iter_mut() {
            match st.backend.copy_slot(from, to, cells) {
                Ok(true) => {}
                Ok(false) => {
                    // A stage that cannot copy (none today mixes): nothing usable in `to`.
                    self.lens[to] = 0;
                    return Ok(false);
                }
                Err(e) => {
                    self.lens[to] = 0;
                    return Err(internal(e));
                }
            }
        }
        self.lens[to] = cells as u64;
        Ok(true)
    }

    fn slot_len(&self, slot: usize) -> u64 {
        self.lens.get(slot).copied().unwrap_or(0)
    }

    fn stats(&self) -> EngineStats {
        let (mut hits, mut misses, mut streamed, mut cpu) = (0, 0, 0, 0);
        for st in &self.stages {
            let (h, m) = st.backend.expert_counters();
            hits += h;
            misses += m;
            streamed += st.backend.expert_bytes_streamed();
            cpu += st.backend.expert_misses_cpu();
        }
        EngineStats {
            expert_hits: hits,
            expert_misses: misses,
            expert_misses_cpu: cpu,
            expert_bytes_streamed: streamed,
            kv_cells_in_use: self.lens.clone(),
            speculation: self.mtp.as_ref().map(|m| m.stats).unwrap_or_default(),
        }
    }

    fn prefill_all(&mut self, slot: usize, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.prefill_rows(slot, tokens, 2)?;
        Ok(&self.all_rows)
    }

    fn allocations(&self) -> u64 {
        self.allocations
    }

    fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes
    }

    fn routing_profile(&self) -> Option<ExpertProfile> {
        let tallies: Vec<&RoutingTally> = self
            .stages
            .iter()
            .filter_map(|st| st.backend.routing())
            .collect();
        let (layers, experts) = tallies.first()?.dims();
        let mut p = ExpertProfile::uniform(layers as u32, experts as u32);
        for t in tallies {
            t.add_into(&mut p).ok()?;
        }
        Some(p)
    }
}
