"""TSDB port and adapters. ``open_adapter(url)`` picks the adapter from the URL scheme.

A TSDB URL may also name a plant's source description (:mod:`aml_pipeline.sources`), which this
package never imports: :func:`aml_pipeline.tsdb_open.open_tsdb` opens any of them.
"""

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
    "open_adapter",
]

def open_adapter(url: str, *, read_only: bool = True, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> TsdbPort:
    """Open the product's own TSDB at ``url``: ``duckdb:///path/file.duckdb`` or
    ``postgresql://...`` (any URL, a source description too: :func:`aml_pipeline.tsdb_open.open_tsdb`).

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
    raise TsdbError(
        f"unsupported TSDB URL {url!r}: use duckdb:///path/to/file.duckdb, postgresql://user@host/db "
        "or a source description (plant.yaml, docs/sources.md)",
        code="TSDB_URL_INVALID",
    )
