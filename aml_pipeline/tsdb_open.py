"""Open whatever a TSDB URL names: the embedded file, PostgreSQL, or a plant's source description.

This module sits above :mod:`aml_pipeline.tsdb` (the port and the product's own adapters) and
:mod:`aml_pipeline.sources` (the mapped sources, built on the tsdb package's read base), so that
``tsdb`` never imports ``sources``. Everything that takes a TSDB URL from a user (``--tsdb``,
``AML_TSDB_URL``, the Dagster resource) opens it here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from aml_pipeline.errors import TsdbError
from aml_pipeline.sources import is_source_url, open_source
from aml_pipeline.tsdb import open_adapter
from aml_pipeline.tsdb.port import DEFAULT_LOCK_TIMEOUT_S, TsdbPort
from aml_pipeline.tsdb.retry import OnRetry, RetryingTsdb
from aml_pipeline.tsdb.session import BriefHandle, TsdbSession


def open_tsdb(url: str, *, read_only: bool = True, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> TsdbPort:
    """Open the adapter for ``url``: ``duckdb:///path/file.duckdb``, ``postgresql://...``, or a
    source description (``plant.yaml`` or ``source:///path/plant.yaml``, docs/sources.md).

    ``read_only`` and ``lock_timeout_s``: see :func:`aml_pipeline.tsdb.open_adapter`. A source
    is always read-only (its ingest refuses), so ``read_only`` changes nothing there. For long
    work in chunks use :func:`retrying_tsdb` or a :class:`~aml_pipeline.tsdb.session.TsdbSession`
    with ``opener=open_tsdb``, which hold a handle per chunk only.
    """
    if is_source_url(url):
        return open_source(url)
    try:
        return open_adapter(url, read_only=read_only, lock_timeout_s=lock_timeout_s)
    except TsdbError as e:
        from aml_pipeline.tsdb.duckdb import NOT_A_DATABASE, parse_duckdb_url

        # ``duckdb:///plant.yaml`` names a DuckDB file whatever its suffix; a user who wrote it
        # for a source description learns the form that reads one.
        if e.code == NOT_A_DATABASE and is_source_url(str(path := parse_duckdb_url(url))):
            raise TsdbError(f"{e.message}; to read {path.name} as a source description, use "
                            f"source://{path} (docs/sources.md)", code=e.code) from None
        raise


@contextmanager
def retrying_tsdb(
    url: str, *, on_retry: OnRetry | None = None, hold_s: float = 0.5, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
) -> Iterator[RetryingTsdb]:
    """A read-only port on ``url`` for a build: a handle held at most about ``hold_s`` at a time
    (:class:`~aml_pipeline.tsdb.session.BriefHandle`), reopened as needed, each call retried
    (:class:`~aml_pipeline.tsdb.retry.RetryingTsdb`)."""
    with TsdbSession(url, lock_timeout_s=lock_timeout_s, opener=open_tsdb) as session:
        brief = BriefHandle(session, hold_s)
        yield RetryingTsdb(brief, on_retry=on_retry, reset=brief.release)
