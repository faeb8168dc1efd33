//! strata-exec: the executor — CPU reference numerics (`quant`, `backend::cpu`), the Qwen3-MoE
//! forward pass (`model::qwen3moe`), plan binding (`bind`), weight loading (`load`), the
//! expert cache (`experts`) and the plan-bound engine (`exec::PlanEngine`).
//! Invariant: the reference computes what transformers' `Qwen3MoeForCausalLM` computes in
//! float32, and allocates nothing per token once its scratch is warm.

pub mod backend;
pub mod bind;
pub mod engine;
pub mod exec;
pub mod experts;
pub mod load;
pub mod model;
pub use strata_schemas::quant;
pub mod sampler;
pub mod serve;
pub mod tokenizer;
