#!/usr/bin/env bash
# The issue-7 benchmark: the latency the gateway adds over calling its
# upstream directly. Starts, all on 127.0.0.1:
#   - the stub upstream (`allowance-stub --no-record`, release build);
#   - `allowance serve` with a [gateway] routing gpt-4o to the stub, twice:
#     in memory (`--data-dir ""`) and with the default durable store
#     (write-ahead log, fsync "always") in a temporary directory;
#   - LiteLLM's proxy (`pip install 'litellm[proxy]'` into target/bench-venv)
#     with one model pointing at the stub as an OpenAI-compatible base, its
#     master key and nothing else (no database, so no keys, budgets or spend
#     tracking) — skipped with LITELLM=0, or said why when it cannot run;
# then one `allowance bench --scenario gateway` run measuring them all
# against the stub, call by call interleaved: 100 / 4,096 / 32,768-token
# prompts, unique and warm, whole and streamed; medians over ROUNDS rounds.
# LiteLLM (the reference) has a phase of its own in every round, beside
# direct calls of that phase, so the CPU it spends after each answer does
# not land on the gateway's calls (REFERENCE_MIXED=1 interleaves it too).
# Prints each server's CPU time over the run, then the scenario's table.
#
#   scripts/bench-gateway.sh                       # 5 rounds x 40 iterations
#   ROUNDS=3 ITERATIONS=20 LITELLM=0 scripts/bench-gateway.sh
#   TOKENIZER=1 scripts/bench-gateway.sh           # also cargo bench -p allowance-estimate
#   BUILD=0 scripts/bench-gateway.sh               # use the release binaries as they are
#   PERF=1 LITELLM=0 scripts/bench-gateway.sh      # also profile the in-memory gateway (perf)
#   BIN=/path/to/allowance scripts/bench-gateway.sh # measure another build (no cargo build)
#   REFERENCE_MIXED=1 scripts/bench-gateway.sh     # LiteLLM interleaved call by call with the rest
#   FSYNC_MODES=never,batch scripts/bench-gateway.sh # also durable gateways with these [store] fsync
#                                                    # policies (targets durable-never, durable-batch)
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
ITERATIONS=${ITERATIONS:-40}
WARMUP=${WARMUP:-5}
SIZES=${SIZES:-100,4096,32768}
CONCURRENCY=${CONCURRENCY:-1}
LITELLM=${LITELLM:-1}
TOKENIZER=${TOKENIZER:-0}
PERF=${PERF:-0}
KEY=sk-allowance-bench-key
VENV=target/bench-venv
BUILD=${BUILD:-1}
REFERENCE_MIXED=${REFERENCE_MIXED:-0}
FSYNC_MODES=${FSYNC_MODES:-}

# BIN (the gateway and the bench client) and STUB may name other builds,
# e.g. a copy kept to compare against; then nothing is built.
[ -n "${BIN:-}${STUB:-}" ] && BUILD=0
[ "$BUILD" = 1 ] && cargo build --release -p allowance-cli -p allowance-stub >&2
BIN=${BIN:-target/release/allowance}
STUB=${STUB:-target/release/allowance-stub}
for b in "$BIN" "$STUB"; do
  [ -x "$b" ] || { echo "no executable at $b (build it, or drop BUILD=0)" >&2; exit 1; }
