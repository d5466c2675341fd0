"""Incremental builds through the Dagster jobs: rebuild only what changed, publish only what is new."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import pytest

from aml_pipeline.runner.build import _run_stages_done, materialize_dataset, sync_run_partitions
from aml_pipeline.runner.jobs import dataset_job_definitions
from aml_pipeline.components.partitions import RANGE_END_TAG, RANGE_START_TAG
from aml_pipeline.errors import AmlError
from aml_pipeline.pipeline.registry import RAW, RUN_ASSETS
from aml_pipeline.spec import parse_spec


def _build(spec, resources, instance, **kw):
    return materialize_dataset(
        spec, tsdb_url=resources["tsdb"].url, home=Path(resources["store"].home), instance=instance, **kw
    )


def _snapshots(resources, spec) -> dict[str, int]:
    """Snapshot directories of the spec and the bytes they take (hard links counted once)."""
    root = resources["store"].datasets_root / spec.id
    seen, out = set(), {}
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")):
        total = 0
        for f in d.rglob("*"):
            st = f.stat()
            if f.is_file() and st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
        out[d.name] = total
    return out


def test_a_rebuild_with_nothing_new_materialises_and_publishes_nothing(dagster_spec, dagster_plant, instance, resources):
    n = len([r for r in dagster_plant.runs if r.ended_at is not None])
    first = _build(dagster_spec, resources, instance)
    assert first["materialized"] == dict.fromkeys(RUN_ASSETS, n) and first["published"] is True
    seconds = first["seconds"]  # the run stages are timed apart even inside the one __build run
    assert 0 < seconds["runStages"] < seconds["total"] and seconds["dataset"] == pytest.approx(
        seconds["total"] - seconds["runStages"], abs=0.002)
    # The step's end, read from its end event alone, is the end Dagster's step statistics give.
    [run] = instance.get_runs(limit=1)
    [stats] = instance.get_run_step_stats(run.run_id, step_keys=[f"{dagster_spec.id}__run_stages"])
    assert _run_stages_done(instance, run.run_id, dagster_spec.id, 0.0) == round(stats.end_time, 3)
    before = _snapshots(resources, dagster_spec)

    again = _build(dagster_spec, resources, instance)
    assert again["materialized"] == dict.fromkeys(RUN_ASSETS, 0)
    assert "runStages" not in again["seconds"]  # no run stage ran
    assert again["published"] is False and again["snapshotDir"] == first["snapshotDir"]
    assert again["sha256"] == first["sha256"] and again["current"] is True
    assert _snapshots(resources, dagster_spec) == before  # no new directory, not a byte more

    # The scheduled job (split, normalisation, manifest) run twice with no change: same.
    defs = dataset_job_definitions(dagster_spec, resources)
    for _ in range(2):
        result = defs.resolve_job_def(f"{dagster_spec.id}__rebuild").execute_in_process(instance=instance)
        [mat] = [e.materialization for e in result.get_asset_materialization_events()
                 if e.materialization.asset_key == dg.AssetKey([dagster_spec.id, "dataset_manifest"])]
        assert mat.metadata["published"].value is False
        assert {e.check_name: e.passed for e in result.get_asset_check_evaluations()} == dict.fromkeys(
            ("hash_verifies", "no_run_in_two_splits", "norm_stats_from_train_only", "no_nan_or_inf"), True)
    assert _snapshots(resources, dagster_spec) == before

    full = _build(dagster_spec, resources, instance, full=True)
    assert full["materialized"] == dict.fromkeys(RUN_ASSETS, n) and full["published"] is False


def test_a_build_records_every_run_in_the_instance_it_is_given(dagster_spec, dagster_plant, resources):
    runs = [r.run_id for r in dagster_plant.runs if r.ended_at is not None]
    windows = dg.AssetKey([dagster_spec.id, "run_windows"])
    with dg.DagsterInstance.ephemeral() as elsewhere:
        first = _build(dagster_spec, resources, elsewhere)
    # The store is fresh, but this instance has recorded none of it: every run is materialised
    # here (the same bytes), so the UI of this instance shows what the snapshot holds.
    with dg.DagsterInstance.ephemeral() as instance:
        here = _build(dagster_spec, resources, instance)
        assert here["materialized"] == dict.fromkeys(RUN_ASSETS, len(runs))
        assert here["sha256"] == first["sha256"] and here["published"] is False
        assert instance.get_materialized_partitions(windows) == set(runs)
        assert _build(dagster_spec, resources, instance)["materialized"] == dict.fromkeys(RUN_ASSETS, 0)

    # Partly recorded (as when a step dies after storing a run): only the unrecorded stages.
    runs_job = dataset_job_definitions(dagster_spec, resources).resolve_job_def(f"{dagster_spec.id}__runs")
    with dg.DagsterInstance.ephemeral() as instance:
        sync_run_partitions(instance, dagster_spec, runs)
        for names, chunk in ((RUN_ASSETS, runs[:1]), (RUN_ASSETS, runs[2:]), (["raw_node_series"], runs[1:2])):
            assert runs_job.execute_in_process(
                instance=instance, tags={RANGE_START_TAG: chunk[0], RANGE_END_TAG: chunk[-1]},
                asset_selection=[dg.AssetKey([dagster_spec.id, n]) for n in names],
            ).success
        again = _build(dagster_spec, resources, instance)
        assert again["materialized"] == {"raw_node_series": 0, "cleaned_grid": 1, "run_windows": 1}
        assert instance.get_materialized_partitions(windows) == set(runs)
        assert again["sha256"] == first["sha256"]


def test_a_spec_edit_reruns_exactly_the_stages_it_changes(dagster_spec, dagster_plant, instance, resources):
    n = len([r for r in dagster_plant.runs if r.ended_at is not None])
    first = _build(dagster_spec, resources, instance)
    j = dagster_spec.to_json_dict()

    split_edit = parse_spec({**j, "split": {**j["split"], "method": "hashed", "seed": 3}})
    s = _build(split_edit, resources, instance)
    assert s["materialized"] == dict.fromkeys(RUN_ASSETS, 0)  # nothing fetched, cleaned or windowed
    assert s["published"] is True and s["sha256"] != first["sha256"]

    nodes = [dict(x) for x in j["nodes"]]
    nodes[0]["hampelK"] = 2
    clean_edit = parse_spec({**j, "split": split_edit.to_json_dict()["split"], "nodes": nodes})
    c = _build(clean_edit, resources, instance)
    assert c["materialized"] == {"raw_node_series": 0, "cleaned_grid": n, "run_windows": n}


def test_a_metadata_only_edit_shares_the_array_files(dagster_spec, instance, resources):
    first = _build(dagster_spec, resources, instance)
    edited = parse_spec({**dagster_spec.to_json_dict(), "note": "reviewed by QA"})
    second = _build(edited, resources, instance)
    assert second["published"] is True and second["snapshotDir"] != first["snapshotDir"]
    assert second["materialized"] == dict.fromkeys(RUN_ASSETS, 0)
    for name in ("x.f32", "u.f32", "y.f32", "timestamps.f64", "mask.f32"):
        a = os.stat(Path(first["snapshotDir"]) / "arrays" / name)
        b = os.stat(Path(second["snapshotDir"]) / "arrays" / name)
        assert a.st_ino == b.st_ino, name  # one file on disk, two snapshots
    assert (Path(second["snapshotDir"]) / "spec.json").read_bytes() != (Path(first["snapshotDir"]) / "spec.json").read_bytes()


def _instance_on_disk(home: Path, settings: str = "") -> dg.DagsterInstance:
    """A persistent instance in ``home`` (created), as a DAGSTER_HOME with this dagster.yaml has."""
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n" + settings)
    return dg.DagsterInstance.from_config(str(home))


@pytest.fixture
def parallel_allowed(monkeypatch):
    """Two workers used whatever the work and the host: these builds are small."""
    monkeypatch.setenv("AML_PARALLEL_MIN_CELLS", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)


def test_two_workers_give_the_bytes_of_one(dagster_plant, dagster_plant_url, tmp_path, parallel_allowed):
    from aml_pipeline.simulate.plant import plant_spec_dict

    spec = parse_spec(plant_spec_dict(dagster_plant, "dg_par", history_steps=20, horizon_steps=10))  # v1: hash reproducible
    out = {}
    for workers in (1, 2):
        # An instance with settings, as a user's DAGSTER_HOME has (Dagster configures logging
        # from them at every run start).
        with _instance_on_disk(tmp_path / f"instance{workers}", "python_logs:\n  python_log_level: INFO\n") as instance:
            summary = materialize_dataset(
                spec, tsdb_url=dagster_plant_url, home=tmp_path / f"home{workers}", instance=instance, workers=workers,
            )
            jobs = sorted(r.job_name for r in instance.get_runs())
            out[workers] = (summary, jobs)
    assert out[1][0]["sha256"] == out[2][0]["sha256"]
    assert out[2][0]["materialized"] == out[1][0]["materialized"]
    assert out[2][0]["workers"] == {"asked": 2, "used": 2} and out[1][0]["workers"] == {"asked": 1, "used": 1}
    assert out[1][1] == [f"{spec.id}__build"]  # one chunk: run stages and dataset in one Dagster run
    # Two workers: the runs in two Dagster runs of the run stages (in parallel), then the dataset.
    assert out[2][1] == [f"{spec.id}__rebuild", f"{spec.id}__runs", f"{spec.id}__runs"]
    # Both time the run stages up to the end of the last run-stage step, the dataset after it.
    for summary, _ in out.values():
        seconds = summary["seconds"]
        assert 0 < seconds["runStages"] < seconds["total"], seconds
        assert seconds["dataset"] == pytest.approx(seconds["total"] - seconds["runStages"], abs=0.002), seconds


def test_a_killed_step_process_ends_the_build_in_one_line_and_the_next_build_redoes_only_its_chunk(
        dagster_plant, dagster_plant_url, tmp_path, parallel_allowed):
    import signal
    import threading
    import time

    from aml_pipeline.simulate.plant import plant_spec_dict

    spec = parse_spec(plant_spec_dict(dagster_plant, "dg_kill", history_steps=20, horizon_steps=10))
    runs = [r.run_id for r in dagster_plant.runs if r.ended_at is not None]
    with _instance_on_disk(tmp_path / "instance") as instance:
        outcome: dict = {}

        def build() -> None:
            try:
                outcome["summary"] = materialize_dataset(spec, tsdb_url=dagster_plant_url, home=tmp_path / "aml",
                                                         instance=instance, workers=2)
            except AmlError as e:
                outcome["error"] = e

        builder = threading.Thread(target=build)
        builder.start()
        killed = None
        while killed is None and builder.is_alive():
            for run in instance.get_runs(dg.RunsFilter(job_name=f"{spec.id}__runs")):
                starts = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)
                if starts:  # the step's own process logged it: SIGKILL that process
                    os.kill(starts[0].dagster_event.pid, signal.SIGKILL)
                    killed = run
                    break
            time.sleep(0.01)
        builder.join(timeout=300)
        assert killed is not None and "error" in outcome, outcome
        lost = runs[runs.index(killed.tags[RANGE_START_TAG]):runs.index(killed.tags[RANGE_END_TAG]) + 1]
        line = outcome["error"].one_line()
        assert line == (
            f"WORKER_LOST: the step process building runs {lost[0]} .. {lost[-1]} ({len(lost)} runs, Dagster run "
            f"{killed.run_id[:8]}) was terminated by signal 9 (SIGKILL); the runs of chunks that finished are "
            "recorded, and the same build again redoes only what is missing"
        ), line
        assert instance.get_materialized_partitions(dg.AssetKey([spec.id, "run_windows"])) == set(runs) - set(lost)

        again = materialize_dataset(spec, tsdb_url=dagster_plant_url, home=tmp_path / "aml", instance=instance, workers=2)
        assert again["materialized"] == dict.fromkeys(RUN_ASSETS, len(lost))
        assert instance.get_materialized_partitions(dg.AssetKey([spec.id, "run_windows"])) == set(runs)
    with dg.DagsterInstance.ephemeral() as clean:
        assert again["sha256"] == materialize_dataset(
            spec, tsdb_url=dagster_plant_url, home=tmp_path / "clean", instance=clean)["sha256"]


def _run_probe(tmp_path: Path, source: str, env: dict[str, str] | None = None, *, stderr: list[str] | None = None) -> str:
    """Run ``source`` as a script in a fresh interpreter; the last line it printed (what it wrote
    to stderr, its step server's and step processes' included, is appended to ``stderr``)."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(source)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0, out.stderr
    if stderr is not None:
        stderr.append(out.stderr)
    return out.stdout.strip().splitlines()[-1]


