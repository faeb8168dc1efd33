//! The prefix cache's choice of a slot: which free slot a new prompt runs in and how many of
//! the tokens it holds to keep (the longest prefix the engine can cut back to: any prefix of
//! a KV cache, the whole context or the prefix checkpoint of recurrent state).
//! Invariant: pure functions of the slots' held tokens and checkpoints; never the whole
//! prompt (its last token is always prefilled, for its logits).

use crate::engine::PrefixReuse;

/// The prefix cache's settings (`--no-prefix-cache`, `--prefix-cache-min`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCache {
    /// Keep each slot's context after its request for the next one to reuse.
    pub enabled: bool,
    /// Fewest matching prompt tokens worth reusing (shorter matches are prefilled anew).
    pub min_tokens: usize,
}

impl Default for PrefixCache {
    fn default() -> Self {
        Self {
            enabled: true,
            min_tokens: 1,
        }
    }
}

/// Leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How many of `cached` (the tokens a slot's context holds) a job with `prompt` can keep:
/// never the whole prompt (the last prompt token is always prefilled, for its logits), only
/// what the engine can cut back to (`reuse`), and 0 below `min` tokens.
pub fn reusable(cached: &[u32], prompt: &[u32], reuse: PrefixReuse, min: usize) -> usize {
    reusable_to(cached, prompt, reuse, min, None)
}

/// [`reusable`] for a slot whose engine also keeps a prefix checkpoint at position `ckpt`:
/// a recurrent engine ([`PrefixReuse::Whole`]) that cannot keep the whole context rewinds
/// to the checkpoint when the prompt shares at least that much.
pub fn reusable_to(
    cached: &[u32],
    prompt: &[u32],
    reuse: PrefixReuse,
    min: usize,
    ckpt: Option<usize>,
) -> usize {
    let lcp = common_prefix(cached, prompt).min(prompt.len().saturating_sub(1));
    let keep = match reuse {
        PrefixReuse::None => 0,
        PrefixReuse::Any => lcp,
        PrefixReuse::Whole if lcp == cached.len() => lcp,
        PrefixReuse::Whole => ckpt.filter(|&c| c <= lcp).unwrap_or(0),
    };
    if keep < min.max(1) {
        0
    } else {
        keep
    }
}

/// A free slot as [`pick_slot`] sees it.
#[derive(Debug, Clone, Copy)]
pub struct FreeSlot<'a> {
    pub slot: usize,
    /// The tokens its context holds.
    pub cached: &'a [u32],
    /// When it was last admitted into or released (larger = more recent).
    pub last_used: u64,
    /// The position of its engine's prefix checkpoint, if any ([`crate::engine::Engine::prefix_checkpoint`]).
    pub checkpoint: Option<usize>,
}

