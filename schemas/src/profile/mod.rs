//! The expert profile file (`--expert-profile`): per-block, per-expert routing counts and
//! (format v2) the LRU stack-distance histograms of the references ([`reuse`]), in a text
//! or a binary encoding (`schemas/PROFILE.md`).
//! Invariant: a parsed `ExpertProfile` has 1 ≤ layers ≤ 1024, 1 ≤ experts ≤ 65536 and exactly
//! `layers * experts` counts, layer-major; nothing is allocated before sizes are checked.

pub mod reuse;

pub use reuse::{Reuse, ReuseHistogram};
use std::path::Path;

/// First line of the text encoding (v1: counts only).
pub const TEXT_HEADER: &str = "# strata expert profile v1";
/// First line of the text encoding with reuse histograms.
pub const TEXT_HEADER_V2: &str = "# strata expert profile v2";
/// First eight bytes of the binary encoding (v1: counts only).
pub const BINARY_MAGIC: [u8; 8] = *b"STRXPRF1";
/// First eight bytes of the binary encoding with reuse histograms after the counts.
pub const BINARY_MAGIC_V2: [u8; 8] = *b"STRXPRF2";
/// Binary header: magic, u32 layers, u32 experts.
pub const BINARY_HEADER_LEN: u64 = 16;
pub const MAX_LAYERS: u32 = 1024;
pub const MAX_EXPERTS: u32 = 65536;

/// What is wrong with a profile. `origin` is the file path as given.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    #[error("expert profile {origin}: neither a text profile (first line `{TEXT_HEADER}`) nor a binary one (magic `STRXPRF1`)")]
    UnknownFormat { origin: String },
    #[error("expert profile {origin}, line {line}: {reason}")]
    Text {
        origin: String,
        line: u64,
        reason: String,
    },
    #[error("expert profile {origin}, byte offset {offset}: {reason}")]
    Binary {
        origin: String,
        offset: u64,
        reason: String,
    },
    #[error("expert profile {origin} does not match the model: {reason}")]
    Mismatch { origin: String, reason: String },
}

/// Routing counts: `counts[layer * experts + expert]` = how often `expert` of block `layer`
/// was selected over the calibration text. Rows are indexed by block index (`blk.N`), MTP
/// blocks after the main ones; rows of dense blocks are ignored (conventionally zero).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertProfile {
    pub layers: u32,
    pub experts: u32,
    /// Layer-major, `layers * experts` entries.
    pub counts: Vec<u64>,
    /// LRU stack distances of the references (v2); `None` in a v1 profile.
    pub reuse: Option<Reuse>,
}

fn check_dims(layers: u64, experts: u64) -> Result<(), String> {
    if layers == 0 || layers > MAX_LAYERS as u64 {
        return Err(format!("layers = {layers}; must be 1..={MAX_LAYERS}"));
    }
    if experts == 0 || experts > MAX_EXPERTS as u64 {
        return Err(format!("experts = {experts}; must be 1..={MAX_EXPERTS}"));
    }
    Ok(())
}

impl ExpertProfile {
    /// All counts zero: every layer reads as uniform.
    pub fn uniform(layers: u32, experts: u32) -> Self {
        ExpertProfile {
            layers,
            experts,
            counts: vec![0; layers as usize * experts as usize],
            reuse: None,
        }
    }

    /// (block, expert) pairs the reuse histograms' distances count in.
    pub fn keys(&self) -> u64 {
        self.layers as u64 * self.experts as u64
    }

    /// Count of `expert` in `layer`; 0 outside the profile.
    pub fn count(&self, layer: u32, expert: u32) -> u64 {
        if layer >= self.layers || expert >= self.experts {
            return 0;
        }
        let i = layer as usize * self.experts as usize + expert as usize;
        self.counts.get(i).copied().unwrap_or(0)
    }

    fn row(&self, layer: u32) -> &[u64] {
        if layer >= self.layers {
            return &[];
        }
        let e = self.experts as usize;
        let start = layer as usize * e;
        self.counts.get(start..start + e).unwrap_or(&[])
    }