_STEP_SERVER_PROBE = """
import multiprocessing, sys
def loaded(queue):
    queue.put(sorted(m for m in ("matplotlib.figure", "aml_pipeline.runner.parallel") if m in sys.modules))
if __name__ == "__main__":
    {start}
    ctx = multiprocessing.get_context("forkserver")
    queue = ctx.Queue()
    p = ctx.Process(target=loaded, args=(queue,))
    p.start()
    print(queue.get(timeout=60))
    p.join()
"""


@pytest.mark.parametrize("started", [True, False])
def test_step_server_forks_with_the_step_modules_loaded(tmp_path, started):
    """--workers starts the forkserver itself, with the step modules preloaded, before Dagster
    needs it; a process forked from it then has them (a plain forkserver does not)."""
    start = "from aml_pipeline.runner.parallel import start_step_server; start_step_server()" if started else "pass"
    expected = ["aml_pipeline.runner.parallel", "matplotlib.figure"] if started else []
    stderr: list[str] = []
    assert _run_probe(tmp_path, _STEP_SERVER_PROBE.format(start=start), stderr=stderr) == str(expected)
    # Its imports (the definitions' modules) write nothing to the terminal of a --workers build.
    assert "Warning" not in stderr[0], stderr[0]


_STEP_SETTINGS_PROBE = """
import json, multiprocessing, os
from aml_pipeline.components.dagster_internals import build_event_settings
from aml_pipeline.runner.parallel import STEP_SETTINGS, reconstruct_runs_job, start_step_server, step_settings
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
def step(spec_json, settings, queue):
    job = reconstruct_runs_job(spec_json, "duckdb:///nowhere.duckdb", "home", None, settings, "probe")
    [grid] = [n for n in job.asset_layer.executable_asset_keys if n.path[-1] == "cleaned_grid"]
    description = job.asset_layer.get(grid).description
    queue.put({"env": {name: os.environ.get(name) for name in STEP_SETTINGS}, "plot": "no plot" not in description})
if __name__ == "__main__":
    start_step_server()  # first thing, as materialize_dataset does: before the build's settings
    os.environ["AML_RUN_PLOTS"] = "off"  # changed and removed after the server started
    del os.environ["AML_MEMORY_MB"]
    spec_json = json.dumps(plant_spec_dict(simulate_plant(n_runs=1, run_minutes=2, seed=1), "probe"))
    with build_event_settings():
        ctx = multiprocessing.get_context("forkserver")
        queue = ctx.Queue()
        p = ctx.Process(target=step, args=(spec_json, step_settings(), queue))
        p.start()
        print(json.dumps(queue.get(timeout=60)))
        p.join()
"""


