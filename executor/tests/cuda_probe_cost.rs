//! `strata-exec probe` on a CUDA machine writes every `[device.cost]` key, each measured with
//! the engine's kernels, positive and within what the device can physically do, and the
//! planner then predicts from measurements (no key defaulted).
//! Invariant: without a CUDA device the test prints `SKIP (no CUDA device): ...` to stderr
//! and checks nothing else; it never passes silently.
#![cfg(feature = "cuda")]

use std::process::Command;
use strata_schemas::probe::HardwareProbe;

#[test]
fn probe_measures_every_cost_key() {
    match strata_exec::backend::cuda::probe::device_count() {
        Ok(n) if n > 0 => {}
        other => {
            eprintln!(
                "SKIP (no CUDA device): [device.cost] not checked ({})",
                match other {
                    Ok(_) => "the driver reports 0 devices".to_string(),
                    Err(e) => e.to_string(),
                }
            );
            return;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("probe.toml");
    let t = std::time::Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .args(["probe", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    eprintln!("{stderr}");
    assert!(o.status.success(), "probe failed: {:?}\n{stderr}", o.status);
    let text = std::fs::read_to_string(&out).unwrap();
    eprintln!("{text}");
    eprintln!("probe took {:.1}s", t.elapsed().as_secs_f64());
    let probe = HardwareProbe::from_file(&out).unwrap();
    for d in &probe.devices {
        let c = d
            .cost
            .as_ref()
            .unwrap_or_else(|| panic!("device {}: no [device.cost]\n{text}", d.index));
        for (key, v) in c.entries() {
            let v = v.unwrap_or_else(|| panic!("device {}: {key} missing\n{text}", d.index));
            assert!(v.is_finite() && v > 0.0, "{key} = {v}");
        }
        let bw = d.mem_bandwidth_gbps.expect("mem_bandwidth_gbps measured");
        let (p, a) = (c.product_gbps.unwrap(), c.attention_gbps.unwrap());
        assert!(
            p <= 1.1 * bw && p >= 0.05 * bw,
            "product {p} GB/s vs copy {bw}"
        );
        assert!(
            a <= 1.1 * bw && a >= 0.02 * bw,
            "attention {a} GB/s vs copy {bw}"
        );
        let launch = c.launch_us.unwrap();
        assert!((0.2..50.0).contains(&launch), "launch_us {launch}");
        let pl = c.product_latency_us.unwrap();
        assert!(pl < 200.0, "product_latency_us {pl}");
        let al = c.attention_latency_us.unwrap();
        assert!(al < 500.0, "attention_latency_us {al}");
        let step = c.step_us.unwrap();
        assert!(step < 2000.0, "step_us {step}");
        // Dense tensor-core peaks stay under 5 PFLOP/s on any current GPU.
        let (g, f) = (c.gemm_tflops.unwrap(), c.prefill_attention_tflops.unwrap());
        assert!(g > 0.5 && g < 5000.0, "gemm_tflops {g}");
        assert!(f > 0.1 && f < 5000.0, "prefill_attention_tflops {f}");
        assert_eq!(
            c.host_expert_gbps, d.h2d_gbps,
            "host_expert_gbps is the h2d copy"
        );
        assert!(c.complete());
    }
}
