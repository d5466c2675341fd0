"""Multi-host lease: PostgreSQL session-level advisory locks.

Every held lease is one dedicated database connection: the session *is* the lease. A reader
holds ``pg_try_advisory_lock_shared(key)``, the exclusive holder ``pg_try_advisory_lock(key)``,
where ``key`` is a stable 64-bit hash of the lease name. Releasing unlocks and closes the
connection; a holder that dies ends its session, and the server drops the lock with it (for a
vanished *host*, once TCP keepalive gives up: the lease session sets
``tcp_keepalives_idle/interval/count`` = 10/5/3 s, and turns ``idle_session_timeout`` off so an
idle holder is not disconnected behind its back).

The gate (see :mod:`aml_pipeline.lease.base`) is a second advisory key, that of ``NAME:pending``
(no lease name contains ``:``). A waiting rebuild holds it with ``pg_try_advisory_lock`` in its
request session; every other request runs one statement that takes it shared, tries the lock
and lets go of it again (``CASE`` evaluates its branches in order and only as needed).

Holders are told apart by ``application_name`` = ``aml-lease:<r|x>:<pid>@<host>:<holder>``
(PostgreSQL keeps 63 ASCII bytes of it, so long holder names are shortened with ``...``); a
waiting rebuild's mode field carries its wait in seconds (``x30``). ``status`` reads them from
``pg_locks`` joined with ``pg_stat_activity``: only sessions that hold a lock right now, so a
dead holder never shows. A holder's ``since`` is the session's ``state_change`` (when the
acquiring query finished; the lease session runs nothing after it); a waiting rebuild's is the
session's ``backend_start`` and its deadline that plus its wait.

The URL's password (if any) is used to connect and never shown: messages and ``location`` carry
the URL without it. Passwords may also come from ``PGPASSWORD`` / ``~/.pgpass`` as libpq reads
them. Connecting and scrubbing messages are :class:`~aml_pipeline.pg_connection.PgConnection`'s,
as for the TSDB adapter and the mapped PostgreSQL sources.
"""

from __future__ import annotations

import hashlib
import os
import select

import psycopg
from psycopg.conninfo import conninfo_to_dict

from aml_pipeline.lease.base import (
    DEFAULT_LEASE_NAME,
    EnvLease,
    HolderInfo,
    LeaseError,
    LeaseHandle,
    LeaseStatus,
    _Attempt,
    hostname,
    retry_briefly,
    short_host,
)
from aml_pipeline.pg_connection import PgConnectError, PgConnection
from aml_pipeline.urls import redact_url

APP_PREFIX = "aml-lease:"
_APP_MAX_BYTES = 63  # NAMEDATALEN - 1
_MODE_LETTER = {"read": "r", "exclusive": "x"}

_SQL_TRY_LOCK = {"read": "pg_try_advisory_lock_shared", "exclusive": "pg_try_advisory_lock"}
# Through the gate: 'gate' (a rebuild waits), 'granted' or 'busy'; the gate is not kept.
_SQL_PASS = {
    mode: f"""
SELECT CASE
  WHEN NOT pg_try_advisory_lock_shared(%(gate)s::bigint) THEN 'gate'
  WHEN {function}(%(key)s::bigint)
    THEN CASE WHEN pg_advisory_unlock_shared(%(gate)s::bigint) THEN 'granted' ELSE 'granted' END
  ELSE CASE WHEN pg_advisory_unlock_shared(%(gate)s::bigint) THEN 'busy' ELSE 'busy' END
END"""
    for mode, function in _SQL_TRY_LOCK.items()
}
_SQL_TAKE_GATE = "SELECT pg_try_advisory_lock(%(gate)s::bigint)"
# Holding the gate: NULL while the lock is refused; once granted, the gate goes in the same step.
_SQL_TRY_HOLDING_GATE = """
SELECT CASE WHEN pg_try_advisory_lock(%(key)s::bigint)
            THEN pg_advisory_unlock(%(gate)s::bigint) END"""
