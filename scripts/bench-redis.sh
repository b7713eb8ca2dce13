#!/usr/bin/env bash
# The Redis store's benchmark, in one run on this machine:
#
#  1. `redis-benchmark` (the system's, a C client: Redis' own ceiling)
#     against a redis-server this script starts on a free port of 127.0.0.1
#     (temporary directory, no persistence): SET, and EVALSHA of the trivial
#     K-key script of benches/throughput.rs (the same text, so the same
#     SHA1; K = 11, the keys a 3-scope reserve touches, all in {t}).
#  2. `cargo bench -p allowance-redis --bench throughput` (release), which
#     starts its own redis-server: PING, the same EVALSHA, reserve, and
#     reserve+settle through RedisStore, all through one redis-rs
#     connection, then the ratios against the issue's targets.
#  3. With HTTP=1: `allowance serve` (release, starter configuration with
#     `[store] kind = "redis"`, on the server of step 1, database 1) loaded
#     by `allowance bench` (reserve+settle pairs over HTTP).
#
#   scripts/bench-redis.sh                          # 5 s per measurement
#   ALLOWANCE_BENCH_SECS=3 scripts/bench-redis.sh
#   HTTP=1 DURATION=5s scripts/bench-redis.sh       # and through HTTP
#
# Knobs: REQUESTS (redis-benchmark -n, 200000), CLIENTS (its -c and the
# Rust bench's concurrency, 64), and the bench's own ALLOWANCE_BENCH_*
# variables (SECS, WARMUP_MS, CONCURRENCY, LATENCY_CONCURRENCY, THREADS).
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=${REQUESTS:-200000}
CLIENTS=${CLIENTS:-${ALLOWANCE_BENCH_CONCURRENCY:-64}}
HTTP=${HTTP:-0}
DURATION=${DURATION:-${ALLOWANCE_BENCH_SECS:-5}s}
HTTP_PORT=${HTTP_PORT:-18990}
export ALLOWANCE_BENCH_CONCURRENCY=$CLIENTS

# Keep identical to TRIVIAL_LUA in crates/allowance-redis/benches/throughput.rs.
LUA="for i = 1, #KEYS do if i % 2 == 1 then redis.call('GET', KEYS[i]) else redis.call('SET', KEYS[i], ARGV[1]) end end return #KEYS"
K=11
VALUE=$(printf 'x%.0s' $(seq 1 64))
keys=()
for i in $(seq 1 $K); do keys+=("key$i{t}"); done

for tool in redis-server redis-cli redis-benchmark; do
  command -v $tool >/dev/null || { echo "error: $tool is not on PATH" >&2; exit 1; }
done

cargo bench -p allowance-redis --bench throughput --no-run >&2
if [ "$HTTP" = 1 ]; then
  cargo build --release -p allowance-cli >&2
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/allowance-bench-redis.XXXXXX")
redis_pid=
serve_pid=
cleanup() {
  for p in $serve_pid $redis_pid; do
    kill "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  rm -rf "$dir"
}
trap cleanup EXIT

# A redis-server of ours on a free port: a random one, again if it is taken
# (the server then exits); ready once PONG comes from this very process.
for attempt in 1 2 3 4 5; do
  port=$((20000 + RANDOM % 30000))
  redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" --save "" --appendonly no \
    --protected-mode no --daemonize no --logfile "$dir/redis.log" &
  redis_pid=$!
  for _ in $(seq 1 500); do
    kill -0 "$redis_pid" 2>/dev/null || break
    if redis-cli -p "$port" INFO server 2>/dev/null | grep -q "^process_id:$redis_pid"; then
      break 2
    fi
    sleep 0.01
  done
  kill "$redis_pid" 2>/dev/null || true
  wait "$redis_pid" 2>/dev/null || true
  redis_pid=
done
[ -n "$redis_pid" ] || { echo "error: redis-server did not start; log:" >&2; tail "$dir/redis.log" >&2; exit 1; }
cli() { redis-cli -p "$port" "$@"; }

version=$(cli INFO server | tr -d '\r' | awk -F: '$1 == "redis_version" {print $2}')
sha=$(cli SCRIPT LOAD "$LUA")
mset=()
for k in "${keys[@]}"; do mset+=("$k" "$VALUE"); done
cli MSET "${mset[@]}" >/dev/null

echo "== redis-benchmark: redis-server $version on 127.0.0.1:$port, -c $CLIENTS -n $REQUESTS"
echo "   EVALSHA $sha: $K keys key1{t}..key$K{t}, $(( (K + 1) / 2 )) GET + $(( K / 2 )) SET of ${#VALUE} bytes"
rb() { redis-benchmark -h 127.0.0.1 -p "$port" -c "$CLIENTS" -n "$REQUESTS" -q "$@" 2>&1 | tr '\r' '\n' | grep 'requests per second' | tail -1; }
set_line=$(rb -t set)
eval_line=$(rb EVALSHA "$sha" "$K" "${keys[@]}" "$VALUE")
echo "   $set_line"
echo "   $eval_line"
[ "$(cli GET 'key2{t}')" = "$VALUE" ] || { echo "error: the EVALSHA run did not write its keys" >&2; exit 1; }
rb_eval=$(echo "$eval_line" | awk '{for (i = 1; i < NF; i++) if ($(i + 1) == "requests") print $i}')

echo
echo "== cargo bench -p allowance-redis --bench throughput (its own redis-server)"
cargo bench -q -p allowance-redis --bench throughput | tee "$dir/bench.out"
reserve=$(awk -v c="$CLIENTS" '$1 == "reserve" && $2 == c {print $3}' "$dir/bench.out")
pair=$(awk -v c="$CLIENTS" '$1 == "pair" && $2 == c {print $3}' "$dir/bench.out")

if [ "$HTTP" = 1 ]; then
  echo
  echo "== allowance bench --scenario pairs over HTTP: allowance serve, redis store (127.0.0.1:$port/1)"
  cli -n 1 FLUSHDB >/dev/null
  sed -e "s|^kind = \"embedded\".*|kind = \"redis\"\nurl = \"redis://127.0.0.1:$port/1\"|" \
    -e '/^data_dir = /d' -e '/^fsync = /d' crates/allowance-config/src/starter.toml >"$dir/serve.toml"
  target/release/allowance serve --config "$dir/serve.toml" --listen "127.0.0.1:$HTTP_PORT" 2>"$dir/serve.log" &
  serve_pid=$!
  for _ in $(seq 1 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$HTTP_PORT") 2>/dev/null && break
    kill -0 "$serve_pid" 2>/dev/null || { cat "$dir/serve.log" >&2; exit 1; }
    sleep 0.05
  done
  target/release/allowance bench --server "http://127.0.0.1:$HTTP_PORT" --scenario pairs \
    --duration "$DURATION" --concurrency "$CLIENTS" 2>/dev/null | tee "$dir/http.out"
  http_pairs=$(awk '/^  pairs/ {gsub(/[(\/s)]/, "", $3); print $3}' "$dir/http.out")
fi

echo
echo "== summary (concurrency $CLIENTS)"
awk -v r="$reserve" -v p="$pair" -v e="$rb_eval" -v h="${http_pairs:-}" 'BEGIN {
  printf "store-level reserve %.0f ops/s = %.1f%% of redis-benchmark EVALSHA (%.0f/s, C client)\n", r, 100 * r / e, e
  printf "store-level reserve+settle %.0f pairs/s\n", p
  if (h != "") printf "HTTP reserve+settle %.0f pairs/s (allowance bench: tenant scope only, starter plans; not the store-level workload)\n", h
}'
