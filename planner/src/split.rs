//! Layer split search: contiguous ranges of main blocks over the chosen devices, in order.
//! Invariant: every device gets at least one block; `auto` is an exact dynamic programme over
//! (device, end block) minimising the summed per-device cost, so its answer is optimal for the
//! cost it is given and deterministic (ties keep the earliest boundary).

/// Bounds `b` for `d` devices over `n` blocks: device i holds `[b[i-1], b[i])` with
/// `b[-1] = 0` and `b[d-1] = n`; the returned vector has `d - 1` entries.
pub type Bounds = Vec<u32>;

/// Check a user's `--layer-split` against the device and block counts.
pub fn check_bounds(bounds: &[u32], devices: usize, n_layer: u32) -> Result<(), String> {
    if bounds.len() + 1 != devices {
        return Err(format!(
            "--layer-split gives {} boundar{} for {} device{}: it needs {} (e.g. {} for {} devices over {} layers)",
            bounds.len(),
            if bounds.len() == 1 { "y" } else { "ies" },
            devices,
            if devices == 1 { "" } else { "s" },
            devices.saturating_sub(1),
            even_bounds(devices, n_layer)
                .iter()
                .map(|b| b.to_string())
                .collect::<Vec<_>>()
                .join(","),
            devices,
            n_layer
        ));
    }
    let mut prev = 0;
    for &b in bounds {
        if b <= prev || b >= n_layer {
            return Err(format!(
                "--layer-split boundaries must rise strictly inside (0, {n_layer}): {b} after {prev} leaves a device without layers"
            ));
        }
        prev = b;
    }
    Ok(())
}

/// Even split (used in messages and as a fallback shape).
pub fn even_bounds(devices: usize, n_layer: u32) -> Bounds {
    (1..devices as u32)
        .map(|i| (i as u64 * n_layer as u64 / devices as u64) as u32)
        .collect()
}

/// Ranges of each device from bounds.
pub fn ranges(bounds: &[u32], n_layer: u32) -> Vec<(u32, u32)> {
    let mut out = Vec::with_capacity(bounds.len() + 1);
    let mut a = 0;
    for &b in bounds {
        out.push((a, b));
        a = b;
    }
    out.push((a, n_layer));
    out
}

/// Minimise `sum cost(device, a, b)` over contiguous splits; `cost` returns `None` when the
/// device cannot hold that range. Returns the bounds and the total cost.
#[allow(clippy::needless_range_loop)] // the DP reads clearer with explicit indices
pub fn best_split<F>(devices: usize, n_layer: u32, mut cost: F) -> Option<(Bounds, f64)>
where
    F: FnMut(usize, u32, u32) -> Option<f64>,
{
    let d = devices;
    let n = n_layer as usize;
    if d == 0 || d > n {
        return None;
    }
    // best[k][e]: least cost of devices 0..k covering blocks [0, e); from[k][e]: start of k-1's range.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; d + 1];
    let mut from = vec![vec![0usize; n + 1]; d + 1];
    best[0][0] = 0.0;
    for k in 1..=d {
        // Device k-1 ends at e; leave at least one block for each later device.
        let e_lo = k;
        let e_hi = n - (d - k);
        for e in e_lo..=e_hi {
            let mut acc = inf;
            let mut arg = 0;
            for s in (k - 1)..e {
                let prev = best[k - 1][s];
                if !prev.is_finite() {
                    continue;
                }
                if let Some(c) = cost(k - 1, s as u32, e as u32) {
                    let total = prev + c;
                    if total < acc {
                        acc = total;
                        arg = s;
                    }
                }
            }
            best[k][e] = acc;
            from[k][e] = arg;
        }
    }
    if !best[d][n].is_finite() {
        return None;
    }
    let mut bounds = vec![0u32; d - 1];
    let mut e = n;
    for k in (1..=d).rev() {
        let s = from[k][e];
        if k >= 2 {
            bounds[k - 2] = s as u32;
        }
        e = s;
    }
    Some((bounds, best[d][n]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_matches_exhaustive_on_small_cases() {
        // Cost: device speed differs; device capacity limits the layers it can take.
        let speed = [1.0, 2.0, 0.5];
        let cap = [5u32, 9, 4];
        let n = 12;
        let cost = |d: usize, a: u32, b: u32| {
            if b - a > cap[d] {
                None
            } else {
                Some((b - a) as f64 / speed[d] + if d == 1 { 0.3 } else { 0.0 })
            }
        };
        let (bounds, total) = best_split(3, n, cost).unwrap();
        let mut brute = f64::INFINITY;
        for x in 1..n {
            for y in (x + 1)..n {
                let c = [cost(0, 0, x), cost(1, x, y), cost(2, y, n)];
                if c.iter().all(|v| v.is_some()) {
                    brute = brute.min(c.iter().map(|v| v.unwrap()).sum());
                }
            }
        }
        assert!((total - brute).abs() < 1e-12, "{total} vs {brute}");
        let r = ranges(&bounds, n);
        let recomputed: f64 = r
            .iter()
            .enumerate()
            .map(|(d, (a, b))| cost(d, *a, *b).unwrap())
            .sum();
        assert!((recomputed - total).abs() < 1e-12);
    }

    #[test]
    fn infeasible_and_too_many_devices() {
        assert!(best_split(3, 2, |_, _, _| Some(1.0)).is_none());
        assert!(best_split(2, 10, |_, a, b| if b - a <= 3 { Some(1.0) } else { None }).is_none());
    }

    #[test]
    fn explicit_bounds_are_checked() {
        assert!(check_bounds(&[16, 32], 3, 48).is_ok());
        let e = check_bounds(&[16], 3, 48).unwrap_err();
        assert!(e.contains("needs 2"), "{e}");
        assert!(check_bounds(&[32, 16], 3, 48).is_err());
        assert!(check_bounds(&[16, 48], 3, 48).is_err());
        assert_eq!(even_bounds(3, 48), vec![16, 32]);
    }
}
