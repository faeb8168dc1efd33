//! A GPU's PCIe link as Linux sysfs reports it, vendor-neutral: `current_link_speed` /
//! `current_link_width` (and the `max_` pair) of a PCI device folder, and, for cards that
//! sit behind a switch of their own vendor (AMD's discrete GPUs do), the link of the topmost
//! such bridge, which is the slot's link; the GPU's own link is the card's internal one.
//! Invariant: a number is reported only when sysfs has it; nothing is guessed.

use std::path::{Path, PathBuf};

/// The PCIe link of one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PcieLink {
    /// Generation of `current_link_speed` (1 = 2.5 GT/s ... 7 = 128 GT/s).
    pub gen: u32,
    /// `current_link_width` in lanes.
    pub width: u32,
    /// Generation of `max_link_speed`, where sysfs has it.
    pub max_gen: Option<u32>,
    /// `max_link_width`, where sysfs has it.
    pub max_width: Option<u32>,
}

/// PCIe generation of a sysfs link speed such as `32.0 GT/s PCIe` or `8 GT/s`.
pub fn gen_of_speed(text: &str) -> Option<u32> {
    let gts: f64 = text.split_whitespace().next()?.parse().ok()?;
    [2.5, 5.0, 8.0, 16.0, 32.0, 64.0, 128.0]
        .iter()
        .position(|g| (g - gts).abs() < 0.01)
        .map(|i| i as u32 + 1)
}

fn read(dir: &Path, f: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(f))
        .ok()
        .map(|s| s.trim().to_string())
}

/// The link files of one PCI device folder; None unless speed and a non-zero width read.
pub fn read_link(dir: &Path) -> Option<PcieLink> {
    let width = |t: Option<String>| t.and_then(|w| w.parse::<u32>().ok()).filter(|&w| w > 0);
    Some(PcieLink {
        gen: gen_of_speed(&read(dir, "current_link_speed")?)?,
        width: width(read(dir, "current_link_width"))?,
        max_gen: read(dir, "max_link_speed").and_then(|t| gen_of_speed(&t)),
        max_width: width(read(dir, "max_link_width")),
    })
}

/// The folder whose link is the card's slot link for the PCI device `bus_id` under `root`
/// (normally `/sys/bus/pci/devices`): walking up the device's real path, the topmost
/// ancestor that is a PCI bridge (class 0x0604) of the device's own vendor, else the device.
pub fn slot_link_dir(root: &Path, bus_id: &str) -> Option<PathBuf> {
    let dev = std::fs::canonicalize(root.join(bus_id)).ok()?;
    let vendor = read(&dev, "vendor")?;
    let mut best = dev.clone();
    let mut cur = dev.parent().map(Path::to_path_buf);
    while let Some(p) = cur {
        let same_vendor = read(&p, "vendor").as_deref() == Some(vendor.as_str());
        let bridge = read(&p, "class").is_some_and(|c| c.starts_with("0x0604"));
        if !(same_vendor && bridge) {
            break;
        }
        best = p.clone();
        cur = p.parent().map(Path::to_path_buf);
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_speeds_map_to_generations() {
        assert_eq!(gen_of_speed("2.5 GT/s PCIe\n"), Some(1));
        assert_eq!(gen_of_speed("16.0 GT/s PCIe"), Some(4));
        assert_eq!(gen_of_speed("32.0 GT/s PCIe"), Some(5));
        assert_eq!(gen_of_speed("Unknown"), None);
    }

    fn node(dir: &Path, vendor: &str, class: &str, speed: &str, width: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("vendor"), format!("{vendor}\n")).unwrap();
        std::fs::write(dir.join("class"), format!("{class}\n")).unwrap();
        std::fs::write(dir.join("current_link_speed"), speed).unwrap();
        std::fs::write(dir.join("current_link_width"), width).unwrap();
    }

    #[test]
    fn an_amd_card_reports_its_slot_link_not_the_internal_one() {
        // root port (AMD CPU) -> card switch upstream -> downstream -> GPU, as sysfs nests them.
        let t = tempfile::tempdir().unwrap();
        let rp = t.path().join("devices/pci0000:00/0000:00:01.1");
        node(&rp, "0x1022", "0x060400", "16.0 GT/s PCIe", "16");
        let up = rp.join("0000:01:00.0");
        node(&up, "0x1002", "0x060400", "16.0 GT/s PCIe", "8");
        let down = up.join("0000:02:00.0");
        node(&down, "0x1002", "0x060400", "32.0 GT/s PCIe", "16");
        let gpu = down.join("0000:03:00.0");
        node(&gpu, "0x1002", "0x030000", "32.0 GT/s PCIe", "16");
        let bus = t.path().join("bus");
        std::fs::create_dir_all(&bus).unwrap();
        std::os::unix::fs::symlink(&gpu, bus.join("0000:03:00.0")).unwrap();
        let dir = slot_link_dir(&bus, "0000:03:00.0").unwrap();
        assert_eq!(dir, std::fs::canonicalize(&up).unwrap());
        let l = read_link(&dir).unwrap();
        assert_eq!((l.gen, l.width, l.max_gen), (4, 8, None));
        // The GPU's own folder reads the internal link.
        assert_eq!(read_link(&gpu).unwrap().gen, 5);
        assert!(slot_link_dir(&bus, "0000:09:00.0").is_none());
    }

    #[test]
    fn a_gpu_without_a_switch_reports_its_own_link() {
        let t = tempfile::tempdir().unwrap();
        let rp = t.path().join("pci0000:00/0000:00:02.0");
        node(&rp, "0x8086", "0x060400", "16.0 GT/s PCIe", "16");
        let gpu = rp.join("0000:18:00.0");
        node(&gpu, "0x10de", "0x030200", "16.0 GT/s PCIe", "16");
        std::fs::write(gpu.join("current_link_width"), "0\n").unwrap();
        let dir = slot_link_dir(&rp, "0000:18:00.0").unwrap();
        assert_eq!(dir, std::fs::canonicalize(&gpu).unwrap());
        assert_eq!(read_link(&dir), None, "width 0 is no link");
    }
}
