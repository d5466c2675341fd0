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
    ``nodes(node_id PK, node_key, unit, range_lo, range_hi)``,
    ``points(run_key, node_key, ts, value, state, seq)`` and the view
    ``points_by_id(run_id, node_id, ts, value, state, seq)`` for people querying the file.

    Points carry small integer surrogate keys instead of the run/node id strings: DuckDB's zone
    maps keep only an 8-byte prefix of string min/max, so plant ids that share a prefix
    (``BATCH-2024-...``) would defeat row-group pruning (measured: 2.7x slower per-series reads
    on 3.7M points). Integer keys prune exactly. Keys are assigned once, on first insert, and
    never change. Every ingest sorts its points by ``(run_key, node_key, ts, seq)`` before the
    insert, so one series occupies few, contiguous row groups.

Concurrency
    DuckDB locks the file: many read-only connections (in as many processes) or one read-write
    connection. An open that finds the file locked is retried for ``lock_timeout_s`` and then
    fails with :class:`TsdbBusyError`. Note that a read-only instance holds its shared lock
    until :meth:`DuckDBTsdb.close`, so keep read-only instances short-lived (a build step, not a
    whole server). Within one process DuckDB refuses to mix read-only and read-write handles
    on the same file; that is reported at once (retrying cannot help).

``seq`` is a global ingestion sequence: the points of one ingest get ``max(seq) + 1 + row
index`` in the order they were given (file row order).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from aml_pipeline.errors import (
    IngestError,
    TsdbBusyError,
    TsdbError,
    UnknownNodeError,
    UnknownRunError,
)
from aml_pipeline.tsdb.columns import (
    PreparedPoints,
    clamp_i64,
    codes_to_keys,
    empty_page,
    nodes_table,
    opt_float,
    prepare_points,
    run_from_row,
    runs_table,
    sorted_by_ts_seq,
)
from aml_pipeline.tsdb.port import (
    DEFAULT_PAGE_LIMIT,
    Cursor,
    Node,
    Page,
    PointColumns,
    Run,
    RunScope,
)

SCHEMA_VERSION = 1
URL_PREFIX = "duckdb://"
# DuckDB's memory limit for read-only handles (see DuckDBTsdb.__init__), in MB: what a page query
# needs (measured: pages of 1 M ordered rows run within 16 MB; results are materialised outside
# the limit). A query that still runs out of it is retried with the limit doubled, up to the max.
READ_ONLY_MEMORY_LIMIT_MB = 16
READ_ONLY_MEMORY_LIMIT_MAX_MB = 16 * 1024

