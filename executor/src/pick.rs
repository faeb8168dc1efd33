//! One row's processing before its token is picked ([`RowProc`]): the grammar's token mask,
//! sparse logit edits (`logit_bias`, the repetition penalty, presence/frequency penalties,
//! merged into one [`Edit`] per token), the locally typical cut (host only) and the `min_p`
//! cut. A driver builds it (the server from a request's settings, its history and its
//! grammar); the backend applies it where it picks (`Stage::pick_proc`: the CPU here, CUDA in
//! `sample.cu` with the mask and `min_p` read inside the pick kernels and the edits written
//! into the logits by `sp_edits`).
//! Invariant: [`RowProc::apply`] is the reference every backend repeats, f32 operation for f32
//! operation: mask (disallowed tokens become -inf), then each edit `((l + bias) / or * rep) -
//! pen`, then typical, then `min_p` (below `max + min_p_off` becomes -inf); a neutral field
//! leaves every bit of the row as it was (bias -0.0, rep 1, pen 0 are exact identities), so a
//! neutral `RowProc` picks exactly what [`crate::sampler::sample_into`] picks. The row's
//! soundness (no NaN, no +inf) is judged on the raw logits, before any processing.

use crate::sampler::{row_is_sound, sample_into, Draw, NON_FINITE};

/// The edits of one token: `l' = ((l + bias) > 0 ? (l + bias) / rep : (l + bias) * rep) - pen`.
/// `#[repr(C)]` with the layout of sample.cu's `SpEdit` (16 bytes), copied to the device as is.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Edit {
    pub id: u32,
    /// Added first (`logit_bias`; -0.0, the exact additive identity, when none).
    pub bias: f32,
    /// The repetition penalty's factor (1 when the token was not seen).
    pub rep: f32,
    /// Subtracted last (presence + frequency x count; 0 when none).
    pub pen: f32,
}

impl Edit {
    /// No change to token `id`.
    pub const fn none(id: u32) -> Self {
        Self {
            id,
            bias: -0.0,
            rep: 1.0,
            pen: 0.0,
        }
    }

    /// `l` after this edit (the f32 operations sample.cu's `sp_edits` repeats).
    pub fn apply(&self, l: f32) -> f32 {
        let v = l + self.bias;
        let v = if v > 0.0 { v / self.rep } else { v * self.rep };
        v - self.pen
    }

    /// The bytes a GPU engine copies to the device.
    pub fn to_words(&self) -> [u32; 4] {
        [
            self.id,
            self.bias.to_bits(),
            self.rep.to_bits(),
            self.pen.to_bits(),
        ]
    }
}

/// `edits` as u32 words, four an edit (the bytes a GPU engine copies to the device).
pub fn edit_words(edits: &[Edit]) -> &[u32] {
    // SAFETY: `Edit` is `#[repr(C)]` of four 4-byte fields (u32, f32, f32, f32): no padding,
    // 4-byte aligned, and every bit pattern of its bytes is a valid u32.
    unsafe { std::slice::from_raw_parts(edits.as_ptr() as *const u32, 4 * edits.len()) }
}

/// One row's processing before the pick (all off by default: neutral).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowProc {
    /// Allowed tokens, one bit each (bit `i % 32` of word `i / 32`, llguidance's layout); a
    /// token past the words is disallowed. `None`: every token.
    pub mask: Option<Vec<u32>>,
    /// At most one edit per token id (ids past the vocabulary are ignored).
    pub edits: Vec<Edit>,
    /// Locally typical sampling's mass (host only; sampled draws only).
    pub typical: Option<f32>,
    /// `min_p` as `t * ln(min_p)` (`t` the draw's temperature, 1 for greedy): tokens below
    /// the row's largest finite logit plus this become -inf.
    pub min_p_off: Option<f32>,
}

/// Flags of a row's device header (sample.cu's `SP_PROC_*`).
pub const PROC_MASK: u32 = 1;
pub const PROC_MIN_P: u32 = 2;

impl RowProc {
    /// Everything off, keeping the buffers.
    pub fn clear(&mut self) {
        if let Some(m) = self.mask.as_mut() {
            m.clear();
        }
        self.mask = None;
        self.edits.clear();
        self.typical = None;
        self.min_p_off = None;
    }

    /// Whether this leaves every row untouched.
    pub fn is_neutral(&self) -> bool {
        self.mask.is_none()
            && self.edits.is_empty()
            && self.typical.is_none()
            && self.min_p_off.is_none()
    }

    /// Whether a device holding `max_edits` edits a row can apply this (typical_p runs on
    /// the host only).
    pub fn fits_device(&self, max_edits: usize) -> bool {
        self.typical.is_none() && self.edits.len() <= max_edits
    }

    /// The row's device header: flags, edit count, `min_p` offset's bits, 0.
    pub fn header(&self) -> [u32; 4] {
        let mut flags = 0;
        if self.mask.is_some() {
            flags |= PROC_MASK;
        }
        if self.min_p_off.is_some() {
            flags |= PROC_MIN_P;
        }
        [
            flags,
            self.edits.len() as u32,
            self.min_p_off.unwrap_or(0.0).to_bits(),
            0,
        ]
    }

