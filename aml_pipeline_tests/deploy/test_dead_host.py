"""A chunk whose run worker dies with its host ends by itself, and its retry records the runs.

The deployment of ``cluster.py`` with Dagster's default executor, its ``run_monitoring`` with a
shorter ``max_runtime_seconds`` (the deployed value is a day). One chunk of three runs is
backfilled with the TSDB's points table locked, so its raw step waits inside its fetch. Then the
code server's whole process group is SIGKILLed: the code server, the chunk's run worker and its
step process, as if their host had died, so nothing is left to record the run's end. The lock is
released and the code server started again, as a service manager would on the rebooted host.

1. The run is still *Started*: nothing in Dagster knows it is dead (the default run launcher has
   no health check, and the new code server never knew the run).
2. Once it has run for ``max_runtime_seconds``, the daemon fails it, and ``run_retries`` launches
   a retry of it, which records the chunk's three runs; the backfill completes. Without the
   deployed ``max_runtime_seconds`` the run would stay *Started* and the backfill would never end.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aml_pipeline.defs.assets import RUN_ASSETS
from aml_pipeline_tests.dagster_server import wait_for
from aml_pipeline_tests.deploy.cluster import (
    RUNS_PER_CHUNK,
    SEEDED,
    _code_server_ready,
    chunk_range,
    deployment,
    raw_step_process,
)

pytestmark = pytest.mark.timeout(2400)

# Long enough for the code server to be back before it passes (it loads the definitions on a busy
# 2-core machine), short enough for a test; the retry's own chunk must also end within it.
MAX_RUNTIME_S = 180


def test_a_run_whose_host_died_is_failed_after_its_max_runtime_and_retried(tmp_path: Path, postgres_url: str) -> None:
    with deployment(
        tmp_path, postgres_url, seeded_runs=SEEDED, runs_per_chunk=RUNS_PER_CHUNK,
        max_concurrent_runs=3, tsdb_pool_limit=4,
        instance_settings={"run_monitoring": {"max_runtime_seconds": MAX_RUNTIME_S, "poll_interval_seconds": 5}},
    ) as d:
        chunk = d.finished[:RUNS_PER_CHUNK]
        d.add_run_partitions(d.finished)
        code_server = d.services["code_server"]

        with d.points_locked():
            backfill_id = d.launch_backfill(chunk, "test: a chunk whose host dies")
            run_id, pid = wait_for(
                lambda: raw_step_process(d, backfill_id, chunk[0], set()),
                timeout=900, what=f"the raw step of chunk {chunk[0]}..{chunk[-1]} waiting in its fetch",
                diagnostics=lambda: d.backfill_diagnostics(backfill_id),
            )
            assert code_server.owns(pid), f"pid {pid} is not a process of this deployment"
            code_server.kill()
        code_server.start()
        port = int(d.env["AML_CODE_SERVER_PORT"])
        wait_for(lambda: _code_server_ready(port), timeout=600, what="the code server, started again",
                 diagnostics=code_server.diagnostics)

        # 1. Nothing has noticed: the run is still started (if not, MAX_RUNTIME_S is too short
        # for this machine, and the test says so rather than testing something else).
        dead = d.run(run_id)
        assert dead["status"] == "STARTED", (dead["status"], d.backfill_diagnostics(backfill_id))
        assert time.time() - dead["startTime"] < MAX_RUNTIME_S, "the max runtime passed before the code server was back"

        # 2. Failed after its max runtime, retried, and the retry records the chunk.
        backfill = d.wait_for_backfill(backfill_id, timeout=MAX_RUNTIME_S + 900)
        diagnostics = d.backfill_diagnostics(backfill_id)
        runs = {r["runId"]: d.run(r["runId"]) for r in backfill["runs"]}
        assert backfill["status"] == "COMPLETED_SUCCESS", diagnostics
        dead = runs[run_id]
        assert dead["status"] == "FAILURE", diagnostics
        assert dead["endTime"] - dead["startTime"] >= MAX_RUNTIME_S, (dead["startTime"], dead["endTime"])
        messages = [e.get("message") or "" for e in dead["eventConnection"]["events"]]
        assert any(f"exceeding maximum runtime of {MAX_RUNTIME_S} seconds" in m for m in messages), messages
        [retry] = [r for r in runs.values() if r["tags"].get("dagster/parent_run_id") == run_id]
        assert retry["status"] == "SUCCESS" and chunk_range(retry) == (chunk[0], chunk[-1]), diagnostics
        assert set(runs) == {run_id, retry["runId"]}, diagnostics
        for asset in RUN_ASSETS:
            assert d.materialized(asset) == chunk, (asset, diagnostics)
            events = d.materializations(asset)
            assert sorted(e["partition"] for e in events) == chunk, (asset, "each run materialised exactly once")
            assert {e["runId"] for e in events} == {retry["runId"]}, (asset, events)
