"""Runs read one after another from a lake whose files each hold several runs (a file a day):
each file is decoded once, and every run gets exactly the points reading its files alone gives,
however the lake changes between runs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aml_pipeline.sources import open_source
from aml_pipeline.sources.lake import LakeSource
from aml_pipeline_tests.sources.layouts import write_description
from aml_pipeline_tests.tsdb.series import fetch_node_series

DAY_MS = 86_400_000
T0 = 1_738_368_000_000  # 2025-02-01 UTC
NODES = ["A", "B", "C"]
QUALITY = {"column": "quality", "good": [192], "states": {64: 1}, "other": 2}
STATE = {192: 0, 64: 1, 0: 2}


def plant_rows(seed: int = 3) -> dict[str, np.ndarray]:
    """Two days of three nodes, a point every 10 s, in insertion order; some samples re-sent
    (the same node and time again, another value), among them the last point of a 3 h window
    and the first of the next."""
    rng = np.random.default_rng(seed)
    ts = np.repeat(T0 + np.arange(0, 2 * DAY_MS, 10_000), len(NODES))
    tag = np.tile(np.array(NODES), ts.size // len(NODES))
    again = np.sort(rng.choice(ts.size, 400, replace=False))
    window_edges = np.flatnonzero(np.isin(ts, [T0 + 3 * 3_600_000 - 10_000, T0 + 3 * 3_600_000]))
    again = np.union1d(again, window_edges)
    order = np.argsort(np.concatenate([np.arange(ts.size), again]), kind="stable")  # each copy right after its original
    ts, tag = np.concatenate([ts, ts[again]])[order], np.concatenate([tag, tag[again]])[order]
    return {"tag": tag, "ts": ts, "value": rng.normal(size=ts.size).round(4),
            "quality": rng.choice([192, 192, 192, 64, 0], size=ts.size)}


def write_day(rows: dict[str, np.ndarray], path: Path, *, sorted_by_tag: bool) -> None:
    """One file of ``rows``, in their order or sorted by tag, then time (ties in their order)."""
    order = np.lexsort((np.arange(rows["ts"].size), rows["ts"], rows["tag"])) if sorted_by_tag else slice(None)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "tag": pa.array(rows["tag"][order]),
        "time": pa.array(rows["ts"][order], type=pa.timestamp("ms", tz="UTC")),
        "value": pa.array(rows["value"][order]),
        "quality": pa.array(rows["quality"][order], type=pa.int32()),
    }), path, row_group_size=2048)


def day_lake(root: Path, rows: dict[str, np.ndarray], *, sorted_by_tag: bool, first_run: str = "00:00") -> str:
    """A file a day in day folders; runs are fixed 3 h windows (eight a file) from ``first_run``
    on the first day."""
    for day in range(2):
        sel = (rows["ts"] >= T0 + day * DAY_MS) & (rows["ts"] < T0 + (day + 1) * DAY_MS)
        write_day({k: v[sel] for k, v in rows.items()}, root / "points" / f"date=2025-02-0{day + 1}" / "day.parquet",
                  sorted_by_tag=sorted_by_tag)
    desc = {"backend": "files",
            "points": {"files": "points/**/*.parquet", "node": "tag", "time": "time", "value": "value",
                       "quality": QUALITY, "partition": {"column": "date", "every": "day"}},
            "runs": {"windows": {"every": "3h", "start": f"2025-02-01T{first_run}:00Z", "end": "2025-02-03T00:00:00Z", "line": "L1",
                                 "product": "P", "recipe": "R"}}}
    return str(write_description(root / "plant.yaml", desc))


def expected(rows: dict[str, np.ndarray], node: str, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """The node's points in [lo, hi] in time order, re-sent ones after their original."""
    sel = np.flatnonzero((rows["tag"] == node) & (rows["ts"] >= lo) & (rows["ts"] <= hi))
    sel = sel[np.argsort(rows["ts"][sel], kind="stable")]
    return rows["ts"][sel], rows["value"][sel], np.array([STATE[int(q)] for q in rows["quality"][sel]], np.int32)


def read_run(db, run, max_points: int | None = None) -> dict[str, tuple[np.ndarray, ...]]:
    """The run's points as a build reads them: the prefetch, then pages node by node."""
    assert db.prefetch(run.run_id, NODES, run.started_at, run.ended_at, max_points=max_points)
    out = {}
    for node in NODES:
        s = fetch_node_series(db, node, run.run_id, run.started_at, run.ended_at, page_limit=500)
        out[node] = (s.ts, s.value, s.state)
    return out


def assert_run(rows, run, got) -> None:
    for node in NODES:
        want = expected(rows, node, run.started_at, run.ended_at)
        for a, b, what in zip(got[node], want, ("ts", "value", "state")):
            np.testing.assert_array_equal(a, b, err_msg=f"{run.run_id}/{node}: {what}")


@pytest.fixture
def queries(monkeypatch) -> list[list[str]]:
    """The files of each points query the lake runs, in order."""
    seen: list[list[str]] = []
    real = LakeSource._narrow_rows

    def recording(self, nodes, files, *args, **kwargs):
        seen.append([Path(f).parent.name for f in files])
        return real(self, nodes, files, *args, **kwargs)

    monkeypatch.setattr(LakeSource, "_narrow_rows", recording)
    return seen


