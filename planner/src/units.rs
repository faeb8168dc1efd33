//! Numbers as people read and type them: byte sizes in the unit that suits them (KiB, MiB,
//! GiB) and cell counts rounded to the multiples a person would pass to a flag.
//! Invariant: formatting never changes a value the plan uses; rounding helpers only round
//! down, so a rounded suggestion asks for no more than the exact one.

use strata_schemas::probe::{GIB, MIB};

/// Cells a suggested `--kv-resident` / `--max-context` is a multiple of.
pub const CELL_STEP: u64 = 256;

/// Bytes in the unit that suits them: GiB (two decimals) from 1 GiB, MiB (one decimal) from
/// 1 MiB, else KiB or bytes.
pub fn bytes(b: u64) -> String {
    if b >= GIB {
        format!("{:.2} GiB", b as f64 / GIB as f64)
    } else if b >= MIB {
        format!("{:.1} MiB", b as f64 / MIB as f64)
    } else if b >= 1024 {
        format!("{:.1} KiB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// `cells` rounded down to a multiple of [`CELL_STEP`], unless that would go below `floor`
/// (then `cells` as is).
pub fn round_cells(cells: u64, floor: u64) -> u64 {
    let r = cells / CELL_STEP * CELL_STEP;
    if r >= floor.max(1) {
        r
    } else {
        cells
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_scale_with_the_size() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(8 * MIB), "8.0 MiB");
        assert_eq!(bytes(1536 * 1024), "1.5 MiB");
        assert_eq!(bytes(3 * GIB / 2), "1.50 GiB");
        assert_eq!(bytes(1023 * MIB), "1023.0 MiB");
    }

    #[test]
    fn cells_round_down_to_typed_values_but_not_below_the_floor() {
        assert_eq!(round_cells(37_421, 4096), 37_376);
        assert_eq!(round_cells(4100, 4096), 4096);
        assert_eq!(round_cells(4100, 4097), 4100);
        assert_eq!(round_cells(65_536, 0), 65_536);
        assert_eq!(round_cells(200, 0), 200);
    }
}
