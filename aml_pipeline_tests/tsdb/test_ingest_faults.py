"""Ingest under fire, on both adapters: an ``aml-pipeline ingest`` SIGKILLed at each named step of
its transaction (proven stopped there) leaves the stored points and run versions as they were, the
database opens and the next ingest stores the file; two ingests of the same file at once store
each point once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aml_pipeline.simulate.plant import simulate_plant
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.tsdb.port import PointColumns
from aml_pipeline_tests.faults import armed, kill_stopped, process_state, traced, wait_stopped
from aml_pipeline_tests.tsdb.series import point_count

REPO = Path(__file__).resolve().parents[2]
POINTS = ("ingest.files_read", "ingest.mid_transaction", "ingest.commit")


@pytest.fixture(scope="module")
def plant():
    return simulate_plant(n_runs=6, run_minutes=90, seed=11)


@pytest.fixture
def url(new_tsdb_url):
    return new_tsdb_url


def points_of(plant, run_ids: set[str]) -> PointColumns:
    keep = np.isin(plant.points.run_id, list(run_ids))
    p = plant.points
    return PointColumns(p.run_id[keep], p.node_id[keep], p.ts[keep], p.value[keep], p.state[keep])


def write_points(points: PointColumns, path: Path) -> Path:
    pq.write_table(
        pa.table({"run_id": points.run_id.astype(str), "node_id": points.node_id.astype(str), "ts": points.ts,
                  "value": points.value, "state": points.state}),
        path,
    )  # fmt: skip
    return path


@pytest.fixture
def seeded(plant, url, tmp_path):
    """The TSDB with every run and node and the first half of the runs' points; a points file
    with the other half (the ingest under test)."""
    first = {r.run_id for r in plant.runs[: len(plant.runs) // 2]}
    rest = {r.run_id for r in plant.runs} - first
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=points_of(plant, first))
    points = points_of(plant, rest)
    return url, write_points(points, tmp_path / "points.parquet"), len(points)


def state_of(url: str, plant) -> dict:
    run_ids = [r.run_id for r in plant.runs]
    with open_tsdb(url) as db:
        return {
            "versions": db.run_versions(run_ids),
            "runs": db.list_runs(finished_only=False),
            "points": {r: point_count(db, run_id=r) for r in run_ids},
            "watermark": db.availability_watermark(),
        }


def ingest(url: str, points: Path, env: dict | None = None, *extra: str) -> subprocess.Popen:
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-m", "aml_pipeline.cli", "ingest", "--tsdb", url, "--points", str(points), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finished(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("point", POINTS)
def test_an_ingest_killed_at_each_step_changes_nothing(point, plant, seeded, tmp_path):
    url, points, n = seeded
    before = state_of(url, plant)
    env = armed(point, tmp_path)
    proc = ingest(url, points, env)
    kill_stopped(wait_stopped(proc, env, output=lambda: proc.stderr.read()), proc)

    assert state_of(url, plant) == before  # nothing of the killed transaction is visible
    again = finished(ingest(url, points))
    assert again["points"] == n and again["skipped"] == 0
    after = state_of(url, plant)
    changed = {r for r in after["versions"] if after["versions"][r] != before["versions"][r]}
    assert changed == {r for r, c in after["points"].items() if c != before["points"][r]}
    assert changed and sum(after["points"].values()) == sum(before["points"].values()) + n


def _waiting_for_the_writer(url: str, pid: int, trace: Path) -> bool:
    """Whether ingest ``pid`` waits for the TSDB another ingest holds: DuckDB, in the queue for
    the file (it holds the intent file open while it polls its lock); PostgreSQL, its files read,
    its transaction blocked on the ingest lock."""
    if url.startswith("duckdb://"):
        intent = url[len("duckdb://"):] + ".lock"
        try:
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            return False
        return intent in fds
    if not trace.exists() or "ingest.files_read" not in trace.read_text():
        return False
    server = url.split("?")[0]
    with psycopg.connect(server, autocommit=True) as con:
        waiting = con.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'aml_pipeline' AND wait_event_type = 'Lock'"
        ).fetchone()[0]
    return waiting >= 1


def test_two_ingests_of_the_same_file_at_once_store_each_point_once(plant, seeded, tmp_path):
    """The first ingest is held inside its transaction (stopped mid-transaction) while the second
    starts and waits for it; then both finish: one writes the points, the other finds them stored."""
    url, points, n = seeded
    before = state_of(url, plant)
    env = armed("ingest.mid_transaction", tmp_path)
    first = ingest(url, points, env, "--lock-timeout-s", "120")
    pid = wait_stopped(first, env, output=lambda: first.stderr.read())
    env2, trace = traced(tmp_path, "second")
    second = ingest(url, points, env2, "--lock-timeout-s", "120")
    deadline = time.monotonic() + 120
    while not _waiting_for_the_writer(url, second.pid, trace):
        assert second.poll() is None, second.communicate()
        assert time.monotonic() < deadline, "the second ingest never waited for the first"
        time.sleep(0.05)
    assert process_state(pid) == "T"  # the first still holds its transaction
    os.kill(pid, signal.SIGCONT)
    outcomes = sorted([finished(first), finished(second)], key=lambda o: o["points"])
    assert [o["points"] for o in outcomes] == [0, n] and outcomes[0]["skipped"] == n
    after = state_of(url, plant)
    in_file = pq.read_table(points, columns=["run_id"]).column("run_id").to_pylist()
    assert after["points"] == {r: c + in_file.count(r) for r, c in before["points"].items()}
