//! Compute backends. `cpu` is the reference every device kernel is tested against.
//! Invariant: backends take pre-validated shapes and never size memory from what is free.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
