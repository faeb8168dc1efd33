//! The on-disk cache of compiled kernel modules shared by the GPU backends: where it lives
//! (`$STRATA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/strata/kernels`, else
//! `$HOME/.cache/strata/kernels`; `STRATA_KERNEL_CACHE=off` disables it) and how an entry is
//! written. Each backend names its entries by what determines the binary.
//! Invariant: an entry is written atomically (a temp file renamed into place), so a reader
//! sees a whole entry or none; failing to write is never an error (the cache only saves time).

use std::path::{Path, PathBuf};

/// The cache folder, or None when caching is off or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("STRATA_KERNEL_CACHE") {
        if d == "off" || d.is_empty() {
            return None;
        }
        return Some(PathBuf::from(d));
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return Some(PathBuf::from(x).join("strata").join("kernels"));
    }
    std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("strata")
            .join("kernels")
    })
}

/// Writes `bytes` to `dir/name` through a temp file and a rename; errors are ignored.
pub fn store(dir: &Path, name: &str, bytes: &[u8]) {
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let path = dir.join(name);
    let tmp = dir.join(format!("{name}.tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, &path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_writes_whole_entries_and_leaves_no_temp_file() {
        let d = tempfile::tempdir().unwrap();
        let sub = d.path().join("a").join("b");
        store(&sub, "m.co", b"\x7fELF data");
        assert_eq!(std::fs::read(sub.join("m.co")).unwrap(), b"\x7fELF data");
        let names: Vec<_> = std::fs::read_dir(&sub).unwrap().collect();
        assert_eq!(names.len(), 1);
        // An unwritable folder is not an error.
        store(Path::new("/proc/strata-cannot-write"), "m.co", b"x");
    }
}
