//! The seam's products on int8 activations (by default over Q8_0 weights; `--kernel-options
//! dp4a` adds Q4_K, Q6_K and IQ3_S, `f32-products` turns them off): where the CUDA stage
//! quantizes a product's input once (`launch::dp4a::quantize`, into the plan's `xh` buffer,
//! which only the tensor-core prefill uses otherwise) and runs the `dq4_*` products over it
//! instead of the f32 ones: Q/K/V (one input, one launch), the output projection, the
//! experts' gate/up (one input for both) and down (the SwiGLU output quantized once).
//! Invariant: each entry answers `Ok(false)` having launched nothing when a weight type is not
//! one the options' `int8` covers (`Int8Products::covers`), the pass is longer than the
//! products take (16 tokens), or `xh` cannot hold the quantized rows; the caller then runs the f32 products. The
//! callers (forward.rs) have already sent tensor-core passes elsewhere, so `xh` is free.

use super::forward::{mat_bytes, CMat};
use super::launch::decode::ExpertTable;
use super::launch::dp4a::{self, Q8a};
use super::launch::{Launcher, Mat};
use super::stage::CudaStage;
use super::{CudaError, DeviceView};
use crate::backend::WorkBuf;
use strata_schemas::ggml::GgmlType;

impl CudaStage {
    /// `xh` as q8a rows of `rows x cols`, when the pass has 1..=16 tokens (`n`) and `xh`
    /// holds them.
    fn q8a_rows(&self, n: usize, rows: usize, cols: usize) -> Option<Q8a<'_>> {
        if n == 0 || n > dp4a::MAX_TOK || cols % 32 != 0 {
            return None;
        }
        let buf = self.buf(WorkBuf::Xh).ok()?;
        if buf.len() < Q8a::bytes(rows, cols) {
            return None;
        }
        Q8a::carve(buf, rows, cols).ok()
    }

    /// Whether products over rows of `cols` of `ty` run on int8 activations: the options
    /// cover the type and a kernel reads it.
    fn int8_covers(&self, ty: GgmlType, cols: usize) -> bool {
        self.opts.int8.covers(ty) && dp4a::supports(ty, cols)
    }

    /// Products of one input `x` (n rows) into each output: `outs` of one width, each of a
    /// supported type (Q4_K_M's Q4_K Q/K with a Q6_K V included), up to three (Q/K/V), `add`
    /// into the outputs (the output projection).
    pub(crate) fn int8_products(
        &self,
        l: &Launcher<'_>,
        label: &'static str,
        x: WorkBuf,
        outs: &[(CMat, WorkBuf)],
        n: usize,
        add: bool,
    ) -> Result<bool, CudaError> {
        let Some((first, _)) = outs.first() else {
            return Ok(false);
        };
        let cols = first.cols;
        let fits = outs
            .iter()
            .all(|(m, _)| m.cols == cols && self.int8_covers(m.ty, m.cols));
        if !fits || outs.len() > 3 {
            return Ok(false);
        }
        let Some(xq) = self.q8a_rows(n, n, cols) else {
            return Ok(false);
        };
        dp4a::quantize(l, self.buf_at(x, 0, 4 * (n * cols) as u64)?, &xq)?;
        let mut mats = Vec::with_capacity(outs.len());
        let mut ys = Vec::with_capacity(outs.len());
        for (m, y) in outs {
            mats.push(Mat {
                w: self.view(m.off, mat_bytes(m.ty, m.rows, m.cols)?)?,
                ty: m.ty,
                rows: m.rows,
                cols: m.cols,
            });
            ys.push(self.buf_at(*y, 0, 4 * (n * m.rows) as u64)?);
        }
        dp4a::mv(l, label, &mats, &xq, &ys, n, add, self.opts.stage_inputs)?;
        Ok(true)
    }

    /// The experts' gate/up of `n` tokens' inputs `xn` into `h`, when gate and up share a
    /// supported type.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn int8_gate_up(
        &self,
        l: &Launcher<'_>,
        ex: ExpertTable<'_>,
        ids: DeviceView<'_>,
        k: usize,
        xn: DeviceView<'_>,
        h: DeviceView<'_>,
        n: usize,
    ) -> Result<bool, CudaError> {
        if ex.ty != ex.ty_up || !self.int8_covers(ex.ty, ex.e) {
            return Ok(false);
        }
        let Some(xq) = self.q8a_rows(n, n, ex.e) else {
            return Ok(false);
        };
        dp4a::quantize(l, xn, &xq)?;
        dp4a::moe_gate_up(l, ex, ids, k, &xq, h, n)?;
        Ok(true)
    }

    /// The experts' down products of `h` (n * k rows) weighted and added into `y`, when the
    /// down matrices are of a supported type.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn int8_down(
        &self,
        l: &Launcher<'_>,
        ex: ExpertTable<'_>,
        ids: DeviceView<'_>,
        wts: DeviceView<'_>,
        k: usize,
        h: DeviceView<'_>,
        y: DeviceView<'_>,
        n: usize,
    ) -> Result<bool, CudaError> {
        if !self.int8_covers(ex.ty_down, ex.f) || k > super::launch::DQ_DOWN_MAXK {
            return Ok(false);
        }
        let Some(hq) = self.q8a_rows(n, n * k, ex.f) else {
            return Ok(false);
        };
        dp4a::quantize(l, h, &hq)?;
        dp4a::moe_down(l, ex, ids, wts, k, &hq, y, n)?;
        Ok(true)
    }
}
