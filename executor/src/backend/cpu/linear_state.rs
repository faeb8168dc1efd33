//! Each slot's linear-attention state on one stage: per linear layer of the stage, the conv
//! state (`(conv_k - 1) x conv channels` f32, token-major, row 0 the oldest input) then the
//! recurrent state (`value heads x head_v x head_k` f32), slot after slot, exactly the bytes
//! the plan's `linear_state` region holds for the stage (`slots x layers x
//! HParams::linear_state_bytes_per_layer`), then, with MTP speculation, `checkpoints` copies
//! of each slot's state (the state after each of the first tokens of a verify pass, so
//! rejected drafts can be rolled back; the planner sizes the region `1 + spec` times). The
//! prefix cache's checkpoint (one more copy of each slot's state, the plan's
//! `prefix_checkpoint` region) lives in its own store.
//! Invariant: a slot's state is what its sequence's tokens so far left there; nothing else
//! writes it, and it is zeroed when the slot starts a new sequence (a token at position 0).
//! A speculation checkpoint is only read back ([`LinearState::restore`]) by the step that
//! wrote it; a prefix checkpoint ([`LinearState::save_prefix`]) by whoever tracks which
//! position it was saved at (the pipeline).

use strata_schemas::dims::Dims;

/// Floats of one layer's state of one slot: (conv, recurrent).
pub fn layer_floats(d: &Dims) -> (usize, usize) {
    (
        d.conv_k.saturating_sub(1) * d.lin_qkv(),
        d.lin_v_heads * d.lin_hv * d.lin_hk,
    )
}

/// Why linear state could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum LinearStateError {
    #[error("the linear_state region holds {got} bytes but {slots} slots x {layers} linear layers x {copies} copies (1 + MTP checkpoints) need {need}: re-plan with this strata-plan")]
    Size {
        got: u64,
        need: u64,
        slots: usize,
        layers: usize,
        copies: usize,
    },
    #[error("the linear_state region is not 4-byte aligned")]
    Align,
    #[error("the prefix_checkpoint region holds {got} bytes but {slots} slots x {layers} linear layers need {need} (4-byte aligned): re-plan with this strata-plan")]
    PrefixSize {
        got: u64,
        need: u64,
        slots: usize,
        layers: usize,
    },
}

enum Store<'a> {
    Owned(Vec<f32>),
    Borrowed(&'a mut [f32]),
}

impl Store<'_> {
    fn floats(&mut self) -> &mut [f32] {
        match self {
            Store::Owned(v) => v,
            Store::Borrowed(s) => s,
        }
    }

    fn len(&self) -> usize {
        match self {
            Store::Owned(v) => v.len(),
            Store::Borrowed(s) => s.len(),
        }
    }
}

/// `floats` f32 at the start of `region`, zeroed; `None` when it is short or misaligned.
fn bind_floats(region: &mut [u8], floats: usize) -> Option<&mut [f32]> {
    if (region.len() as u64) < 4 * floats as u64 {
        return None;
    }
    // SAFETY: any 4 initialized bytes are a valid f32; align_to_mut only yields a correctly
    // aligned middle part, which is checked to be the whole prefix needed.
    let (head, mid, _) = unsafe { region.align_to_mut::<f32>() };
    if !head.is_empty() || mid.len() < floats {
        return None;
    }
    let mid = &mut mid[..floats];
    mid.fill(0.0);
    Some(mid)
}

/// The linear state of every slot of a stage.
pub struct LinearState<'a> {
    store: Store<'a>,
    conv: usize,
    rec: usize,
    layers: usize,
    slots: usize,
    /// Checkpoints kept per slot (the plan's `--spec`; 0 without speculation).
    checkpoints: usize,
    /// The prefix cache's checkpoint of each slot (empty when the plan places none).
    prefix: Store<'a>,
}

impl<'a> LinearState<'a> {
    fn per_slot(&self) -> usize {
        self.layers * (self.conv + self.rec)
    }

