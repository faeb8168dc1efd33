//! `strata-exec probe` on AMD GPUs: what the HIP runtime reports (name, gfx target, wave
//! size, compute units, VRAM and free memory), what our own start-up costs (kernel modules
//! and one captured graph, read as the drop in free memory), the PCIe slot link from sysfs,
//! and timed copies (host-to-device from pinned memory, device-to-device); written as the
//! same `[[device]]` TOML as CUDA's with `vendor = "amd"`.
//! Invariant: every number in an `AmdMeasure` was read from the runtime, sysfs or a timed
//! copy; what could not be measured is left out and said in a note.

use super::device::{device_count, HipDevice};
use super::{DeviceInfo, HipError};
use crate::backend::pcie::{self, PcieLink};
use std::fmt::Write as _;
use std::path::Path;

/// Bytes of one timed host-to-device copy.
pub const H2D_BYTES: u64 = 64 << 20;
/// Timed copies per measurement.
pub const H2D_REPEATS: u32 = 8;
/// Bytes of the device-to-device copy (read + written are counted).
pub const D2D_BYTES: u64 = 256 << 20;

/// One AMD device, measured.
#[derive(Debug, Clone)]
pub struct AmdMeasure {
    pub info: DeviceInfo,
    pub free_after_open: u64,
    pub free_after_modules: u64,
    pub free_after_graph: u64,
    pub h2d_gbps: Option<f64>,
    pub d2d_gbps: Option<f64>,
    /// The slot's link (and the sysfs folder it was read from).
    pub pcie: Option<(PcieLink, String)>,
    pub peers: Vec<usize>,
    pub compiler: String,
    pub open_seconds: f64,
    pub modules_from_cache: usize,
    pub notes: Vec<String>,
}

impl AmdMeasure {
    /// Device memory our start-up takes (runtime, modules, one graph), by free memory.
    pub fn runtime_reserve(&self) -> u64 {
        self.info.total_bytes.saturating_sub(self.free_after_graph)
    }
}

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64)
}

/// The number of AMD devices, or why there are none to measure (no ROCm, no device).
pub fn count() -> Result<usize, String> {
    super::check_libraries().map_err(|e| e.to_string())?;
    device_count().map_err(|e| e.to_string())
}

