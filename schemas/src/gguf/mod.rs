//! GGUF headers: reading (validated, hostile-input safe) and writing.