    /// Expected uses per token of each expert of `layer`:
    /// `n_expert_used * count / layer_total`; uniform `n_expert_used / experts` when the layer's
    /// total is 0 or `layer` is past the profile (an omitted MTP block). Length `experts`.
    pub fn probabilities(&self, layer: u32, n_expert_used: u64) -> Vec<f64> {
        let e = self.experts as usize;
        let k = n_expert_used as f64;
        let row = self.row(layer);
        let total: u128 = row.iter().map(|&c| c as u128).sum();
        if total == 0 || row.len() != e {
            let u = if e == 0 { 0.0 } else { k / e as f64 };
            return vec![u; e];
        }
        let t = total as f64;
        row.iter().map(|&c| k * (c as f64) / t).collect()
    }

    /// The text encoding (see PROFILE.md): v1 without reuse histograms, v2 with them.
    pub fn write_text(&self) -> String {
        let header = if self.reuse.is_some() {
            TEXT_HEADER_V2
        } else {
            TEXT_HEADER
        };
        let mut s = format!(
            "{header}\nlayers = {}\nexperts = {}\n",
            self.layers, self.experts
        );
        for l in 0..self.layers {
            s.push_str(&l.to_string());
            s.push(':');
            for c in self.row(l) {
                s.push(' ');
                s.push_str(&c.to_string());
            }
            s.push('\n');
        }
        if let Some(r) = &self.reuse {
            s.push_str("# LRU stack distances (distance:references) over every block's experts\n");
            for (kind, h) in [("decode", &r.decode), ("prefill", &r.prefill)] {
                s.push_str(&format!("reuse.{kind}.first = {}\n", h.first));
                s.push_str(&format!("reuse.{kind} = {}\n", h.write_pairs()));
            }
        }
        s
    }

    /// The binary encoding (see PROFILE.md): v1 without reuse histograms, v2 with them.
    pub fn write_binary(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.counts.len() * 8);
        let magic = if self.reuse.is_some() {
            BINARY_MAGIC_V2
        } else {
            BINARY_MAGIC
        };
        out.extend_from_slice(&magic);
        out.extend_from_slice(&self.layers.to_le_bytes());
        out.extend_from_slice(&self.experts.to_le_bytes());
        for c in &self.counts {
            out.extend_from_slice(&c.to_le_bytes());
        }
        if let Some(r) = &self.reuse {
            r.write_binary(&mut out);
        }
        out
    }

    /// Strict check: the profile has one row per block of the model including MTP blocks
    /// (`n_blocks_total` = main blocks + MTP blocks, dense blocks counted) and `n_expert`
    /// columns. Use `check_against_model` to also accept a profile that omits MTP blocks.
    pub fn check_against(
        &self,
        n_blocks_total: u32,
        n_expert: u64,
        origin: &str,
    ) -> Result<(), ProfileError> {
        self.check_experts(n_expert, origin)?;
        if self.layers != n_blocks_total {
            return Err(ProfileError::Mismatch {
                origin: origin.to_string(),
                reason: format!(
                    "profile has {} layers, the model has {n_blocks_total} blocks (MTP included); \
                     record the profile on this model",
                    self.layers
                ),
            });
        }
        Ok(())
    }

    /// Accepts `layers == n_layer + n_mtp` (every block) or `layers == n_layer` (MTP blocks
    /// omitted: they read as uniform through `probabilities`). `n_layer` is the main block
    /// count (`HParams::n_layer`), `n_mtp` the MTP blocks (`nextn_predict_layers`).
    pub fn check_against_model(
        &self,
        n_layer: u32,
        n_mtp: u32,
        n_expert: u64,
        origin: &str,
    ) -> Result<(), ProfileError> {
        self.check_experts(n_expert, origin)?;
        let total = n_layer as u64 + n_mtp as u64;
        if self.layers as u64 == total || self.layers == n_layer {
            return Ok(());
        }
        let want = if n_mtp == 0 {
            format!("{n_layer}")
        } else {
            format!("{total} (or {n_layer} without the MTP blocks)")
        };
        Err(ProfileError::Mismatch {
            origin: origin.to_string(),
            reason: format!(
                "profile has {} layers, the model needs {want}; record the profile on this model",
                self.layers
            ),
        })
    }

    fn check_experts(&self, n_expert: u64, origin: &str) -> Result<(), ProfileError> {
        if self.experts as u64 != n_expert {
            return Err(ProfileError::Mismatch {
                origin: origin.to_string(),
                reason: format!(
                    "profile has {} experts per layer, the model has {n_expert}; \
                     record the profile on this model",
                    self.experts
                ),
            });
        }
        Ok(())
    }
}

