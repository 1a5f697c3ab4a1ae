#!/usr/bin/env bash
# Charges per second through RedisStore beside redis-benchmark EVALSHA of the
# same script, on this machine, in one run. Installs Debian's redis-server
# and redis-tools (redis-benchmark, redis-cli) when they are missing.
#
#   scripts/redis-bench.sh            # 5 paired rounds of 200000 charges
#   BENCH_N=50000 BENCH_ROUNDS=3 scripts/redis-bench.sh
#   BENCH_STOCK_POOL=1 scripts/redis-bench.sh   # on deadpool-redis's stock pool
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
    # The package may start a server of its own on 6379; the benchmark starts
    # its own on a free port.
    service redis-server stop >/dev/null 2>&1 || true
fi

exec cargo bench --features redis --bench redis
