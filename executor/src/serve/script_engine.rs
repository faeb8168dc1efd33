//! A test-support `Engine` that writes a fixed script: whatever the prompt, every sequence's
//! output is `script` token by token, then `end` forever; so the server's output shaping
//! (reasoning, tool calls) is testable with exact model text.
//! Invariant: a sequence's next token depends only on how many tokens it has produced since
//! its last prefill that asked for logits; the chosen token's logit is 0 and every other is
//! -1e4, so greedy and sampled draws alike follow the script.

use crate::engine::{Engine, EngineError, EngineInfo, EngineStats};

/// An [`Engine`] that writes `script`, then `end`.
pub struct ScriptEngine {
    info: EngineInfo,
    script: Vec<u32>,
    end: u32,
    /// Per slot: cells in use, and the index of the next token to write.
    lens: Vec<u64>,
    steps: Vec<usize>,
    logits: Vec<f32>,
}

impl ScriptEngine {
    /// `n_vocab` must exceed every id in `script` and `end`.
    pub fn new(
        script: Vec<u32>,
        end: u32,
        n_vocab: usize,
        n_slots: usize,
        max_context: u64,
    ) -> Self {
        assert!(
            script.iter().chain([&end]).all(|&t| (t as usize) < n_vocab),
            "script token outside the vocabulary"
        );
        Self {
            info: EngineInfo {
                model_name: "strata-script".into(),
                n_slots,
                max_context,
                ubatch: 16,
                n_vocab,
            },
            script,
            end,
            lens: vec![0; n_slots],
            steps: vec![0; n_slots],
            logits: Vec::new(),
        }
    }

    fn next(&mut self, slot: usize) -> u32 {
        let s = self.steps[slot];
        self.steps[slot] += 1;
        self.script.get(s).copied().unwrap_or(self.end)
    }

    fn rows(&mut self, picks: &[u32]) -> &[f32] {
        let v = self.info.n_vocab;
        self.logits.clear();
        self.logits.resize(picks.len() * v, -1e4);
        for (i, &t) in picks.iter().enumerate() {
            self.logits[i * v + t as usize] = 0.0;
        }
        &self.logits
    }

    fn check(&self, slot: usize, more: usize) -> Result<(), EngineError> {
        if slot >= self.lens.len() {
            return Err(EngineError::Request(format!("no slot {slot}")));
        }
        if self.lens[slot] + more as u64 > self.info.max_context {
            return Err(EngineError::Request("context full".into()));
        }
        Ok(())
    }
}

impl Engine for ScriptEngine {
    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn prefill(
        &mut self,
        slot: usize,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, EngineError> {
        self.check(slot, tokens.len())?;
        self.lens[slot] += tokens.len() as u64;
        if !want_logits {
            return Ok(None);
        }
        self.steps[slot] = 0;
        let t = self.next(slot);
        Ok(Some(self.rows(&[t])))
    }

    fn decode(&mut self, batch: &[(usize, u32)]) -> Result<&[f32], EngineError> {
        for &(slot, _) in batch {
            self.check(slot, 1)?;
        }
        let picks: Vec<u32> = batch
            .iter()
            .map(|&(slot, _)| {
                self.lens[slot] += 1;
                self.next(slot)
            })
            .collect();
        Ok(self.rows(&picks))
    }

    fn reset_slot(&mut self, slot: usize) {
        if let Some(l) = self.lens.get_mut(slot) {
            *l = 0;
            self.steps[slot] = 0;
        }
    }

    fn slot_len(&self, slot: usize) -> u64 {
        self.lens.get(slot).copied().unwrap_or(0)
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            kv_cells_in_use: self.lens.clone(),
            ..EngineStats::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_script_then_the_end_token() {
        let mut e = ScriptEngine::new(vec![5, 6], 9, 10, 2, 64);
        let l = e.prefill(1, &[1, 2, 3], true).unwrap().unwrap();
        assert_eq!(crate::sampler::argmax(l), 5);
        let l = e.decode(&[(1, 5)]).unwrap();
        assert_eq!(crate::sampler::argmax(l), 6);
        let l = e.decode(&[(1, 6)]).unwrap();
        assert_eq!(crate::sampler::argmax(l), 9);
        assert_eq!(e.slot_len(1), 5);
        e.reset_slot(1);
        assert_eq!(e.slot_len(1), 0);
    }
}