    /// Zeroed state owned here (plan-less engines).
    pub fn owned(d: &Dims, layers: usize, slots: usize) -> Self {
        Self::owned_with_checkpoints(d, layers, slots, 0)
    }

    /// Zeroed state owned here with `checkpoints` copies per slot (plan-less engines that
    /// speculate).
    pub fn owned_with_checkpoints(
        d: &Dims,
        layers: usize,
        slots: usize,
        checkpoints: usize,
    ) -> Self {
        let (conv, rec) = layer_floats(d);
        let floats = (1 + checkpoints) * slots * layers * (conv + rec);
        Self {
            store: Store::Owned(vec![0.0; floats]),
            conv,
            rec,
            layers,
            slots,
            checkpoints,
            prefix: Store::Owned(Vec::new()),
        }
    }

    /// The same state with a prefix checkpoint of each slot owned here (plan-less engines).
    pub fn with_owned_prefix(mut self) -> Self {
        self.prefix = Store::Owned(vec![0.0; self.slots * self.per_slot()]);
        self
    }

    /// The same state with each slot's prefix checkpoint in a planned `prefix_checkpoint`
    /// region (its first bytes; the rest is alignment padding).
    pub fn with_prefix_region(mut self, region: &'a mut [u8]) -> Result<Self, LinearStateError> {
        let floats = self.slots * self.per_slot();
        let got = region.len() as u64;
        let mid = bind_floats(region, floats).ok_or(LinearStateError::PrefixSize {
            got,
            need: 4 * floats as u64,
            slots: self.slots,
            layers: self.layers,
        })?;
        self.prefix = Store::Borrowed(mid);
        Ok(self)
    }

    /// State (and `checkpoints` copies per slot) in a planned region (its first bytes; the
    /// rest is alignment padding).
    pub fn bind(
        region: &'a mut [u8],
        d: &Dims,
        layers: usize,
        slots: usize,
        checkpoints: usize,
    ) -> Result<Self, LinearStateError> {
        let (conv, rec) = layer_floats(d);
        let floats = (1 + checkpoints) * slots * layers * (conv + rec);
        let need = 4 * floats as u64;
        if (region.len() as u64) < need {
            return Err(LinearStateError::Size {
                got: region.len() as u64,
                need,
                slots,
                layers,
                copies: 1 + checkpoints,
            });
        }
        let mid = bind_floats(region, floats).ok_or(LinearStateError::Align)?;
        Ok(Self {
            store: Store::Borrowed(mid),
            conv,
            rec,
            layers,
            slots,
            checkpoints,
            prefix: Store::Owned(Vec::new()),
        })
    }

    fn all(&mut self) -> &mut [f32] {
        self.store.floats()
    }

    /// Slots held.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Zero every layer's state of `slot`.
    pub fn clear(&mut self, slot: usize) {
        let per = self.per_slot();
        if slot < self.slots {
            self.all()[slot * per..(slot + 1) * per].fill(0.0);
        }
    }

    /// Copy every layer's state of slot `from` over slot `to`'s (false outside the stage).
    pub fn copy_slot(&mut self, from: usize, to: usize) -> bool {
        if from >= self.slots || to >= self.slots {
            return false;
        }
        let per = self.per_slot();
        self.all()
            .copy_within(from * per..(from + 1) * per, to * per);
        true
    }

    /// (conv state, recurrent state) of `layer` of `slot`, or `None` outside the stage.
    pub fn layer(&mut self, slot: usize, layer: usize) -> Option<(&mut [f32], &mut [f32])> {
        if slot >= self.slots || layer >= self.layers {
            return None;
        }
        let (per, one) = (self.per_slot(), self.conv + self.rec);
        let conv = self.conv;
        let at = slot * per + layer * one;
        let s = &mut self.all()[at..at + one];
        Some(s.split_at_mut(conv))
    }

    /// Linear layers held.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Checkpoints kept per slot.
    pub fn checkpoints(&self) -> usize {
        self.checkpoints
    }

