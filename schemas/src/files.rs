//! Opening and reading input files safely: only regular files (after following links), and
//! never more than a limit that fits the kind of file. `/dev/zero`, a FIFO, a socket or a
//! link to one is refused before it is opened (opening a FIFO would block), and a regular
//! file that grows while it is read is still cut at the limit.
//! Invariant: every file a Strata program reads whole goes through [`read_limited`] (or
//! [`open_regular`] before an mmap or a bounded header read), and every error names the
//! file, what it should have been, and the limit.

use std::io::Read;
use std::path::Path;

/// Limits by kind of file (bytes).
pub mod limit {
    /// Hardware probe, serve settings and descriptor TOML files.
    pub const TOML: u64 = 4 << 20;
    /// A model's config.json.
    pub const CONFIG_JSON: u64 = 16 << 20;
    /// A tokenizer.json (the largest real ones are ~35 MB).
    pub const TOKENIZER_JSON: u64 = 256 << 20;
    /// tokenizer_config.json (chat templates live here; real ones are well under 1 MB).
    pub const TOKENIZER_CONFIG: u64 = 16 << 20;
    /// A plan file (real plans are kilobytes to a few megabytes).
    pub const PLAN: u64 = 1 << 30;
    /// An expert profile.
    pub const PROFILE: u64 = 256 << 20;
    /// A safetensors index (model.safetensors.index.json).
    pub const INDEX_JSON: u64 = 64 << 20;
}

/// A file that cannot be read as an input of its kind.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read {what} `{path}`: {source}")]
    Io {
        path: String,
        what: String,
        source: std::io::Error,
    },
    #[error("{what} `{path}` is {kind}, not a regular file: give the path of the file itself")]
    NotRegular {
        path: String,
        what: String,
        kind: &'static str,
    },
    #[error("{what} `{path}` is larger than {limit} bytes, the most a {what} may be: is this the right file?")]
    TooLarge {
        path: String,
        what: String,
        limit: u64,
    },
}

impl FileError {
    /// The underlying I/O error kind, when there is one (e.g. `NotFound`).
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            FileError::Io { source, .. } => Some(source.kind()),
            _ => None,
        }
    }
}

fn kind_of(ft: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    if ft.is_dir() {
        "a folder"
    } else {
        "not a regular file"
    }
}

/// Open `path` for reading if it is (or links to) a regular file; `what` names the kind of
/// file in errors ("hardware probe", "plan file"...).
pub fn open_regular(path: &Path, what: &str) -> Result<std::fs::File, FileError> {
    let shown = || path.display().to_string();
    let io = |source| FileError::Io {
        path: shown(),
        what: what.to_string(),
        source,
    };
    // Checked before opening: opening a FIFO blocks until a writer appears.
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(FileError::NotRegular {
            path: shown(),
            what: what.to_string(),
            kind: kind_of(&meta.file_type()),
        });
    }
    let f = std::fs::File::open(path).map_err(io)?;
    // And again on the open file, in case the path was swapped in between.
    let meta = f.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(FileError::NotRegular {
            path: shown(),
            what: what.to_string(),
            kind: kind_of(&meta.file_type()),
        });
    }
    Ok(f)
}

/// The whole of the regular file `path`, refused when larger than `limit` bytes.
pub fn read_limited(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>, FileError> {
    let f = open_regular(path, what)?;
    let too_large = || FileError::TooLarge {
        path: path.display().to_string(),
        what: what.to_string(),
        limit,
    };
    let io = |source| FileError::Io {
        path: path.display().to_string(),
        what: what.to_string(),
        source,
    };
    let size = f.metadata().map_err(io)?.len();
    if size > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::with_capacity(size as usize);
    // `take(limit + 1)` keeps a file that grows while it is read bounded too.
    f.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// [`read_limited`] as UTF-8 text.
pub fn read_text_limited(path: &Path, limit: u64, what: &str) -> Result<String, FileError> {
    let bytes = read_limited(path, limit, what)?;
    String::from_utf8(bytes).map_err(|e| FileError::Io {
        path: path.display().to_string(),
        what: what.to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_files_are_read_up_to_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        std::fs::write(&p, b"12345").unwrap();
        assert_eq!(read_limited(&p, 5, "probe").unwrap(), b"12345");
        let e = read_limited(&p, 4, "hardware probe")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a.toml")
                && e.contains("larger than 4 bytes")
                && e.contains("hardware probe"),
            "{e}"
        );
        let e = read_limited(&dir.path().join("none"), 4, "plan file").unwrap_err();
        assert_eq!(e.io_kind(), Some(std::io::ErrorKind::NotFound));
        assert!(e.to_string().contains("plan file"), "{e}");
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        let e = read_text_limited(&p, 10, "probe").unwrap_err().to_string();
        assert!(e.contains("not UTF-8"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn devices_fifos_folders_and_links_to_them_are_refused_without_reading() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = std::time::Instant::now();
        let e = read_limited(Path::new("/dev/zero"), 1 << 20, "hardware probe")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/dev/zero") && e.contains("character device"),
            "{e}"
        );
        let link = dir.path().join("zero.plan");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = open_regular(&link, "plan file").unwrap_err().to_string();
        assert!(
            e.contains("zero.plan") && e.contains("character device"),
            "{e}"
        );
        let fifo = dir.path().join("fifo");
        let ok = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            // Opening it would block forever; it is refused first.
            let e = read_limited(&fifo, 10, "tokenizer")
                .unwrap_err()
                .to_string();
            assert!(e.contains("FIFO"), "{e}");
        } else {
            eprintln!("mkfifo unavailable: FIFO case not exercised");
        }
        let e = read_limited(dir.path(), 10, "probe")
            .unwrap_err()
            .to_string();
        assert!(e.contains("a folder"), "{e}");
        assert!(t0.elapsed().as_secs() < 5);
    }
}
