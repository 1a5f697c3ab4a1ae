#!/usr/bin/env bash
# Instructions per request that the demo server runs over HTTP (user space,
# every thread), counted by valgrind's callgrind: a figure that does not move
# with the machine's noise, unlike the rates of `scripts/http-bench.sh`, so
# that two builds, or the quota and its references, compare within a
# fraction of a percent.
#
#   scripts/http-instructions.sh                    # off, fields, memory, governor
#   BENCH_STORES=off,memory,governor,redis scripts/http-instructions.sh
#   BENCH_SECONDS=8 BENCH_CONNECTIONS=16 scripts/http-instructions.sh
#   BENCH_BASE_SERVER=path/to/server BENCH_STORES=off,memory,memory-base scripts/http-instructions.sh
#   BENCH_SUBJECTS=200 BENCH_STORES=off,memory,redis-lease scripts/http-instructions.sh
#
# Each server runs under callgrind with counting off; wrk sends `GET /read`
# for one of 10 000 accounts at random (`BENCH_SUBJECTS`) over
# `BENCH_CONNECTIONS` (16) connections from one thread, first for 3 s
# unmeasured, then for `BENCH_SECONDS` (8) with counting on. The figure is
# the instructions counted over the requests wrk completed meanwhile.
# Servers, as in `scripts/http-bench.sh`: `off`, `fields` (the demo server
# with `--quota fields`: the two fields written, nothing counted),
# `memory`, `governor`, `redis`, `redis-lease` (`--lease`), and
# `memory-base` from `BENCH_BASE_SERVER`. Under callgrind a server runs
# some fifty times slower: with 10 000 accounts the leased server's
# subjects are idle between two requests and take no block; measure it
# with `BENCH_SUBJECTS=200`, each subject then as busy as in
# `scripts/http-bench.sh` (its timed background work still falls on fifty
# times fewer requests). Installs Debian's valgrind and wrk (and
# redis-server, redis-tools when a Redis server is measured) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${BENCH_SECONDS:-8}
connections=${BENCH_CONNECTIONS:-16}
subjects=${BENCH_SUBJECTS:-10000}
IFS=, read -r -a stores <<<"${BENCH_STORES:-off,fields,memory,governor}"
for name in "${stores[@]}"; do
    case $name in
    off | fields | memory | governor | redis | redis-lease) ;;
    memory-base)
        if [ ! -x "${BENCH_BASE_SERVER:-}" ]; then
            echo "BENCH_STORES: $name needs BENCH_BASE_SERVER, the path of another build's demo server" >&2
            exit 2
        fi
        ;;
    *)
        echo "BENCH_STORES: unknown server $name (off, fields, memory, governor, redis, redis-lease, memory-base)" >&2
        exit 2
        ;;
    esac
done
uses_redis() { [[ $1 == redis* ]]; }
redis_measured=false
for name in "${stores[@]}"; do uses_redis "$name" && redis_measured=true; done

# shellcheck source=scripts/common.sh
. scripts/common.sh
needed=(wrk=wrk valgrind=valgrind callgrind_control=valgrind)
$redis_measured && needed+=(redis-server=redis-server redis-cli=redis-tools)
install_missing "${needed[@]}"

cargo build --release --features redis --example server
server=${CARGO_TARGET_DIR:-target}/release/examples/server
$redis_measured && start_redis

cat >"$work/subjects.lua" <<EOF
function init(args)
  math.randomseed(os.time())
end
request = function()
  local id = math.random(1, $subjects)
  return wrk.format("GET", "/read", { ["x-account-id"] = "account-" .. id })
end
EOF

# Prints the instructions per request of server `name`, run as `program args...`.
measure() {
    local name=$1 program=$2
    shift 2
    local port pid out
    port=$(free_port)
    out="$work/$name.callgrind"
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out" \
        "$program" --listen "127.0.0.1:$port" "$@" >"$work/$name.log" 2>&1 &
    pid=$!
    pids+=("$pid")
    local started=false
    for _ in $(seq 300); do
        grep -q "listening on" "$work/$name.log" 2>/dev/null && started=true && break
        sleep 0.1
    done
    if ! $started; then
        echo "$name: the server did not start under valgrind; its log:" >&2
        cat "$work/$name.log" >&2
        exit 1
    fi
    local url="http://127.0.0.1:$port/read"
    wrk -t1 -c"$connections" -d3s -s "$work/subjects.lua" "$url" >/dev/null
    # Through vgdb: the server must be one this user may trace.
    if ! callgrind_control -i on "$pid" >"$work/$name.control" 2>&1; then
        echo "$name: callgrind_control could not reach the server:" >&2
        cat "$work/$name.control" >&2
        exit 1
    fi
    wrk -t1 -c"$connections" -d"${seconds}s" -s "$work/subjects.lua" "$url" >"$work/$name.wrk"
    callgrind_control -i off "$pid" >/dev/null 2>&1 || true
    callgrind_control -d "$pid" >/dev/null 2>&1 || true
    sleep 1
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    local requests instructions
    requests=$(awk '/requests in/ { print $1 }' "$work/$name.wrk")
    # The dump made on demand, between the two `callgrind_control` calls.
    if [ -z "$requests" ] || [ ! -s "$out.1" ]; then
        echo "$name: no requests counted, or no dump written" >&2
        exit 1
    fi
    instructions=$(
        callgrind_annotate "$out.1" 2>/dev/null |
            awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }'
    )
    echo "$name $requests $instructions" | awk '{ printf "%-18s %8d requests  %7.0f instructions per request\n", $1, $2, $3 / $2 }'
}

base=${BENCH_BASE_SERVER:-}
redis_url() { echo "redis://127.0.0.1:$redis_port/"; }
for name in "${stores[@]}"; do
    case $name in
    off) measure off "$server" --limit 1000000000 --quota off ;;
    fields) measure fields "$server" --limit 1000000000 --quota fields ;;
    memory) measure memory "$server" --limit 1000000000 --store memory ;;
    governor) measure governor "$server" --limit 1000000000 --quota governor ;;
    redis) measure redis "$server" --limit 1000000000 --store "$(redis_url)" ;;
    redis-lease) measure redis-lease "$server" --limit 1000000000 --store "$(redis_url)" --lease ;;
    memory-base) measure memory-base "$base" --limit 1000000000 --store memory ;;
    esac
done
