//! The bench's output: llama-bench-style table rows (model file, size, params, backend,
//! test, t/s mean ± sd, per-sequence t/s, the plan's prediction and measured / predicted)
//! and one JSON object per combination.
//! Invariant: formats only; every figure comes from the measurements and the plan passed in.

use super::measure::Combo;
use strata_exec::sampler::SamplingParams;

/// Mean and sample standard deviation (0 for one value).
pub fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, var.sqrt())
}

/// measured / predicted, 0 without a prediction.
pub fn ratio(m: f64, p: f64) -> f64 {
    if p > 0.0 {
        m / p
    } else {
        0.0
    }
}

/// The decode row's suffix naming its sampling (empty for greedy).
pub fn sampled_label(s: &SamplingParams) -> String {
    if s.temperature <= 0.0 {
        return String::new();
    }
    let mut l = format!(" T{}", s.temperature);
    if s.top_k > 0 {
        l += &format!(" top-k {}", s.top_k);
    }
    if s.top_p < 1.0 {
        l += &format!(" top-p {}", s.top_p);
    }
    l
}

/// The test column, as llama-bench names it: `pp512`, `tg128`, `pp512 @ d4096`, plus ` b4`
/// for four parallel sequences (and the tg row's sampling).
pub fn test_label(kind: &str, tokens: usize, c: &Combo, sampled: &str) -> String {
    let mut l = format!("{kind}{tokens}");
    if c.depth > 0 {
        l += &format!(" @ d{}", c.depth);
    }
    if c.batch > 1 {
        l += &format!(" b{}", c.batch);
    }
    l + sampled
}

/// Parameters in llama-bench's unit (billions), or millions for small models.
pub fn params_label(params: u64) -> String {
    if params >= 1_000_000_000 {
        format!("{:.2} B", params as f64 / 1e9)
    } else {
        format!("{:.2} M", params as f64 / 1e6)
    }
}

pub fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

pub const HEADER: &str = "| model | size | params | backend | test | t/s | per-seq t/s | plan predicts t/s | measured / predicted |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_name_depth_batch_and_draw() {
        let c = Combo {
            prompt: 512,
            n_gen: 128,
            batch: 4,
            depth: 4096,
        };
        assert_eq!(test_label("pp", 512, &c, ""), "pp512 @ d4096 b4");
        let one = Combo {
            batch: 1,
            depth: 0,
            ..c
        };
        assert_eq!(test_label("tg", 128, &one, " T0.8"), "tg128 T0.8");
        assert_eq!(params_label(30_530_000_000), "30.53 B");
        assert_eq!(params_label(1_500_000), "1.50 M");
    }

    #[test]
    fn sd_of_one_value_is_zero() {
        assert_eq!(mean_sd(&[3.0]), (3.0, 0.0));
        let (m, s) = mean_sd(&[1.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((s - 2f64.sqrt()).abs() < 1e-12);
    }
}
