"""The PostgreSQL TSDB adapter (psycopg 3): a real server, keyset pages, bulk COPY ingest.

URL
    ``postgresql://user@host:5432/db`` (``postgres://`` too), any libpq URI: extra query
    parameters (``sslmode``, ``connect_timeout``, ...) go to libpq. One parameter is the
    adapter's own: ``?schema=NAME`` picks the PostgreSQL schema holding the tables (default
    :data:`DEFAULT_SCHEMA`; ``[a-z_][a-z0-9_]*``, at most 63 characters, not ``pg_*``).
    Passwords belong in the environment (``PGPASSWORD``, ``~/.pgpass``, or a URL taken from
    ``AML_TSDB_URL``), never in code. :attr:`PostgresTsdb.url` is the URL with any password
    replaced by ``***``, and no error message ever carries the password.

Schema (version :data:`SCHEMA_VERSION`, recorded in ``<schema>.schema_version``)
    ``runs(run_key PK, run_id UNIQUE, line_id, product_id, recipe_id, recipe_version,
    recipe_content_hash, started_at, ended_at, evidence_source, context_confirmed)``,
    ``nodes(node_key PK, node_id UNIQUE, unit, range_lo, range_hi)``,
    ``points(ts, seq, value, run_key, node_key, state)`` with primary key
    ``(run_key, node_key, ts, seq)``, ``ingest_state(next_seq, max_ts)`` (one row),
    ``run_state(run_key PK, data_version, point_count)`` (version 2: each run's data version,
    :mod:`aml_pipeline.tsdb.versions`) and the view
    ``points_by_id(run_id, node_id, ts, value, state, seq)`` for people querying by id. A
    version-1 schema is migrated in place, in one transaction, by the first read-write open;
    read-only handles read it as it is.

    Points carry integer surrogate keys (assigned once, on first insert, never changed) like
    the embedded adapter: 8 bytes per row instead of two id strings, and a narrow index. The
    primary key is the read index: one series (run, node) is one contiguous key range, in
    ``(ts, seq)`` order, so a page is one index range scan with no sort, and keyset resumption
    is an index seek. It includes the time column, so ``points`` can be made a TimescaleDB
    hypertable as is (``docs/postgres.md``): a hypertable's unique indexes must contain it.
    There are no foreign keys from ``points`` (the adapter resolves ids itself; per-row FK
    checks would slow COPY down), and every ingest writes its points sorted by
    ``(run_key, node_key, ts, seq)``, so a series occupies few, contiguous heap pages.

Ingest
    One transaction (:func:`aml_pipeline.tsdb.writer.write_ingest` decides what it writes): lock
    the ``ingest_state`` row (concurrent ingests queue there, at most ``lock_timeout_s``, so
    their ``seq`` ranges never interleave), upsert nodes and changed runs, resolve keys, find
    the points already stored (the candidates are COPYed into a temporary table and
    semi-joined with ``points``; only runs that have points are checked), ``COPY ... FROM
    STDIN (FORMAT BINARY)`` the new points (the COPY buffer is built with numpy), advance
    ``next_seq`` and ``max_ts``, store the runs' new data versions, commit. Anything failing
    rolls everything back; a server out of disk space is ``DISK_FULL``. ``seq`` is
    ``next_seq + row index`` in the order given (file row order) over the points written,
    starting at 0 like the embedded adapter, so the same ingests give the same ``seq`` in both.

Reads
    A page is ``SELECT ... WHERE run_key = ? AND node_key = ? AND ts BETWEEN ? AND ?
    [AND (ts, seq) > (cursor)] ORDER BY ts, seq LIMIT limit + 1``, aggregated on the server
    into four packed big-endian binary columns (``string_agg(int8send(ts), '')``, ...) so
    one row crosses the wire per page and numpy decodes it without a Python object per point.
    The order is checked on the client (and restored if a plan ever changed it).

    ``availability_watermark`` is ``ingest_state.max_ts``, maintained by every ingest in its
    transaction (O(1) instead of a scan of all points; it never decreases, also when
    ``replace_runs`` removed the latest points). Points must therefore be written through this
    adapter, which they must be anyway: it assigns ``seq``.

Connections
    One connection per instance (autocommit; ingest opens an explicit transaction), used
    under a lock, reconnected once if the server dropped it
    (:class:`~aml_pipeline.pg_connection.PgConnection`, which also classifies failures and
    scrubs messages for every PostgreSQL user of the product). ``close()`` or ``with``. A
    :class:`~aml_pipeline.tsdb.session.TsdbSession` keeps its one connection for its whole
    life: MVCC readers never block an ingest, so there is nothing to release between chunks.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import numpy as np
import psycopg
import pyarrow as pa
from psycopg import sql
from psycopg.types.numeric import Int4, Int8

from aml_pipeline.errors import (
    IngestError,
    TsdbBusyError,
    TsdbError,
    TsdbUnavailableError,
    UnknownNodeError,
    UnknownRunError,
    disk_full,
)
from aml_pipeline.faults import crash_point
from aml_pipeline.pg_connection import PgConnectError, PgConnection

# Validation and the error messages are shared with the embedded adapter on purpose: both
# adapters must refuse the same inputs with the same words.
from aml_pipeline.tsdb.columns import (
    check_schema_version,
    clamp_i64,
    nodes_table,
    opt_float,
    prepare_points,
    run_from_row,
    runs_table,
)
from aml_pipeline.tsdb.port import (
    DEFAULT_LOCK_TIMEOUT_S,
    Cursor,
    Node,
    PointColumns,
    Run,
    RunScope,
)
from aml_pipeline.tsdb.reading import ReadBase, Rows
from aml_pipeline.tsdb.versions import migrated_version
from aml_pipeline.tsdb.writer import PointRows, RunState, StoredRun, write_ingest
from aml_pipeline.urls import redact_url, url_secrets

SCHEMA_VERSION = 2
DEFAULT_SCHEMA = "aml"
URL_SCHEMES = ("postgresql", "postgres")

_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# Rows per server round trip of a page: bounds the size of one aggregated bytea value (PostgreSQL
# refuses values over 1 GB); a larger ``limit`` is served by several queries.
_MAX_ROWS_PER_QUERY = 4_000_000
# Points per binary COPY chunk written during ingest (bounds the client-side buffer).
_COPY_CHUNK_ROWS = 262_144
_PGCOPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
_PGCOPY_TRAILER = b"\xff\xff"
# The binary COPY row of points and of the candidates of the stored-points check: the PostgreSQL
# type of each column, as big-endian numpy dtypes (see _pgcopy_rows).
_POINT_FIELDS = (("ts", ">i8"), ("seq", ">i8"), ("value", ">f8"), ("run_key", ">i4"), ("node_key", ">i4"), ("state", ">i4"))
_CANDIDATE_FIELDS = (
    ("idx", ">i8"), ("run_key", ">i4"), ("node_key", ">i4"), ("ts", ">i8"),
    ("value", ">f8"), ("state", ">i4"), ("neg_zero", "?"),
)  # fmt: skip
_NEG_ZERO = b"\x80" + b"\x00" * 7  # float8send(-0.0)

# Version 1 as it was: a fresh schema is created at version 1 and migrated, the path every
# version-1 schema takes.
_DDL_V1 = (
    """CREATE TABLE {s}.schema_version (
        version integer NOT NULL,
        applied_at_ms bigint NOT NULL
    )""",
    """CREATE TABLE {s}.ingest_state (
        id boolean PRIMARY KEY DEFAULT true CHECK (id),
        next_seq bigint NOT NULL,
        max_ts bigint
    )""",
    "INSERT INTO {s}.ingest_state (id, next_seq, max_ts) VALUES (true, 0, NULL)",
    """CREATE TABLE {s}.runs (
        run_key integer PRIMARY KEY,
        run_id text NOT NULL UNIQUE,
        line_id text NOT NULL,
        product_id text NOT NULL,
        recipe_id text NOT NULL,
        recipe_version integer,
        recipe_content_hash text,
        started_at bigint NOT NULL,
        ended_at bigint,
        evidence_source text NOT NULL
            CHECK (evidence_source IN ('simulation', 'real', 'unassessed')),
        context_confirmed boolean NOT NULL DEFAULT false,
        CHECK (ended_at IS NULL OR ended_at >= started_at)
    )""",
    """CREATE TABLE {s}.nodes (
        node_key integer PRIMARY KEY,
        node_id text NOT NULL UNIQUE,
        unit text NOT NULL DEFAULT '',
        range_lo double precision,
        range_hi double precision
    )""",
    # 8-byte columns first: no alignment padding inside the row.
    """CREATE TABLE {s}.points (
        ts bigint NOT NULL,
        seq bigint NOT NULL,
        value double precision NOT NULL,
        run_key integer NOT NULL,
        node_key integer NOT NULL,
        state integer NOT NULL,
        CONSTRAINT points_pkey PRIMARY KEY (run_key, node_key, ts, seq)
    )""",
    """CREATE VIEW {s}.points_by_id AS
        SELECT r.run_id, n.node_id, p.ts, p.value, p.state, p.seq
        FROM {s}.points p JOIN {s}.runs r USING (run_key) JOIN {s}.nodes n USING (node_key)""",
)
_DDL_V2 = (
    """CREATE TABLE {s}.run_state (
        run_key integer PRIMARY KEY,
        data_version text NOT NULL,
        point_count bigint NOT NULL
    )""",
)
_OWN_TABLES = ("schema_version", "ingest_state", "runs", "nodes", "points", "points_by_id", "run_state")

_RUN_COLUMNS = (
    "run_id, line_id, product_id, recipe_id, recipe_version, recipe_content_hash, "
    "started_at, ended_at, evidence_source, context_confirmed"
)

_PAGE_SQL = """SELECT count(*)::int8,
    string_agg(int8send(p.ts), ''), string_agg(float8send(p.value), ''),
    string_agg(int4send(p.state), ''), string_agg(int8send(p.seq), '')
