//! Compute backends. `cpu` is the reference every device kernel is tested against; `cuda`
//! and `hip` drive GPUs; `view`, `pcie` and `kernel_cache` are the vendor-neutral pieces the
//! GPU backends share (bounds-checked device views, the PCIe link from sysfs, the on-disk
//! cache of compiled kernels).
//! Invariant: backends take pre-validated shapes and never size memory from what is free.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "hip")]
pub mod hip;
pub mod kernel_cache;
pub mod pcie;
pub mod view;
