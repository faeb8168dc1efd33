//! `strata-exec probe -o FILE` end to end: the file it writes is accepted by the planner's
//! probe reader and by the solver, its host numbers match /proc on this machine, and on a
//! machine with CUDA its device entries hold real, consistent measurements.
//! Invariant: without a CUDA device the GPU test prints `SKIP (no CUDA device): ...` to stderr
//! and checks the CPU fallback instead; it never passes silently.

mod common;

use std::path::Path;
use std::process::Command;
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_schemas::probe::{HardwareProbe, Vendor, GIB};
use strata_schemas::serve::ServeSettings;

fn run_probe(out: &Path) -> (HardwareProbe, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .args(["probe", "-o"])
        .arg(out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "probe failed: {:?}\n{stderr}", o.status);
    assert!(
        o.stdout.is_empty(),
        "probe -o must write the file, not stdout"
    );
    let text = std::fs::read_to_string(out).unwrap();
    let probe = HardwareProbe::from_file(out)
        .unwrap_or_else(|e| panic!("planner's probe reader refused it: {e}\n{text}"));
    (probe, text, stderr)
}

fn meminfo_bytes(key: &str) -> u64 {
    let t = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = t
        .lines()
        .find(|l| l.starts_with(&format!("{key}:")))
        .unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

fn memlock_soft() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = t
        .lines()
        .find(|l| l.starts_with("Max locked memory"))
        .unwrap();
    let soft = line.split_whitespace().nth(3).unwrap();
    (soft != "unlimited").then(|| soft.parse().unwrap())
}

#[test]
fn probe_file_has_this_hosts_memory_and_plans() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("probe.toml");
    let (probe, text, stderr) = run_probe(&out);
    assert!(
        stderr.contains("probe: host RAM"),
        "no progress lines: {stderr}"
    );

    // MemTotal does not move; MemAvailable does, so allow a wide band around it.
    assert_eq!(probe.host.ram_bytes, meminfo_bytes("MemTotal"), "{text}");
    let avail_now = meminfo_bytes("MemAvailable") as f64;
    let avail = probe.host.available_bytes as f64;
    assert!(
        (avail - avail_now).abs() <= (avail_now * 0.25).max(2.0 * GIB as f64),
        "available_bytes {avail} vs MemAvailable now {avail_now}"
    );
    assert!(probe.host.available_bytes <= probe.host.ram_bytes);
    // The child inherits our limits.
    assert_eq!(probe.host.memlock_limit_bytes, memlock_soft(), "{text}");
    assert!(!probe.devices.is_empty());

    // The solver accepts it: plan the tiny reference model on whatever was probed.
    let model = common::data("base");
    let inv = strata_plan::model::load_model(&model).unwrap();
    let settings = ServeSettings {
        max_context: 64,
        pinned_chunk_mib: 1,
        ..ServeSettings::default()
    };
    let req = PlanRequest {
        inventory: &inv,
        model_source: model.display().to_string(),
        probe: &probe,
        probe_source: out.display().to_string(),
        settings: &settings,
        profile: None,
        vision: None,
        mtp_file: None,
    };
    match solve(&req) {
        Ok(Outcome::Planned(p)) => assert!(!p.devices.is_empty(), "a plan with no devices"),
        Ok(_) => panic!("the tiny model did not fit the probed machine:\n{text}"),
        Err(e) => panic!("the solver refused the probe: {e}\n{text}"),
    }
}

#[test]
fn devices_are_measured_or_cpu_fallback_is_loud() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("probe.toml");
    #[cfg(feature = "cuda")]
    let gpus = strata_exec::backend::cuda::probe::device_count();
    #[cfg(not(feature = "cuda"))]
    let gpus: Result<usize, String> = Err("built without the `cuda` feature".into());
    let (probe, text, stderr) = run_probe(&out);
    match gpus {
        Ok(n) if n > 0 => {
            assert_eq!(probe.devices.len(), n, "{text}");
            for d in &probe.devices {
                eprintln!(
                    "device {}: {} {} vram {} free {:?} reserve {:?} h2d {:?} mem {:?} pcie {:?}x{:?}",
                    d.index,
                    d.name,
                    d.arch,
                    d.vram_bytes,
                    d.free_bytes,
                    d.runtime_reserve_bytes,
                    d.h2d_gbps,
                    d.mem_bandwidth_gbps,
                    d.pcie_gen,
                    d.pcie_width
                );
                assert_eq!(d.vendor, Vendor::Nvidia);
                assert!(d.arch.starts_with("sm_") && d.arch.len() >= 5, "{}", d.arch);
                assert!(!d.name.is_empty() && d.vram_bytes > 0);
                let free = d.free_bytes.expect("free_bytes measured");
                assert!(free > 0 && free <= d.vram_bytes, "{text}");
                let reserve = d.runtime_reserve_bytes.expect("runtime reserve measured");
                // At least the context's own use, less than the whole card.
                assert!(reserve >= d.vram_bytes - free, "{text}");
                assert!(reserve > 0 && reserve < d.vram_bytes, "{text}");
                let h2d = d.h2d_gbps.expect("h2d measured");
                assert!(h2d > 0.5 && h2d < 1000.0, "h2d {h2d}");
                if let Some(m) = d.mem_bandwidth_gbps {
                    assert!(m > h2d, "device copy {m} GB/s slower than PCIe {h2d}");
                }
                if let (Some(g), Some(w)) = (d.pcie_gen, d.pcie_width) {
                    assert!((1..=7).contains(&g) && w > 0, "{g} x{w}");
                }
            }
        }
        other => {
            eprintln!(
                "SKIP (no CUDA device): device fields not checked ({}); checking the CPU fallback",
                match other {
                    Ok(_) => "the driver reports 0 devices".to_string(),
                    Err(e) => e.to_string(),
                }
            );
            assert!(
                stderr.contains("no CUDA device: probe holds the host only"),
                "{stderr}"
            );
            assert_eq!(probe.devices.len(), 1, "{text}");
            let d = &probe.devices[0];
            assert_eq!(d.vendor, Vendor::Cpu);
            assert_eq!(d.arch, std::env::consts::ARCH);
            assert!(d.vram_bytes > 0 && d.vram_bytes <= probe.host.available_bytes);
        }
    }
}
