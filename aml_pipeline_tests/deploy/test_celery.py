"""Steps on Celery workers: the same snapshot bytes as one process, even when a worker dies mid-chunk.

The deployment of ``cluster.py`` with ``AML_EXECUTOR=celery``: PostgreSQL (instance storage and
the TSDB), ``redis-server`` (broker and result backend), two Celery workers
(``celery -A aml_pipeline.workers worker``), the code server (which starts the run workers), the
webserver and the daemon, each a separate process sharing only the databases and the artifact
store directory, as hosts would. Eight finished runs, three runs per chunk.

1. The run assets are backfilled through the daemon (GraphQL ``launchPartitionBackfill``) in
   chunks of three runs, one Dagster run each (as the new-run sensor requests them), with
   the TSDB's points table locked, so every fetch waits inside its query. Once every raw step a
   worker has taken is waiting there, the worker running one chunk's raw step is SIGKILLed with
   its whole process group (as if its host died), and the lock is released.
2. The step is not lost: it is acknowledged only when it ends, so the broker delivers it again
   (Redis: once the visibility timeout, 20 s here, has passed) and the surviving worker runs it;
   the chunk's Dagster run waits for it and succeeds. No Dagster run is retried: the run never
   failed. The other chunks are recorded as soon as they end, each partition once, by its
   chunk's run.
3. The dataset assets (the rebuild job, also on the workers) publish a snapshot whose bytes equal
   the single-process build's (``materialize_dataset`` in this process, same TSDB): every array,
   spec.json, report.json and the manifest apart from ``provenance.capturedAt``.
4. One chunk is backfilled again, and only the process running its raw step (the surviving
   worker's pool process) is SIGKILLed while it waits in its fetch: the worker lives, Celery
   requeues the step at once (``task_reject_on_worker_lost``), the same worker runs it again in
   the same Dagster run, and the chunk's stored stages are byte-identical to before.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from aml_pipeline.runner.build import materialize_dataset
from aml_pipeline.pipeline.registry import RUN_ASSETS
from aml_pipeline_tests.dagster_server import wait_for
from aml_pipeline_tests.deploy.cluster import (
    RUNS_PER_CHUNK,
    SEEDED,
    Deployment,
    chunk_range,
    deployment,
)
from aml_pipeline_tests.snapshot_compare import assert_same_v2_snapshot

pytestmark = pytest.mark.timeout(2400)

VISIBILITY_TIMEOUT_S = 20
WORKERS = 2


def step_executions(run: dict[str, Any], step: str) -> list[str]:
    """The Celery workers that started ``step`` in this run, in order (one entry per delivery)."""
    return [
        {m["label"]: m.get("text") for m in e["metadataEntries"]}["Celery worker"]
        for e in run["eventConnection"]["events"]
        if e["__typename"] == "EngineEvent" and (e.get("stepKey") or "").endswith(step)
        and "in celery worker" in e["message"]
    ]


def raw_step_waiting(d: Deployment, backfill_ids: list[str]) -> tuple[str, str] | None:
    """(Dagster run, worker) of a chunk's raw step running on a worker, once every raw step the
    workers have taken is waiting inside its fetch."""
    taken = []
    for r in d.chunk_runs(backfill_ids):
        run = d.run(r["runId"])
        taken += [(run["runId"], w) for w in step_executions(run, "run_stages")]
    if taken and d.fetches_waiting() >= len(taken):
        return taken[0]
    return None


def pool_processes(worker) -> list[int]:
    """The pids of a Celery worker's pool processes (its children: they run the steps)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == worker.proc.pid:
                children.append(int(entry.name))
    return children


def step_process_waiting(d: Deployment, backfill_id: str, worker) -> tuple[str, int] | None:
    """(Dagster run, pid) of the process running the chunk's raw step under ``worker``, once the
    step has started there and waits inside its fetch (the worker runs one step at a time)."""
    for r in d.backfill(backfill_id)["runs"]:
        run = d.run(r["runId"])
        if step_executions(run, "run_stages") and d.fetches_waiting() >= 1:
            [pid] = pool_processes(worker)
            return run["runId"], pid
    return None


def stage_bytes(d: Deployment, run_ids: list[str]) -> dict[str, bytes]:
    """Every stored stage array of these runs, by path under the store."""
    store = d.root / "aml" / "store" / d.spec.id / "runs"
    return {str(f.relative_to(store)): f.read_bytes() for r in run_ids for f in sorted((store / r).glob("*.npy"))}


