#!/usr/bin/env bash
# Open the Dagster UI (webserver + daemon) on the repository's instance, where the demo recorded
# its materialisations: http://127.0.0.1:3000
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export DAGSTER_HOME="$PWD"
exec .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "${PORT:-3000}" "$@"