done
out=$(mktemp -d "${TMPDIR:-/tmp}/allowance-gw-bench.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$out"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Waits for "listening on http://127.0.0.1:PORT" in LOG from PID; prints the URL.
wait_listening() { # log pid what
  local url
  for _ in $(seq 1 300); do
    url=$(grep -o 'listening on http://127\.0\.0\.1:[0-9]*' "$1" | head -n1 | cut -d' ' -f3 || true)
    [ -n "$url" ] && { echo "$url"; return 0; }
    kill -0 "$2" 2>/dev/null || break
    sleep 0.1
  done
  echo "$3 did not start:" >&2
  cat "$1" >&2
  return 1
}

# A free port on 127.0.0.1 (for LiteLLM, which cannot pick its own).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# CPU time (user + system, seconds) a process has used so far.
TICKS=$(getconf CLK_TCK)
cpu_s() { awk -v hz="$TICKS" '{printf "%.2f", ($14 + $15) / hz}' "/proc/$1/stat"; }

"$STUB" --listen 127.0.0.1:0 --no-record >"$out/stub.log" 2>&1 &
stub=$!
pids+=("$stub")
stub_url=$(wait_listening "$out/stub.log" "$stub" "the stub")
echo "stub: $stub_url" >&2

key_sha=$(printf '%s' "$KEY" | sha256sum | cut -d' ' -f1)
# Limits that never deny but are all checked: the plans a real deployment
# has (tenant cost and concurrency; user requests, tokens and concurrency)
# and the upstream's own limits, so every call reserves on 2 scopes plus
# one attempt on upstream:stub, as in production.
cat >"$out/gw.toml" <<EOF
[kinds.tenant]
plan = "tenant"
[kinds.user]
plan = "user"

[plans.tenant]
limits = [
  { dimension = "cost_micros", capacity = 1_000_000_000_000_000, window = "sliding", period = "24h", slices = 24 },
  { dimension = "concurrent",  capacity = 10_000 },
]
[plans.user]
limits = [
  { dimension = "requests",   capacity = 100_000_000,         window = "bucket",  period = "1m" },
  { dimension = "tokens",     capacity = 1_000_000_000_000,   window = "sliding", period = "1h", slices = 60 },
  { dimension = "concurrent", capacity = 10_000 },
]

[models."gpt-4o"]
input_per_million = "2.50"
output_per_million = "10.00"
max_output_tokens = 16384

[gateway]
[[gateway.upstreams]]
name = "stub"
base_url = "$stub_url"
models = ["gpt-4o"]
requests_per_minute = 100_000_000
input_tokens_per_minute = 1_000_000_000_000
output_tokens_per_minute = 1_000_000_000_000
max_concurrent = 10_000

[[gateway.keys]]
sha256 = "$key_sha"
tenant = "bench"
user = "bob"
EOF
$BIN check-config "$out/gw.toml" >"$out/check-config.txt"

$BIN serve --config "$out/gw.toml" --data-dir "" --listen 127.0.0.1:0 2>"$out/memory.log" &
memory=$!
pids+=("$memory")
memory_url=$(wait_listening "$out/memory.log" "$memory" "the in-memory gateway")
echo "gateway, in memory: $memory_url" >&2

$BIN serve --config "$out/gw.toml" --data-dir "$out/data" --listen 127.0.0.1:0 2>"$out/durable.log" &
durable=$!
pids+=("$durable")
durable_url=$(wait_listening "$out/durable.log" "$durable" "the durable gateway")
echo "gateway, durable store in $out/data: $durable_url" >&2

targets=(--target "memory=$memory_url" --target "durable=$durable_url")
watched=(stub:$stub memory:$memory durable:$durable)

# The same durable gateway under other fsync policies: what the sync costs
# against the hand-off to the log's writer.
for mode in ${FSYNC_MODES//,/ }; do
  case "$mode" in
    never|batch) ;;
    *) echo "FSYNC_MODES: '$mode' is not a policy to compare (never, batch)" >&2; exit 2 ;;
  esac
  { cat "$out/gw.toml"; printf '\n[store]\nfsync = "%s"\n' "$mode"; } >"$out/gw-$mode.toml"
  $BIN serve --config "$out/gw-$mode.toml" --data-dir "$out/data-$mode" --listen 127.0.0.1:0 2>"$out/durable-$mode.log" &
  pid=$!
  pids+=("$pid")
  url=$(wait_listening "$out/durable-$mode.log" "$pid" "the durable gateway (fsync $mode)")
  echo "gateway, durable store, fsync $mode: $url" >&2
  targets+=(--target "durable-$mode=$url")
  watched+=("durable-$mode:$pid")
