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
#   BENCH_WARMUP=2 scripts/http-bench.sh        # unmeasured seconds before each run (2)
#   BENCH_CONNECTIONS=64 BENCH_SUBJECTS=10000 BENCH_THREADS=2 scripts/http-bench.sh
#   BENCH_STORES=off,memory scripts/http-bench.sh   # some of the servers only
#   BENCH_STORES=off,redis,floor scripts/http-bench.sh
#   BENCH_STORES=off,memory,governor scripts/http-bench.sh
#   BENCH_STORES=off,fields,memory,governor scripts/http-bench.sh
#   BENCH_STORES=off,fields,layer-floor,memory,governor scripts/http-bench.sh
#   BENCH_STORES=off,memory,redis,redis-lease,floor-eval scripts/http-bench.sh
#   BENCH_BASE_SERVER=path/to/server BENCH_STORES=off,redis-lease,redis-lease-base scripts/http-bench.sh
#
# `redis-lease` is the demo server on Redis with `--lease`: a busy account's
# requests are counted from blocks taken from Redis in one charge. For each
# server that talks to Redis, the Redis commands it sent per request are
# printed too (from `INFO commandstats`, before and after each round: the
# calls of EVALSHA and EVAL, and of INCR for `floor`; the commands a script
# runs inside Redis are not requests of the server's, and not counted).
#
# `floor` is no quota: the `redis_floor` example, which sends one `INCR` per
# request on a multiplexed redis-rs connection (`floor-eval`: an `EVALSHA`
# of a one-line script instead), the least a request that waits on Redis
# costs. It shows how much of the Redis server's gap to `off` is the round
# trip itself.
#
# `fields` is no quota either: the demo server with `--quota fields`, whose
# routes write the two fields the quota layer writes on every answer
# (`RateLimit-Policy` and a `RateLimit` formatted per request) and count
# nothing: what telling clients where they stand costs by itself, a floor
# under the memory store's figure. `layer-floor` is the `fields_floor`
# example with `--count`: it reads the subject, builds each request's
# counter key, counts it in a map under a lock, puts the count in the
# request's extensions and writes the fields, the least a quota layer does
# per request.
#
# `memory-base`, `redis-base` and `redis-lease-base` are `memory`, `redis`
# and `redis-lease` served by the demo server binary `BENCH_BASE_SERVER`
# (another build, e.g. of an earlier commit): two builds side by side in the
# same rounds, which on a noisy machine is the way to compare them.
#
# `governor` is another rate limiter: the demo server with `--quota
# governor`, the same routes behind a tower_governor layer (a GCRA per
# account in memory) keyed by the same header, with a limit nothing here
# reaches. It shows how the memory store compares with a rate limiter that
# keeps one state per key in memory.
#
# Installs Debian's wrk, redis-server and redis-tools when they are missing
# (redis-server and redis-tools only when the Redis server is measured).
# Prints one line per round and server (requests per second, and the CPU
# time per request of the server, of redis-server and of wrk, read from
# /proc and from the shell's `times`), each round's ratios "quota on / quota
# off" (and "memory / governor" when both are measured), then the medians:
# the median of the rounds' ratios is the headline (every other round runs
# the servers in the opposite order), the ratio of the median rates is
# printed beside it.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${BENCH_ROUNDS:-5}
seconds=${BENCH_SECONDS:-10}
warmup=${BENCH_WARMUP:-2}
connections=${BENCH_CONNECTIONS:-64}
subjects=${BENCH_SUBJECTS:-10000}
threads=${BENCH_THREADS:-2}
IFS=, read -r -a stores <<<"${BENCH_STORES:-off,memory,redis}"
for name in "${stores[@]}"; do
    case $name in
    off | fields | layer-floor | memory | redis | redis-lease | floor | floor-eval | governor) ;;
    memory-base | redis-base | redis-lease-base)
        if [ ! -x "${BENCH_BASE_SERVER:-}" ]; then
            echo "BENCH_STORES: $name needs BENCH_BASE_SERVER, the path of another build's demo server" >&2
            exit 2
        fi
        ;;
    *)
        echo "BENCH_STORES: unknown server $name (off, fields, layer-floor, memory, redis, redis-lease, floor, floor-eval, governor, memory-base, redis-base, redis-lease-base)" >&2
        exit 2
        ;;
    esac
