//! The seam between the executor and whoever drives it (the CLI, the HTTP server): a fixed
//! set of slots, prefill in chunks, decode of several slots together.
//! Invariant: an engine never allocates per token after start-up, and every slot's context is
//! bounded by `EngineInfo::max_context` (the plan's); requests beyond it are refused, not grown.

/// What a driver needs to know about an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    /// Model name (for `/v1/models`).
    pub model_name: String,
    /// Planned slots.
    pub n_slots: usize,
    /// Planned cells per slot (prompt + generated tokens).
    pub max_context: u64,
    /// Largest prefill chunk.
    pub ubatch: usize,
    pub n_vocab: usize,
}

/// Counters a driver reports (e.g. on `/metrics`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub expert_hits: u64,
    /// Misses copied into the cache (streamed).
    pub expert_misses: u64,
    /// Misses computed on the host CPU instead (the CUDA engine's hybrid path).
    pub expert_misses_cpu: u64,
    /// Bytes of expert weights copied host -> device for misses (PCIe traffic).
    pub expert_bytes_streamed: u64,
    /// Context cells in use, per slot.
    pub kv_cells_in_use: Vec<u64>,
    /// Speculative decoding (MTP drafts) since start-up.
    pub speculation: SpecStats,
}

/// Speculative decoding counters: steps run, draft tokens proposed, and those the model
/// accepted (each step also emits one token of its own after the accepted drafts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecStats {
    pub steps: u64,
    pub drafted: u64,
    pub accepted: u64,
}

/// Which prefixes of a slot's context an engine can keep ([`Engine::truncate_slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixReuse {
    /// None: every request starts from an empty slot.
    None,
    /// Any prefix (a KV cache: the cells past it are simply overwritten).
    Any,
    /// Only the whole context, or the position of the slot's prefix checkpoint
    /// ([`Engine::prefix_checkpoint`]): recurrent state, such as Qwen3-Next's linear
    /// attention, summarises every token so far and is rewound only to a saved copy.
    Whole,
}

/// A request an engine cannot run, or a failure inside it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request is wrong (bad slot, context overflow, token out of the vocabulary).
    #[error("{0}")]
    Request(String),
    /// Something failed inside the engine.
    #[error("engine failure: {0}")]
    Internal(String),
}

/// `decode_greedy`'s arguments agree: an output for every entry of the step.
pub fn check_greedy_args(batch: usize, out: usize) -> Result<(), EngineError> {
    if out < batch {
        return Err(EngineError::Request(format!(
            "decode_greedy: room for {out} tokens, the step has {batch}"
        )));
    }
    Ok(())
}

/// `decode_sample`'s arguments agree: a draw and an output for every entry of the step.
pub fn check_sample_args(batch: usize, draws: usize, out: usize) -> Result<(), EngineError> {
    if draws < batch || out < batch {
        return Err(EngineError::Request(format!(
            "decode_sample: the step has {batch} entries but {draws} draws and room for {out} tokens"
        )));
    }
    Ok(())
}

/// `decode_proc`'s arguments agree: a draw, a processing and an output for every entry.
pub fn check_proc_args(
    batch: usize,
    draws: usize,
    procs: usize,
    out: usize,
) -> Result<(), EngineError> {
    check_sample_args(batch, draws, out)?;
    if procs < batch {
        return Err(EngineError::Request(format!(
            "decode_proc: the step has {batch} entries but {procs} row processings"
        )));
    }
    Ok(())
}

/// The prompt chunk of a mixed step ([`Engine::step_mixed`]): `tokens` appended to `slot`'s
/// context as [`Engine::prefill`] would, with the last token's logits when `want_logits`.
#[derive(Debug, Clone, Copy)]
pub struct MixedPrefill<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
    pub want_logits: bool,
}

/// How a mixed step's decode rows are picked.
#[derive(Debug)]
pub enum DecodePick<'a> {
    /// Return their logits (`batch.len() x n_vocab`), as [`Engine::decode`] does.
    Logits,
    /// Draw them as [`Engine::decode_sample`] does: `out[i]` from row i with `draws[i]`.
    Sample {
        draws: &'a [crate::sampler::Draw],
        out: &'a mut [u32],
    },
    /// Draw them as [`Engine::decode_proc`] does: `out[i]` from row i after `procs[i]`,
    /// with `draws[i]`.
    Proc {
        draws: &'a [crate::sampler::Draw],
        procs: &'a [crate::pick::RowProc],
        out: &'a mut [u32],
    },
}

