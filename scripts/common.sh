# What the benchmark scripts share: sourced, not run.
#
# - `install_missing CMD=PACKAGE...` installs Debian's PACKAGE for each CMD
#   not on the PATH (and python3, which `free_port` runs);
# - `work` is a scratch directory, and every pid added to `pids` is killed
#   on exit (then `work` is removed);
# - `free_port` prints a free loopback port;
# - `start_redis` starts a `redis-server` without persistence on a free
#   port in `work`, sets `redis_port` and `redis_pid`, and waits until it
#   answers.

install_missing() {
    local missing=() pair sudo=""
    for pair in "$@" python3=python3; do
        command -v "${pair%%=*}" >/dev/null || missing+=("${pair#*=}")
    done
    [ "$(id -u)" = 0 ] || sudo="sudo"
    if [ ${#missing[@]} -gt 0 ]; then
        $sudo apt-get update -qq
        # Through `env`: sudo drops the caller's environment.
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
        $sudo service redis-server stop >/dev/null 2>&1 || true
    fi
}

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

# Not in a subshell: the pid must reach `pids` for the cleanup.
start_redis() {
    redis_port=$(free_port)
    redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
        --dir "$work" --daemonize no >"$work/redis.log" 2>&1 &
    pids+=($!)
    redis_pid=$!
    for _ in $(seq 50); do
        redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
}
