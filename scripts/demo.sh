#!/usr/bin/env bash
# One command: set up, seed the simulated plant into the embedded TSDB, build specs/reactor_a.yaml
# through Dagster (recorded in the repository's Dagster instance), print the snapshot summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export DAGSTER_HOME="${DAGSTER_HOME:-$PWD}"  # the repository (dagster.yaml), unless set
exec .venv/bin/aml-pipeline demo "$@"
