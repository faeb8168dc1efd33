//! The probe's cost measurement on a CUDA machine (`probe::measure_device` and the
//! `[device.cost]` text `strata-exec probe` writes): every key present, positive, within what
//! the device can physically do, and read back by the planner's probe parser (no key left to
//! a default).
//! Invariant: without a CUDA device the test prints `SKIP (no CUDA device): ...` to stderr
//! and checks nothing else; it never passes silently.
#![cfg(feature = "cuda")]

use strata_exec::backend::cuda::probe;
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
    // Through the library (not the CLI binary, whose build path is not on the GPU machine):
    // the same measure_device and [device.cost] text `strata-exec probe` writes.
    let n = strata_exec::backend::cuda::probe::device_count().unwrap();
    let mut text = String::from("[host]\nram_bytes = 1\navailable_bytes = 1\n");
    for i in 0..n {
        let t = std::time::Instant::now();
        let m = probe::measure_device(i, &mut |l| eprintln!("probe: {l}")).unwrap();
        eprintln!("device {i} measured in {:.1}s", t.elapsed().as_secs_f64());
        let cost = m
            .cost
            .as_ref()
            .unwrap_or_else(|| panic!("no cost: {:?}", m.notes));
        text.push_str(&format!(
            "[[device]]\nindex = {i}\nname = \"g\"\nvendor = \"nvidia\"\narch = \"{}\"\nvram_bytes = {}\nmem_bandwidth_gbps = {:.1}\nh2d_gbps = {:.1}\n{}",
            m.arch,
            m.total_bytes,
            m.d2d_gbps.expect("mem bandwidth measured"),
            m.h2d_gbps.expect("h2d measured"),
            probe::cost::cost_toml(cost)
        ));
    }
    eprintln!("{text}");
    let probe = HardwareProbe::from_toml(&text, "measured").unwrap();
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
        // Misses copy one expert matrix at a time from pageable memory: never faster than
        // the pinned bulk copy (with rounding of the two figures).
        let (h, pinned) = (c.host_expert_gbps.unwrap(), d.h2d_gbps.unwrap());
        assert!(
            h <= 1.1 * pinned + 0.1,
            "host_expert_gbps {h} vs pinned {pinned}"
        );
        // The decode expert products read within the copy rate; the grouped products stay
        // under the tensor-core peak bound used above.
        let xg = c.expert_gbps.unwrap();
        assert!(
            xg <= 1.1 * bw && xg >= 0.05 * bw,
            "expert {xg} GB/s vs copy {bw}"
        );
        assert!(c.expert_latency_us.unwrap() < 500.0);
        let xp = c.expert_pass_gbps.unwrap();
        assert!(
            xp <= 1.1 * bw && xp >= 0.02 * bw,
            "expert pass {xp} GB/s vs copy {bw}"
        );
        let xt = c.expert_gemm_tflops.unwrap();
        assert!(xt > 0.5 && xt < 5000.0, "expert_gemm_tflops {xt}");
        assert!(c.complete());
        // Every weight type the engine runs has all four rates, each within the bounds of
        // its family above, and Q8_0's entry agrees with the family keys (the same kernels).
        for ty in probe::types::TYPES {
            let r = c
                .type_rates(ty)
                .unwrap_or_else(|| panic!("device {}: no types.{}\n{text}", d.index, ty.name()));
            for (key, v) in r.entries() {
                let v = v.unwrap_or_else(|| panic!("types.{}.{key} missing\n{text}", ty.name()));
                let ok = if key.ends_with("gbps") {
                    v <= 1.1 * bw && v >= 0.02 * bw
                } else {
                    v > 0.5 && v < 5000.0
                };
                assert!(ok, "types.{}.{key} = {v} (copy {bw} GB/s)", ty.name());
            }
        }
        let q8 = c.type_rates(strata_schemas::ggml::GgmlType::Q8_0).unwrap();
        let near = |a: f64, b: f64| (a / b - 1.0).abs() < 0.25;
        assert!(near(q8.product_gbps.unwrap(), p), "{q8:?} vs {p}");
        assert!(near(q8.gemm_tflops.unwrap(), g), "{q8:?} vs {g}");
        // The host paths' round trips (hybrid.rs and kv_host_attn.rs timed whole) and the
        // eager launch: measured, and within what one layer's synchronisations can cost.
        for (key, v) in c.host_entries() {
            let v = v.unwrap_or_else(|| panic!("device {}: {key} missing\n{text}", d.index));
            assert!(v.is_finite() && v >= 0.0, "{key} = {v}");
        }
        let trip = c.host_round_trip_us.unwrap();
        assert!(trip > 1.0 && trip < 100_000.0, "host_round_trip_us {trip}");
        let kv_trip = c.kv_host_round_trip_us.unwrap();
        assert!(
            kv_trip > 1.0 && kv_trip < 100_000.0,
            "kv_host_round_trip_us {kv_trip}"
        );
        let eager = c.eager_launch_us.unwrap();
        assert!((0.2..100.0).contains(&eager), "eager_launch_us {eager}");
        // The grouped products say at what shape they were measured: probe/experts.rs's
        // 512 tokens, top-8 of 128 experts.
        assert_eq!(c.expert_gemm_tokens_per_expert, Some(32.0), "{text}");
        // The delta rule (probe/linear.rs): a token's step of one layer is a serial chain of
        // warp reductions, well under the 19.7 µs of the kernel it replaced and over the
        // ~0.05 µs a launch-free loop iteration could take; the decode state moves within the
        // copy rate, and each layer's launch pair costs what launches do.
        for (key, v) in c.linear_entries() {
            let v = v.unwrap_or_else(|| panic!("device {}: {key} missing\n{text}", d.index));
            assert!(v.is_finite() && v > 0.0, "{key} = {v}");
        }
        let tok = c.delta_rule_token_us.unwrap();
        assert!((0.05..19.7).contains(&tok), "delta_rule_token_us {tok}");
        let st = c.linear_state_gbps.unwrap();
        assert!(
            st <= 1.1 * bw && st >= 0.02 * bw,
            "linear_state_gbps {st} vs copy {bw}"
        );
        let dl = c.delta_rule_latency_us.unwrap();
        assert!(dl < 500.0, "delta_rule_latency_us {dl}");
    }
}
