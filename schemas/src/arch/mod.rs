//! Per-architecture tensor layouts (llama.cpp names and GGUF shapes): synthesis and checking.
