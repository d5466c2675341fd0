#!/usr/bin/env bash
# The Debian packages the tests (and the benchmark) start servers from, installed when missing:
#   postgresql     the throwaway PostgreSQL servers (adapter, lease and deployment tests)
#   redis-server   the Celery broker of the deployment tests (aml_pipeline_tests/deploy/cluster.py)
#   pgbouncer      the pooler docs/deployment.md puts in front of the instance database
#                  (aml_pipeline_tests/pgbouncer.py)
#   e2fsprogs, mount  mkfs.ext4, dumpe2fs and losetup for the ext4 that fills at fsync
#                  (aml_pipeline_tests/thin_fs.py; usually part of the base system)
#   chromium       the browser the UI test drives (Playwright, headless; no browser download)
#   influxdb       InfluxDB 1.x (influxd), a plant historian the mapped sources read
#                  (aml_pipeline_tests/influx_server.py, docs/sources.md)
# Each test starts its own on 127.0.0.1; nothing is started here.
set -euo pipefail

missing=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || missing+=(postgresql)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || missing+=(redis-server)
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
{ command -v mkfs.ext4 || [ -x /usr/sbin/mkfs.ext4 ] || [ -x /sbin/mkfs.ext4 ]; } >/dev/null 2>&1 || missing+=(e2fsprogs)
[ -x /usr/bin/chromium ] || missing+=(chromium)
{ command -v losetup || [ -x /usr/sbin/losetup ] || [ -x /sbin/losetup ]; } >/dev/null 2>&1 || missing+=(mount)
command -v influxd >/dev/null 2>&1 || [ -x /usr/bin/influxd ] || missing+=(influxdb)

if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} (Debian packages) for the tests" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
