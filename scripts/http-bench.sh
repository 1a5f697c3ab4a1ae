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
#
# Installs Debian's wrk, redis-server and redis-tools when they are missing.
# Prints one line per round and server, then the medians and the ratios
# "quota on / quota off".
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${BENCH_ROUNDS:-5}
seconds=${BENCH_SECONDS:-10}
connections=${BENCH_CONNECTIONS:-64}
subjects=${BENCH_SUBJECTS:-10000}
threads=${BENCH_THREADS:-2}

missing=()
command -v wrk >/dev/null || missing+=(wrk)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)
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

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$work" --daemonize no >"$work/redis.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do
    redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break
    sleep 0.1
done

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

start_server off --quota off
start_server memory --store memory
start_server redis --store "redis://127.0.0.1:$redis_port/"

cat >"$work/subjects.lua" <<EOF
math.randomseed(os.time())
request = function()
  local id = math.random(1, $subjects)
  return wrk.format("GET", "/read", { ["x-account-id"] = "account-" .. id })
end
EOF

declare -A results
for round in $(seq "$rounds"); do
    for name in off memory redis; do
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
off=$(echo "${results[off]}" | median)
memory=$(echo "${results[memory]}" | median)
redis=$(echo "${results[redis]}" | median)
echo
echo "median req/s: off $off, memory $memory, redis $redis"
awk -v o="$off" -v m="$memory" -v r="$redis" \
    'BEGIN { printf "ratio memory/off %.2f, redis/off %.2f\n", m / o, r / o }'
