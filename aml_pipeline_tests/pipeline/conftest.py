"""A small simulated plant in a real DuckDB file, shared by the pipeline tests (read-only)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aml_pipeline.simulate.plant import SimulatedPlant, plant_spec_dict, simulate_plant
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb_open import open_tsdb


@pytest.fixture(scope="session")
def plant() -> SimulatedPlant:
    return simulate_plant(n_runs=8, run_minutes=8, seed=7)


@pytest.fixture(scope="session")
def plant_url(plant: SimulatedPlant, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("plant") / "tsdb.duckdb"
    url = f"duckdb://{path}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    return url


@pytest.fixture
def make_spec(plant: SimulatedPlant) -> Callable[..., DatasetSpec]:
    """``make_spec(extras=False, **overrides)``: a spec over the plant with fields replaced."""

    def make(*, extras: bool = False, **overrides: Any) -> DatasetSpec:
        data = plant_spec_dict(plant, "plant_ds", history_steps=20, horizon_steps=10, extras=extras)
        data.update(overrides)
        return parse_spec(data)

    return make


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    return {"store_root": tmp_path / "store", "datasets_root": tmp_path / "datasets"}
