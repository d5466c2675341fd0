"""A throwaway OPC UA server with raw history for the tests and the benchmark: asyncua's own
``Server`` with its SQL history backend (``HistorySQLite``), on a free port of 127.0.0.1, in a
process of its own.

A test writes the history first (:func:`write_history`: the plant's points per node, in
``HistorySQLite``'s own tables in ``DIR/history.sqlite``), then :func:`start_server` starts
``python -m aml_pipeline_tests.opcua_server serve DIR``, which exposes each node as a variable
``ns=2;s=<path>`` (namespace ``urn:aml-pipeline:test-plant``) under ``Objects`` (a dotted path
``Reactor.TI101`` is the browse path ``/Objects/2:Reactor/2:TI101``) and answers HistoryRead
from that file. History written while the server runs is read by the next HistoryRead. By hand::

    python -m aml_pipeline_tests.opcua_server start DIR    # prints opc.tcp://127.0.0.1:PORT
    python -m aml_pipeline_tests.opcua_server stop DIR

Reads follow OPC UA Part 11 where asyncua's stock ``HistorySQLite`` does not: values are ordered
by SourceTimestamp (ties in the order they were written), a read returns at most
``numValuesPerNode`` values and at most the server's own limit (``max_values``), and whenever
values remain it returns an opaque continuation point that resumes exactly after the last value
returned (asyncua's resumes at a timestamp, repeating the values of that timestamp already
sent, and ignores ``numValuesPerNode`` below its limit); released points are forgotten.
``DIR/stats.json`` counts what the server was asked (reads, continuation points issued,
released and still open, writes, subscriptions), for the tests to check what a client did.

``stop`` ends the process (its pid is in ``DIR/aml-opcua-server.json``) and deletes DIR; a test
that stops the server mid-read keeps DIR and starts it again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline_tests.pg_server import end_process, free_port, reap_orphans

STATE_FILE = "aml-opcua-server.json"
CONFIG_FILE = "server.json"
HISTORY_FILE = "history.sqlite"
STATS_FILE = "stats.json"
TMP_PREFIX = "aml-opcua-"
NAMESPACE_URI = "urn:aml-pipeline:test-plant"
# Values one HistoryRead returns per node at most (a server's own limit), unless start_server says.
MAX_VALUES = 10_000

# OPC UA StatusCodes the tests give the plant's states (severity Good, Uncertain, Bad).
GOOD = 0x00000000
UNCERTAIN_SENSOR_NOT_ACCURATE = 0x40930000
BAD_SENSOR_FAILURE = 0x808B0000
STATUS_OF_STATE = np.array([GOOD, UNCERTAIN_SENSOR_NOT_ACCURATE, BAD_SENSOR_FAILURE], dtype=np.int64)

_TS_FORMAT = "%Y-%m-%d %H:%M:%S.%f"  # what HistorySQLite's TIMESTAMP columns hold (UTC)


class OpcUaServerError(RuntimeError):
    pass


# ---- the history file (written by the tests, read by the server) ---------------------------------


def table_name(path: str, namespace_index: int = 2) -> str:
    """The table ``HistorySQLite`` keeps a node's history in (``<ns>_<repr of identifier>``)."""
    return f"{namespace_index}_{path!r}"


def _ts_text(ms: np.ndarray) -> list[str]:
    """Epoch milliseconds (or finer, as datetime64) as HistorySQLite's timestamp text."""
    stamps = np.asarray(ms).astype("datetime64[ms]") if np.asarray(ms).dtype.kind in "iu" else np.asarray(ms)
    return [str(s).replace("T", " ") for s in np.datetime_as_string(stamps.astype("datetime64[us]"), unit="us")]


def write_history(base: Path | str, path: str, ts: np.ndarray, value: np.ndarray, status: np.ndarray) -> int:
    """Append one node's values to its history (and the node to the address space the server
    builds when it starts). ``ts``: int64 epoch ms, or datetime64 for finer times; ``status``:
    OPC UA StatusCodes. Rows are stored in the order given (ties keep it)."""
    from asyncua import ua
    from asyncua.ua.ua_binary import variant_to_binary

    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    config = _read_config(base)
    if path not in config["nodes"]:
        config["nodes"].append(path)
        _write_config(base, config)
    table = table_name(path)
    stamps = _ts_text(ts)
    rows = [
        (t, t, int(s), repr(float(v)), "Double", sqlite3.Binary(variant_to_binary(ua.Variant(float(v), ua.VariantType.Double))))
        for t, v, s in zip(stamps, np.asarray(value, dtype=np.float64).tolist(), np.asarray(status).tolist())
    ]
    with contextlib.closing(sqlite3.connect(base / HISTORY_FILE)) as con, con:
        # HistorySQLite's own table, with an index for reads by time.
        con.execute(f'CREATE TABLE IF NOT EXISTS "{table}" (_Id INTEGER PRIMARY KEY NOT NULL, ServerTimestamp TIMESTAMP, '
                    "SourceTimestamp TIMESTAMP, StatusCode INTEGER, Value TEXT, VariantType TEXT, VariantBinary BLOB)")
        con.execute(f'CREATE INDEX IF NOT EXISTS "{table}_time" ON "{table}" (SourceTimestamp, _Id)')
        con.executemany(f'INSERT INTO "{table}" VALUES (NULL, ?, ?, ?, ?, ?, ?)', rows)
    return len(rows)


