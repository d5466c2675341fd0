"""The dataset assets executed by a real Dagster instance (in process)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import dagster as dg
import pytest

from aml_pipeline.definitions import defs as load_definitions
from aml_pipeline.errors import AmlError
from aml_pipeline.components.assets import dataset_assets
from aml_pipeline.components.dataset import dataset_definitions
from aml_pipeline.runner.build import materialize_dataset, sync_run_partitions
from aml_pipeline.components.partitions import RANGE_END_TAG, RANGE_START_TAG, run_partitions
from aml_pipeline.components.sensors import new_run_sensor
from aml_pipeline.components.resources import plant_resources
from aml_pipeline.components.sources import tsdb_points
from aml_pipeline.pipeline.checks import MANIFEST_CHECKS
from aml_pipeline.pipeline.publish import current_snapshot
from aml_pipeline.pipeline.runs import PROGRESS_LINES, progress_line_due
from aml_pipeline.pipeline.registry import DATASET_ASSETS, GRID, RUN_ASSETS
from aml_pipeline.spec import parse_spec
from aml_pipeline.pipeline.registry import StageVersions


def finished_runs(plant) -> list[str]:
    return [r.run_id for r in plant.runs if r.ended_at is not None]


def keys(spec, names):
    return [dg.AssetKey([spec.id, n]) for n in names]


def materialize(spec, instance, resources, names, **kw):
    return dg.materialize(
        [*dataset_assets(spec, StageVersions.of(spec)), tsdb_points], instance=instance, resources=resources,
        selection=keys(spec, names), **kw,
    )


def latest(instance, key: dg.AssetKey, partition: str | None = None):
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition else None), limit=1
    ).records
    return records[0].asset_materialization if records else None


def run_figures(instance, key: dg.AssetKey, partition: str) -> dict:
    """A run's figures as the UI's partition view shows them: the metadata of the partition's
    latest materialisation, with no observation of their own."""
    where = dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition])
    [materialization] = instance.fetch_materializations(where, limit=1).records
    assert not instance.fetch_observations(where, limit=1).records
    return materialization.asset_materialization.metadata


def test_a_step_logs_at_most_its_progress_lines_and_always_the_last_run():
    for runs in range(1, 250):
        due = [i for i in range(1, runs + 1) if progress_line_due(i, runs)]
        # Each line is an event written to the instance: 16 runs once gave 16 lines.
        assert len(due) <= PROGRESS_LINES, (runs, due)
        assert due[-1] == runs
        # Evenly spread: no two lines further apart than a step of the bound.
        assert max(b - a for a, b in zip([0, *due], due)) <= -(-runs // PROGRESS_LINES)
    assert len([i for i in range(1, 7) if progress_line_due(i, 6)]) == 6  # a short step reports every run


def test_one_partition_per_run_with_metadata_and_data_version(dagster_spec, dagster_plant, instance, resources):
    runs = finished_runs(dagster_plant)
    sync_run_partitions(instance, dagster_spec, runs)
    result = materialize(dagster_spec, instance, resources, RUN_ASSETS, partition_key=runs[0])
    assert result.success
    raw = latest(instance, dg.AssetKey([dagster_spec.id, "raw_node_series"]), runs[0])
    assert raw.tags.get("dagster/data_version")  # hash of the fetched points
    grid = latest(instance, dg.AssetKey([dagster_spec.id, "cleaned_grid"]), runs[0])
    assert grid.tags.get("dagster/data_version") and grid.metadata["grid_rows"].value > 0
    # All three built in one step: each stage's figures on its own asset's partition.
    fetch = run_figures(instance, dg.AssetKey([dagster_spec.id, "raw_node_series"]), runs[0])
    assert fetch["points"].value > 0 and fetch["pages"].value >= len(dagster_spec.nodes)
    table = fetch["per_node"].value
    assert sorted(r.data["node"] for r in table.records) == sorted(dagster_spec.node_ids)
    cleaning = run_figures(instance, dg.AssetKey([dagster_spec.id, "cleaned_grid"]), runs[0])
    windows = run_figures(instance, dg.AssetKey([dagster_spec.id, "run_windows"]), runs[0])
    assert {"points", "per_node", "plot", "cleaning"}.isdisjoint(windows) and "windows" not in cleaning
    # Fetched alone, raw_node_series carries the same figures.
    materialize(dagster_spec, instance, resources, ["raw_node_series"], partition_key=runs[1])
    alone = run_figures(instance, dg.AssetKey([dagster_spec.id, "raw_node_series"]), runs[1])
    assert alone["points"].value > 0 and "per_node" in alone
    # The run's plot, drawn from the traces summarised while the run streamed (no run in memory).
    assert "data:image/png;base64," in cleaning["plot"].value
    assert (resources["store"].dataset_store(dagster_spec).run_dir(runs[0]) / "grid.traces.npz").is_file()
    per_node = cleaning["cleaning"].value
    assert [c.name for c in per_node.schema.columns] == ["node", "unit", "input", "removed", "kept", "missing_ratio"]
    fast = cleaning["sampled_faster_than_beat"].value  # AI910 has a point every 0.5 s, on the edge of it
    assert fast == "none" or fast.startswith("AI910: median sample period")
    assert sorted(r.data["node"] for r in per_node.records) == sorted(dagster_spec.node_ids)
    # each node's unit, as its stored summary carries it from the catalog
    units = resources["store"].dataset_store(dagster_spec).read_meta(runs[0], GRID)["units"]
    assert all(units[n] for n in dagster_spec.node_ids)
    assert {r.data["node"]: r.data["unit"] for r in per_node.records} == units
    assert all(r.data["input"] - r.data["removed"] == r.data["kept"] for r in per_node.records)
    by_cause = cleaning["removed_by_cause"].value
    assert [c.name for c in by_cause.schema.columns] == ["node", "cause", "points"]
    assert {r.data["cause"] for r in by_cause.records} <= {"non_finite", "bad_state", "out_of_range", "duplicate_ts",
                                                          "hampel_outlier"}
    removed = {n: sum(r.data["points"] for r in by_cause.records if r.data["node"] == n) for n in dagster_spec.node_ids}
    assert removed == {r.data["node"]: r.data["removed"] for r in per_node.records}
    assert cleaning["points_removed"].value == sum(removed.values()) > 0
    assert cleaning["worst_missing_node"].value.split(" ")[0] in dagster_spec.node_ids
    assert windows["windows"].value > 0
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["has_windows"].passed


def test_with_run_plots_off_a_runs_figures_are_recorded_without_its_plot(dagster_spec, dagster_plant, instance,
                                                                       resources, monkeypatch):
    runs = finished_runs(dagster_plant)
    sync_run_partitions(instance, dagster_spec, runs)
    key = dg.AssetKey([dagster_spec.id, "cleaned_grid"])
    assert materialize(dagster_spec, instance, resources, RUN_ASSETS, partition_key=runs[0]).success
    monkeypatch.setenv("AML_RUN_PLOTS", "off")
    assert materialize(dagster_spec, instance, resources, RUN_ASSETS, partition_key=runs[1]).success
    with_plot, without = run_figures(instance, key, runs[0]), run_figures(instance, key, runs[1])
    assert "plot" in with_plot and "plot" not in without
    # Everything else is there: the cleaning table and its figures.
    assert set(with_plot) - {"plot"} == set(without)
    assert without["cleaning"].value.records and without["max_missing_ratio"].value >= 0
    # What the switch is for: the event log's share of the run, measured on what is stored.
    assert len(dg.serialize_value(without)) < len(dg.serialize_value(with_plot)) / 1.5


def test_single_run_backfill_keeps_per_run_metadata(dagster_spec, dagster_plant, instance, resources):
    runs = finished_runs(dagster_plant)
    keys_ = sync_run_partitions(instance, dagster_spec, runs)
    result = materialize(
        dagster_spec, instance, resources, RUN_ASSETS, tags={RANGE_START_TAG: keys_[0], RANGE_END_TAG: keys_[-1]}
    )
    assert result.success
    # One run for all partitions, and each partition carries its own run's figures only.
    figures = {r: run_figures(instance, dg.AssetKey([dagster_spec.id, "raw_node_series"]), r) for r in runs}
    points = {r: m["points"].value for r, m in figures.items()}
    assert len(set(points.values())) > 1
    assert all("runs" not in m for m in figures.values())
    assert instance.get_materialized_partitions(dg.AssetKey([dagster_spec.id, "run_windows"])) == set(runs)
    # The step warns about nodes sampled faster than the beat only when a run has some (every
    # partition carries the figure, "none" for a run without; the warning once counted those too).
    fast = {r: run_figures(instance, dg.AssetKey([dagster_spec.id, "cleaned_grid"]), r)["sampled_faster_than_beat"].value
            for r in runs}
    with_fast = [r for r, v in fast.items() if v != "none"]
    warned = [e.user_message for e in instance.all_logs(result.run_id)
              if e.level == logging.WARNING and "sampled faster than twice the beat" in e.user_message]
    if with_fast:
        [line] = warned
        assert line.startswith(f"{len(with_fast)} of {len(runs)} runs have nodes sampled faster") and ": none" not in line
    else:
        assert warned == [], warned


def test_no_warning_about_fast_nodes_when_no_run_has_them(dagster_spec, dagster_plant, instance, resources):
    """With a beat of half the fastest node's period no node is sampled faster than twice the beat."""
    slow = dagster_spec.model_copy(update={"beat_ms": 250})
    runs = finished_runs(dagster_plant)
    keys_ = sync_run_partitions(instance, slow, runs)
    result = materialize(slow, instance, resources, RUN_ASSETS, tags={RANGE_START_TAG: keys_[0], RANGE_END_TAG: keys_[-1]})
    assert result.success
    assert {run_figures(instance, dg.AssetKey([slow.id, "cleaned_grid"]), r)["sampled_faster_than_beat"].value
            for r in runs} == {"none"}
    assert not [e for e in instance.all_logs(result.run_id) if "sampled faster than twice the beat" in e.user_message]


