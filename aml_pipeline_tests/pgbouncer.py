"""PgBouncer in front of a test PostgreSQL server, as docs/deployment.md puts it in front of the
Dagster instance database: session pooling, so every storage call of Dagster (which opens a new
connection for each, see docs/deployment.md) reuses a server connection instead of forking a
backend.

What :func:`pooled_url` does (``pgbouncer`` from Debian's package of that name)::

    write DIR/pgbouncer.ini: [databases] * = host=<server host> port=<server port>
                             listen_addr=127.0.0.1, a free port, auth_type=trust, pool_mode as in
                             deploy/pgbouncer.ini (session)
    pgbouncer -d DIR/pgbouncer.ini        (as the postgres OS user when root: it refuses root)
    -> the server URL with the pooler's port; on exit SIGTERM and wait

DIR also records the pid of the process that started it: a pooler whose starter died without
stopping it (a SIGKILLed pytest) is stopped and DIR deleted when the next one starts.

It trusts local connections like the test server behind it: it is for tests and the benchmark.
"""

from __future__ import annotations

import configparser
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

from aml_pipeline.fsutil import process_alive
from aml_pipeline_tests.pg_server import PgServerError, clean_env, free_port, run_as_for_server

_INI = """\
[databases]
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen_port}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/users.txt
admin_users = {user}
pool_mode = {pool_mode}
max_client_conn = 500
default_pool_size = 40
logfile = {dir}/pgbouncer.log
pidfile = {dir}/pgbouncer.pid
"""


DEPLOYED_INI = Path(__file__).resolve().parents[1] / "deploy" / "pgbouncer.ini"
TMP_PREFIX = "aml-pgbouncer-"
OWNER_FILE = "owner.pid"


class PgBouncerMissing(PgServerError):
    pass


def find_pgbouncer() -> str:
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )
    if not found:
        raise PgBouncerMissing("no pgbouncer on PATH or in /usr/sbin (Debian package: pgbouncer)")
    return found


def deployed_pool_mode() -> str:
    """The pool mode of deploy/pgbouncer.ini: the tests pool the way a deployment does."""
    ini = configparser.ConfigParser()
    ini.read(DEPLOYED_INI)
    return ini["pgbouncer"]["pool_mode"]


def with_port(url: str, port: int) -> str:
    """``url`` with its host's port replaced (user, database and query kept)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{parts.hostname}:{port}" if userinfo else f"{parts.hostname}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


@contextlib.contextmanager
def pooled_url(server_url: str) -> Iterator[str]:
    """The URL of a PgBouncer (session pooling) in front of ``server_url``, stopped on exit."""
    binary = find_pgbouncer()
    server = urlsplit(server_url)
    run_as = run_as_for_server()
    reap_stale_poolers()
    base = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
    try:
        (base / OWNER_FILE).write_text(str(os.getpid()))
        port = free_port()
        user = server.username or "postgres"
        (base / "users.txt").write_text(f'"{user}" ""\n')
        (base / "pgbouncer.ini").write_text(_INI.format(
            host=server.hostname or "127.0.0.1", port=server.port or 5432, listen_port=port, dir=base,
            user=user, pool_mode=deployed_pool_mode(),
        ))
        command = [binary, "-d", str(base / "pgbouncer.ini")]
        if run_as is not None:
            for p in (base, *base.iterdir()):
                os.chown(p, run_as.uid, run_as.gid)
            command = ["runuser", "-u", run_as.name, "--", *command]
        started = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=30)
        if started.returncode != 0:
            raise PgServerError(f"pgbouncer did not start: {started.stderr.strip() or started.stdout.strip()}")
        url = with_port(server_url, port)
        _wait_ready(url, base)
        try:
            yield url
        finally:
            _stop(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def reap_stale_poolers(root: Path | None = None) -> list[Path]:
    """Stop and delete the poolers of :func:`pooled_url` whose starting process is gone."""
    reaped = []
    for owner_file in (root or Path(tempfile.gettempdir())).glob(f"{TMP_PREFIX}*/{OWNER_FILE}"):
        try:
            owner = int(owner_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if not process_alive(owner):
            _stop(owner_file.parent)
            shutil.rmtree(owner_file.parent, ignore_errors=True)
            reaped.append(owner_file.parent)
    return reaped


def _is_pgbouncer(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "pgbouncer"
    except OSError:
        return False


def _wait_ready(url: str, base: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with psycopg.connect(url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                log = (base / "pgbouncer.log").read_text(errors="replace")[-2000:] if (base / "pgbouncer.log").exists() else ""
                _stop(base)
                raise PgServerError(f"pgbouncer at {url} not ready after {timeout_s:g} s: {exc}\n{log}") from exc
            time.sleep(0.1)


def _stop(base: Path) -> None:
    try:
        pid = int((base / "pgbouncer.pid").read_text().strip())
    except (OSError, ValueError):
        return
    if not _is_pgbouncer(pid):
        return  # gone already (its pid file outlives it when it is killed), perhaps reused
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
