"""The TSDB source: observed by its watermark through the job, and on a schedule that launches a
run only when the watermark moved."""

from __future__ import annotations

import dagster as dg
import numpy as np
import pytest

from aml_pipeline.definitions import defs as load_definitions
from aml_pipeline.components.assets import TSDB_POINTS
from aml_pipeline.components.resources import TsdbResource
from aml_pipeline.components.sources import OBSERVE_JOB, observe_tsdb, observe_tsdb_schedule
from aml_pipeline.simulate.plant import simulate_plant
from aml_pipeline.tsdb import PointColumns
from aml_pipeline.tsdb_open import open_tsdb


def tick(instance, url):
    # closed after the tick: it opens resources (and Dagster's context) that must not outlive it
    with dg.build_schedule_context(instance=instance, resources={"tsdb": TsdbResource(url=url)}) as context:
        return observe_tsdb_schedule(context)


def test_the_project_defines_the_observation_job_and_a_running_schedule():
    defs = load_definitions()  # the project's entry point, as `dg dev` loads it
    schedule = defs.resolve_schedule_def(f"{OBSERVE_JOB}_schedule")
    assert schedule.job_name == OBSERVE_JOB
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    job = defs.resolve_job_def(OBSERVE_JOB)
    assert TSDB_POINTS in job.asset_layer.asset_graph.get_all_asset_keys()


@pytest.fixture
def persistent_instance():
    """Schedules read the instance through a reference, which an ephemeral instance has not."""
    with dg.instance_for_test() as inst:
        yield inst


def test_the_schedule_observes_only_when_the_watermark_moved(tmp_path, persistent_instance):
    instance = persistent_instance
    url = f"duckdb://{tmp_path / 'tsdb.duckdb'}"
    skipped = tick(instance, f"duckdb://{tmp_path / 'nowhere' / 'tsdb.duckdb'}")
    assert isinstance(skipped, dg.SkipReason) and "cannot be read" in skipped.skip_message

    plant = simulate_plant(n_runs=2, run_minutes=3, seed=5)
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
        watermark = db.availability_watermark()
    assert isinstance(tick(instance, url), dg.RunRequest)  # never observed yet

    assert observe_tsdb(instance, url) == str(watermark)
    [record] = instance.fetch_observations(TSDB_POINTS, limit=5).records
    observation = record.asset_observation
    assert observation.data_version == str(watermark)
    assert observation.metadata["runs_finished"].value + observation.metadata["runs_in_progress"].value == 2
    assert observation.metadata["watermark_ms"].value == watermark
    assert instance.get_runs()[0].job_name == OBSERVE_JOB

    unchanged = tick(instance, url)
    assert isinstance(unchanged, dg.SkipReason) and str(watermark) in unchanged.skip_message

    with open_tsdb(url, read_only=False) as db:  # a late point moves the watermark
        run = plant.runs[0].run_id
        db.ingest(points=PointColumns(np.array([run], object), np.array([plant.nodes[0].node_id], object),
                                      np.array([watermark + 1000]), np.array([1.0]), np.array([0], np.int32)))
    assert isinstance(tick(instance, url), dg.RunRequest)