/// The free slot to run `prompt` in and how many of its cached tokens to keep: the longest
/// reusable prefix, ties (no match included) to the least recently used slot, then the
/// lowest id. `None` when no slot is free.
pub fn pick_slot<'a>(
    free: impl IntoIterator<Item = FreeSlot<'a>>,
    prompt: &[u32],
    reuse: PrefixReuse,
    min: usize,
) -> Option<(usize, usize)> {
    free.into_iter()
        .map(|f| (f, reusable_to(f.cached, prompt, reuse, min, f.checkpoint)))
        .min_by_key(|(f, keep)| (std::cmp::Reverse(*keep), f.last_used, f.slot))
        .map(|(f, keep)| (f.slot, keep))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free<'a>(slots: &'a [(usize, &'a [u32], u64)]) -> impl Iterator<Item = FreeSlot<'a>> {
        slots.iter().map(|&(slot, cached, last_used)| FreeSlot {
            slot,
            cached,
            last_used,
            checkpoint: None,
        })
    }

    #[test]
    fn common_prefix_counts_leading_matches() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[5], &[1]), 0);
    }

    #[test]
    fn reusable_leaves_the_last_prompt_token_and_respects_the_engine() {
        use PrefixReuse::*;
        // The whole prompt cached: its last token is prefilled again for its logits.
        assert_eq!(reusable(&[1, 2, 3], &[1, 2, 3], Any, 1), 2);
        assert_eq!(reusable(&[1, 2, 3, 4, 5], &[1, 2, 3], Any, 1), 2);
        // A divergence: the common part only.
        assert_eq!(reusable(&[1, 2, 9, 9], &[1, 2, 3, 4], Any, 1), 2);
        // Recurrent state: only a prompt that extends everything cached.
        assert_eq!(reusable(&[1, 2, 9, 9], &[1, 2, 3, 4], Whole, 1), 0);
        assert_eq!(reusable(&[1, 2], &[1, 2, 3, 4], Whole, 1), 2);
        assert_eq!(reusable(&[1, 2, 3], &[1, 2, 3], Whole, 1), 0);
        // Below the minimum, off, or nothing cached: nothing.
        assert_eq!(reusable(&[1, 2], &[1, 2, 3, 4], Any, 3), 0);
        assert_eq!(reusable(&[1, 2, 3], &[1, 2, 3, 4], Any, 3), 3);
        assert_eq!(reusable(&[1, 2], &[1, 2, 3], None, 1), 0);
        assert_eq!(reusable(&[], &[1, 2, 3], Any, 1), 0);
        assert_eq!(reusable(&[], &[1, 2, 3], Whole, 1), 0);
        assert_eq!(reusable(&[1], &[1], Any, 1), 0);
    }

    #[test]
    fn pick_slot_takes_the_longest_prefix_then_the_least_recently_used() {
        use PrefixReuse::*;
        let p = [1, 2, 3, 4, 5];
        let a: &[u32] = &[1, 2, 3, 9];
        let b: &[u32] = &[1, 2, 3, 4];
        let c: &[u32] = &[7];
        let slots = [(0, a, 5), (1, b, 9), (2, c, 1)];
        assert_eq!(pick_slot(free(&slots), &p, Any, 1), Some((1, 4)));
        // Cache off for the request: the least recently used slot, nothing kept.
        assert_eq!(pick_slot(free(&slots), &p, None, 1), Some((2, 0)));
        // Equal matches: the least recently used wins; then the lowest id.
        let slots = [(3, a, 7), (1, a, 4), (0, c, 0)];
        assert_eq!(pick_slot(free(&slots), &p, Any, 1), Some((1, 3)));
        let slots = [(3, c, 2), (1, c, 2)];
        assert_eq!(pick_slot(free(&slots), &p, Any, 1), Some((1, 0)));
        // Recurrent engines skip a slot they would have to rewind.
        let slots = [(0, a, 0), (1, &[1, 2][..], 9)];
        assert_eq!(pick_slot(free(&slots), &p, Whole, 1), Some((1, 2)));
        assert_eq!(pick_slot(free(&[]), &p, Any, 1), Option::None);
    }

    #[test]
    fn a_recurrent_slot_rewinds_to_its_checkpoint_when_the_prompt_reaches_it() {
        use PrefixReuse::*;
        // Cached: a 3-token prompt (checkpoint at 3) and 2 generated tokens.
        let cached: &[u32] = &[1, 2, 3, 8, 9];
        // The next prompt shares the prompt but not the reply: back to the checkpoint.
        assert_eq!(reusable_to(cached, &[1, 2, 3, 5, 6], Whole, 1, Some(3)), 3);
        // It diverges before the checkpoint: nothing (a rewind further is impossible).
        assert_eq!(reusable_to(cached, &[1, 2, 7, 5], Whole, 1, Some(3)), 0);
        // The same prompt again: its last token must run for logits, so not reachable.
        assert_eq!(reusable_to(cached, &[1, 2, 3], Whole, 1, Some(3)), 0);
        // Extending everything still keeps everything; the minimum still applies.
        assert_eq!(
            reusable_to(cached, &[1, 2, 3, 8, 9, 4], Whole, 1, Some(3)),
            5
        );
        assert_eq!(reusable_to(cached, &[1, 2, 3, 5, 6], Whole, 4, Some(3)), 0);
        // A KV cache ignores the checkpoint: any prefix.
        assert_eq!(reusable_to(cached, &[1, 2, 3, 8, 7], Any, 1, Some(3)), 4);
        // pick_slot sees it through FreeSlot.
        let slots = [FreeSlot {
            slot: 0,
            cached,
            last_used: 0,
            checkpoint: Some(3),
        }];
        assert_eq!(pick_slot(slots, &[1, 2, 3, 4], Whole, 1), Some((0, 3)));
    }
}