@pytest.mark.parametrize("sorted_by_tag", [False, True], ids=["rows_in_time_order", "rows_sorted_by_tag"])
def test_runs_in_time_order_decode_each_day_once_and_get_their_own_points(tmp_path, queries, sorted_by_tag):
    rows = plant_rows()
    url = day_lake(tmp_path, rows, sorted_by_tag=sorted_by_tag)
    with open_source(url) as db:
        runs = db.list_runs(finished_only=False)
        assert len(runs) == 16
        for run in runs:
            assert_run(rows, run, read_run(db, run))
    # the first run of each day read the whole day; the others read nothing
    assert queries == [["date=2025-02-01"], ["date=2025-02-02"]]


def test_runs_out_of_order_read_their_files_again(tmp_path, queries):
    rows = plant_rows()
    url = day_lake(tmp_path, rows, sorted_by_tag=True)
    with open_source(url) as db:
        runs = db.list_runs(finished_only=False)
        for i in (5, 2, 3, 7):
            assert_run(rows, runs[i], read_run(db, runs[i]))
    # run 2 starts before what run 5 kept: the day is read again; run 3 follows run 2
    assert queries == [["date=2025-02-01"], ["date=2025-02-01"]]


def test_a_day_file_rewritten_between_two_runs_is_read_again(tmp_path, queries):
    """A late point lands in the day file after the first run was read: the next run has it."""
    rows = plant_rows()
    url = day_lake(tmp_path, rows, sorted_by_tag=True)
    with open_source(url) as db:
        runs = db.list_runs(finished_only=False)
        assert_run(rows, runs[0], read_run(db, runs[0]))
        late = {"tag": np.array(["B"]), "ts": np.array([runs[1].started_at + 5]), "value": np.array([99.0]),
                "quality": np.array([192])}
        rows = {k: np.concatenate([rows[k], late[k]]) for k in rows}
        day = (rows["ts"] < T0 + DAY_MS)
        path = tmp_path / "points" / "date=2025-02-01" / "day.parquet"
        before = path.stat()
        write_day({k: v[day] for k, v in rows.items()}, path, sorted_by_tag=True)
        assert path.stat().st_size != before.st_size
        got = read_run(db, runs[1])
        assert 99.0 in got["B"][1]
        assert_run(rows, runs[1], got)
    assert queries == [["date=2025-02-01"], ["date=2025-02-01"]]


def test_a_new_file_that_sorts_before_a_held_one_is_read_in_its_place(tmp_path, queries):
    """Points re-sent for the next run arrive in a file whose name comes before the day file's:
    they come first among the points of their time, as reading the files alone puts them."""
    rows = plant_rows()
    url = day_lake(tmp_path, rows, sorted_by_tag=False)
    with open_source(url) as db:
        runs = db.list_runs(finished_only=False)
        assert_run(rows, runs[0], read_run(db, runs[0]))
        t = runs[1].started_at + 60_000
        early = {"tag": np.array(["A", "C"]), "ts": np.array([t, t]), "value": np.array([-7.0, -8.0]),
                 "quality": np.array([64, 192])}
        write_day(early, tmp_path / "points" / "date=2025-02-01" / "a-resent.parquet", sorted_by_tag=False)
        os.sync()
        db.list_runs(finished_only=False)  # a build lists the lake again when it begins
        got = read_run(db, runs[1])
    # the re-sent file's rows come before the day file's rows of the same time
    rows = {k: np.concatenate([early[k], rows[k]]) for k in rows}
    assert_run(rows, runs[1], got)
    assert got["A"][1][got["A"][0] == t][0] == -7.0
    assert queries[1] == ["date=2025-02-01", "date=2025-02-01"]


@pytest.mark.parametrize("bounded", [False, True], ids=["room_for_both", "room_for_one_day"])
def test_what_is_held_stays_within_the_prefetch_share(tmp_path, queries, monkeypatch, bounded):
    """A day is read past the run even when the run's own bound is far smaller (a build's
    cleaning chunk), within the memory share of a prefetch. A run across midnight holds the end
    of the first day when it reads the second: the second is read past the run only if it fits
    that share beside what is held; if not, the next run reads it again. Every run gets its own
    points either way."""
    from aml_pipeline.sources import mapped

    rows = plant_rows()
    url = day_lake(tmp_path, rows, sorted_by_tag=True, first_run="01:30")
    day = T0 + DAY_MS
    per_day = max(int(np.sum(rows["ts"] < day)), int(np.sum(rows["ts"] >= day)))
    held_at_midnight = int(np.sum((rows["ts"] >= day - 90 * 60_000) & (rows["ts"] < day)))
    if bounded:
        monkeypatch.setattr(mapped.MappedTsdb, "prefetch_limit", classmethod(lambda cls: per_day + held_at_midnight // 2))
    run_bound = 4_000  # a run holds about 3,300 points; a day, eight times that
    with open_source(url) as db:
        runs = [r for r in db.list_runs(finished_only=False) if r.ended_at is not None]
        assert [r.started_at % DAY_MS for r in runs[7:9]] == [DAY_MS - 90 * 60_000, 90 * 60_000]  # across midnight, next
        for run in runs:
            assert_run(rows, run, read_run(db, run, run_bound))
    days = [["date=2025-02-01"], ["date=2025-02-01", "date=2025-02-02"], ["date=2025-02-02"]]
    assert queries == ([days[0], ["date=2025-02-02"], days[2]] if bounded else [days[0], ["date=2025-02-02"]])
