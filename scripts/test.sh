#!/usr/bin/env bash
# Runs every test suite of the project: the one command the README gives.
#
# Budgets (2 cores): the Rust suites take a few minutes; the locking model
# check runs a reduced number of schedules in CI. Raise the counts locally:
#   ALLOWANCE_PROPTEST_CASES=5000 ALLOWANCE_STRESS_ROUNDS=2000 \
#   ALLOWANCE_SHUTTLE_ITERS=100000 scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo test (workspace, unit + integration + doc tests)"
cargo test --workspace

if [ -x scripts/shuttle.sh ]; then
  echo "== shuttle: model check of the shared ledger's locking protocol"
  scripts/shuttle.sh
fi
