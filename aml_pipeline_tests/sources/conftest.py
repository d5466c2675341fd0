"""Fixtures of the mapped-source tests: one small simulated plant, its embedded reference build,
fresh PostgreSQL schemas and InfluxDB databases.

The plant starts 50 minutes before 2025-02-01 00:00 UTC, so its runs cross a day and a month
boundary (hive day folders, monthly tables) and the midnight of the Europe/Berlin wide layout.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from aml_pipeline.pipeline.stages.manifest import PublishedDataset
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.simulate.plant import SimulatedPlant, plant_spec_dict, simulate_plant
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline.tsdb.port import PointColumns
from aml_pipeline_tests.pipeline.test_cross_adapter import ingest_plant

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


@pytest.fixture(scope="session")
def plant() -> SimulatedPlant:
    return make_plant()


@pytest.fixture(scope="session")
def reference(plant, tmp_path_factory) -> Reference:
    return embedded_reference(plant, tmp_path_factory.mktemp("embedded"))


@pytest.fixture
def pg_schema(postgres_url) -> Iterator[Callable[[], tuple[psycopg.Connection, str]]]:
    """``make() -> (connection, schema)``: a fresh schema on the session's server (dropped after)."""
    made: list[str] = []
    con = psycopg.connect(postgres_url, autocommit=True)

    def make() -> tuple[psycopg.Connection, str]:
        schema = f"plant_{uuid.uuid4().hex[:10]}"
        con.execute(f"CREATE SCHEMA {schema}")
        made.append(schema)
        return con, schema

    try:
        yield make
    finally:
        for schema in made:
            con.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        con.close()


@pytest.fixture
def influx_db(influx_url) -> Iterator[str]:
    """A fresh database name on the session's InfluxDB (dropped after)."""
    from aml_pipeline_tests.sources.layouts import influx_query

    name = f"plant_{uuid.uuid4().hex[:10]}"
    try:
        yield name
    finally:
        influx_query(influx_url, f'DROP DATABASE "{name}"')


# Values the test OPC UA server returns per node and read: below a run's points per node, so
# every run's read follows continuation points.
OPCUA_MAX_VALUES = 100


@pytest.fixture
def opcua_plant(plant, tmp_path_factory):
    """A test OPC UA server (``aml_pipeline_tests.opcua_server``) holding the plant's history,
    returning at most :data:`OPCUA_MAX_VALUES` values per node and read; stopped after the test."""
    from aml_pipeline_tests import opcua_server
    from aml_pipeline_tests.sources import layouts

    base = tmp_path_factory.mktemp("opcua")
    layouts.opcua_history(base, plant)
    with opcua_server.running(base, max_values=OPCUA_MAX_VALUES) as server:
        yield server
