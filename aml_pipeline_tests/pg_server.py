"""A throwaway PostgreSQL server for the tests: the one way to start it, for pytest and for CI.

pytest (``postgres_url`` fixture in ``conftest.py``) uses ``AML_TEST_PG_URL`` if set, otherwise
:func:`start_server` into a fresh temporary directory and :meth:`PgServer.stop` at the end.
CI starts one with::

    export AML_TEST_PG_URL="$(python -m aml_pipeline_tests.pg_server start "$DIR")"
    ...
    python -m aml_pipeline_tests.pg_server stop "$DIR"

What ``start`` does (``BIN`` = ``pg_config --bindir`` if it holds ``initdb``, else the newest
``/usr/lib/postgresql/*/bin``, or ``$AML_PG_BINDIR``)::

    BIN/initdb -D DIR/data -U postgres -A trust -E UTF8 --no-locale -N
    (append listen_addresses='127.0.0.1', port, unix_socket_directories='DIR/sock', fsync=off,
     ... to DIR/data/postgresql.conf)
    BIN/pg_ctl -D DIR/data -l DIR/postgres.log -w -t 60 start
    BIN/createdb -h 127.0.0.1 -p PORT -U postgres aml_test
    -> postgresql://postgres@127.0.0.1:PORT/aml_test

initdb and pg_ctl refuse to run as root, so as root they run as the ``postgres`` OS user (or
``$AML_TEST_PG_OSUSER``), DIR being handed over to that user. The server listens on 127.0.0.1
only, with its Unix socket in DIR, and trusts local connections: it is for tests only.
``stop`` runs ``pg_ctl -D DIR/data -m immediate -w stop`` and deletes DIR.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from aml_pipeline.fsutil import process_alive

STATE_FILE = "aml-pg-server.json"
DB_NAME = "aml_test"
DB_USER = "postgres"
TMP_PREFIX = "aml-pg-"
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes, minus "/.s.PGSQL.NNNNN"

_CONF = """
# --- aml_pipeline_tests.pg_server: throwaway test server ---
listen_addresses = '127.0.0.1'
unix_socket_directories = '{sock}'
max_connections = 200
shared_buffers = 32MB
fsync = off
synchronous_commit = off
full_page_writes = off
log_min_messages = warning
"""


class PgServerError(RuntimeError):
    pass


def find_bindir() -> Path:
    """The directory holding initdb, pg_ctl and postgres."""
    candidates: list[str] = []
    if os.environ.get("AML_PG_BINDIR"):
        candidates.append(os.environ["AML_PG_BINDIR"])
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=30, check=True
            ).stdout.strip()
            if out:
                candidates.append(out)

    def version(path: str) -> tuple[int, ...]:
        m = re.search(r"/postgresql/([\d.]+)/bin$", path)
        return tuple(int(x) for x in m.group(1).split(".") if x) if m else ()

    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(str(Path(initdb).resolve().parent))
    for cand in candidates:
        d = Path(cand)
        if all(os.access(d / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            return d
    raise PgServerError(
        "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found via $AML_PG_BINDIR, "
        "pg_config --bindir, /usr/lib/postgresql/*/bin or PATH; install the server "
        "(e.g. apt-get install postgresql) or set AML_TEST_PG_URL"
    )


@dataclass(frozen=True)
class _RunAs:
    uid: int
    gid: int
    name: str


def run_as_for_server() -> _RunAs | None:
    """None when not root; else the unprivileged OS user that runs initdb/pg_ctl."""
    if os.geteuid() != 0:
        return None
    name = os.environ.get("AML_TEST_PG_OSUSER", "postgres")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise PgServerError(
            f"running as root, but there is no OS user {name!r} to run PostgreSQL as "
            "(initdb refuses root): create one or set AML_TEST_PG_OSUSER"
        ) from None
    if pw.pw_uid == 0:
        raise PgServerError(f"AML_TEST_PG_OSUSER={name!r} is root; PostgreSQL refuses root")
    return _RunAs(pw.pw_uid, pw.pw_gid, name)


def _owner_of(path: Path) -> _RunAs | None:
    """Whom to run pg_ctl as for an existing data directory (its owner, when we are root)."""
    if os.geteuid() != 0:
        return None
    st = os.stat(path)
    try:
        name = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        name = str(st.st_uid)
    return _RunAs(st.st_uid, st.st_gid, name)


def clean_env() -> dict[str, str]:
    # PG* variables (PGDATA, PGPORT, PGHOST, ...) of the caller must not redirect the tools.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    env["PGCONNECT_TIMEOUT"] = "10"
    return env


def _run(
    cmd: list[str], *, run_as: _RunAs | None, cwd: Path, log: Path, timeout: float = 120
) -> None:
    """Run a server tool; its output goes to ``log`` (never to a pipe a daemon could inherit)."""
    kwargs: dict[str, object] = {}
    if run_as is not None:
        kwargs.update(user=run_as.uid, group=run_as.gid, extra_groups=[])
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            proc = subprocess.run(
                cmd,
                cwd=cwd,
                env=clean_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                **kwargs,
            )
        except subprocess.TimeoutExpired:
            raise PgServerError(f"{Path(cmd[0]).name} timed out after {timeout}s; see {log}")
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise PgServerError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}):\n{tail}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_traversable(path: Path) -> bool:
    path = path.resolve()
    for p in [path, *path.parents]:
        try:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


def _temp_root() -> Path:
    root = Path(tempfile.gettempdir())
    if os.geteuid() == 0 and not _world_traversable(root):
        root = Path("/tmp")  # the server user must reach the directory
    return root


@dataclass(frozen=True)
class PgServer:
    base: Path
    url: str
    port: int
    bindir: Path

    @property
    def data(self) -> Path:
        return self.base / "data"

    def stop(self, *, remove: bool = True) -> None:
        stop_server(self.base, remove=remove)

    def start(self) -> None:
        """Start the server again after ``stop(remove=False)``: same data, same port."""
        log = self.base / "postgres.log"
        _run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(log), "-w", "-t", "60", "start"],
             run_as=_owner_of(self.data), cwd=self.base, log=log, timeout=90)

    def restart_immediate(self) -> None:
        """``pg_ctl restart -m immediate``: every backend killed at once (as in a crash), the
        server started again (crash recovery) and accepting connections when this returns."""
        log = self.base / "postgres.log"
        _run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(log), "-m", "immediate", "-w",
              "-t", "60", "restart"], run_as=_owner_of(self.data), cwd=self.base, log=log, timeout=90)

    @property
    def postmaster_pid(self) -> int | None:
        return _postmaster_pid(self.data)


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def start_server(base: Path | str | None = None, *, owner_pid: int | None = None) -> PgServer:
    """initdb + start a server in ``base`` (a new temporary directory if None); see module doc.

    ``owner_pid``: the process whose death makes this server stale (pytest's fixture passes its
    own pid, so a later run can stop servers left by a killed run); None for CI's script use.
    """
    bindir = find_bindir()
    run_as = run_as_for_server()
    if base is None:
        reap_stale_servers()
        base_path = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=_temp_root()))
    else:
        base_path = Path(base).absolute()
        base_path.mkdir(parents=True, exist_ok=True)
        if any(base_path.iterdir()):
            raise PgServerError(f"{base_path} is not empty; give a new or empty directory")
    data, sock, log = base_path / "data", base_path / "sock", base_path / "postgres.log"
    if len(str(sock)) > _SOCKET_PATH_MAX:
        raise PgServerError(f"{sock} is too long for a Unix socket path; use a shorter DIR")
    sock.mkdir(mode=0o700)
    log.touch()
    if run_as is not None:
        for p in (base_path, sock, log):
            os.chown(p, run_as.uid, run_as.gid)
        if not _world_traversable(base_path.parent):
            raise PgServerError(
                f"{base_path.parent} is not reachable by OS user {run_as.name!r}; "
                "give a DIR under /tmp"
            )
    state = {
        "bindir": str(bindir),
        "owner_pid": owner_pid,
        "run_as": run_as.name if run_as else None,
    }
    (base_path / STATE_FILE).write_text(json.dumps(state))
    try:
        _run(
            [str(bindir / "initdb"), "-D", str(data), "-U", DB_USER, "-A", "trust",
             "-E", "UTF8", "--no-locale", "-N"],
            run_as=run_as, cwd=base_path, log=log,
        )
        conf = data / "postgresql.conf"
        with open(conf, "a") as f:
            f.write(_CONF.format(sock=str(sock).replace("'", "''")))
        port = None
        for attempt in range(5):
            port = free_port()
            with open(conf, "a") as f:
                f.write(f"port = {port}\n")  # the last setting wins
            try:
                _run(
                    [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60",
                     "start"],
                    run_as=run_as, cwd=base_path, log=log, timeout=90,
                )
                break
            except PgServerError:
                if attempt == 4 or "could not bind" not in log.read_text(errors="replace"):
                    raise
        assert port is not None
        createdb = bindir / "createdb"
        _run(
            [str(createdb), "-h", "127.0.0.1", "-p", str(port), "-U", DB_USER, DB_NAME],
            run_as=run_as, cwd=base_path, log=log, timeout=60,
        )
    except BaseException:
        stop_server(base_path, remove=base is None)
        raise
    url = f"postgresql://{DB_USER}@127.0.0.1:{port}/{DB_NAME}"
    state.update(url=url, port=port, postmaster_pid=_postmaster_pid(data))
    (base_path / STATE_FILE).write_text(json.dumps(state))
    return PgServer(base=base_path, url=url, port=port, bindir=bindir)


def stop_server(base: Path | str, *, remove: bool = True) -> None:
    """Stop the server in ``base`` (immediate shutdown) and delete ``base``.

    Only a directory made by :func:`start_server` (it holds ``aml-pg-server.json``) is deleted.
    """
    base_path = Path(base).absolute()
    state_path = base_path / STATE_FILE
    if not state_path.exists():
        raise PgServerError(f"{base_path} holds no server started by aml_pipeline_tests.pg_server ({STATE_FILE})")
    data = base_path / "data"
    try:
        bindir = Path(json.loads(state_path.read_text()).get("bindir") or find_bindir())
    except (OSError, ValueError):
        bindir = find_bindir()
    if (data / "postmaster.pid").exists():
        pid = _postmaster_pid(data)
        try:
            _run(
                [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "-t", "30",
                 "stop"],
                run_as=_owner_of(data), cwd=base_path, log=base_path / "postgres.log",
                timeout=60,
            )
        except PgServerError:
            # Last resort, for this server's postmaster only (its children exit on their own).
            if pid is not None and process_alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    if remove:
        shutil.rmtree(base_path, ignore_errors=True)


def end_process(pid: int, *, kill: bool = False, grace_s: float = 20.0) -> None:
    """End a throwaway server's process: SIGTERM (SIGKILL with ``kill``), SIGKILL after
    ``grace_s`` seconds, and reap it if it is our child."""
    if not process_alive(pid):
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while process_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    if process_alive(pid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


def reap_orphans(root: Path, prefix: str, state_file: str, stop: Callable[[Path], None],
                 errors: tuple[type[BaseException], ...]) -> list[Path]:
    """Stop and delete the throwaway servers under ``root`` (folders ``prefix*`` holding
    ``state_file`` with an ``owner_pid``) whose owner is gone: a test run killed before it could
    stop them. ``stop`` stops one server folder; ``errors`` it raises are ignored here."""
    reaped = []
    for state_path in root.glob(f"{prefix}*/{state_file}"):
        try:
            owner = json.loads(state_path.read_text()).get("owner_pid")
        except (OSError, ValueError):
            continue
        if isinstance(owner, int) and not process_alive(owner):
            with contextlib.suppress(*errors):
                stop(state_path.parent)
                reaped.append(state_path.parent)
    return reaped


def reap_stale_servers(root: Path | None = None) -> list[Path]:
    """Stop and delete servers that a test run started and did not outlive (killed pytest)."""
    return reap_orphans(root or _temp_root(), TMP_PREFIX, STATE_FILE, stop_server, (PgServerError, OSError))


@contextlib.contextmanager
def server_url() -> Iterator[str]:
    """``AML_TEST_PG_URL`` if set, else the URL of a throwaway server stopped on exit."""
    url = os.environ.get("AML_TEST_PG_URL")
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
        print(f"usage: python -m {__spec__.name if __spec__ else 'pg_server'} start|stop DIR",
              file=sys.stderr)
        return 2
    command, directory = args
    try:
        if command == "start":
            print(start_server(directory).url)
        else:
            stop_server(directory)
    except PgServerError as exc:
        print(f"pg_server {command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
