//! Fuzz target: `parse_gguf_bytes` on arbitrary bytes must return (Ok or a typed error) without
//! panicking, and must not allocate more than a small multiple of the input.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "alloc_bound.rs"]
mod alloc_bound;

#[global_allocator]
static ALLOC: alloc_bound::Counting = alloc_bound::Counting;

/// Allowed peak: 16 bytes held per input byte plus a fixed 64 KiB (error messages, capacity
/// hints). A string array of empty strings is the densest case: 24 bytes of `String` per
/// 8 input bytes.
fn limit(len: usize) -> usize {
    16 * len + (64 << 10)
}

fuzz_target!(|data: &[u8]| {
    let base = alloc_bound::reset();
    let result = strata_schemas::gguf::parse_gguf_bytes(data, "fuzz.gguf");
    let peak = alloc_bound::peak_above(base);
    assert!(
        peak <= limit(data.len()),
        "allocated {peak} bytes for a {}-byte input",
        data.len()
    );
    if let Ok(f) = result {
        for t in &f.tensors {
            let end = f.data_offset + t.offset + t.bytes;
            assert!(end <= f.file_size, "tensor {} ends past the file", t.name);
            assert!((1..=4).contains(&t.dims.len()));
            assert_eq!(t.offset % f.alignment, 0);
        }
        assert!(f.alignment.is_power_of_two());
    }
});