done
measured() { [[ " ${stores[*]} " == *" $1 "* ]]; }
# Whether a server that talks to Redis is measured.
redis_measured() {
    measured redis || measured redis-lease || measured floor || measured floor-eval ||
        measured redis-base || measured redis-lease-base
}
uses_redis() { [[ $1 == redis* || $1 == floor* ]]; }

# shellcheck source=scripts/common.sh
. scripts/common.sh
needed=(wrk=wrk)
redis_measured && needed+=(redis-server=redis-server redis-cli=redis-tools)
install_missing "${needed[@]}"

cargo build --release --features redis --example server --example redis_floor --example fields_floor
examples=${CARGO_TARGET_DIR:-target}/release/examples
server=$examples/server

if redis_measured; then
    start_redis
fi

declare -A ports server_pids
# Not in a subshell: the server's pid must reach `pids` for the cleanup.
start_server() { # name, program, args...
    local name=$1 program=$2
    shift 2
    local port
    port=$(free_port)
    "$program" --listen "127.0.0.1:$port" "$@" >"$work/$name.log" 2>&1 &
    pids+=($!)
    server_pids[$name]=$!
    for _ in $(seq 100); do
        grep -q "listening on" "$work/$name.log" 2>/dev/null && break
        sleep 0.1
    done
    ports[$name]=$port
}

measured off && start_server off "$server" --limit 1000000000 --quota off
measured memory && start_server memory "$server" --limit 1000000000 --store memory
measured redis && start_server redis "$server" --limit 1000000000 --store "redis://127.0.0.1:$redis_port/"
measured redis-lease && start_server redis-lease "$server" --limit 1000000000 --store "redis://127.0.0.1:$redis_port/" --lease
measured floor && start_server floor "$examples/redis_floor" --redis "redis://127.0.0.1:$redis_port/"
measured floor-eval && start_server floor-eval "$examples/redis_floor" --redis "redis://127.0.0.1:$redis_port/" --eval
measured governor && start_server governor "$server" --limit 1000000000 --quota governor
measured fields && start_server fields "$server" --limit 1000000000 --quota fields
base=${BENCH_BASE_SERVER:-}
measured memory-base && start_server memory-base "$base" --limit 1000000000 --store memory
measured redis-base && start_server redis-base "$base" --limit 1000000000 --store "redis://127.0.0.1:$redis_port/"
measured redis-lease-base && start_server redis-lease-base "$base" --limit 1000000000 --store "redis://127.0.0.1:$redis_port/" --lease
measured layer-floor && start_server layer-floor "$examples/fields_floor" --count

# Each wrk thread draws its own accounts: seeded alike, the threads would
# send the same account at the same moment, each request in a pair.
cat >"$work/subjects.lua" <<EOF
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("seed", os.time() * 1000 + threads)
end
function init(args)
  math.randomseed(seed)
end
request = function()
  local id = math.random(1, $subjects)
  return wrk.format("GET", "/read", { ["x-account-id"] = "account-" .. id })
end
EOF

# CPU time (user + system) a process has used, in clock ticks.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# CPU time the shell's finished children (the wrk runs) have used, in
# seconds. `times` runs in this shell, not in a command substitution's
# subshell, whose children would be others.
children_cpu() {
    times >"$work/times"
    awk 'NR == 2 { split($1, u, /[ms]/); split($2, s, /[ms]/); print u[1] * 60 + u[2] + s[1] * 60 + s[2] }' "$work/times"
}
hz=$(getconf CLK_TCK)
# Commands the server `$1` sent Redis since it started: scripts (and INCR
# for `floor`, which sends nothing else).
redis_commands() {
    local sent='^cmdstat_(eval|evalsha|eval_ro|evalsha_ro)$'
    [ "$1" = floor ] && sent='^cmdstat_incr$'
    redis-cli -p "$redis_port" INFO commandstats |
        awk -F'[:=,]' -v sent="$sent" '$1 ~ sent { s += $3 } END { print s + 0 }'
}

