#!/usr/bin/env bash
# Runs every fuzz target for a bounded time, starting from what fuzz/seeds keeps.
#
#   scripts/fuzz.sh [seconds per target, default 30] [--keep]
#
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz --locked`). A crash
# fails the script and leaves its input in fuzz/artifacts/<target>/ (add it to
# fuzz/seeds/<target>/ once fixed: tests/fuzz_corpus.rs replays it in every `cargo test`).
# --keep merges the new inputs that add coverage into fuzz/seeds (libFuzzer's -merge=1).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-30}
keep=${2:-}
targets=(frame_decoder handshake shm_descriptor rdma_proto session_control)
cargo +nightly fuzz build -O 2>&1 | grep -E "^error" && exit 1 || true
for t in "${targets[@]}"; do
    rm -rf "corpus/$t" && mkdir -p "corpus/$t" && cp "seeds/$t/"* "corpus/$t/"
    # A fixed RSS ceiling: no input may make a decoder allocate past its limits.
    out=$(cargo +nightly fuzz run -O "$t" "corpus/$t" -- -max_total_time="$secs" \
        -rss_limit_mb=2048 -malloc_limit_mb=256 2>&1) || {
        echo "$out" | tail -40
        echo "fuzz: $t FAILED (input in fuzz/artifacts/$t/)"
        exit 1
    }
    echo "fuzz: $t: $(echo "$out" | grep -E '^Done [0-9]+ runs' | tail -1) ($(echo "$out" | grep -oE 'cov: [0-9]+' | tail -1))"
    if [ "$keep" = "--keep" ]; then
        mkdir -p "new/$t"
        cargo +nightly fuzz run -O "$t" "new/$t" "seeds/$t" "corpus/$t" -- -merge=1 >/dev/null 2>&1
        cp "new/$t/"* "seeds/$t/" 2>/dev/null || true
        rm -rf "new/$t"
    fi
done
