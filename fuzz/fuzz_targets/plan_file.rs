//! Fuzz target: the plan file reader (fixed header + SHA-256 + validated rkyv archive) on
//! arbitrary bytes must return without panicking and within the allocation bound. The checksum
//! shields the archive from most mutations; `plan_payload` fuzzes the archive itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_schemas::planfile::{plan_to_bytes, read_plan_bytes};

#[path = "alloc_bound.rs"]
mod alloc_bound;

#[global_allocator]
static ALLOC: alloc_bound::Counting = alloc_bound::Counting;

/// Allowed peak: the GGUF target's 16 x input + 64 KiB. A decoded plan is larger than its
/// archive (an archived `String` or `Vec` is 8 bytes, the owned one 24 plus its heap bytes;
/// worst measured 3.7x, see FUZZING.md), plus one aligned copy of an unaligned payload (1x).
fn limit(len: usize) -> usize {
    16 * len + (64 << 10)
}

fuzz_target!(|data: &[u8]| {
    let base = alloc_bound::reset();
    let result = read_plan_bytes(data);
    let peak = alloc_bound::peak_above(base);
    alloc_bound::log(data.len(), peak);
    assert!(
        peak <= limit(data.len()),
        "allocated {peak} bytes for a {}-byte input",
        data.len()
    );
    // Decode -> encode -> decode -> encode is byte-stable (bytes, not `==`: an f64 may be NaN).
    if let Ok(plan) = result {
        if let Ok(file) = plan_to_bytes(&plan) {
            let back = read_plan_bytes(&file).expect("re-encoded plan reads back");
            let again = plan_to_bytes(&back).expect("re-encodes twice");
            assert_eq!(again, file, "re-encoding is not stable");
        }
    }
});
