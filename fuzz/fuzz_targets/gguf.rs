#![no_main]
//! Fuzzes the gguf reader: any input must give a model listing or a clean error.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    stable_diffusion::io::fuzzing::gguf_bytes(data);
});