FROM (
    SELECT ts, value, state, seq FROM {s}.points
    WHERE run_key = %s AND node_key = %s AND ts BETWEEN %s AND %s{after}
    ORDER BY ts, seq
    LIMIT %s
) p"""
_AFTER_SQL = " AND (ts, seq) > (%s, %s)"

_UPSERT_NODES = """INSERT INTO {s}.nodes (node_key, node_id, unit, range_lo, range_hi)
SELECT (SELECT coalesce(max(node_key), 0) FROM {s}.nodes) + i.ord,
       i.node_id, i.unit, i.range_lo, i.range_hi
FROM unnest(%s::text[], %s::text[], %s::float8[], %s::float8[])
     WITH ORDINALITY AS i(node_id, unit, range_lo, range_hi, ord)
ON CONFLICT (node_id) DO UPDATE SET
    unit = excluded.unit, range_lo = excluded.range_lo, range_hi = excluded.range_hi"""

_UPSERT_RUNS = """INSERT INTO {s}.runs (run_key, run_id, line_id, product_id, recipe_id,
    recipe_version, recipe_content_hash, started_at, ended_at, evidence_source, context_confirmed)
SELECT (SELECT coalesce(max(run_key), 0) FROM {s}.runs) + i.ord,
       i.run_id, i.line_id, i.product_id, i.recipe_id, i.recipe_version, i.recipe_content_hash,
       i.started_at, i.ended_at, i.evidence_source, i.context_confirmed
FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::int4[], %s::text[],
            %s::int8[], %s::int8[], %s::text[], %s::bool[])
     WITH ORDINALITY AS i(run_id, line_id, product_id, recipe_id, recipe_version,
                          recipe_content_hash, started_at, ended_at, evidence_source,
                          context_confirmed, ord)
ON CONFLICT (run_id) DO UPDATE SET
    line_id = excluded.line_id, product_id = excluded.product_id,
    recipe_id = excluded.recipe_id, recipe_version = excluded.recipe_version,
    recipe_content_hash = excluded.recipe_content_hash,
    started_at = excluded.started_at, ended_at = excluded.ended_at,
    evidence_source = excluded.evidence_source,
    context_confirmed = excluded.context_confirmed"""


# ---- URL ---------------------------------------------------------------------------------------


class _ParsedUrl:
    __slots__ = ("conninfo", "schema", "redacted", "secrets")

    def __init__(self, conninfo: str, schema: str, redacted: str, secrets: list[str]) -> None:
        self.conninfo = conninfo  # what libpq gets (no ?schema=)
        self.schema = schema
        self.redacted = redacted  # for messages and .url
        self.secrets = secrets  # strings that must never appear in a message


def parse_postgres_url(url: str) -> _ParsedUrl:
    """Split ``?schema=`` off a libpq URL, validate it, and build the password-free form."""
    if not isinstance(url, str):
        raise TsdbError(f"not a PostgreSQL URL: {url!r}", code="TSDB_URL_INVALID")
    parts = urlsplit(url)
    if parts.scheme not in URL_SCHEMES:
        raise TsdbError(
            f"not a PostgreSQL URL: {redact_url(url)!r} (use postgresql://user@host:5432/db)",
            code="TSDB_URL_INVALID",
        )
    if parts.fragment:
        raise TsdbError(
            f"PostgreSQL URL {redact_url(url)!r} must not have a fragment", code="TSDB_URL_INVALID"
        )
    schema = DEFAULT_SCHEMA
    passthrough: list[tuple[str, str]] = []
    seen_schema = False
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key != "schema":
            passthrough.append((key, value))
            continue
        if seen_schema:
            raise TsdbError(f"PostgreSQL URL {redact_url(url)!r}: schema= given twice", code="TSDB_URL_INVALID")
        seen_schema, schema = True, value
    redacted = redact_url(url)
    check_schema_name(schema, redacted)
    # quote, not quote_plus: libpq decodes %20 but takes "+" literally (options=-c%20x%3Dy).
    conninfo = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(passthrough, quote_via=quote), ""))
    return _ParsedUrl(conninfo, schema, redacted, url_secrets(url))


def check_schema_name(schema: str, where: str = "") -> str:
    """A schema name the adapter accepts: lower-case identifier, not ``pg_*``."""
    if (
        not isinstance(schema, str)
        or not _SCHEMA_RE.fullmatch(schema)
        or schema.startswith("pg_")
        or schema == "information_schema"
    ):
        prefix = f"{where}: " if where else ""
        raise TsdbError(
            f"{prefix}schema {schema!r} is not usable: use a lower-case name matching "
            "[a-z_][a-z0-9_]* (at most 63 characters, not pg_* or information_schema)",
            code="TSDB_URL_INVALID",
        )
    return schema


# ---- adapter -----------------------------------------------------------------------------------


class PostgresTsdb(ReadBase):
    """:class:`~aml_pipeline.tsdb.port.TsdbPort` over a PostgreSQL schema.

    ``read_only=False`` (the default, and what :func:`~aml_pipeline.tsdb.open_adapter` gives)
    creates the schema and its tables if they are missing (or migrates a version-1 schema);
    ``read_only=True`` requires them, sets the session read-only and refuses :meth:`ingest`.
    ``lock_timeout_s`` bounds how long an ingest waits for another one to commit.
    """

    def __init__(
        self,
        url: str,
        read_only: bool = False,
        *,
        connect_timeout_s: float = 10.0,
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
    ) -> None:
        super().__init__()
        parsed = parse_postgres_url(url)
        self._parsed = parsed
        self.url = parsed.redacted
        self.schema = parsed.schema
        self.read_only = bool(read_only)
        self.connect_timeout_s = float(connect_timeout_s)
        self.lock_timeout_s = float(lock_timeout_s)
        self.schema_version = SCHEMA_VERSION
        self._run_keys: dict[str, int] = {}
        self._node_keys: dict[str, int] = {}
        s = sql.Identifier(self.schema)
        self._sql = {
            name: sql.SQL(text).format(s=s)
            for name, text in (
                ("page", _PAGE_SQL.replace("{after}", "")),
                ("page_after", _PAGE_SQL.replace("{after}", _AFTER_SQL)),
                ("upsert_nodes", _UPSERT_NODES),
                ("upsert_runs", _UPSERT_RUNS),
            )
        }
        self._pg = PgConnection(
            parsed.conninfo,
            defaults={"connect_timeout": max(1, int(round(self.connect_timeout_s))), "application_name": "aml_pipeline"},
            settings=["SET default_transaction_read_only = on"] if self.read_only else [],
            # Page queries are simple scans: JIT compilation (kicking in for large pages once the
            # table has statistics) would only add its compile time to every page.
            optional_settings=["SET jit = off"],
            secrets=parsed.secrets,
        )
        conn = self._c
        try:
            self._render_statements(conn)
            self._init_schema()
        except BaseException:
            self._pg.close()
            self._closed = True
            raise

    # ---- lifecycle -----------------------------------------------------------------------------
    def _render_statements(self, conn: psycopg.Connection) -> None:
        self._q = {k: v.as_string(conn) for k, v in self._sql.items()}
        s = sql.Identifier(self.schema).as_string(conn)
        self._s = s
        self._q.update(
            runs=f"SELECT {_RUN_COLUMNS} FROM {s}.runs",
            nodes=(
                f"SELECT node_id, unit, range_lo, range_hi FROM {s}.nodes "
                'ORDER BY node_id COLLATE "C"'
            ),
            run_key=f"SELECT run_key FROM {s}.runs WHERE run_id = %s",
            node_key=f"SELECT node_key FROM {s}.nodes WHERE node_id = %s",
            run_keys=f"SELECT run_id, run_key FROM {s}.runs WHERE run_id = ANY(%s::text[])",
            node_keys=f"SELECT node_id, node_key FROM {s}.nodes WHERE node_id = ANY(%s::text[])",
            watermark=f"SELECT max_ts FROM {s}.ingest_state",
            lock_state=f"SELECT next_seq FROM {s}.ingest_state FOR UPDATE",
            advance_state=(
                # greatest() ignores NULL: the first ingest sets max_ts.
                f"UPDATE {s}.ingest_state SET next_seq = next_seq + %s, max_ts = greatest(max_ts, %s)"
            ),
            copy_points=(
                f"COPY {s}.points (ts, seq, value, run_key, node_key, state) "
                "FROM STDIN (FORMAT BINARY)"
            ),
            stored_runs=(
                f"SELECT r.run_key, {', '.join('r.' + c.strip() for c in _RUN_COLUMNS.split(','))}, "
                f"coalesce(s.data_version, ''), coalesce(s.point_count, 0) FROM {s}.runs r "
                f"LEFT JOIN {s}.run_state s USING (run_key) WHERE r.run_id = ANY(%s::text[])"
            ),
            run_versions=(
                f"SELECT r.run_id, s.data_version FROM {s}.runs r JOIN {s}.run_state s "
                "USING (run_key) WHERE r.run_id = ANY(%s::text[])"
            ),
            # Each run's point count and seq range: what a version-1 schema can say about it.
            v1_runs=(
                f"SELECT r.run_key, {', '.join('r.' + c.strip() for c in _RUN_COLUMNS.split(','))}, "
                f"coalesce(c.n, 0), c.lo, c.hi FROM {s}.runs r LEFT JOIN ("
                f"SELECT p.run_key, count(*) AS n, min(p.seq) AS lo, max(p.seq) AS hi FROM {s}.points p "
                f"WHERE p.run_key IN (SELECT run_key FROM {s}.runs WHERE %(all)s OR run_id = ANY(%(ids)s::text[])) "
                "GROUP BY p.run_key) c USING (run_key) "
                "WHERE %(all)s OR r.run_id = ANY(%(ids)s::text[])"
            ),
            save_states=(
                f"INSERT INTO {s}.run_state (run_key, data_version, point_count) "
                "SELECT * FROM unnest(%s::int4[], %s::text[], %s::int8[]) "
                "ON CONFLICT (run_key) DO UPDATE SET data_version = excluded.data_version, "
                "point_count = excluded.point_count"
            ),
            delete_points=f"DELETE FROM {s}.points WHERE run_key = ANY(%s::int4[])",
            # ON COMMIT DROP: the table lives as long as the ingest transaction.
            candidates_table=(
                "CREATE TEMPORARY TABLE IF NOT EXISTS aml_candidates (idx int8, run_key int4, "
                "node_key int4, ts int8, value float8, state int4, neg_zero bool) ON COMMIT DROP"
            ),
            copy_candidates=(
                "COPY aml_candidates (idx, run_key, node_key, ts, value, state, neg_zero) "
                "FROM STDIN (FORMAT BINARY)"
            ),
            # NaN = NaN and -0.0 = 0.0 for float8 '='; neg_zero tells the zeros apart. A plain
            # join, not EXISTS: a candidate stored twice comes back twice, which costs nothing,
            # while EXISTS made PostgreSQL de-duplicate all of points first.
            stored_candidates=(
                "SELECT count(*)::int8, string_agg(int8send(c.idx), '') FROM aml_candidates c "
                f"JOIN {s}.points p ON p.run_key = c.run_key AND p.node_key = c.node_key "
                "AND p.ts = c.ts AND p.state = c.state AND p.value = c.value "
                "AND (float8send(p.value) = %s) = c.neg_zero "
                # only the runs concerned: with a few late points the plan is index probes
                "WHERE p.run_key = ANY(%s::int4[])"
            ),
        )

    def _init_schema(self) -> None:
        conn = self._c
        version = self._schema_version(conn)
        if version is None and self.read_only:
            raise TsdbError(
                f"{self.url}: schema {self.schema!r} holds no TSDB yet; ingest data first "
                "(aml-pipeline ingest --tsdb ..., or aml-pipeline demo)",
                code="TSDB_EMPTY",
            )
        if version is not None:
            check_schema_version(version, SCHEMA_VERSION, f"{self.url}: schema {self.schema!r}", "schema")
            if version == SCHEMA_VERSION or self.read_only:
                self.schema_version = version
                return
        try:
            with conn.transaction():
                # Two processes creating or migrating the same schema at once: the second waits
                # here, then finds the version the first one recorded.
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [_lock_id(self.schema)])
                version = self._schema_version(conn)
                if version is None:
                    self._create_schema(conn)
                    version = 1
                if version == 1:
                    self._migrate_to_v2(conn)
        except psycopg.Error as e:
            full = disk_full(e, f"{self.url} (PostgreSQL server: {self._scrub(e)})")
            if full is not None:
                raise full from None
            raise TsdbError(
                f"{self.url}: cannot create or migrate the TSDB schema {self.schema!r} ({self._scrub(e)})"
            ) from None

    def _schema_version(self, conn: psycopg.Connection) -> int | None:
        try:
            has = conn.execute(
                "SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = 'schema_version'",
                [self.schema],
            ).fetchone()
            if not has:
                return None
            row = conn.execute(f"SELECT max(version) FROM {self._s}.schema_version").fetchone()
        except psycopg.Error as e:
            raise TsdbError(
                f"{self.url}: cannot read the TSDB schema {self.schema!r} ({self._scrub(e)})"
            ) from None
        return None if row is None or row[0] is None else int(row[0])

    def _create_schema(self, conn: psycopg.Connection) -> None:
        """Version 1 of the schema (then migrated like any version-1 schema)."""
        exists = conn.execute(
            "SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s", [self.schema]
        ).fetchone()
        if exists:
            clashing = [
                r[0]
                for r in conn.execute(
                    "SELECT c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
                    "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = ANY(%s) "
                    "ORDER BY 1",
                    [self.schema, list(_OWN_TABLES)],
                ).fetchall()
            ]
            if clashing:
                raise TsdbError(
                    f"{self.url}: schema {self.schema!r} belongs to something else (it has "
                    f"{', '.join(clashing)} but no aml_pipeline schema_version); refusing to "
                    "change it, use another schema (?schema=...)",
                    code="TSDB_SCHEMA_VERSION",
                )
        else:
            # Only when missing: CREATE SCHEMA needs CREATE on the database even with IF NOT
            # EXISTS, which a role given just a pre-made schema does not have.
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema)))
        for ddl in _DDL_V1:
            conn.execute(sql.SQL(ddl).format(s=sql.Identifier(self.schema)))
        conn.execute(
            f"INSERT INTO {self._s}.schema_version (version, applied_at_ms) VALUES (1, %s)",
            [int(time.time() * 1000)],
        )

    def _migrate_to_v2(self, conn: psycopg.Connection) -> None:
        """Version 1 -> 2: ``run_state`` with each run's first data version and point count (one
        pass over the points, once)."""
        for ddl in _DDL_V2:
            conn.execute(sql.SQL(ddl).format(s=sql.Identifier(self.schema)))
        rows = conn.execute(self._q["v1_runs"], {"all": True, "ids": []}).fetchall()
        _Statements(self, conn, next_seq=0).save_run_states(
            [RunState(int(r[0]), migrated_version(run_from_row(r[1:11]), int(r[11]), r[12], r[13]), int(r[11])) for r in rows]
        )
        conn.execute(
            f"INSERT INTO {self._s}.schema_version (version, applied_at_ms) VALUES (2, %s)",
            [int(time.time() * 1000)],
        )

    def _release(self) -> None:
        self._pg.close()

    def __repr__(self) -> str:
        mode = "ro" if self.read_only else "rw"
        state = "closed" if self._closed else "open"
        return f"PostgresTsdb({self.url!r}, schema={self.schema!r}, {mode}, {state})"

    @property
    def _c(self) -> psycopg.Connection:
        """The connection; reopened once if the server dropped it (e.g. a restart)."""
        self._require_open()
        try:
            return self._pg.connection()
        except PgConnectError as e:
            if e.kind == "invalid":  # e.g. a URL parameter libpq does not know
                raise TsdbError(f"{self.url}: cannot connect ({e.detail})", code="TSDB_URL_INVALID") from None
            error = TsdbUnavailableError if e.transient else TsdbError
            raise error(f"{self.url}: cannot connect ({e.detail})") from None

    def _scrub(self, e: BaseException | str) -> str:
        return self._pg.scrub(e)

    @contextmanager
    def _reading(self, what: str) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as e:
            raise (TsdbUnavailableError if self._pg.lost(e) else TsdbError)(
                f"{self.url}: {what} failed ({self._scrub(e)})"
            ) from None

    # ---- catalog -------------------------------------------------------------------------------
    def list_runs(self, scope: RunScope | None = None, finished_only: bool = True) -> list[Run]:
        conds = (scope or RunScope()).sql_conditions(finished_only=finished_only)
        where = [c.replace("?", "%s") for c, _ in conds]
        params = [Int8(v) if isinstance(v, int) else v for _, v in conds if v is not None]
        query = self._q["runs"]
        if where:
            query += " WHERE " + " AND ".join(where)
        query += " ORDER BY started_at, run_id COLLATE \"C\""
        with self._lock, self._reading("listing runs"):
            rows = self._c.execute(query, params).fetchall()
        return [run_from_row(r) for r in rows]

    def get_run(self, run_id: str) -> Run:
        with self._lock, self._reading(f"reading run {run_id!r}"):
            rows = self._c.execute(self._q["runs"] + " WHERE run_id = %s", [run_id]).fetchall()
        if not rows:
            raise UnknownRunError(f"unknown run {run_id!r}: not in {self.url}")
        return run_from_row(rows[0])

    def list_nodes(self) -> list[Node]:
        with self._lock, self._reading("listing nodes"):
            rows = self._c.execute(self._q["nodes"]).fetchall()
        return [Node(r[0], r[1] or "", opt_float(r[2]), opt_float(r[3])) for r in rows]

    def availability_watermark(self) -> int | None:
        with self._lock, self._reading("reading the watermark"):
            row = self._c.execute(self._q["watermark"]).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def _run_key(self, conn: psycopg.Connection, run_id: str) -> int:
        key = self._run_keys.get(run_id)
        if key is None:
            row = conn.execute(self._q["run_key"], [run_id]).fetchone()
            if row is None:
                raise UnknownRunError(f"unknown run {run_id!r}: not in {self.url}")
            key = self._run_keys[run_id] = int(row[0])
        return key

    def _node_key(self, conn: psycopg.Connection, node_id: str) -> int:
        key = self._node_keys.get(node_id)
        if key is None:
            row = conn.execute(self._q["node_key"], [node_id]).fetchone()
            if row is None:
                raise UnknownNodeError(f"unknown node {node_id!r}: not in {self.url}")
            key = self._node_keys[node_id] = int(row[0])
        return key

    # ---- points (the read base's primitives) ---------------------------------------------------
    def _locate(self, node_id: str, run_id: str, from_ms: int, to_ms: int) -> tuple[Any, int, int]:
        what = f"reading node {node_id!r} of run {run_id!r}"
        with self._reading(what):
            conn = self._c
            series = (self._run_key(conn, run_id), self._node_key(conn, node_id), what)
        return series, clamp_i64(from_ms), clamp_i64(to_ms)

    def _read(self, series: Any, lo: int, hi: int, after: Cursor | None, want: int) -> Rows:
        """``ORDER BY ts, seq LIMIT`` over the primary key's range of the series: an index range
        scan, no sort; at most :data:`_MAX_ROWS_PER_QUERY` rows per round trip."""
        run_key, node_key, what = series
        resume = None if after is None else (after.ts, after.seq)
        parts: list[tuple[np.ndarray, ...]] = []
        with self._reading(what):
            conn = self._c
            while want > 0:
                n = min(want, _MAX_ROWS_PER_QUERY)
                cols = self._fetch(conn, run_key, node_key, lo, hi, resume, n)
                parts.append(cols)
                got = cols[0].shape[0]
                want -= got
                if got < n:
                    break
                resume = (int(cols[0][-1]), int(cols[3][-1]))
                lo = max(lo, resume[0])
        if len(parts) == 1:
            return Rows(*parts[0])
        return Rows(*(np.concatenate([p[i] for p in parts]) for i in range(4)))

    def _fetch(
        self,
        conn: psycopg.Connection,
        run_key: int,
        node_key: int,
        lo: int,
        hi: int,
        after: tuple[int, int] | None,
        n: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        params: list[Any] = [Int4(run_key), Int4(node_key), Int8(lo), Int8(hi)]
        if after is None:
            query = self._q["page"]
        else:
            query = self._q["page_after"]
            params += [Int8(after[0]), Int8(after[1])]
        params.append(Int8(n))
        with conn.cursor(binary=True) as cur:
            count, b_ts, b_value, b_state, b_seq = cur.execute(query, params).fetchone()
        if not count:
            return (
                np.empty(0, np.int64), np.empty(0, np.float64),
                np.empty(0, np.int32), np.empty(0, np.int64),
            )  # fmt: skip
        ts = np.frombuffer(b_ts, ">i8").astype(np.int64)
        value = np.frombuffer(b_value, ">f8").astype(np.float64)
        state = np.frombuffer(b_state, ">i4").astype(np.int32)
        seq = np.frombuffer(b_seq, ">i8").astype(np.int64)
        if not (ts.shape[0] == value.shape[0] == state.shape[0] == seq.shape[0] == count):
            raise TsdbError(f"{self.url}: page of {count} rows decoded to mismatched columns")
        if ts.shape[0] > 1:
            d_ts = np.diff(ts)
            if not bool(np.all((d_ts > 0) | ((d_ts == 0) & (np.diff(seq) > 0)))):
                # string_agg keeps the subquery's (ts, seq) order in every plan PostgreSQL
                # makes for it; should one ever differ, restore the order rather than trust it.
                order = np.lexsort((seq, ts))
                ts, value, state, seq = ts[order], value[order], state[order], seq[order]
        return ts, value, state, seq

    # ---- versions ------------------------------------------------------------------------------
    def run_versions(self, run_ids: Sequence[str]) -> dict[str, str]:
        ids = list(dict.fromkeys(str(r) for r in run_ids))
        if not ids:
            return {}
        with self._lock, self._reading("reading run versions"):
            conn = self._c
            if self.schema_version >= 2:
                return dict(conn.execute(self._q["run_versions"], [ids]).fetchall())
            # Version 1 (read-only): what the migration will store.
            rows = conn.execute(self._q["v1_runs"], {"all": False, "ids": ids}).fetchall()
        return {r[1]: migrated_version(run_from_row(r[1:11]), int(r[11]), r[12], r[13]) for r in rows}

    # ---- ingest --------------------------------------------------------------------------------
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
        n = prepared.n if prepared is not None else 0
        what = f"ingest of {n:,} points and {len(runs)} runs failed, nothing written"
        with self._lock:
            conn = self._c
            try:
                with conn.transaction():
                    # Wait for another ingest's commit at most lock_timeout_s, then give up.
                    conn.execute(
                        "SELECT set_config('lock_timeout', %s, true)",
                        [f"{max(1, int(self.lock_timeout_s * 1000))}ms"],
                    )
                    next_seq = int(conn.execute(self._q["lock_state"]).fetchone()[0])
                    statements = _Statements(self, conn, next_seq)
                    outcome = write_ingest(
                        statements, runs, runs_tab, nodes_tab, prepared, replace_runs=bool(replace_runs)
                    )
                    statements.advance()
                    crash_point("ingest.commit")
            except psycopg.Error as e:
                self._run_keys.clear()
                self._node_keys.clear()
                if isinstance(e, psycopg.errors.LockNotAvailable):
                    raise TsdbBusyError(
                        f"{self.url}: another ingest holds the TSDB; {what} (waited "
                        f"{self.lock_timeout_s:g} s for it to commit)"
                    ) from None
                full = disk_full(e, f"{self.url} (PostgreSQL server: {self._scrub(e)}): {what}")
                if full is not None:
                    raise full from None
                if conn.broken:
                    raise TsdbUnavailableError(f"{self.url}: {what} (connection lost: {self._scrub(e)})") from None
                raise IngestError(f"{self.url}: {what} ({self._scrub(e)})") from None
            except BaseException:
                self._run_keys.clear()
                self._node_keys.clear()
                raise
        return outcome.written

    def _key_map(self, conn: psycopg.Connection, query: str, ids: list[Any]) -> dict[str, int]:
        if not ids:
            return {}
        wanted = [i for i in ids if isinstance(i, str)]
        rows = conn.execute(self._q[query], [wanted]).fetchall()
        return {r[0]: int(r[1]) for r in rows}


class _Statements:
    """:class:`~aml_pipeline.tsdb.writer.IngestStatements` over one PostgreSQL transaction that
    holds the ``ingest_state`` row lock (``next_seq`` was read under it)."""

    def __init__(self, db: PostgresTsdb, conn: psycopg.Connection, next_seq: int) -> None:
        self.db, self.conn, self.q = db, conn, db._q
        self._next_seq = next_seq
        self._written = 0
        self._max_ts: int | None = None

    def stored_runs(self, run_ids: list[str]) -> dict[str, StoredRun]:
        if not run_ids:
            return {}
        rows = self.conn.execute(self.q["stored_runs"], [run_ids]).fetchall()
        return {r[1]: StoredRun(int(r[0]), run_from_row(r[1:11]), r[11], int(r[12])) for r in rows}

    def upsert_nodes(self, nodes: pa.Table) -> None:
        self.conn.execute(
            self.q["upsert_nodes"],
            [nodes.column(c).to_pylist() for c in ("node_id", "unit", "range_lo", "range_hi")],
        )

    def upsert_runs(self, runs: pa.Table) -> None:
        self.conn.execute(
            self.q["upsert_runs"],
            [
                runs.column(c).to_pylist()
                for c in (
                    "run_id", "line_id", "product_id", "recipe_id", "recipe_version",
                    "recipe_content_hash", "started_at", "ended_at", "evidence_source", "context_confirmed",
                )
            ],
        )  # fmt: skip

    def key_maps(self, run_ids: list[str], node_ids: list[str]) -> tuple[dict[str, int], dict[str, int]]:
        return self.db._key_map(self.conn, "run_keys", run_ids), self.db._key_map(self.conn, "node_keys", node_ids)

    def stored_point_rows(self, candidates: pa.Table, run_keys: list[int]) -> np.ndarray:
        self.conn.execute(self.q["candidates_table"])
        found: list[np.ndarray] = []
        # Chunks bound the temporary table and the aggregated answer (PostgreSQL values < 1 GB).
        for start in range(0, candidates.num_rows, _MAX_ROWS_PER_QUERY):
            chunk = candidates.slice(start, _MAX_ROWS_PER_QUERY)
            self.conn.execute("TRUNCATE aml_candidates")
            with self.conn.cursor() as cur, cur.copy(self.q["copy_candidates"]) as copy:
                _copy_write(copy, _CANDIDATE_FIELDS, {f: chunk.column(f).to_numpy() for f, _ in _CANDIDATE_FIELDS})
            self.conn.execute("ANALYZE aml_candidates")  # a temporary table has no statistics
            with self.conn.cursor(binary=True) as cur:
                count, packed = cur.execute(self.q["stored_candidates"], [_NEG_ZERO, run_keys]).fetchone()
            if count:
                found.append(np.frombuffer(packed, ">i8").astype(np.int64))
        return np.concatenate(found) if found else np.empty(0, np.int64)

    def delete_points(self, run_keys: list[int]) -> None:
        if run_keys:
            self.conn.execute(self.q["delete_points"], [run_keys])

    def next_seq(self) -> int:
        return self._next_seq + self._written

    def append_points(self, rows: PointRows) -> None:
        # Stable sort: equal (run, node, ts) keep row order, i.e. seq order.
        order = np.lexsort((rows.ts, rows.node_key, rows.run_key))
        columns = {f: getattr(rows, f) for f, _ in _POINT_FIELDS}
        with self.conn.cursor() as cur, cur.copy(self.q["copy_points"]) as copy:
            _copy_write(copy, _POINT_FIELDS, columns, order)
        self._written += len(rows)
        top = int(rows.ts.max())
        self._max_ts = top if self._max_ts is None else max(self._max_ts, top)

    def save_run_states(self, states: list[RunState]) -> None:
        self.conn.execute(
            self.q["save_states"],
            [[s.key for s in states], [s.version for s in states], [s.points for s in states]],
        )

    def advance(self) -> None:
        if self._written:
            self.conn.execute(self.q["advance_state"], [Int8(self._written), Int8(self._max_ts)])


def _copy_write(
    copy: Any,
    fields: tuple[tuple[str, str], ...],
    columns: dict[str, np.ndarray],
    order: np.ndarray | None = None,
) -> None:
    """Write ``columns`` (rows in ``order``) to a ``COPY ... FROM STDIN (FORMAT BINARY)``: a
    numpy record per row (field count, then length and big-endian value per field), built
    chunk by chunk; no Python object per row."""
    row = np.dtype(
        [("n", ">i2")]
        + [item for name, dt in fields for item in ((f"l_{name}", ">i4"), (name, dt))]
    )
    n = next(iter(columns.values())).shape[0]
    copy.write(_PGCOPY_HEADER)
    for start in range(0, n, _COPY_CHUNK_ROWS):
        stop = min(n, start + _COPY_CHUNK_ROWS)
        idx = slice(start, stop) if order is None else order[start:stop]
        chunk = np.empty(stop - start, dtype=row)
        chunk["n"] = len(fields)
        for name, dt in fields:
            chunk[f"l_{name}"] = np.dtype(dt).itemsize
            chunk[name] = columns[name][idx]
        copy.write(chunk.view(np.uint8).data)
    copy.write(_PGCOPY_TRAILER)


# ---- helpers -----------------------------------------------------------------------------------


def _lock_id(schema: str) -> int:
    """A stable advisory-lock key (signed int64) for creating ``schema``."""
    digest = hashlib.sha256(f"aml_pipeline.tsdb:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)

