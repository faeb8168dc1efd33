//! Fuzz target: the bare rkyv payload of a plan file (no header, no checksum), so mutations
//! reach rkyv's validator (`access`) and deserializer, which `plan_file` rarely does because
//! of the payload SHA-256. No input may panic or allocate past the bound; an accepted payload
//! must decode to a plan whose re-encoding is stable.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_schemas::planfile::{plan_to_bytes, read_plan_payload, HEADER_LEN};

#[path = "alloc_bound.rs"]
mod alloc_bound;

#[global_allocator]
static ALLOC: alloc_bound::Counting = alloc_bound::Counting;

/// Same bound and reasoning as `plan_file`.
fn limit(len: usize) -> usize {
    16 * len + (64 << 10)
}

fuzz_target!(|data: &[u8]| {
    let base = alloc_bound::reset();
    let result = read_plan_payload(data);
    let peak = alloc_bound::peak_above(base);
    alloc_bound::log(data.len(), peak);
    assert!(
        peak <= limit(data.len()),
        "allocated {peak} bytes for a {}-byte input",
        data.len()
    );
    // A validated archive may still hold fingerprints that `plan_to_bytes` refuses (too long,
    // not printable): that is an error, not a crash. Otherwise encode -> decode -> encode is
    // byte-stable (bytes, not `==`: a fuzzed f64 may be NaN).
    if let Ok(plan) = result {
        if let Ok(file) = plan_to_bytes(&plan) {
            let payload = &file[HEADER_LEN as usize..];
            let back = read_plan_payload(payload).expect("re-encoded payload reads back");
            let again = plan_to_bytes(&back).expect("re-encodes twice");
            assert_eq!(again, file, "re-encoding is not stable");
        }
    }
});
