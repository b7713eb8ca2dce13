#!/usr/bin/env bash
# The Python client's checks: lint, format, types, then pytest against the
# real binaries (`allowance serve`, the stub upstream, a private
# redis-server started by the tests). Also runs the gateway's SDK tests in
# tests/python/ when that directory exists. Budget: about a minute on 2 cores
# once the Rust binaries are built.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

venv="$(scripts/python-env.sh | tail -n 1)"
py="$venv/bin"

echo "== cargo build (the binaries the tests start)"
packages=(-p allowance-cli)
if [ -f crates/allowance-stub/Cargo.toml ]; then
  packages+=(-p allowance-stub)
fi
cargo build "${packages[@]}"

cd clients/python
echo "== ruff check"
"$py/ruff" check src tests examples
echo "== ruff format --check"
"$py/ruff" format --check src tests examples
echo "== mypy --strict"
"$py/mypy" --strict src examples tests
echo "== pytest clients/python/tests"
"$py/pytest" -q tests
cd "$root"

if [ -d tests/python ]; then
  echo "== pytest tests/python"
  # Exit 5 is pytest's "no tests collected": the directory is there but its
  # tests are not written yet. Anything else non-zero fails the script.
  status=0
  "$py/pytest" -q tests/python || status=$?
  if [ "$status" -eq 5 ]; then
    echo "tests/python has no tests yet"
  elif [ "$status" -ne 0 ]; then
    exit "$status"
  fi
fi
