#!/usr/bin/env bash
# The issue-4 benchmark: reserve+settle pairs over HTTP/1.1 keep-alive at
# concurrency 64 against three release `allowance serve` processes — the
# durable store with `fsync = "always"`, with `fsync = "batch"`, and the
# in-memory store — measured in the same run, alternating the order every
# round so the machine's drift hits all three. Figures are medians over
# ROUNDS rounds; the ratios against in-memory are what to quote.
#
#   scripts/bench-durable.sh                    # 5 rounds of 10 s each
#   ROUNDS=3 DURATION=5s scripts/bench-durable.sh
#   DATA_ROOT=/some/disk scripts/bench-durable.sh   # where the logs go
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-10s}
CONCURRENCY=${CONCURRENCY:-64}
SCENARIO=${SCENARIO:-pairs}
BASE_PORT=${BASE_PORT:-18890}

# BIN=path/to/allowance measures that build instead (e.g. another worktree's).
if [ -z "${BIN:-}" ]; then
  cargo build --release -p allowance-cli >&2
  BIN=target/release/allowance
fi
out=$(mktemp -d)
data=$(mktemp -d "${DATA_ROOT:-${TMPDIR:-/tmp}}/allowance-bench.XXXXXX")
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$out" "$data"' EXIT

config() { # fsync
  printf '%s\n' "$(sed "s/^fsync = .*/fsync = \"$1\"/" crates/allowance-config/src/starter.toml)"
}

start() { # label port data-dir fsync
  config "$4" >"$out/$1.toml"
  $BIN serve --config "$out/$1.toml" --data-dir "$3" --listen "127.0.0.1:$2" 2>"$out/$1.log" &
  pids+=($!)
  eval "pid_$1=$!"
}
start memory $BASE_PORT "" always
start always $((BASE_PORT + 1)) "$data/always" always
start batch $((BASE_PORT + 2)) "$data/batch" batch
sleep 2

. scripts/bench-lib.sh
run() { # label port round
  bench_round "http://127.0.0.1:$2" "$1" "$3" "$(eval echo "\$pid_$1")"
}

order=(memory always batch)
ports=([0]=$BASE_PORT [1]=$((BASE_PORT + 1)) [2]=$((BASE_PORT + 2)))
for r in $(seq 1 "$ROUNDS"); do
  for k in 0 1 2; do
    i=$(( (k + r) % 3 ))
    run "${order[$i]}" "${ports[$i]}" "$r"
  done
done

echo
echo "scenario $SCENARIO, concurrency $CONCURRENCY, $ROUNDS rounds of $DURATION (medians)"
m=$(cut -d' ' -f1 "$out/memory.all" | median)
for l in memory always batch; do
  t=$(cut -d' ' -f1 "$out/$l.all" | median)
  p=$(cut -d' ' -f2 "$out/$l.all" | median)
  c=$(cut -d' ' -f3 "$out/$l.all" | median)
  awk -v l="$l" -v t="$t" -v p="$p" -v c="$c" -v m="$m" 'BEGIN {
    printf "%-7s %9.0f pairs/s (%5.1f%% of in-memory), pair p99 %s ms, server CPU %s us/pair\n", l, t, 100*t/m, p, c }'
done
echo "target: always >= 80% of in-memory"