_SQL_DROP_GATE = "SELECT pg_advisory_unlock(%(gate)s::bigint)"
_SQL_UNLOCK = {
    "read": "SELECT pg_advisory_unlock_shared(%s::bigint)",
    "exclusive": "SELECT pg_advisory_unlock(%s::bigint)",
}
_SQL_SESSION_SETUP = (
    "SELECT set_config('tcp_keepalives_idle', '10', false),"
    " set_config('tcp_keepalives_interval', '5', false),"
    " set_config('tcp_keepalives_count', '3', false)"
)
_SQL_NO_IDLE_TIMEOUT = "SELECT set_config('idle_session_timeout', '0', false)"  # PostgreSQL >= 14
# A bigint advisory key shows in pg_locks as classid = high 32 bits, objid = low 32 bits,
# objsubid = 1, in the database of the session that took it. The gate is listed only when held
# exclusively (by a waiting rebuild); requests passing through hold it shared for an instant.
_SQL_HOLDERS = """
SELECT l.classid::int8 = %(gate_hi)s AND l.objid::int8 = %(gate_lo)s AS is_gate,
       l.mode,
       a.pid,
       a.application_name,
       extract(epoch FROM coalesce(a.state_change, a.backend_start))::float8,
       extract(epoch FROM a.backend_start)::float8,
       host(a.client_addr)
  FROM pg_locks l
  JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory'
   AND l.granted
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.objsubid = 1
   AND ((l.classid::int8 = %(key_hi)s AND l.objid::int8 = %(key_lo)s)
        OR (l.classid::int8 = %(gate_hi)s AND l.objid::int8 = %(gate_lo)s
            AND l.mode = 'ExclusiveLock'))
 ORDER BY 5, a.pid
"""


