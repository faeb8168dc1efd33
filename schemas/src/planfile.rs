//! The plan file: fixed header plus a validated rkyv archive.
