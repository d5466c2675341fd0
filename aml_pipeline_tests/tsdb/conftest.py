"""TSDB adapter fixtures.

``tsdb_factory`` is parametrised over every adapter in :data:`ADAPTERS`. Each param yields a
function ``make(read_only=False) -> TsdbPort`` bound to one fresh, empty database; every call
opens a new handle on that same database (handles are closed at teardown). To add an adapter
(e.g. PostgreSQL), write a generator like :func:`_duckdb` that creates an empty database and
yields ``make``, and add it to :data:`ADAPTERS`.

DuckDB note: within one process DuckDB refuses a read-only handle while a read-write handle on
the same file is open, so tests close the writer before asking for ``read_only=True``.

PostgreSQL: every test gets its own, freshly named schema (``?schema=t_<hex>``) on the session's
server (``postgres_url``: ``AML_TEST_PG_URL`` or a throwaway server), dropped at teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import uuid

import pytest

from aml_pipeline.tsdb.port import TsdbPort
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema

MakeTsdb = Callable[..., TsdbPort]


def _duckdb(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MakeTsdb]:
    from aml_pipeline.tsdb.duckdb import DuckDBTsdb

    url = f"duckdb://{tmp_path / 'tsdb.duckdb'}"  # duckdb:///abs/path
    opened: list[TsdbPort] = []

    def make(read_only: bool = False) -> TsdbPort:
        db = DuckDBTsdb(url, read_only=read_only, lock_timeout_s=2.0)
        opened.append(db)
        return db

    try:
        yield make
    finally:
        for db in reversed(opened):
            db.close()


def _postgres(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MakeTsdb]:
    from aml_pipeline.tsdb.postgres import PostgresTsdb

    server = request.getfixturevalue("postgres_url")
    schema = f"t_{uuid.uuid4().hex[:16]}"
    url = with_schema(server, schema)
    opened: list[TsdbPort] = []

    def make(read_only: bool = False) -> TsdbPort:
        db = PostgresTsdb(url, read_only=read_only)
        opened.append(db)
        return db

    try:
        yield make
    finally:
        for db in reversed(opened):
            db.close()
        drop_schema(server, schema)


ADAPTERS: dict[str, Callable[[Path, pytest.FixtureRequest], Iterator[MakeTsdb]]] = {
    "duckdb": _duckdb,
    "postgres": _postgres,
}


@pytest.fixture(params=sorted(ADAPTERS))
def tsdb_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeTsdb]:
    yield from ADAPTERS[request.param](tmp_path, request)


@pytest.fixture(params=["duckdb", "postgres"])
def new_tsdb_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a TSDB that does not exist yet: a DuckDB file (in a directory not made yet), or a
    fresh schema on the session's PostgreSQL server (dropped at teardown)."""
    if request.param == "duckdb":
        yield f"duckdb://{tmp_path / 'db' / 'tsdb.duckdb'}"
        return
    server = request.getfixturevalue("postgres_url")
    schema = f"t_{uuid.uuid4().hex[:16]}"
    try:
        yield with_schema(server, schema)
    finally:
        drop_schema(server, schema)
