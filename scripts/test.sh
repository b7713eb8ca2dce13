#!/usr/bin/env bash
# Runs every test suite of the project: the one command the README gives.
#
# Budgets (2 cores): the Rust suites take a few minutes; the locking model
# check runs a reduced number of schedules in CI. Raise the counts locally:
#   ALLOWANCE_PROPTEST_CASES=5000 ALLOWANCE_STRESS_ROUNDS=2000 \
#   ALLOWANCE_SHUTTLE_ITERS=100000 ALLOWANCE_CRASH_ROUNDS=50 scripts/test.sh
# (ALLOWANCE_CRASH_ROUNDS: kill -9 rounds of the durable store's crash test,
# 5 by default; ALLOWANCE_CRASH_SEED replays one.)
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo test (workspace, unit + integration + doc tests)"
cargo test --workspace

if [ -x scripts/shuttle.sh ]; then
  echo "== shuttle: model check of the shared ledger's locking protocol"
  scripts/shuttle.sh
fi

echo "== Python: the client (clients/python) and the gateway's SDK tests (tests/python)"
scripts/test-python.sh