def test_step_processes_get_the_builds_settings(tmp_path):
    """A --workers step process forks from the step server, which started with the environment of
    its time: here before the build put its event settings (event batching, one planned event per
    asset) there, before AML_RUN_PLOTS was switched off and while AML_MEMORY_MB was still set. The
    step process still builds its job and its runs with the build's settings."""
    import json

    from aml_pipeline.components.dagster_internals import BUILD_EVENT_SETTINGS
    from aml_pipeline.runner.parallel import STEP_SETTINGS

    env = {k: v for k, v in os.environ.items() if k not in STEP_SETTINGS} | {"AML_RUN_PLOTS": "on", "AML_MEMORY_MB": "512"}
    got = json.loads(_run_probe(tmp_path, _STEP_SETTINGS_PROBE, env))
    assert got == {"env": {**BUILD_EVENT_SETTINGS, "AML_RUN_PLOTS": "off", "AML_MEMORY_MB": None}, "plot": False}


# ---- late points: one run, and only that run, is rebuilt (both TSDB adapters) ----------------------

import uuid  # noqa: E402

import numpy as np  # noqa: E402

from aml_pipeline.components.resources import StoreResource, TsdbResource  # noqa: E402
from aml_pipeline.components.sensors import new_run_sensor  # noqa: E402
from aml_pipeline.tsdb import PointColumns  # noqa: E402
from aml_pipeline.tsdb_open import open_tsdb  # noqa: E402
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema  # noqa: E402
from aml_pipeline.pipeline.registry import StageVersions