def set_engineering(base: Path | str, path: str, *, unit: str | None = None,
                    eu_range: tuple[float, float] | None = None) -> None:
    """Give a node (of :func:`write_history`) the AnalogItem properties a historian exposes:
    ``EngineeringUnits`` (an EUInformation whose display name is ``unit``) and ``EURange``; the
    server adds them when it starts."""
    base = Path(base)
    config = _read_config(base)
    config.setdefault("engineering", {})[path] = {"unit": unit, "range": None if eu_range is None else list(eu_range)}
    _write_config(base, config)


def history_sql(base: Path | str, sql: str, params: Sequence[Any] = ()) -> int:
    """Run one statement on the history file (a test correcting or deleting a value); rows changed."""
    with contextlib.closing(sqlite3.connect(Path(base) / HISTORY_FILE)) as con, con:
        return con.execute(sql, params).rowcount


def ts_text(ms: int) -> str:
    """The stored text of a time in epoch ms (for :func:`history_sql`)."""
    return _ts_text(np.array([ms], dtype=np.int64))[0]


def _read_config(base: Path) -> dict[str, Any]:
    path = base / CONFIG_FILE
    if path.exists():
        return json.loads(path.read_text())
    return {"nodes": [], "port": None, "max_values": MAX_VALUES, "users": None, "security": None}


def _write_config(base: Path, config: dict[str, Any]) -> None:
    (base / CONFIG_FILE).write_text(json.dumps(config, indent=1))


def read_stats(base: Path | str) -> dict[str, int]:
    path = Path(base) / STATS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


# ---- the server process ---------------------------------------------------------------------------


@dataclass
class _Open:
    """Where a read resumes: after row ``(ts, row_id)`` of ``table`` within ``lo .. hi`` (``hi``
    itself excluded when ``hi_open``), backward when ``reverse``."""

    table: str
    lo: str
    hi: str
    hi_open: bool
    reverse: bool
    per_read: int  # numValuesPerNode: values per read at most (0: the server's limit alone)
    ts: str = ""
    row_id: int = -1


@dataclass
class _Stats:
    reads: int = 0
    values: int = 0
    continuation_points: int = 0
    released: int = 0
    open: int = 0
    writes: int = 0
    history_updates: int = 0
    subscriptions: int = 0


