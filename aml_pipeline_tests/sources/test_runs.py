"""Runs from where a plant keeps them: an MES table (the same-bytes tests), a batch-id tag, fixed
windows for a continuous line; and the errors a bad runs table gets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from aml_pipeline.errors import SourceError
from aml_pipeline.sources.description import BatchTag, Runs, Windows
from aml_pipeline.sources.runs import runs_from_rows, runs_from_tag, runs_from_windows
from aml_pipeline.tsdb.port import PointColumns, Run
from aml_pipeline_tests.snapshot_compare import assert_same_v2_snapshot
from aml_pipeline_tests.sources import layouts
from aml_pipeline_tests.sources.support import build, embedded_reference, plant_spec


def ms(text: str) -> int:
    return int(pd.Timestamp(text).as_unit("ms").asm8.astype(np.int64))


CONST = {"line": "L1", "product": "P", "recipe": "R"}


# ---- batch-id tag ------------------------------------------------------------------------------


def test_a_run_per_value_of_the_batch_tag():
    tag = BatchTag(node="BATCH", idle=[0], id_prefix="B", **CONST)
    ts = np.array([0, 10, 20, 30, 40, 50, 60, 70, 80])
    value = np.array([0, 7, 7, 0, 8, 8, 7, np.nan, 9.0])
    runs = runs_from_tag(tag, ts, value)
    assert [(r.run_id, r.started_at, r.ended_at) for r in runs] == [
        ("B7", 10, 29), ("B8", 40, 59), ("B7-2", 60, 69), ("B9", 80, None)]  # NaN ends a run too
    assert all(r.line_id == "L1" and r.evidence_source == "unassessed" for r in runs)


def test_a_batch_tag_value_that_makes_no_valid_id_is_an_error():
    with pytest.raises(SourceError, match="run id"):
        runs_from_tag(BatchTag(node="BATCH", id_prefix="../", **CONST), np.array([0]), np.array([1.0]))


# ---- fixed windows -----------------------------------------------------------------------------


def test_fixed_windows_up_to_the_latest_point():
    w = Windows(every="8h", start="2025-02-01T06:00:00Z", **CONST)
    runs = runs_from_windows(w, ms("2025-02-02T07:00:00Z"), "runs")
    assert [r.run_id for r in runs] == ["L1-20250201T0600", "L1-20250201T1400", "L1-20250201T2200", "L1-20250202T0600"]
    assert runs[0].started_at == ms("2025-02-01T06:00:00Z") and runs[0].ended_at == ms("2025-02-01T14:00:00Z") - 1
    assert runs[-1].ended_at is None  # the window holding the latest point is still running
    assert runs_from_windows(w, None, "runs") == []


def test_daily_windows_follow_the_local_calendar_across_a_clock_change():
    w = Windows(every="1d", start="2025-03-29T06:00:00", zone="Europe/Berlin", id_prefix="day-", **CONST)
    runs = runs_from_windows(w, ms("2025-04-01T00:00:00Z"), "runs")
    lengths = [(r.ended_at + 1 - r.started_at) / 3_600_000 for r in runs if r.ended_at is not None]
    assert lengths == [23, 24]  # the clocks go forward in the night to 30 March
    assert runs[0].started_at == ms("2025-03-29T05:00:00Z") and runs[1].started_at == ms("2025-03-30T04:00:00Z")
    assert runs[0].run_id == "day-20250329T0600"


def test_windows_stop_at_end_and_refuse_absurd_counts():
    w = Windows(every="1h", start="2025-02-01T00:00:00Z", end="2025-02-01T03:00:00Z", **CONST)
    runs = runs_from_windows(w, ms("2025-03-01T00:00:00Z"), "runs")
    assert len(runs) == 3 and all(r.finished for r in runs)
    with pytest.raises(SourceError, match="windows"):
        runs_from_windows(Windows(every="1s", start="2000-01-01T00:00:00Z", **CONST), ms("2025-01-01T00:00:00Z"), "runs")


# ---- MES table rows ----------------------------------------------------------------------------


def table(**kw) -> Runs:
    return Runs(table="mes.b", id="id", start="s", end="e", line="l", product={"value": "P"}, recipe="r", **kw)


def rows(**cols) -> dict:
    base = {"id": ["A", "B"], "start": [0, 100], "end": [50, None], "line": ["L1", "L1"], "recipe": ["R", "R"]}
    base.update(cols)
    return base


def test_mes_rows_become_runs_with_constants():
    runs = runs_from_rows(table(), rows(), "plant.yaml: runs")
    assert runs[0] == Run("A", "L1", "P", "R", None, None, 0, 50)
    assert runs[1].ended_at is None


@pytest.mark.parametrize("bad, message", [
    ({"id": ["A", "A"]}, "appears twice"),
    ({"id": ["A", "x/y"]}, "not a valid id"),
    ({"end": [-1, None]}, "ends before it starts"),
    ({"start": [None, 100]}, "has no start"),
    ({"line": ["L1", ""]}, "has no line"),
])
def test_bad_mes_rows_are_one_error_naming_the_run(bad, message):
    with pytest.raises(SourceError, match=message) as e:
        runs_from_rows(table(), rows(**bad), "plant.yaml: runs")
    assert "plant.yaml: runs" in e.value.message


# ---- builds through a batch tag and through windows ---------------------------------------------


def renamed(plant, runs: list[Run], assign) -> PointColumns:
    """The plant's points with their run ids replaced by ``assign(ts) -> run id``."""
    p = plant.points
    return PointColumns(assign(p.ts), p.node_id, p.ts, p.value, p.state)


