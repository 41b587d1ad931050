//! Exposes the iceoryx2 version that Cargo.lock pinned as `IOX2_VERSION`, so the JSON
//! line reports the crate actually linked, not a number typed by hand.

use std::fs;
use std::path::Path;

fn main() {
    let lock = Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    let text = fs::read_to_string(&lock).unwrap_or_default();
    let mut version = String::from("unknown");
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim() == "name = \"iceoryx2\"" {
            if let Some(v) = lines
                .next()
                .and_then(|l| l.trim().strip_prefix("version = "))
            {
                version = v.trim_matches('"').to_string();
            }
            break;
        }
    }
    println!("cargo:rustc-env=IOX2_VERSION={version}");
}
