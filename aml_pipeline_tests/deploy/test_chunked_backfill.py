"""Chunks on the production instance, without Celery: a crash loses one chunk at most.

The deployment of ``cluster.py`` with Dagster's default executor (one process per step on the
code server's host): PostgreSQL instance from ``deploy/dagster.yaml``, code server, webserver,
daemon. Eight finished runs, ``AML_BACKFILL_RUNS_PER_CHUNK=3``:

1. the run assets are backfilled in ceil(8 / 3) = 3 contiguous chunks, as the new-run sensor
   requests them, each one Dagster run (the run stages' single-run backfill policy);
2. the first chunk's TSDB fetch is held (a lock on the points table) and its step process is
   SIGKILLed, and so are the step processes of the run retries the instance launches for it
   (``run_retries``); every other chunk completes and its partitions are recorded;
3. the first chunk's backfill ends failed with exactly its runs missing; re-executing it from
   failure launches one Dagster run over exactly those runs, and redoes nothing else.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import yaml

from aml_pipeline.pipeline.registry import RUN_ASSETS
from aml_pipeline_tests.dagster_server import wait_for
from aml_pipeline_tests.deploy.cluster import (
    DEPLOY,
    RUNS_PER_CHUNK,
    SEEDED,
    chunk_range,
    deployment,
    raw_step_process,
)

pytestmark = pytest.mark.timeout(2400)


def test_a_killed_chunk_loses_only_its_runs_and_a_rerun_redoes_only_them(tmp_path: Path, postgres_url: str) -> None:
    max_retries = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())["run_retries"]["max_retries"]
    with deployment(
        tmp_path, postgres_url, seeded_runs=SEEDED, runs_per_chunk=RUNS_PER_CHUNK,
        max_concurrent_runs=3, tsdb_pool_limit=4,
    ) as d:
        finished = d.finished
        assert len(finished) == SEEDED - 1, finished
        chunks = [finished[i:i + RUNS_PER_CHUNK] for i in range(0, len(finished), RUNS_PER_CHUNK)]
        lost, kept = chunks[0], [r for c in chunks[1:] for r in c]
        d.add_run_partitions(finished)
        code_server = d.services["code_server"]

        killed: list[str] = []
        with d.points_locked():
            backfill_ids = d.launch_chunks(finished, "test: chunks, one of them killed")
            lost_id = backfill_ids[0]
            # The chunk's run, then each retry the instance launches for it: kill its raw step.
            for _ in range(max_retries + 1):
                run_id, pid = wait_for(
                    lambda: raw_step_process(d, backfill_ids, lost[0], set(killed)),
                    timeout=900, what=f"the raw step of chunk {lost[0]}..{lost[-1]} waiting in its fetch",
                    diagnostics=lambda: d.backfill_diagnostics(lost_id),
                )
                assert code_server.owns(pid), f"pid {pid} is not a process of this deployment"
                os.kill(pid, signal.SIGKILL)
                killed.append(run_id)

        backfills = [d.wait_for_backfill(b) for b in backfill_ids]
        runs = {r["runId"]: d.run(r["runId"]) for b in backfills for r in b["runs"]}
        diagnostics = "\n".join(d.backfill_diagnostics(b) for b in backfill_ids)
        assert [b["status"] for b in backfills] == ["COMPLETED_FAILED"] + ["COMPLETED_SUCCESS"] * (len(chunks) - 1), diagnostics

        # 1. One Dagster run per chunk of at most K runs, plus the retries of the killed chunk.
        originals = [r for r in runs.values() if "dagster/parent_run_id" not in r["tags"]]
        assert len(originals) == math.ceil(len(finished) / RUNS_PER_CHUNK) == len(chunks), diagnostics
        assert sorted(chunk_range(r) for r in originals) == sorted((c[0], c[-1]) for c in chunks), diagnostics
        assert len(runs) == len(chunks) + max_retries, diagnostics
        for run_id in killed:
            assert runs[run_id]["status"] == "FAILURE" and chunk_range(runs[run_id]) == (lost[0], lost[-1]), runs[run_id]
        retries = [runs[r] for r in killed[1:]]
        assert [r["tags"]["dagster/parent_run_id"] for r in retries] == killed[:-1], [r["tags"] for r in retries]
        for run in runs.values():
            if run["runId"] not in killed:
                assert run["status"] == "SUCCESS", diagnostics

        # 2. Every other chunk's runs are recorded, by the Dagster run of their own chunk.
        run_of = {p: r["runId"] for r in originals if r["runId"] not in killed for p in finished if chunk_range(r)[0] <= p <= chunk_range(r)[1]}
        for asset in RUN_ASSETS:
            assert d.materialized(asset) == kept, (asset, diagnostics)
            events = d.materializations(asset)
            assert sorted(e["partition"] for e in events) == kept, (asset, events)
            for e in events:
                run = runs[e["runId"]]
                assert e["runId"] == run_of[e["partition"]], (asset, e)
                assert int(e["timestamp"]) <= run["endTime"] * 1000, (asset, e, run["endTime"])
        assert d.failed("run_windows") == lost, diagnostics

        # 3. Re-executed from failure: one Dagster run over exactly the lost chunk; nothing else redone.
        rerun_id = d.reexecute_backfill_from_failure(lost_id)
        rerun = d.wait_for_backfill(rerun_id)
        rerun_diagnostics = d.backfill_diagnostics(rerun_id)
        assert rerun["status"] == "COMPLETED_SUCCESS", rerun_diagnostics
        assert [chunk_range(r) for r in rerun["runs"]] == [(lost[0], lost[-1])], rerun_diagnostics
        [rerun_run] = rerun["runs"]
        assert rerun_run["status"] == "SUCCESS", rerun_diagnostics
        for asset in RUN_ASSETS:
            assert d.materialized(asset) == finished, (asset, rerun_diagnostics)
            events = d.materializations(asset)
            assert sorted(e["partition"] for e in events) == finished, (asset, "each run materialised exactly once")
            assert {e["partition"] for e in events if e["runId"] == rerun_run["runId"]} == set(lost), (asset, events)
