"""Runs whose process died with its host end by themselves; a backfill's chunk is retried.

The deployment of ``cluster.py`` with Dagster's default executor, its ``run_monitoring`` with a
shorter ``max_runtime_seconds`` (the deployed value is a day). With the TSDB's points table
locked, so that every fetch waits inside its query:

- one chunk of three runs is backfilled through the daemon, launched with a tighter maximum of
  its own (the tag ``dagster/max_runtime``, as docs/deployment.md tells an operator to add in
  the launch dialog), and its raw step waits in its fetch;
- ``aml-pipeline build`` on the same instance (as another host's command line would) waits in
  its first chunk's fetch, and is SIGKILLed there;
- the code server's whole process group is SIGKILLed: the code server, the chunk's run worker
  and its step process, as if their host had died.

Nothing is left to record either run's end. The lock is released and the code server started
again, as a service manager would on the rebooted host.

1. Both runs are still *Started*: nothing in Dagster knows they are dead (the default run
   launcher has no health check, the new code server never knew the backfill's run, and the
   build's host never builds again).
2. Once each has run for its maximum (the backfill's run: its tag; the build's run: the
   instance's ``max_runtime_seconds``), the daemon fails it. ``run_retries`` launches a retry of
   the backfill's run (with the backfill's tags), which records the chunk's three runs, and the
   backfill completes. The build's run is not retried (``dagster/max_retries: 0``: the same build
   again is its retry).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from aml_pipeline.runner.instance import BUILD_PID_TAG
from aml_pipeline.demo import DEMO_SPEC
from aml_pipeline.pipeline.registry import RUN_ASSETS
from aml_pipeline_tests.dagster_server import wait_for
from aml_pipeline_tests.deploy.cluster import (
    RUNS_PER_CHUNK,
    SEEDED,
    chunk_range,
    deployment,
    instance_env,
    raw_step_process,
)

pytestmark = pytest.mark.timeout(2400)

# The backfill's maximum (its tag): long enough for the code server to be back before it passes
# (it loads the definitions on a busy 2-core machine), short enough for a test; the retry's own
# chunk must also end within it. The instance's maximum, which the build's run gets, differs from
# it so that each failure message shows which one ended the run.
BACKFILL_MAX_RUNTIME_S = 240
MAX_RUNTIME_S = 300


def test_runs_whose_host_died_are_failed_after_their_max_runtime_and_a_chunk_retried(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    with deployment(
        tmp_path, postgres_url, seeded_runs=SEEDED, runs_per_chunk=RUNS_PER_CHUNK,
        max_concurrent_runs=3, tsdb_pool_limit=4,
        instance_settings={"run_monitoring": {"max_runtime_seconds": MAX_RUNTIME_S, "poll_interval_seconds": 5}},
    ) as d:
        chunk = d.finished[:RUNS_PER_CHUNK]
        d.add_run_partitions(d.finished)
        code_server = d.services["code_server"]

        # The test's own view of the instance, as deploy/dagster.yaml reads it from the environment.
        for k, v in instance_env(postgres_url, d.env["DAGSTER_PG_DB"], int(d.env["AML_MAX_CONCURRENT_RUNS"])).items():
            monkeypatch.setenv(k, v)
        build = [sys.executable, "-m", "aml_pipeline.cli", "build", str(DEMO_SPEC),
                 "--tsdb", d.tsdb_url, "--home", str(tmp_path / "cli-home"), "--json"]

        with d.points_locked():
            backfill_id = d.launch_backfill(chunk, "test: a chunk whose host dies",
                                            tags={dg.MAX_RUNTIME_SECONDS_TAG: str(BACKFILL_MAX_RUNTIME_S)})
            run_id, pid = wait_for(
                lambda: raw_step_process(d, [backfill_id], chunk[0], set()),
                timeout=900, what=f"the raw step of chunk {chunk[0]}..{chunk[-1]} waiting in its fetch",
                diagnostics=lambda: d.backfill_diagnostics(backfill_id),
            )
            cli = subprocess.Popen(build, env=d.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            wait_for(lambda: d.fetches_waiting() >= 2 or cli.poll() is not None, timeout=600,
                     what="the command-line build waiting in its fetch")
            assert cli.poll() is None, cli.communicate()
            cli.kill()
            cli.communicate(timeout=60)
            assert code_server.owns(pid), f"pid {pid} is not a process of this deployment"
            code_server.kill()
        d.restart_code_server()

        # 1. Nothing has noticed: both runs are still started (if not, BACKFILL_MAX_RUNTIME_S is too
        # short for this machine, and the test says so rather than testing something else).
        dead = d.run(run_id)
        assert dead["status"] == "STARTED", (dead["status"], d.backfill_diagnostics(backfill_id))
        since_start = time.time() - dead["startTime"]
        assert since_start < BACKFILL_MAX_RUNTIME_S, f"the code server was back only {since_start:.0f} s after the run started"
        with dg.DagsterInstance.from_config(d.env["DAGSTER_HOME"]) as instance:
            [cli_run] = instance.get_runs(filters=dg.RunsFilter(tags={BUILD_PID_TAG: str(cli.pid)}))
        assert cli_run.status == dg.DagsterRunStatus.STARTED, cli_run.status

        # 2. Failed after its max runtime, retried, and the retry records the chunk.
        backfill = d.wait_for_backfill(backfill_id, timeout=BACKFILL_MAX_RUNTIME_S + 900)
        diagnostics = d.backfill_diagnostics(backfill_id)
        runs = {r["runId"]: d.run(r["runId"]) for r in backfill["runs"]}
        assert backfill["status"] == "COMPLETED_SUCCESS", diagnostics
        dead = runs[run_id]
        assert dead["status"] == "FAILURE", diagnostics
        assert dead["endTime"] - dead["startTime"] >= BACKFILL_MAX_RUNTIME_S, (dead["startTime"], dead["endTime"])
        messages = [e.get("message") or "" for e in dead["eventConnection"]["events"]]
        assert any(f"exceeding maximum runtime of {BACKFILL_MAX_RUNTIME_S} seconds" in m for m in messages), messages
        [retry] = [r for r in runs.values() if r["tags"].get("dagster/parent_run_id") == run_id]
        assert retry["status"] == "SUCCESS" and chunk_range(retry) == (chunk[0], chunk[-1]), diagnostics
        for run in (dead, retry):
            assert run["tags"].get(dg.MAX_RUNTIME_SECONDS_TAG) == str(BACKFILL_MAX_RUNTIME_S), run["tags"]
        assert set(runs) == {run_id, retry["runId"]}, diagnostics
        for asset in RUN_ASSETS:
            assert d.materialized(asset) == chunk, (asset, diagnostics)
            events = d.materializations(asset)
            assert sorted(e["partition"] for e in events) == chunk, (asset, "each run materialised exactly once")
            assert {e["runId"] for e in events} == {retry["runId"]}, (asset, events)

        # The build's run: failed by the daemon too, and not retried.
        def cli_run_ended() -> dg.DagsterRun | None:
            with dg.DagsterInstance.from_config(d.env["DAGSTER_HOME"]) as instance:
                run = instance.get_run_by_id(cli_run.run_id)
                return run if run is not None and run.is_finished else None

        ended = wait_for(cli_run_ended, timeout=MAX_RUNTIME_S + 600, what="the killed build's run ended")
        assert ended.status == dg.DagsterRunStatus.FAILURE, ended.status
        with dg.DagsterInstance.from_config(d.env["DAGSTER_HOME"]) as instance:
            messages = [e.message for e in instance.all_logs(cli_run.run_id)]
            assert any(f"exceeding maximum runtime of {MAX_RUNTIME_S} seconds" in m for m in messages), messages
            assert not instance.get_runs(filters=dg.RunsFilter(tags={"dagster/parent_run_id": cli_run.run_id}))
            assert not instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
