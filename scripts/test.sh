#!/usr/bin/env bash
# One command: set up (venv, packages, PostgreSQL server binaries) and run the whole test suite.
# Tests that need PostgreSQL use $AML_TEST_PG_URL if set, else start a throwaway server themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null; then
  echo "installing PostgreSQL server (Debian packages) for the tests" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
if ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then
  echo "installing Redis server (Debian package) for the Celery deployment tests" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
  echo "installing PgBouncer (Debian package) for the pooled-instance test" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends pgbouncer >/dev/null
fi
exec .venv/bin/python -m pytest "$@"
