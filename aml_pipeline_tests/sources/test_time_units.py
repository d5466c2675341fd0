"""A time column read in the wrong unit is one line (exit 2) naming the column, the unit assumed
and the unit the values look like, from ``source check`` and from a build; no time value gives
a traceback. Every epoch time type is tried on a column of every other unit."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from aml_pipeline.cli import main
from aml_pipeline.plausible_time import PLAUSIBLE_FROM_MS, implausible_times
from aml_pipeline_tests.sources import layouts
from aml_pipeline_tests.sources.support import plant_spec

T0 = 1_738_368_000_000  # 2025-02-01 UTC, in ms
MS = T0 + np.arange(0, 600_000, 1000)  # ten minutes, a point a second
# A column of each unit: the same times as integers of that unit, or float seconds.
COLUMNS = {
    "epoch_s": pa.array(MS // 1000, pa.int64()),
    "epoch_ms": pa.array(MS, pa.int64()),
    "epoch_us": pa.array(MS * 1000, pa.int64()),
    "epoch_ns": pa.array(MS * 1_000_000, pa.int64()),
    "epoch_s_float": pa.array(MS / 1000.0, pa.float64()),
}
SECONDS = ("epoch_s", "epoch_s_float")
RUNS = {"windows": {"every": "1h", "start": "2025-02-01T00:00:00Z", "line": "L1", "product": "P", "recipe": "R"}}


def lake(tmp_path, unit: str, declared: str):
    pq.write_table(pa.table({"tag": ["A"] * MS.size, "t": COLUMNS[unit], "value": np.arange(MS.size, dtype=float)}),
                   tmp_path / "points.parquet")
    desc = {"backend": "files",
            "points": {"files": "points.parquet", "node": "tag", "time": "t", "time_type": declared, "value": "value"},
            "runs": RUNS}
    return layouts.write_description(tmp_path / "plant.yaml", desc)


def check(capsys, path) -> tuple[int, str, str]:
    code = main(["source", "check", str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


@pytest.mark.parametrize("unit", list(COLUMNS))
@pytest.mark.parametrize("declared", list(COLUMNS))
def test_every_time_type_on_a_column_of_every_unit(tmp_path, capsys, unit, declared):
    code, out, err = check(capsys, lake(tmp_path, unit, declared))
    same_unit = unit == declared or (unit in SECONDS and declared in SECONDS)
    float_column = unit == "epoch_s_float"
    if same_unit and not (float_column and declared == "epoch_s"):
        assert code == 0, err
        assert "A 600" in out  # the sample run: every point of the node in its hour
        return
    assert code == 2 and out == "", (code, out, err)
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("SOURCE_INVALID: ") and "points.time" in err and "'t'" in err, err
    if float_column and declared != "epoch_s_float":  # a float column is not an integer unit
        assert f"time_type {declared} does not fit column 't'" in err, err
        return
    assert f"read as {declared} (" in err, err
    want = "epoch_s" if unit == "epoch_s_float" else unit
    assert f"the values look like {want} (" in err and f"set time_type: {want}" in err, err


def test_a_timestamp_column_outside_the_plausible_range(tmp_path, capsys):
    """A timestamp with time zone holding 1970 (epoch ms written as microseconds)."""
    t = pa.array(MS, pa.timestamp("us", tz="UTC"))  # 1970-01-21
    pq.write_table(pa.table({"tag": ["A"] * MS.size, "t": t, "value": np.ones(MS.size)}), tmp_path / "p.parquet")
    desc = {"backend": "files", "points": {"files": "p.parquet", "node": "tag", "time": "t", "value": "value"},
            "runs": {**RUNS, "windows": {**RUNS["windows"], "start": "1970-01-01T00:00:00Z"}}}
    code, out, err = check(capsys, layouts.write_description(tmp_path / "plant.yaml", desc))
    assert code == 2 and "\n" not in err, err
    assert "points.time: column 't'" in err and "gives 1970-01-21" in err and "not between 1990-01-01 and" in err, err


def test_a_build_with_the_wrong_unit_is_one_line(plant, tmp_path, capsys, monkeypatch):
    """The plant's times in ms read as microseconds: the build names the column and the unit, not
    NO_WINDOWS; nothing is published."""
    p = plant.points
    pq.write_table(pa.table({"tag": p.node_id.astype(str), "t": pa.array(p.ts, pa.int64()), "value": p.value}),
                   tmp_path / "points.parquet")
    layouts._runs_file(plant, tmp_path / "batches.csv")
    desc = {"backend": "files",
            "points": {"files": "points.parquet", "node": "tag", "time": "t", "time_type": "epoch_us", "value": "value"},
            "runs": {"files": "batches.csv", **layouts.RUNS_MAPPING}, "nodes": layouts.node_entries(plant)}
    path = layouts.write_description(tmp_path / "plant.yaml", desc)
    spec = tmp_path / "mapped_ds.yaml"
    spec.write_text(yaml.safe_dump(plant_spec(plant).to_json_dict(), sort_keys=False))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    code = main(["build", str(spec), "--tsdb", str(path), "--home", str(tmp_path / "home"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith("SOURCE_INVALID: ") and "read as epoch_us (microseconds)" in err[-1], err
    assert "the values look like epoch_ms" in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_run_table_in_the_wrong_unit(tmp_path, capsys):
    pq.write_table(pa.table({"tag": ["A"] * MS.size, "t": COLUMNS["epoch_ms"], "value": np.ones(MS.size)}),
                   tmp_path / "points.parquet")
    pq.write_table(pa.table({"id": ["R1"], "s": [int(MS[0])], "e": [int(MS[-1])], "l": ["L1"], "p": ["P"], "r": ["R"]}),
                   tmp_path / "runs.parquet")
    desc = {"backend": "files",
            "points": {"files": "points.parquet", "node": "tag", "time": "t", "time_type": "epoch_ms", "value": "value"},
            "runs": {"files": "runs.parquet", "id": "id", "start": "s", "end": "e", "line": "l", "product": "p",
                     "recipe": "r", "time_type": "epoch_s"}}
    code, out, err = check(capsys, layouts.write_description(tmp_path / "plant.yaml", desc))
    assert code == 2 and "\n" not in err, err
    assert "runs.start: column 's' read as epoch_s (seconds)" in err and "look like epoch_ms" in err, err


def test_implausible_times():
    assert implausible_times(MS, "epoch_ms") is None
    assert implausible_times(np.array([PLAUSIBLE_FROM_MS - 1]), None).startswith("read gives 1989-12-31")
    # a sample period of 60 days (days read as... a year of points): named, with its unit
    sparse = T0 - np.arange(200)[::-1] * 60 * 86_400_000 // 20
    assert implausible_times(sparse, "epoch_ms") is None  # 3 days apart: plausible
    months = np.array([PLAUSIBLE_FROM_MS + k * 60 * 86_400_000 for k in range(100)])
    why = implausible_times(months, "epoch_ms")
    assert why is not None and "median sample period of 60 days" in why
    assert implausible_times(np.array([2**62]), "epoch_s").count("\n") == 0  # far beyond any year
