//! The cost model's delta-rule coefficients (Qwen3-Next's Gated DeltaNet) timed with the
//! engine's own launcher, `launch::linear::delta_rule` (`lin_delta_rule` + `lin_gated_norm`),
//! as `forward.rs` calls it: `delta_rule_token_us`, the slope of one slot's prefill run
//! against its tokens (the recurrence walks them one after another per state row), and
//! `delta_rule_latency_us` / `linear_state_gbps`, the line of a decode step's launch (one
//! token a slot) against the state bytes its slots read and write.
//! Invariant: the reference heads are Qwen3-Next-80B's ([`NK`] key heads, [`NV`] value heads
//! of [`D`]); the decode passes cycle through more state than the L2 cache holds; at most
//! [`super::cost::COST_ARENA_BYTES`] of state plus small buffers, all freed on return.

use super::cost::{filled, graph_ms, latency_and_gbps, stream_ms, COST_ARENA_BYTES};
use crate::backend::cuda::launch::linear::{delta_rule, DeltaHeads, DeltaIn, LinSlots, Tokens};
use crate::backend::cuda::launch::Launcher;
use crate::backend::cuda::{CudaDevice, CudaError};

/// Key heads, value heads and their dim (key and value alike): Qwen3-Next-80B's.
pub const NK: usize = 16;
pub const NV: usize = 32;
pub const D: usize = 128;
/// Tokens of the prefill runs whose times are fitted.
pub const PREFILL_TOKENS: [usize; 3] = [64, 256, 1024];
/// Slots of the decode steps (one token each) whose times are fitted.
pub const DECODE_SLOTS: [usize; 3] = [1, 4, 16];
/// Layers of state each decode slot holds; a timed graph cycles through them.
const LAYERS: usize = 16;
/// Timed runs.
const REPS: usize = 10;

fn heads() -> DeltaHeads {
    DeltaHeads {
        nk: NK,
        nv: NV,
        dk: D,
        dv: D,
    }
}

/// Floats of one layer's recurrent state of one slot.
pub fn state_floats() -> usize {
    NV * D * D
}

/// The layer's inputs for `n` tokens, zero-filled (finite gates: beta 1/2, decay 1).
struct Inputs {
    conv: crate::backend::cuda::DeviceArena,
    ba: crate::backend::cuda::DeviceArena,
    z: crate::backend::cuda::DeviceArena,
    small: crate::backend::cuda::DeviceArena,
    out: crate::backend::cuda::DeviceArena,
    pos: crate::backend::cuda::DeviceArena,
    slot: crate::backend::cuda::DeviceArena,
}

impl Inputs {
    /// Buffers for `n` tokens whose slots are `slot_of(t)`, every position 1 (the state is
    /// read, as in a run that continues a context).
    fn new(dev: &CudaDevice, n: usize, slot_of: &dyn Fn(usize) -> u32) -> Result<Self, CudaError> {
        let h = heads();
        let f = |x: usize| 4 * x as u64;
        let s = Self {
            conv: filled(dev, "probe-delta-conv", f(n * h.width()), 0)?,
            ba: filled(dev, "probe-delta-ba", f(n * 2 * NV), 0)?,
            z: filled(dev, "probe-delta-z", f(n * NV * D), 0)?,
            small: filled(dev, "probe-delta-small", f(NV.max(D)), 0)?,
            out: dev.alloc_arena("probe-delta-out", f(n * NV * D))?,
            pos: dev.alloc_arena("probe-delta-pos", f(n))?,
            slot: dev.alloc_arena("probe-delta-slot", f(n))?,
        };
        dev.htod(&vec![1u32; n], s.pos.all())?;
        let slots: Vec<u32> = (0..n).map(slot_of).collect();
        dev.htod(&slots, s.slot.all())?;
        Ok(s)
    }

    fn input(&self) -> Result<DeltaIn<'_>, CudaError> {
        Ok(DeltaIn {
            conv: self.conv.all(),
            ba: self.ba.all(),
            z: self.z.all(),
            dt_bias: self.small.view(0, 4 * NV as u64)?,
            ssm_a: self.small.view(0, 4 * NV as u64)?,
            norm: self.small.view(0, 4 * D as u64)?,
        })
    }

    fn tokens(&self, n: usize) -> Tokens<'_> {
        Tokens {
            pos: self.pos.all(),
            slot: self.slot.all(),
            n,
        }
    }
}

