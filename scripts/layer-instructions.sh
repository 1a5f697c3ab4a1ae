#!/usr/bin/env bash
# Instructions per request through `QuotaLayer::daily`, through the bare
# service it wraps, and through the floor of a quota layer written by hand
# around that service (`examples/shared/floor_layer.rs`, as in `cargo bench
# --bench layer`), counted by valgrind's callgrind: a figure that does not
# move with the machine's noise, unlike the times of `cargo bench --bench
# layer`, so that two builds compare within a fraction of a percent.
#
#   scripts/layer-instructions.sh                  # 1 subject
#   BENCH_SUBJECTS=100000 scripts/layer-instructions.sh
#
# Runs `examples/layer_instructions.rs` (release) with 20 000 and with
# 60 000 requests in each mode and prints the difference over 40 000: what
# one request costs, start-up and exit left out. Installs Debian's valgrind
# when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

subjects=${BENCH_SUBJECTS:-1}

# shellcheck source=scripts/common.sh
. scripts/common.sh
install_missing valgrind=valgrind

cargo build --release --quiet --example layer_instructions
program=${CARGO_TARGET_DIR:-target}/release/examples/layer_instructions

count() { # mode requests
    local refs
    refs=$(valgrind --tool=callgrind --callgrind-out-file="$work/out" "$program" "$1" "$2" "$subjects" 2>&1 |
        awk '/refs:/ { gsub(",", "", $NF); print $NF }')
    if [ -z "$refs" ]; then
        echo "$program $1 $2 $subjects: no instruction count (did it run?)" >&2
        exit 1
    fi
    echo "$refs"
}

for mode in bare floor layer; do
    low=$(count "$mode" 20000)
    high=$(count "$mode" 60000)
    echo "$mode, $subjects subject(s): $(((high - low) / 40000)) instructions per request"
done
