"""A simulated plant (spikes, bad states, out-of-range readings, duplicates, short and long
dropouts) in a DuckDB file, and snapshots of it built by the library build, for the live path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from aml_pipeline.live.points import NodePoints, node_points
from aml_pipeline.simulate.plant import SimulatedPlant, simulate_plant
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.live.support import Built, build, spec_dict


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


