#!/usr/bin/env bash
# Open the Dagster UI (`dg dev`: webserver, daemon, code server) on the repository's instance,
# where the demo recorded its materialisations: http://127.0.0.1:3000 (PORT=... for another port).
# DAGSTER_HOME defaults to the repository (its dagster.yaml keeps the instance under .aml/).
#
# Ctrl-C or SIGTERM stops it within seconds: `dg dev` runs in a process group of its own, gets one
# SIGINT (its shutdown signal) from here, and whatever is still running STOP_TIMEOUT_S (default
# 10) seconds later is terminated, then killed. (Started with SIGINT ignored, as a background job
# of a script is, `dagster dev` would ignore SIGTERM too: it maps SIGTERM to SIGINT's handler.
# SIGINT is therefore reset for it here.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export DAGSTER_HOME="${DAGSTER_HOME:-$PWD}"
# The webserver and the daemon upload what is under $DAGSTER_HOME/logs whatever dagster.yaml says
# about telemetry; an `aml-pipeline build --workers N` leaves Dagster's usage records there
# (docs/operations.md, "Parallel builds"). This variable stops the upload.
export DAGSTER_DISABLE_TELEMETRY="${DAGSTER_DISABLE_TELEMETRY:-1}"
export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"  # what `dg` expects of a project
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-10}

set -m  # job control: the background job below gets its own process group
.venv/bin/python -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
  .venv/bin/dg dev --host 127.0.0.1 --port "${PORT:-3000}" "$@" &
pid=$!

# Any process of the group still running (its exited leader stays a zombie until reaped).
alive() { ps -e -o pgid=,stat= | awk -v g="$pid" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'; }
stop() {
  trap '' INT TERM HUP
  echo "ui.sh: stopping Dagster..." >&2
  kill -INT -- "-$pid" 2>/dev/null || true
  for _ in $(seq $((STOP_TIMEOUT_S * 10))); do alive || break; sleep 0.1; done
  if alive; then
    echo "ui.sh: still running after ${STOP_TIMEOUT_S} s: terminating its processes" >&2
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 30); do alive || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  echo "ui.sh: stopped" >&2
  exit 0
}
trap stop INT TERM HUP
status=0
wait "$pid" || status=$?
exit "$status"