declare -A results ratios
# The memory store's rate over governor's, per round.
governor_ratios=
for round in $(seq "$rounds"); do
    # Every other round runs the servers in the opposite order, so that a
    # drift of the machine's speed within a round favours none of them.
    order=("${stores[@]}")
    if ((round % 2 == 0)); then
        order=()
        for ((i = ${#stores[@]} - 1; i >= 0; i--)); do order+=("${stores[i]}"); done
    fi
    declare -A rate=()
    for name in "${order[@]}"; do
        spid=${server_pids[$name]}
        # Unmeasured: the same load for a moment first, so that every
        # server starts its round as under steady load, not as after the
        # pause while the others were measured (a leased server's blocks
        # went back meanwhile, and the rates it sizes them by were lost).
        if ((warmup > 0)); then
            wrk -t"$threads" -c"$connections" -d"${warmup}s" -s "$work/subjects.lua" \
                "http://127.0.0.1:${ports[$name]}/read" >/dev/null
        fi
        server0=$(ticks "$spid")
        uses_redis "$name" && redis0=$(ticks "$redis_pid") && commands0=$(redis_commands "$name")
        children_cpu >"$work/cpu"
        wrk0=$(cat "$work/cpu")
        out=$(wrk -t"$threads" -c"$connections" -d"${seconds}s" -s "$work/subjects.lua" \
            "http://127.0.0.1:${ports[$name]}/read")
        children_cpu >"$work/cpu"
        wrk1=$(cat "$work/cpu")
        server1=$(ticks "$spid")
        uses_redis "$name" && redis1=$(ticks "$redis_pid") && commands1=$(redis_commands "$name")
        rps=$(echo "$out" | awk '/^Requests\/sec:/ {print $2}')
        failed=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
        # CPU per request, in µs, of the server, Redis and wrk.
        cpu=$(awk -v n="$rps" -v s="$seconds" -v hz="$hz" -v a="$server0" -v b="$server1" \
            -v w0="$wrk0" -v w1="$wrk1" -v r0="${redis0:-0}" -v r1="${redis1:-0}" 'BEGIN {
                q = n * s / 1e6
                line = sprintf("server %.1f", (b - a) / hz / q)
                if (r1 > r0) line = line sprintf(", redis-server %.1f", (r1 - r0) / hz / q)
                printf "%s, wrk %.1f", line, (w1 - w0) / q
            }')
        commands=
        if uses_redis "$name"; then
            commands=$(awk -v n="$rps" -v s="$seconds" -v a="$commands0" -v b="$commands1" \
                'BEGIN { printf ", Redis commands per request %.3f", (b - a) / (n * s) }')
        fi
        unset redis0 redis1 commands0 commands1
        echo "round $round  $name  $rps req/s  (CPU µs per request: $cpu$commands)${failed:+  ($failed answers not 2xx)}"
        results[$name]="${results[$name]:-} $rps"
        rate[$name]=$rps
    done
    if measured off; then
        for name in "${stores[@]}"; do
            [ "$name" = off ] && continue
            ratio=$(awk -v o="${rate[off]}" -v x="${rate[$name]}" 'BEGIN { printf "%.3f", x / o }')
            ratios[$name]="${ratios[$name]:-} $ratio"
            echo "round $round  $name/off $(printf '%.2f' "$ratio")"
        done
    fi
    if measured memory && measured governor; then
        ratio=$(awk -v g="${rate[governor]}" -v m="${rate[memory]}" 'BEGIN { printf "%.3f", m / g }')
        governor_ratios+=" $ratio"
        echo "round $round  memory/governor $(printf '%.2f' "$ratio")"
    fi
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
    # The headline: the median of the rounds' ratios (each round's servers
    # ran back to back); the ratio of the medians beside it.
    for name in "${stores[@]}"; do
        [ "$name" = off ] && continue
        echo "$name/off: median ratio $(echo "${ratios[$name]}" | median | xargs printf '%.2f')," \
            "ratio of medians $(awk -v o="${medians[off]}" -v x="${medians[$name]}" 'BEGIN { printf "%.2f", x / o }')," \
            "per round:${ratios[$name]}"
    done
fi
if measured memory && measured governor; then
    echo "memory/governor: median ratio $(echo "$governor_ratios" | median | xargs printf '%.2f')," \
        "ratio of medians $(awk -v g="${medians[governor]}" -v m="${medians[memory]}" 'BEGIN { printf "%.2f", m / g }')," \
        "per round:$governor_ratios"
fi