def advisory_key(name: str) -> int:
    """The signed 64-bit advisory-lock key of a lease name (stable across hosts and versions)."""
    digest = hashlib.sha256(f"aml_pipeline.lease:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _ascii(text: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text)


def application_name(
    mode: str, holder: str, pid: int, host: str, wait: float | None = None
) -> str:
    """``aml-lease:<r|x>[wait]:<pid>@<host>:<holder>``, at most 63 ASCII bytes."""
    head = f"{APP_PREFIX}{_MODE_LETTER[mode]}{f'{wait:g}' if wait else ''}:{pid}@{short_host(host)}:"
    name = _ascii(holder)
    room = _APP_MAX_BYTES - len(head)
    if len(name) > room:
        name = name[: room - 3] + "..."
    return head + name


def parse_application_name(app: str | None) -> tuple[str, int | None, str | None] | None:
    """``(holder, pid, host)`` from an application_name made by :func:`application_name`."""
    if not app or not app.startswith(APP_PREFIX):
        return None
    parts = app[len(APP_PREFIX) :].split(":", 2)
    if len(parts) != 3:
        return None
    _mode, who, holder = parts
    pid_s, _, host = who.partition("@")
    try:
        pid = int(pid_s)
    except ValueError:
        pid = None
    return holder, pid, host or None


def application_wait(app: str | None) -> float | None:
    """The wait in seconds a waiting rebuild put in its application_name (None if absent)."""
    if not app or not app.startswith(APP_PREFIX):
        return None
    mode = app[len(APP_PREFIX) :].split(":", 1)[0]
    try:
        return float(mode[1:]) if len(mode) > 1 else None
    except ValueError:
        return None


class _PgHandle(LeaseHandle):
    def __init__(self, lease: PgLease, mode: str, holder: str, conn: psycopg.Connection) -> None:
        super().__init__(holder=holder, mode=mode, location=lease.location, name=lease.name)
        self._conn = conn
        self._key = lease.key
        self.backend_pid = conn.info.backend_pid

    def info(self) -> HolderInfo:
        base = super().info()
        return HolderInfo(
            base.holder, base.mode, base.pid, base.host, base.since, backend_pid=self.backend_pid
        )

    def is_held(self) -> bool:
        """Whether the lease session is still there (a server restart or a terminated backend
        ends it, and its lock). Runs no query, so the holder's ``since`` in status stays put."""
        if self._released or self._conn.closed:
            return False
        pgconn = self._conn.pgconn
        try:
            # An idle session gets unsolicited bytes only for a notice or its termination
            # (FATAL message, then EOF): consume what is there and see whether it survived.
            for _ in range(8):
                readable, _, _ = select.select([pgconn.socket], [], [], 0)
                if not readable or pgconn.status != psycopg.pq.ConnStatus.OK:
                    break
                pgconn.consume_input()
        except (OSError, ValueError, psycopg.Error):
            return False
        return pgconn.status == psycopg.pq.ConnStatus.OK

    def _release(self) -> None:
        conn = self._conn
        try:
            # Unlock explicitly: closing alone would let the server drop the lock a moment
            # *after* close() returns, and a request made right after could be refused.
            conn.execute(_SQL_UNLOCK[self.mode], (self._key,))
        except psycopg.Error:
            pass  # the session is broken or gone: so is its lock
        finally:
            conn.close()

    def _drop_inherited(self) -> None:
        self._released = True
        _detach_socket(self._conn)


def _detach_socket(conn: psycopg.Connection) -> None:
    """In a forked child, which shares the parent's socket: point the child's descriptor at
    /dev/null. The child then neither keeps the session alive after the parent dies nor ends it
    (libpq's goodbye message goes nowhere)."""
    try:
        sock = conn.pgconn.socket
    except Exception:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(devnull, sock, inheritable=False)
    finally:
        os.close(devnull)


def _key_parts(key: int) -> tuple[int, int]:
    """(classid, objid) under which pg_locks shows a bigint advisory key."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


class _PgAttempt(_Attempt):
    def __init__(self, lease: PgLease, mode: str, holder: str, wait: float) -> None:
        super().__init__(mode, holder, wait)
        self.lease = lease
        self.keys = {"key": lease.key, "gate": lease.gate_key}
        self.gate_held = False
        app = application_name(mode, holder, os.getpid(), hostname(), wait if self.waits else None)
        self.conn: psycopg.Connection | None = lease._connect(app)
        try:
            self.conn.execute(_SQL_SESSION_SETUP)
            if self.conn.info.server_version >= 140000:
                self.conn.execute(_SQL_NO_IDLE_TIMEOUT)
        except psycopg.Error as exc:
            self.abandon()
            raise lease._error("cannot set up the lease session", exc) from exc

    def _query(self, sql: str) -> object:
        assert self.conn is not None
        try:
            row = self.conn.execute(sql, self.keys).fetchone()
        except psycopg.Error as exc:
            raise self.lease._error("advisory lock request failed", exc) from exc
        return row[0] if row else None

    def try_acquire(self) -> LeaseHandle | None:
        if not self.waits:
            outcome = self._query(_SQL_PASS[self.mode])
            if outcome != "granted":
                self.refused_by = "gate" if outcome == "gate" else "lock"
                return None
            return self._grant()
        if not self.gate_held:
            if not retry_briefly(lambda: bool(self._query(_SQL_TAKE_GATE))):
                self.refused_by = "gate"  # another rebuild waits
                return None
            self.gate_held = True
        if self._query(_SQL_TRY_HOLDING_GATE) is None:
            self.refused_by = "lock"
            return None
        self.gate_held = False  # dropped by the same statement
        return self._grant()

    def _grant(self) -> LeaseHandle:
        conn, self.conn = self.conn, None
        assert conn is not None
        try:
            return _PgHandle(self.lease, self.mode, self.holder, conn)
        except BaseException:
            conn.close()
            raise

    def busy_status(self) -> LeaseStatus:
        assert self.conn is not None
        return self.lease._status_on(self.conn)

    def withdraw(self) -> None:
        if self.gate_held and self.conn is not None:
            self.gate_held = False
            try:
                # Explicitly, as in _PgHandle._release: closing alone drops it a moment later.
                self.conn.execute(_SQL_DROP_GATE, self.keys)
            except psycopg.Error:
                pass  # the session is broken or gone: so is its gate

    def abandon(self) -> None:
        try:
            self.withdraw()
        finally:
            conn, self.conn = self.conn, None
            if conn is not None:
                conn.close()

    def _drop_inherited(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            _detach_socket(conn)


class PgLease(EnvLease):
    """Lease shared by several hosts through one PostgreSQL database."""

    backend = "postgres"

    def __init__(
        self, url: str, *, name: str = DEFAULT_LEASE_NAME, connect_timeout_s: int = 10
    ) -> None:
        super().__init__(location=redact_url(url), name=name)
        self.key = advisory_key(self.name)
        self.gate_key = advisory_key(f"{self.name}:pending")
        self.connect_timeout_s = int(connect_timeout_s)
        try:
            conninfo_to_dict(url)
        except psycopg.Error as exc:
            raise LeaseError(f"invalid lease database URL {self.location}: {exc}") from None
        self._pg = PgConnection(
            url,
            defaults={
                "connect_timeout": self.connect_timeout_s,
                # A vanished holder's host is noticed by TCP keepalive (module docstring).
                "keepalives": 1,
                "keepalives_idle": 10,
                "keepalives_interval": 5,
                "keepalives_count": 3,
            },
        )

    def _begin(self, mode: str, holder: str, wait: float) -> _Attempt:
        return _PgAttempt(self, mode, holder, wait)

    def _error(self, what: str, exc: BaseException) -> LeaseError:
        return LeaseError(f"{what} on {self.location}: {self._pg.scrub(exc)}")

    def _connect(self, app_name: str) -> psycopg.Connection:
        """A session of its own (the lease *is* the session); its name says who holds it."""
        try:
            return self._pg.open(application_name=app_name)
        except PgConnectError as exc:
            raise self._error("cannot connect to the lease database", exc) from None

    def status(self) -> LeaseStatus:
        conn = self._connect(f"{APP_PREFIX}status")
        try:
            return self._status_on(conn)
        finally:
            conn.close()

    def _status_on(self, conn: psycopg.Connection) -> LeaseStatus:
        (key_hi, key_lo), (gate_hi, gate_lo) = _key_parts(self.key), _key_parts(self.gate_key)
        params = {"key_hi": key_hi, "key_lo": key_lo, "gate_hi": gate_hi, "gate_lo": gate_lo}
        try:
            rows = conn.execute(_SQL_HOLDERS, params).fetchall()
        except psycopg.Error as exc:
            raise self._error("cannot read lease holders", exc) from exc
        readers: list[HolderInfo] = []
        exclusive: list[HolderInfo] = []
        waiting: list[HolderInfo] = []
        for is_gate, lock_mode, backend_pid, app, since, started, client_addr in rows:
            parsed = parse_application_name(app)
            if parsed is None:
                holder, pid, host = f"<session of backend pid {backend_pid}>", None, client_addr
            else:
                holder, pid, host = parsed
            if is_gate:
                wait = application_wait(app)
                deadline = started + wait if started is not None and wait is not None else None
                waiting.append(
                    HolderInfo(holder, "exclusive", pid, host, started, backend_pid, deadline)
                )
                continue
            mode = "exclusive" if lock_mode == "ExclusiveLock" else "read"
            info = HolderInfo(holder, mode, pid, host, since, backend_pid=backend_pid)
            (exclusive if mode == "exclusive" else readers).append(info)
        return LeaseStatus(
            location=self.location,
            name=self.name,
            backend=self.backend,
            reader_leases=tuple(readers),
            exclusive=exclusive[0] if exclusive else None,
            waiting=min(waiting, key=lambda w: w.since or 0.0) if waiting else None,
        )
