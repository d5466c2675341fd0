"""Reading a whole series into memory: how the TSDB tests and benchmarks look at what a TSDB holds.

The build never does this (it streams pages into the store, :mod:`aml_pipeline.pipeline.stages.raw`);
every page goes through :func:`aml_pipeline.tsdb.port.iter_node_pages`, which checks it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from aml_pipeline.errors import TruncationError
from aml_pipeline.tsdb.port import DEFAULT_PAGE_LIMIT, Page, TsdbPort, iter_node_pages
from aml_pipeline.tsdb.session import TsdbSession


@dataclass
class NodeSeries:
    """All points of one node in one run, in (ts, seq) order, with how they were fetched."""

    node_id: str
    run_id: str
    ts: np.ndarray
    value: np.ndarray
    state: np.ndarray
    seq: np.ndarray
    pages: int = 0  # query_page calls it took

    def __len__(self) -> int:
        return int(self.ts.shape[0])


def fetch_node_series(
    tsdb: TsdbPort,
    node_id: str,
    run_id: str,
    from_ms: int,
    to_ms: int,
    *,
    page_limit: int = DEFAULT_PAGE_LIMIT,
    max_points: int | None = None,
) -> NodeSeries:
    """Read every point of a node in a run, page by page, into memory (:func:`iter_node_pages`
    checks every page). ``max_points`` bounds memory; exceeding it is an error, never a silent cut.
    """
    chunks: list[Page] = []
    total = 0
    queries = 0
    for page, queries in iter_node_pages(tsdb, node_id, run_id, from_ms, to_ms, page_limit=page_limit):
        if len(page):
            chunks.append(page)
            total += len(page)
            if max_points is not None and total > max_points:
                raise TruncationError(
                    f"node {node_id!r} in run {run_id!r} has more than {max_points} points in "
                    f"[{from_ms}, {to_ms}]; raise the limit or narrow the window (points are never "
                    "dropped silently)"
                )
    if chunks:
        ts = np.concatenate([c.ts for c in chunks]).astype(np.int64, copy=False)
        value = np.concatenate([c.value for c in chunks]).astype(np.float64, copy=False)
        state = np.concatenate([c.state for c in chunks]).astype(np.int32, copy=False)
        seq = np.concatenate([c.seq for c in chunks]).astype(np.int64, copy=False)
    else:
        ts, value = np.empty(0, np.int64), np.empty(0, np.float64)
        state, seq = np.empty(0, np.int32), np.empty(0, np.int64)
    return NodeSeries(node_id, run_id, ts, value, state, seq, pages=queries)


@contextmanager
def held(session: TsdbSession) -> Iterator[TsdbPort]:
    """The session's handle for one chunk of work, released when the block ends (also on error)."""
    handle = session.acquire()
    try:
        yield handle
    finally:
        session.release()


def point_count(db: TsdbPort, run_id: str | None = None, node_id: str | None = None) -> int:
    """The rows of the embedded or PostgreSQL adapter's ``points`` table (of one run and/or node),
    counted in SQL on the handle's own connection: what is stored, rows no page would show
    included (what a failed ingest must not leave behind)."""
    from aml_pipeline.tsdb.duckdb import DuckDBTsdb
    from aml_pipeline.tsdb.postgres import PostgresTsdb

    if isinstance(db, PostgresTsdb):
        schema, mark = f"{db._s}.", "%s"
    elif isinstance(db, DuckDBTsdb):
        schema, mark = "", "?"
    else:
        raise TypeError(f"point_count counts the rows of the embedded or PostgreSQL adapter, not {db!r}")
    where, params = [], []
    if run_id is not None:
        where.append(f"run_key = (SELECT run_key FROM {schema}runs WHERE run_id = {mark})")
        params.append(run_id)
    if node_id is not None:
        where.append(f"node_key = (SELECT node_key FROM {schema}nodes WHERE node_id = {mark})")
        params.append(node_id)
    query = f"SELECT count(*) FROM {schema}points" + (" WHERE " + " AND ".join(where) if where else "")
    with db._lock:
        return int(db._c.execute(query, params).fetchone()[0])
