#!/usr/bin/env bash
# The issue-6 benchmark: seed 003's fan-out through the admission queue.
# 120 sub-tasks of 3,000 prompt + 500 output tokens start at once on one
# tenant, each reserving with wait_ms, under 60 requests per minute
# compressed 10x (a bucket of 60 refilled over 6 s) and a 350,000-token
# total budget (so the budget binds: 100 fit, 20 are refused). Against a
# release `allowance serve` in memory on a free 127.0.0.1 port; `allowance
# bench --scenario fanout` reports the completion time against the ideal
# schedule (target <= 1.1x), the overspend (must be 0) and a queued
# admission's overhead against an immediate one. Each round uses a fresh
# tenant (fanout-<unix ms>), so one server serves every round.
#
#   scripts/bench-queue.sh               # 3 rounds, median ratio
#   ROUNDS=5 scripts/bench-queue.sh
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}

cargo build --release -p allowance-cli >&2
BIN=target/release/allowance
out=$(mktemp -d)
server=
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$out"' EXIT

cat >"$out/fanout.toml" <<'EOF'
[queue]
max_wait_ms = 60_000

[kinds.tenant]
plan = "fanout"

[plans.fanout]
limits = [
  { dimension = "requests", capacity = 60,      window = "bucket", period = "6s" },
  { dimension = "tokens",   capacity = 350_000, window = "total" },
]
EOF
$BIN check-config "$out/fanout.toml" >&2

# Port 0: the kernel picks a free port, and the server logs which.
$BIN serve --config "$out/fanout.toml" --data-dir "" --listen 127.0.0.1:0 2>"$out/server.log" &
server=$!
url=
for _ in $(seq 1 100); do
  url=$(grep -o 'listening on http://127\.0\.0\.1:[0-9]*' "$out/server.log" | head -n1 | cut -d' ' -f3 || true)
  [ -n "$url" ] && break
  kill -0 "$server" 2>/dev/null || { cat "$out/server.log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$url" ] || { echo "the server did not start:" >&2; cat "$out/server.log" >&2; exit 1; }
echo "server: $url" >&2

# The median of the numbers on stdin, one per line.
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

for r in $(seq 1 "$ROUNDS"); do
  $BIN bench --server "$url" --scenario fanout 2>/dev/null >"$out/round.$r"
  echo "--- round $r"
  cat "$out/round.$r"
  awk '/^  ratio/ {sub(/×/, "", $2); print $2}' "$out/round.$r" >>"$out/ratios"
  awk '/^  overspend/ {print $2}' "$out/round.$r" >>"$out/overspends"
  awk '/^  queued / {print $2}' "$out/round.$r" >>"$out/queued"
  awk '/^  imm\.\+settle / {print $3}' "$out/round.$r" >>"$out/pair"
  awk '/^  immediate / {print $3}' "$out/round.$r" >>"$out/immediate"
  sleep 0.5 # a new millisecond, hence a new tenant
done

echo
echo "fanout, $ROUNDS rounds (medians)"
echo "completion / ideal: $(median <"$out/ratios")x (target <= 1.1x); rounds: $(paste -sd' ' "$out/ratios")"
echo "overspend (max over rounds): $(sort -g "$out/overspends" | tail -n1) tokens (must be 0)"
q=$(median <"$out/queued"); i=$(median <"$out/immediate"); p=$(median <"$out/pair")
echo "immediate reserve p50 $i ms, immediate reserve+settle p50 $p ms"
echo "queued admission (settle answer -> waiter answer) p50 $q ms"
awk -v q="$q" -v i="$i" -v p="$p" 'BEGIN {
  printf "queued - immediate: %+.3f ms vs the reserve, %+.3f ms vs reserve+settle\n", q - i, q - p }'