/// µs of one token's step of one layer inside a prefill run: the slope of one slot's run
/// time against its [`PREFILL_TOKENS`] tokens (the intercept, the launches, is the pass's).
pub fn delta_rule_token_us(dev: &CudaDevice) -> Result<f64, String> {
    let e = |e: CudaError| e.to_string();
    let st = filled(dev, "probe-delta-state", 4 * state_floats() as u64, 0).map_err(e)?;
    let l = Launcher::new(dev);
    let mut points = Vec::new();
    for n in PREFILL_TOKENS {
        let inp = Inputs::new(dev, n, &|_| 0).map_err(e)?;
        let ms = stream_ms(dev, REPS, &mut || {
            let slots = LinSlots {
                state: st.all(),
                slots: 1,
                slot_stride: state_floats(),
                layer_off: 0,
                ckpt: None,
            };
            delta_rule(
                &l,
                heads(),
                inp.input()?,
                slots,
                inp.tokens(n),
                inp.out.all(),
                1e-6,
            )
        })
        .map_err(e)?;
        points.push((n as f64, ms * 1e3));
    }
    let (_, slope) = super::cost::fit_line(&points).ok_or("no line through the runs")?;
    if slope <= 0.0 {
        return Err(format!(
            "the run's time does not grow with its tokens: {points:?}"
        ));
    }
    Ok(slope)
}

/// (latency µs, GB/s) of a decode step's delta rule of one layer: one token in each of
/// [`DECODE_SLOTS`] slots, fitted against the state bytes the slots read and write, in
/// graphs cycling through [`LAYERS`] layers of every slot's state.
pub fn delta_rule_decode(dev: &CudaDevice) -> Result<(f64, f64), String> {
    let e = |e: CudaError| e.to_string();
    let layer = state_floats();
    let max_slots = *DECODE_SLOTS.iter().max().unwrap_or(&1);
    let stride = LAYERS * layer;
    let bytes = 4 * (max_slots * stride) as u64;
    if bytes > COST_ARENA_BYTES {
        return Err(format!(
            "{max_slots} slots x {LAYERS} layers of state is {bytes} bytes, over the probe's {COST_ARENA_BYTES}"
        ));
    }
    let st = filled(dev, "probe-delta-decode-state", bytes, 0).map_err(e)?;
    let l = Launcher {
        dev,
        pdl: true,
        prof: None,
        q4k_lanes: false,
    };
    let mut points = Vec::new();
    for s in DECODE_SLOTS {
        let inp = Inputs::new(dev, s, &|t| t as u32).map_err(e)?;
        let ms = graph_ms(dev, REPS, &mut || {
            for i in 0..LAYERS {
                let slots = LinSlots {
                    state: st.all(),
                    slots: max_slots,
                    slot_stride: stride,
                    layer_off: i * layer,
                    ckpt: None,
                };
                delta_rule(
                    &l,
                    heads(),
                    inp.input()?,
                    slots,
                    inp.tokens(s),
                    inp.out.all(),
                    1e-6,
                )?;
            }
            Ok(())
        })
        .map_err(e)?;
        let rw = 2.0 * 4.0 * (s * layer) as f64;
        points.push((rw, ms * 1e3 / LAYERS as f64));
    }
    latency_and_gbps(&points)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference heads are the 80B's, whose state the planner's default scales from
    /// (`DELTA_REF_STATE_BYTES` in planner/src/cost.rs: 32 x 128 x 128 f32).
    #[test]
    fn the_reference_state_is_the_80b_layers() {
        assert_eq!(4 * state_floats(), 32 * 128 * 128 * 4);
        assert_eq!(heads().width(), 2 * 16 * 128 + 32 * 128);
        assert!(4 * (16 * LAYERS * state_floats()) as u64 <= COST_ARENA_BYTES);
    }
}
