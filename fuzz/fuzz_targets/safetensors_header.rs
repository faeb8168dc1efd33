//! Fuzz target: the safetensors header reader on arbitrary bytes must return without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = strata_schemas::safetensors::parse_header_bytes(data, "fuzz.safetensors");
});
