"""A plant's PostgreSQL (or TimescaleDB) tables, read in place, read-only.

Connection
    The description's ``connection`` (a libpq URL; ``${VAR}`` from the environment, or the
    password from ``PGPASSWORD`` / ``~/.pgpass``). The session is ``default_transaction_read_only``
    and ``TimeZone = UTC``; nothing is created, not even a temporary table: a role with
    ``CONNECT``, ``USAGE`` on the schemas and ``SELECT`` on the mapped tables is enough. The
    connection's life is :class:`~aml_pipeline.pg_connection.PgConnection`'s, as for the TSDB
    adapter and the lease: a server that cannot be reached or drops the connection mid-call is
    ``TSDB_UNAVAILABLE`` (the next call connects again); a missing table, column or privilege
    is one ``SOURCE_*`` line naming it; no message shows the password.

Reads
    A page of one node is ``COPY (SELECT time, value, state FROM ... WHERE node = ... AND time
    BETWEEN ... ORDER BY time, <order>, value, state LIMIT n) TO STDOUT (FORMAT BINARY)``: every
    column fixed-width (value NULL -> NaN, the state computed in SQL from the quality mapping),
    decoded by numpy in one pass; COPY keeps the ORDER BY. A run's prefetch (every node at once)
    reads its rows unordered, in one index range scan, each with a number naming its node
    (``hashtext`` of the tag, or an integer key); numpy groups and orders them, and the points
    that share a time are read again with their ``order`` columns. Its rows travel packed on the
    server (``string_agg(<type>send(column), '')``, one row per read, values bound server-side):
    ``PostgresSource.transfer``, the faster of the two in ``bench/sources_bench.py``, which
    reports both; ``copy`` selects COPY.
    COPY takes no server-side parameters, so psycopg binds its values on the client (quoted
    literals); identifiers are quoted with ``psycopg.sql.Identifier`` or the same quoting.

Versions
    One query per batch of runs, a ``UNION ALL`` of one aggregate per run window over the points
    of every mapped node in it (an index range scan each, bounds bound): ``count``, ``min``/``max``
    of time and the sum of a hash of each point's value combined with its quality code (or
    ``max(<modified>)`` where the mapping names a modification column).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import psycopg
from psycopg import pq, sql

from aml_pipeline.errors import SourceError, TsdbError, TsdbUnavailableError
from aml_pipeline.pg_connection import CONNECT_TIMEOUT_S, PgConnectError, PgConnection
from aml_pipeline.sources.backend import Backend, NodeRef, Series, TableRead, Window, source_order
from aml_pipeline.sources.description import LoadedDescription, Quality
from aml_pipeline.sources.sqlbuild import (
    Q,
    check_columns,
    dotted_parts,
    join,
    quote_ident,
    state_expr,
    user_query,
    val,
    where_equal,
)
from aml_pipeline.sources.timecodec import TimeCodec, resolve_codec, timestamp_ms, type_class
from aml_pipeline.tsdb.postgres import parse_postgres_url

_PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in Unix microseconds: the zero of binary timestamps
_HEADER = 19  # PGCOPY signature (11), flags (4), header extension length (4)
# A fixed-width column's PostgreSQL type: its binary form as numpy reads it, and the function
# that sends it.
_DTYPE = {"int4": ">i4", "int8": ">i8", "float8": ">f8", "bool": "?", "timestamptz": ">i8", "timestamp": ">i8"}
_SEND = {"int4": "int4send", "int8": "int8send", "float8": "float8send", "bool": "boolsend",
         "timestamptz": "timestamptz_send", "timestamp": "timestamp_send"}
# The cursor transfer packs a column into one bytea value (PostgreSQL's limit is 1 GB): a read
# that could pack more goes through COPY.
_AGG_BYTES_MAX = 256 * 2**20


class PostgresSource(Backend):
    """The PostgreSQL backend of :class:`~aml_pipeline.sources.mapped.MappedTsdb`.

    ``transfer`` is how rows of points travel: ``copy`` (``COPY ... TO STDOUT (FORMAT BINARY)``)
    or ``cursor`` (one row of columns packed on the server); the benchmark measures both.
    """

    transfer = "cursor"

    def __init__(self, loaded: LoadedDescription) -> None:
        self.loaded = loaded
        self.spec = loaded.spec
        parsed = parse_postgres_url(loaded.connection())
        self.label = parsed.redacted.split("?")[0]
        self._pg = PgConnection(
            parsed.conninfo,
            defaults={"connect_timeout": CONNECT_TIMEOUT_S, "application_name": "aml_pipeline source"},
            # Read-only by construction: every transaction on this connection refuses writes.
            settings=["SET default_transaction_read_only = on", "SET TimeZone = 'UTC'"],
            optional_settings=["SET jit = off"],
            secrets=parsed.secrets,
        )
        self._closed = False
        self._periods: list[tuple[int, int, str]] = []
        self._hashes: dict[str, int] = {}  # node name -> hashtext(name), as this server computes it
        try:
            self._c  # noqa: B018 - connect now: a wrong connection is reported when the source opens
            self._prepare_points()
        except BaseException:
            self.close()
            raise

    # ---- connection --------------------------------------------------------------------------
    @property
    def _c(self) -> psycopg.Connection:
        if self._closed:
            raise TsdbError(f"{self.label}: this source handle is closed")
        try:
            return self._pg.connection()
        except PgConnectError as e:
            if e.setting_up:
                raise (TsdbUnavailableError if e.transient else SourceError)(
                    f"{self.label}: cannot set up the session ({e.detail})") from None
            if e.transient:
                raise TsdbUnavailableError(f"{self.label}: cannot connect ({e.detail})") from None
            code = {"authentication": "SOURCE_PERMISSION", "no_database": "SOURCE_NOT_FOUND"}.get(e.kind)
            raise SourceError(f"{self.loaded.path}: connection {self.label}: {e.detail}", code=code) from None

    def close(self) -> None:
        self._closed = True
        self._pg.close()

    def _scrub(self, e: BaseException) -> str:
        return self._pg.scrub(e)

    @contextmanager
    def _reading(self, what: str) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as e:
            if self._pg.lost(e):
                raise TsdbUnavailableError(f"{self.label}: {what}: the connection was lost ({self._scrub(e)})") from None
            if isinstance(e, psycopg.errors.InsufficientPrivilege):
                raise self._permission(what, e) from None
            if isinstance(e, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn,
                              psycopg.errors.InvalidSchemaName)):
                raise SourceError(f"{self.loaded.path}: {what}: {self._scrub(e)}", code="SOURCE_NOT_FOUND") from None
            raise SourceError(f"{self.loaded.path}: {what}: {self._scrub(e)}", code="SOURCE_QUERY") from None

    def _permission(self, what: str, e: psycopg.Error) -> SourceError:
        """A refused read as the docs promise it: the role, the schema-qualified table (or the
        schema) it may not read, and the GRANT that fixes it."""
        text = (e.diag.message_primary or str(e)).strip()
        m = re.match(r"permission denied for (schema|table|view|materialized view|relation|sequence|foreign table) (.+)$",
                     text)
        try:  # (the session is in autocommit: the refused statement left no transaction behind)
            user = self._c.execute("SELECT quote_ident(current_user)").fetchone()[0]
            if m and m.group(1) == "schema":
                schema = self._c.execute("SELECT quote_ident(%s)", [m.group(2)]).fetchone()[0]
                return SourceError(f"{self.loaded.path}: {what}: role {user} may not use schema {schema}: "
                                   f"GRANT USAGE ON SCHEMA {schema} TO {user}", code="SOURCE_PERMISSION")
            if m:
                # The relations of that name the role may not read, schema-qualified.
                found = self._c.execute(
                    "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname), n.nspname || '.' || c.relname "
                    "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE c.relname = %s AND NOT has_table_privilege(c.oid, 'SELECT') "
                    "AND has_schema_privilege(n.oid, 'USAGE') ORDER BY 1", [m.group(2)]).fetchall()
                # Of several, the ones the description names (a query's schema.table).
                written = self.spec.model_dump_json()
                names = [q for q, plain in found if plain in written] or [q for q, _ in found]
                if names:
                    return SourceError(f"{self.loaded.path}: {what}: role {user} may not read table {names[0]}: "
                                       f"GRANT SELECT ON {', '.join(names)} TO {user}", code="SOURCE_PERMISSION")
        except psycopg.Error:
            pass
        return SourceError(f"{self.loaded.path}: {what}: {self._scrub(e)}; the role needs SELECT on it "
                           "(GRANT SELECT ON the table, and GRANT USAGE ON its schema)", code="SOURCE_PERMISSION")

    # ---- introspection -----------------------------------------------------------------------
    def _table_columns(self, name: str, key: str, needed: Sequence[tuple[str, str]]) -> dict[str, str]:
        """Column -> type of table ``name`` (as written in the description at ``key``); the
        ``needed`` (key, column) pairs must exist and be readable."""
        where = str(self.loaded.path)
        quoted = self._quoted_table(name)
        with self._reading(f"{key}: table {name}"):
            oid = self._c.execute("SELECT to_regclass(%s)::oid", [quoted]).fetchone()[0]
            if oid is None:
                raise SourceError(f"{where}: {key}: table {name!r} does not exist (or is not on the search_path; "
                                  "write schema.table)", code="SOURCE_NOT_FOUND")
            rows = self._c.execute(
                "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_catalog.pg_attribute a "
                "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum", [oid]
            ).fetchall()
            have = {r[0]: r[1] for r in rows}
            check_columns(have, needed, f"table {name}", where)
            for k, column in needed:
                ok = self._c.execute("SELECT has_column_privilege(%s, %s, 'SELECT')", [oid, column]).fetchone()[0]
                if not ok:
                    user, table = self._c.execute(
                        "SELECT quote_ident(current_user), quote_ident(n.nspname) || '.' || quote_ident(c.relname) "
                        "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE c.oid = %s", [oid]).fetchone()
                    raise SourceError(
                        f"{where}: {k}: role {user} may not read column {column!r} of table {table}: "
                        f"GRANT SELECT ON {table} TO {user}", code="SOURCE_PERMISSION")
        return have

    def _quoted_table(self, name: str) -> str:
        return sql.SQL(".").join(sql.Identifier(p) for p in dotted_parts(name)).as_string(self._c)

    def _query_columns(self, q: Q, key: str) -> dict[str, str]:
        text, params = q.render("pyformat")
        with self._reading(f"{key}: the query"):
            with self._c.cursor() as cur:
                cur.execute(f"SELECT * FROM ({text}) AS aml_q LIMIT 0", params)
                out = {}
                for d in cur.description or ():
                    out[d.name] = self._c.execute("SELECT format_type(%s, NULL)", [d.type_code]).fetchone()[0]
        return out

    # ---- points ------------------------------------------------------------------------------
    def _prepare_points(self) -> None:
        p, where = self.spec.points, str(self.loaded.path)
        self.layout = p.effective_layout
        quality = p.quality_spec()
        needed = [("points.time", p.time)]
        if self.layout == "narrow":
            needed += [("points.node", p.node), ("points.value", p.value)]
        if self.layout == "query":
            needed += [("points.value", p.value)]
        if quality is not None:
            needed.append(("points.quality", quality.column))
        needed += [("points.order", c) for c in p.order]
        if p.line:
            needed.append(("points.line", p.line))
        if p.modified:
            needed.append(("points.modified", p.modified))
        if self.layout == "wide":
            for node_id, col in p.wide_columns().items():
                needed.append((f"points.columns.{node_id}", col.column))
                q = col.quality_spec()
                if q is not None:
                    needed.append((f"points.columns.{node_id}.quality", q.column))
        if self.layout == "query":
            if p.periods is not None:
                self._periods = self._list_periods()
                if not self._periods:
                    raise SourceError(f"{where}: points.periods: no table matches {p.periods.table!r}", code="SOURCE_NOT_FOUND")
            probe = self._from_query(None, Q("NULL"), Q("NULL"), Q("NULL"), last_period=True)
            self._types = self._query_columns(Q("SELECT * FROM ") + probe, "points.query")
            check_columns(self._types, [k for k in needed if k[0] != "points.where"], "the query's columns", where)
        else:
            self._types = self._table_columns(p.table, "points.table", needed + [("points.where", c) for c in p.where])
        codec, why = resolve_codec(p.time_type, p.time_zone, self._types[p.time], p.time)
        if codec is None:
            raise SourceError(f"{where}: points.time_type: {why}")
        self.codec: TimeCodec = codec
        self._t = quote_ident(p.time)

    def _textual(self, column: str) -> bool:
        return type_class(self._types.get(column, "")) == "other"

    def _time_select(self, expr: str) -> str:
        """The time column as its raw binary value: timestamps as they are (8 bytes), epoch
        numbers as int8 or float8."""
        if self.codec.is_timestamp:
            return expr
        return f"CAST({expr} AS float8)" if self.codec.is_float else f"CAST({expr} AS int8)"

    def _time_scalar(self, expr: str) -> str:
        """One time value as a raw number (for max, min): microseconds for timestamps."""
        if self.codec.is_timestamp:
            return f"CAST(extract(epoch FROM {expr}) * 1000000 AS int8)"
        return self._time_select(expr)

    def _time_type(self) -> str:
        return {"timestamptz": "timestamptz", "timestamp": "timestamp"}.get(
            self.codec.kind, "float8" if self.codec.is_float else "int8")

    def _bound(self, raw: Any) -> Q:
        return val(self.codec.bind(raw)) + f"::{self._time_type()}"

    def _value_sql(self, column: str, prefix: str = "") -> str:
        return f"coalesce(CAST({prefix}{quote_ident(column)} AS float8), 'NaN'::float8)"

    def _state_sql(self, quality: Quality | None, prefix: str = "") -> Q:
        if quality is None:
            return Q("0")
        return state_expr(quality, f"{prefix}{quote_ident(quality.column)}", self._textual(quality.column))

    def _filters(self, prefix: str = "") -> list[Q]:
        return where_equal(self.spec.points.where, prefix)

    def _list_periods(self) -> list[tuple[int, int, str]]:
        """The period tables that exist: (start ms, end ms, quoted name), oldest first."""
        import pandas as pd

        per = self.spec.points.periods
        # Quote-aware (``"hist.v2"."samples.{period}"``); the description's check made it one or
        # two parts with one {period}, in the table's name.
        *schemas, pattern = dotted_parts(per.table)
        schema = schemas[0] if schemas else None
        prefix, suffix = pattern.split("{period}")
        with self._reading("points.periods: listing the period tables"):
            if schema is None:
                schema = self._c.execute("SELECT current_schema()").fetchone()[0]
            names = [r[0] for r in self._c.execute(
                "SELECT c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v', 'm', 'f') AND starts_with(c.relname, %s)",
                [schema, prefix]).fetchall()]
        out = []
        step = {"day": pd.DateOffset(days=1), "month": pd.DateOffset(months=1), "year": pd.DateOffset(years=1)}[per.every]
        seen: dict[int, str] = {}
        for name in sorted(names):
            if not name.endswith(suffix) or len(name) < len(prefix) + len(suffix):
                continue
            text = name[len(prefix): len(name) - len(suffix)]
            try:
                start = pd.Timestamp(dt.datetime.strptime(text, per.period_format)).tz_localize(per.zone)
            except ValueError:
                continue
            # strptime reads "2025_1" and "2025_01" alike for %Y_%m: two tables of one period
            # would read its points twice, so they are refused, named.
            first = timestamp_ms(start)
            if first in seen:
                raise SourceError(
                    f"{self.loaded.path}: points.periods: tables {seen[first]!r} and {name!r} in schema {schema!r} are "
                    f"both the period starting {start.isoformat()} (format {per.period_format!r}); drop or rename one"
                )
            seen[first] = name
            quoted = sql.Identifier(schema, name).as_string(self._c)
            out.append((first, timestamp_ms(start + step) - 1, quoted))
        return sorted(out)

    def _from_query(self, key: Any, lo: Q, hi: Q, line: Q, *, span: tuple[int, int] | None = None,
                    last_period: bool = False, alias: str = "q") -> Q:
        """``(<the description's query>) AS q`` bound to one node and a time range; over every
        period table the span overlaps (or the newest one)."""
        p = self.spec.points

        def bind(name: str) -> Q:
            return {"node": val(key), "from": lo, "to": hi, "line": line}[name]

        if p.periods is None:
            return Q("(") + user_query(p.query, bind) + f") AS {alias}"
        if last_period:
            tables = [self._periods[-1][2]]
        else:
            a, b = span if span is not None else (-(2**63), 2**63 - 1)
            tables = [name for s, e, name in self._periods if e >= a and s <= b]
            if not tables:
                tables = [self._periods[-1][2]]  # no period: an empty result of the right shape
                return Q("(") + user_query(p.query.replace("{table}", tables[0]), bind) + f" LIMIT 0) AS {alias}"
        parts = [Q("(") + user_query(p.query.replace("{table}", t), bind) + ")" for t in tables]
        return Q("(") + join(parts, " UNION ALL ") + f") AS {alias}"

    def _points_from(self, node: NodeRef, lo: int, hi: int, line: str | None) -> tuple[Q, str]:
        """FROM and WHERE of one node's points in [lo, hi] (ms), and the column prefix."""
        p = self.spec.points
        a, b = self.codec.bounds(lo, hi)
        if self.layout == "query":
            frm = self._from_query(node.key, self._bound(a), self._bound(b), val(line), span=(lo, hi))
            return Q(" FROM ") + frm, "q."
        conds = [Q(f"{self._t} BETWEEN ") + self._bound(a) + " AND " + self._bound(b)]
        if self.layout == "narrow":
            conds.insert(0, Q(f"{quote_ident(p.node)} = ") + val(node.key))
        else:
            conds.append(Q(f"{quote_ident(node.column)} IS NOT NULL"))
        if p.line and line is not None:
            conds.append(Q(f"{quote_ident(p.line)} = ") + val(line))
        conds += self._filters()
        return Q(f" FROM {self._quoted_table(p.table)} WHERE ") + join(conds, " AND "), ""

    def _order(self, prefix: str, value_pos: int) -> str:
        """The source order: time, the mapping's order columns, then value and state (the
        selected columns at ``value_pos`` and ``value_pos + 1``)."""
        cols = [prefix + quote_ident(c) for c in (self.spec.points.time, *self.spec.points.order)]
        return ", ".join(cols + [str(value_pos), str(value_pos + 1)])

    def _node_value(self, node: NodeRef) -> tuple[str, Quality | None]:
        if self.layout == "wide":
            return node.column, node.quality
        return self.spec.points.value, self.spec.points.quality_spec()

    def fetch(self, node: NodeRef, lo: int, hi: int, line: str | None, limit: int) -> Series:
        value_col, quality = self._node_value(node)
        frm, pre = self._points_from(node, lo, hi, line)
        q = (Q(f"SELECT {self._time_select(pre + self._t)}, {self._value_sql(value_col, pre)}, ")
             + self._state_sql(quality, pre) + frm + f" ORDER BY {self._order(pre, 2)} LIMIT "
             + val(int(limit)))
        with self._reading(f"reading node {node.node_id!r}"):
            # In ORDER BY order: COPY sends rows as the query returns them.
            cols = self._copy(q, [("t", self._time_field()), ("v", "float8"), ("s", "int4")])
        return Series(self._to_ms(cols["t"]), cols["v"].astype(np.float64), cols["s"].astype(np.int32))

    def _to_ms(self, raw: np.ndarray) -> np.ndarray:
        if self.codec.is_timestamp:
            raw = raw.astype(np.int64) + _PG_EPOCH_US
        return self.codec.to_ms(raw)

    def fetch_many(self, nodes: Sequence[NodeRef], lo: int, hi: int, line: str | None, limit: int,
                   hold: int = 0) -> list[Series] | None:
        """One scan of the run's rows (no ORDER BY: the same index range a plain ``COPY`` of them
        reads), each row with its node; numpy then orders each node's points exactly as
        :meth:`fetch` does (time, order columns, value, state). None (node by node) for the query
        layout, or where the node or order columns are not plain numbers."""
        p = self.spec.points
        order_keys = self._order_keys()
        if self.layout == "query" or order_keys is None:
            return None
        conds = self._range_conds(lo, hi, line)
        table = self._quoted_table(p.table)
        if self.layout == "narrow":
            return self._fetch_many_narrow(nodes, conds, order_keys, limit)
        select = [Q(self._time_select(self._t))] + [Q(sql_) for sql_, _ in order_keys]
        fields = [("t", self._time_field())] + [(f"o{k}", typ) for k, (_, typ) in enumerate(order_keys)]
        conds.append(Q("(") + join([Q(f"{quote_ident(n.column)} IS NOT NULL") for n in nodes], " OR ") + ")")
        for k, n in enumerate(nodes):
            select += [Q(self._value_sql(n.column)), Q(f"{quote_ident(n.column)} IS NOT NULL"), self._state_sql(n.quality)]
            fields += [(f"v{k}", "float8"), (f"p{k}", "bool"), (f"s{k}", "int4")]
        q = Q("SELECT ") + join(select, ", ") + f" FROM {table} WHERE " + join(conds, " AND ") + " LIMIT " + val(int(limit))
        with self._reading(f"reading {len(nodes)} nodes"):
            cols = self._rows(q, fields, limit)
        t = cols["t"].astype(np.float64 if self.codec.is_float else np.int64)
        ties = [cols[f"o{k}"].astype(np.float64 if typ == "float8" else np.int64) for k, (_, typ) in enumerate(order_keys)]
        ts = self._to_ms(cols["t"])
        out = []
        for k in range(len(nodes)):
            has = cols[f"p{k}"].astype(bool)
            v, s = cols[f"v{k}"][has].astype(np.float64), cols[f"s{k}"][has].astype(np.int32)
            order = source_order(np.zeros(int(has.sum()), np.int64), [t[has], *(o[has] for o in ties), v, s])
            out.append(Series(ts[has][order], v[order], s[order]))
        return out

    def _range_conds(self, lo: int, hi: int, line: str | None) -> list[Q]:
        p = self.spec.points
        a, b = self.codec.bounds(lo, hi)
        conds = [Q(f"{self._t} BETWEEN ") + self._bound(a) + " AND " + self._bound(b)]
        if p.line and line is not None:
            conds.append(Q(f"{quote_ident(p.line)} = ") + val(line))
        return conds + self._filters()

    def _fetch_many_narrow(self, nodes: Sequence[NodeRef], conds: list[Q], order_keys: list[tuple[str, str]],
                           limit: int) -> list[Series] | None:
        """Narrow layout: the rows carry node, time, value and state only. Points sharing a node
        and a time (re-sent samples: few) are ordered by the mapping's order columns, read for
        just those in a second query of the same snapshot."""
        p = self.spec.points
        named = self._node_key_sql(nodes)
        if named is None:
            return None
        key_sql, key_type, numbers = named
        by_number = np.argsort(numbers)
        table = self._quoted_table(p.table)
        select = f"{key_sql}, {self._time_select(self._t)}"
        q = (Q(f"SELECT {select}, {self._value_sql(p.value)}, ") + self._state_sql(p.quality_spec())
             + f" FROM {table} WHERE " + join([self._node_in(nodes), *conds], " AND ") + " LIMIT " + val(int(limit)))
        fields = [("k", key_type), ("t", self._time_field()), ("v", "float8"), ("s", "int4")]

        def read() -> tuple[np.ndarray, ...]:
            cols = self._rows(q, fields, limit)
            node = by_number[np.searchsorted(numbers[by_number], cols["k"])]
            t = cols["t"].astype(np.float64 if self.codec.is_float else np.int64)
            v, s = cols["v"].astype(np.float64), cols["s"].astype(np.int32)
            order = source_order(node, [t] if order_keys else [t, v, s])
            node, t, v, s = node[order], t[order], v[order], s[order]
            same = np.flatnonzero((node[1:] == node[:-1]) & (t[1:] == t[:-1]))
            if order_keys and same.size:
                tied = np.zeros(node.shape[0], dtype=bool)
                tied[same] = tied[same + 1] = True
                v, s = self._order_ties(nodes, numbers, by_number, conds, order_keys, node, t, v, s, tied)
            return node, t, v, s

        with self._reading(f"reading {len(nodes)} nodes"):
            try:
                node, t, v, s = read()
            except _TiesChanged:
                # Points were written between the two reads: both again, in one snapshot.
                with self._snapshot():
                    node, t, v, s = read()
        ts = self._to_ms(t)
        bounds = np.searchsorted(node, np.arange(len(nodes) + 1))
        return [Series(ts[x:y], v[x:y], s[x:y]) for x, y in zip(bounds[:-1], bounds[1:])]

    def _order_ties(self, nodes, numbers, by_number, conds, order_keys, node, t, v, s, tied):
        """Replace the rows of each (node, time) shared by several points with the same rows read
        again with their order columns, sorted by (order columns, value, state)."""
        p = self.spec.points
        pairs = np.flatnonzero(tied)
        pairs = pairs[np.r_[True, (node[pairs][1:] != node[pairs][:-1]) | (t[pairs][1:] != t[pairs][:-1])]]
        pair_keys = [nodes[i].key for i in node[pairs].tolist()]
        pair_times = [self.codec.bind(int(x) + _PG_EPOCH_US) if self.codec.is_timestamp else x.item() for x in t[pairs]]
        key_sql, key_type, _ = self._node_key_sql(nodes)
        node_col = quote_ident(p.node)
        # Exactly the tied (node, time) pairs: one index probe each, where a node list crossed with
        # a time list would probe every node at every tied time.
        q = (Q(f"SELECT {key_sql}, {self._time_select(self._t)}, {', '.join(k for k, _ in order_keys)}, "
               f"{self._value_sql(p.value)}, ") + self._state_sql(p.quality_spec())
             + f" FROM {self._quoted_table(p.table)} WHERE ({node_col}, {self._t}) IN (SELECT * FROM unnest("
             + val(pair_keys) + f"::{self._types[p.node]}[], " + val(pair_times) + f"::{self._time_type()}[])) AND "
             + join(conds, " AND "))
        fields = ([("k", key_type), ("t", self._time_field())] + [(f"o{i}", typ) for i, (_, typ) in enumerate(order_keys)]
                  + [("v", "float8"), ("s", "int4")])
        again = self._rows(q, fields)
        n2 = by_number[np.searchsorted(numbers[by_number], again["k"].astype(np.int64))]
        t2 = again["t"].astype(np.float64 if self.codec.is_float else np.int64)
        v2, s2 = again["v"].astype(np.float64), again["s"].astype(np.int32)
        o2 = [again[f"o{i}"].astype(np.float64 if typ == "float8" else np.int64) for i, (_, typ) in enumerate(order_keys)]
        o = np.lexsort((s2, v2, *reversed(o2), t2, n2))
        # The tied rows are contiguous runs of one (node, time) in (node, time) order, as are the
        # rows read again once sorted: the same places, now in the order columns' order.
        if not (np.array_equal(n2[o], node[tied]) and np.array_equal(t2[o], t[tied])):
            if self._c.info.transaction_status == pq.TransactionStatus.INTRANS:
                raise TsdbError(f"{self.label}: the points sharing a time differ between two reads of one snapshot")
            raise _TiesChanged()
        v, s = v.copy(), s.copy()
        v[tied], s[tied] = v2[o], s2[o]
        return v, s

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        """One repeatable-read, read-only transaction around several reads."""
        conn = self._c
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield

    def _node_in(self, nodes: Sequence[NodeRef]) -> Q:
        return Q(f"{quote_ident(self.spec.points.node)} IN (") + join([val(n.key) for n in nodes], ", ") + ")"

    def _order_keys(self) -> list[tuple[str, str]] | None:
        """The mapping's order columns as fixed-width SQL (NULLs last, as ORDER BY puts them) and
        their binary types; None when one is not a number or a time."""
        keys = []
        for c in self.spec.points.order:
            cls = type_class(self._types[c])
            col = quote_ident(c)
            if cls in ("int", "numeric") and "numeric" not in self._types[c]:
                keys.append((f"coalesce(CAST({col} AS int8), 9223372036854775807)", "int8"))
            elif cls == "float":
                keys.append((f"coalesce(CAST({col} AS float8), 'NaN'::float8)", "float8"))
            elif cls in ("tz", "naive"):
                keys.append((f"coalesce({col}, 'infinity')", "timestamptz" if cls == "tz" else "timestamp"))
            else:
                return None
        return keys

    def _node_key_sql(self, nodes: Sequence[NodeRef]) -> tuple[str, str, np.ndarray] | None:
        """How a row names its node as a fixed-width number: the key itself (integer keys) or
        ``hashtext`` of it (text keys), with the number of each of ``nodes``; None if two nodes'
        numbers collide or the keys are neither."""
        col = quote_ident(self.spec.points.node)
        cls = type_class(self._types[self.spec.points.node])
        if cls == "int":
            numbers = np.array([int(n.key) for n in nodes], dtype=np.int64)
            key_sql, key_type = f"CAST({col} AS int8)", "int8"
        elif cls == "other":
            names = [str(n.key) for n in nodes]
            missing = [k for k in names if k not in self._hashes]
            if missing:
                text, params = (Q("SELECT k, hashtext(k) FROM unnest(") + val(missing) + "::text[]) AS u(k)").render("pyformat")
                with self._reading("hashing node names"):
                    self._hashes.update(self._c.execute(text, params).fetchall())
            numbers = np.array([self._hashes[k] for k in names], dtype=np.int64)
            key_sql, key_type = f"hashtext({col})", "int4"
        else:
            return None
        if np.unique(numbers).shape[0] != len(nodes):
            return None
        return key_sql, key_type, numbers

    def _time_field(self) -> str:
        """The PostgreSQL type of the time column as :meth:`_time_select` reads it."""
        return self._time_type()

    def _rows(self, q: Q, fields: list[tuple[str, str]], most: int | None = None) -> dict[str, np.ndarray]:
        """The rows of ``q`` (every column fixed-width and never NULL: ``fields`` names each and
        its PostgreSQL type; at most ``most`` rows), in no particular order, as numpy columns,
        through :attr:`transfer`."""
        if self.transfer == "cursor" and (most is None or 8 * most < _AGG_BYTES_MAX):
            return self._aggregated(q, fields)
        return self._copy(q, fields)

    def _aggregated(self, q: Q, fields: list[tuple[str, str]]) -> dict[str, np.ndarray]:
        """One row: each column packed by ``string_agg(<type>send(column), '')`` on the server,
        bound parameters and all, decoded by numpy (the aggregates of one pass keep the rows
        aligned)."""
        names = [f"c{i}" for i in range(len(fields))]
        packed = ", ".join(f"string_agg({_SEND[typ]}({n}), '')" for n, (_, typ) in zip(names, fields))
        text, params = (Q(f"SELECT count(*)::int8, {packed} FROM (") + q + f") AS aml_rows({', '.join(names)})").render("pyformat")
        with self._c.cursor(binary=True) as cur:
            row = cur.execute(text, params).fetchone()
        n = int(row[0])
        out = {}
        for (name, typ), data in zip(fields, row[1:]):
            out[name] = np.frombuffer(data, _DTYPE[typ]) if n else np.empty(0, _DTYPE[typ])
            if out[name].shape[0] != n:
                raise TsdbError(f"{self.label}: {n} rows decoded to {out[name].shape[0]} values of column {name}")
        return out

    def _copy(self, q: Q, fields: list[tuple[str, str]]) -> dict[str, np.ndarray]:
        """Run ``COPY (q) TO STDOUT (FORMAT BINARY)`` and decode its fixed-width rows."""
        text, params = q.render("pyformat")
        conn = self._c
        statement = psycopg.ClientCursor(conn).mogrify(f"COPY ({text}) TO STDOUT (FORMAT BINARY)", params)
        pg = conn.pgconn
        body = bytearray()
        try:
            pg.send_query(statement.encode(conn.info.encoding))
            result = pg.get_result()
            if result is not None and result.status == pq.ExecStatus.COPY_OUT:
                get = pg.get_copy_data
                while True:
                    nbytes, data = get(0)
                    if nbytes < 0:
                        break
                    # Copied at once: keeping libpq's row buffers alive until the end costs
                    # several times the copy.
                    body += data
                result = pg.get_result()
            error = None
            while result is not None:
                if error is None and result.status in (pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.BAD_RESPONSE):
                    error = psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
                result = pg.get_result()
        except psycopg.Error:
            conn.close()  # the protocol state is unknown: the next call connects afresh
            raise
        except BaseException:
            conn.close()
            raise
        if pg.status != pq.ConnStatus.OK:
            raise psycopg.OperationalError(pg.error_message.decode(errors="replace") or "connection lost")
        if error is not None:
            raise error
        row = np.dtype([("n", ">i2")] + [item for name, typ in fields for item in ((f"l_{name}", ">i4"), (name, _DTYPE[typ]))])
        payload = memoryview(body)[_HEADER: len(body) - 2] if body else memoryview(b"")
        if len(payload) % row.itemsize:
            raise TsdbError(f"{self.label}: unexpected row layout from COPY (a NULL where none can be)")
        rows = np.frombuffer(payload, dtype=row)
        out = {name: rows[name] for name, _ in fields}
        for name, typ in fields:
            if rows.shape[0] and not bool(np.all(rows[f"l_{name}"] == np.dtype(_DTYPE[typ]).itemsize)):
                raise TsdbError(f"{self.label}: unexpected NULL in column {name} from COPY")
        return out

    # ---- catalog, watermark, versions --------------------------------------------------------
    def distinct_keys(self) -> list[Any]:
        p = self.spec.points
        node = quote_ident(p.node)
        table = self._quoted_table(p.table)
        filters = self._filters()
        extra = (Q(" AND ") + join(filters, " AND ")) if filters else Q()
        # A loose index scan: one index probe per distinct node on an index led by the node column.
        q = (Q(f"WITH RECURSIVE k(v) AS (SELECT min({node}) FROM {table} WHERE TRUE") + extra
             + f" UNION ALL SELECT (SELECT min({node}) FROM {table} WHERE {node} > k.v" + extra
             + ") FROM k WHERE k.v IS NOT NULL) SELECT v FROM k WHERE v IS NOT NULL ORDER BY v")
        text, params = q.render("pyformat")
        with self._reading("points: listing the nodes"):
            return [r[0] for r in self._c.execute(text, params).fetchall()]

    def max_time(self, nodes: Sequence[NodeRef]) -> int | None:
        p = self.spec.points
        if self.layout == "query":
            best: int | None = None
            for n in nodes:
                a, b = self.codec.bounds(-(2**63), 2**63 - 1)
                frm = self._from_query(n.key, self._bound(a), self._bound(b), Q("NULL"))
                q = Q(f"SELECT {self._time_scalar('q.' + self._t)} FROM ") + frm + f" ORDER BY q.{self._t} DESC LIMIT 1"
                v = self._scalar(q, "points.query: the latest point")
                if v is not None:
                    ms = int(self.codec.to_ms(np.array([v]))[0])
                    best = ms if best is None else max(best, ms)
            return best
        table = self._quoted_table(p.table)
        filters = self._filters()
        if self.layout == "narrow":
            node = quote_ident(p.node)
            extra = (Q(" AND ") + join(filters, " AND ")) if filters else Q()
            q = (Q("SELECT max(m) FROM unnest(") + val([n.key for n in nodes])
                 + f"::{self._types[p.node]}[]) AS k(key) CROSS JOIN LATERAL (SELECT {self._time_scalar(self._t)} AS m "
                 f"FROM {table} WHERE {node} = k.key" + extra + f" ORDER BY {self._t} DESC LIMIT 1) AS x")
        else:
            conds = [Q("(") + join([Q(f"{quote_ident(n.column)} IS NOT NULL") for n in nodes], " OR ") + ")"] + filters
            q = (Q(f"SELECT {self._time_scalar(self._t)} FROM {table} WHERE ") + join(conds, " AND ")
                 + f" ORDER BY {self._t} DESC LIMIT 1")
        v = self._scalar(q, "points: the latest point")
        return None if v is None else int(self.codec.to_ms(np.array([v]))[0])

    def _scalar(self, q: Q, what: str) -> Any:
        text, params = q.render("pyformat")
        with self._reading(what):
            row = self._c.execute(text, params).fetchone()
        return None if row is None else row[0]

    def _checksum(self, values: Sequence[str], qualities: Sequence[str]) -> str:
        """Per row, an int4 that changes with any of the ``values`` (hashed) or ``qualities``
        columns: value hashes and quality codes combined by XOR (an integer code as it is, a
        word hashed). Summed over a run's rows in the version query."""
        parts = [f"coalesce(hashfloat8(CAST(p.{quote_ident(c)} AS float8)), 0)" for c in values]
        for c in qualities:
            col, cls = f"p.{quote_ident(c)}", type_class(self._types.get(c, ""))
            if cls == "int" and self._types.get(c) in ("smallint", "integer"):
                parts.append(f"coalesce(CAST({col} AS int4), -1)")
            elif cls in ("int", "float", "numeric"):
                parts.append(f"coalesce(hashfloat8(CAST({col} AS float8)), -1)")
            else:
                parts.append(f"coalesce(hashtext(CAST({col} AS text)), -1)")
        return " # ".join(parts)

    def aggregates(self, windows: Sequence[Window], nodes: Sequence[NodeRef]) -> list[Any]:
        """Per window, in one query (a ``UNION ALL`` of one aggregate per window, each an index
        range scan with its bounds bound, which PostgreSQL may run in parallel workers): the
        point count, the first and last time, and the sum over points of a hash of (value,
        quality): a point added, deleted or corrected changes it. Or ``max(<modified>)``."""
        p = self.spec.points
        t = f"p.{self._t}"
        if self.layout == "wide":
            values = [n.column for n in nodes]
            qualities = [n.quality.column for n in nodes if n.quality is not None]
        else:
            q = p.quality_spec()
            values, qualities = [p.value], ([q.column] if q is not None else [])
        if p.modified:
            check = f"max(p.{quote_ident(p.modified)})"
        else:
            # Time enters through the count and the first and last time only: hashing it too
            # (date_part per row) would cost more than the value and quality together.
            check = f"sum({self._checksum(values, qualities)})"
        branches = []
        for i, w in enumerate(windows):
            a, b = self.codec.bounds(w.lo, w.hi)
            head = Q(f"SELECT {i} AS i, count({t}) AS n, {self._time_scalar(f'min({t})')} AS a, "
                     f"{self._time_scalar(f'max({t})')} AS b, {check} AS c FROM ")
            line = val(w.line) if p.line else Q("NULL")
            if self.layout == "query":
                parts = [Q("(SELECT * FROM ") + self._from_query(n.key, self._bound(a), self._bound(b), line,
                                                                  span=(w.lo, w.hi), alias=f"n{k}") + ")"
                         for k, n in enumerate(nodes)]
                branches.append(head + "(" + join(parts, " UNION ALL ") + ") AS p")
                continue
            conds = [Q(f"{t} BETWEEN ") + self._bound(a) + " AND " + self._bound(b)]
            if self.layout == "narrow":
                conds.insert(0, Q(f"p.{quote_ident(p.node)} = ANY(") + val([n.key for n in nodes]) + f"::{self._types[p.node]}[])")
            else:
                conds.append(Q("(") + join([Q(f"p.{quote_ident(n.column)} IS NOT NULL") for n in nodes], " OR ") + ")")
            if p.line:
                conds.append(Q(f"p.{quote_ident(p.line)} = ") + line)
            conds += self._filters("p.")
            branches.append(head + f"{self._quoted_table(p.table)} AS p WHERE " + join(conds, " AND "))
        text, params = (join([Q("(") + b_ + ")" for b_ in branches], " UNION ALL ") + " ORDER BY 1").render("pyformat")
        with self._reading(f"reading the versions of {len(windows)} runs"):
            rows = self._c.execute(text, params).fetchall()
        return [[r[1], r[2], r[3], None if r[4] is None else str(r[4])] for r in rows]

    # ---- runs and node tables ----------------------------------------------------------------
    def read_table(self, read: TableRead) -> dict[str, list[Any]]:
        rel, where = read.relation, str(self.loaded.path)
        needed = [(f"{read.key}.{f}", c) for f, c in read.columns.items()]
        if rel.query is not None:
            frm = Q("(") + rel.query + ") AS r"
            types = self._query_columns(Q("SELECT * FROM ") + frm, f"{read.key}.query")
            check_columns(types, needed, "the query's columns", where)
        elif rel.table is not None:
            types = self._table_columns(rel.table, f"{read.key}.table", needed + [(f"{read.key}.where", c) for c in rel.where])
            frm = Q(f"{self._quoted_table(rel.table)} AS r")
        else:
            return super().read_table(read)  # runs or nodes in files
        codec = None
        if read.times:
            first = read.columns[read.times[0]]
            codec, why = resolve_codec(read.time_type, read.time_zone, types[first], first)
            if codec is None:
                raise SourceError(f"{where}: {read.key}.time_type: {why}")
        select = []
        for f, c in read.columns.items():
            col = f"r.{quote_ident(c)}"
            if f in read.times:
                select.append(f"CASE WHEN {col} IS NULL THEN NULL ELSE {_scalar_raw(codec, col)} END")
            elif type_class(types[c]) == "numeric":
                select.append(f"CAST({col} AS float8)")
            else:
                select.append(col)
        q = Q(f"SELECT {', '.join(select)} FROM ") + frm
        filters = where_equal(rel.where, "r.") if rel.table is not None else []
        if filters:
            q = q + " WHERE " + join(filters, " AND ")
        text, params = q.render("pyformat")
        with self._reading(f"reading {read.key}"):
            rows = self._c.execute(text, params).fetchall()
        out: dict[str, list[Any]] = {f: [r[i] for r in rows] for i, f in enumerate(read.columns)}
        for f in read.times:
            out[f] = codec.to_ms_or_none(out[f])
        return out

    def describe(self) -> dict[str, Any]:
        p = self.spec.points
        out = {
            "backend": "postgresql",
            "connection": self.label,
            "layout": self.layout,
            "points": p.table if p.table else "query" + (f" over {len(self._periods)} period tables" if self._periods else ""),
            "time": {"column": p.time, "type": self.codec.describe(), "kind": self.codec.kind, "zone": self.codec.zone},
            "order": "time, " + ", ".join([*p.order, "value", "quality"]),
        }
        with self._reading("reading the role"):
            out["role"] = self._c.execute("SELECT current_user").fetchone()[0]
        return out


class _TiesChanged(Exception):
    """Points sharing a time changed between the two reads of a prefetch (read them again in one
    snapshot)."""


def _scalar_raw(codec: TimeCodec, col: str) -> str:
    if codec.is_timestamp:
        return f"CAST(extract(epoch FROM {col}) * 1000000 AS int8)"
    return f"CAST({col} AS float8)" if codec.is_float else f"CAST({col} AS int8)"
