//! strata-exec: the executor. For now it holds the CPU reference numerics — row codecs
//! (`quant`), CPU ops (`backend::cpu`) and the Qwen3-MoE forward pass (`model::qwen3moe`).
//! Invariant: the reference computes what transformers' `Qwen3MoeForCausalLM` computes in
//! float32, and allocates nothing per token once its scratch is warm.

pub mod backend;
pub mod engine;
pub mod model;
pub mod quant;
pub mod sampler;
pub mod serve;
pub mod tokenizer;
