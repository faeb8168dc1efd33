//! The expert profile file: per-layer, per-expert routing counts.
