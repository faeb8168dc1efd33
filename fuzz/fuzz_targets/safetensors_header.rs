//! Fuzz target: the safetensors header reader on arbitrary bytes must return without panicking,
//! must not allocate more than a small multiple of the input, and anything it accepts must
//! satisfy the header invariants (spans inside the data, sized by shape and dtype, disjoint).
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_schemas::safetensors::{parse_header_bytes, MAX_ELEMENTS, MAX_RANK};

#[path = "alloc_bound.rs"]
mod alloc_bound;

#[global_allocator]
static ALLOC: alloc_bound::Counting = alloc_bound::Counting;

/// Allowed peak: the GGUF target's bound, 16 bytes held per input byte plus a fixed 64 KiB
/// (error messages, capacity hints).
fn limit(len: usize) -> usize {
    16 * len + (64 << 10)
}

fuzz_target!(|data: &[u8]| {
    let base = alloc_bound::reset();
    let result = parse_header_bytes(data, "fuzz.safetensors");
    let peak = alloc_bound::peak_above(base);
    alloc_bound::log(data.len(), peak);
    assert!(
        peak <= limit(data.len()),
        "allocated {peak} bytes for a {}-byte input",
        data.len()
    );
    if let Ok(h) = result {
        assert_eq!(h.file_size, data.len() as u64);
        assert!(h.data_start >= 8 && h.data_start <= h.file_size);
        let mut spans = Vec::new();
        for t in &h.tensors {
            assert!(t.shape.len() <= MAX_RANK, "{}", t.name);
            let elements = t.shape.iter().try_fold(1u64, |a, d| a.checked_mul(*d));
            let elements = elements.expect("accepted shape overflows");
            assert!(elements <= MAX_ELEMENTS);
            assert_eq!(
                elements * t.dtype.bits(),
                8 * (t.end - t.begin),
                "{}",
                t.name
            );
            assert!(t.begin <= t.end && t.end <= h.data_len(), "{}", t.name);
            if t.begin < t.end {
                spans.push((t.begin, t.end));
            }
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "overlapping spans accepted: {w:?}");
        }
    }
});