@pytest.fixture(params=["duckdb", "postgres"])
def plant_tsdb(request, dagster_plant, tmp_path):
    if request.param == "duckdb":
        url = f"duckdb:///{tmp_path / 'tsdb.duckdb'}"
    else:
        server = request.getfixturevalue("postgres_url")
        schema = f"t_{uuid.uuid4().hex[:16]}"
        url = with_schema(server, schema)
        request.addfinalizer(lambda: drop_schema(server, schema))
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=dagster_plant.runs, nodes=dagster_plant.nodes, points=dagster_plant.points)
    return url


def test_late_points_rebuild_that_run_and_only_that_run(dagster_spec, dagster_plant, plant_tsdb, tmp_path):
    resources = {"tsdb": TsdbResource(url=plant_tsdb), "store": StoreResource(home=str(tmp_path / "aml"))}
    finished = [r for r in dagster_plant.runs if r.ended_at is not None]
    with dg.DagsterInstance.ephemeral() as instance:
        first = _build(dagster_spec, resources, instance)
        assert first["materialized"] == dict.fromkeys(RUN_ASSETS, len(finished))
        sensor = new_run_sensor(dagster_spec, StageVersions.of(dagster_spec))
        assert isinstance(sensor(dg.build_sensor_context(instance=instance, resources=resources)), dg.SkipReason)

        # Late points for one run that was already built (inside its time window).
        late = finished[2]
        ts = np.arange(late.started_at + 1500, late.started_at + 6500, 1000, dtype=np.int64)
        node = dagster_spec.node_ids[0]
        with open_tsdb(plant_tsdb, read_only=False) as db:
            written = db.ingest(points=PointColumns(
                run_id=np.array([late.run_id] * ts.size, dtype=object), node_id=np.array([node] * ts.size, dtype=object),
                ts=ts, value=np.full(ts.size, 42.0), state=np.zeros(ts.size, np.int32),
            ))
        assert written == ts.size

        # The sensor requests that run alone, and the build rebuilds it alone, then republishes.
        tick = sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert [(r.tags["dagster/asset_partition_range_start"], r.tags["dagster/asset_partition_range_end"])
                for r in tick.run_requests] == [(late.run_id, late.run_id)]
        store = resources["store"].dataset_store(dagster_spec)
        before = store.read_meta(late.run_id, RAW)["points"][node]
        again = _build(dagster_spec, resources, instance)
        assert again["materialized"] == dict.fromkeys(RUN_ASSETS, 1)
        assert store.read_meta(late.run_id, RAW)["points"][node] == before + ts.size
        assert _build(dagster_spec, resources, instance)["materialized"] == dict.fromkeys(RUN_ASSETS, 0)