def _history_manager_class() -> type:
    """The server's history manager (a class made on demand: the module loads without asyncua)."""
    import datetime as dt

    from asyncua import ua
    from asyncua.common.utils import Buffer
    from asyncua.server.history import HistoryManager
    from asyncua.ua.ua_binary import variant_from_binary

    win_epoch = ua.get_win_epoch()
    latest = "9999-12-31 23:59:59.999999"

    def text(moment: dt.datetime) -> str:
        if moment.tzinfo is not None:
            moment = moment.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return moment.strftime(_TS_FORMAT)

    def status(code: int) -> Any:
        return ua.StatusCode(code)

    class PlantHistory(HistoryManager):
        """Raw history from HistorySQLite's tables, read as Part 11 says (see the module doc)."""

        def __init__(self, iserver: Any, db_path: Path, max_values: int, stats_path: Path) -> None:
            super().__init__(iserver)
            self.db_path, self.max_values, self.stats_path = db_path, max_values, stats_path
            self.open: dict[bytes, _Open] = {}
            self.stats = _Stats()
            self._db: sqlite3.Connection | None = None

        async def init(self) -> None:
            # PARSE_DECLTYPES: HistorySQLite's TIMESTAMP columns come back as datetimes.
            self._db = sqlite3.connect(self.db_path, detect_types=sqlite3.PARSE_DECLTYPES, check_same_thread=False)

        async def stop(self) -> None:
            if self._db is not None:
                self._db.close()

        def save_stats(self) -> None:
            self.stats.open = len(self.open)
            self.stats.subscriptions = len(self.iserver.subscription_service.subscriptions)
            tmp = self.stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.stats.__dict__))
            os.replace(tmp, self.stats_path)

        async def read_history(self, params: Any) -> list[Any]:
            self.stats.reads += 1
            out = []
            for rv in params.NodesToRead:
                if params.ReleaseContinuationPoints:
                    if self.open.pop(bytes(rv.ContinuationPoint or b""), None) is not None:
                        self.stats.released += 1
                    out.append(ua.HistoryReadResult())
                else:
                    out.append(self._read_raw(params.HistoryReadDetails, rv, params.TimestampsToReturn))
            self.save_stats()
            return out

        def _start(self, details: Any, rv: Any) -> _Open | int:
            """Where a new read starts, or the StatusCode refusing it."""
            if not isinstance(details, ua.ReadRawModifiedDetails) or details.IsReadModified:
                return ua.StatusCodes.BadHistoryOperationUnsupported
            nid = rv.NodeId
            if not isinstance(nid.Identifier, str):
                return ua.StatusCodes.BadNodeIdUnknown
            table = table_name(nid.Identifier, nid.NamespaceIndex)
            if not self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [table]).fetchone():
                return ua.StatusCodes.BadNodeIdUnknown
            start, end, n = details.StartTime, details.EndTime, int(details.NumValuesPerNode)
            has_start = start is not None and start > win_epoch
            has_end = end is not None and end > win_epoch
            if has_start + has_end + (n > 0) < 2:
                return ua.StatusCodes.BadInvalidArgument
            if has_start and has_end:  # [start, end), or backward from start down to end
                reverse = end < start
                if reverse:
                    return _Open(table, text(end), text(start), False, True, n)
                return _Open(table, text(start), text(end), True, False, n)
            if has_start:  # n values from start on
                return _Open(table, text(start), latest, False, False, n)
            return _Open(table, text(win_epoch), text(end), False, True, n)  # n values back from end

        def _read_raw(self, details: Any, rv: Any, stamps: Any) -> Any:
            result = ua.HistoryReadResult()
            if rv.ContinuationPoint:
                state = self.open.pop(bytes(rv.ContinuationPoint), None)
                if state is None:
                    result.StatusCode = status(ua.StatusCodes.BadContinuationPointInvalid)
                    return result
            else:
                state = self._start(details, rv)
                if isinstance(state, int):
                    result.StatusCode = status(state)
                    return result
            page = min(self.max_values, state.per_read) if state.per_read else self.max_values
            rows = self._rows(state, page + 1)
            more = len(rows) > page
            rows = rows[:page]
            result.HistoryData = ua.HistoryData()
            server_too = stamps in (ua.TimestampsToReturn.Server, ua.TimestampsToReturn.Both)
            result.HistoryData.DataValues = [
                ua.DataValue(variant_from_binary(Buffer(blob)), status(code), when, when if server_too else None)
                for _, when, code, blob in rows
            ]
            self.stats.values += len(rows)
            if more:  # values remain: resume exactly after the last one returned
                state.ts, state.row_id = rows[-1][1].strftime(_TS_FORMAT), rows[-1][0]
                cp = secrets.token_bytes(16)
                self.open[cp] = state
                self.stats.continuation_points += 1
                result.ContinuationPoint = cp
            return result

        def _rows(self, state: _Open, limit: int) -> list[tuple]:
            order, after_cmp = ("DESC", "<") if state.reverse else ("ASC", ">")
            params: list[Any] = [state.lo, state.hi]
            after = ""
            if state.row_id >= 0:  # strictly after the last row returned, in (time, row) order
                after = f" AND (SourceTimestamp {after_cmp} ? OR (SourceTimestamp = ? AND _Id {after_cmp} ?))"
                params += [state.ts, state.ts, state.row_id]
            params.append(limit)
            return self._db.execute(
                f'SELECT _Id, SourceTimestamp, StatusCode, VariantBinary FROM "{state.table}" '
                f"WHERE SourceTimestamp >= ? AND SourceTimestamp {'<' if state.hi_open else '<='} ?{after} "
                f"ORDER BY SourceTimestamp {order}, _Id {order} LIMIT ?", params).fetchall()

        def update_history(self, params: Any) -> list[Any]:
            self.stats.history_updates += 1
            self.save_stats()
            return super().update_history(params)

    return PlantHistory