    /// Where checkpoint `j` of `slot`'s `layer` starts.
    fn checkpoint_at(&self, slot: usize, j: usize, layer: usize) -> usize {
        let per = self.per_slot();
        self.slots * per + (slot * self.checkpoints + j) * per + layer * (self.conv + self.rec)
    }

    /// Copy `layer`'s live state of `slot` into its checkpoint `j`; false (nothing copied)
    /// outside the slots, layers or checkpoints.
    pub fn save(&mut self, slot: usize, layer: usize, j: usize) -> bool {
        if slot >= self.slots || layer >= self.layers || j >= self.checkpoints {
            return false;
        }
        let one = self.conv + self.rec;
        let live = slot * self.per_slot() + layer * one;
        let at = self.checkpoint_at(slot, j, layer);
        self.all().copy_within(live..live + one, at);
        true
    }

    /// Set every layer's state of `slot` to its checkpoint `j`; false (nothing copied)
    /// outside the slots or checkpoints.
    pub fn restore(&mut self, slot: usize, j: usize) -> bool {
        if slot >= self.slots || j >= self.checkpoints {
            return false;
        }
        let per = self.per_slot();
        let at = self.checkpoint_at(slot, j, 0);
        self.all().copy_within(at..at + per, slot * per);
        true
    }

    /// Whether each slot has a prefix checkpoint (and there is state to keep).
    pub fn has_prefix(&self) -> bool {
        let need = self.slots * self.per_slot();
        need > 0 && self.prefix.len() >= need
    }

    /// Copy every layer's live state of `slot` into its prefix checkpoint; false (nothing
    /// copied) outside the slots or without prefix checkpoints.
    pub fn save_prefix(&mut self, slot: usize) -> bool {
        self.copy_prefix(slot, true)
    }

    /// Set every layer's state of `slot` to its prefix checkpoint; false (nothing copied)
    /// outside the slots or without prefix checkpoints.
    pub fn restore_prefix(&mut self, slot: usize) -> bool {
        self.copy_prefix(slot, false)
    }

    /// `slot`'s live state into its prefix checkpoint (`save`) or back.
    fn copy_prefix(&mut self, slot: usize, save: bool) -> bool {
        if slot >= self.slots || !self.has_prefix() {
            return false;
        }
        let per = self.per_slot();
        let r = slot * per..(slot + 1) * per;
        let (live, copy) = (self.store.floats(), self.prefix.floats());
        if save {
            copy[r.clone()].copy_from_slice(&live[r]);
        } else {
            live[r.clone()].copy_from_slice(&copy[r]);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn next_dims() -> Dims {
        Dims {
            n_layer: 2,
            e: 8,
            vocab: 8,
            n_head: 2,
            n_head_kv: 1,
            hd: 8,
            hd_v: 8,
            n_rot: 4,
            n_expert: 0,
            k: 0,
            f: 0,
            n_ff: 0,
            n_ff_shexp: 0,
            eps: 1e-6,
            norm_topk: true,
            rope_theta: 1e4,
            n_ctx_train: 16,
            lin_k_heads: 2,
            lin_v_heads: 4,
            lin_hk: 8,
            lin_hv: 8,
            conv_k: 4,
        }
    }

    #[test]
    fn slots_and_layers_do_not_overlap_and_clear_is_per_slot() {
        let d = next_dims();
        let mut s = LinearState::owned(&d, 2, 3);
        let (conv, rec) = layer_floats(&d);
        assert_eq!(conv, 3 * (2 * 2 * 8 + 32));
        assert_eq!(rec, 4 * 8 * 8);
        for slot in 0..3 {
            for l in 0..2 {
                let (c, r) = s.layer(slot, l).unwrap();
                c.fill((slot * 10 + l) as f32);
                r.fill((slot * 10 + l) as f32 + 0.5);
            }
        }
        s.clear(1);
        for slot in 0..3 {
            for l in 0..2 {
                let (c, r) = s.layer(slot, l).unwrap();
                let want = if slot == 1 {
                    0.0
                } else {
                    (slot * 10 + l) as f32
                };
                assert!(c.iter().all(|&v| v == want));
                let want_r = if slot == 1 { 0.0 } else { want + 0.5 };
                assert!(r.iter().all(|&v| v == want_r));
            }
        }
        assert!(s.layer(3, 0).is_none() && s.layer(0, 2).is_none());
    }

    #[test]
    fn a_short_region_is_refused_with_the_sizes() {
        let d = next_dims();
        let mut buf = vec![0u32; 10];
        // SAFETY: u32 storage viewed as bytes, same length in bytes.
        let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, 40) };
        let e = LinearState::bind(bytes, &d, 1, 1, 0).err().unwrap();
        assert!(e.to_string().contains("re-plan"), "{e}");
    }