def test_celery_workers_build_the_same_bytes_and_survive_a_killed_worker(tmp_path: Path, postgres_url: str) -> None:
    with deployment(
        tmp_path / "cluster", postgres_url, seeded_runs=SEEDED, runs_per_chunk=RUNS_PER_CHUNK,
        max_concurrent_runs=3, tsdb_pool_limit=4, workers=WORKERS,
        extra_env={"AML_CELERY_VISIBILITY_TIMEOUT_S": str(VISIBILITY_TIMEOUT_S)},
    ) as d:
        finished = d.finished
        chunks = [finished[i:i + RUNS_PER_CHUNK] for i in range(0, len(finished), RUNS_PER_CHUNK)]
        d.add_run_partitions(finished)

        # 1. The backfill, and a worker killed while its chunk's fetch waits.
        with d.points_locked():
            backfill_ids = d.launch_chunks(finished, "test: Celery workers, one killed")
            hit_run, hit_worker = wait_for(
                lambda: raw_step_waiting(d, backfill_ids), timeout=900,
                what="a raw step waiting in its fetch on a worker", diagnostics=lambda: d.backfill_diagnostics(backfill_ids[0]),
            )
            victim = next(w for w in d.workers if hit_worker.startswith(f"{w.name}@"))
            victim.kill()
        survivor = next(w for w in d.workers if w is not victim)

        hit = chunk_range(d.run(hit_run))
        lost = next(c for c in chunks if (c[0], c[-1]) == hit)
        others = [r for c in chunks if c is not lost for r in c]

        # 2. The other chunks end and are recorded while the killed step waits for redelivery.
        def others_done() -> tuple[dict[str, Any], list[str]] | None:
            runs = [d.run(r["runId"]) for r in d.chunk_runs(backfill_ids)]
            if all(r["status"] == "SUCCESS" for r in runs if r["runId"] != hit_run) and len(runs) == len(chunks):
                return d.run(hit_run), d.materialized("run_windows")
            return None

        hit_then, recorded = wait_for(
            others_done, timeout=900, what="the chunks on the surviving worker",
            diagnostics=lambda: "\n".join(d.backfill_diagnostics(b) for b in backfill_ids),
        )
        assert set(others) <= set(recorded), (recorded, others)
        if hit_then["status"] != "SUCCESS":
            assert not set(lost) & set(recorded), (recorded, lost, hit_then["status"])

        backfills = [d.wait_for_backfill(b) for b in backfill_ids]
        diagnostics = "\n".join(d.backfill_diagnostics(b) for b in backfill_ids)
        assert all(b["status"] == "COMPLETED_SUCCESS" for b in backfills), diagnostics
        runs = {r["runId"]: d.run(r["runId"]) for b in backfills for r in b["runs"]}
        # ceil(8 / 3) chunks, each one Dagster run; none retried by Dagster.
        assert sorted(chunk_range(r) for r in runs.values()) == sorted((c[0], c[-1]) for c in chunks), diagnostics
        assert all(r["status"] == "SUCCESS" and "dagster/parent_run_id" not in r["tags"] for r in runs.values()), diagnostics
        # The killed worker's step was delivered again, to the survivor, in the same Dagster run.
        executions = step_executions(runs[hit_run], "run_stages")
        assert [w.split("@")[0] for w in executions] == [victim.name, survivor.name], executions
        # Each partition recorded once, by its own chunk's run, before that run ended.
        run_of = {p: rid for rid, r in runs.items() for p in finished if chunk_range(r)[0] <= p <= chunk_range(r)[1]}
        for asset in RUN_ASSETS:
            events = d.materializations(asset)
            assert sorted(e["partition"] for e in events) == finished, (asset, events)
            for e in events:
                assert e["runId"] == run_of[e["partition"]], (asset, e)
                assert int(e["timestamp"]) <= runs[e["runId"]]["endTime"] * 1000, (asset, e)

        # 3. The dataset assets, then the bytes against one process on the same data.
        rebuild = d.launch_job(f"{d.spec.id}__rebuild")
        status = d.webserver.wait_for_run(rebuild, 900)
        assert status == "SUCCESS", f"{d.webserver.run_failures(rebuild)}\n{d.diagnostics()}"
        assert survivor.name in {w.split("@")[0] for w in step_executions(d.run(rebuild), "dataset_manifest")}
        deployed = (d.root / "aml" / "datasets" / d.spec.id / "current").resolve()

        # 4. Only a step's process killed under a living worker (as the out-of-memory killer does):
        #    the worker stays, Celery requeues the step at once and the worker runs it again; the
        #    chunk is redone and its stored stages come out byte-identical.
        redo = chunks[0]
        before = stage_bytes(d, redo)
        assert len(before) >= 3 * len(redo)
        with d.points_locked():
            redo_id = d.launch_backfill(redo, "test: a step process killed under a living worker")
            redo_run, step_pid = wait_for(
                lambda: step_process_waiting(d, redo_id, survivor), timeout=900,
                what="the chunk's raw step waiting in its fetch", diagnostics=lambda: d.backfill_diagnostics(redo_id),
            )
            os.kill(step_pid, signal.SIGKILL)
        redone = d.wait_for_backfill(redo_id)
        assert redone["status"] == "COMPLETED_SUCCESS", d.backfill_diagnostics(redo_id)
        assert survivor.proc.poll() is None  # the worker lived through it
        assert step_pid not in pool_processes(survivor)  # and the killed process was its own
        executions = step_executions(d.run(redo_run), "run_stages")
        assert [w.split("@")[0] for w in executions] == [survivor.name, survivor.name], executions
        assert d.run(redo_run)["status"] == "SUCCESS" and "dagster/parent_run_id" not in d.run(redo_run)["tags"]
        assert stage_bytes(d, redo) == before

        reference = materialize_dataset(d.spec, tsdb_url=d.tsdb_url, home=tmp_path / "one_process")
        single = Path(reference["snapshotDir"])

    assert_same_v2_snapshot(single, deployed, "the Celery deployment and one process")
