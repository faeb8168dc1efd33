//! strata-schemas: Strata's vocabulary and every on-disk format. Nothing here touches a GPU;
//! the planner and the executor both read the world through these types.

pub mod arch;
pub mod capability;
pub mod descriptor;
pub mod dims;
pub mod files;
pub mod ggml;
pub mod gguf;
pub mod graph;
pub mod inventory;
pub mod known;
pub mod modelinfo;
pub mod moe_tiles;
pub mod plan;
pub mod planfile;
pub mod probe;
pub mod profile;
pub mod quant;
pub mod safetensors;
pub mod serve;
pub mod text;
pub mod workset;