done
litellm_note="LiteLLM: not measured (LITELLM=0)"
if [ "$LITELLM" = 1 ]; then
  litellm_note=""
  if [ ! -x "$VENV/bin/litellm" ]; then
    echo "== installing litellm[proxy] into $VENV" >&2
    if ! { [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"; } \
      || ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check 'litellm[proxy]' >"$out/pip.log" 2>&1; then
      litellm_note="LiteLLM: not measured: pip install 'litellm[proxy]' failed: $(tail -n 3 "$out/pip.log" 2>/dev/null | tr '\n' ' ')"
    fi
  fi
  if [ -z "$litellm_note" ]; then
    # One deployment, the stub as an OpenAI-compatible base; the master key
    # is the only credential (no database: no virtual keys, budgets or spend).
    cat >"$out/litellm.yaml" <<EOF
model_list:
  - model_name: gpt-4o
    litellm_params:
      model: openai/gpt-4o
      api_base: $stub_url/v1
      api_key: sk-stub-does-not-check
general_settings:
  master_key: $KEY
litellm_settings:
  telemetry: false
EOF
    port=$(free_port)
    # The bundled model-price map, not a download at start-up.
    LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_LOG=ERROR \
      "$VENV/bin/litellm" --config "$out/litellm.yaml" --host 127.0.0.1 --port "$port" >"$out/litellm.log" 2>&1 &
    litellm=$!
    pids+=("$litellm")
    up=0
    for _ in $(seq 1 600); do
      if curl -fsS -o /dev/null "http://127.0.0.1:$port/health/liveliness" 2>/dev/null; then up=1; break; fi
      kill -0 "$litellm" 2>/dev/null || break
      sleep 0.2
    done
    if [ "$up" = 1 ]; then
      echo "LiteLLM $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))'): http://127.0.0.1:$port" >&2
      targets+=(--target "litellm=http://127.0.0.1:$port" --reference litellm)
      [ "$REFERENCE_MIXED" = 1 ] && targets+=(--reference-mixed)
      watched+=(litellm:$litellm)
    else
      litellm_note="LiteLLM: not measured: its proxy did not come up: $(tail -n 5 "$out/litellm.log" | tr '\n' ' ')"
    fi
  fi
fi
[ -n "$litellm_note" ] && echo "$litellm_note" >&2

if [ "$PERF" = 1 ]; then
  # Sampled call stacks of the in-memory gateway over the whole run.
  perf record -F 1999 -g -p "$memory" -o "$out/perf.data" >"$out/perf.log" 2>&1 &
  perf_pid=$!
  pids+=("$perf_pid")
fi
declare -A before
for w in "${watched[@]}"; do before[$w]=$(cpu_s "${w#*:}"); done
start=$(date +%s.%N)
$BIN bench --scenario gateway --direct "$stub_url" "${targets[@]}" --key "$KEY" \
  --rounds "$ROUNDS" --iterations "$ITERATIONS" --warmup-iterations "$WARMUP" \
  --sizes "$SIZES" --concurrency "$CONCURRENCY" >"$out/report.txt"
wall=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "%.1f", e - s}')

echo
echo "== $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== server CPU over the run (${wall} s wall, calibration included):"
for w in "${watched[@]}"; do
  awk -v n="${w%%:*}" -v b="${before[$w]}" -v a="$(cpu_s "${w#*:}")" 'BEGIN {printf "   %-8s %7.2f s\n", n, a - b}'
done
[ -n "$litellm_note" ] && echo "== $litellm_note"
echo
cat "$out/report.txt"

if [ "$PERF" = 1 ]; then
  kill -INT "$perf_pid" 2>/dev/null || true
  wait "$perf_pid" 2>/dev/null || true
  echo
  echo "== perf: the in-memory gateway's CPU samples by binary, then its top functions (self)"
  perf report -i "$out/perf.data" --no-children --sort dso --stdio 2>/dev/null \
    | grep -E '^ +[0-9.]+%' | head -n 8 || true
  perf report -i "$out/perf.data" --no-children --sort symbol --stdio -g none --percent-limit 0.7 2>/dev/null \
    | grep -E '^ +[0-9.]+%' | cut -c1-150 | head -n 45 || true
fi

if [ "$TOKENIZER" = 1 ]; then
  echo
  echo "== tokenizer throughput: cargo bench -p allowance-estimate (criterion medians)"
  cargo bench -p allowance-estimate -- --warm-up-time 1 --measurement-time 3 2>/dev/null \
    | grep -E '^[a-z_/0-9]+ *$|^[a-z_/0-9]+ +time:|time:|thrpt:' || true
fi
