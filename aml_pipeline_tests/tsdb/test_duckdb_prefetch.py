"""DuckDBTsdb.prefetch: pages served from one run query are exactly the SQL path's pages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from aml_pipeline.errors import UnknownNodeError
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline.tsdb.port import Node, PointColumns, Run
from aml_pipeline_tests.tsdb.series import fetch_node_series


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(3)
    runs = [Run(f"R{r}", "L1", "P1", "RC", 1, "h", 0, 100_000, "simulation", True) for r in range(3)]
    nodes = [Node(f"N{j}") for j in range(4)]
    url = f"duckdb://{Path(tmp_path_factory.mktemp('prefetch')) / 'tsdb.duckdb'}"
    with DuckDBTsdb(url, read_only=False) as db:
        db.ingest(runs=runs, nodes=nodes)
        for _ in range(3):  # several ingests: a series is spread over row groups, with equal ts
            n = 600
            ts = rng.integers(0, 2000, n) * 50  # many duplicate timestamps
            db.ingest(points=PointColumns(
                np.array([f"R{r}" for r in rng.integers(0, 3, n)], dtype=object),
                np.array([f"N{j}" for j in rng.integers(0, 4, n)], dtype=object),
                ts.astype(np.int64), rng.normal(size=n), rng.integers(0, 3, n).astype(np.int32),
            ))
    return url


@pytest.mark.parametrize("limit", [1, 7, 250, 100_000])
@pytest.mark.parametrize("window", [(0, 100_000), (20_000, 60_050), (99_000, 10)])
def test_prefetched_pages_equal_the_sql_pages(url: str, limit: int, window: tuple[int, int]) -> None:
    lo, hi = window
    nodes = ["N0", "N1", "N2", "N3"]
    with DuckDBTsdb(url) as db:
        for run in ("R0", "R2"):
            plain = [fetch_node_series(db, n, run, lo, hi, page_limit=limit) for n in nodes]
            db.prefetch(run, nodes, lo, hi)
            fast = [fetch_node_series(db, n, run, lo, hi, page_limit=limit) for n in nodes]
            assert not db._prefetched  # every served series was dropped
            for a, b in zip(plain, fast, strict=True):
                assert a.pages == b.pages
                for col in ("ts", "value", "state", "seq"):
                    assert np.array_equal(getattr(a, col), getattr(b, col)), col


def test_prefetch_only_serves_what_it_read(url: str) -> None:
    with DuckDBTsdb(url) as db:
        db.prefetch("R1", ["N0", "NOPE"], 0, 100_000)  # an unknown node is left to query_page
        with pytest.raises(UnknownNodeError):
            fetch_node_series(db, "NOPE", "R1", 0, 100_000)
        other = fetch_node_series(db, "N0", "R1", 0, 50_000)  # other window: the SQL path
        assert other.ts.max() <= 50_000
        full = fetch_node_series(db, "N0", "R1", 0, 100_000)
        assert full.ts.max() > 50_000
