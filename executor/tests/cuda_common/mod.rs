//! Shared helpers of the CUDA kernel tests (`cuda_ops`, `cuda_gemm`, `cuda_flash`,
//! `cuda_decode_ops`): the device or a loud skip, carving test buffers out of one arena,
//! copying host data in and out, random inputs.
//! Invariant: every view handed out lies inside its arena (`DeviceArena::view` checks it).
#![allow(dead_code)]

use rand::{rngs::StdRng, Rng};
use std::cell::Cell;
use std::sync::OnceLock;
use strata_exec::backend::cuda::{CudaDevice, DeviceArena, DeviceView, Pod};

/// The test binary's device, opened once by `init` into `cell`; `None` after printing
/// `SKIP (no CUDA device): TEST: why` when there is none, so no GPU test passes silently.
pub fn device_or_skip(
    cell: &'static OnceLock<Result<CudaDevice, String>>,
    test: &str,
    init: impl FnOnce() -> Result<CudaDevice, String>,
) -> Option<&'static CudaDevice> {
    match cell.get_or_init(init) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIP (no CUDA device): {test}: {e}");
            None
        }
    }
}

/// Hands out 256-aligned windows of one arena, front to back.
pub struct Carve<'a> {
    arena: &'a DeviceArena,
    /// The next free offset (a second carve may start where another stands).
    pub off: Cell<u64>,
}

impl<'a> Carve<'a> {
    pub fn new(arena: &'a DeviceArena) -> Self {
        Self {
            arena,
            off: Cell::new(0),
        }
    }
    pub fn take(&self, len: u64) -> DeviceView<'a> {
        let at = self.off.get();
        let v = self.arena.view(at, len).expect("test arena too small");
        self.off.set((at + len).div_ceil(256) * 256);
        v
    }
}

/// A fresh window holding `x`.
pub fn put<'a, T: Pod>(d: &CudaDevice, c: &Carve<'a>, x: &[T]) -> DeviceView<'a> {
    let v = c.take(std::mem::size_of_val(x) as u64);
    d.htod(x, v).unwrap();
    v
}

/// The first `n` values of `v`.
pub fn get<T: Pod>(d: &CudaDevice, v: DeviceView<'_>, n: usize) -> Vec<T> {
    let mut out = vec![T::default(); n];
    d.dtoh(
        v.sub(0, std::mem::size_of_val(&out[..]) as u64).unwrap(),
        &mut out,
    )
    .unwrap();
    out
}

/// `n` values uniform in [-scale, scale).
pub fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| scale * (2.0 * rng.random::<f32>() - 1.0))
        .collect()
}