_DDL = (
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


class DuckDBTsdb:
    """:class:`~aml_pipeline.tsdb.port.TsdbPort` over one embedded DuckDB file.

    One connection per instance, used under a lock (DuckDB connections are not safe for
    concurrent use from several threads). ``read_only=False`` creates the file and its schema
    if needed; ``read_only=True`` requires an existing, initialised file.
    """

    def __init__(self, url: str, read_only: bool = True, *, lock_timeout_s: float = 10.0) -> None:
        self.url = url
        self.path = parse_duckdb_url(url)
        self.read_only = bool(read_only)
        self.lock_timeout_s = float(lock_timeout_s)
        self._lock = threading.RLock()
        self._run_keys: dict[str, int] = {}
        self._node_keys: dict[str, int] = {}
        if self.read_only and not self.path.exists():
            raise TsdbError(
                f"{self.path}: no TSDB file there yet; ingest data first "
                "(aml-pipeline ingest ..., or aml-pipeline demo for a simulated plant)",
                code="TSDB_EMPTY",
            )
        if not self.read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prefetched: dict[tuple[str, str, int, int], tuple[np.ndarray, ...]] = {}
        self._con: duckdb.DuckDBPyConnection | None = self._connect()
        try:
            self._init_schema()
            if self.read_only:
                # DuckDB keeps every table block it has read cached until its memory limit (80 %
                # of RAM by default), so a build's memory would grow with the data it reads. A
                # reader needs no more than one page's blocks at a time.
                self._set_memory_limit(READ_ONLY_MEMORY_LIMIT_MB)
        except BaseException:
            self._con.close()
            self._con = None
            raise

    # ---- lifecycle -------------------------------------------------------------------------
    def _set_memory_limit(self, mb: int) -> None:
        self._memory_limit_mb = int(mb)
        self._c.execute(f"SET memory_limit = '{int(mb)}MB'")

    def _read(self, sql: str, params: list[Any]) -> dict[str, np.ndarray]:
        """``execute(sql, params).fetchnumpy()``; on a read-only handle, a query that runs out
        of the (deliberately small) memory limit is retried with the limit doubled."""
        while True:
            try:
                return self._c.execute(sql, params).fetchnumpy()
            except duckdb.OutOfMemoryException:
                limit = getattr(self, "_memory_limit_mb", None)
                if not self.read_only or limit is None or limit >= READ_ONLY_MEMORY_LIMIT_MAX_MB:
                    raise
                self._set_memory_limit(min(2 * limit, READ_ONLY_MEMORY_LIMIT_MAX_MB))

    def _connect(self) -> duckdb.DuckDBPyConnection:
        deadline = time.monotonic() + max(0.0, self.lock_timeout_s)
        delay = 0.05
        mode = "read-only" if self.read_only else "read-write"
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=self.read_only)
            except duckdb.ConnectionException as e:
                if "different configuration" in str(e):
                    raise TsdbBusyError(
                        f"{self.path} is already open in this process in another mode; close "
                        f"that handle before opening it {mode} (DuckDB allows either many "
                        "read-only handles or read-write ones, not both)"
                    ) from None
                raise TsdbError(f"{self.path}: cannot open ({_one_line(e)})") from None
            except duckdb.IOException as e:
                text = str(e)
                if "lock" not in text.lower():
                    if "database does not exist" in text:
                        raise TsdbError(
                            f"{self.path}: no TSDB file there yet; ingest data first",
                            code="TSDB_EMPTY",
                        ) from None
                    raise TsdbError(f"{self.path}: cannot open ({_one_line(e)})") from None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    holder = _lock_holder(text)
                    raise TsdbBusyError(
                        f"{self.path} is in use by another process (a build reading it, or "
                        "another ingest); try again when it finishes "
                        f"(waited {self.lock_timeout_s:g} s to open it {mode}{holder})"
                    ) from None
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.5)
            except duckdb.Error as e:
                raise TsdbError(f"{self.path}: cannot open ({_one_line(e)})") from None

    def _init_schema(self) -> None:
        con = self._con
        assert con is not None
        has_table = con.execute(
            "SELECT count(*) FROM information_schema.tables "
            "WHERE table_schema = 'main' AND table_name = 'schema_version'"
        ).fetchall()[0][0]
        version = None
        if has_table:
            version = con.execute("SELECT max(version) FROM schema_version").fetchall()[0][0]
        if version is None:
            if self.read_only:
                raise TsdbError(
                    f"{self.path} holds no TSDB schema yet (an empty or foreign DuckDB file); "
                    "ingest data first (aml-pipeline ingest ..., or aml-pipeline demo)",
                    code="TSDB_EMPTY",
                )
            clashing = [
                r[0]
                for r in con.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' "
                    "AND table_name IN ('runs', 'nodes', 'points', 'points_by_id') ORDER BY 1"
                ).fetchall()
            ]
            if clashing:
                raise TsdbError(
                    f"{self.path} is a DuckDB file of something else (it has {', '.join(clashing)} "
                    "but no aml_pipeline schema_version); refusing to change it, use a new file",
                    code="TSDB_SCHEMA_VERSION",
                )
            con.execute("BEGIN TRANSACTION")
            try:
                for ddl in _DDL:
                    con.execute(ddl)
                con.execute(
                    "INSERT INTO schema_version VALUES (?, ?)",
                    [SCHEMA_VERSION, int(time.time() * 1000)],
                )
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
            return
        if version != SCHEMA_VERSION:
            newer = version > SCHEMA_VERSION
            raise TsdbError(
                f"{self.path} has TSDB schema version {version}, this aml_pipeline reads "
                f"version {SCHEMA_VERSION}"
                + ("; upgrade aml_pipeline" if newer else "; re-ingest into a new file"),
                code="TSDB_SCHEMA_VERSION",
            )

    def close(self) -> None:
        with self._lock:
            self._prefetched.clear()
            if self._con is not None:
                try:
                    self._con.close()
                finally:
                    self._con = None

    def __enter__(self) -> DuckDBTsdb:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "ro" if self.read_only else "rw"
        state = "closed" if self._con is None else "open"
        return f"DuckDBTsdb({str(self.path)!r}, {mode}, {state})"

    @property
    def _c(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            raise TsdbError(f"{self.url}: this TSDB handle is closed")
        return self._con

    # ---- catalog ---------------------------------------------------------------------------
    def list_runs(self, scope: RunScope | None = None, finished_only: bool = True) -> list[Run]:
        where: list[str] = []
        params: list[Any] = []
        if scope is not None:
            for column, value in (
                ("line_id", scope.line_id),
                ("product_id", scope.product_id),
                ("recipe_id", scope.recipe_id),
            ):
                if value is not None:
                    where.append(f"{column} = ?")
                    params.append(value)
            if scope.to_ms is not None:
                where.append("started_at <= ?")
                params.append(clamp_i64(scope.to_ms))
            if scope.from_ms is not None:
                where.append("(ended_at IS NULL OR ended_at >= ?)")
                params.append(clamp_i64(scope.from_ms))
        if finished_only:
            where.append("ended_at IS NOT NULL")
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

    def point_count(self, run_id: str | None = None, node_id: str | None = None) -> int:
        """Number of stored points (optionally of one run and/or node); not part of the port."""
        where, params = [], []
        with self._lock:
            if run_id is not None:
                where.append("run_key = ?")
                params.append(self._run_key(run_id))
            if node_id is not None:
                where.append("node_key = ?")
                params.append(self._node_key(node_id))
            sql = "SELECT count(*) FROM points" + (" WHERE " + " AND ".join(where) if where else "")
            return int(self._c.execute(sql, params).fetchall()[0][0])

    def _run_key(self, run_id: str) -> int:
        key = self._run_keys.get(run_id)
        if key is None:
            rows = self._c.execute(
                "SELECT run_key FROM runs WHERE run_id = ?", [run_id]
            ).fetchall()
            if not rows:
                raise UnknownRunError(f"unknown run {run_id!r}: not in {self.url}")
            key = self._run_keys[run_id] = int(rows[0][0])
        return key

    def _node_key(self, node_id: str) -> int:
        key = self._node_keys.get(node_id)
        if key is None:
            rows = self._c.execute(
                "SELECT node_key FROM nodes WHERE node_id = ?", [node_id]
            ).fetchall()
            if not rows:
                raise UnknownNodeError(f"unknown node {node_id!r}: not in {self.url}")
            key = self._node_keys[node_id] = int(rows[0][0])
        return key

    # ---- points ----------------------------------------------------------------------------
    def query_page(
        self,
        node_id: str,
        run_id: str,
        from_ms: int,
        to_ms: int,
        cursor: Cursor | None = None,
        limit: int = DEFAULT_PAGE_LIMIT,
    ) -> Page:
        """Keyset page on ``(ts, seq)``; ``done`` is exact (``limit + 1`` rows are asked for)."""
        limit = int(limit)
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        with self._lock:
            self._c  # noqa: B018 - raises if this handle is closed
            key = (node_id, run_id, from_ms, to_ms)
            if key in self._prefetched:
                return self._prefetched_page(key, cursor, limit)
            run_key = self._run_key(run_id)
            node_key = self._node_key(node_id)
            lo, hi = clamp_i64(from_ms), clamp_i64(to_ms)
            where = "run_key = ? AND node_key = ? AND ts BETWEEN ? AND ?"
            if cursor is not None:
                # ts >= cursor.ts is folded into the range (so zone maps prune on it); within it,
                # (ts, seq) > cursor  <=>  ts > cursor.ts OR seq > cursor.seq.
                lo = max(lo, clamp_i64(cursor.ts))
                where += " AND (ts > ? OR seq > ?)"
            if lo > hi:
                return empty_page(cursor)
            params: list[Any] = [run_key, node_key, lo, hi]
            if cursor is not None:
                params += [clamp_i64(cursor.ts), clamp_i64(cursor.seq)]
            cols = None
            if cursor is None:
                # First page: most series fit in one page. An unordered LIMIT limit+1 that
                # returns <= limit rows returned them all, and sorting them here is cheaper
                # than DuckDB's top-N. Continuation pages go straight to the ordered query.
                cols = self._read(
                    f"SELECT ts, value, state, seq FROM points WHERE {where} LIMIT ?",
                    [*params, limit + 1],
                )
                if len(cols["ts"]) > limit:
                    cols = None
                else:
                    cols = sorted_by_ts_seq(cols)
            if cols is None:
                cols = self._read(
                    f"SELECT ts, value, state, seq FROM points WHERE {where} "
                    "ORDER BY ts, seq LIMIT ?",
                    [*params, limit + 1],
                )
        ts = np.asarray(cols["ts"], dtype=np.int64)
        value = np.asarray(cols["value"], dtype=np.float64)
        state = np.asarray(cols["state"], dtype=np.int32)
        seq = np.asarray(cols["seq"], dtype=np.int64)
        done = ts.shape[0] <= limit
        if not done:
            ts, value, state, seq = ts[:limit], value[:limit], state[:limit], seq[:limit]
        next_cursor = Cursor(int(ts[-1]), int(seq[-1])) if ts.shape[0] else cursor
        return Page(ts, value, state, seq, next_cursor, done)

    def prefetch(self, run_id: str, node_ids: Sequence[str], from_ms: int, to_ms: int) -> None:
        """Read the points of ``node_ids`` in ``run_id`` within ``[from_ms, to_ms]`` in one query
        and serve the next :meth:`query_page` calls for exactly those series from memory.

        Not part of the port: an optional hint the pipeline gives before it reads a run node by
        node (one scan of the run's row groups instead of one per node). Pages served from
        memory are what the SQL path returns (same rows, order, limits and cursors). A
        series is dropped once its last page has been served; a new prefetch replaces the old
        one. Memory: one run's points of these nodes, which the caller holds anyway.
        """
        with self._lock:
            self._c  # noqa: B018 - raises if this handle is closed
            self._prefetched.clear()
            run_key = self._run_key(run_id)
            keys: dict[int, str] = {}
            for node_id in dict.fromkeys(node_ids):
                try:
                    keys[self._node_key(node_id)] = node_id
                except UnknownNodeError:
                    continue  # query_page reports it when that node is asked for
            lo, hi = clamp_i64(from_ms), clamp_i64(to_ms)
            if not keys or lo > hi:
                return
            node_list = ", ".join(str(int(k)) for k in keys)  # integers from our own catalog
            cols = self._read(
                "SELECT node_key, ts, value, state, seq FROM points "
                f"WHERE run_key = ? AND node_key IN ({node_list}) AND ts BETWEEN ? AND ?",
                [run_key, lo, hi],
            )
        nk = np.asarray(cols["node_key"], dtype=np.int64)
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
        with self._lock:
            for k, node_id in keys.items():
                a, b = np.searchsorted(nk, k, "left"), np.searchsorted(nk, k, "right")
                self._prefetched[(node_id, run_id, from_ms, to_ms)] = (ts[a:b], value[a:b], state[a:b], seq[a:b])

    def _prefetched_page(self, key: tuple[str, str, int, int], cursor: Cursor | None, limit: int) -> Page:
        ts, value, state, seq = self._prefetched[key]
        pos = 0
        if cursor is not None:  # first row with (ts, seq) > cursor
            c_ts, c_seq = clamp_i64(cursor.ts), clamp_i64(cursor.seq)
            lo, hi = int(np.searchsorted(ts, c_ts, "left")), int(np.searchsorted(ts, c_ts, "right"))
            pos = lo + int(np.searchsorted(seq[lo:hi], c_seq, "right"))
        end = min(pos + limit, ts.shape[0])
        done = ts.shape[0] - pos <= limit
        if done:
            del self._prefetched[key]
        ts, value, state, seq = ts[pos:end], value[pos:end], state[pos:end], seq[pos:end]
        next_cursor = Cursor(int(ts[-1]), int(seq[-1])) if ts.shape[0] else cursor
        return Page(ts, value, state, seq, next_cursor, done)

    # ---- ingest ----------------------------------------------------------------------------
    def ingest(
        self,
        *,
        runs: Sequence[Run] = (),
        nodes: Sequence[Node] = (),
        points: PointColumns | None = None,
    ) -> int:
        if self.read_only:
            raise TsdbError(f"{self.url} is open read-only; open it with read_only=False to ingest")
        runs, nodes = list(runs), list(nodes)
        runs_tab = runs_table(runs)
        nodes_tab = nodes_table(nodes)
        prepared = prepare_points(points) if points is not None and len(points) else None
        with _ingest_lock(self.path), self._lock:
            con = self._c
            con.execute("BEGIN TRANSACTION")
            try:
                if nodes_tab is not None:
                    self._upsert_nodes(con, nodes_tab)
                if runs_tab is not None:
                    self._upsert_runs(con, runs_tab)
                written = 0
                if prepared is not None:
                    written = self._append_points(con, prepared)
                con.execute("COMMIT")
            except BaseException as e:
                try:
                    con.execute("ROLLBACK")
                except duckdb.Error:
                    pass
                # Keys assigned inside the rolled-back transaction must not stay cached.
                self._run_keys.clear()
                self._node_keys.clear()
                if isinstance(e, duckdb.Error):
                    raise IngestError(f"{self.url}: ingest failed, nothing written ({_one_line(e)})") from e
                raise
        return written

    @staticmethod
    def _upsert_nodes(con: duckdb.DuckDBPyConnection, tab: pa.Table) -> None:
        con.register("_aml_nodes", tab)
        try:
            con.execute(
                """INSERT INTO nodes (node_id, node_key, unit, range_lo, range_hi)
                SELECT s.node_id,
                       (SELECT coalesce(max(node_key), 0) FROM nodes) + row_number() OVER (ORDER BY s.ord),
                       s.unit, s.range_lo, s.range_hi
                FROM _aml_nodes s
                ON CONFLICT (node_id) DO UPDATE SET
                    unit = excluded.unit, range_lo = excluded.range_lo, range_hi = excluded.range_hi"""
            )
        finally:
            con.unregister("_aml_nodes")

    @staticmethod
    def _upsert_runs(con: duckdb.DuckDBPyConnection, tab: pa.Table) -> None:
        con.register("_aml_runs", tab)
        try:
            con.execute(
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
                    context_confirmed = excluded.context_confirmed"""
            )
        finally:
            con.unregister("_aml_runs")

    def _append_points(self, con: duckdb.DuckDBPyConnection, p: PreparedPoints) -> int:
        run_map = _key_map(con, "runs", "run_id", "run_key", p.run_uniques)
        node_map = _key_map(con, "nodes", "node_id", "node_key", p.node_uniques)
        run_keys = codes_to_keys(p, p.run_codes, p.run_uniques, run_map, "run")
        node_keys = codes_to_keys(p, p.node_codes, p.node_uniques, node_map, "node")
        base = int(con.execute("SELECT coalesce(max(seq), -1) + 1 FROM points").fetchall()[0][0])
        n = p.n
        tab = pa.table(
            {
                "run_key": pa.array(run_keys, type=pa.int32()),
                "node_key": pa.array(node_keys, type=pa.int32()),
                "ts": pa.array(p.ts, type=pa.int64()),
                "value": pa.array(p.value, type=pa.float64()),
                "state": pa.array(p.state, type=pa.int32()),
                "seq": pa.array(np.arange(base, base + n, dtype=np.int64), type=pa.int64()),
            }
        )
        con.register("_aml_points", tab)
        try:
            con.execute(
                "INSERT INTO points SELECT run_key, node_key, ts, value, state, seq "
                "FROM _aml_points ORDER BY run_key, node_key, ts, seq"
            )
        finally:
            con.unregister("_aml_points")
        self._run_keys.update(run_map)
        self._node_keys.update(node_map)
        return n


# ---- helpers -------------------------------------------------------------------------------


def _key_map(
    con: duckdb.DuckDBPyConnection, table: str, id_col: str, key_col: str, ids: list[Any]
) -> dict[str, int]:
    if not ids:
        return {}
    wanted = pa.table({"id": pa.array([str(i) for i in ids], type=pa.string())})
    con.register("_aml_ids", wanted)
    try:
        rows = con.execute(
            f"SELECT t.{id_col}, t.{key_col} FROM {table} t JOIN _aml_ids w ON t.{id_col} = w.id"
        ).fetchall()
    finally:
        con.unregister("_aml_ids")
    return {r[0]: int(r[1]) for r in rows}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


_HOLDER_RE = re.compile(r"Conflicting lock is held in (.+?) \(PID (\d+)\)")


def _lock_holder(text: str) -> str:
    m = _HOLDER_RE.search(text)
    return f"; held by PID {m.group(2)} ({m.group(1)})" if m else ""
