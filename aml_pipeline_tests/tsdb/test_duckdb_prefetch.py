"""DuckDBTsdb.prefetch: pages served from one run query are exactly the SQL path's pages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from aml_pipeline.errors import UnknownNodeError
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline.tsdb.port import Node, PointColumns, Run
from aml_pipeline_tests.tsdb.series import fetch_node_series


@pytest.fixture(scope="module", params=[3, 1], ids=["three-ingests", "one-ingest"])
def url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(3)
    runs = [Run(f"R{r}", "L1", "P1", "RC", 1, "h", 0, 100_000, "simulation", True) for r in range(3)]
    nodes = [Node(f"N{j}") for j in range(4)]
    url = f"duckdb://{Path(tmp_path_factory.mktemp('prefetch')) / 'tsdb.duckdb'}"
    with DuckDBTsdb(url, read_only=False) as db:
        db.ingest(runs=runs, nodes=nodes)
        # Several ingests: a series is spread over row groups (stored in pieces), with equal ts.
        # One ingest: each series stored in one piece, in (ts, seq) order.
        for _ in range(request.param):
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


def _pages(db: DuckDBTsdb, run: str, nodes: list[str], lo: int, hi: int, limit: int) -> list:
    return [fetch_node_series(db, n, run, lo, hi, page_limit=limit) for n in nodes]


def _same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.pages == y.pages
        for col in ("ts", "value", "state", "seq"):
            assert np.array_equal(getattr(x, col), getattr(y, col)), col


@pytest.mark.parametrize("limit", [7, 100_000])
def test_slices_read_ahead_are_served_without_a_read(url: str, limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = ["N0", "N1", "N2", "N3"]
    slices = [("R0", 0, 100_000), ("R1", 20_000, 60_050), ("R2", 99_000, 10), ("R2", 0, 100_000)]
    with DuckDBTsdb(url) as db:
        plain = [_pages(db, r, nodes, lo, hi, limit) for r, lo, hi in slices]
    with DuckDBTsdb(url) as db:
        reads: list[str] = []
        real = db._select
        monkeypatch.setattr(db, "_select", lambda sql, params, **k: reads.append(sql) or real(sql, params, **k))
        for i, (run, lo, hi) in enumerate(slices):
            taken = db.prefetch(run, nodes, lo, hi, ahead=slices[i + 1 :])
            assert taken == (lo <= hi)
            assert len(reads) == 1  # the first prefetch read every slice; an empty one needs no read
            _same(_pages(db, run, nodes, lo, hi, limit), plain[i])
        assert not db._prefetched and not db._ahead


def test_read_ahead_is_bounded_and_dropped_by_another_prefetch(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = ["N0", "N1", "N2", "N3"]
    with DuckDBTsdb(url) as db:
        counts = [db._run_points[db._run_key(r)] for r in ("R0", "R1", "R2")]
        # Room for two runs' points at once: the third is not read ahead.
        monkeypatch.setattr(DuckDBTsdb, "prefetch_limit", classmethod(lambda cls: counts[0] + counts[1]))
        assert db.prefetch("R0", nodes, 0, 100_000, ahead=[("R1", 0, 100_000), ("R2", 0, 100_000)])
        assert [k[0] for k in db._ahead] == ["R1"]
        # A slice larger than this prefetch's bound is not served from what is held.
        assert not db.prefetch("R1", nodes, 0, 100_000, max_points=counts[1] // 8)
        assert not db._ahead and not db._prefetched
        assert db.prefetch("R0", nodes, 0, 100_000, ahead=[("R1", 0, 100_000)])
        assert db.prefetch("R2", nodes, 0, 100_000)  # not held: the held slices are dropped
        assert not db._ahead
        full = fetch_node_series(db, "N1", "R2", 0, 100_000)
    with DuckDBTsdb(url) as db:
        _same([full], [fetch_node_series(db, "N1", "R2", 0, 100_000)])
