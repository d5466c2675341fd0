"""The source descriptions shipped in ``examples/sources/`` work: each one, pointed at the test
servers through its ``${VAR}`` connection, reads the plant's points from the layout it describes
(loaded by :mod:`aml_pipeline_tests.sources.layouts` under the names the example uses), and
``aml-pipeline source check`` accepts it. docs/sources.md shows each example as it is."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import pandas as pd
import psycopg
import pytest

from aml_pipeline.config import REPO_ROOT
from aml_pipeline.sources import open_source
from aml_pipeline.sources.backend import NO_END
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.tsdb.port import PointColumns, Run
from aml_pipeline_tests.sources import layouts
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline_tests.sources.support import embedded_reference, same_points
from aml_pipeline_tests.tsdb.series import fetch_node_series

EXAMPLES = REPO_ROOT / "examples" / "sources"
DOC = REPO_ROOT / "docs" / "sources.md"


def example(name: str, folder: Path) -> Path:
    """The example copied into ``folder`` (its relative paths then point at the test's files)."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(EXAMPLES / name, folder / name))


def source_check(path: Path, env: dict[str, str], *args: str) -> dict:
    """``aml-pipeline source check PATH --json`` as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "aml_pipeline.cli", "source", "check", str(path), "--json", *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture
def plant_db(postgres_url) -> Iterator[tuple[psycopg.Connection, str]]:
    """A database of its own (the examples name fixed schemas): a connection and its URL."""
    name = f"example_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    parts = urlsplit(postgres_url)
    url = urlunsplit(parts._replace(path=f"/{name}"))
    try:
        with psycopg.connect(url, autocommit=True) as con:
            yield con, url
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def check_reads_the_plant(path: Path, env: dict[str, str], reference_url: str, plant, monkeypatch) -> None:
    """The example reads every point, run and node the embedded file holds, and `source check`
    finds the plant's nodes and runs."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert same_points(str(path), reference_url) > 0
    found = source_check(path, env)
    assert [n["node_id"] for n in found["nodes"]] == sorted(n.node_id for n in plant.nodes)
    assert found["runs"]["count"] == len(plant.runs) and sum(found["sample_run"]["points"].values()) > 0


@pytest.mark.parametrize("name, layout, schemas", [
    ("narrow_timescaledb.yaml", layouts.pg_narrow_layout, ("historian", "mes")),
    ("wide_table.yaml", layouts.pg_wide_layout, ("line2", "mes")),
    ("monthly_tables.yaml", layouts.pg_monthly_layout, ("hist", "mes")),
])
def test_a_postgresql_example_reads_the_plant(name, layout, schemas, plant, reference, plant_db, tmp_path, monkeypatch):
    con, url = plant_db
    for schema in schemas:
        con.execute(f"CREATE SCHEMA {schema}")
    layout(con, schemas[0], url, plant, mes_schema=schemas[1])
    check_reads_the_plant(example(name, tmp_path), {"PLANT_DB": url}, reference.url, plant, monkeypatch)


def test_the_parquet_lake_example_reads_the_plant(plant, reference, tmp_path, monkeypatch):
    layouts.parquet_lake_layout(tmp_path / "lake", plant)
    check_reads_the_plant(example("parquet_lake.yaml", tmp_path), {}, reference.url, plant, monkeypatch)


def test_the_influxdb_example_reads_the_plant(plant, influx_url, tmp_path, monkeypatch):
    # The example names its database, "plant": this test's server must not hold one already.
    listed = layouts.influx_query(influx_url, "SHOW DATABASES")["results"][0]["series"][0].get("values", [])
    assert ["plant"] not in listed, "the InfluxDB of the tests already holds a database named plant"
    try:
        layouts.influx_layout(influx_url, "plant", plant)
        layouts._runs_file(plant, tmp_path / "mes" / "batches.csv")
        # InfluxDB keeps one point per series and time: the re-sent samples' last values
        reference = embedded_reference(plant, tmp_path / "embedded", points=layouts.last_write_wins(plant.points))
        check_reads_the_plant(example("influxdb.yaml", tmp_path), {"PLANT_INFLUX": influx_url}, reference.url, plant,
                              monkeypatch)
    finally:
        layouts.influx_query(influx_url, 'DROP DATABASE "plant"')


def test_the_opcua_example_reads_the_plant(plant, reference, tmp_path, monkeypatch):
    """The OPC UA example against the test historian: a signed and encrypted channel (this
    client's certificate and key where the example names them), the user and password it names,
    the nodes by NodeId and by browse path."""
    from aml_pipeline_tests import opcua_server

    base = tmp_path / "historian"
    layouts.opcua_history(base, plant)
    server_cert, server_key = opcua_server.make_certificate(tmp_path / "server-pki", "server", opcua_server.SERVER_URI,
                                                            server=True)
    opcua_server.make_certificate(tmp_path / "pki", "aml-client", "urn:aml-pipeline:example-client")
    layouts._runs_file(plant, tmp_path / "mes" / "batches.csv")
    security = {"policy": "Basic256Sha256_SignAndEncrypt", "certificate": str(server_cert), "private_key": str(server_key)}
    with opcua_server.running(base, users={"aml_reader": "example-secret"}, security=security) as server:
        env = {"PLANT_OPCUA": server.url, "OPC_PASSWORD": "example-secret"}
        check_reads_the_plant(example("opcua.yaml", tmp_path), env, reference.url, plant, monkeypatch)
        assert server.stats()["open"] == 0 and server.stats()["writes"] == 0


def renamed_points(plant, runs: list[Run]) -> PointColumns:
    """The plant's points, each given the run (of ``runs``, sorted by start) whose time holds it."""
    starts = np.array([r.started_at for r in runs])
    ids = np.array([r.run_id for r in runs], dtype=object)
    p = plant.points
    return PointColumns(ids[np.searchsorted(starts, p.ts, "right") - 1], p.node_id, p.ts, p.value, p.state)


def embedded_file(plant, root: Path, runs: list[Run], points: PointColumns) -> str:
    """The embedded file holding ``runs`` and ``points`` with the plant's nodes."""
    root.mkdir(parents=True, exist_ok=True)
    url = f"duckdb://{root / 'plant.duckdb'}"
    with DuckDBTsdb(url, read_only=False) as db:
        db.ingest(runs=runs, nodes=plant.nodes)
        db.ingest(points=points)
    return url


def same_points_per_run(mapped: str, reference: str, plant, runs: list[Run]) -> int:
    """The plant's nodes' points of every run, read through the example and from the embedded
    file, equal (the example's catalog also holds the batch tag, which the plant has not)."""
    total = 0
    with open_tsdb(mapped) as m, open_tsdb(reference) as d:
        for run in runs:
            end = NO_END if run.ended_at is None else run.ended_at
            for node in plant.nodes:
                a = fetch_node_series(m, node.node_id, run.run_id, run.started_at, end)
                b = fetch_node_series(d, node.node_id, run.run_id, run.started_at, end)
                for field in ("ts", "value", "state"):
                    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=f"{run.run_id}/{node.node_id}")
                total += len(a)
    return total


