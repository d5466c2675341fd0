"""A simulated plant (spikes, bad states, out-of-range readings, duplicates, short and long
dropouts) in a DuckDB file, and snapshots of it built by the library build, for the live path."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aml_pipeline.live.points import NodePoints, node_points
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.registry import WINDOWS
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.simulate.plant import SimulatedPlant, plant_spec_dict, simulate_plant
from aml_pipeline.snapshot import Snapshot, open_snapshot
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb_open import open_tsdb


@pytest.fixture(scope="session")
def plant() -> SimulatedPlant:
    # 4 runs of 7 min: train 2, val 1, test 1; every run has spikes, bad states and dropouts.
    return simulate_plant(n_runs=4, run_minutes=7, seed=21, unfinished_last_run=False, spike_rate=0.01,
                          bad_state_rate=0.005, short_dropouts_per_hour=20.0, long_dropouts_per_hour=10.0)


@pytest.fixture(scope="session")
def plant_url(plant: SimulatedPlant, tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"duckdb://{tmp_path_factory.mktemp('live-plant') / 'tsdb.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    return url


@dataclass
class Built:
    spec: DatasetSpec
    snap: Snapshot
    store: DatasetStore

    def windows(self) -> Iterator[tuple[int, str, int]]:
        """Every window of the snapshot: (index, run id, origin in epoch ms)."""
        for block in self.snap.runs():
            meta = self.store.read_meta(block.run_id, WINDOWS)
            starts = self.store.read_flat(block.run_id, WINDOWS, "starts", 0, len(block))
            for i, start in zip(block.windows, starts.tolist(), strict=True):
                yield i, block.run_id, int(meta["firstMs"]) + start * self.spec.beat_ms


def spec_dict(plant: SimulatedPlant, *, extras: bool = True, point_nodes: tuple[str, ...] = (), **overrides: Any) -> dict[str, Any]:
    """The plant's spec (H 20, F 10), v2 with ``extras``; ``point_nodes`` set ``aggregate: point``."""
    data = plant_spec_dict(plant, "live_ds", history_steps=20, horizon_steps=10, extras=extras,
                           split={"method": "chronological", "train": 0.5, "val": 0.25, "test": 0.25, "seed": 0})
    for node in data["nodes"]:
        if node["nodeId"] in point_nodes:
            node["aggregate"] = "point"
    data.update(overrides)
    return data


def build(data: dict[str, Any], url: str, root: Path) -> Built:
    spec = parse_spec(data)
    with open_tsdb(url) as db:
        published = build_dataset(spec, db, store_root=root / "store", datasets_root=root / "datasets")
    return Built(spec, open_snapshot(published.snapshot_dir), DatasetStore(root / "store", spec))


@pytest.fixture(scope="session")
def built(plant, plant_url, tmp_path_factory) -> Callable[..., Built]:
    """``built(extras=..., **spec overrides)``: a snapshot of the plant, built once per session."""
    cache: dict[str, Built] = {}

    def make(**kw: Any) -> Built:
        key = repr(sorted(kw.items()))
        if key not in cache:
            cache[key] = build(spec_dict(plant, **kw), plant_url, tmp_path_factory.mktemp("live"))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def run_points(plant: SimulatedPlant) -> dict[str, dict[str, NodePoints]]:
    """Every point of every run, per node, in ingestion order within a timestamp."""
    p = plant.points
    out: dict[str, dict[str, NodePoints]] = {}
    for run in plant.runs:
        in_run = p.run_id == run.run_id
        out[run.run_id] = {
            n: node_points(p.ts[in_run & (p.node_id == n)], p.value[in_run & (p.node_id == n)],
                           p.state[in_run & (p.node_id == n)])
            for n in plant.roles
        }
    return out


def before(points: dict[str, NodePoints], t: int, since: int | None = None) -> dict[str, tuple[np.ndarray, ...]]:
    """The points before ``t`` (and from ``since``), in the mapping form the live API takes."""
    out = {}
    for node, p in points.items():
        part = p.between(since, t - 1)
        out[node] = (part.ts, part.value, part.state)
    return out
