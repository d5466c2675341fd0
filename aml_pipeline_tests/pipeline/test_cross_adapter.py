"""The same points and spec give the same dataset whichever TSDB adapter serves them.

A small simulated plant is ingested into an embedded DuckDB file and into a fresh PostgreSQL
schema (the session's real server), a v2 spec is built from each by the library build, and the
two snapshots are compared byte for byte. Only ``provenance.capturedAt`` (wall-clock time) may
differ, so the manifest is compared without it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.stages.manifest import PublishedDataset
from aml_pipeline.simulate.plant import SimulatedPlant, plant_spec_dict, simulate_plant
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline.tsdb.postgres import PostgresTsdb
from aml_pipeline_tests.tsdb.series import point_count
from aml_pipeline_tests.snapshot_compare import ARRAYS, snapshot_files, without_captured_at
from aml_pipeline_tests.tsdb.support import ingest_plant
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema


@pytest.fixture(scope="module")
def small_plant() -> SimulatedPlant:
    return simulate_plant(n_runs=5, run_minutes=10, seed=3)


@pytest.fixture
def pg_url(postgres_url) -> Iterator[str]:
    schema = f"t_{uuid.uuid4().hex[:16]}"
    try:
        yield with_schema(postgres_url, schema)
    finally:
        drop_schema(postgres_url, schema)


def build(spec: DatasetSpec, url: str, root: Path) -> PublishedDataset:
    with open_tsdb(url) as db:
        return build_dataset(spec, db, store_root=root / "store", datasets_root=root / "datasets")


def test_postgres_and_embedded_builds_are_byte_identical(small_plant, pg_url, tmp_path):
    plant = small_plant
    duck_url = f"duckdb://{tmp_path / 'plant.duckdb'}"
    with DuckDBTsdb(duck_url, read_only=False) as db:
        ingest_plant(db, plant)
    with PostgresTsdb(pg_url) as db:
        ingest_plant(db, plant)

    # The adapters hold the same points, with the same seq.
    with open_tsdb(duck_url) as dd, open_tsdb(pg_url) as pg:
        assert isinstance(pg, PostgresTsdb)
        assert dd.list_runs(finished_only=False) == pg.list_runs(finished_only=False)
        assert dd.list_nodes() == pg.list_nodes()
        assert dd.availability_watermark() == pg.availability_watermark() == int(plant.points.ts.max())
        assert point_count(dd) == point_count(pg) == len(plant.points)

    spec = parse_spec(plant_spec_dict(plant, "cross_ds", history_steps=20, horizon_steps=10, extras=True))
    from_duck = build(spec, duck_url, tmp_path / "duck")
    from_pg = build(spec, pg_url, tmp_path / "pg")
    assert from_duck.current and from_pg.current

    a, b = snapshot_files(from_duck.snapshot_dir), snapshot_files(from_pg.snapshot_dir)
    assert sorted(a) == sorted(b)
    for name in ARRAYS:
        key = f"arrays/{name}"
        assert key in a, f"v2 snapshot lacks {key}"
        assert len(a[key]) > 0
        assert a[key] == b[key], f"{key} differs between the DuckDB and the PostgreSQL build"
    n_windows = sum(from_duck.manifest["split"][p] for p in ("train", "val", "test"))
    assert n_windows > 0
    x = np.frombuffer(a["arrays/x.f32"], "<f4").reshape(from_duck.manifest["shapes"]["x"])
    assert np.isfinite(x).any()  # real data, not an all-NaN coincidence

    assert without_captured_at(a.pop("manifest.json")) == without_captured_at(b.pop("manifest.json"))
    # The digest file covers the manifest (capturedAt), so only its per-file digests of the
    # other files must agree.
    da, db_ = (json.loads(d.pop("sha256.json"))["files"] for d in (a, b))
    assert {k: v for k, v in da.items() if k != "manifest.json"} == {k: v for k, v in db_.items() if k != "manifest.json"}
    for name in a:  # spec.json, report.json, arrays/*, sidecar
        assert a[name] == b[name], f"{name} differs between the DuckDB and the PostgreSQL build"
    assert from_duck.manifest["provenance"]["availabilityWatermark"] == int(plant.points.ts.max())