def test_the_batch_tag_example_cuts_runs_where_the_tag_changes(plant, plant_db, tmp_path, monkeypatch):
    con, url = plant_db
    con.execute("CREATE SCHEMA historian")
    con.execute("CREATE SCHEMA mes")
    layouts.pg_narrow_layout(con, "historian", url, plant, mes_schema="mes")
    numbers = layouts.pg_batch_tag(con, "historian", plant)
    path = example("batch_tag.yaml", tmp_path)
    monkeypatch.setenv("PLANT_DB", url)
    expected = [Run(f"B{n}", "L1", "P100", "R7", None, None, r.started_at, r.ended_at, "real", False)
                for n, r in zip(numbers, plant.runs)]
    with open_source(str(path)) as db:
        assert db.list_runs(finished_only=False) == expected
    reference = embedded_file(plant, tmp_path / "embedded", expected, renamed_points(plant, expected))
    assert same_points_per_run(str(path), reference, plant, expected) == len(plant.points)
    found = source_check(path, {"PLANT_DB": url})
    assert found["runs"]["form"] == "batch_tag" and found["runs"]["count"] == len(plant.runs)
    assert "BATCH" in [n["node_id"] for n in found["nodes"]]


def test_the_fixed_windows_example_makes_a_run_per_shift(plant, plant_db, tmp_path, monkeypatch):
    con, url = plant_db
    con.execute("CREATE SCHEMA historian")
    con.execute("CREATE SCHEMA mes")
    layouts.pg_narrow_layout(con, "historian", url, plant, mes_schema="mes")
    path = example("fixed_windows.yaml", tmp_path)
    monkeypatch.setenv("PLANT_DB", url)
    # 8 h shifts from 06:00 in Berlin (UTC+1 in January): 05:00, 13:00 and 21:00 UTC
    first = pd.Timestamp("2025-01-01T05:00:00Z")
    latest = pd.Timestamp(int(plant.points.ts.max()), unit="ms", tz="UTC")
    shifts = pd.date_range(first, latest, freq="8h")
    berlin = shifts.tz_convert("Europe/Berlin")
    expected = [Run(f"L3-{local.strftime('%Y%m%dT%H%M')}", "L3", "PE-HD", "continuous", None, None,
                    int(start.value // 1_000_000), None if k == len(shifts) - 1 else int(start.value // 1_000_000) + 8 * 3_600_000 - 1,
                    "real", False)
                for k, (start, local) in enumerate(zip(shifts, berlin))]
    with open_source(str(path)) as db:
        assert db.list_runs(finished_only=False) == expected
    assert expected[-1].started_at <= int(plant.points.ts.min())  # the plant's points fall in the last shift
    reference = embedded_file(plant, tmp_path / "embedded", expected[-1:], renamed_points(plant, expected[-1:]))
    assert same_points_per_run(str(path), reference, plant, expected[-1:]) == len(plant.points)
    found = source_check(path, {"PLANT_DB": url}, "--run", expected[-1].run_id)
    assert found["runs"]["form"] == "windows" and found["sample_run"]["run_id"] == expected[-1].run_id
    assert sum(found["sample_run"]["points"].values()) == len(plant.points)


# ---- the docs show the examples as they are ------------------------------------------------------


def recipes(doc: str) -> list[tuple[str, str]]:
    """(example file named before the block, the block) for every ```yaml block of "Recipes"."""
    section = doc.split("\n## Recipes\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"\[`?examples/sources/([\w.]+)`?\]\([^)]*\)[^\n]*\n+```yaml\n(.*?)```", section, flags=re.S)


def test_the_docs_recipes_are_the_example_files():
    doc = DOC.read_text(encoding="utf-8")
    shown = recipes(doc)
    section = doc.split("\n## Recipes\n", 1)[1].split("\n## ", 1)[0]
    assert len(shown) == section.count("```yaml"), "every recipe names its example file"
    assert sorted(name for name, _ in shown) == sorted(p.name for p in EXAMPLES.glob("*.yaml")), \
        "every example is a recipe of docs/sources.md, and every recipe an example"
    for name, block in shown:
        assert block == (EXAMPLES / name).read_text(encoding="utf-8"), f"docs/sources.md shows another {name}"
    for name, _ in shown:
        assert f"](../examples/sources/{name})" in doc


def test_the_recipe_check_sees_a_difference(tmp_path):
    doc = ("# Sources\n\n## Recipes\n\n### A\n\n[`examples/sources/x.yaml`](../examples/sources/x.yaml):\n\n```yaml\nbackend: files\n```\n"
           "\n## Next\n")
    assert recipes(doc) == [("x.yaml", "backend: files\n")]
    assert recipes(doc.replace("[`examples/sources/x.yaml`](../examples/sources/x.yaml):\n\n", "")) == []
