"""Helpers of the mapped-source tests: one small simulated plant and its embedded reference build,
points compared with the reference's, and a node with hundreds of points at one millisecond read
page by page at several page limits.

The plant starts 50 minutes before 2025-02-01 00:00 UTC, so its runs cross a day and a month
boundary (hive day folders, monthly tables) and the midnight of the Europe/Berlin wide layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aml_pipeline.pipeline.stages.manifest import PublishedDataset
from aml_pipeline.simulate.plant import SimulatedPlant, plant_spec_dict, simulate_plant
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline.sources.backend import NO_END
from aml_pipeline.tsdb.port import PointColumns, iter_node_pages
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline_tests.tsdb.series import fetch_node_series
from aml_pipeline_tests.tsdb.support import ingest_plant


FEB_1_2025_MS = 1_738_368_000_000


PLANT_START_MS = FEB_1_2025_MS - 50 * 60_000


def make_plant(**kw) -> SimulatedPlant:
    return simulate_plant(n_runs=5, run_minutes=10, seed=3, start_ms=PLANT_START_MS, **kw)


def plant_spec(plant: SimulatedPlant) -> DatasetSpec:
    return parse_spec(plant_spec_dict(plant, "mapped_ds", history_steps=20, horizon_steps=10, extras=True))


def build(spec: DatasetSpec, url: str, root: Path) -> PublishedDataset:
    with open_tsdb(url) as db:
        return build_dataset(spec, db, store_root=root / "store", datasets_root=root / "datasets")


@dataclass
class Reference:
    """The plant's points in an embedded file, and the snapshot built from it."""

    url: str
    published: PublishedDataset


def embedded_reference(plant: SimulatedPlant, root: Path, points: PointColumns | None = None, runs=None) -> Reference:
    url = f"duckdb://{root / 'plant.duckdb'}"
    with DuckDBTsdb(url, read_only=False) as db:
        if points is None and runs is None:
            ingest_plant(db, plant)
        else:
            db.ingest(runs=runs if runs is not None else plant.runs, nodes=plant.nodes)
            db.ingest(points=points if points is not None else plant.points)
    return Reference(url, build(plant_spec(plant), url, root / "build"))


# Values the test OPC UA server returns per node and read: below a run's points per node, so
# every run's read follows continuation points.
OPCUA_MAX_VALUES = 100


def same_points(mapped_url: str, reference_url: str) -> int:
    """Every point of every run and node, in (ts, seq) order, equal in ts, value and state."""
    total = 0
    with open_tsdb(mapped_url) as m, open_tsdb(reference_url) as d:
        assert m.list_nodes() == d.list_nodes()
        runs = d.list_runs(finished_only=False)
        assert m.list_runs(finished_only=False) == runs
        assert m.availability_watermark() == d.availability_watermark()
        for run in runs:
            end = NO_END if run.ended_at is None else run.ended_at
            for node in d.list_nodes():
                a = fetch_node_series(m, node.node_id, run.run_id, run.started_at, end, page_limit=997)
                b = fetch_node_series(d, node.node_id, run.run_id, run.started_at, end)
                where = f"{run.run_id}/{node.node_id}"
                np.testing.assert_array_equal(a.ts, b.ts, err_msg=where)
                np.testing.assert_array_equal(a.value, b.value, err_msg=where)
                np.testing.assert_array_equal(a.state, b.state, err_msg=where)
                total += len(a)
    return total


T0 = 1_738_368_000_000  # 2025-02-01 UTC


def tie_points(seed: int = 7) -> dict[str, np.ndarray]:
    """Node TIE: bursts of up to 300 points at one millisecond between single ones, values that
    do not follow insertion order; node ONE: one point a second. Insertion order is the row order."""
    rng = np.random.default_rng(seed)
    counts = rng.choice([1, 1, 2, 3, 40], size=40)
    counts[[5, 6, 30]] = 300  # bursts longer than some page limits, two of them back to back
    ts = T0 + np.repeat(np.arange(counts.size) * 10, counts)
    tie = {"tag": np.full(ts.size, "TIE"), "ts": ts, "value": rng.normal(size=ts.size).round(3),
           "quality": rng.choice([192, 192, 192, 64, 0], size=ts.size)}
    one_ts = T0 + np.arange(0, 1200, 100)
    one = {"tag": np.full(one_ts.size, "ONE"), "ts": one_ts, "value": np.arange(one_ts.size, dtype=float),
           "quality": np.full(one_ts.size, 192)}
    cat = {k: np.concatenate([tie[k], one[k]]) for k in tie}
    order = np.argsort(cat["ts"], kind="stable")  # rows in time order, ties in insertion order
    return {k: v[order] for k, v in cat.items()}


EXPECTED_STATE = {192: 0, 64: 1, 0: 2}


def read_all(db, node: str, page_limit: int):
    run = db.list_runs(finished_only=False)[0]
    pages = list(iter_node_pages(db, node, run.run_id, run.started_at, run.ended_at or 2**62, page_limit=page_limit))
    ts = np.concatenate([p.ts for p, _ in pages])
    value = np.concatenate([p.value for p, _ in pages])
    state = np.concatenate([p.state for p, _ in pages])
    seq = np.concatenate([p.seq for p, _ in pages])
    return ts, value, state, seq, len(pages)


def expected(rows: dict[str, np.ndarray], node: str, tie_by_value: bool = False):
    sel = rows["tag"] == node
    ts, value, q = rows["ts"][sel], rows["value"][sel], rows["quality"][sel]
    state = np.vectorize(EXPECTED_STATE.get)(q).astype(np.int32)
    order = np.lexsort((state, value, ts)) if tie_by_value else np.arange(ts.size)
    return ts[order], value[order], state[order]


# Page limits: one point a page, a few, just below and above a burst, everything at once. A page
# of the lake backends is a scan of its files, so they skip the one-point pages.
LIMITS = (1, 7, 299, 301, 100_000)
LAKE_LIMITS = (7, 299, 301, 100_000)


def check_pages(db, rows: dict[str, np.ndarray], tie_by_value: bool = False, limits=LIMITS) -> None:
    for node in ("TIE", "ONE"):
        want_ts, want_value, want_state = expected(rows, node, tie_by_value)
        first = None
        for limit in limits:
            ts, value, state, seq, n_pages = read_all(db, node, limit)
            np.testing.assert_array_equal(ts, want_ts)
            np.testing.assert_array_equal(value, want_value)
            np.testing.assert_array_equal(state, want_state)
            # seq numbers the points of one millisecond 0, 1, ...
            starts = np.r_[True, ts[1:] != ts[:-1]]
            group_start = np.maximum.accumulate(np.where(starts, np.arange(ts.size), 0))
            np.testing.assert_array_equal(seq, np.arange(ts.size) - group_start)
            assert n_pages >= -(-ts.size // limit)
            first = first or (ts, value, seq)
        # the prefetched slice serves the same pages
        run = db.list_runs(finished_only=False)[0]
        assert db.prefetch(run.run_id, ["TIE", "ONE"], run.started_at, run.ended_at)
        s = fetch_node_series(db, node, run.run_id, run.started_at, run.ended_at, page_limit=13)
        np.testing.assert_array_equal(s.ts, want_ts)
        np.testing.assert_array_equal(s.value, want_value)
        np.testing.assert_array_equal(s.seq, first[2])
