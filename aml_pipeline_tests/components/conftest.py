"""A simulated plant in a real DuckDB file and a dataset spec over it, for the Dagster tests."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from aml_pipeline.components.resources import StoreResource, TsdbResource
from aml_pipeline.simulate.plant import SimulatedPlant, plant_spec_dict, simulate_plant
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb_open import open_tsdb


@pytest.fixture(scope="session")
def dagster_plant() -> SimulatedPlant:
    return simulate_plant(n_runs=6, run_minutes=6, seed=11)


@pytest.fixture(scope="session")
def dagster_plant_url(dagster_plant: SimulatedPlant, tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"duckdb://{tmp_path_factory.mktemp('dplant') / 'tsdb.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=dagster_plant.runs, nodes=dagster_plant.nodes, points=dagster_plant.points)
    return url


@pytest.fixture
def dagster_spec(dagster_plant: SimulatedPlant) -> DatasetSpec:
    return parse_spec(plant_spec_dict(dagster_plant, "dg_ds", history_steps=20, horizon_steps=10, extras=True))


@pytest.fixture
def resources(dagster_plant_url: str, tmp_path: Path) -> dict:
    return {"tsdb": TsdbResource(url=dagster_plant_url), "store": StoreResource(home=str(tmp_path / "aml"))}


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst
