"""DuckDB pages read in time windows (no ORDER BY ... LIMIT): every window size gives exactly the
pages a sorted reference gives, ties across window and page boundaries included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from aml_pipeline.tsdb import duckdb as adapter
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline.tsdb.port import Cursor, Node, PointColumns, Run
from aml_pipeline_tests.tsdb.series import fetch_node_series

FAR = 2**62


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory):
    """Three ingests into one series: dense, sparse, gaps, late points, 300 points at one ts."""
    rng = np.random.default_rng(11)
    url = f"duckdb://{Path(tmp_path_factory.mktemp('pages')) / 'tsdb.duckdb'}"
    batches = [
        np.sort(rng.integers(0, 5_000, 1_500)),  # dense with many ties
        rng.integers(0, 200_000, 400),  # sparse, unordered
        np.concatenate([np.full(300, 777), rng.integers(10**6, 10**6 + 50, 200)]),  # one crowded ts
    ]
    ts_all, seq_all = [], []
    with DuckDBTsdb(url, read_only=False) as db:
        db.ingest(runs=[Run("R", "L", "P", "C", 1, "h", 0, 10**7)], nodes=[Node("A"), Node("B")])
        seq = 0
        for b in batches:
            n = b.shape[0]
            db.ingest(points=PointColumns(
                np.full(n, "R", dtype=object), np.full(n, "A", dtype=object), b.astype(np.int64),
                np.arange(seq, seq + n, dtype=np.float64), np.zeros(n, np.int32),
            ))
            ts_all.append(b)
            seq_all.append(np.arange(seq, seq + n))
            seq += n
    ts, seq = np.concatenate(ts_all), np.concatenate(seq_all)
    order = np.lexsort((seq, ts))
    return url, ts[order], seq[order]


@pytest.mark.parametrize("window_rows", [1, 3, 64, 100_000])
@pytest.mark.parametrize(
    ("limit", "bounds"),
    [(lim, b) for lim in (7, 256, 5_000) for b in ((-FAR, FAR), (700, 1_000_010), (777, 777))]
    + [(1, (777, 777)), (1, (4_990, 1_000_010))],
)
def test_windowed_pages_equal_the_sorted_reference(stored, monkeypatch, window_rows, limit, bounds):
    url, ref_ts, ref_seq = stored
    lo, hi = bounds
    keep = (ref_ts >= lo) & (ref_ts <= hi)
    monkeypatch.setattr(adapter, "_WINDOW_ROWS", window_rows)
    with DuckDBTsdb(url) as db:
        s = fetch_node_series(db, "A", "R", lo, hi, page_limit=limit)
        assert s.ts.tolist() == ref_ts[keep].tolist()
        assert s.seq.tolist() == ref_seq[keep].tolist()
        assert s.value.tolist() == ref_seq[keep].astype(float).tolist()  # values name the rows
        n = int(keep.sum())
        assert s.pages in (max(1, -(-n // limit)), n // limit + 1)
        # a cursor in the middle of the crowded timestamp, resumed by a fresh handle
        crowded = np.flatnonzero(ref_ts[keep] == 777)
        if crowded.size > 10:
            i = int(crowded[5])
            c = Cursor(int(ref_ts[keep][i]), int(ref_seq[keep][i]))
            with DuckDBTsdb(url) as other:
                page = other.query_page("A", "R", lo, hi, c, limit)
            expect = ref_seq[keep][i + 1 : i + 1 + limit].tolist()
            assert page.seq.tolist() == expect
            assert page.done == (i + 1 + limit >= n)


def test_an_empty_series_and_empty_windows(stored, monkeypatch):
    url, _, _ = stored
    monkeypatch.setattr(adapter, "_WINDOW_ROWS", 2)
    with DuckDBTsdb(url) as db:
        assert len(fetch_node_series(db, "B", "R", -FAR, FAR)) == 0
        page = db.query_page("A", "R", 300_000, 900_000, None, 3)  # between the ingests
        assert page.done and page.ts.tolist() == []
