#!/usr/bin/env bash
# Creates (or refreshes) the Python environment at target/py-venv: the
# `allowance` client from clients/python (editable) with its dev extras
# (pytest, pytest-asyncio, mypy, ruff, httpx, openai, anthropic). The
# gateway's SDK tests and the API's OpenAPI conformance test (tests/python/)
# share it, with what tests/python/requirements.txt adds (schemathesis).
#
# Idempotent and quick: a stamp keyed by a hash of clients/python/pyproject.toml
# (and of this script) skips pip when nothing changed. Needs CPython ≥ 3.11
# with the venv module and PyPI.
#   PYTHON=python3.12 scripts/python-env.sh    # pick the interpreter
#   scripts/python-env.sh --force               # reinstall regardless
# Prints the venv's path on its last line.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/target/py-venv"
python="${PYTHON:-python3}"
stamp="$venv/.allowance-stamp"

key="$( (cat "$root/clients/python/pyproject.toml" "$root/tests/python/requirements.txt" "$0"; "$python" --version 2>&1) | sha256sum | cut -d' ' -f1)"

if [ "${1:-}" != "--force" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] \
  && [ -x "$venv/bin/python" ]; then
  echo "$venv"
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "== creating $venv" >&2
  mkdir -p "$root/target"
  "$python" -m venv "$venv"
fi
echo "== installing clients/python[dev] into $venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  -e "$root/clients/python[dev]" -r "$root/tests/python/requirements.txt" >&2
echo "$key" > "$stamp"
echo "$venv"