/// Read a profile file of either encoding (sniffed from its first bytes).
pub fn read_profile(path: &Path) -> Result<ExpertProfile, ProfileError> {
    let origin = path.display().to_string();
    let bytes = crate::files::read_limited(path, crate::files::limit::PROFILE, "expert profile")?;
    parse_profile_bytes(&bytes, &origin)
}

/// Parse either encoding; `origin` names the source in errors.
pub fn parse_profile_bytes(bytes: &[u8], origin: &str) -> Result<ExpertProfile, ProfileError> {
    if bytes.starts_with(&BINARY_MAGIC) || bytes.starts_with(&BINARY_MAGIC_V2) {
        parse_binary(bytes, origin)
    } else if bytes.starts_with(b"# strata expert profile") {
        parse_text(bytes, origin)
    } else {
        Err(ProfileError::UnknownFormat {
            origin: origin.to_string(),
        })
    }
}

fn parse_binary(bytes: &[u8], origin: &str) -> Result<ExpertProfile, ProfileError> {
    let err = |offset: u64, reason: String| ProfileError::Binary {
        origin: origin.to_string(),
        offset,
        reason,
    };
    let len = bytes.len() as u64;
    if len < BINARY_HEADER_LEN {
        return Err(err(
            len,
            format!("truncated: {len} bytes, the header needs {BINARY_HEADER_LEN}"),
        ));
    }
    let v2 = bytes.starts_with(&BINARY_MAGIC_V2);
    let u32_at =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let layers = u32_at(8);
    let experts = u32_at(12);
    check_dims(layers as u64, experts as u64).map_err(|r| err(8, r))?;
    let expected = (layers as u64)
        .checked_mul(experts as u64)
        .and_then(|n| n.checked_mul(8))
        .and_then(|n| n.checked_add(BINARY_HEADER_LEN))
        .ok_or_else(|| err(8, format!("{layers} layers x {experts} experts overflows")))?;
    if len < expected {
        return Err(err(
            len,
            format!("truncated: {len} bytes, header says {expected} ({layers} layers x {experts} experts x 8)"),
        ));
    }
    let reuse = if v2 {
        let keys = layers as u64 * experts as u64;
        Some(
            Reuse::parse_binary(&bytes[expected as usize..], expected, keys)
                .map_err(|(o, r)| err(o, r))?,
        )
    } else {
        None
    };
    if !v2 && len > expected {
        return Err(err(
            expected,
            format!(
                "{} trailing bytes after the {layers} x {experts} counts",
                len - expected
            ),
        ));
    }
    let counts = bytes[BINARY_HEADER_LEN as usize..expected as usize]
        .chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u64::from_le_bytes(a)
        })
        .collect();
    Ok(ExpertProfile {
        layers,
        experts,
        counts,
        reuse,
    })
}

