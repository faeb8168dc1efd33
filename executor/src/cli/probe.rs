//! `strata-exec probe`: measure this machine and write the probe file the planner reads.
//! Invariant: reports what it measured; never guesses a number it could not read. Facts the
//! probe schema has no key for go into `#` comments; the text written always parses with
//! `HardwareProbe::from_toml` (checked before it is written).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use strata_schemas::probe::HardwareProbe;

#[derive(clap::Args, Debug, Clone)]
pub struct ProbeArgs {
    /// Where to write the probe file (TOML); default: standard output.
    #[arg(short = 'o', long)]
    pub out: Option<PathBuf>,
    /// Instead of the probe file: pin MIB of host memory with cuMemHostAlloc and with
    /// cuMemHostRegister (anonymous memory, and a mapped file read-only) on GPU 0 and print
    /// whether each counts against `ulimit -l`. Run it under a small limit, e.g.
    /// `(ulimit -l 8192; strata-exec probe --memlock-test 64)`.
    #[arg(long, value_name = "MIB")]
    pub memlock_test: Option<u64>,
}

/// The host facts the probe holds.
#[derive(Debug, Clone, PartialEq)]
struct Host {
    ram_bytes: u64,
    available_bytes: u64,
    /// Soft `Max locked memory`; None = unlimited.
    memlock: Option<u64>,
}

/// `MemTotal` and `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn parse_meminfo(text: &str) -> Result<(u64, u64), String> {
    let field = |key: &str| -> Result<u64, String> {
        let line = text
            .lines()
            .find(|l| l.split(':').next() == Some(key))
            .ok_or_else(|| format!("/proc/meminfo has no {key} line"))?;
        let mut parts = line[key.len() + 1..].split_whitespace();
        let n: u64 = parts
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("/proc/meminfo: cannot read the number in `{line}`"))?;
        match parts.next() {
            Some("kB") => Ok(n * 1024),
            None => Ok(n),
            Some(u) => Err(format!("/proc/meminfo: unknown unit `{u}` in `{line}`")),
        }
    };
    Ok((field("MemTotal")?, field("MemAvailable")?))
}

/// The soft `Max locked memory` of a `/proc/self/limits` text: Ok(None) = unlimited.
fn parse_memlock(text: &str) -> Result<Option<u64>, String> {
    let line = text
        .lines()
        .find(|l| l.starts_with("Max locked memory"))
        .ok_or("/proc/self/limits has no `Max locked memory` line")?;
    let soft = line["Max locked memory".len()..]
        .split_whitespace()
        .next()
        .ok_or_else(|| format!("/proc/self/limits: no soft limit in `{line}`"))?;
    if soft == "unlimited" {
        return Ok(None);
    }
    soft.parse()
        .map(Some)
        .map_err(|_| format!("/proc/self/limits: cannot read `{soft}` in `{line}`"))
}

fn read_host() -> Result<Host, String> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| format!("cannot read /proc/meminfo: {e}"))?;
    let (ram_bytes, available_bytes) = parse_meminfo(&meminfo)?;
    let limits = std::fs::read_to_string("/proc/self/limits")
        .map_err(|e| format!("cannot read /proc/self/limits: {e}"))?;
    let memlock = parse_memlock(&limits)?;
    Ok(Host {
        ram_bytes,
        available_bytes,
        memlock,
    })
}

/// A TOML basic string (JSON's escapes are valid TOML escapes).
fn toml_str(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serializes")
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64)
}

/// A float TOML reads back as a float (always with a decimal point).
#[cfg(feature = "cuda")]
fn toml_f64(v: f64) -> String {
    format!("{v:.1}")
}

fn write_host(out: &mut String, host: &Host) {
    let _ = writeln!(out, "[host]");
    let _ = writeln!(out, "# MemTotal {}", gib(host.ram_bytes));
    let _ = writeln!(out, "ram_bytes = {}", host.ram_bytes);
    let _ = writeln!(
        out,
        "# MemAvailable when probed: {}",
        gib(host.available_bytes)
    );
    let _ = writeln!(out, "available_bytes = {}", host.available_bytes);
    match host.memlock {
        Some(b) => {
            let _ = writeln!(out, "# soft `ulimit -l` ({})", mib(b));
            let _ = writeln!(out, "memlock_limit_bytes = {b}");
        }
        None => {
            let _ = writeln!(
                out,
                "# memlock_limit_bytes absent: `ulimit -l` is unlimited"
            );
        }
    }
    let _ = writeln!(
        out,
        "# disk_read_gbps not measured (absent = 2 GB/s); add it if experts page from disk"
    );
}

