"""TSDB port and adapters. ``open_tsdb(url)`` picks the adapter from the URL scheme."""

from __future__ import annotations

from aml_pipeline.errors import TsdbError
from aml_pipeline.tsdb.port import (
    DEFAULT_LOCK_TIMEOUT_S,
    Cursor,
    Node,
    Page,
    PointColumns,
    Run,
    RunScope,
    TsdbPort,
)
from aml_pipeline.tsdb.session import TsdbSession

__all__ = [
    "Cursor",
    "Node",
    "Page",
    "PointColumns",
    "Run",
    "RunScope",
    "TsdbPort",
    "TsdbSession",
    "open_tsdb",
]


def open_tsdb(url: str, *, read_only: bool = True, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> TsdbPort:
    """Open the adapter for ``url``: ``duckdb:///path/file.duckdb``, ``postgresql://...``, or a
    source description (``plant.yaml`` or ``source:///path/plant.yaml``, docs/sources.md).

    ``read_only`` matters for the embedded file: many read-only processes may share it, a
    writer (ingest) needs it alone. ``lock_timeout_s``: how long to wait for the other side
    (a reader for a writer's turn, a writer for the readers to let go; PostgreSQL: an ingest
    for another one to commit) before ``TSDB_BUSY``. For long work in chunks use
    :class:`TsdbSession`, which holds a handle per chunk only.
    """
    if url.startswith("duckdb://"):
        from aml_pipeline.tsdb.duckdb import DuckDBTsdb

        return DuckDBTsdb(url, read_only=read_only, lock_timeout_s=lock_timeout_s)
    if url.startswith(("postgresql://", "postgres://")):
        from aml_pipeline.tsdb.postgres import PostgresTsdb

        return PostgresTsdb(url, read_only=read_only, lock_timeout_s=lock_timeout_s)
    from aml_pipeline.sources import is_source_url, open_source

    if is_source_url(url):
        # A plant's own tables, files or InfluxDB, mapped by a description: always read-only
        # (its ingest refuses), so ``read_only`` changes nothing.
        return open_source(url)
    raise TsdbError(
        f"unsupported TSDB URL {url!r}: use duckdb:///path/to/file.duckdb, postgresql://user@host/db "
        "or a source description (plant.yaml, docs/sources.md)",
        code="TSDB_URL_INVALID",
    )
