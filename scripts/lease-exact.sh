#!/usr/bin/env bash
# Three demo servers with leased counting share one Redis, and wrk drives
# all three at once until every account's limit is reached: the requests
# admitted (answered 200) must equal the limits, and what Redis counts,
# once the servers stopped (SIGTERM, which gives leased units back), must
# equal what was admitted.
#
#   scripts/lease-exact.sh
#   EXACT_SECONDS=10 EXACT_SUBJECTS=100 EXACT_LIMIT=1000 scripts/lease-exact.sh
#   EXACT_CONNECTIONS=500 EXACT_LEASE=0 scripts/lease-exact.sh   # plain Redis store
#
# It also prints how many charges the servers answered as store failures
# (503s: Redis is healthy here, so load alone must cause none).
#
# Installs Debian's wrk, redis-server and redis-tools when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${EXACT_SECONDS:-10}
subjects=${EXACT_SUBJECTS:-100}
limit=${EXACT_LIMIT:-1000}
connections=${EXACT_CONNECTIONS:-64}
lease=()
[ "${EXACT_LEASE:-1}" = 0 ] || lease=(--lease)

# shellcheck source=scripts/common.sh
. scripts/common.sh
install_missing wrk=wrk redis-server=redis-server redis-cli=redis-tools

cargo build --release --features redis --example server
server=${CARGO_TARGET_DIR:-target}/release/examples/server

start_redis

ports=()
server_pids=()
for i in 1 2 3; do
    port=$(free_port)
    "$server" --listen "127.0.0.1:$port" --limit "$limit" --period 1d \
        --store "redis://127.0.0.1:$redis_port/" "${lease[@]}" >"$work/server$i.log" 2>&1 &
    pids+=($!)
    server_pids+=($!)
    for _ in $(seq 100); do
        grep -q "listening on" "$work/server$i.log" 2>/dev/null && break
        sleep 0.1
    done
    ports+=("$port")
done

cat >"$work/subjects.lua" <<EOF
math.randomseed(os.time())
request = function()
  local id = math.random(1, $subjects)
  return wrk.format("GET", "/read", { ["x-account-id"] = "account-" .. id })
end
EOF

wrk_pids=()
for i in 0 1 2; do
    wrk -t1 -c"$connections" -d"${seconds}s" -s "$work/subjects.lua" \
        "http://127.0.0.1:${ports[i]}/read" >"$work/wrk$i.log" 2>&1 &
    wrk_pids+=($!)
done
for pid in "${wrk_pids[@]}"; do wait "$pid"; done

sent=0
refused=0
for i in 0 1 2; do
    n=$(awk '/requests in/ {print $1}' "$work/wrk$i.log")
    r=$(awk '/Non-2xx/ {print $NF}' "$work/wrk$i.log")
    sent=$((sent + n))
    refused=$((refused + ${r:-0}))
done
admitted=$((sent - refused))

for pid in "${server_pids[@]}"; do kill -TERM "$pid"; done
for pid in "${server_pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
done
given_back=$(cat "$work"/server*.log | awk '/gave back/ {s += $3} END {print s + 0}')

counted=0
while read -r key; do
    [ -z "$key" ] && continue
    n=$(redis-cli -p "$redis_port" HGET "$key" n)
    counted=$((counted + n))
done < <(redis-cli -p "$redis_port" --scan --pattern 'quota:*:read:*')

# Store failures: each logged line, and those its throttle left out.
failures=$(cat "$work"/server*.log | awk '/quota store failed/ { n++; if (match($0, /suppressed=[0-9]+/)) n += substr($0, RSTART + 11, RLENGTH - 11) } END { print n + 0 }')

expected=$((subjects * limit))
echo "sent $sent, admitted $admitted, refused $refused; limits $expected; counted $counted; units given back on SIGTERM $given_back; store failures $failures"
if [ "$admitted" -eq "$expected" ] && [ "$counted" -eq "$admitted" ] && [ "$failures" -eq 0 ]; then
    echo "exact: admitted equals the limits, counted equals admitted, no store failure"
else
    echo "NOT EXACT" >&2
    exit 1
fi
