# Shared by the HTTP benchmark scripts (sourced, not run): one measured
# round of `allowance bench` against a server process, and medians.
# Needs BIN, SCENARIO, DURATION, CONCURRENCY and a writable $out.

# CPU time (user + system, clock ticks) a process has used so far.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TICKS=$(getconf CLK_TCK)

# One round: URL LABEL ROUND PID. Appends "pairs/s p99_ms cpu_us_per_pair"
# to $out/LABEL.all and prints the round on stderr.
bench_round() {
  local before after pairs p99 errors total cpu_us
  before=$(cpu_ticks "$4")
  $BIN bench --server "$1" --scenario "$SCENARIO" --duration "$DURATION" \
    --concurrency "$CONCURRENCY" 2>/dev/null >"$out/$2.$3"
  after=$(cpu_ticks "$4")
  pairs=$(awk '/^  pairs/ {gsub(/[(\/s)]/, "", $3); print $3}' "$out/$2.$3")
  total=$(awk '/^  pairs/ {print $2}' "$out/$2.$3")
  p99=$(awk '/^  pair / {print $5}' "$out/$2.$3")
  errors=$(awk '/^  errors/ {print $2}' "$out/$2.$3")
  # Server CPU per pair: robust to a noisy machine, unlike wall throughput.
  # (It includes the 1 s warm-up's pairs' CPU, a small overestimate for all.)
  cpu_us=$(awk -v t=$((after - before)) -v hz="$TICKS" -v n="$total" 'BEGIN {printf "%.1f", t / hz * 1e6 / n}')
  echo "$2 round $3: $pairs pairs/s, pair p99 $p99 ms, server CPU $cpu_us us/pair, errors $errors" >&2
  echo "$pairs $p99 $cpu_us" >>"$out/$2.all"
}

# The median of the numbers on stdin, one per line.
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
