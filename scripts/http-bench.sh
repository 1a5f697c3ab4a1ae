#!/usr/bin/env bash
# Requests per second through the demo server over HTTP, with the quota on
# the memory store, on Redis, and off, measured side by side in one run:
# the rounds alternate between the servers so that the machine's noise falls
# on all of them alike. wrk sends `GET /read` over 64 connections, each
# request for one of 10 000 accounts drawn at random; the limit is high
# enough that nothing is refused.
#
#   scripts/http-bench.sh                       # 5 rounds of 10 s each
#   BENCH_ROUNDS=3 BENCH_SECONDS=5 scripts/http-bench.sh
#   BENCH_CONNECTIONS=64 BENCH_SUBJECTS=10000 BENCH_THREADS=2 scripts/http-bench.sh
#   BENCH_STORES=off,memory scripts/http-bench.sh   # some of the servers only
#
# Installs Debian's wrk, redis-server and redis-tools when they are missing
# (redis-server and redis-tools only when the Redis server is measured).
# Prints one line per round and server, then the medians and the ratios
# "quota on / quota off".
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${BENCH_ROUNDS:-5}
seconds=${BENCH_SECONDS:-10}
connections=${BENCH_CONNECTIONS:-64}
subjects=${BENCH_SUBJECTS:-10000}
threads=${BENCH_THREADS:-2}
IFS=, read -r -a stores <<<"${BENCH_STORES:-off,memory,redis}"
for name in "${stores[@]}"; do
    case $name in
    off | memory | redis) ;;
    *)
        echo "BENCH_STORES: unknown server $name (off, memory, redis)" >&2
        exit 2
        ;;
    esac
done
measured() { [[ " ${stores[*]} " == *" $1 "* ]]; }

missing=()
command -v wrk >/dev/null || missing+=(wrk)
if measured redis; then
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v redis-cli >/dev/null || missing+=(redis-tools)
fi
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    service redis-server stop >/dev/null 2>&1 || true
fi

cargo build --release --features redis --example server
server=target/release/examples/server

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

if measured redis; then
    redis_port=$(free_port)
    redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
        --dir "$work" --daemonize no >"$work/redis.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 50); do
        redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
fi

declare -A ports
# Not in a subshell: the server's pid must reach `pids` for the cleanup.
start_server() { # name, args...
    local name=$1
    shift
    local port
    port=$(free_port)
    "$server" --listen "127.0.0.1:$port" --limit 1000000000 "$@" >"$work/$name.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do
        grep -q "listening on" "$work/$name.log" 2>/dev/null && break
        sleep 0.1
    done
    ports[$name]=$port
}

measured off && start_server off --quota off
measured memory && start_server memory --store memory
measured redis && start_server redis --store "redis://127.0.0.1:$redis_port/"

cat >"$work/subjects.lua" <<EOF
math.randomseed(os.time())
request = function()
  local id = math.random(1, $subjects)
  return wrk.format("GET", "/read", { ["x-account-id"] = "account-" .. id })
end
EOF

declare -A results
for round in $(seq "$rounds"); do
    for name in "${stores[@]}"; do
        out=$(wrk -t"$threads" -c"$connections" -d"${seconds}s" -s "$work/subjects.lua" \
            "http://127.0.0.1:${ports[$name]}/read")
        rps=$(echo "$out" | awk '/^Requests\/sec:/ {print $2}')
        failed=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
        echo "round $round  $name  $rps req/s${failed:+  ($failed answers not 2xx)}"
        results[$name]="${results[$name]:-} $rps"
    done
done

median() {
    tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'
}
declare -A medians
line="median req/s:"
for name in "${stores[@]}"; do
    medians[$name]=$(echo "${results[$name]}" | median)
    line+=" $name ${medians[$name]},"
done
echo
echo "${line%,}"
if measured off; then
    ratios=()
    for name in "${stores[@]}"; do
        [ "$name" = off ] && continue
        ratios+=("$(awk -v o="${medians[off]}" -v x="${medians[$name]}" -v n="$name" \
            'BEGIN { printf "%s/off %.2f", n, x / o }')")
    done
    if [ ${#ratios[@]} -gt 0 ]; then
        joined=$(printf ', %s' "${ratios[@]}")
        echo "ratio ${joined#, }"
    fi
fi