async def _serve(base: Path) -> None:
    from asyncua import Server, ua
    from asyncua.crypto.permission_rules import User, UserRole
    from asyncua.server.user_managers import UserManager

    config = _read_config(base)
    users = config.get("users")

    class Passwords(UserManager):
        def get_user(self, iserver, username=None, password=None, certificate=None):
            if users is None:
                return User(role=UserRole.User)
            if username in users and secrets.compare_digest(str(users[username]), str(password or "")):
                return User(role=UserRole.User)
            return None

    server = Server(user_manager=Passwords())
    manager = _history_manager_class()(server.iserver, base / HISTORY_FILE, int(config["max_values"]), base / STATS_FILE)
    server.iserver.history_manager = manager
    await server.init()
    server.set_endpoint(f"opc.tcp://127.0.0.1:{config['port']}")
    server.set_server_name("aml_pipeline test historian")
    security = config.get("security")
    if security:
        server.set_security_policy([getattr(ua.SecurityPolicyType, security["policy"])])
        await server.load_certificate(security["certificate"])
        await server.load_private_key(security["private_key"])
    else:
        server.set_security_policy([ua.SecurityPolicyType.NoSecurity])
    if users is not None:
        server.set_identity_tokens([ua.UserNameIdentityToken])
    idx = await server.register_namespace(NAMESPACE_URI)
    assert idx == 2, idx
    folders: dict[str, Any] = {}
    for path in config["nodes"]:
        parent = server.nodes.objects
        parts = path.split(".")
        for k in range(1, len(parts)):
            key = ".".join(parts[:k])
            if key not in folders:
                folders[key] = await parent.add_folder(ua.NodeId(f"{key}/", idx), ua.QualifiedName(parts[k - 1], idx))
            parent = folders[key]
        var = await parent.add_variable(ua.NodeId(path, idx), ua.QualifiedName(parts[-1], idx), 0.0)
        await var.write_attribute(ua.AttributeIds.Historizing, ua.DataValue(ua.Variant(True, ua.VariantType.Boolean)))
        level = ua.AccessLevel.CurrentRead.mask | ua.AccessLevel.HistoryRead.mask
        await var.write_attribute(ua.AttributeIds.AccessLevel, ua.DataValue(ua.Variant(level, ua.VariantType.Byte)))
        await var.write_attribute(ua.AttributeIds.UserAccessLevel, ua.DataValue(ua.Variant(level, ua.VariantType.Byte)))
        engineering = (config.get("engineering") or {}).get(path) or {}
        if engineering.get("unit") is not None:
            eu = ua.EUInformation(NamespaceUri="http://www.opcfoundation.org/UA/units/un/cefact", UnitId=-1,
                                  DisplayName=ua.LocalizedText(engineering["unit"]),
                                  Description=ua.LocalizedText(engineering["unit"]))
            await var.add_property(ua.NodeId(f"{path}.EngineeringUnits", idx), ua.QualifiedName("EngineeringUnits", 0), eu)
        if engineering.get("range") is not None:
            low, high = engineering["range"]
            await var.add_property(ua.NodeId(f"{path}.EURange", idx), ua.QualifiedName("EURange", 0),
                                   ua.Range(Low=float(low), High=float(high)))

    async def count_write(event: Any, dispatcher: Any) -> None:
        if event.is_external:  # a client's Write (the server's own start-up writes are not)
            manager.stats.writes += 1
            manager.save_stats()

    from asyncua.common.callback import CallbackType

    server.iserver.subscribe_server_callback(CallbackType.PreWrite, count_write)
    manager.save_stats()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        (base / "ready").write_text("ready")
        await stop.wait()


# ---- starting and stopping ----------------------------------------------------------------------


@dataclass(frozen=True)
class OpcUaServer:
    base: Path
    url: str
    pid: int

    def stop(self, *, remove: bool = True) -> None:
        stop_server(self.base, remove=remove)

    def start(self) -> OpcUaServer:
        """Start the server again on its port, with its history (after ``stop(remove=False)``)."""
        return start_server(self.base)

    def stats(self) -> dict[str, int]:
        return read_stats(self.base)