def test_a_run_that_fails_in_a_chunk_loses_none_of_the_others(dagster_spec, dagster_plant, instance, resources):
    runs = finished_runs(dagster_plant)
    [unfinished] = [r.run_id for r in dagster_plant.runs if r.ended_at is None]
    sync_run_partitions(instance, dagster_spec, runs)
    # A partition for a run still in progress (added by hand: the sensor adds finished runs only).
    instance.add_dynamic_partitions(run_partitions(dagster_spec.id).name, [unfinished])
    result = materialize(dagster_spec, instance, resources, RUN_ASSETS, raise_on_error=False,
                         tags={RANGE_START_TAG: runs[0], RANGE_END_TAG: unfinished})
    assert not result.success
    [failure] = result.get_step_failure_events()
    description = failure.step_failure_data.user_failure_data.description
    assert description.startswith(f"1 of {len(runs) + 1} runs failed; first: run {unfinished}: "), description
    # Every other run of the step is recorded, stage by stage, with its figures.
    for name in RUN_ASSETS:
        assert instance.get_materialized_partitions(dg.AssetKey([dagster_spec.id, name])) == set(runs), name
    windows_key = dg.AssetKey([dagster_spec.id, "run_windows"])
    assert all(run_figures(instance, windows_key, r)["windows"].value > 0 for r in runs)
    assert not instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=windows_key, asset_partitions=[unfinished]), limit=1).records