/// Parse the text form: header line, `layers = L` and `experts = E`, then one
/// `LAYER: c0 c1 ...` line per layer; errors name the line.
fn parse_text(bytes: &[u8], origin: &str) -> Result<ExpertProfile, ProfileError> {
    let err = |line: u64, reason: String| ProfileError::Text {
        origin: origin.to_string(),
        line,
        reason,
    };
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let line = bytes[..e.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count() as u64
            + 1;
        err(line, "not valid UTF-8".into())
    })?;
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i as u64 + 1, l.trim()));
    let v2 = match lines.next() {
        Some((_, TEXT_HEADER)) => false,
        Some((_, TEXT_HEADER_V2)) => true,
        Some((n, other)) => {
            return Err(err(
                n,
                format!(
                "first line is `{other}`; this build reads `{TEXT_HEADER}` and `{TEXT_HEADER_V2}`"
            ),
            ))
        }
        None => return Err(err(1, "empty file".into())),
    };
    let mut reuse_lines = reuse::ReuseLines::default();
    let mut layers: Option<(u32, u64)> = None;
    let mut experts: Option<(u32, u64)> = None;
    let mut counts: Vec<u64> = Vec::new();
    // Line each layer was given on (0 = not yet).
    let mut seen: Vec<u64> = Vec::new();

    for (n, line) in lines {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some((key, value)) = line.split_once('=') {
            let key = key.trim();
            let value = value.trim();
            if key.starts_with("reuse.") {
                if !v2 {
                    return Err(err(
                        n,
                        format!("`{key}` needs the v2 header `{TEXT_HEADER_V2}`"),
                    ));
                }
                reuse_lines.take(key, value, n).map_err(|r| err(n, r))?;
                continue;
            }
            let slot = match key {
                "layers" => &mut layers,
                "experts" => &mut experts,
                _ => {
                    return Err(err(
                        n,
                        format!("unknown key `{key}`; expected `layers`, `experts` or `reuse.*`"),
                    ))
                }
            };
            if let Some((_, first)) = slot {
                return Err(err(
                    n,
                    format!("`{key}` given again (first on line {first})"),
                ));
            }
            if !counts.is_empty() || !seen.is_empty() {
                return Err(err(n, format!("`{key}` must come before the layer lines")));
            }
            let v: u64 = value
                .parse()
                .map_err(|_| err(n, format!("`{key} = {value}`: not an unsigned integer")))?;
            let cap = if key == "layers" {
                MAX_LAYERS
            } else {
                MAX_EXPERTS
            };
            if v == 0 || v > cap as u64 {
                return Err(err(n, format!("`{key} = {v}`: must be 1..={cap}")));
            }
            *slot = Some((v as u32, n));
            if let (Some((l, _)), Some((e, _))) = (layers, experts) {
                // Both ≤ caps: at most 2^26 entries.
                counts = vec![0; l as usize * e as usize];
                seen = vec![0; l as usize];
            }
            continue;
        }
        let Some((idx, rest)) = line.split_once(':') else {
            return Err(err(
                n,
                "expected `layers = L`, `experts = E` or `LAYER: c0 c1 ...`".into(),
            ));
        };
        let (Some((l, _)), Some((e, _))) = (layers, experts) else {
            return Err(err(
                n,
                "layer line before `layers = L` and `experts = E`".into(),
            ));
        };
        let idx = idx.trim();
        let layer: u32 = idx
            .parse()
            .map_err(|_| err(n, format!("layer index `{idx}` is not an unsigned integer")))?;
        if layer >= l {
            return Err(err(
                n,
                format!("layer {layer} is out of range: `layers = {l}`"),
            ));
        }
        let first = seen[layer as usize];
        if first != 0 {
            return Err(err(
                n,
                format!("layer {layer} given again (first on line {first})"),
            ));
        }
        seen[layer as usize] = n;
        let row = &mut counts[layer as usize * e as usize..(layer as usize + 1) * e as usize];
        parse_counts(rest, row, layer, e, n, origin)?;
    }
    let (Some((l, _)), Some((e, _))) = (layers, experts) else {
        let missing = if layers.is_none() {
            "layers"
        } else {
            "experts"
        };
        return Err(err(
            text.lines().count() as u64,
            format!("missing `{missing} = N`"),
        ));
    };
    if let Some(missing) = seen.iter().position(|&s| s == 0) {
        return Err(err(
            text.lines().count() as u64,
            format!("layer {missing} has no line; every layer 0..{l} needs one"),
        ));
    }
    let reuse = reuse_lines
        .finish(l as u64 * e as u64)
        .map_err(|(line, r)| err(line.unwrap_or(text.lines().count() as u64), r))?;
    Ok(ExpertProfile {
        layers: l,
        experts: e,
        counts,
        reuse,
    })
}

