"""The PostgreSQL benchmark's COPY reference reads the rows the adapter stored, and only those."""

from __future__ import annotations

import uuid

import pytest

from aml_pipeline.errors import UnknownRunError
from aml_pipeline.tsdb.postgres import PostgresTsdb
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema
from aml_pipeline_tests.tsdb.support import small_dataset
from bench.pg_copy import copy_points


@pytest.fixture
def url(postgres_url):
    schema = f"t_{uuid.uuid4().hex[:10]}"
    yield with_schema(postgres_url, schema)
    drop_schema(postgres_url, schema)


def test_copy_counts_the_rows_of_the_runs_and_nodes_asked_for(url):
    runs, nodes, pts = small_dataset()
    with PostgresTsdb(url) as db:
        db.ingest(runs=runs, nodes=nodes, points=pts)
    for fmt in ("text", "binary"):
        n, seconds = copy_points(url, fmt=fmt)
        assert n == len(pts) and seconds >= 0
    assert copy_points(url, ["R0", "R2"], ["N1"])[0] == 100
    with pytest.raises(UnknownRunError):
        copy_points(url, ["NOPE"])
    with pytest.raises(ValueError):
        copy_points(url, fmt="csv")