def test_workers_that_cannot_help_are_not_started_and_the_build_says_why(dagster_plant, dagster_plant_url, tmp_path,
                                                                         monkeypatch, caplog):
    from aml_pipeline.runner.parallel import parallel_workers
    from aml_pipeline.simulate.plant import plant_spec_dict

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("AML_PARALLEL_MIN_CELLS", raising=False)
    assert parallel_workers(1, runs=100, cells=10**12) == (1, None)
    assert parallel_workers(2, runs=100, cells=10**9) == (2, None)
    used, why = parallel_workers(8, runs=100, cells=10**9)
    assert used == 2 and why == "this host has 2 cores"
    used, why = parallel_workers(2, runs=1, cells=10**9)
    assert used == 1 and why == "1 run to build"
    used, why = parallel_workers(2, runs=32, cells=3_700_000)
    assert used == 1 and why.startswith("3.7 M grid cells to build, under 10 M per extra worker")
    monkeypatch.setenv("AML_PARALLEL_MIN_CELLS", "1000000")
    assert parallel_workers(2, runs=32, cells=3_700_000) == (2, None)
    monkeypatch.delenv("AML_PARALLEL_MIN_CELLS")

    # A small build asked for two workers: built by one, in one Dagster run, saying why once.
    spec = parse_spec(plant_spec_dict(dagster_plant, "dg_few", history_steps=20, horizon_steps=10))
    with _instance_on_disk(tmp_path / "instance") as instance, caplog.at_level("WARNING", logger="aml_pipeline"):
        summary = materialize_dataset(spec, tsdb_url=dagster_plant_url, home=tmp_path / "aml", instance=instance, workers=2)
        assert [r.job_name for r in instance.get_runs()] == [f"{spec.id}__build"]
    assert summary["workers"]["asked"] == 2 and summary["workers"]["used"] == 1
    assert "grid cells to build" in summary["workers"]["why"]
    # The simulated plant's AI910 is sampled faster than the beat, which the build also warns about
    # (tested in pipeline/stages/test_grid.py); the workers' reason is said exactly once.
    lines = [r.getMessage() for r in caplog.records if r.name == "aml_pipeline" and "--workers" in r.getMessage()]
    assert lines == [f"--workers 2: building with 1 worker: {summary['workers']['why']}"], lines
