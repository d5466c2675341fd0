#!/usr/bin/env bash
# Prepare the production instance: once before the first start and again after every upgrade of
# Dagster. Creates or migrates Dagster's tables in PostgreSQL and stores the pool limits.
# Idempotent. Run it with the deployment's environment (deploy/aml.env.example) and
# DAGSTER_HOME holding deploy/dagster.yaml.
#
#   AML_TSDB_POOL_LIMIT   steps reading the TSDB at once (default: 4 for a PostgreSQL TSDB,
#                         1 for the embedded DuckDB file; see docs/deployment.md)
#   DAGSTER               the dagster command (default: `dagster` on PATH)
set -euo pipefail
: "${DAGSTER_HOME:?DAGSTER_HOME must name the directory holding deploy/dagster.yaml}"
DAGSTER=${DAGSTER:-dagster}
case "${AML_TSDB_URL:-duckdb:}" in
  postgres:*|postgresql:*) default_limit=4 ;;
  *) default_limit=1 ;;  # DuckDB: readers share the file, but an ingest needs a moment without them
esac
limit=${AML_TSDB_POOL_LIMIT:-$default_limit}
case "$limit" in
  ''|*[!0-9]*) echo "AML_TSDB_POOL_LIMIT=$limit must be a whole number >= 1" >&2; exit 2 ;;
esac
[ "$limit" -ge 1 ] || { echo "AML_TSDB_POOL_LIMIT=$limit must be a whole number >= 1" >&2; exit 2; }

"$DAGSTER" instance migrate
# TSDB reads: a PostgreSQL TSDB serves several readers at once.
"$DAGSTER" instance concurrency set aml_tsdb "$limit"
# Rebuilds of the shared environment never queue against each other (the lease refuses them).
"$DAGSTER" instance concurrency set aml_shared_env 1
"$DAGSTER" instance concurrency get --all