    #[test]
    fn a_checkpoint_restores_every_layer_of_its_slot_only() {
        let d = next_dims();
        let mut s = LinearState::owned_with_checkpoints(&d, 2, 2, 3);
        let fill = |s: &mut LinearState, v: f32| {
            for slot in 0..2 {
                for l in 0..2 {
                    let (c, r) = s.layer(slot, l).unwrap();
                    c.fill(v + slot as f32);
                    r.fill(v + slot as f32 + 0.5);
                }
            }
        };
        fill(&mut s, 10.0);
        for l in 0..2 {
            assert!(s.save(0, l, 1) && s.save(1, l, 1));
        }
        fill(&mut s, 20.0);
        assert!(s.restore(0, 1));
        for l in 0..2 {
            let (c, r) = s.layer(0, l).unwrap();
            assert!(c.iter().all(|&v| v == 10.0) && r.iter().all(|&v| v == 10.5));
            let (c, _) = s.layer(1, l).unwrap();
            assert!(c.iter().all(|&v| v == 21.0), "slot 1 is untouched");
        }
        assert!(!s.save(0, 0, 3) && !s.restore(2, 0) && !s.restore(0, 3));
    }

    #[test]
    fn a_prefix_checkpoint_restores_its_slot_only_and_needs_its_region() {
        let d = next_dims();
        let mut s = LinearState::owned(&d, 2, 2);
        assert!(!s.save_prefix(0), "no prefix checkpoints without a store");
        let per = 2 * {
            let (c, r) = layer_floats(&d);
            c + r
        };
        let mut short = vec![0u32; 2 * per - 1];
        // SAFETY: u32 storage viewed as bytes, same length in bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(short.as_mut_ptr() as *mut u8, 4 * short.len())
        };
        let e = LinearState::owned(&d, 2, 2)
            .with_prefix_region(bytes)
            .err()
            .unwrap();
        assert!(e.to_string().contains("prefix_checkpoint"), "{e}");
        let mut buf = vec![0u32; 2 * per];
        // SAFETY: as above.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, 4 * buf.len()) };
        let mut s2 = LinearState::owned(&d, 2, 2)
            .with_prefix_region(bytes)
            .unwrap();
        for s in [
            &mut s2,
            &mut LinearState::owned(&d, 2, 2).with_owned_prefix(),
        ] {
            let fill = |s: &mut LinearState, v: f32| {
                for slot in 0..2 {
                    for l in 0..2 {
                        let (c, r) = s.layer(slot, l).unwrap();
                        c.fill(v + slot as f32);
                        r.fill(v + slot as f32 + 0.5);
                    }
                }
            };
            fill(s, 10.0);
            assert!(s.save_prefix(1));
            fill(s, 20.0);
            assert!(s.restore_prefix(1));
            for l in 0..2 {
                let (c, r) = s.layer(1, l).unwrap();
                assert!(c.iter().all(|&v| v == 11.0) && r.iter().all(|&v| v == 11.5));
                let (c, _) = s.layer(0, l).unwrap();
                assert!(c.iter().all(|&v| v == 20.0), "slot 0 is untouched");
            }
            assert!(!s.save_prefix(2) && !s.restore_prefix(2));
        }
        let _ = s;
    }
}
