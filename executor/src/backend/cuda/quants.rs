//! Launchers of the any-type kernels (kernels/cuda/dequant.cu over quants.cuh's decoders):
//! `dequant_rows` (rows of any weight type to f32: embedding lookups, tests) and `mv_any`
//! (one-token matrix-vector product for any weight type). Simple and correct first; the
//! engine's fused decode and prefill kernels are the fast paths.
//! Invariant: every launch is preceded by the checks the kernels rely on: the type has a
//! decoder, `cols` is a multiple of 32 and a whole number of blocks, every view holds what
//! the kernel touches, and every row id is inside the table.

use super::launch::{arg_ptr, bad, int};
use super::{CudaDevice, CudaError, DeviceView};
use crate::quant;
use cudarc::driver::LaunchConfig;
use strata_schemas::ggml::GgmlType;

/// Threads per block of both kernels.
const BLOCK: u32 = 128;

/// The bytes of one row of `cols` elements of `ty`, after the checks every any-type kernel
/// needs.
fn any_row_bytes(op: &'static str, ty: GgmlType, cols: usize) -> Result<usize, CudaError> {
    if cols == 0 || cols % 32 != 0 {
        return Err(bad(
            op,
            format!(
                "cols = {cols}: the any-type kernels take rows of a positive multiple of 32 values"
            ),
        ));
    }
    quant::row_bytes(ty, cols).map_err(|e| bad(op, e.to_string()))
}

impl CudaDevice {
    /// `out[r] = dequantize(W row ids[r])` for every id (or, with `ids` None, every row of W),
    /// W `rows × cols` of any type the CPU reference decodes; `out` is `n × cols` f32 where
    /// n is the number of ids (or `rows`). `ids` pairs the host copy (checked here) with the
    /// same values on the device.
    pub fn dequant_rows(
        &self,
        w: DeviceView<'_>,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        ids: Option<(&[i32], DeviceView<'_>)>,
        out: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "dequant_rows";
        let rb = any_row_bytes(OP, ty, cols)?;
        w.expect(OP, "w", rb as u64 * rows as u64, 1)?;
        let (n, ip) = match ids {
            Some((host, dev)) => {
                if let Some(b) = host.iter().find(|&&i| i < 0 || i as usize >= rows) {
                    return Err(bad(OP, format!("row id {b} outside the {rows}-row table")));
                }
                dev.expect(OP, "ids", 4 * host.len() as u64, 4)?;
                (host.len(), dev.ptr())
            }
            None => (rows, 0),
        };
        if n == 0 {
            return Ok(());
        }
        out.expect(OP, "out", 4 * (n * cols) as u64, 4)?;
        let (ti, rbi, ci, ni) = (
            ty.id() as i32,
            rb as i64,
            int(OP, "cols", cols)?,
            int(OP, "rows out", n)?,
        );
        int(OP, "cols * rows out", cols * n)?;
        let (wp, op) = (w.ptr(), out.ptr());
        let cfg = LaunchConfig {
            grid_dim: (ni as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: w holds `rows` rows of rb bytes, every id (when given) is < rows and the
        // device ids equal the host ones (the caller uploads them); out holds n rows of cols.
        unsafe {
            self.launch_raw(
                "dequant_rows",
                cfg,
                &mut [
                    arg_ptr(&wp),
                    arg_ptr(&ti),
                    arg_ptr(&rbi),
                    arg_ptr(&ip),
                    arg_ptr(&op),
                    arg_ptr(&ci),
                    arg_ptr(&ni),
                ],
            )
        }
    }

    /// `y[r] = W_r · x` for one token: W `rows × cols` of any type the CPU reference decodes,
    /// x `cols` f32, y `rows` f32.
    pub fn mv_any(
        &self,
        w: DeviceView<'_>,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        x: DeviceView<'_>,
        y: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "mv_any";
        let rb = any_row_bytes(OP, ty, cols)?;
        if rows == 0 {
            return Ok(());
        }
        w.expect(OP, "w", rb as u64 * rows as u64, 1)?;
        x.expect(OP, "x", 4 * cols as u64, 4)?;
        y.expect(OP, "y", 4 * rows as u64, 4)?;
        let (ti, rbi, ri, ci) = (
            ty.id() as i32,
            rb as i64,
            int(OP, "rows", rows)?,
            int(OP, "cols", cols)?,
        );
        let warps = BLOCK as usize / 32;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let (wp, xp, yp) = (w.ptr(), x.ptr(), y.ptr());
        // SAFETY: w holds `rows` rows of rb bytes of ty, x holds cols floats, y rows floats;
        // the kernel skips warps past the last row.
        unsafe {
            self.launch_raw(
                "mv_any",
                cfg,
                &mut [
                    arg_ptr(&wp),
                    arg_ptr(&ti),
                    arg_ptr(&rbi),
                    arg_ptr(&xp),
                    arg_ptr(&yp),
                    arg_ptr(&ri),
                    arg_ptr(&ci),
                ],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_the_kernels_cannot_take_are_refused() {
        assert!(
            any_row_bytes("t", GgmlType::Q8_0, 48).is_err(),
            "not a multiple of 32"
        );
        assert!(
            any_row_bytes("t", GgmlType::Q4K, 32).is_err(),
            "partial K-quant block"
        );
        assert!(
            any_row_bytes("t", GgmlType::Tq1_0, 256).is_err(),
            "no decoder"
        );
        assert!(any_row_bytes("t", GgmlType::F32, 0).is_err());
        assert_eq!(any_row_bytes("t", GgmlType::Iq3S, 512).unwrap(), 220);
        assert_eq!(any_row_bytes("t", GgmlType::MXFP4, 64).unwrap(), 34);
    }
}