/// The CPU device written when no CUDA device is found: the schema needs at least one device.
fn write_cpu_device(out: &mut String, host: &Host) {
    // Half of MemAvailable, in whole GiB: a policy, not a measurement (the other half is for
    // the host's own buffers); the comment says so and how to change it.
    let arena = (host.available_bytes / 2) / (1 << 30) * (1 << 30);
    let arena = arena.max(1 << 30).min(host.available_bytes);
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "# No CUDA device: the CPU backend. vram_bytes is the RAM its arena may use, set to half"
    );
    let _ = writeln!(
        out,
        "# of MemAvailable in whole GiB (a choice, not a measurement): edit it to taste."
    );
    let _ = writeln!(out, "[[device]]");
    let _ = writeln!(out, "index = 0");
    let _ = writeln!(out, "name = \"cpu\"");
    let _ = writeln!(out, "vendor = \"cpu\"");
    let _ = writeln!(out, "arch = {}", toml_str(std::env::consts::ARCH));
    let _ = writeln!(out, "vram_bytes = {arena}");
}

#[cfg(feature = "cuda")]
fn write_cuda_device(out: &mut String, m: &strata_exec::backend::cuda::probe::DeviceMeasure) {
    use strata_exec::backend::cuda::probe::{D2D_BYTES, H2D_BYTES, H2D_REPEATS};
    let _ = writeln!(out);
    let _ = writeln!(out, "[[device]]");
    let _ = writeln!(out, "index = {}", m.ordinal);
    let _ = writeln!(out, "name = {}", toml_str(&m.name));
    let _ = writeln!(out, "vendor = \"nvidia\"");
    let _ = writeln!(out, "arch = {}", toml_str(&m.arch));
    let _ = writeln!(out, "# cuDeviceTotalMem: {}", gib(m.total_bytes));
    let _ = writeln!(out, "vram_bytes = {}", m.total_bytes);
    let _ = writeln!(
        out,
        "# cuMemGetInfo right after the primary context was created"
    );
    let _ = writeln!(out, "free_bytes = {}", m.free_after_context);
    let _ = writeln!(
        out,
        "# total less free once everything below exists ({}):",
        mib(m.runtime_reserve())
    );
    let _ = writeln!(
        out,
        "#   context (and any other process on the device) {}",
        mib(m.total_bytes.saturating_sub(m.free_after_context))
    );
    let _ = writeln!(
        out,
        "#   + {} strata kernel modules {}",
        strata_kernels::all().len(),
        mib(m.free_after_context.saturating_sub(m.free_after_modules))
    );
    let mut last = m.free_after_modules;
    match m.free_after_blas {
        Some(f) => {
            let _ = writeln!(
                out,
                "#   + cuBLAS handle, workspace and kernels after one SGEMM {}",
                mib(last.saturating_sub(f))
            );
            last = f;
        }
        None => {
            let _ = writeln!(out, "#   + cuBLAS: not measured (see notes)");
        }
    }
    if let Some(f) = m.free_after_graph {
        let _ = writeln!(
            out,
            "#   + one captured CUDA graph (memset + copy) {}",
            mib(last.saturating_sub(f))
        );
    }
    let _ = writeln!(
        out,
        "#   not included: cuBLASLt, NCCL, graphs of the real decode step"
    );
    let _ = writeln!(out, "runtime_reserve_bytes = {}", m.runtime_reserve());
    match m.d2d_gbps {
        Some(g) => {
            let _ = writeln!(
                out,
                "# device-to-device copy of {}, bytes read + written per second",
                mib(D2D_BYTES)
            );
            let _ = writeln!(out, "mem_bandwidth_gbps = {}", toml_f64(g));
        }
        None => {
            let _ = writeln!(
                out,
                "# mem_bandwidth_gbps not measured (absent = 300 GB/s): add the datasheet figure"
            );
        }
    }
    if let Some(g) = m.h2d_gbps {
        let _ = writeln!(
            out,
            "# {H2D_REPEATS} copies of {} from pinned host memory, timed with events",
            mib(H2D_BYTES)
        );
        let _ = writeln!(out, "h2d_gbps = {}", toml_f64(g));
    }
    match m.pcie {
        Some(l) => {
            let _ = writeln!(
                out,
                "# sysfs {} current link, read after the copy test (max: gen {} x{})",
                m.pci_bus_id,
                l.max_gen.map_or("?".into(), |g| g.to_string()),
                l.max_width.map_or("?".into(), |w| w.to_string())
            );
            let _ = writeln!(out, "pcie_gen = {}", l.gen);
            let _ = writeln!(out, "pcie_width = {}", l.width);
        }
        None => {
            let _ = writeln!(
                out,
                "# pcie_gen/pcie_width: no link files in /sys/bus/pci/devices/{}",
                m.pci_bus_id
            );
        }
    }
    let _ = writeln!(
        out,
        "# devices whose memory this one reads directly (cuDeviceCanAccessPeer): a layer split's hand-off between them is a peer copy"
    );
    let peers: Vec<String> = m.peers.iter().map(|p| p.to_string()).collect();
    let _ = writeln!(out, "peers = [{}]", peers.join(", "));
    let _ = writeln!(
        out,
        "# kernel modules opened in {:.1}s ({} from the disk cache)",
        m.open_seconds, m.modules_from_cache
    );
    for n in &m.notes {
        let _ = writeln!(out, "# note: {n}");
    }
    // Last: `[device.cost]` is a sub-table of this device, so nothing of the device follows.
    if let Some(c) = &m.cost {
        out.push_str(&strata_exec::backend::cuda::probe::cost::cost_toml(c));
    }
}