/// [`Engine::step_mixed`] as two steps: the prefill chunk (its last row copied into `row`),
/// then the decode step. What an engine that cannot mix them in one pass does.
pub fn step_separately<'e, E: Engine + ?Sized>(
    e: &'e mut E,
    prefill: MixedPrefill<'_>,
    row: &mut [f32],
    batch: &[(usize, u32)],
    pick: DecodePick<'_>,
) -> Result<Option<&'e [f32]>, EngineError> {
    check_mixed_args(e.info().n_vocab, &prefill, row.len(), batch, &pick)?;
    let v = e.info().n_vocab;
    if let Some(l) = e.prefill(prefill.slot, prefill.tokens, prefill.want_logits)? {
        row[..v].copy_from_slice(&l[..v]);
    }
    match pick {
        DecodePick::Logits => e.decode(batch).map(Some),
        DecodePick::Sample { draws, out } => e.decode_sample(batch, draws, out).map(|()| None),
        DecodePick::Proc { draws, procs, out } => {
            e.decode_proc(batch, draws, procs, out).map(|()| None)
        }
    }
}

/// A mixed step's arguments agree: room for the prompt row when asked, the prompt's slot
/// not among the decode slots, a draw and an output for every decode entry.
pub fn check_mixed_args(
    n_vocab: usize,
    prefill: &MixedPrefill<'_>,
    row: usize,
    batch: &[(usize, u32)],
    pick: &DecodePick<'_>,
) -> Result<(), EngineError> {
    if prefill.want_logits && row < n_vocab {
        return Err(EngineError::Request(format!(
            "step_mixed: room for {row} logits of the prompt's last row, the vocabulary has {n_vocab}"
        )));
    }
    if batch.iter().any(|&(s, _)| s == prefill.slot) {
        return Err(EngineError::Request(format!(
            "step_mixed: slot {} both prefills and decodes in one step",
            prefill.slot
        )));
    }
    match pick {
        DecodePick::Logits => Ok(()),
        DecodePick::Sample { draws, out } => check_sample_args(batch.len(), draws.len(), out.len()),
        DecodePick::Proc { draws, procs, out } => {
            check_proc_args(batch.len(), draws.len(), procs.len(), out.len())
        }
    }
}

