//! strata-plan library: accounting, split search, packing, verifier, cost model, report.

pub mod account;
pub mod catalogue;
pub mod cost;
pub mod experts;
pub mod facts;
pub mod model;
pub mod pack;
pub mod report;
pub mod solve;
pub mod split;
pub mod testing;
pub mod units;
pub mod verify;
