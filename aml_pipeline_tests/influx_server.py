"""A throwaway InfluxDB 1.x server for the tests (Debian's ``influxdb`` package, ``influxd``).

pytest (``influx_url`` fixture in ``conftest.py``) uses ``AML_TEST_INFLUX_URL`` if set,
otherwise :func:`start_server` into a fresh temporary directory and :meth:`InfluxServer.stop`
at the end. By hand::

    python -m aml_pipeline_tests.influx_server start DIR    # prints http://127.0.0.1:PORT
    python -m aml_pipeline_tests.influx_server stop DIR

What ``start`` does: writes ``DIR/influxdb.conf`` (meta, data and WAL under DIR; HTTP and the
RPC service on free ports of 127.0.0.1 only; no reporting, no self-monitoring, no query log;
``max-row-limit`` small, so a reader that does not page would see its answers cut), starts
``influxd -config DIR/influxdb.conf`` with its output in ``DIR/influxd.log`` and waits for
``/ping``. ``stop`` ends that process (its pid is in ``DIR/aml-influx-server.json``) and deletes
DIR. The server has no authentication: it is for tests only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aml_pipeline_tests.pg_server import end_process, free_port, reap_orphans

STATE_FILE = "aml-influx-server.json"
TMP_PREFIX = "aml-influx-"
# Rows per answer the server returns without chunking: small, so that a client that does not
# ask for chunks gets a partial answer in the tests.
MAX_ROW_LIMIT = 1000

_CONF = """reporting-enabled = false
bind-address = "127.0.0.1:{rpc_port}"

[meta]
  dir = "{base}/meta"
  logging-enabled = false

[data]
  dir = "{base}/data"
  wal-dir = "{base}/wal"
  query-log-enabled = false
  wal-fsync-delay = "1s"

[monitor]
  store-enabled = false

[continuous_queries]
  enabled = false

[http]
  enabled = true
  bind-address = "127.0.0.1:{port}"
  log-enabled = false
  auth-enabled = false
  max-row-limit = {max_rows}
"""


class InfluxServerError(RuntimeError):
    pass


def find_influxd() -> str:
    path = os.environ.get("AML_INFLUXD") or shutil.which("influxd") or "/usr/bin/influxd"
    if not os.access(path, os.X_OK):
        raise InfluxServerError(
            "no influxd found (AML_INFLUXD, PATH, /usr/bin/influxd); install the Debian package influxdb "
            "(scripts/system_packages.sh) or set AML_TEST_INFLUX_URL"
        )
    return path


@dataclass(frozen=True)
class InfluxServer:
    base: Path
    url: str
    pid: int

    def stop(self) -> None:
        stop_server(self.base)


def _ping(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ping", timeout=2) as resp:
            return resp.status == 204
    except (urllib.error.URLError, OSError):
        return False


def start_server(base: Path | str | None = None, *, owner_pid: int | None = None, timeout_s: float = 60.0) -> InfluxServer:
    influxd = find_influxd()
    if base is None:
        reap_stale_servers()
        base_path = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
    else:
        base_path = Path(base).absolute()
        base_path.mkdir(parents=True, exist_ok=True)
        if any(base_path.iterdir()):
            raise InfluxServerError(f"{base_path} is not empty; give a new or empty directory")
    port, rpc_port = free_port(), free_port()
    conf = base_path / "influxdb.conf"
    conf.write_text(_CONF.format(base=base_path, port=port, rpc_port=rpc_port, max_rows=MAX_ROW_LIMIT))
    log = open(base_path / "influxd.log", "ab")
    try:
        proc = subprocess.Popen([influxd, "-config", str(conf)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=base_path)
    finally:
        log.close()
    url = f"http://127.0.0.1:{port}"
    (base_path / STATE_FILE).write_text(json.dumps({"pid": proc.pid, "url": url, "owner_pid": owner_pid}))
    deadline = time.monotonic() + timeout_s
    while not _ping(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (base_path / "influxd.log").read_text(errors="replace")[-2000:]
            stop_server(base_path, remove=base is None)
            raise InfluxServerError(f"influxd did not start (exit {proc.poll()}):\n{tail}")
        time.sleep(0.1)
    return InfluxServer(base_path, url, proc.pid)


def stop_server(base: Path | str, *, remove: bool = True) -> None:
    """End the server started in ``base`` (SIGTERM, then SIGKILL after 20 s) and delete ``base``."""
    base_path = Path(base).absolute()
    state_path = base_path / STATE_FILE
    if not state_path.exists():
        raise InfluxServerError(f"{base_path} holds no server started by aml_pipeline_tests.influx_server")
    pid = json.loads(state_path.read_text()).get("pid")
    if isinstance(pid, int):
        end_process(pid)
    if remove:
        shutil.rmtree(base_path, ignore_errors=True)


def reap_stale_servers(root: Path | None = None) -> list[Path]:
    """Stop and delete servers whose test run died before stopping them."""
    return reap_orphans(root or Path(tempfile.gettempdir()), TMP_PREFIX, STATE_FILE, stop_server,
                        (InfluxServerError, OSError))


@contextlib.contextmanager
def server_url() -> Iterator[str]:
    """``AML_TEST_INFLUX_URL`` if set, else the URL of a throwaway server stopped on exit."""
    url = os.environ.get("AML_TEST_INFLUX_URL")
    if url:
        yield url
        return
    server = start_server(owner_pid=os.getpid())
    try:
        yield server.url
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("start", "stop"):
        print("usage: python -m aml_pipeline_tests.influx_server start|stop DIR", file=sys.stderr)
        return 2
    try:
        if args[0] == "start":
            print(start_server(args[1]).url)
        else:
            stop_server(args[1])
    except InfluxServerError as exc:
        print(f"influx_server {args[0]}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
