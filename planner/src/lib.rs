//! strata-plan library: accounting, split search, packing, verifier, cost model, report.