/// A model bound to planned memory, driven one step at a time.
pub trait Engine: Send {
    fn info(&self) -> &EngineInfo;
    /// Append up to `info().ubatch` prompt tokens to `slot`'s context. When `want_logits`,
    /// returns the logits (n_vocab) of the last token fed.
    fn prefill(
        &mut self,
        slot: usize,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, EngineError>;
    /// One decode step of several slots together: entry i appends `token` to `slot` and
    /// gets logits row i (`batch.len() x n_vocab`).
    fn decode(&mut self, batch: &[(usize, u32)]) -> Result<&[f32], EngineError>;
    /// One decode step like [`Engine::decode`] whose next tokens are picked greedily: `out[i]`
    /// gets the argmax of row i's logits (lowest id on ties, NaN never wins; see
    /// [`crate::sampler::argmax`]). Engines that can pick on their device override it and
    /// skip bringing the logits back; this default picks from [`Engine::decode`]'s rows.
    fn decode_greedy(
        &mut self,
        batch: &[(usize, u32)],
        out: &mut [u32],
    ) -> Result<(), EngineError> {
        check_greedy_args(batch.len(), out.len())?;
        let v = self.info().n_vocab;
        let n = batch.len();
        let logits = self.decode(batch)?;
        crate::sampler::argmax_rows(logits, v, &mut out[..n]);
        Ok(())
    }
    /// One decode step like [`Engine::decode`] whose next tokens are drawn: `out[i]` gets
    /// [`crate::sampler::sample_with`]`(row i, draws[i])`. Engines that can sample on their
    /// device override it and skip bringing the logits back; this default samples from
    /// [`Engine::decode`]'s rows on the host.
    fn decode_sample(
        &mut self,
        batch: &[(usize, u32)],
        draws: &[crate::sampler::Draw],
        out: &mut [u32],
    ) -> Result<(), EngineError> {
        check_sample_args(batch.len(), draws.len(), out.len())?;
        if draws[..batch.len()].iter().all(|d| d.is_greedy()) {
            return self.decode_greedy(batch, out);
        }
        let v = self.info().n_vocab;
        let n = batch.len();
        let logits = self.decode(batch)?;
        crate::sampler::sample_rows(logits, v, &draws[..n], &mut out[..n]);
        Ok(())
    }
    /// One decode step like [`Engine::decode_sample`] whose rows are processed first:
    /// `out[i]` gets the token `draws[i]` picks from row i after `procs[i]` (grammar mask,
    /// logit edits, `min_p`, typical; [`crate::pick::RowProc`]). Engines that sample on their
    /// device override it and apply what they can there; this default processes and picks
    /// [`Engine::decode`]'s rows on the host, the reference.
    fn decode_proc(
        &mut self,
        batch: &[(usize, u32)],
        draws: &[crate::sampler::Draw],
        procs: &[crate::pick::RowProc],
        out: &mut [u32],
    ) -> Result<(), EngineError> {
        check_proc_args(batch.len(), draws.len(), procs.len(), out.len())?;
        let n = batch.len();
        if procs[..n].iter().all(|p| p.is_neutral()) {
            return self.decode_sample(batch, draws, out);
        }
        let v = self.info().n_vocab;
        let mut rows = self.decode(batch)?.to_vec();
        crate::pick::pick_rows(&mut rows, v, &draws[..n], &procs[..n], &mut out[..n]);
        Ok(())
    }

    /// One step of a prompt chunk and a decode step of other slots together (chunked
    /// prefill: a long prompt does not stall the other slots' tokens). The chunk is appended
    /// as [`Engine::prefill`] would (with `want_logits`, its last row's logits copied into
    /// `row`, `n_vocab` long); the decode step is [`Engine::decode`]'s (returned, with
    /// [`DecodePick::Logits`]) or [`Engine::decode_sample`]'s (into `out`, `None` returned).
    /// Everything is checked before anything runs; a failure after that may leave any slot
    /// of the step half written (the caller resets them all). Engines that run both in one
    /// pass override it; this default runs them apart ([`step_separately`]).
    fn step_mixed(
        &mut self,
        prefill: MixedPrefill<'_>,
        row: &mut [f32],
        batch: &[(usize, u32)],
        pick: DecodePick<'_>,
    ) -> Result<Option<&[f32]>, EngineError> {
        step_separately(self, prefill, row, batch, pick)
    }
    /// The most prompt tokens [`Engine::step_mixed`] takes beside `decode_rows` decode rows
    /// (the planned pass's tokens less the decode rows where both share one pass).
    fn mixed_chunk(&self, decode_rows: usize) -> usize {
        let _ = decode_rows;
        self.info().ubatch
    }
    /// Draft tokens per speculative step ([`Engine::decode_spec_greedy`]): the plan's
    /// `--spec` where the engine runs the model's MTP block; 0 when it does not speculate.
    fn spec_tokens(&self) -> usize {
        0
    }
    /// One greedy speculative step of `slot`, whose last picked token `token` is not yet in
    /// its context: the MTP block drafts up to [`Engine::spec_tokens`] tokens, one pass
    /// verifies `token` and the drafts, and `out` gets the drafts the model agrees with
    /// followed by the model's own next pick (the tokens plain greedy decoding would give);
    /// returns how many (1 ..= spec + 1). The slot's context then holds `token` and the
    /// accepted drafts. `forced` (a test mode): draft these tokens instead of the block's
    /// picks (the block still runs, so a step costs the same). Engines that do not speculate
    /// run one plain greedy step.
    fn decode_spec_greedy(
        &mut self,
        slot: usize,
        token: u32,
        forced: Option<&[u32]>,
        out: &mut [u32],
    ) -> Result<usize, EngineError> {
        let _ = forced;
        if out.is_empty() {
            return Err(EngineError::Request(
                "decode_spec_greedy: no room for the step's tokens".into(),
            ));
        }
        self.decode_greedy(&[(slot, token)], &mut out[..1])?;
        Ok(1)
    }
    /// [`Engine::decode_spec_greedy`] for a sampled request: the drafts are drawn from the
    /// MTP block's distribution and accepted by the speculative sampling rule, so each token
    /// has the distribution `draw`'s settings give the model's own logits (not the same
    /// tokens as a plain sampled run: the randomness is used differently). `forced` drafts
    /// count as certain. Engines that do not speculate run one plain sampled step.
    fn decode_spec_sample(
        &mut self,
        slot: usize,
        token: u32,
        draw: &crate::sampler::Draw,
        forced: Option<&[u32]>,
        out: &mut [u32],
    ) -> Result<usize, EngineError> {
        let _ = forced;
        if out.is_empty() {
            return Err(EngineError::Request(
                "decode_spec_sample: no room for the step's tokens".into(),
            ));
        }
        self.decode_sample(&[(slot, token)], std::slice::from_ref(draw), &mut out[..1])?;
        Ok(1)
    }
    /// Forget `slot`'s context so it can take a new request.
    fn reset_slot(&mut self, slot: usize);
    /// Which prefixes of a slot's context [`Engine::truncate_slot`] can keep.
    fn prefix_reuse(&self) -> PrefixReuse {
        PrefixReuse::None
    }
    /// Keep the first `n` cells of `slot`'s context and forget the rest, so the next
    /// prefill continues the sequence from position `n` (a prefix cache). Returns false, and
    /// leaves the slot as it was, when the engine cannot (see [`Engine::prefix_reuse`]) or
    /// `n` is beyond the slot's length. With [`PrefixReuse::Whole`], `n` is the slot's length
    /// or its [`Engine::prefix_checkpoint`] (the state is restored from the checkpoint; a
    /// restore that fails inside the engine leaves the slot empty and returns false).
    fn truncate_slot(&mut self, slot: usize, n: u64) -> bool {
        let _ = (slot, n);
        false
    }
    /// Save `slot`'s recurrent state at its current length as its prefix checkpoint (the
    /// plan's `prefix_checkpoint` region), replacing the one before, so
    /// [`Engine::truncate_slot`] can later rewind the slot to this position. `Ok(false)`,
    /// and no checkpoint, where the engine keeps none (no recurrent state, or a plan made
    /// with `--no-prefix-checkpoint`).
    fn save_prefix_checkpoint(&mut self, slot: usize) -> Result<bool, EngineError> {
        let _ = slot;
        Ok(false)
    }
    /// The position `slot`'s prefix checkpoint was saved at, while it is valid (cleared when
    /// the slot is reset or copied over).
    fn prefix_checkpoint(&self, slot: usize) -> Option<u64> {
        let _ = slot;
        None
    }
    /// Make slot `to` hold a copy of slot `from`'s context (KV cells and recurrent state),
    /// so `to` continues `from`'s sequence (the `n` choices of one prompt prefill it once).
    /// `Ok(false)` where the engine cannot (the caller then prefills `to` itself); `to`'s old
    /// context is not to be used after either answer.
    fn copy_slot(&mut self, from: usize, to: usize) -> Result<bool, EngineError> {
        let _ = (from, to);
        Ok(false)
    }
    /// Cells of `slot`'s context in use.
    fn slot_len(&self, slot: usize) -> u64;
    fn stats(&self) -> EngineStats;
    /// Like [`Engine::prefill`] but returns the logits of every token fed
    /// (`tokens.len() x n_vocab`), e.g. for `--logits`. Engines that cannot keep every row
    /// say so.
    fn prefill_all(&mut self, slot: usize, tokens: &[u32]) -> Result<&[f32], EngineError> {
        let _ = (slot, tokens);
        Err(EngineError::Request(
            "this engine returns the logits of the last prompt token only".into(),
        ))
    }
    /// Arena and chunk allocations made at start-up (0 when the engine has no plan).
    fn allocations(&self) -> u64 {
        0
    }
    /// Bytes of every planned arena and chunk allocated.
    fn allocated_bytes(&self) -> u64 {
        0
    }
    /// The router's picks since start-up as a routing profile of the model's main blocks
    /// (`schemas/PROFILE.md`), for `strata-exec profile`; `None` when this engine does not
    /// count them.
    fn routing_profile(&self) -> Option<strata_schemas::profile::ExpertProfile> {
        None
    }
}
