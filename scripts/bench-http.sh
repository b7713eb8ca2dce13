#!/usr/bin/env bash
# The issue-3 benchmark: reserve+settle pairs over HTTP/1.1 keep-alive at
# concurrency 64 against a release `allowance serve` (in memory, starter
# configuration), and — in the same run, alternating — against the no-op
# ceiling (`allowance bench-noop`: same routes, same JSON parsing, fixed
# answers), each as its own process. Client and servers share this
# machine's cores: the figures are ratios, medians over ROUNDS rounds.
#
#   scripts/bench-http.sh                # 5 rounds of 10 s each
#   ROUNDS=3 DURATION=5s scripts/bench-http.sh
#   BIN=/other/target/release/allowance scripts/bench-http.sh
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-10s}
CONCURRENCY=${CONCURRENCY:-64}
SCENARIO=${SCENARIO:-pairs}
SERVER_PORT=${SERVER_PORT:-18787}
NOOP_PORT=${NOOP_PORT:-18788}

# BIN=path/to/allowance measures that build instead (e.g. another worktree's).
if [ -z "${BIN:-}" ]; then
  cargo build --release -p allowance-cli >&2
  BIN=target/release/allowance
fi
out=$(mktemp -d)
trap 'kill $server $noop 2>/dev/null || true; rm -rf "$out"' EXIT

$BIN serve --data-dir "" --listen 127.0.0.1:$SERVER_PORT 2>"$out/server.log" &
server=$!
$BIN bench-noop --listen 127.0.0.1:$NOOP_PORT 2>"$out/noop.log" &
noop=$!
sleep 1

. scripts/bench-lib.sh
run() { bench_round "$@"; }

for r in $(seq 1 "$ROUNDS"); do
  # Alternate which goes first, so drift in the machine's load hits both.
  if (( r % 2 )); then
    run "http://127.0.0.1:$SERVER_PORT" allowance "$r" $server
    run "http://127.0.0.1:$NOOP_PORT" noop "$r" $noop
  else
    run "http://127.0.0.1:$NOOP_PORT" noop "$r" $noop
    run "http://127.0.0.1:$SERVER_PORT" allowance "$r" $server
  fi
done

a_tput=$(cut -d' ' -f1 "$out/allowance.all" | median)
n_tput=$(cut -d' ' -f1 "$out/noop.all" | median)
a_p99=$(cut -d' ' -f2 "$out/allowance.all" | median)
n_p99=$(cut -d' ' -f2 "$out/noop.all" | median)
a_cpu=$(cut -d' ' -f3 "$out/allowance.all" | median)
n_cpu=$(cut -d' ' -f3 "$out/noop.all" | median)
echo
echo "scenario $SCENARIO, concurrency $CONCURRENCY, $ROUNDS rounds of $DURATION (medians)"
echo "allowance: $a_tput pairs/s, pair p99 $a_p99 ms, server CPU $a_cpu us/pair"
echo "no-op:     $n_tput pairs/s, pair p99 $n_p99 ms, server CPU $n_cpu us/pair"
awk -v a="$a_tput" -v n="$n_tput" -v ap="$a_p99" -v np="$n_p99" -v ac="$a_cpu" -v nc="$n_cpu" 'BEGIN {
  printf "throughput %.1f%% of the no-op (target >= 80%%); p99 %.2fx the no-op (target <= 1.5x); server CPU per pair %.2fx the no-op\n", 100*a/n, ap/np, ac/nc }'