/// Measures device `ordinal` of `count`; `progress` receives one line per step.
pub fn measure_device(
    ordinal: usize,
    count: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<AmdMeasure, HipError> {
    let t = std::time::Instant::now();
    let mut dev = HipDevice::open_bare(ordinal)?;
    let info = dev.info().clone();
    let (free_after_open, _) = dev.mem_info()?;
    progress(&format!(
        "device {ordinal}: {} ({}, wave{}, {} CUs), {} total, {} free after open",
        info.name,
        info.target.id(),
        info.warp_size,
        info.compute_units,
        mib(info.total_bytes),
        mib(free_after_open)
    ));
    dev.load_kernels()?;
    let open_seconds = t.elapsed().as_secs_f64();
    let (free_after_modules, _) = dev.mem_info()?;
    progress(&format!(
        "device {ordinal}: kernel modules compiled by {} in {open_seconds:.1}s ({} from cache), {} free",
        dev.compiler(),
        dev.modules_from_cache,
        mib(free_after_modules)
    ));
    let _graph = graph_step(&dev)?;
    let (free_after_graph, _) = dev.mem_info()?;
    let mut notes = Vec::new();
    let mut timed = |what: &str, r: Result<f64, HipError>, notes: &mut Vec<String>| match r {
        Ok(g) => {
            progress(&format!("device {ordinal}: {what} {g:.1} GB/s"));
            Some(g)
        }
        Err(e) => {
            notes.push(format!("{what} not measured: {e}"));
            None
        }
    };
    let h2d_gbps = timed("host-to-device", h2d_step(&dev), &mut notes);
    let d2d_gbps = timed("device-to-device", d2d_step(&dev), &mut notes);
    // Read the link right after the copies: idle GPUs train their link down to save power.
    let pcie = read_slot_link(Path::new("/sys/bus/pci/devices"), &info.pci_bus_id);
    match &pcie {
        Some((l, _)) if l.max_gen.is_some_and(|m| m > l.gen) => notes.push(format!(
            "PCIe link runs below its maximum (gen {} of gen {}) even after the copy test",
            l.gen,
            l.max_gen.unwrap_or(0)
        )),
        Some(_) => {}
        None => notes.push(format!(
            "no PCIe link files in sysfs for {}",
            info.pci_bus_id
        )),
    }
    let mut peers = Vec::new();
    for p in (0..count).filter(|&p| p != ordinal) {
        if dev.can_access_peer(p)? {
            peers.push(p);
        }
    }
    Ok(AmdMeasure {
        compiler: dev.compiler().to_string(),
        modules_from_cache: dev.modules_from_cache,
        info,
        free_after_open,
        free_after_modules,
        free_after_graph,
        h2d_gbps,
        d2d_gbps,
        pcie,
        peers,
        open_seconds,
        notes,
    })
}

/// The slot link of `bus_id` and the folder it came from.
pub fn read_slot_link(root: &Path, bus_id: &str) -> Option<(PcieLink, String)> {
    let dir = pcie::slot_link_dir(root, bus_id)?;
    let link = pcie::read_link(&dir)?;
    let name = dir.file_name()?.to_string_lossy().into_owned();
    Some((link, name))
}

/// Captures a memset and a copy into a graph and runs it once (its memory is part of the
/// runtime reserve the planner keeps).
fn graph_step(dev: &HipDevice) -> Result<super::HipGraph, HipError> {
    let a = dev.alloc_arena("probe-graph", 1 << 20)?;
    let s = dev.stream();
    let g = dev.capture(s, || {
        dev.memset_async(a.view(0, 1 << 19)?, 1, s)?;
        dev.dtod_async(a.view(0, 1 << 19)?, a.view(1 << 19, 1 << 19)?, s)
    })?;
    g.launch(s)?;
    s.synchronize()?;
    Ok(g)
}

fn h2d_step(dev: &HipDevice) -> Result<f64, HipError> {
    let host = dev.alloc_pinned(H2D_BYTES as usize)?;
    let a = dev.alloc_arena("probe-h2d", H2D_BYTES)?;
    let s = dev.stream();
    let (t0, t1) = (dev.new_event()?, dev.new_event()?);
    // SAFETY: host is pinned and outlives the copies: the stream is synchronized below.
    unsafe { dev.htod_async(host.as_slice(), a.all(), s)? };
    t0.record(s)?;
    for _ in 0..H2D_REPEATS {
        // SAFETY: as above.
        unsafe { dev.htod_async(host.as_slice(), a.all(), s)? };
    }
    t1.record(s)?;
    t1.synchronize()?;
    let ms = t0.elapsed_ms(&t1)? as f64;
    Ok(H2D_BYTES as f64 * H2D_REPEATS as f64 / (ms / 1e3) / 1e9)
}

fn d2d_step(dev: &HipDevice) -> Result<f64, HipError> {
    let a = dev.alloc_arena("probe-d2d", 2 * D2D_BYTES)?;
    let (src, dst) = (a.view(0, D2D_BYTES)?, a.view(D2D_BYTES, D2D_BYTES)?);
    let s = dev.stream();
    let (t0, t1) = (dev.new_event()?, dev.new_event()?);
    dev.dtod_async(src, dst, s)?;
    t0.record(s)?;
    for _ in 0..4 {
        dev.dtod_async(src, dst, s)?;
    }
    t1.record(s)?;
    t1.synchronize()?;
    let ms = t0.elapsed_ms(&t1)? as f64;
    Ok(2.0 * D2D_BYTES as f64 * 4.0 / (ms / 1e3) / 1e9)
}

/// The `[[device]]` entry of one measured AMD device, with `#` comments for what the schema
/// has no key for.
pub fn device_toml(m: &AmdMeasure) -> String {
    let mut o = String::new();
    let q = |s: &str| serde_json::to_string(s).expect("a string always serializes");
    let f = |v: f64| format!("{v:.1}");
    let _ = writeln!(o, "\n[[device]]");
    let _ = writeln!(o, "index = {}", m.info.ordinal);
    let _ = writeln!(o, "name = {}", q(&m.info.name));
    let _ = writeln!(o, "vendor = \"amd\"");
    let _ = writeln!(
        o,
        "# target ID {} (wave{}, {} compute units); kernels compiled by {}",
        m.info.target.id(),
        m.info.warp_size,
        m.info.compute_units,
        m.compiler
    );
    let _ = writeln!(o, "arch = {}", q(&m.info.target.processor));
    let _ = writeln!(o, "# hipDeviceTotalMem: {}", mib(m.info.total_bytes));
    let _ = writeln!(o, "vram_bytes = {}", m.info.total_bytes);
    let _ = writeln!(o, "# hipMemGetInfo right after the device was opened");
    let _ = writeln!(o, "free_bytes = {}", m.free_after_open);
    let _ = writeln!(
        o,
        "# total less free once the runtime, {} kernel modules ({}) and one captured graph ({}) exist",
        strata_kernels::all().iter().filter(|k| !k.cuda_only).count(),
        mib(m.free_after_open.saturating_sub(m.free_after_modules)),
        mib(m.free_after_modules.saturating_sub(m.free_after_graph))
    );
    let _ = writeln!(o, "runtime_reserve_bytes = {}", m.runtime_reserve());
    if let Some(g) = m.d2d_gbps {
        let _ = writeln!(
            o,
            "# device-to-device copy of {}, bytes read + written per second",
            mib(D2D_BYTES)
        );
        let _ = writeln!(o, "mem_bandwidth_gbps = {}", f(g));
    }
    if let Some(g) = m.h2d_gbps {
        let _ = writeln!(
            o,
            "# {H2D_REPEATS} copies of {} from pinned host memory, timed with events",
            mib(H2D_BYTES)
        );
        let _ = writeln!(o, "h2d_gbps = {}", f(g));
    }
    match &m.pcie {
        Some((l, at)) => {
            let _ = writeln!(
                o,
                "# sysfs link of {at} (the card's slot; GPU {}), read after the copy test",
                m.info.pci_bus_id
            );
            let _ = writeln!(o, "pcie_gen = {}", l.gen);
            let _ = writeln!(o, "pcie_width = {}", l.width);
        }
        None => {
            let _ = writeln!(o, "# pcie_gen/pcie_width: no link files in sysfs");
        }
    }
    let _ = writeln!(
        o,
        "# devices whose memory this one reads directly (hipDeviceCanAccessPeer)"
    );
    let peers: Vec<String> = m.peers.iter().map(|p| p.to_string()).collect();
    let _ = writeln!(o, "peers = [{}]", peers.join(", "));
    let _ = writeln!(
        o,
        "# kernel modules opened in {:.1}s ({} from the disk cache)",
        m.open_seconds, m.modules_from_cache
    );
    for n in &m.notes {
        let _ = writeln!(o, "# note: {n}");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::hip::compile::GfxTarget;
    use strata_schemas::probe::HardwareProbe;

    fn sample() -> AmdMeasure {
        AmdMeasure {
            info: DeviceInfo {
                ordinal: 1,
                name: "AMD Radeon AI PRO R9700".into(),
                target: GfxTarget::parse("gfx1201").unwrap(),
                total_bytes: 32 << 30,
                warp_size: 32,
                compute_units: 64,
                max_threads_per_block: 1024,
                max_shared_per_block: 65536,
                pci_bus_id: "0000:03:00.0".into(),
            },
            free_after_open: (32 << 30) - (300 << 20),
            free_after_modules: (32 << 30) - (340 << 20),
            free_after_graph: (32 << 30) - (342 << 20),
            h2d_gbps: Some(24.6),
            d2d_gbps: None,
            pcie: Some((
                PcieLink {
                    gen: 5,
                    width: 16,
                    max_gen: Some(5),
                    max_width: Some(16),
                },
                "0000:01:00.0".into(),
            )),
            peers: vec![0],
            compiler: "hiprtc7.2-7.2.53211".into(),
            open_seconds: 3.5,
            modules_from_cache: 0,
            notes: vec!["device-to-device not measured: test".into()],
        }
    }

    #[test]
    fn the_amd_entry_parses_as_a_probe_device() {
        let m = sample();
        assert_eq!(m.runtime_reserve(), 342 << 20);
        // Two cards that reach each other, as on the seed's machine.
        let mut m0 = sample();
        m0.info.ordinal = 0;
        m0.peers = vec![1];
        let text = format!(
            "[host]\nram_bytes = {}\navailable_bytes = {}\n{}{}",
            64u64 << 30,
            60u64 << 30,
            device_toml(&m),
            device_toml(&m0)
        );
        let p = HardwareProbe::from_toml(&text, "test").unwrap();
        let d = &p.devices[0];
        assert_eq!(d.vendor.as_str(), "amd");
        assert_eq!(d.arch, "gfx1201");
        assert_eq!(d.index, 1);
        assert_eq!(d.vram_bytes, 32 << 30);
        assert_eq!(d.runtime_reserve_bytes, Some(342 << 20));
        assert_eq!((d.pcie_gen, d.pcie_width), (Some(5), Some(16)));
        assert_eq!(d.h2d_gbps, Some(24.6));
        assert_eq!(d.mem_bandwidth_gbps, None, "not measured, not written");
        assert_eq!(d.peers, Some(vec![0]));
        assert!(text.contains("# note: device-to-device not measured"));
        assert!(text.contains("wave32"), "{text}");
    }

    #[test]
    fn the_arch_key_is_the_processor_even_with_target_features() {
        let mut m = sample();
        m.info.target = GfxTarget::parse("gfx90a:sramecc+:xnack-").unwrap();
        let t = device_toml(&m);
        assert!(t.contains("arch = \"gfx90a\""), "{t}");
        assert!(t.contains("gfx90a:sramecc+:xnack-"), "{t}");
    }

    #[test]
    fn no_rocm_is_a_reason_not_a_panic() {
        match count() {
            Ok(_) => {}
            Err(why) => assert!(
                why.contains("libamdhip64") || why.contains("libhiprtc"),
                "{why}"
            ),
        }
    }
}
