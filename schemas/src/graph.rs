//! The forward graph: per-architecture ops and the buffers each needs, with lifetimes.
