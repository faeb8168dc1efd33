//! strata-exec: the executor — the backend seam and its backends (`backend::cpu`, the
//! reference; `backend::cuda`), one forward pass per architecture over the seam (`model`),
//! the pipeline that drives any backend as an engine (`pipeline`), plan binding (`bind`),
//! weight loading (`load`), the expert cache (`experts`), sampling, tokenizer and server.
//! Invariant: the CPU reference computes what transformers computes in float32, every GPU
//! kernel is checked against it, and no engine allocates per token after start-up.

pub mod backend;
pub mod bind;
pub mod engine;
pub mod exec;
pub mod experts;
pub mod load;
pub mod model;
pub mod pick;
pub mod pipeline;
pub mod routing;
pub use strata_schemas::quant;
pub mod sampler;
pub mod serve;
pub mod tokenizer;
