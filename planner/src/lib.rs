//! strata-plan library: accounting, split search, packing, verifier, cost model, report.

pub mod pack;
pub mod verify;
