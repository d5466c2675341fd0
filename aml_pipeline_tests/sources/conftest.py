"""Fixtures of the mapped-source tests: one small simulated plant
(:func:`aml_pipeline_tests.sources.support.make_plant`), its embedded reference build, fresh
PostgreSQL schemas, InfluxDB databases and a test OPC UA server."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

from aml_pipeline.simulate.plant import SimulatedPlant
from aml_pipeline_tests.sources.support import OPCUA_MAX_VALUES, Reference, embedded_reference, make_plant


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
