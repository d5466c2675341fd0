"""The production instance's database stops in the middle of a CLI build.

``aml-pipeline build`` on ``deploy/dagster.yaml``, its instance database on a PostgreSQL server of
its own (stopped and started again by the test), the TSDB on the session's server. Eight finished
runs, two per chunk. The first chunk is recorded; the server stops while a later chunk waits in
its fetch (a lock on the points table holds it there). Then:

1. the build ends with one line, ``INSTANCE_UNAVAILABLE: ...``, naming the instance, and exit 2;
2. what the instance recorded before is kept; the same build again, once the database answers,
   materialises exactly the runs it had not recorded and publishes the bytes of a build that
   never failed (the demo spec's v2 snapshot: all but the build time in the manifest);
3. the Dagster run the dead build left "started" is recorded as failed by that next build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import dagster as dg
import pytest

from aml_pipeline.runner.build import materialize_dataset
from aml_pipeline.runner.instance import BUILD_PID_TAG
from aml_pipeline.demo import DEMO_SPEC, seed_demo
from aml_pipeline.pipeline.plan import run_scope
from aml_pipeline.pipeline.registry import RUN_ASSETS
from aml_pipeline.spec import load_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests import pg_server
from aml_pipeline_tests.dagster_server import wait_for
from aml_pipeline_tests.deploy.cluster import (
    SEEDED,
    database,
    fetches_waiting,
    instance_env,
    points_locked,
    production_home,
)
from aml_pipeline_tests.snapshot_compare import assert_same_v2_snapshot
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema

pytestmark = pytest.mark.timeout(1200)

RUNS_PER_CHUNK = 2


def recorded(instance: dg.DagsterInstance, spec_id: str) -> dict[str, list[str]]:
    return {name: sorted(instance.get_materialized_partitions(dg.AssetKey([spec_id, name]))) for name in RUN_ASSETS}


def test_an_instance_database_stopping_mid_build_ends_it_in_one_line_and_loses_nothing(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = load_spec(DEMO_SPEC)
    schema = f"t_{uuid.uuid4().hex[:16]}"
    tsdb_url = with_schema(postgres_url, schema)
    server = pg_server.start_server(owner_pid=os.getpid())
    try:
        assert seed_demo(tsdb_url, runs=SEEDED).written > 0
        with open_tsdb(tsdb_url) as db:
            finished = sorted(r.run_id for r in db.list_runs(run_scope(spec), finished_only=True))
        assert len(finished) == SEEDED - 1
        with dg.DagsterInstance.ephemeral() as reference:
            expected = materialize_dataset(spec, tsdb_url=tsdb_url, home=tmp_path / "reference", instance=reference,
                                           console_log_level="CRITICAL")["snapshotDir"]

        home = production_home(tmp_path)
        with database(server.url) as name:
            settings = instance_env(server.url, name, max_concurrent_runs=2)
            for k, v in settings.items():
                monkeypatch.setenv(k, v)  # the test's own view of the instance
            env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "AML_", "PG"))}
            env.update(settings, DAGSTER_HOME=str(home), AML_BACKFILL_RUNS_PER_CHUNK=str(RUNS_PER_CHUNK))
            build = [sys.executable, "-m", "aml_pipeline.cli", "build", str(DEMO_SPEC), "--tsdb", tsdb_url,
                     "--home", str(tmp_path / "aml"), "--json"]

            with dg.DagsterInstance.from_config(str(home)) as instance:
                with points_locked(postgres_url, schema):
                    proc = subprocess.Popen(build, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    wait_for(lambda: fetches_waiting(postgres_url) > 0 or proc.poll() is not None, timeout=300,
                             what="the first chunk waiting in its fetch")
                    assert proc.poll() is None, proc.communicate()
                # The first chunk goes on and is recorded; the next fetch is held again at once
                # (a steady short poll: a growing interval could let later chunks through).
                windows_key = dg.AssetKey([spec.id, "run_windows"])
                wait_for(lambda: instance.get_materialized_partitions(windows_key) or proc.poll() is not None,
                         timeout=300, what="the first chunk recorded", interval=0.02, max_interval=0.02)
                with points_locked(postgres_url, schema):
                    wait_for(lambda: fetches_waiting(postgres_url) > 0 or proc.poll() is not None, timeout=300,
                             what="a later chunk waiting in its fetch")
                    assert proc.poll() is None, proc.communicate()
                    before = recorded(instance, spec.id)
                    server.stop(remove=False)
                # The chunk fetches and builds its runs, and cannot record them.
                out, err = proc.communicate(timeout=600)

            lines = err.strip().splitlines()
            assert proc.returncode == 2, err
            assert lines[-1].startswith(f"INSTANCE_UNAVAILABLE: the Dagster instance in {home} failed: "), err
            assert "redoes only the runs it has not recorded" in lines[-1], err
            assert "Traceback" not in err, err
            # Dagster retries the database at every call while it is down; the build says so once.
            assert sum("Retrying failed database connection" in line for line in lines) == 1, err
            assert not out.strip(), out
            # Whole chunks were recorded, the first among them, and not all of them.
            assert before["raw_node_series"] == before["cleaned_grid"] == before["run_windows"], before
            kept = before["run_windows"]
            assert finished[:RUNS_PER_CHUNK] == kept[:RUNS_PER_CHUNK] and len(kept) % RUNS_PER_CHUNK == 0, kept
            assert len(kept) < len(finished), kept

            server.start()
            with dg.DagsterInstance.from_config(str(home)) as instance:
                assert recorded(instance, spec.id) == before
                [dead] = instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
                dead_pid = dead.tags[BUILD_PID_TAG]
                assert dead_pid == str(proc.pid), dead.tags

            again = subprocess.run(build, env=env, capture_output=True, text=True, timeout=600)
            assert again.returncode == 0, again.stderr
            summary = json.loads(again.stdout.strip().splitlines()[-1])
            assert summary["current"] is True
            assert_same_v2_snapshot(Path(expected), Path(summary["snapshotDir"]), "a build that never failed and this one")
            assert summary["materialized"] == dict.fromkeys(RUN_ASSETS, len(finished) - len(kept)), (summary, kept)
            with dg.DagsterInstance.from_config(str(home)) as instance:
                assert recorded(instance, spec.id) == dict.fromkeys(RUN_ASSETS, finished)
                dead = instance.get_run_by_id(dead.run_id)
                assert dead.status == dg.DagsterRunStatus.FAILURE
                assert dead.tags.get("dagster/will_retry") != "true", dead.tags  # the build redid it
                [failure] = [e for e in instance.all_logs(dead.run_id)
                             if e.dagster_event and e.dagster_event.event_type == dg.DagsterEventType.RUN_FAILURE]
                assert f"process {dead_pid} on" in failure.message, failure.message
                assert not instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
    finally:
        server.stop()
        drop_schema(postgres_url, schema)
