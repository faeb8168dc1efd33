//! Fuzz target: the plan file reader (fixed header + validated rkyv archive) on arbitrary
//! bytes must return without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = strata_schemas::planfile::read_plan_bytes(data);
});
