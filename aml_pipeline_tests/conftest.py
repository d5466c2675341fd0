"""Fixtures shared by several folders: ``postgres_url``, a real PostgreSQL server (see
``pg_server.py``); ``influx_url``, a real InfluxDB; and for the Dagster tests (``components/``,
``runner/``) a simulated plant in a DuckDB file, a spec over it, resources and an instance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aml_pipeline_tests import pg_server


@pytest.fixture(scope="session")
def postgres_url():
    """``AML_TEST_PG_URL`` if set, else a throwaway server started once for the test run."""
    if not os.environ.get("AML_TEST_PG_URL"):
        try:
            pg_server.find_bindir()
        except pg_server.PgServerError as exc:
            # Never skip: a missing server is a set-up error (scripts/test.sh installs it).
            pytest.fail(f"{exc}; run scripts/test.sh, which installs PostgreSQL, or set AML_TEST_PG_URL")
    with pg_server.server_url() as url:
        yield url


@pytest.fixture(scope="session")
def influx_url():
    """``AML_TEST_INFLUX_URL`` if set, else a throwaway InfluxDB 1.x started once for the test run."""
    from aml_pipeline_tests import influx_server

    if not os.environ.get("AML_TEST_INFLUX_URL"):
        try:
            influx_server.find_influxd()
        except influx_server.InfluxServerError as exc:
            # Never skip: a missing server is a set-up error (scripts/system_packages.sh installs it).
            pytest.fail(str(exc))
    with influx_server.server_url() as url:
        yield url


@pytest.fixture(scope="session")
def dagster_plant():
    from aml_pipeline.simulate.plant import simulate_plant

    return simulate_plant(n_runs=6, run_minutes=6, seed=11)


@pytest.fixture(scope="session")
def dagster_plant_url(dagster_plant, tmp_path_factory: pytest.TempPathFactory) -> str:
    from aml_pipeline.tsdb_open import open_tsdb

    url = f"duckdb://{tmp_path_factory.mktemp('dplant') / 'tsdb.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=dagster_plant.runs, nodes=dagster_plant.nodes, points=dagster_plant.points)
    return url


@pytest.fixture
def dagster_spec(dagster_plant):
    from aml_pipeline.simulate.plant import plant_spec_dict
    from aml_pipeline.spec import parse_spec

    return parse_spec(plant_spec_dict(dagster_plant, "dg_ds", history_steps=20, horizon_steps=10, extras=True))


@pytest.fixture
def resources(dagster_plant_url: str, tmp_path: Path) -> dict:
    from aml_pipeline.components.resources import StoreResource, TsdbResource

    return {"tsdb": TsdbResource(url=dagster_plant_url), "store": StoreResource(home=str(tmp_path / "aml"))}


@pytest.fixture
def instance():
    import dagster as dg

    with dg.DagsterInstance.ephemeral() as inst:
        yield inst