def _listening(port: int) -> bool:
    with contextlib.closing(socket.socket()) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_server(base: Path | str | None = None, *, max_values: int | None = None, users: dict[str, str] | None = None,
                 security: dict[str, str] | None = None, owner_pid: int | None = None,
                 timeout_s: float = 120.0) -> OpcUaServer:
    """Start the server on the history in ``base`` (a new empty one if None). The first start
    picks a free port and keeps it in ``base``'s config, so a restart listens where clients
    connect. ``max_values``: values per node a HistoryRead returns at most; ``users``: names and
    passwords (anonymous refused); ``security``: ``{policy, certificate, private_key}`` (the only
    policy offered)."""
    if base is None:
        reap_stale_servers()
        base_path = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
    else:
        base_path = Path(base).absolute()
        base_path.mkdir(parents=True, exist_ok=True)
    config = _read_config(base_path)
    if config["port"] is None:
        config["port"] = free_port()
    if max_values is not None:
        config["max_values"] = int(max_values)
    if users is not None:
        config["users"] = users
    if security is not None:
        config["security"] = security
    _write_config(base_path, config)
    if not (base_path / HISTORY_FILE).exists():
        sqlite3.connect(base_path / HISTORY_FILE).close()
    with contextlib.suppress(FileNotFoundError):
        (base_path / "ready").unlink()
    log = open(base_path / "server.log", "ab")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "aml_pipeline_tests.opcua_server", "serve", str(base_path)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()
    url = f"opc.tcp://127.0.0.1:{config['port']}"
    (base_path / STATE_FILE).write_text(json.dumps({"pid": proc.pid, "url": url, "owner_pid": owner_pid}))
    deadline = time.monotonic() + timeout_s
    while not ((base_path / "ready").exists() and _listening(config["port"])):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (base_path / "server.log").read_text(errors="replace")[-3000:]
            stop_server(base_path, remove=base is None)
            raise OpcUaServerError(f"the OPC UA server did not start (exit {proc.poll()}):\n{tail}")
        time.sleep(0.05)
    return OpcUaServer(base_path, url, proc.pid)


def stop_server(base: Path | str, *, remove: bool = True, kill: bool = False) -> None:
    """End the server started in ``base`` (SIGTERM, or SIGKILL with ``kill``; SIGKILL after 20 s)
    and delete ``base`` unless ``remove`` is false."""
    base_path = Path(base).absolute()
    state_path = base_path / STATE_FILE
    if not state_path.exists():
        raise OpcUaServerError(f"{base_path} holds no server started by aml_pipeline_tests.opcua_server")
    pid = json.loads(state_path.read_text()).get("pid")
    if isinstance(pid, int):
        end_process(pid, kill=kill)
    if remove:
        import shutil

        shutil.rmtree(base_path, ignore_errors=True)


def reap_stale_servers(root: Path | None = None) -> list[Path]:
    """Stop and delete servers whose test run died before stopping them."""
    return reap_orphans(root or Path(tempfile.gettempdir()), TMP_PREFIX, STATE_FILE, stop_server,
                        (OpcUaServerError, OSError))


@contextlib.contextmanager
def running(base: Path | str | None = None, **kw: Any) -> Iterator[OpcUaServer]:
    """A server for the ``with`` block, stopped (and its directory deleted) after it."""
    server = start_server(base, owner_pid=os.getpid(), **kw)
    try:
        yield server
    finally:
        with contextlib.suppress(OpcUaServerError):
            server.stop()


def write_points(base: Path | str, paths: dict[str, str], node_id: np.ndarray, ts: np.ndarray, value: np.ndarray,
                 state: np.ndarray, status_of_state: np.ndarray = STATUS_OF_STATE) -> None:
    """A plant's points (columns in file order) as history: node ``n``'s points under
    ``paths[n]``, the plant's states as StatusCodes (``status_of_state[state]``)."""
    node_id = np.asarray(node_id).astype(str)
    for node, path in paths.items():
        sel = np.flatnonzero(node_id == node)
        write_history(base, path, ts[sel], value[sel], status_of_state[state[sel]])


SERVER_URI = "urn:freeopcua:python:server"  # asyncua's server application URI


def make_certificate(directory: Path | str, name: str, app_uri: str, *, server: bool = False) -> tuple[Path, Path]:
    """A self-signed application certificate (DER) and its key (PEM) in ``directory``, for
    ``app_uri`` on this host (as OPC UA applications carry them); the two paths."""
    from asyncua.crypto.cert_gen import setup_self_signed_certificate
    from cryptography.x509.oid import ExtendedKeyUsageOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.der", directory / f"{name}-key.pem"
    use = [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
    asyncio.run(setup_self_signed_certificate(key, cert, app_uri, socket.gethostname(), use, {"organizationName": "aml"}))
    return cert, key


def main(argv: Iterable[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in ("start", "stop", "serve"):
        print("usage: python -m aml_pipeline_tests.opcua_server start|stop DIR", file=sys.stderr)
        return 2
    try:
        if args[0] == "serve":
            asyncio.run(_serve(Path(args[1])))
        elif args[0] == "start":
            print(start_server(args[1]).url)
        else:
            stop_server(args[1])
    except OpcUaServerError as exc:
        print(f"opcua_server {args[0]}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
