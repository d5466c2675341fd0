"""The embedded default TSDB: one DuckDB file, shared by many read-only processes.

URL
    ``duckdb:///abs/path/file.duckdb`` names an absolute path; extra leading slashes are
    collapsed, so ``duckdb:////abs/path`` (what ``f"duckdb:///{abs_path}"`` produces) is the
    same file. A path that starts with ``./`` or ``../`` after the third slash
    (``duckdb:///./x.duckdb``), or that has no third slash (``duckdb://x.duckdb``), is relative
    to the current working directory.

Schema (version :data:`SCHEMA_VERSION`, recorded in ``schema_version``)
    ``runs(run_id PK, run_key, line_id, product_id, recipe_id, recipe_version, recipe_content_hash,
    started_at, ended_at, evidence_source, context_confirmed)``,
    ``run_state(run_key PK, data_version, point_count)`` (version 2: maintained by every ingest,
    see :mod:`aml_pipeline.tsdb.versions`),
    ``nodes(node_id PK, node_key, unit, range_lo, range_hi)``,
    ``points(run_key, node_key, ts, value, state, seq)`` and the view
    ``points_by_id(run_id, node_id, ts, value, state, seq)`` for people querying the file.
    A version-1 file is migrated in place, in one transaction, by the first read-write open;
    read-only handles read it as it is (their :meth:`DuckDBTsdb.run_versions` then counts the
    run's points, and gives what the migration will store).

    Points carry small integer surrogate keys instead of the run/node id strings: DuckDB's zone
    maps keep only an 8-byte prefix of string min/max, so plant ids that share a prefix
    (``BATCH-2024-...``) would defeat row-group pruning. Integer keys prune exactly. Keys are
    assigned once, on first insert, and never change. Every ingest sorts its points by
    ``(run_key, node_key, ts, seq)`` before the insert, so one series occupies few, contiguous
    row groups.

Concurrency
    DuckDB locks the file: many read-only processes or one read-write one. A writer first takes
    its place in the queue (:mod:`aml_pipeline.tsdb.writer_intent`), then waits for the readers
    to close; new readers wait while a writer waits or writes. Either side gives up after
    ``lock_timeout_s`` with :class:`TsdbBusyError`. Readers should therefore hold a handle for
    a chunk of work, not a whole build (:class:`~aml_pipeline.tsdb.session.TsdbSession`);
    opening and closing one is cheap (``bench/tsdb_bench.py`` measures it): read-only handles
    ATTACH the file to one in-memory DuckDB instance per process instead of starting a database
    each time.
    Within one process a file is either written or read, never both at once; mixing is
    reported at once (retrying cannot help).

Memory
    The readers' DuckDB instance gets ``memory_limit`` = 1/:data:`READER_MEMORY_SHARE` of the
    build's budget (``AML_MEMORY_MB``, :func:`aml_pipeline.config.memory_budget_mb`), at least
    :data:`READER_MEMORY_MIN_MB`, read once when the instance starts. A page needs little (it is
    read in bounded time windows, see :meth:`DuckDBTsdb._read`; results are materialised
    outside the limit); the rest of the budget is the build's. Without a limit DuckDB caches
    every block it reads, up to its default limit of 80 % of RAM. A query that does not fit
    fails with ``TSDB_OUT_OF_MEMORY`` naming the budget; nothing retries with more memory.

``seq`` is a global ingestion sequence: the points of one ingest get ``max(seq) + 1 + row
index`` in the order they were given (file row order), counting only the points written.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from aml_pipeline.config import memory_budget_mb
from aml_pipeline.errors import (
    IngestError,
    TsdbBusyError,
    TsdbError,
    TsdbReaderBusyError,
    UnknownNodeError,
    UnknownRunError,
    disk_full,
)
from aml_pipeline.faults import crash_point
from aml_pipeline.tsdb.columns import (
    check_schema_version,
    clamp_i64,
    nodes_table,
    opt_float,
    prepare_points,
    run_from_row,
    runs_table,
    sorted_by_ts_seq,
)
from aml_pipeline.tsdb.port import (
    DEFAULT_LOCK_TIMEOUT_S,
    Cursor,
    Node,
    PointColumns,
    Run,
    RunScope,
    ordered_by_ts_seq,
)
from aml_pipeline.tsdb.reading import ReadBase, Rows
from aml_pipeline.tsdb.versions import migrated_version
from aml_pipeline.tsdb.writer import PointRows, RunState, StoredRun, write_ingest
from aml_pipeline.tsdb.writer_intent import (
    drop_writer_intent,
    hold_writer_intent,
    intent_path,
    pass_reader_gate,
    writer_handles_here,
)

SCHEMA_VERSION = 2
URL_PREFIX = "duckdb://"
# The code of a URL whose path holds something other than a DuckDB database (tsdb_open adds what
# to do when that something is a source description).
NOT_A_DATABASE = "TSDB_NOT_A_DATABASE"
READER_MEMORY_SHARE = 32
READER_MEMORY_MIN_MB = 16
# Points one page query reads at most (more if the page limit is larger); see DuckDBTsdb._read.
_WINDOW_ROWS = 65_536
_SERIES = "run_key = ? AND node_key = ?"
# Rows per Arrow batch of a prefetch: one batch for most reads, so its columns are taken without a copy.
_ARROW_BATCH_ROWS = 1 << 22

# Version 1: every table but run_state. Kept as it was: a fresh file is created at version 1 and
# migrated, the same path every version-1 file takes.
_DDL_V1 = (
    """CREATE TABLE IF NOT EXISTS schema_version (
        version INTEGER NOT NULL,
        applied_at_ms BIGINT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS runs (
        run_id VARCHAR PRIMARY KEY,
        run_key INTEGER NOT NULL UNIQUE,
        line_id VARCHAR NOT NULL,
        product_id VARCHAR NOT NULL,
        recipe_id VARCHAR NOT NULL,
        recipe_version INTEGER,
        recipe_content_hash VARCHAR,
        started_at BIGINT NOT NULL,
        ended_at BIGINT,
        evidence_source VARCHAR NOT NULL
            CHECK (evidence_source IN ('simulation', 'real', 'unassessed')),
        context_confirmed BOOLEAN NOT NULL DEFAULT FALSE,
        CHECK (ended_at IS NULL OR ended_at >= started_at)
    )""",
    """CREATE TABLE IF NOT EXISTS nodes (
        node_id VARCHAR PRIMARY KEY,
        node_key INTEGER NOT NULL UNIQUE,
        unit VARCHAR NOT NULL DEFAULT '',
        range_lo DOUBLE,
        range_hi DOUBLE
    )""",
    """CREATE TABLE IF NOT EXISTS points (
        run_key INTEGER NOT NULL,
        node_key INTEGER NOT NULL,
        ts BIGINT NOT NULL,
        value DOUBLE NOT NULL,
        state INTEGER NOT NULL,
        seq BIGINT NOT NULL
    )""",
    """CREATE OR REPLACE VIEW points_by_id AS
        SELECT r.run_id, n.node_id, p.ts, p.value, p.state, p.seq
        FROM points p JOIN runs r USING (run_key) JOIN nodes n USING (node_key)""",
)
_DDL_V2 = (
    """CREATE TABLE run_state (
        run_key INTEGER PRIMARY KEY,
        data_version VARCHAR NOT NULL,
        point_count BIGINT NOT NULL
    )""",
)

_RUN_COLUMNS = (
    "run_id, line_id, product_id, recipe_id, recipe_version, recipe_content_hash, "
    "started_at, ended_at, evidence_source, context_confirmed"
)

# Ingests within one process are serialised per file: seq = max(seq) + 1 + i must not race
# between two read-write handles that share DuckDB's in-process database instance.
_INGEST_LOCKS: dict[str, threading.Lock] = {}
_INGEST_LOCKS_GUARD = threading.Lock()


def _ingest_lock(path: Path) -> threading.Lock:
    with _INGEST_LOCKS_GUARD:
        return _INGEST_LOCKS.setdefault(str(path), threading.Lock())


def reader_memory_limit_mb() -> int:
    """DuckDB's memory limit for the read-only handles of this process (see the module docstring)."""
    return max(READER_MEMORY_MIN_MB, memory_budget_mb() // READER_MEMORY_SHARE)


class _Readers:
    """Read-only access through one in-memory DuckDB instance per process (per memory limit):
    each file is ATTACHed once while any handle of this process reads it, DETACHed (its lock
    released) when the last one closes."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._instances: dict[int, duckdb.DuckDBPyConnection] = {}
        self._attached: dict[str, list[Any]] = {}  # path -> [alias, handles, instance]

    def attach(self, path: Path) -> tuple[duckdb.DuckDBPyConnection, int]:
        """A cursor whose default database is ``path`` (attached read-only), and the limit."""
        with self._guard:
            entry = self._attached.get(str(path))
            if entry is None:
                limit = reader_memory_limit_mb()
                instance = self._instances.get(limit)
                if instance is None:
                    # threads=1: pages are small scans, each answered in the calling thread.
                    # No temp directory: a query that does not fit in the limit fails instead of
                    # spilling next to the database.
                    instance = duckdb.connect(
                        ":memory:",
                        config={"threads": 1, "memory_limit": f"{limit}MiB", "temp_directory": ""},
                    )
                    self._instances[limit] = instance
                alias = "aml_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
                instance.execute(f'ATTACH ? AS "{alias}" (READ_ONLY)', [str(path)])
                entry = self._attached[str(path)] = [alias, 0, instance, limit]
            entry[1] += 1
            alias, instance, limit = entry[0], entry[2], entry[3]
        try:
            cursor = instance.cursor()
            cursor.execute(f'USE "{alias}"')
        except BaseException:
            self.detach(path)
            raise
        return cursor, limit

    def detach(self, path: Path) -> None:
        with self._guard:
            entry = self._attached.get(str(path))
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._attached[str(path)]
            entry[2].execute(f'DETACH "{entry[0]}"')

    def reading_here(self, path: Path) -> bool:
        with self._guard:
            return str(path) in self._attached

    def forget_in_child(self) -> None:
        """After fork(): a DuckDB instance must not be used by two processes; the child starts
        its own (the parent's stay referenced, never closed or destroyed, in the child). DuckDB's
        process-wide file registry is copied too, so a file the parent had open at the fork is
        refused in the child ("already open in this process"): start workers with spawn, as
        Dagster's executors do by default."""
        self._inherited = (self._instances, self._attached)
        self._guard = threading.Lock()
        self._instances, self._attached = {}, {}


_READERS = _Readers()
os.register_at_fork(after_in_child=_READERS.forget_in_child)


def parse_duckdb_url(url: str) -> Path:
    """The file a ``duckdb://`` URL names (see the module docstring for the forms)."""
    if not isinstance(url, str) or not url.startswith(URL_PREFIX):
        raise TsdbError(
            f"not a DuckDB URL: {url!r} (use duckdb:///absolute/path/file.duckdb)",
            code="TSDB_URL_INVALID",
        )
    rest = url[len(URL_PREFIX) :]
    if "?" in rest or "#" in rest:
        raise TsdbError(
            f"DuckDB URL {url!r} must not have a query or fragment", code="TSDB_URL_INVALID"
        )
    if rest.startswith(("/./", "/../")):
        raw = rest[1:]
    elif rest.startswith("/"):
        raw = "/" + rest.lstrip("/")
    else:
        raw = rest
    if raw.strip("/") in ("", ".", ".."):
        raise TsdbError(f"DuckDB URL {url!r} names no file", code="TSDB_URL_INVALID")
    if raw == ":memory:" or raw.endswith("/:memory:"):
        raise TsdbError(
            f"DuckDB URL {url!r}: in-memory databases are not supported; name a file",
            code="TSDB_URL_INVALID",
        )
    return Path(os.path.abspath(raw))


class DuckDBTsdb(ReadBase):
    """:class:`~aml_pipeline.tsdb.port.TsdbPort` over one embedded DuckDB file.

    One connection per instance, used under the base's lock (DuckDB connections are not safe for
    concurrent use from several threads). ``read_only=False`` creates the file and its schema
    if needed (or migrates a version-1 file); ``read_only=True`` requires an existing,
    initialised file.
    """

    # A prefetch reads node_key too: node_key, ts, value, seq (8 bytes each) and state (4).
    _PREFETCH_BYTES_PER_POINT = 36

    def __init__(
        self, url: str, read_only: bool = True, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    ) -> None:
        super().__init__()
        self.url = url
        self.path = parse_duckdb_url(url)
        self.read_only = bool(read_only)
        self.lock_timeout_s = float(lock_timeout_s)
        self.created_file = False  # this handle created the file (see discard())
        self._created_dirs: list[Path] = []
        self.schema_version = SCHEMA_VERSION
        self.memory_limit_mb: int | None = None
        self._run_keys: dict[str, int] = {}
        self._node_keys: dict[str, int] = {}
        self._spans: dict[tuple[int, int], int] = {}  # per series: the last time window that fit
        self._run_points: dict[int, int] = {}  # run_key -> its point count (read-only, version 2)
        self._con: duckdb.DuckDBPyConnection | None = None
        if self.path.is_dir():  # refused before a writer's lock file is made beside it
            raise self._not_a_database("a directory, not a DuckDB database file")
        if self.read_only and not self.path.exists():
            raise TsdbError(
                f"{self.path}: no TSDB file there yet; ingest data first "
                "(aml-pipeline ingest ..., or aml-pipeline demo for a simulated plant)",
                code="TSDB_EMPTY",
            )
        deadline = time.monotonic() + max(0.0, self.lock_timeout_s)
        if self.read_only:
            self._con = self._open_reader(deadline)
            try:
                self._check_reader_schema()
            except BaseException:
                self._release()
                raise
            return
        try:
            self._created_dirs = [d for d in self.path.parents if not d.exists()]  # innermost first
            self.path.parent.mkdir(parents=True, exist_ok=True)
            made_intent = not intent_path(self.path).exists()
            hold_writer_intent(self.path, deadline, self.lock_timeout_s)
        except OSError as e:
            raise self._os_error(e, "cannot create") from None
        try:
            self.created_file = not self.path.exists()
            self._con = self._open_writer(deadline)
            self._init_schema()
        except BaseException as e:
            # A failed open leaves nothing it made: not the intent file beside a file that turned
            # out not to be a database (a YAML file, a text file), nor a database it began.
            self._release(remove_files=self.created_file, remove_intent=made_intent)
            full = disk_full(e, _path_in(e) or self.path)
            if full is not None:
                raise full from None
            raise

    # ---- lifecycle -------------------------------------------------------------------------
    def _open_reader(self, deadline: float) -> duckdb.DuckDBPyConnection:
        if writer_handles_here(self.path):
            raise self._mixed_modes()

        def attach() -> duckdb.DuckDBPyConnection:
            # Every attempt passes the gate: a writer that got the file between our gate and our
            # open is queued ahead of us.
            pass_reader_gate(self.path, deadline, self.lock_timeout_s)
            self._refuse_another_kind_of_file()
            cursor, self.memory_limit_mb = _READERS.attach(self.path)
            return cursor

        return self._open(deadline, attach)

    def _open_writer(self, deadline: float) -> duckdb.DuckDBPyConnection:
        if _READERS.reading_here(self.path):
            raise self._mixed_modes()
        if not self.created_file:
            self._refuse_another_kind_of_file()
        # Readers still holding the file finish their chunk; our intent keeps new ones out.
        return self._open(deadline, lambda: duckdb.connect(str(self.path), read_only=False))

    def _refuse_another_kind_of_file(self) -> None:
        """TSDB_NOT_A_DATABASE unless the file starts as a DuckDB database does (a checksum, then
        the magic ``DUCK``). Checked before DuckDB opens it: DuckDB opens some other formats
        itself (a SQLite file, by downloading and loading its sqlite extension), and a writer
        would then add the TSDB's tables to that file."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(12)
        except FileNotFoundError:
            return  # gone since: DuckDB's open says so
        except OSError:
            return  # unreadable: DuckDB's open names the reason
        if head[8:12] != b"DUCK":
            raise self._not_a_database("not a DuckDB database file")

    def _open(self, deadline: float, connect: Any) -> duckdb.DuckDBPyConnection:
        """``connect()`` again and again while another process holds DuckDB's file lock, until
        ``deadline``; every other failure is reported at once."""
        mode = "read-only" if self.read_only else "read-write"
        delay = 0.02
        while True:
            try:
                return connect()
            except duckdb.ResourceInUseException:
                raise self._mixed_modes() from None
            except duckdb.ConnectionException as e:
                if "different configuration" in str(e):
                    raise self._mixed_modes() from None
                raise TsdbError(f"{self.path}: cannot open ({_one_line(e)})") from None
            except duckdb.IOException as e:
                text = str(e)
                if "not a valid DuckDB database file" in text:
                    raise self._not_a_database("not a DuckDB database file") from None
                if "lock" not in text.lower():
                    if "database does not exist" in text:
                        raise TsdbError(
                            f"{self.path}: no TSDB file there yet; ingest data first", code="TSDB_EMPTY"
                        ) from None
                    raise TsdbError(f"{self.path}: cannot open ({_one_line(e)})") from None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._busy(mode, text) from None
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.2)
            except duckdb.Error as e:
                raise TsdbError(f"{self.path}: cannot open ({_one_line(e)})") from None

    def _not_a_database(self, what: str) -> TsdbError:
        return TsdbError(
            f"{self.path} is {what} (left as it is); a duckdb:// URL names the "
            "embedded TSDB file, or a new path for an ingest to create it",
            code=NOT_A_DATABASE,
        )

    def _busy(self, mode: str, text: str) -> TsdbBusyError:
        # A reader kept out by a writer is transient (a build retries it); a writer is not retried.
        return (TsdbReaderBusyError if self.read_only else TsdbBusyError)(
            f"{self.path} is in use by another process (a build reading it, or another ingest); "
            f"try again when it finishes (waited {self.lock_timeout_s:g} s to open it {mode}"
            f"{_lock_holder(text)})"
        )

    def _mixed_modes(self) -> TsdbBusyError:
        mode = "read-only" if self.read_only else "read-write"
        return TsdbBusyError(
            f"{self.path} is already open in this process in another mode; close that handle "
            f"before opening it {mode} (a file is either read, by many handles, or written, "
            "not both at once)"
        )

    def _os_error(self, e: OSError, what: str) -> Exception:
        full = disk_full(e, self.path)
        return full if full is not None else TsdbError(f"{self.path}: {what} ({_one_line(e)})")

    def _check_reader_schema(self) -> None:
        try:
            version = self._c.execute("SELECT max(version) FROM schema_version").fetchall()[0][0]
        except duckdb.CatalogException:
            version = None
        except duckdb.Error as e:
            raise TsdbError(f"{self.path}: cannot read the TSDB schema ({_one_line(e)})") from None
        if version is None:
            raise TsdbError(
                f"{self.path} holds no TSDB schema yet (an empty or foreign DuckDB file); "
                "ingest data first (aml-pipeline ingest ..., or aml-pipeline demo)",
                code="TSDB_EMPTY",
            )
        check_schema_version(int(version), SCHEMA_VERSION, str(self.path), "file")
        self.schema_version = int(version)

    def _init_schema(self) -> None:
        con = self._c
        has_table = con.execute(
            "SELECT count(*) FROM information_schema.tables "
            "WHERE table_schema = 'main' AND table_name = 'schema_version'"
        ).fetchall()[0][0]
        version = None
        if has_table:
            version = con.execute("SELECT max(version) FROM schema_version").fetchall()[0][0]
        if version is None:
            clashing = [
                r[0]
                for r in con.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' "
                    "AND table_name IN ('runs', 'nodes', 'points', 'points_by_id', 'run_state') "
                    "ORDER BY 1"
                ).fetchall()
            ]
            if clashing:
                raise TsdbError(
                    f"{self.path} is a DuckDB file of something else (it has {', '.join(clashing)} "
                    "but no aml_pipeline schema_version); refusing to change it, use a new file",
                    code="TSDB_SCHEMA_VERSION",
                )
        else:
            check_schema_version(int(version), SCHEMA_VERSION, str(self.path), "file")
            if version == SCHEMA_VERSION:
                return
        with _transaction(con):
            if version is None:
                for ddl in _DDL_V1:
                    con.execute(ddl)
                con.execute("INSERT INTO schema_version VALUES (1, ?)", [int(time.time() * 1000)])
            self._migrate_to_v2(con)

    @staticmethod
    def _migrate_to_v2(con: duckdb.DuckDBPyConnection) -> None:
        """Version 1 -> 2: ``run_state`` with each run's first data version and point count (one
        scan of the points, once)."""
        for ddl in _DDL_V2:
            con.execute(ddl)
        rows = con.execute(
            f"SELECT r.run_key, {', '.join('r.' + c.strip() for c in _RUN_COLUMNS.split(','))}, "
            "coalesce(c.n, 0), c.lo, c.hi FROM runs r LEFT JOIN "
            "(SELECT run_key, count(*) AS n, min(seq) AS lo, max(seq) AS hi FROM points GROUP BY run_key) c "
            "USING (run_key)"
        ).fetchall()
        if rows:
            states = [
                RunState(int(r[0]), migrated_version(run_from_row(r[1:11]), int(r[11]), r[12], r[13]), int(r[11]))
                for r in rows
            ]
            _Statements(con).save_run_states(states)
        con.execute("INSERT INTO schema_version VALUES (2, ?)", [int(time.time() * 1000)])

    def discard(self) -> None:
        """Close; if this handle created the file, remove it again (with its ``.wal``, temporary
        directory and intent file). For an ingest that failed into a file that did not exist."""
        with self._lock:
            self._closed = True
            self._prefetched.clear()
            self._ahead.clear()
            self._release(remove_files=self.created_file)

    def _release(self, *, remove_files: bool = False, remove_intent: bool = False) -> None:
        con, self._con = self._con, None
        try:
            if con is not None:
                con.close()
        finally:
            if self.read_only:
                if con is not None:
                    _READERS.detach(self.path)
            else:
                # Only the last handle of this process on the file may remove it.
                last = writer_handles_here(self.path) == 1
                sole = remove_files and last
                if sole:
                    for leftover in (self.path, self.path.with_name(self.path.name + ".wal")):
                        leftover.unlink(missing_ok=True)
                    shutil.rmtree(self.path.with_name(self.path.name + ".tmp"), ignore_errors=True)
                drop_writer_intent(self.path, remove=sole or (remove_intent and last))
                if sole:
                    for d in self._created_dirs:  # the directories made for the file, if empty
                        try:
                            d.rmdir()
                        except OSError:
                            break

    def __repr__(self) -> str:
        mode = "ro" if self.read_only else "rw"
        state = "closed" if self._con is None else "open"
        return f"DuckDBTsdb({str(self.path)!r}, {mode}, {state})"

    @property
    def _c(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            raise TsdbError(f"{self.url}: this TSDB handle is closed")
        return self._con

    def _select(self, sql: str, params: list[Any], *, arrow: bool = False) -> dict[str, np.ndarray]:
        """The result's columns as numpy arrays. ``arrow``: through one Arrow table (its columns
        taken without a copy, read-only): less work for a result of many rows."""
        try:
            if not arrow:
                return self._c.execute(sql, params).fetchnumpy()
            rel = self._c.sql(sql, params=params)
            to_table = getattr(rel, "to_arrow_table", None) or rel.fetch_arrow_table  # older DuckDB: fetch_arrow_table
            table = to_table(_ARROW_BATCH_ROWS)
            return {name: table.column(name).to_numpy() for name in table.column_names}
        except duckdb.OutOfMemoryException as e:
            if self.memory_limit_mb is None:
                raise TsdbError(f"{self.path}: out of memory ({_one_line(e)})", code="TSDB_OUT_OF_MEMORY") from None
            raise TsdbError(
                f"{self.path}: a query needed more than the {self.memory_limit_mb} MB the TSDB "
                f"reader may use (1/{READER_MEMORY_SHARE} of the memory budget, at least "
                f"{READER_MEMORY_MIN_MB} MB; AML_MEMORY_MB={memory_budget_mb()}); raise "
                "AML_MEMORY_MB or read smaller pages",
                code="TSDB_OUT_OF_MEMORY",
            ) from None

    # ---- catalog ---------------------------------------------------------------------------
    def list_runs(self, scope: RunScope | None = None, finished_only: bool = True) -> list[Run]:
        conds = (scope or RunScope()).sql_conditions(finished_only=finished_only)
        where = [c for c, _ in conds]
        params = [v for _, v in conds if v is not None]
        sql = f"SELECT {_RUN_COLUMNS} FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY started_at, run_id"
        with self._lock:
            rows = self._c.execute(sql, params).fetchall()
        return [run_from_row(r) for r in rows]

    def get_run(self, run_id: str) -> Run:
        with self._lock:
            rows = self._c.execute(
                f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id = ?", [run_id]
            ).fetchall()
        if not rows:
            raise UnknownRunError(f"unknown run {run_id!r}: not in {self.url}")
        return run_from_row(rows[0])

    def list_nodes(self) -> list[Node]:
        with self._lock:
            rows = self._c.execute(
                "SELECT node_id, unit, range_lo, range_hi FROM nodes ORDER BY node_id"
            ).fetchall()
        return [Node(r[0], r[1] or "", opt_float(r[2]), opt_float(r[3])) for r in rows]

    def availability_watermark(self) -> int | None:
        with self._lock:
            value = self._c.execute("SELECT max(ts) FROM points").fetchall()[0][0]
        return None if value is None else int(value)

    def _run_key(self, run_id: str) -> int:
        key = self._run_keys.get(run_id)
        if key is None:
            counted = self.read_only and self.schema_version >= 2
            rows = self._c.execute(
                "SELECT r.run_key, s.point_count FROM runs r LEFT JOIN run_state s USING (run_key) WHERE run_id = ?"
                if counted
                else "SELECT run_key, NULL FROM runs WHERE run_id = ?",
                [run_id],
            ).fetchall()
            if not rows:
                raise UnknownRunError(f"unknown run {run_id!r}: not in {self.url}")
            key = self._run_keys[run_id] = int(rows[0][0])
            if rows[0][1] is not None:
                # Nothing changes under a read-only handle: a bound for every series of the run.
                self._run_points[key] = int(rows[0][1])
        return key

    def _run_keys_of(self, run_ids: Sequence[str]) -> None:
        """Look up the keys (and point counts) of those of ``run_ids`` not known yet, in one query."""
        missing = [r for r in dict.fromkeys(run_ids) if r not in self._run_keys]
        if not missing:
            return
        counted = self.read_only and self.schema_version >= 2
        rows = self._c.execute(
            "SELECT r.run_id, r.run_key, s.point_count FROM runs r LEFT JOIN run_state s USING (run_key) "
            "WHERE list_contains(?, r.run_id)"
            if counted
            else "SELECT run_id, run_key, NULL FROM runs WHERE list_contains(?, run_id)",
            [missing],
        ).fetchall()
        for run_id, key, points in rows:
            self._run_keys[run_id] = int(key)
            if points is not None:
                self._run_points[int(key)] = int(points)

    def _node_key(self, node_id: str) -> int:
        key = self._node_keys.get(node_id)
        if key is None and not self._node_keys:
            # The node catalog is small and a handle may live for one chunk only: one query for
            # every key instead of one per node.
            self._node_keys.update(
                (r[0], int(r[1])) for r in self._c.execute("SELECT node_id, node_key FROM nodes").fetchall()
            )
            key = self._node_keys.get(node_id)
        if key is None:
            rows = self._c.execute(
                "SELECT node_key FROM nodes WHERE node_id = ?", [node_id]
            ).fetchall()
            if not rows:
                raise UnknownNodeError(f"unknown node {node_id!r}: not in {self.url}")
            key = self._node_keys[node_id] = int(rows[0][0])
        return key

    def run_versions(self, run_ids: Sequence[str]) -> dict[str, str]:
        ids = list(dict.fromkeys(str(r) for r in run_ids))
        if not ids:
            return {}
        with self._lock:
            con = self._c
            if self.schema_version >= 2:
                rows = con.execute(
                    "SELECT r.run_id, s.data_version FROM runs r JOIN run_state s USING (run_key) "
                    "WHERE list_contains(?, r.run_id)",
                    [ids],
                ).fetchall()
                return {r[0]: r[1] for r in rows}
            # Version 1 (read-only): what the migration will store.
            rows = con.execute(
                f"SELECT {', '.join('r.' + c.strip() for c in _RUN_COLUMNS.split(','))}, "
                "coalesce(c.n, 0), c.lo, c.hi FROM runs r LEFT JOIN "
                "(SELECT run_key, count(*) AS n, min(seq) AS lo, max(seq) AS hi FROM points "
                " WHERE run_key IN (SELECT run_key FROM runs WHERE list_contains(?, run_id)) "
                " GROUP BY run_key) c USING (run_key) WHERE list_contains(?, r.run_id)",
                [ids, ids],
            ).fetchall()
        return {r[0]: migrated_version(run_from_row(r[:10]), int(r[10]), r[11], r[12]) for r in rows}

    # ---- points (the read base's primitives) -------------------------------------------------
    def _locate(self, node_id: str, run_id: str, from_ms: int, to_ms: int) -> tuple[Any, int, int]:
        return (self._run_key(run_id), self._node_key(node_id)), clamp_i64(from_ms), clamp_i64(to_ms)

    def _read(self, series: Any, lo: int, hi: int, after: Cursor | None, want: int) -> Rows:
        """No ``ORDER BY ... LIMIT``: DuckDB's top-N scans the rest of the series for every page
        (quadratic over a long run) and needs far more memory than the page. Instead the page
        is read in time windows, unordered, each at most :data:`_WINDOW_ROWS` or ``want`` rows,
        sorted here, until ``want`` rows are in hand (see :meth:`_first_rows`); zone maps on
        ``ts`` prune each window to the row groups it overlaps."""
        run_key, node_key = series
        return Rows(*self._first_rows(run_key, node_key, lo, hi, after, want))

    def _first_rows(
        self, run_key: int, node_key: int, lo: int, hi: int, cursor: Cursor | None, want: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The first ``want`` points after ``cursor`` with ``lo <= ts <= hi``, in (ts, seq) order.

        Windows ``[w_lo, w_hi]`` of ts follow each other without overlap, so every point of a
        timestamp is in one window and sorted windows concatenate in order. A window holding
        more than ``cap`` points is read again narrower (its rows only told how dense the
        series is); one holding fewer than needed is kept and the next one is wider. The
        first window of a series is the whole range: most series fit, in one query.
        """
        cap = max(want, _WINDOW_ROWS)
        series = (run_key, node_key)
        span = self._spans.get(series)  # None: the whole range
        parts: list[dict[str, np.ndarray]] = []
        total = 0
        w_lo = lo
        while True:
            w_hi = hi if span is None else min(hi, w_lo + span)
            after = cursor if w_lo == lo else None
            # No LIMIT when the whole run has no more points than that (a LIMIT slows the scan).
            bounded = self._run_points.get(run_key, cap + 1) <= cap
            cols = self._window(run_key, node_key, w_lo, w_hi, after, None if bounded else cap + 1)
            n = int(cols["ts"].shape[0])
            if n > cap:
                if w_hi > w_lo:
                    if span is None:  # aim for about `want` points, from where these rows reach
                        reach = int(cols["ts"].max()) - w_lo + 1
                        span = max(0, reach * want // (2 * n))
                    else:
                        span = (w_hi - w_lo) // 8
                    continue
                # More than cap points share one timestamp: order just those, by seq.
                cols = self._select(
                    f"SELECT ts, value, state, seq FROM points WHERE {_SERIES} AND ts = ?"
                    + (" AND (ts > ? OR seq > ?)" if after is not None else "") + " ORDER BY seq LIMIT ?",
                    [run_key, node_key, w_lo]
                    + ([clamp_i64(after.ts), clamp_i64(after.seq)] if after is not None else [])
                    + [want - total],
                )
                n = int(cols["ts"].shape[0])
            else:
                cols = sorted_by_ts_seq(cols)
            parts.append(cols)
            total += n
            if total >= want or w_hi >= hi:
                break
            w_lo = w_hi + 1
            if span is not None:
                span = max(1, span) * min(64, max(2, (want - total) // max(n, 1)))
        if span is not None:
            self._spans[series] = span
        if len(parts) == 1:
            out = parts[0]
        else:
            out = {k: np.concatenate([p[k] for p in parts]) for k in ("ts", "value", "state", "seq")}
        return (
            np.asarray(out["ts"][:want], dtype=np.int64),
            np.asarray(out["value"][:want], dtype=np.float64),
            np.asarray(out["state"][:want], dtype=np.int32),
            np.asarray(out["seq"][:want], dtype=np.int64),
        )

    def _window(
        self, run_key: int, node_key: int, w_lo: int, w_hi: int, after: Cursor | None, limit: int | None
    ) -> dict[str, np.ndarray]:
        """Up to ``limit`` (None: all) points with ``w_lo <= ts <= w_hi`` (and after ``after``), unordered."""
        where = f"{_SERIES} AND ts BETWEEN ? AND ?"
        params: list[Any] = [run_key, node_key, w_lo, w_hi]
        if after is not None:
            # Within ts >= after.ts: (ts, seq) > after  <=>  ts > after.ts OR seq > after.seq.
            where += " AND (ts > ? OR seq > ?)"
            params += [clamp_i64(after.ts), clamp_i64(after.seq)]
        if limit is None:
            return self._select(f"SELECT ts, value, state, seq FROM points WHERE {where}", params)
        return self._select(f"SELECT ts, value, state, seq FROM points WHERE {where} LIMIT ?", [*params, limit])

    def _read_run(
        self, run_id: str, node_ids: Sequence[str], from_ms: int, to_ms: int, most: int
    ) -> dict[str, Rows] | None:
        """One query for every point of the run's nodes in ``[from_ms, to_ms]`` (a query per
        node costs more on a short run), split by node."""
        run_key = self._run_key(run_id)
        keys: dict[int, str] = {}
        for node_id in node_ids:
            try:
                keys[self._node_key(node_id)] = node_id
            except UnknownNodeError:
                continue  # query_page reports it when that node is asked for
        lo, hi = clamp_i64(from_ms), clamp_i64(to_ms)
        if not keys or lo > hi:
            return None
        node_list = ", ".join(str(int(k)) for k in keys)  # integers from our own catalog
        cols = self._select(
            "SELECT node_key, ts, value, state, seq FROM points "
            f"WHERE run_key = ? AND node_key IN ({node_list}) AND ts BETWEEN ? AND ? LIMIT ?",
            [run_key, lo, hi, most + 1],
        )
        nk = np.asarray(cols["node_key"], dtype=np.int64)
        if nk.shape[0] > most:
            return None
        ts = np.asarray(cols["ts"], dtype=np.int64)
        value = np.asarray(cols["value"], dtype=np.float64)
        state = np.asarray(cols["state"], dtype=np.int32)
        seq = np.asarray(cols["seq"], dtype=np.int64)
        # Rows usually arrive in storage order, (node_key, ts, seq); sort only if they did not.
        if nk.shape[0] > 1:
            dn, dt, ds = np.diff(nk), np.diff(ts), np.diff(seq)
            if not bool(np.all((dn > 0) | ((dn == 0) & ((dt > 0) | ((dt == 0) & (ds > 0)))))):
                order = np.lexsort((seq, ts, nk))
                nk, ts, value, state, seq = nk[order], ts[order], value[order], state[order], seq[order]
        out = {}
        for k, node_id in keys.items():
            a, b = np.searchsorted(nk, k, "left"), np.searchsorted(nk, k, "right")
            out[node_id] = Rows(ts[a:b], value[a:b], state[a:b], seq[a:b])
        return out

    def _read_slices(
        self, slices: Sequence[tuple[str, int, int]], node_ids: Sequence[str], most: int, total: int
    ) -> list[dict[str, Rows] | None]:
        """Consecutive slices in one query where the runs' point counts (``run_state``, read-only
        handles) bound what it returns: the first slice, then each next one while its run has at
        most ``most`` points and all of them together at most ``total``. The rows are split by
        run and node here, and each slice cut to its own time range."""
        out: list[dict[str, Rows] | None] = [None] * len(slices)
        self._run_keys_of([r for r, _, _ in slices])
        run_key = self._run_key(slices[0][0])  # an unknown run is reported here
        counted = self._run_points.get(run_key)
        if counted is None or counted > most:  # no bound from the counts: the first slice alone
            out[0] = self._read_run(slices[0][0], node_ids, slices[0][1], slices[0][2], most)
            return out
        keys: dict[int, str] = {}
        for node_id in node_ids:
            try:
                keys[self._node_key(node_id)] = node_id
            except UnknownNodeError:
                continue  # query_page reports it when that node is asked for
        if not keys:
            return out
        chosen: dict[int, list[tuple[int, int, int]]] = {}  # run_key -> its slices (index, lo, hi)
        points = 0
        for i, (run_id, from_ms, to_ms) in enumerate(slices):
            key = self._run_keys.get(run_id)
            n = None if key is None else self._run_points.get(key)
            lo, hi = clamp_i64(from_ms), clamp_i64(to_ms)
            if n is None or n > most or points + n > total:
                break
            if lo <= hi:
                chosen.setdefault(key, []).append((i, lo, hi))
            points += n
        if not chosen:
            return out
        run_list = ", ".join(str(int(k)) for k in chosen)  # integers from our own catalog
        node_list = ", ".join(str(int(k)) for k in keys)
        ranges = [c for cs in chosen.values() for c in cs]
        cols = self._select(
            "SELECT run_key, node_key, ts, value, state, seq FROM points "
            f"WHERE run_key IN ({run_list}) AND node_key IN ({node_list}) AND ts BETWEEN ? AND ?",
            [min(c[1] for c in ranges), max(c[2] for c in ranges)],
            # Through Arrow when runs are read ahead: its conversion costs a fixed setup per
            # query and less per row than fetchnumpy's, which a read of one slice does not repay.
            arrow=len(ranges) > 1,
        )
        rk, nk, ts, seq = cols["run_key"], cols["node_key"], cols["ts"], cols["seq"]
        value, state = cols["value"], cols["state"]
        starts = _series_starts(rk, nk, ts, seq)
        if starts is None:  # not in storage order: sort (run, node, ts, seq)
            order = np.lexsort((seq, ts, nk, rk))
            rk, nk, ts, value, state, seq = rk[order], nk[order], ts[order], value[order], state[order], seq[order]
            starts = _series_starts(rk, nk, ts, seq)
            assert starts is not None
        empty = Rows(ts[:0], value[:0], state[:0], seq[:0])
        for i, _, _ in ranges:
            out[i] = dict.fromkeys(keys.values(), empty)
        bounds = starts.tolist() + [int(ts.shape[0])]
        for a, b in zip(bounds[:-1], bounds[1:]):
            node_id = keys[int(nk[a])]
            part = ts[a:b]
            for i, lo, hi in chosen[int(rk[a])]:
                x, y = a + int(np.searchsorted(part, lo, "left")), a + int(np.searchsorted(part, hi, "right"))
                out[i][node_id] = Rows(ts[x:y], value[x:y], state[x:y], seq[x:y])
        return out

    # ---- ingest ----------------------------------------------------------------------------
    def ingest(
        self,
        *,
        runs: Sequence[Run] = (),
        nodes: Sequence[Node] = (),
        points: PointColumns | None = None,
        replace_runs: bool = False,
    ) -> int:
        if self.read_only:
            raise TsdbError(f"{self.url} is open read-only; open it with read_only=False to ingest")
        runs, nodes = list(runs), list(nodes)
        runs_tab = runs_table(runs)
        nodes_tab = nodes_table(nodes)
        prepared = prepare_points(points) if points is not None and len(points) else None
        with _ingest_lock(self.path), self._lock:
            con = self._c
            try:
                with _transaction(con):
                    outcome = write_ingest(
                        _Statements(con), runs, runs_tab, nodes_tab, prepared, replace_runs=bool(replace_runs)
                    )
                    crash_point("ingest.commit")
            except BaseException as e:
                # Keys assigned inside the rolled-back transaction must not stay cached.
                self._run_keys.clear()
                self._node_keys.clear()
                if isinstance(e, duckdb.Error):
                    n = prepared.n if prepared is not None else 0
                    what = f"ingest of {n:,} points and {len(runs)} runs failed, nothing written"
                    full = disk_full(e, f"{_path_in(e) or self.path}: {what}")
                    if full is not None:
                        raise full from None
                    raise IngestError(f"{self.url}: {what} ({_one_line(e)})") from e
                raise
        return outcome.written


def _series_starts(rk: np.ndarray, nk: np.ndarray, ts: np.ndarray, seq: np.ndarray) -> np.ndarray | None:
    """Where each series (``rk``, ``nk``) begins, if the rows come in series, each series once and
    in ``(ts, seq)`` order (as they are stored); None otherwise."""
    n = int(ts.shape[0])
    if n < 2:
        return np.zeros(min(n, 1), dtype=np.int64)
    new = (rk[1:] != rk[:-1]) | (nk[1:] != nk[:-1])
    starts = np.concatenate(([0], np.flatnonzero(new) + 1))
    if np.unique(rk[starts].astype(np.int64) << 32 | nk[starts].astype(np.int64)).shape[0] != starts.shape[0]:
        return None
    return starts if ordered_by_ts_seq(ts, seq, new) else None


class _Statements:
    """:class:`~aml_pipeline.tsdb.writer.IngestStatements` over a DuckDB connection."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con

    def _with(self, name: str, table: pa.Table, sql: str) -> dict[str, np.ndarray]:
        """Run ``sql`` with ``table`` registered as ``name``; its result as numpy columns."""
        with _registered(self.con, name, table):
            return self.con.execute(sql).fetchnumpy()

    def stored_runs(self, run_ids: list[str]) -> dict[str, StoredRun]:
        if not run_ids:
            return {}
        with _registered(self.con, "_aml_ids", pa.table({"id": pa.array(run_ids, type=pa.string())})):
            rows = self.con.execute(
                f"SELECT r.run_key, {', '.join('r.' + c.strip() for c in _RUN_COLUMNS.split(','))}, "
                "coalesce(s.data_version, ''), coalesce(s.point_count, 0) "
                "FROM runs r JOIN _aml_ids w ON r.run_id = w.id LEFT JOIN run_state s USING (run_key)"
            ).fetchall()
        return {r[1]: StoredRun(int(r[0]), run_from_row(r[1:11]), r[11], int(r[12])) for r in rows}

    def upsert_nodes(self, nodes: pa.Table) -> None:
        self._with(
            "_aml_nodes",
            nodes,
            """INSERT INTO nodes (node_id, node_key, unit, range_lo, range_hi)
            SELECT s.node_id,
                   (SELECT coalesce(max(node_key), 0) FROM nodes) + row_number() OVER (ORDER BY s.ord),
                   s.unit, s.range_lo, s.range_hi
            FROM _aml_nodes s
            ON CONFLICT (node_id) DO UPDATE SET
                unit = excluded.unit, range_lo = excluded.range_lo, range_hi = excluded.range_hi""",
        )

    def upsert_runs(self, runs: pa.Table) -> None:
        self._with(
            "_aml_runs",
            runs,
            """INSERT INTO runs (run_id, run_key, line_id, product_id, recipe_id, recipe_version,
                recipe_content_hash, started_at, ended_at, evidence_source, context_confirmed)
            SELECT s.run_id,
                   (SELECT coalesce(max(run_key), 0) FROM runs) + row_number() OVER (ORDER BY s.ord),
                   s.line_id, s.product_id, s.recipe_id, s.recipe_version, s.recipe_content_hash,
                   s.started_at, s.ended_at, s.evidence_source, s.context_confirmed
            FROM _aml_runs s
            ON CONFLICT (run_id) DO UPDATE SET
                line_id = excluded.line_id, product_id = excluded.product_id,
                recipe_id = excluded.recipe_id, recipe_version = excluded.recipe_version,
                recipe_content_hash = excluded.recipe_content_hash,
                started_at = excluded.started_at, ended_at = excluded.ended_at,
                evidence_source = excluded.evidence_source,
                context_confirmed = excluded.context_confirmed""",
        )

    def key_maps(self, run_ids: list[str], node_ids: list[str]) -> tuple[dict[str, int], dict[str, int]]:
        return (
            _key_map(self.con, "runs", "run_id", "run_key", run_ids),
            _key_map(self.con, "nodes", "node_id", "node_key", node_ids),
        )

    def stored_point_rows(self, candidates: pa.Table, run_keys: list[int]) -> np.ndarray:
        keys = ", ".join(str(int(k)) for k in run_keys)  # integers from our own catalog
        cols = self._with(
            "_aml_candidates",
            candidates,
            f"""SELECT c.idx FROM _aml_candidates c SEMI JOIN
                (SELECT run_key, node_key, ts, value, state, (value = 0 AND signbit(value)) AS neg_zero
                 FROM points WHERE run_key IN ({keys})) p
            ON p.run_key = c.run_key AND p.node_key = c.node_key AND p.ts = c.ts
               AND p.state = c.state AND p.value = c.value AND p.neg_zero = c.neg_zero""",
        )
        return np.asarray(cols["idx"], dtype=np.int64)

    def delete_points(self, run_keys: list[int]) -> None:
        if run_keys:
            keys = ", ".join(str(int(k)) for k in run_keys)  # integers from our own catalog
            self.con.execute(f"DELETE FROM points WHERE run_key IN ({keys})")

    def next_seq(self) -> int:
        return int(self.con.execute("SELECT coalesce(max(seq), -1) + 1 FROM points").fetchall()[0][0])

    def append_points(self, rows: PointRows) -> None:
        table = pa.table(
            {
                "run_key": pa.array(rows.run_key, type=pa.int32()),
                "node_key": pa.array(rows.node_key, type=pa.int32()),
                "ts": pa.array(rows.ts, type=pa.int64()),
                "value": pa.array(rows.value, type=pa.float64()),
                "state": pa.array(rows.state, type=pa.int32()),
                "seq": pa.array(rows.seq, type=pa.int64()),
            }
        )
        self._with(
            "_aml_points",
            table,
            "INSERT INTO points SELECT run_key, node_key, ts, value, state, seq "
            "FROM _aml_points ORDER BY run_key, node_key, ts, seq",
        )

    def save_run_states(self, states: list[RunState]) -> None:
        table = pa.table(
            {
                "run_key": pa.array([s.key for s in states], type=pa.int32()),
                "data_version": pa.array([s.version for s in states], type=pa.string()),
                "point_count": pa.array([s.points for s in states], type=pa.int64()),
            }
        )
        self._with(
            "_aml_states",
            table,
            """INSERT INTO run_state SELECT run_key, data_version, point_count FROM _aml_states
            ON CONFLICT (run_key) DO UPDATE SET
                data_version = excluded.data_version, point_count = excluded.point_count""",
        )


# ---- helpers -------------------------------------------------------------------------------


class _transaction:
    """BEGIN ... COMMIT, ROLLBACK on any error (the error itself propagates)."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con

    def __enter__(self) -> None:
        self.con.execute("BEGIN TRANSACTION")

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.con.execute("COMMIT")  # a failing COMMIT has already ended the transaction
            return
        try:
            self.con.execute("ROLLBACK")
        except duckdb.Error:
            pass  # e.g. a failed COMMIT: nothing is left to roll back


def _key_map(
    con: duckdb.DuckDBPyConnection, table: str, id_col: str, key_col: str, ids: list[Any]
) -> dict[str, int]:
    if not ids:
        return {}
    wanted = pa.table({"id": pa.array([str(i) for i in ids], type=pa.string())})
    with _registered(con, "_aml_ids", wanted):
        rows = con.execute(
            f"SELECT t.{id_col}, t.{key_col} FROM {table} t JOIN _aml_ids w ON t.{id_col} = w.id"
        ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


@contextmanager
def _registered(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> Iterator[None]:
    """``table`` visible to SQL as ``name`` for the block. After a failed statement the
    transaction is aborted and unregistering fails too: the statement's error is the one to
    report, so that second error is dropped."""
    con.register(name, table)
    try:
        yield
    except BaseException:
        with suppress(duckdb.Error):
            con.unregister(name)
        raise
    con.unregister(name)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


_HOLDER_RE = re.compile(r"Conflicting lock is held in (.+?) \(PID (\d+)\)")
_FILE_RE = re.compile(r'file "([^"]+)"')


def _lock_holder(text: str) -> str:
    m = _HOLDER_RE.search(text)
    return f"; held by PID {m.group(2)} ({m.group(1)})" if m else ""


def _path_in(e: BaseException) -> str | None:
    """The file DuckDB names in an I/O error (the database, its WAL or a temporary file)."""
    m = _FILE_RE.search(str(e))
    return m.group(1) if m else None
