#!/usr/bin/env bash
# One command: set up (venv, packages, the server packages of scripts/system_packages.sh) and run
# the whole test suite.
# Tests that need PostgreSQL use $AML_TEST_PG_URL if set, else start a throwaway server themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
scripts/system_packages.sh
exec .venv/bin/python -m pytest "$@"
