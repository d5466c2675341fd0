"""The embedded TSDB's readers live within a share of the memory budget (AML_MEMORY_MB), set once;
a query that does not fit fails naming the budget (nothing retries with more memory), and a
prefetch never keeps more than its share."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from aml_pipeline.errors import AmlError, TsdbError
from aml_pipeline.tsdb.duckdb import DuckDBTsdb, reader_memory_limit_mb
from aml_pipeline.tsdb.port import Cursor, Node, PointColumns, Run
from aml_pipeline_tests.tsdb.series import fetch_node_series

FAR = 2**62
CROWDED = 1_000_000  # points of one node at one timestamp


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"duckdb://{Path(tmp_path_factory.mktemp('memory')) / 'tsdb.duckdb'}"
    rng = np.random.default_rng(4)
    n = 150_000
    with DuckDBTsdb(url, read_only=False) as db:
        db.ingest(runs=[Run("R", "L", "P", "C", 1, "h", 0, 10**9)], nodes=[Node("A"), Node("B"), Node("C")])
        for node in ("A", "B"):
            db.ingest(points=PointColumns(
                np.full(n, "R", dtype=object), np.full(n, node, dtype=object),
                np.sort(rng.integers(0, 10**8, n)).astype(np.int64), rng.normal(size=n), np.zeros(n, np.int32),
            ))
    # Node C: a million points at one timestamp, stored out of seq order (written past the
    # adapter, which would store them in seq order): the one query DuckDB must sort itself.
    perm = rng.permutation(CROWDED)
    con = duckdb.connect(url[len("duckdb://"):])
    con.register("crowded", pa.table({
        "run_key": np.ones(CROWDED, np.int32), "node_key": np.full(CROWDED, 3, np.int32),
        "ts": np.full(CROWDED, 5_000, np.int64), "value": perm.astype(np.float64),
        "state": np.zeros(CROWDED, np.int32), "seq": (10**6 + perm).astype(np.int64),
    }))
    con.execute("INSERT INTO points SELECT * FROM crowded")
    con.close()
    return url


def duckdb_limit_mib(db: DuckDBTsdb) -> float:
    text = db._c.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
    value, unit = text.split()
    return float(value) * {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}[unit]


@pytest.mark.parametrize(("budget", "expected"), [(None, 32), ("64", 16), ("512", 16), ("1024", 32), ("4096", 128)])
def test_the_reader_memory_limit_is_a_share_of_the_budget(url, monkeypatch, budget, expected):
    if budget is None:
        monkeypatch.delenv("AML_MEMORY_MB", raising=False)
    else:
        monkeypatch.setenv("AML_MEMORY_MB", budget)
    assert reader_memory_limit_mb() == expected
    with DuckDBTsdb(url) as db:
        assert db.memory_limit_mb == expected
        assert duckdb_limit_mib(db) == pytest.approx(expected, rel=0.01)


def test_an_invalid_budget_is_a_configuration_error(url, monkeypatch):
    monkeypatch.setenv("AML_MEMORY_MB", "lots")
    with pytest.raises(AmlError) as info:
        DuckDBTsdb(url)
    assert info.value.code == "CONFIG_INVALID" and "AML_MEMORY_MB" in info.value.message


def test_a_query_that_does_not_fit_fails_naming_the_budget_then_fits_with_a_larger_one(url, monkeypatch):
    monkeypatch.setenv("AML_MEMORY_MB", "64")
    with DuckDBTsdb(url) as db:
        with pytest.raises(TsdbError) as info:
            db.query_page("C", "R", 0, FAR, None, 250_000)
        err = info.value
        assert err.code == "TSDB_OUT_OF_MEMORY"
        assert "16 MB" in err.message and "AML_MEMORY_MB=64" in err.message and "raise AML_MEMORY_MB" in err.message
        assert "\n" not in err.one_line()
        # the handle is still fine for what fits
        assert len(fetch_node_series(db, "A", "R", 0, FAR)) == 150_000
    monkeypatch.setenv("AML_MEMORY_MB", "4096")
    with DuckDBTsdb(url) as db:
        assert db.memory_limit_mb == 128
        page = db.query_page("C", "R", 0, FAR, None, 250_000)
        assert len(page) == 250_000 and not page.done
        assert page.value.tolist() == list(range(250_000))  # ordered by seq within the timestamp
        assert page.next_cursor == Cursor(5_000, 10**6 + 249_999)
        rest = db.query_page("C", "R", 0, FAR, page.next_cursor, 250_000)
        assert rest.value.tolist() == list(range(250_000, 500_000)) and not rest.done


def test_prefetch_keeps_at_most_its_share_of_the_budget(url, monkeypatch):
    monkeypatch.setenv("AML_MEMORY_MB", "64")
    limit = DuckDBTsdb.prefetch_limit()
    assert limit == 64 * 2**20 // 8 // 36  # 233,016 points
    with DuckDBTsdb(url) as db:
        plain = {n: fetch_node_series(db, n, "R", 0, 10**8) for n in ("A", "B")}
        assert not db.prefetch("R", ["A", "B"], 0, 10**8)  # 300 000 points: too many
        assert not db._prefetched
        again = {n: fetch_node_series(db, n, "R", 0, 10**8) for n in ("A", "B")}
        half = int(np.median(plain["A"].ts))
        assert db.prefetch("R", ["A", "B"], 0, half)  # about 150 000: kept
        assert db._prefetched
        sliced = {n: fetch_node_series(db, n, "R", 0, half) for n in ("A", "B")}
        assert not db._prefetched  # served and dropped
    for n in ("A", "B"):
        assert np.array_equal(again[n].seq, plain[n].seq)
        keep = plain[n].ts <= half
        assert np.array_equal(sliced[n].seq, plain[n].seq[keep])
        assert np.array_equal(sliced[n].value, plain[n].value[keep])
