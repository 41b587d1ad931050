#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hyperframes::fuzzing::handshake(data));
