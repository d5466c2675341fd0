"""Shared fixtures. ``postgres_url``: a real PostgreSQL server (see ``pg_server.py``)."""

from __future__ import annotations

import os

import pytest

from aml_pipeline_tests import pg_server


@pytest.fixture(scope="session")
def postgres_url():
    """``AML_TEST_PG_URL`` if set, else a throwaway server started for this session."""
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
    """``AML_TEST_INFLUX_URL`` if set, else a throwaway InfluxDB 1.x started for this session."""
    from aml_pipeline_tests import influx_server

    if not os.environ.get("AML_TEST_INFLUX_URL"):
        try:
            influx_server.find_influxd()
        except influx_server.InfluxServerError as exc:
            # Never skip: a missing server is a set-up error (scripts/system_packages.sh installs it).
            pytest.fail(str(exc))
    with influx_server.server_url() as url:
        yield url