/// Parse the counts of layer `layer` (line `n`): exactly `e` unsigned 64-bit integers into `row`.
fn parse_counts(
    rest: &str,
    row: &mut [u64],
    layer: u32,
    e: u32,
    n: u64,
    origin: &str,
) -> Result<(), ProfileError> {
    let err = |line: u64, reason: String| ProfileError::Text {
        origin: origin.to_string(),
        line,
        reason,
    };
    let mut got: u64 = 0;
    for tok in rest.split_whitespace() {
        if got < e as u64 {
            row[got as usize] = tok.parse().map_err(|_| {
                err(
                    n,
                    format!(
                        "layer {layer}, count {got}: `{tok}` is not an unsigned 64-bit integer"
                    ),
                )
            })?;
        }
        got += 1;
    }
    if got != e as u64 {
        return Err(err(
            n,
            format!("layer {layer} has {got} counts, `experts = {e}` needs exactly {e}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ExpertProfile {
        ExpertProfile {
            layers: 3,
            experts: 4,
            counts: vec![1, 2, 3, 4, 0, 0, 0, 0, u64::MAX, 0, 7, 0],
            reuse: None,
        }
    }

    fn text_err(s: &str) -> (u64, String) {
        match parse_profile_bytes(s.as_bytes(), "p.txt").unwrap_err() {
            ProfileError::Text {
                line,
                reason,
                origin,
            } => {
                assert_eq!(origin, "p.txt");
                (line, reason)
            }
            e => panic!("expected a text error, got {e}"),
        }
    }

    fn bin_err(b: &[u8]) -> (u64, String) {
        match parse_profile_bytes(b, "p.bin").unwrap_err() {
            ProfileError::Binary { offset, reason, .. } => (offset, reason),
            e => panic!("expected a binary error, got {e}"),
        }
    }

    #[test]
    fn round_trips_both_encodings() {
        let p = sample();
        let t = p.write_text();
        assert!(t.starts_with("# strata expert profile v1\nlayers = 3\nexperts = 4\n0: 1 2 3 4\n"));
        assert_eq!(parse_profile_bytes(t.as_bytes(), "t").unwrap(), p);
        let b = p.write_binary();
        assert_eq!(&b[..8], b"STRXPRF1");
        assert_eq!(b.len(), 16 + 12 * 8);
        assert_eq!(parse_profile_bytes(&b, "b").unwrap(), p);

        let dir = tempfile::tempdir().unwrap();
        let tp = dir.path().join("p.txt");
        let bp = dir.path().join("p.bin");
        std::fs::write(&tp, &t).unwrap();
        std::fs::write(&bp, &b).unwrap();
        assert_eq!(read_profile(&tp).unwrap(), p);
        assert_eq!(read_profile(&bp).unwrap(), p);
        let e = read_profile(&dir.path().join("none")).unwrap_err();
        assert!(matches!(e, ProfileError::File(_)));
        assert!(e.to_string().contains("none"));
    }

    #[test]
    fn text_accepts_comments_any_order_and_crlf() {
        let s = "# strata expert profile v1\r\n# calibrated on wiki\r\nexperts = 2\r\nlayers = 2\r\n\r\n1: 5 6\r\n0:7   8\r\n";
        let p = parse_profile_bytes(s.as_bytes(), "x").unwrap();
        assert_eq!(p.counts, vec![7, 8, 5, 6]);
        assert_eq!(p.count(1, 0), 5);
        assert_eq!(p.count(9, 0), 0);
    }

    #[test]
    fn probabilities() {
        let p = sample();
        let pr = p.probabilities(0, 2);
        assert_eq!(pr, vec![0.2, 0.4, 0.6, 0.8]);
        assert!((pr.iter().sum::<f64>() - 2.0).abs() < 1e-12);
        assert_eq!(p.probabilities(1, 2), vec![0.5; 4]);
        // Omitted (MTP) layer past the profile: uniform.
        assert_eq!(p.probabilities(3, 8), vec![2.0; 4]);
        // u64::MAX counts do not overflow the total.
        let p2 = p.probabilities(2, 1);
        assert!((p2.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(p2[0] > 0.99);
        let u = ExpertProfile::uniform(2, 8);
        assert_eq!(u.counts.len(), 16);
        assert_eq!(u.probabilities(1, 4), vec![0.5; 8]);
    }

    #[test]
    fn text_bad_inputs() {
        let h = "# strata expert profile v1\n";
        let (line, r) = text_err(&format!("{h}layers = 2\nexperts = 3\n0: 1 2 3\n1: 1 2\n"));
        assert_eq!(line, 5);
        assert!(r.contains("has 2 counts"), "{r}");
        let (line, r) = text_err(&format!("{h}layers = 1\nexperts = 3\n0: 1 2 3 4\n"));
        assert_eq!(line, 4);
        assert!(r.contains("has 4 counts"), "{r}");
        let (line, r) = text_err(&format!("{h}layers = 1\nexperts = 2\n0: 1 x\n"));
        assert_eq!(line, 4);
        assert!(r.contains("`x`"), "{r}");
        let (_, r) = text_err(&format!("{h}layers = 1\nexperts = 2\n0: 1 -3\n"));
        assert!(r.contains("`-3`"), "{r}");
        let (_, r) = text_err(&format!(
            "{h}layers = 1\nexperts = 1\n0: 18446744073709551616\n"
        ));
        assert!(r.contains("not an unsigned 64-bit"), "{r}");
        let (_, r) = text_err(&format!("{h}layers = 2\nexperts = 1\n0: 1\n"));
        assert!(r.contains("layer 1 has no line"), "{r}");
        let (line, r) = text_err(&format!("{h}layers = 2\nexperts = 1\n0: 1\n0: 2\n"));
        assert_eq!(line, 5);
        assert!(r.contains("first on line 4"), "{r}");
        let (_, r) = text_err(&format!("{h}layers = 2\nexperts = 1\n2: 1\n"));
        assert!(r.contains("out of range"), "{r}");
        let (_, r) = text_err(&format!("{h}layers = 1\n0: 1\n"));
        assert!(r.contains("before `layers"), "{r}");
        let (_, r) = text_err(&format!("{h}layers = 1\n"));
        assert!(r.contains("missing `experts"), "{r}");
        let (_, r) = text_err(&format!("{h}layers = 1025\n"));
        assert!(r.contains("1..=1024"), "{r}");
        let (_, r) = text_err(&format!("{h}layers = 1\nexperts = 65537\n"));
        assert!(r.contains("1..=65536"), "{r}");
        let (_, r) = text_err(&format!("{h}layers = 0\n"));
        assert!(r.contains("1..=1024"), "{r}");
        let (_, r) = text_err(&format!("{h}layers = 99999999999999999999\n"));
        assert!(r.contains("not an unsigned"), "{r}");
        let (_, r) = text_err(&format!("{h}layrs = 1\n"));
        assert!(r.contains("unknown key `layrs`"), "{r}");
        let (line, r) = text_err("# strata expert profile v3\n");
        assert_eq!(line, 1);
        assert!(
            r.contains("reads `# strata expert profile v1` and `# strata expert profile v2`"),
            "{r}"
        );
        match parse_profile_bytes(b"# strata expert profile v1\nlayers = 1\n\xff\n", "u")
            .unwrap_err()
        {
            ProfileError::Text { line, reason, .. } => {
                assert_eq!(line, 3);
                assert!(reason.contains("UTF-8"));
            }
            e => panic!("{e}"),
        }
        assert!(matches!(
            parse_profile_bytes(b"hello", "z"),
            Err(ProfileError::UnknownFormat { .. })
        ));
        assert!(matches!(
            parse_profile_bytes(b"", "z"),
            Err(ProfileError::UnknownFormat { .. })
        ));
    }

    #[test]
    fn binary_bad_inputs() {
        let good = sample().write_binary();
        for n in [8usize, 15] {
            let (off, r) = bin_err(&good[..n]);
            assert_eq!(off, n as u64);
            assert!(r.contains("truncated"), "{r}");
        }
        let (off, r) = bin_err(&good[..good.len() - 3]);
        assert_eq!(off, good.len() as u64 - 3);
        assert!(r.contains("header says 112"), "{r}");
        let mut long = good.clone();
        long.push(0);
        let (off, r) = bin_err(&long);
        assert_eq!(off, 112);
        assert!(r.contains("1 trailing"), "{r}");

        // Huge dimensions are refused before any allocation (caps and checked arithmetic).
        let mut huge = BINARY_MAGIC.to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        let (off, r) = bin_err(&huge);
        assert_eq!(off, 8);
        assert!(r.contains("1..=1024"), "{r}");
        let mut big = BINARY_MAGIC.to_vec();
        big.extend_from_slice(&1024u32.to_le_bytes());
        big.extend_from_slice(&65536u32.to_le_bytes());
        let (_, r) = bin_err(&big);
        assert!(r.contains("header says 536870928"), "{r}");
        let mut zero = BINARY_MAGIC.to_vec();
        zero.extend_from_slice(&1u32.to_le_bytes());
        zero.extend_from_slice(&0u32.to_le_bytes());
        let (_, r) = bin_err(&zero);
        assert!(r.contains("experts = 0"), "{r}");
    }

    #[test]
    fn checks_against_model() {
        let p = ExpertProfile::uniform(48, 512);
        assert!(p.check_against(48, 512, "p").is_ok());
        let e = p.check_against(49, 512, "p").unwrap_err();
        assert!(e.to_string().contains("49 blocks"), "{e}");
        let e = p.check_against(48, 256, "p").unwrap_err();
        assert!(e.to_string().contains("the model has 256"), "{e}");
        // MTP block may be omitted.
        assert!(p.check_against_model(48, 1, 512, "p").is_ok());
        assert!(ExpertProfile::uniform(49, 512)
            .check_against_model(48, 1, 512, "p")
            .is_ok());
        let e = ExpertProfile::uniform(47, 512)
            .check_against_model(48, 1, 512, "p")
            .unwrap_err();
        assert!(
            e.to_string().contains("49 (or 48 without the MTP blocks)"),
            "{e}"
        );
        let e = ExpertProfile::uniform(49, 512)
            .check_against_model(48, 0, 512, "p")
            .unwrap_err();
        assert!(e.to_string().contains("needs 48;"), "{e}");
    }

    fn with_reuse() -> ExpertProfile {
        let mut p = sample();
        p.reuse = Some(Reuse {
            decode: ReuseHistogram::from_dense(3, &[5, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
            prefill: ReuseHistogram::from_dense(7, &[]),
        });
        p
    }

    #[test]
    fn v2_round_trips_the_reuse_histograms_and_v1_files_still_parse() {
        let p = with_reuse();
        let t = p.write_text();
        assert!(t.starts_with("# strata expert profile v2\n"), "{t}");
        assert!(
            t.contains("reuse.decode.first = 3\nreuse.decode = 0:5 2:2 11:1\n"),
            "{t}"
        );
        assert!(
            t.contains("reuse.prefill.first = 7\nreuse.prefill = \n"),
            "{t}"
        );
        assert_eq!(parse_profile_bytes(t.as_bytes(), "t").unwrap(), p);
        let b = p.write_binary();
        assert_eq!(&b[..8], b"STRXPRF2");
        assert_eq!(parse_profile_bytes(&b, "b").unwrap(), p);
        // A profile without reuse still writes (and reads) v1.
        assert!(sample()
            .write_text()
            .starts_with("# strata expert profile v1\n"));
        assert_eq!(&sample().write_binary()[..8], b"STRXPRF1");
        let h = &p.reuse.as_ref().unwrap().decode;
        assert_eq!(h.hit_rate(1.0), Some(0.625));
    }

    #[test]
    fn v2_bad_reuse_lines_name_the_line() {
        let good = with_reuse().write_text();
        let v1 = good.replace("profile v2", "profile v1");
        let (line, r) = text_err(&v1);
        assert_eq!(line, 8);
        assert!(r.contains("needs the v2 header"), "{r}");
        let (_, r) = text_err(&good.replace("reuse.prefill = \n", ""));
        assert!(r.contains("needs all of"), "{r}");
        let (line, r) = text_err(&good.replace("11:1", "12:1"));
        assert_eq!(line, 9);
        assert!(r.contains("not below layers x experts = 12"), "{r}");
        let (_, r) = text_err(&good.replace("2:2 11:1", "2:2 1:1"));
        assert!(r.contains("strictly ascending"), "{r}");
        let (_, r) = text_err(&good.replace("0:5", "0-5"));
        assert!(r.contains("`0-5` is not `distance:count`"), "{r}");
        let (_, r) = text_err(&good.replace("reuse.decode.first = 3", "reuse.decode.first = x"));
        assert!(r.contains("`x` is not an unsigned"), "{r}");
        let (_, r) = text_err(&format!("{good}reuse.decode = 1:1\n"));
        assert!(r.contains("given again"), "{r}");
        let (_, r) = text_err(&good.replace("reuse.decode =", "reuse.decodes ="));
        assert!(r.contains("unknown key `reuse.decodes`"), "{r}");
    }

    #[test]
    fn v2_binary_bad_reuse_sections() {
        let good = with_reuse().write_binary();
        let counts_end = 16 + 12 * 8;
        let (off, r) = bin_err(&good[..counts_end]);
        assert_eq!(off, counts_end as u64);
        assert!(r.contains("truncated"), "{r}");
        let (off, r) = bin_err(&good[..good.len() - 1]);
        assert_eq!(off, good.len() as u64 - 1);
        assert!(r.contains("truncated"), "{r}");
        let mut long = good.clone();
        long.push(0);
        let (_, r) = bin_err(&long);
        assert!(r.contains("1 trailing"), "{r}");
        // A pair count past the bytes left is refused before allocating.
        let mut huge = good.clone();
        huge[counts_end + 8..counts_end + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        let (off, r) = bin_err(&huge);
        assert_eq!(off, counts_end as u64 + 8);
        assert!(r.contains("claims"), "{r}");
    }

    proptest::proptest! {
        /// Arbitrary bytes after either header never panic; success means a consistent profile.
        #[test]
        fn arbitrary_input_never_panics(kind in 0usize..4, tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let heads: [&[u8]; 4] = [&BINARY_MAGIC, &BINARY_MAGIC_V2, b"# strata expert profile v1\n", b"# strata expert profile v2\n"];
            let mut b = heads[kind].to_vec();
            b.extend_from_slice(&tail);
            if let Ok(p) = parse_profile_bytes(&b, "f") {
                proptest::prop_assert_eq!(p.counts.len() as u64, p.layers as u64 * p.experts as u64);
            }
        }

        #[test]
        fn text_and_binary_agree(layers in 1u32..6, experts in 1u32..9, seed: u64) {
            let counts = (0..layers * experts)
                .map(|i| seed.rotate_left(i) >> (i % 64))
                .collect();
            let p = ExpertProfile { layers, experts, counts, reuse: None };
            proptest::prop_assert_eq!(&parse_profile_bytes(p.write_text().as_bytes(), "t").unwrap(), &p);
            proptest::prop_assert_eq!(&parse_profile_bytes(&p.write_binary(), "b").unwrap(), &p);
        }
    }
}