def test_non_contiguous_selection_builds_only_the_selected_runs(dagster_spec, dagster_plant, instance, resources):
    runs = finished_runs(dagster_plant)
    keys_ = sync_run_partitions(instance, dagster_spec, runs)
    chosen = [keys_[0], keys_[2], keys_[3]]
    # A backfill of a non-contiguous selection runs one single-run range per contiguous block.
    for lo, hi in ((keys_[0], keys_[0]), (keys_[2], keys_[3])):
        assert materialize(dagster_spec, instance, resources, RUN_ASSETS, tags={RANGE_START_TAG: lo, RANGE_END_TAG: hi}).success
    assert instance.get_materialized_partitions(dg.AssetKey([dagster_spec.id, "run_windows"])) == set(chosen)
    # The dataset is built from the materialised runs; the rest are listed, not silently dropped.
    assert materialize(dagster_spec, instance, resources, DATASET_ASSETS).success
    split = latest(instance, dg.AssetKey([dagster_spec.id, "dataset_split"]))
    assert split.metadata["runs_excluded"].value == len(runs) - len(chosen)
    assert "data:image/png;base64," in split.metadata["overview"].value
    # Lineage is explained where it is shown: the unconfirmed run and why.
    lineage = {r.data["run"]: r.data for r in split.metadata["lineage_per_run"].value.records}
    assert any(v["lineage"] == "unknown" and "not confirmed" in v["why"] for v in lineage.values()), lineage
    assert split.metadata["lineage"].value.startswith("0: ")