/// Why no CUDA device entries were written.
enum NoCuda {
    /// No library, no driver or no device: the CPU fallback applies.
    Absent(String),
    /// A device exists but measuring it failed: an error, not a fallback.
    #[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code))]
    Failed(String),
}

/// Measures every CUDA device.
#[cfg(feature = "cuda")]
fn cuda_devices(out: &mut String) -> Result<usize, NoCuda> {
    use strata_exec::backend::cuda::probe;
    let count = probe::device_count().map_err(|e| NoCuda::Absent(e.to_string()))?;
    if count == 0 {
        return Err(NoCuda::Absent("the CUDA driver reports 0 devices".into()));
    }
    eprintln!("probe: {count} CUDA device(s)");
    for i in 0..count {
        let m = probe::measure_device(i, &mut |line| eprintln!("probe: {line}"))
            .map_err(|e| NoCuda::Failed(format!("measuring CUDA device {i}: {e}")))?;
        for n in &m.notes {
            eprintln!("probe: device {i}: note: {n}");
        }
        write_cuda_device(out, &m);
    }
    Ok(count)
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices(_out: &mut String) -> Result<usize, NoCuda> {
    Err(NoCuda::Absent(
        "this strata-exec was built without the `cuda` feature".into(),
    ))
}

/// Measures every AMD device (a `--features hip` build; the code is in `backend::hip::probe`).
#[cfg(feature = "hip")]
fn amd_devices(out: &mut String) -> Result<usize, NoCuda> {
    use strata_exec::backend::hip::probe;
    let count = probe::count().map_err(NoCuda::Absent)?;
    if count == 0 {
        return Err(NoCuda::Absent(
            "the HIP runtime reports 0 AMD devices".into(),
        ));
    }
    eprintln!("probe: {count} AMD device(s)");
    for i in 0..count {
        let m = probe::measure_device(i, count, &mut |line| eprintln!("probe: {line}"))
            .map_err(|e| NoCuda::Failed(format!("measuring AMD device {i}: {e}")))?;
        for n in &m.notes {
            eprintln!("probe: device {i}: note: {n}");
        }
        out.push_str(&probe::device_toml(&m));
    }
    Ok(count)
}

#[cfg(not(feature = "hip"))]
fn amd_devices(_out: &mut String) -> Result<usize, NoCuda> {
    Err(NoCuda::Absent(
        "this strata-exec was built without the `hip` feature (no AMD devices probed)".into(),
    ))
}

/// The whole probe text: host, then every CUDA device, else every AMD device, else one CPU
/// device.
fn probe_text() -> Result<String, String> {
    eprintln!("probe: reading /proc/meminfo and /proc/self/limits");
    let host = read_host()?;
    eprintln!(
        "probe: host RAM {}, available {}, memlock {}",
        gib(host.ram_bytes),
        gib(host.available_bytes),
        host.memlock.map_or("unlimited".into(), mib)
    );
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Hardware probe written by `strata-exec probe` on this machine (unix time {}).",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );
    let _ = writeln!(
        out,
        "# Measured values; `#` lines hold facts the probe schema has no key for.\n"
    );
    write_host(&mut out, &host);
    let mut devices = String::new();
    let found = cuda_devices(&mut devices).or_else(|e| match e {
        NoCuda::Absent(why) => {
            eprintln!("probe: {why}");
            amd_devices(&mut devices)
        }
        failed => Err(failed),
    });
    match found {
        Ok(_) => out.push_str(&devices),
        Err(NoCuda::Failed(why)) => return Err(why),
        Err(NoCuda::Absent(why)) => {
            eprintln!("probe: {why}");
            eprintln!(
                "probe: no CUDA device: probe holds the host only (nor AMD); add devices by hand or run on the GPU machine (a `cpu` device is written since the format needs one)"
            );
            write_cpu_device(&mut out, &host);
        }
    }
    Ok(out)
}

fn write_out(text: &str, out: Option<&Path>) -> Result<(), String> {
    match out {
        Some(p) => {
            std::fs::write(p, text).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
            eprintln!("probe: wrote {}", p.display());
            Ok(())
        }
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

pub fn main(args: ProbeArgs) {
    if let Some(mib) = args.memlock_test {
        return memlock_test(mib);
    }
    let text = probe_text().unwrap_or_else(|e| super::fail(format!("probe: {e}")));
    // What we write must be what the planner accepts; a failure here is our bug.
    if let Err(e) = HardwareProbe::from_toml(&text, "the probe just measured") {
        super::fail(format!(
            "probe: the measured probe does not validate ({e}); this is a bug, the text was:\n{text}"
        ))
    }
    write_out(&text, args.out.as_deref()).unwrap_or_else(|e| super::fail(format!("probe: {e}")));
}

#[cfg(feature = "cuda")]
fn memlock_test(mib: u64) {
    use strata_exec::backend::cuda::memlock::probe_memlock;
    if mib == 0 {
        super::fail("--memlock-test: give the MiB to pin, e.g. 64 (more than `ulimit -l`)");
    }
    match probe_memlock(0, mib << 20) {
        Ok(r) => print!("{}", r.text()),
        Err(e) => super::fail(format!("--memlock-test: {e}")),
    }
}

#[cfg(not(feature = "cuda"))]
fn memlock_test(_mib: u64) {
    super::fail(
        "--memlock-test pins memory through CUDA: rebuild strata-exec with the `cuda` feature",
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_are_read_in_bytes() {
        let t = "MemTotal:       16318412 kB\nMemFree:  100 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(
            parse_meminfo(t).unwrap(),
            (16318412 * 1024, 12000000 * 1024)
        );
        let e = parse_meminfo("MemTotal: 5 kB\n").unwrap_err();
        assert!(e.contains("MemAvailable"), "{e}");
    }

    #[test]
    fn memlock_soft_limit_or_unlimited() {
        let t = "Limit                     Soft Limit           Hard Limit           Units\nMax locked memory         8388608              8388608              bytes\n";
        assert_eq!(parse_memlock(t).unwrap(), Some(8388608));
        let u = t.replace(
            "8388608              8388608",
            "unlimited            unlimited",
        );
        assert_eq!(parse_memlock(&u).unwrap(), None);
        assert!(parse_memlock("Max open files 1 1 files\n").is_err());
    }

    #[test]
    fn names_with_quotes_stay_valid_toml() {
        assert_eq!(toml_str("a \"b\" \\c"), r#""a \"b\" \\c""#);
    }
}
