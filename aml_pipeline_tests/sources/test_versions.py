"""Per-run data versions read from the source: a late, deleted or corrected point (value or
quality), or a changed run record, makes exactly that run stale; nothing else changes."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aml_pipeline.pipeline.plan import BuildPlan
from aml_pipeline.pipeline.registry import RAW
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.sources import open_source
from aml_pipeline.tsdb.port import PointColumns
from aml_pipeline_tests.snapshot_compare import assert_same_v2_snapshot
from aml_pipeline_tests.sources import layouts
from aml_pipeline_tests.sources.support import build, plant_spec


def versions(url: str) -> dict[str, str]:
    with open_source(url) as db:
        return db.run_versions([r.run_id for r in db.list_runs(finished_only=False)])


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    assert before.keys() == after.keys()
    return {r for r in before if before[r] != after[r]}


def a_point_of(plant, run_index: int, node: str = "TI101") -> tuple[str, int]:
    run = plant.runs[run_index]
    p = plant.points
    sel = np.flatnonzero((p.run_id == run.run_id) & (p.node_id == node))
    return run.run_id, int(p.ts[sel[len(sel) // 2]])


def _utc(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)


def test_postgres_changes_make_exactly_their_run_stale(plant, pg_schema, postgres_url, tmp_path):
    con, schema = pg_schema()
    url = str(layouts.write_description(tmp_path / "p.yaml", layouts.pg_narrow_layout(con, schema, postgres_url, plant)))
    t = f"{schema}.samples"
    v0 = versions(url)
    assert len(set(v0.values())) == len(v0) == len(plant.runs)
    assert versions(url) == v0  # reading twice changes nothing

    def after(sql: str, params: list) -> set[str]:
        before = versions(url)
        con.execute(sql, params)
        return changed(before, versions(url))

    run, ts = a_point_of(plant, 1)
    assert after(f"INSERT INTO {t} (tag, ts, value, quality) VALUES ('TI101', %s, 1.5, 192)", [_utc(ts + 1)]) == {run}
    run, ts = a_point_of(plant, 2, "QI301")
    assert after(f"DELETE FROM {t} WHERE tag = 'QI301' AND ts = %s", [_utc(ts)]) == {run}
    run, ts = a_point_of(plant, 0, "TI900")
    assert after(f"UPDATE {t} SET value = value + 0.001 WHERE tag = 'TI900' AND ts = %s", [_utc(ts)]) == {run}
    run, ts = a_point_of(plant, 3, "AI910")
    assert after(f"UPDATE {t} SET quality = 64 WHERE tag = 'AI910' AND ts = %s", [_utc(ts)]) == {run}
    # the run still in progress ends: its record changes
    last = plant.runs[-1]
    assert after(f"UPDATE {schema}.batches SET finished = started + interval '6 minutes' WHERE batch = %s",
                 [last.run_id]) == {last.run_id}
    # a point outside every run changes no run
    assert after(f"INSERT INTO {t} (tag, ts, value, quality) VALUES ('TI101', %s, 1.0, 192)",
                 [_utc(plant.runs[0].started_at - 60_000)]) == set()


def test_postgres_modified_column(plant, pg_schema, postgres_url, tmp_path):
    con, schema = pg_schema()
    desc = layouts.pg_narrow_layout(con, schema, postgres_url, plant)
    con.execute(f"ALTER TABLE {schema}.samples ADD COLUMN modified timestamptz NOT NULL DEFAULT '2025-02-01'")
    desc["points"]["modified"] = "modified"
    url = str(layouts.write_description(tmp_path / "p.yaml", desc))
    before = versions(url)
    run, ts = a_point_of(plant, 2)
    con.execute(f"UPDATE {schema}.samples SET value = 0, modified = '2025-02-02' WHERE tag = 'TI101' AND ts = %s", [_utc(ts)])
    assert changed(before, versions(url)) == {run}


def test_late_points_rebuild_their_run_only_and_match_the_embedded_build(plant, reference, pg_schema, postgres_url, tmp_path):
    """A minute of one node of run 2 arrives after the first build: only that run is stale, and
    the rebuild equals the embedded build of the whole plant."""
    con, schema = pg_schema()
    p = plant.points
    run = plant.runs[1]
    sel = (p.run_id == run.run_id) & (p.node_id == "TI101") & (p.ts >= run.started_at + 120_000) & (p.ts < run.started_at + 180_000)
    assert sel.sum() >= 50
    early = PointColumns(*(getattr(p, f)[~sel] for f in ("run_id", "node_id", "ts", "value", "state")))
    desc = layouts.pg_narrow_layout(con, schema, postgres_url, plant, points=early)
    url = str(layouts.write_description(tmp_path / "p.yaml", desc))
    spec = plant_spec(plant)
    first = build(spec, url, tmp_path / "mapped")
    assert first.current

    late = [(str(n), _utc(int(t)), float(v), layouts.OPC[int(st)])
            for n, t, v, st in zip(p.node_id[sel], p.ts[sel], p.value[sel], p.state[sel])]
    with con.cursor() as cur, cur.copy(f"COPY {schema}.samples (tag, ts, value, quality) FROM STDIN") as copy:
        for row in late:
            copy.write_row(row)
    with open_source(url) as db:
        stale = BuildPlan.read(db, DatasetStore(tmp_path / "mapped" / "store", spec)).stale
    assert stale == {run.run_id: RAW}
    second = build(spec, url, tmp_path / "mapped")
    assert second.snapshot_dir != first.snapshot_dir
    assert_same_v2_snapshot(reference.published.snapshot_dir, second.snapshot_dir, "the embedded and the mapped rebuild")


def test_parquet_late_file_and_rewritten_file(plant, tmp_path):
    root = tmp_path / "lake"
    url = str(layouts.write_description(root / "s.yaml", layouts.parquet_lake_layout(root, plant)))
    before = versions(url)
    run, ts = a_point_of(plant, 3)
    day = _utc(ts).strftime("%Y-%m-%d")
    pq.write_table(pa.table({"tag": ["TI101"], "time": pa.array([_utc(ts + 1)], pa.timestamp("ms", tz="UTC")),
                             "value": [1.0], "quality": pa.array([192], pa.int32())}),
                   root / "points" / f"date={day}" / "late-0.parquet")
    assert changed(before, versions(url)) == {run}

    before = versions(url)
    run, ts = a_point_of(plant, 0, "AI910")
    day = _utc(ts).strftime("%Y-%m-%d")
    for f in sorted((root / "points" / f"date={day}").glob("part-*.parquet")):
        t = pq.read_table(f)
        hit = np.flatnonzero((t["tag"].to_numpy(zero_copy_only=False) == "AI910")
                             & (t["time"].cast(pa.int64()).to_numpy() == ts))
        if hit.size:
            value = t["value"].to_numpy().copy()
            value[hit] += 0.25
            pq.write_table(t.set_column(t.schema.get_field_index("value"), "value", pa.array(value)), f)
            break
    else:
        pytest.fail("the point to correct is in no file")
    assert changed(before, versions(url)) == {run}


def test_influxdb_late_corrected_and_deleted_points(plant, influx_url, influx_db, tmp_path):
    desc = layouts.influx_layout(influx_url, influx_db, plant)
    layouts._runs_file(plant, tmp_path / "batches.csv")
    url = str(layouts.write_description(tmp_path / "influx.yaml", desc))

    def after(change: Callable[[], None]) -> set[str]:
        before = versions(url)
        change()
        return changed(before, versions(url))

    run, ts = a_point_of(plant, 1)
    assert after(lambda: layouts.influx_write(influx_url, influx_db, [f"process,tag=TI101 value=3.5,quality=192i {ts + 1}"])) == {run}
    run, ts = a_point_of(plant, 2, "QI301")
    assert after(lambda: layouts.influx_write(influx_url, influx_db, [f"process,tag=QI301 value=12.25,quality=192i {ts}"])) == {run}
    run, ts = a_point_of(plant, 0, "TI900")
    assert after(lambda: layouts.influx_query(
        influx_url, f"DELETE FROM process WHERE \"tag\" = 'TI900' AND time = {ts * 1_000_000}", influx_db)) == {run}


def test_opcua_changes_make_exactly_their_run_stale(plant, tmp_path):
    """A value added to, deleted from or corrected in (value or StatusCode) a node's history."""
    from aml_pipeline_tests import opcua_server

    base = tmp_path / "historian"
    layouts.opcua_history(base, plant)
    layouts._runs_file(plant, tmp_path / "batches.csv")
    table = opcua_server.table_name

    with opcua_server.running(base, max_values=150) as server:
        url = str(layouts.write_description(tmp_path / "o.yaml", layouts.opcua_layout(server.url, plant)))
        v0 = versions(url)
        assert len(set(v0.values())) == len(v0) == len(plant.runs)
        assert versions(url) == v0

        def after(change) -> set[str]:
            before = versions(url)
            change()
            return changed(before, versions(url))

        run, ts = a_point_of(plant, 1)
        assert after(lambda: opcua_server.write_history(base, "Reactor.TI101", np.array([ts + 1]), np.array([1.5]),
                                                        np.array([0]))) == {run}
        run, ts = a_point_of(plant, 2, "QI301")
        assert after(lambda: opcua_server.history_sql(base, f'DELETE FROM "{table("Reactor.QI301")}" WHERE SourceTimestamp = ?',
                                                      [opcua_server.ts_text(ts)])) == {run}
        run, ts = a_point_of(plant, 0, "TI900")
        from asyncua import ua
        from asyncua.ua.ua_binary import variant_to_binary

        corrected = variant_to_binary(ua.Variant(123.25, ua.VariantType.Double))
        assert after(lambda: opcua_server.history_sql(
            base, f'UPDATE "{table("Reactor.TI900")}" SET VariantBinary = ? WHERE SourceTimestamp = ?',
            [corrected, opcua_server.ts_text(ts)])) == {run}
        run, ts = a_point_of(plant, 3, "AI910")
        assert after(lambda: opcua_server.history_sql(
            base, f'UPDATE "{table("Reactor.AI910")}" SET StatusCode = ? WHERE SourceTimestamp = ?',
            [opcua_server.UNCERTAIN_SENSOR_NOT_ACCURATE, opcua_server.ts_text(ts)])) == {run}
        # a value outside every run changes no run
        assert after(lambda: opcua_server.write_history(base, "Reactor.TI101", np.array([plant.runs[0].started_at - 60_000]),
                                                        np.array([1.0]), np.array([0]))) == set()
        assert server.stats()["open"] == 0