def test_one_failing_run_does_not_lose_the_others(dagster_spec, dagster_plant, instance, resources):
    runs = finished_runs(dagster_plant)
    name = run_partitions(dagster_spec.id).name
    instance.add_dynamic_partitions(name, [runs[0], "NO-SUCH-RUN", runs[1]])
    result = materialize(
        dagster_spec, instance, resources, ["raw_node_series"],
        tags={RANGE_START_TAG: runs[0], RANGE_END_TAG: runs[1]}, raise_on_error=False,
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "NO-SUCH-RUN" in failure.step_failure_data.error.message
    assert instance.get_materialized_partitions(dg.AssetKey([dagster_spec.id, "raw_node_series"])) == {runs[0], runs[1]}


def test_manifest_checks_block_publication_as_current(dagster_spec, dagster_plant, instance, resources):
    runs = finished_runs(dagster_plant)
    summary = materialize_dataset(
        dagster_spec, tsdb_url=resources["tsdb"].url, home=Path(resources["store"].home), instance=instance
    )
    root = resources["store"].datasets_root
    first = current_snapshot(root, dagster_spec.id)
    assert str(first) == summary["snapshotDir"] and summary["checks"] == dict.fromkeys(MANIFEST_CHECKS, True)

    # Tamper with the fitted statistics between the two assets: the snapshot is still written
    # (for inspection) but the blocking check fails and `current` keeps the previous snapshot.
    norm_path = resources["store"].dataset_store(dagster_spec).dir / "norm.json"
    norm = json.loads(norm_path.read_bytes())
    norm["x"]["std"][0] *= 1.01
    norm_path.write_text(json.dumps(norm))
    result = materialize(dagster_spec, instance, resources, ["dataset_manifest"], raise_on_error=False)
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert not evaluations["norm_stats_from_train_only"].passed
    assert evaluations["hash_verifies"].passed
    assert current_snapshot(root, dagster_spec.id) == first
    m = latest(instance, dg.AssetKey([dagster_spec.id, "dataset_manifest"]))
    assert m.metadata["current"].value is False
    assert len(runs) >= 3


def _code_versions(spec) -> dict[str, str]:
    out = {}
    for a in dataset_assets(spec, StageVersions.of(spec)):
        for k, v in a.code_versions_by_key.items():
            out[k.path[-1]] = v
    return out


def test_code_versions_are_scoped_to_each_stage(dagster_spec):
    base = _code_versions(dagster_spec)
    assert set(base) == {*RUN_ASSETS, *DATASET_ASSETS} and len(set(base.values())) == 6
    assert _code_versions(parse_spec(dagster_spec.to_json_dict())) == base

    def changed(**fields) -> set[str]:
        other = _code_versions(parse_spec({**dagster_spec.to_json_dict(), **fields}))
        return {k for k in base if other[k] != base[k]}

    j = dagster_spec.to_json_dict()
    stages_after = lambda first: set([*RUN_ASSETS, *DATASET_ASSETS][[*RUN_ASSETS, *DATASET_ASSETS].index(first):])  # noqa: E731
    assert changed(note="edited") == {"dataset_manifest"}
    assert changed(split={**j["split"], "seed": 7}) == stages_after("dataset_split")
    assert changed(stride=2) == stages_after("run_windows")
    assert changed(cleaning={**j["cleaning"], "hampelSigma": 4.0}) == stages_after("cleaned_grid")
    nodes = [dict(n) for n in j["nodes"]]
    nodes[0]["hampelK"] = 2
    assert changed(nodes=nodes) == stages_after("cleaned_grid")
    assert changed(toMs=253_402_300_799_999) == stages_after("raw_node_series")  # 9999-12-31, the latest


def _tick(sensor, instance, resources, cursor=None):
    return sensor(dg.build_sensor_context(instance=instance, resources=resources, cursor=cursor))


def test_sensor_adds_finished_runs_and_requests_them_in_ranges(dagster_spec, dagster_plant, instance, resources, monkeypatch):
    monkeypatch.setenv("AML_BACKFILL_RUNS_PER_CHUNK", "2")
    sensor = new_run_sensor(dagster_spec, StageVersions.of(dagster_spec))
    assert sensor.name == f"{dagster_spec.id}__new_runs"
    finished = finished_runs(dagster_plant)
    unfinished = [r.run_id for r in dagster_plant.runs if r.ended_at is None]
    assert unfinished and len(finished) >= 4, "the plant should have runs in progress and several finished"

    result = _tick(sensor, instance, resources)
    assert isinstance(result, dg.SensorResult)
    [add] = result.dynamic_partitions_requests
    assert add.partitions_def_name == run_partitions(dagster_spec.id).name
    assert sorted(add.partition_keys) == sorted(finished)
    # Contiguous ranges of at most 2 runs (AML_BACKFILL_RUNS_PER_CHUNK), each a Dagster run over the
    # three run stages; no run in progress; every finished run exactly once.
    ranges = [(r.tags[RANGE_START_TAG], r.tags[RANGE_END_TAG]) for r in result.run_requests]
    covered = []
    for lo, hi in ranges:
        i, j = finished.index(lo), finished.index(hi)
        assert 0 <= j - i <= 1
        covered += finished[i : j + 1]
    assert covered == finished and len(result.run_requests) == -(-len(finished) // 2)
    assert all(set(r.asset_selection) == set(keys(dagster_spec, RUN_ASSETS)) for r in result.run_requests)

    # A repeated tick (e.g. after a crash before the runs launched) asks again with the same run
    # keys, which Dagster launches only once; partitions are not added twice.
    instance.add_dynamic_partitions(add.partitions_def_name, list(add.partition_keys))
    again = _tick(sensor, instance, resources)
    assert {r.run_key for r in again.run_requests} == {r.run_key for r in result.run_requests}
    assert again.dynamic_partitions_requests == []

    # Once runs are built, only the rest are requested; with none left the tick skips.
    materialize(dagster_spec, instance, resources, RUN_ASSETS, tags={RANGE_START_TAG: finished[0], RANGE_END_TAG: finished[1]})
    rest = _tick(sensor, instance, resources)
    assert sorted(r for q in rest.run_requests for r in finished[finished.index(q.tags[RANGE_START_TAG]) : finished.index(q.tags[RANGE_END_TAG]) + 1]) == sorted(finished[2:])
    materialize(dagster_spec, instance, resources, RUN_ASSETS, tags={RANGE_START_TAG: finished[2], RANGE_END_TAG: finished[-1]})
    assert isinstance(_tick(sensor, instance, resources), dg.SkipReason)

    # A spec edit that changes the cleaning re-requests every run, from the cleaning stage on.
    j = dagster_spec.to_json_dict()
    edited = parse_spec({**j, "cleaning": {**j["cleaning"], "hampelSigma": 4.0}})
    redo = _tick(new_run_sensor(edited, StageVersions.of(edited)), instance, resources)
    assert all(set(r.asset_selection) == set(keys(edited, ["cleaned_grid", "run_windows"])) for r in redo.run_requests)


def test_sensor_retries_a_failed_build_a_bounded_number_of_times(dagster_spec, dagster_plant, instance, resources):
    sensor = new_run_sensor(dagster_spec, StageVersions.of(dagster_spec))
    first = _tick(sensor, instance, resources)
    instance.add_dynamic_partitions(run_partitions(dagster_spec.id).name, list(first.dynamic_partitions_requests[0].partition_keys))
    cursor, keys_seen = first.cursor, {r.run_key for r in first.run_requests}
    # Nothing got built (as if every launched run failed): each tick retries with a new run key ...
    for attempt in range(2, 4):
        retry = _tick(sensor, instance, resources, cursor)
        assert retry.run_requests and all(r.run_key.endswith(f"#{attempt}") for r in retry.run_requests)
        assert not keys_seen & {r.run_key for r in retry.run_requests}
        keys_seen |= {r.run_key for r in retry.run_requests}
        cursor = retry.cursor
    # ... until MAX_ATTEMPTS, then the runs are reported, not requested again.
    skip = _tick(sensor, instance, resources, cursor)
    assert isinstance(skip, dg.SkipReason) and "gave up after 3 failed attempts" in skip.skip_message
    assert finished_runs(dagster_plant)[0] in skip.skip_message


def test_schedule_rebuilds_the_dataset_assets(dagster_spec, resources):
    all_resources = {**plant_resources(), **resources}
    defs = dg.Definitions.merge(dataset_definitions(dagster_spec), dg.Definitions(resources=all_resources))
    [schedule] = [s for s in defs.schedules if s.name == f"{dagster_spec.id}__rebuild_schedule"]
    assert schedule.cron_schedule == "15 * * * *"
    job = defs.resolve_job_def(f"{dagster_spec.id}__rebuild")
    assert set(job.asset_layer.executable_asset_keys) == set(keys(dagster_spec, DATASET_ASSETS))
    custom = dataset_definitions(parse_spec({**dagster_spec.to_json_dict(), "schedule": "0 3 * * *"}))
    assert {s.name: s.cron_schedule for s in custom.schedules}[f"{dagster_spec.id}__rebuild_schedule"] == "0 3 * * *"
    verify = {s.name: s for s in defs.schedules}[f"{dagster_spec.id}__verify_schedule"]
    assert verify.default_status == dg.DefaultScheduleStatus.STOPPED


def test_a_broken_spec_stops_the_code_location_loading_naming_the_file_and_field(dagster_spec, tmp_path, monkeypatch):
    """The specs folder fails closed: a code location without one of its datasets is no success.
    (`dg check defs` prints the line alone: components/test_dataset.py.)"""
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "good.yaml").write_text(json.dumps(dagster_spec.to_json_dict()))
    (specs / "broken.yaml").write_text(json.dumps({**dagster_spec.to_json_dict(), "id": "broken", "historySteps": 0}))
    monkeypatch.setenv("AML_SPECS", str(specs))
    with pytest.raises(Exception) as err:
        load_definitions()  # the project's entry point, as `dagster dev` loads it
    cause = err.value
    while not isinstance(cause, AmlError) and cause.__cause__ is not None:
        cause = cause.__cause__
    assert isinstance(cause, AmlError), err.value
    assert cause.one_line().startswith(f"SPEC_INVALID: {specs / 'broken.yaml'}: field historySteps:"), cause.one_line()


def test_verify_job_rechecks_the_published_snapshot(dagster_spec, instance, resources):
    summary = materialize_dataset(
        dagster_spec, tsdb_url=resources["tsdb"].url, home=Path(resources["store"].home), instance=instance
    )
    all_resources = {**plant_resources(), **resources}
    defs = dg.Definitions.merge(dataset_definitions(dagster_spec), dg.Definitions(resources=all_resources))
    verify = defs.resolve_job_def(f"{dagster_spec.id}__verify")
    manifest_key = dg.AssetKey([dagster_spec.id, "dataset_manifest"])
    materialisations = len(instance.fetch_materializations(manifest_key, limit=100).records)

    ok = verify.execute_in_process(instance=instance)
    assert {e.check_name: e.passed for e in ok.get_asset_check_evaluations()} == dict.fromkeys(MANIFEST_CHECKS, True)
    # Only the checks ran: the snapshot was not rebuilt.
    assert len(instance.fetch_materializations(manifest_key, limit=100).records) == materialisations

    # Tampering after publication shows as a failed blocking check naming the file.
    x = Path(summary["snapshotDir"]) / "arrays" / "x.f32"
    os.chmod(x, 0o644)
    data = bytearray(x.read_bytes())
    data[100] ^= 1
    x.write_bytes(bytes(data))
    bad = verify.execute_in_process(instance=instance, raise_on_error=False)
    checks = {e.check_name: e for e in bad.get_asset_check_evaluations()}
    assert not checks["hash_verifies"].passed and "arrays/x.f32" in checks["hash_verifies"].description
    record = instance.get_latest_asset_check_evaluation_record(dg.AssetCheckKey(manifest_key, "hash_verifies"))
    assert record is not None and record.evaluation is not None and not record.evaluation.passed


def test_a_split_with_val_or_test_empty_is_a_warning_in_the_run_log_naming_the_rule(dagster_spec, instance, resources):
    summary = materialize_dataset(
        dagster_spec, tsdb_url=resources["tsdb"].url, home=Path(resources["store"].home), instance=instance
    )
    n = sum(summary["runs"][p] for p in ("train", "val", "test"))
    assert summary["runs"]["val"] == 0 < n < 7, summary  # few runs: floor(n x 0.15) = 0
    [record] = instance.fetch_materializations(dg.AssetKey([dagster_spec.id, "dataset_split"]), limit=1).records
    warnings = [e.user_message for e in instance.all_logs(record.run_id)
                if e.level == logging.WARNING and "no runs" in e.user_message]
    assert any(f"the chronological split of {n} runs gives floor({n} x 0.15) = 0 for val" in w
               and "(docs/spec.md, split)" in w for w in warnings), warnings


def test_a_series_dataset_has_the_windows_datasets_figures_and_checks(dagster_spec, instance, resources, tmp_path):
    """The same spec in the series layout through Dagster: its blocking checks pass on its own
    files, its metadata (windows, runs, statistics, lag correlations) is the windows layout's,
    and the verify job names a tampered row file."""
    from aml_pipeline.components.resources import StoreResource

    series_spec = parse_spec({**dagster_spec.to_json_dict(), "layout": "series"})
    figures = {}
    for spec, home in ((dagster_spec, tmp_path / "w"), (series_spec, tmp_path / "s")):
        store = StoreResource(home=str(home))
        summary = materialize_dataset(spec, tsdb_url=resources["tsdb"].url, home=home, instance=instance)
        assert summary["checks"] == dict.fromkeys(MANIFEST_CHECKS, True) and summary["current"]
        m = latest(instance, dg.AssetKey([spec.id, "dataset_manifest"]))
        figures[spec.layout] = {k: m.metadata[k].value for k in ("lag_cross_correlation", "norm", "windows_train",
                                                                  "windows_val", "windows_test", "runs_train")}
        snapshot = Path(summary["snapshotDir"])
    assert figures["series"] == figures["windows"]
    assert figures["series"]["lag_cross_correlation"].records  # there are lag figures to compare
    assert json.loads((snapshot / "manifest.json").read_text())["layout"] == "series"

    all_resources = {**plant_resources(), **resources, "store": store}
    defs = dg.Definitions.merge(dataset_definitions(series_spec), dg.Definitions(resources=all_resources))
    verify = defs.resolve_job_def(f"{series_spec.id}__verify")
    assert all(e.passed for e in verify.execute_in_process(instance=instance).get_asset_check_evaluations())
    rows = snapshot / "arrays" / "x_rows.f32"
    os.chmod(rows, 0o644)
    data = bytearray(rows.read_bytes())
    data[100] ^= 1
    rows.write_bytes(bytes(data))
    checks = {e.check_name: e for e in verify.execute_in_process(instance=instance, raise_on_error=False)
              .get_asset_check_evaluations()}
    assert not checks["hash_verifies"].passed and "arrays/x_rows.f32" in checks["hash_verifies"].description


def test_the_dataset_assets_derive_from_the_stage_declarations(dagster_spec) -> None:
    from aml_pipeline.components.assets import dataset_stage_assets
    from aml_pipeline.pipeline.registry import DATASET_STAGES, STAGES

    versions = StageVersions.of(dagster_spec)
    assets = dataset_stage_assets(dagster_spec, versions)
    by_name = {s.name: s for s in STAGES}
    assert [a.key for a in assets] == [dg.AssetKey([dagster_spec.id, n]) for n in DATASET_ASSETS]
    for a, stage in zip(assets, DATASET_STAGES):
        [spec] = a.specs
        assert spec.code_version == versions[stage] and spec.description == stage.description
        assert spec.group_name == dagster_spec.id and a.node_def.name == f"{dagster_spec.id}__{stage.asset}"
        assert dg.AssetKey([dagster_spec.id, by_name[stage.upstream].asset]) == next(iter(spec.deps)).asset_key