    /// Whether the mask allows token `i`.
    pub fn allows(&self, i: usize) -> bool {
        match &self.mask {
            None => true,
            Some(m) => m.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1),
        }
    }

    /// Process `row` in place (see the module comment); `temperature` is the draw's (typical
    /// applies only to sampled draws).
    pub fn apply(&self, temperature: f32, row: &mut [f32]) {
        if self.mask.is_some() {
            for (i, l) in row.iter_mut().enumerate() {
                if !self.allows(i) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for e in &self.edits {
            if let Some(l) = row.get_mut(e.id as usize) {
                *l = e.apply(*l);
            }
        }
        if let Some(mass) = self.typical {
            if temperature > 0.0 {
                typical_cut(row, mass, temperature);
            }
        }
        if let Some(off) = self.min_p_off {
            let max = row
                .iter()
                .copied()
                .filter(|v| v.is_finite())
                .fold(f32::NEG_INFINITY, f32::max);
            if max.is_finite() {
                let cut = max + off;
                for l in row.iter_mut() {
                    if *l < cut {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// The token `d` picks from the raw logits `logits` after this processing: copied into
    /// `row`, processed, drawn; [`NON_FINITE`] when the raw row holds NaN or +inf.
    pub fn pick(
        &self,
        logits: &[f32],
        d: &Draw,
        row: &mut Vec<f32>,
        cand: &mut Vec<(u32, u32)>,
    ) -> u32 {
        if !row_is_sound(logits) {
            return NON_FINITE;
        }
        row.clear();
        row.extend_from_slice(logits);
        self.apply(d.temperature, row);
        sample_into(row, d, cand)
    }
}

/// The `min_p` offset of a request's cut under a draw of `temperature`: `t * ln(min_p)` with
/// `t` the temperature (1 for greedy draws); `None` for `min_p <= 0` (off).
pub fn min_p_offset(min_p: f32, temperature: f32) -> Option<f32> {
    if min_p <= 0.0 {
        return None;
    }
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    Some(t * min_p.ln())
}

/// [`RowProc::pick`] for consecutive rows of `n_vocab` raw logits, processed in place:
/// `out[i]` gets row i's token under `draws[i]` and `procs[i]` (as many rows as the shortest
/// gives). The host's `Stage::pick_proc`.
pub fn pick_rows(
    logits: &mut [f32],
    n_vocab: usize,
    draws: &[Draw],
    procs: &[RowProc],
    out: &mut [u32],
) {
    let mut cand = Vec::new();
    for (((o, row), d), p) in out
        .iter_mut()
        .zip(logits.chunks_exact_mut(n_vocab.max(1)))
        .zip(draws)
        .zip(procs)
    {
        *o = if row_is_sound(row) {
            p.apply(d.temperature, row);
            sample_into(row, d, &mut cand)
        } else {
            NON_FINITE
        };
    }
}

/// The `typical_p` cut of `row` at `temperature`: with `lp` the log-softmax of `row /
/// temperature` and `H` its entropy, tokens are ranked by `|-lp - H|` and the smallest
/// prefix whose probability reaches `mass` is kept (at least one token); the rest become
/// `-inf`. Ties in rank keep the lower id first.
pub fn typical_cut(row: &mut [f32], mass: f32, temperature: f32) {
    let max = row
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return;
    }
    let t = temperature as f64;
    let scaled = |v: f32| (v as f64 - max as f64) / t;
    let z: f64 = row
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| scaled(v).exp())
        .sum();
    let lz = z.ln();
    let mut ent = 0.0f64;
    let mut rank: Vec<(f64, u32, f64)> = Vec::new();
    for (i, &v) in row.iter().enumerate() {
        if v.is_finite() {
            let lp = scaled(v) - lz;
            ent -= lp.exp() * lp;
            rank.push((0.0, i as u32, lp));
        }
    }
    for r in rank.iter_mut() {
        r.0 = (-r.2 - ent).abs();
    }
    rank.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut cum = 0.0f64;
    let mut keep = rank.len();
    for (k, r) in rank.iter().enumerate() {
        cum += r.2.exp();
        if cum >= mass as f64 {
            keep = k + 1;
            break;
        }
    }
    for r in &rank[keep..] {
        row[r.1 as usize] = f32::NEG_INFINITY;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neutral_fields_are_exact_identities() {
        let vals = [
            -0.0f32,
            0.0,
            1.5,
            -3.25,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::NEG_INFINITY,
        ];
        for v in vals {
            assert_eq!(Edit::none(0).apply(v).to_bits(), v.to_bits(), "{v}");
        }
        let mut row = vals.to_vec();
        RowProc::default().apply(0.7, &mut row);
        assert!(row
            .iter()
            .zip(vals)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn mask_words_follow_llguidance_bits_and_missing_words_disallow() {
        let p = RowProc {
            mask: Some(vec![0b101, 1 << 31]),
            ..Default::default()
        };
        let allowed: Vec<usize> = (0..70).filter(|&i| p.allows(i)).collect();
        assert_eq!(allowed, [0, 2, 63]);
        let mut row = vec![1.0f32; 70];
        p.apply(0.0, &mut row);
        assert_eq!(crate::sampler::argmax(&row), 0);
        assert_eq!(row.iter().filter(|v| v.is_finite()).count(), 3);
        assert_eq!(p.header()[0], PROC_MASK);
    }

    #[test]
    fn soundness_is_judged_before_the_mask() {
        let p = RowProc {
            mask: Some(vec![0b10]),
            ..Default::default()
        };
        let logits = [f32::NAN, 1.0, 0.0];
        let mut out = [0u32];
        pick_rows(
            &mut logits.clone(),
            3,
            &[Draw::GREEDY],
            std::slice::from_ref(&p),
            &mut out,
        );
        assert_eq!(
            out[0], NON_FINITE,
            "a NaN under the mask still ends the request"
        );
        assert_eq!(
            p.pick(&logits, &Draw::GREEDY, &mut Vec::new(), &mut Vec::new()),
            NON_FINITE
        );
    }
}
