//! `strata-exec bench`'s expert-cache counters: hits, misses streamed, misses computed on the
//! CPU and bytes copied host to device over a combination's timed repetitions, beside the
//! plan's predicted hit rate.
//! Invariant: the counts are differences of the engine's cumulative stats taken around the
//! timed repetitions only (warm-up excluded).

use strata_exec::engine::EngineStats;

/// Expert-cache counters of the timed repetitions (warm-up excluded).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct ExpertCounts {
    reps: usize,
    hits: u64,
    misses_streamed: u64,
    /// Misses computed on the CPU from host memory (the hybrid path).
    misses_cpu: u64,
    bytes_streamed: u64,
    /// Of those, the bytes of the prefills and of the decode steps (`steps` a rep).
    pp_bytes: u64,
    tg_bytes: u64,
    steps: usize,
    predicted_hit_rate: f64,
}

impl ExpertCounts {
    pub(super) fn between(
        a: &EngineStats,
        b: &EngineStats,
        reps: usize,
        predicted_hit_rate: f64,
    ) -> Self {
        Self {
            reps,
            hits: b.expert_hits.saturating_sub(a.expert_hits),
            misses_streamed: b.expert_misses.saturating_sub(a.expert_misses),
            misses_cpu: b.expert_misses_cpu.saturating_sub(a.expert_misses_cpu),
            bytes_streamed: b
                .expert_bytes_streamed
                .saturating_sub(a.expert_bytes_streamed),
            pp_bytes: 0,
            tg_bytes: 0,
            steps: 0,
            predicted_hit_rate,
        }
    }

    /// With the PCIe bytes of the prefills and of the decode steps (`steps` a rep).
    pub(super) fn with_pcie(self, pp_bytes: u64, tg_bytes: u64, steps: usize) -> Self {
        Self {
            pp_bytes,
            tg_bytes,
            steps,
            ..self
        }
    }

    /// PCIe bytes of one prefill (all of a rep's sequences) and of one decode step.
    fn pcie(&self) -> (f64, f64) {
        let reps = self.reps.max(1) as f64;
        (
            self.pp_bytes as f64 / reps,
            self.tg_bytes as f64 / (reps * self.steps.max(1) as f64),
        )
    }

    /// Hits over lookups (None without lookups: every expert read in place).
    fn hit_rate(&self) -> Option<f64> {
        let all = self.hits + self.misses_streamed + self.misses_cpu;
        (all > 0).then(|| self.hits as f64 / all as f64)
    }

    pub(super) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "reps": self.reps,
            "hits": self.hits,
            "misses_streamed": self.misses_streamed,
            "misses_cpu": self.misses_cpu,
            "bytes_streamed": self.bytes_streamed,
            "pcie_bytes_per_prefill": self.pcie().0,
            "pcie_bytes_per_decode_step": self.pcie().1,
            "hit_rate": self.hit_rate(),
            "predicted_hit_rate": self.predicted_hit_rate,
        })
    }

    pub(super) fn text(&self) -> String {
        let per = |x: u64| x as f64 / self.reps.max(1) as f64;
        match self.hit_rate() {
            None => format!(
                "experts: every expert read in place (no cache lookups); the plan predicts a hit rate of {:.3}",
                self.predicted_hit_rate
            ),
            Some(r) => format!(
                "experts per rep: {:.0} hits, {:.0} misses streamed ({:.1} MiB host -> device: {:.1} MiB in the prefill, {:.2} MiB a decode step), {:.0} computed on the CPU; hit rate {r:.3}, the plan predicts {:.3}",
                per(self.hits),
                per(self.misses_streamed),
                per(self.bytes_streamed) / (1u64 << 20) as f64,
                self.pcie().0 / (1u64 << 20) as f64,
                self.pcie().1 / (1u64 << 20) as f64,
                per(self.misses_cpu),
                self.predicted_hit_rate
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_counts_are_the_timed_reps_difference() {
        let a = EngineStats {
            expert_hits: 10,
            expert_misses: 4,
            expert_misses_cpu: 1,
            expert_bytes_streamed: 1 << 20,
            kv_cells_in_use: vec![],
            ..EngineStats::default()
        };
        let b = EngineStats {
            expert_hits: 40,
            expert_misses: 14,
            expert_misses_cpu: 7,
            expert_bytes_streamed: 5 << 20,
            kv_cells_in_use: vec![3],
            ..EngineStats::default()
        };
        let c = ExpertCounts::between(&a, &b, 2, 0.5);
        assert_eq!(
            (c.hits, c.misses_streamed, c.misses_cpu, c.bytes_streamed),
            (30, 10, 6, 4 << 20)
        );
        assert_eq!(c.hit_rate(), Some(30.0 / 46.0));
        let t = c.text();
        assert!(
            t.contains("15 hits")
                && t.contains("5 misses")
                && t.contains("2.0 MiB")
                && t.contains("3 computed on the CPU"),
            "{t}"
        );
        assert_eq!(c.json()["misses_cpu"], 6);
        // 1 MiB in the prefills and 3 MiB over 2 reps x 4 decode steps.
        let c = c.with_pcie(1 << 20, 3 << 20, 4);
        assert_eq!(c.pcie(), ((1 << 19) as f64, (3 << 17) as f64));
        assert!(
            c.text()
                .contains("0.5 MiB in the prefill, 0.38 MiB a decode step"),
            "{}",
            c.text()
        );
        assert_eq!(c.json()["pcie_bytes_per_decode_step"], (3 << 17) as f64);
        let none = ExpertCounts::between(&a, &a, 1, 0.9);
        assert_eq!(none.hit_rate(), None);
        assert!(none.text().contains("in place"));
    }
}
