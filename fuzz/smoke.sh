#!/usr/bin/env bash
# Time-boxed coverage-guided fuzzing of the Rust core (cargo-fuzz / libFuzzer, AddressSanitizer,
# debug assertions and overflow checks on), seeded with the malformed-checkpoint corpus.
#
#   bash fuzz/smoke.sh [SECONDS_PER_TARGET] [PYTHON]
#
# SECONDS_PER_TARGET defaults to 20 (six targets: about 120 s of fuzzing, plus the first build);
# PYTHON is an interpreter with kda_tp installed, used to write the seed corpus (default python3).
# Works on a stable toolchain: RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its -Z flags. Installs
# cargo-fuzz from crates.io when it is missing. Prints the inputs tried per target; exits
# non-zero on any crash (the reproducer is left in fuzz/artifacts/<target>/).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
python=${2:-python3}
export RUSTC_BOOTSTRAP=1

command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" tests/malformed.py "$work/seeds" >/dev/null

total=0
for target in header open_read plan_shard index read_range read_spans; do
    mkdir -p "$work/corpus/$target"
    cargo fuzz build -a "$target" 2>&1 | tail -1
    log="$work/$target.log"
    if ! cargo fuzz run -a "$target" "$work/corpus/$target" "$work/seeds" -- \
        -max_total_time="$seconds" -max_len=8192 -rss_limit_mb=2048 -timeout=10 >"$log" 2>&1; then
        tail -40 "$log"
        echo "fuzz target $target FAILED (reproducer under fuzz/artifacts/$target/)" >&2
        exit 1
    fi
    runs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -1)
    echo "fuzz $target: ${runs:-?} inputs in ${seconds} s, no crash"
    total=$((total + ${runs:-0}))
done
echo "fuzz: $total inputs tried, no crash"