def test_build_from_a_batch_id_tag(plant, pg_schema, postgres_url, tmp_path):
    """A ``BATCH`` tag holds the batch number while a run lasts and 0 between runs (on change,
    and every 10 s): the runs it gives, built, equal the embedded build of the same runs."""
    con, schema = pg_schema()
    desc = layouts.pg_narrow_layout(con, schema, postgres_url, plant)
    numbers = layouts.pg_batch_tag(con, schema, plant)
    const = {"line": "L1", "product": "P100", "recipe": "R7", "recipe_version": 3,
             "recipe_hash": plant.runs[0].recipe_content_hash, "evidence": "simulation", "confirmed": True}
    desc["runs"] = {"batch_tag": {"node": "BATCH", "idle": [0], "id_prefix": "B", **const}}
    url = str(layouts.write_description(tmp_path / "tag.yaml", desc))

    runs = [dataclasses.replace(r, run_id=f"B{n}", context_confirmed=True) for n, r in zip(numbers, plant.runs)]
    starts = np.array([r.started_at for r in plant.runs])
    ids = np.array([r.run_id for r in runs], dtype=object)
    reference = embedded_reference(plant, tmp_path / "embedded", runs=runs,
                                   points=renamed(plant, runs, lambda ts: ids[np.searchsorted(starts, ts, "right") - 1]))
    from aml_pipeline.sources import open_source

    with open_source(url) as db:
        assert db.list_runs(finished_only=False) == runs
    published = build(plant_spec(plant), url, tmp_path / "mapped")
    assert_same_v2_snapshot(reference.published.snapshot_dir, published.snapshot_dir, "the embedded and the batch-tag build")


def test_build_from_fixed_windows_of_a_continuous_line(plant, tmp_path):
    """The plant read as a continuous line cut into 15-minute windows (a window may hold parts of
    two batches, or none): the same windows ingested as runs build the same snapshot."""
    desc = layouts.parquet_lake_layout(tmp_path / "lake", plant)
    start = "2025-01-31T23:10:00Z"
    desc["runs"] = {"windows": {"every": "15min", "start": start, "line": "L1", "product": "P100", "recipe": "R7",
                                "recipe_version": 3, "recipe_hash": plant.runs[0].recipe_content_hash,
                                "evidence": "simulation", "confirmed": True}}
    url = str(layouts.write_description(tmp_path / "lake" / "windows.yaml", desc))
    from aml_pipeline.sources import open_source

    with open_source(url) as db:
        runs = db.list_runs(finished_only=False)
    t0, step = ms(start), 15 * 60_000
    assert runs[0].started_at == t0 and all(r.started_at == t0 + k * step for k, r in enumerate(runs))
    assert runs[-1].ended_at is None and all(r.finished for r in runs[:-1])
    ids = np.array([r.run_id for r in runs], dtype=object)
    reference = embedded_reference(plant, tmp_path / "embedded", runs=runs,
                                   points=renamed(plant, runs, lambda ts: ids[(ts - t0) // step]))
    published = build(plant_spec(plant), url, tmp_path / "mapped")
    assert_same_v2_snapshot(reference.published.snapshot_dir, published.snapshot_dir, "the embedded and the windows build")
