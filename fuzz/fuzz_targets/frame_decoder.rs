#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hyperframes::fuzzing::frame_decoder(data));
