#!/usr/bin/env bash
# Create .venv at the repository root (if needed) and install the project with pinned versions.
# Usage: scripts/setup.sh [extra ...]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extras=$(IFS=,; echo "$*")
stamp=".venv/.installed-$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -c1-16)-${extras:-base}"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -c requirements/constraints.txt -e ".${extras:+[$extras]}"
  touch "$stamp"
fi
