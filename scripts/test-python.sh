#!/usr/bin/env bash
# The Python client's checks: lint, format, types, then pytest against the
# real binaries (`allowance serve`, the stub upstream, a private
# redis-server started by the tests), then the gateway's tests in
# tests/python/ with the official openai and anthropic SDKs as clients.
# Budget: about a minute and a half on 2 cores
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

echo "== the gateway's tests with the official SDKs (tests/python)"
"$py/ruff" check tests/python
"$py/ruff" format --check tests/python
"$py/mypy" --strict tests/python
"$py/pytest" -q tests/python
