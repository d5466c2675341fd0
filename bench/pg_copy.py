"""The benchmark's reference for reading points out of PostgreSQL: a raw ``COPY ... TO STDOUT``.

The rows go through libpq's own COPY loop and are thrown away: the fastest way a Python client
can pull them (no decoding, no order). It reads the adapter's schema (``?schema=`` of the URL)
directly, on a connection of its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq, sql

from aml_pipeline.errors import UnknownNodeError, UnknownRunError
from aml_pipeline.tsdb.postgres import parse_postgres_url


def copy_points(
    url: str, run_ids: Sequence[str] | None = None, node_ids: Sequence[str] | None = None, *, fmt: str = "text"
) -> tuple[int, float]:
    """Time ``COPY (SELECT ts, value, state FROM points ...) TO STDOUT`` of the points of
    ``run_ids`` x ``node_ids`` (None: all): ``(rows, seconds)``; ``fmt`` is ``text`` or ``binary``."""
    if fmt not in ("text", "binary"):
        raise ValueError(f"fmt must be 'text' or 'binary', got {fmt!r}")
    parsed = parse_postgres_url(url)
    schema = sql.Identifier(parsed.schema)
    with psycopg.connect(parsed.conninfo, autocommit=True) as conn:
        where: list[sql.Composable] = []
        params: list[Any] = []
        for ids, table, key, column, missing in (
            (run_ids, "runs", "run_key", "run_id", UnknownRunError),
            (node_ids, "nodes", "node_key", "node_id", UnknownNodeError),
        ):
            if ids is None:
                continue
            found = dict(conn.execute(
                sql.SQL("SELECT {c}, {k} FROM {s}.{t} WHERE {c} = ANY(%s)").format(
                    c=sql.Identifier(column), k=sql.Identifier(key), s=schema, t=sql.Identifier(table)),
                [list(ids)],
            ).fetchall())
            unknown = [i for i in ids if i not in found]
            if unknown:
                raise missing(f"{parsed.redacted}: no {column} {unknown[0]!r}")
            where.append(sql.SQL("{k} = ANY(%s::int4[])").format(k=sql.Identifier(key)))
            params.append([found[i] for i in ids])
        query = sql.SQL("SELECT ts, value, state FROM {s}.points").format(s=schema)
        if where:
            query = sql.SQL("{q} WHERE {w}").format(q=query, w=sql.SQL(" AND ").join(where))
        statement = sql.SQL("COPY ({q}) TO STDOUT (FORMAT {f})").format(q=query, f=sql.SQL(fmt))
        # COPY takes no bind parameters: psycopg binds them client-side, quoted.
        text = psycopg.ClientCursor(conn).mogrify(statement, params)
        start = time.perf_counter()
        conn.pgconn.send_query(text.encode(conn.info.encoding))
        rows = _drain_copy_out(conn.pgconn, conn.info.encoding)
        return rows, time.perf_counter() - start


def _drain_copy_out(pg: pq.abc.PGconn, encoding: str) -> int:
    """Finish a ``COPY ... TO STDOUT`` sent with ``send_query``: receive and discard the data,
    collect the results; the number of rows COPY reports. Raises the server's error."""
    error: psycopg.Error | None = None
    rows = 0
    result = pg.get_result()
    if result is not None and result.status == pq.ExecStatus.COPY_OUT:
        while pg.get_copy_data(0)[0] >= 0:
            pass
        result = pg.get_result()
    while result is not None:
        if result.status == pq.ExecStatus.COMMAND_OK:
            status = (result.command_status or b"").split()
            if len(status) == 2 and status[0] == b"COPY":
                rows = int(status[1])
        elif error is None and result.status in (pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.BAD_RESPONSE):
            error = psycopg.errors.error_from_result(result, encoding=encoding)
        result = pg.get_result()
    if error is not None:
        raise error
    return rows
