"""Real published snapshots (v1 and v2) of a small simulated plant, built by the library build."""

from __future__ import annotations

import pytest

from aml_pipeline.pipeline.stages.manifest import PublishedDataset
from aml_pipeline.simulate.plant import SimulatedPlant, simulate_plant
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.snapshot.support import publish


@pytest.fixture(scope="session")
def plant() -> SimulatedPlant:
    return simulate_plant(n_runs=7, run_minutes=8, seed=11)


@pytest.fixture(scope="session")
def plant_url(plant: SimulatedPlant, tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"duckdb://{tmp_path_factory.mktemp('snapshot-plant') / 'tsdb.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    return url


@pytest.fixture(scope="session")
def v2(plant, plant_url, tmp_path_factory) -> PublishedDataset:
    """Shared and read-only: tests that change bytes use ``fresh_v2``."""
    published = publish(plant, plant_url, tmp_path_factory.mktemp("v2"))
    assert all(published.manifest["split"][p] > 0 for p in ("train", "val", "test"))
    return published


@pytest.fixture(scope="session")
def v1(plant, plant_url, tmp_path_factory) -> PublishedDataset:
    return publish(plant, plant_url, tmp_path_factory.mktemp("v1"), extras=False)


@pytest.fixture
def fresh_v2(plant, plant_url, tmp_path) -> PublishedDataset:
    return publish(plant, plant_url, tmp_path)


@pytest.fixture(scope="session")
def series_v2(plant, plant_url, tmp_path_factory) -> PublishedDataset:
    """The v2 dataset in the series layout (same spec and data as ``v2``)."""
    return publish(plant, plant_url, tmp_path_factory.mktemp("series-v2"), layout="series")


@pytest.fixture(scope="session")
def series_v1(plant, plant_url, tmp_path_factory) -> PublishedDataset:
    return publish(plant, plant_url, tmp_path_factory.mktemp("series-v1"), extras=False, layout="series")


@pytest.fixture
def fresh_series_v2(plant, plant_url, tmp_path) -> PublishedDataset:
    return publish(plant, plant_url, tmp_path, layout="series")
