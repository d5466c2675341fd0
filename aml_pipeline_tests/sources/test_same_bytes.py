"""Same bytes: the same points, laid out the ways plants keep them and read through a source
description, build the same snapshot as when they are ingested into the embedded file.

The plant (``support.make_plant``) has re-sent samples, half of them with a corrected value, so
the order of points sharing a timestamp decides which value cleaning keeps: each layout must
order them as the embedded file does (file order, or the mapping's ``order`` column).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from aml_pipeline.cli import main
from aml_pipeline_tests.snapshot_compare import assert_same_v2_snapshot
from aml_pipeline_tests.sources import layouts
from aml_pipeline_tests.sources.support import Reference, build, embedded_reference, plant_spec, same_points


def test_the_plant_has_ties_whose_order_matters(plant):
    p = plant.points
    key = np.stack([np.unique(p.run_id, return_inverse=True)[1], np.unique(p.node_id, return_inverse=True)[1], p.ts])
    _, first, counts = np.unique(key, axis=1, return_index=True, return_counts=True)
    dup = first[counts > 1]
    assert dup.size >= 2
    # the re-sent sample follows its original; some carry a corrected value
    assert np.any(p.value[dup] != p.value[dup + 1])


def assert_same_build(plant, reference: Reference, desc: dict[str, Any], path: Path, tmp_path: Path) -> None:
    url = str(layouts.write_description(path, desc))
    n = same_points(url, reference.url)
    assert n > 0
    published = build(plant_spec(plant), url, tmp_path / "mapped")
    assert published.current
    assert_same_v2_snapshot(reference.published.snapshot_dir, published.snapshot_dir, "the embedded and the mapped build")


def test_postgres_narrow_table(plant, reference, pg_schema, postgres_url, tmp_path):
    con, schema = pg_schema()
    desc = layouts.pg_narrow_layout(con, schema, postgres_url, plant)
    assert_same_build(plant, reference, desc, tmp_path / "narrow.yaml", tmp_path)


def test_postgres_wide_table_with_local_timestamps(plant, reference, pg_schema, postgres_url, tmp_path):
    con, schema = pg_schema()
    desc = layouts.pg_wide_layout(con, schema, postgres_url, plant)
    assert_same_build(plant, reference, desc, tmp_path / "wide.yaml", tmp_path)


def test_postgres_monthly_tables_and_tag_table_through_a_query(plant, reference, pg_schema, postgres_url, tmp_path):
    con, schema = pg_schema()
    desc = layouts.pg_monthly_layout(con, schema, postgres_url, plant)
    months = [r[0] for r in con.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename LIKE 'samples_%%' ORDER BY 1", [schema])]
    assert months == ["samples_2025_01", "samples_2025_02"]  # the runs cross the month boundary
    assert_same_build(plant, reference, desc, tmp_path / "monthly.yaml", tmp_path)


@pytest.mark.parametrize("sorted_by_tag", [False, True], ids=["rows_in_time_order", "rows_sorted_by_tag"])
def test_parquet_lake_with_day_folders(plant, reference, tmp_path, sorted_by_tag):
    desc = layouts.parquet_lake_layout(tmp_path / "lake", plant, sorted_by_tag=sorted_by_tag)
    assert sorted(p.name for p in (tmp_path / "lake" / "points").iterdir()) == ["date=2025-01-31", "date=2025-02-01"]
    assert_same_build(plant, reference, desc, tmp_path / "lake" / "source.yaml", tmp_path)


def test_csv_exports(plant, reference, tmp_path):
    desc = layouts.csv_layout(tmp_path / "csv", plant)
    assert_same_build(plant, reference, desc, tmp_path / "csv" / "source.yaml", tmp_path)


def test_influxdb(plant, influx_url, influx_db, tmp_path):
    # InfluxDB keeps one point per series and time: a re-sent sample replaces the first. The
    # same points are then the ones it holds, ingested into the embedded file.
    desc = layouts.influx_layout(influx_url, influx_db, plant)
    layouts._runs_file(plant, tmp_path / "batches.csv")
    kept = layouts.last_write_wins(plant.points)
    assert len(kept) < len(plant.points)
    reference = embedded_reference(plant, tmp_path / "embedded", points=kept)
    assert_same_build(plant, reference, desc, tmp_path / "influx.yaml", tmp_path)


def test_opcua_history(plant, reference, opcua_plant, tmp_path):
    """Every node's raw history through HistoryRead, the server returning fewer values a read than
    a run holds per node: the build follows continuation points to the end (or releases them),
    and asks the server for nothing but history."""
    desc = layouts.opcua_layout(opcua_plant.url, plant)
    layouts._runs_file(plant, tmp_path / "batches.csv")
    assert_same_build(plant, reference, desc, tmp_path / "opcua.yaml", tmp_path)
    stats = opcua_plant.stats()
    assert stats["continuation_points"] > len(plant.runs) * len(plant.nodes) and stats["open"] == 0
    assert stats["writes"] == stats["history_updates"] == stats["subscriptions"] == 0


def test_the_command_line_build_through_dagster(plant, reference, tmp_path, monkeypatch, capsys):
    """``aml-pipeline build SPEC --tsdb source.yaml`` (Dagster's jobs, what users run), with the
    description named relative to the working directory."""
    desc = layouts.parquet_lake_layout(tmp_path / "lake", plant)
    layouts.write_description(tmp_path / "lake" / "plant.yaml", desc)
    spec = tmp_path / "mapped_ds.yaml"
    spec.write_text(yaml.safe_dump(plant_spec(plant).to_json_dict(), sort_keys=False))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.chdir(tmp_path / "lake")
    code = main(["build", str(spec), "--tsdb", "plant.yaml", "--home", str(tmp_path / "home"),
                 "--out", str(tmp_path / "out"), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert_same_v2_snapshot(reference.published.snapshot_dir, Path(summary["snapshotDir"]), "the embedded and the CLI build")


@pytest.mark.parametrize("url_form", ["path", "scheme"])
def test_a_description_is_accepted_wherever_a_tsdb_url_is(plant, tmp_path, url_form, monkeypatch, capsys):
    desc = layouts.csv_layout(tmp_path / "csv", plant)
    path = layouts.write_description(tmp_path / "csv" / "plant.yml", desc)
    url = str(path) if url_form == "path" else f"source://{path}"
    from aml_pipeline.components.resources import TsdbResource

    with TsdbResource(url=url).open() as db:
        assert [n.node_id for n in db.list_nodes()] == sorted(n.node_id for n in plant.nodes)
        with pytest.raises(Exception) as e:
            db.ingest(runs=plant.runs)
        assert getattr(e.value, "code", None) == "TSDB_READ_ONLY"
    # The command line says so before it reads the files (their runs would be checked against it).
    from aml_pipeline.cli import main

    points = tmp_path / "points.csv"
    points.write_text("run_id,node_id,ts,value,state\nNOT-A-RUN,TI101,1735718400000,1.0,0\n")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["ingest", "--tsdb", url, "--points", str(points)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"TSDB_READ_ONLY: {url} is a mapped source")
