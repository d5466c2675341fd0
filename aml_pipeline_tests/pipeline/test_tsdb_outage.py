"""A TSDB that goes away mid-fetch: a PostgreSQL server restarted (``pg_ctl restart -m immediate``,
or stopped and started), the embedded file held by a writer past a reader's wait. The build is
stopped at a named page of its fetch (``fetch.page``) while the fault is made, so the fault is
proven to fall mid-fetch; the build retries, resumes from the page cursor and publishes the same
bytes as an undisturbed build. Past ``AML_TSDB_RETRY_S`` it fails in one line naming the run and
node, exit 2, publishing nothing.

These tests restart PostgreSQL, so they start a server of their own (never the session's)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from aml_pipeline.errors import AmlError
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.publish import Catalog
from aml_pipeline.pipeline.registry import RAW
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.tsdb.retry import RETRY_ENV, RetryPolicy
from aml_pipeline_tests import pg_server
from aml_pipeline_tests.faults import armed, process_state, wait_stopped
from aml_pipeline_tests.pipeline.support import stage_runs
from aml_pipeline_tests.pg_schemas import with_schema
from aml_pipeline_tests.tsdb.support import wait_until_queued

# Small pages: a node of a run takes several, so a fault falls between two pages of one node.
PAGE = 200
# How long the build holds the embedded file before it lets go after a page (retrying_tsdb's hold_s).
HOLD_S = 0.5
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[pg_server.PgServer]:
    server = pg_server.start_server(owner_pid=os.getpid())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_plant(server, plant) -> str:
    """The simulated plant in a fresh schema of this module's server."""
    url = with_schema(server.url, f"t_{uuid.uuid4().hex[:16]}")
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    return url


def reference(spec, url: str, tmp_path: Path) -> tuple[str, dict]:
    """An undisturbed build's snapshot hash and its raw stage's points and pages per run."""
    roots = {"store_root": tmp_path / "ref-store", "datasets_root": tmp_path / "ref-datasets"}
    with open_tsdb(url) as db:
        out = build_dataset(spec, db, page_limit=PAGE, **roots)
    return out.sha256, raw_figures(spec, roots["store_root"])


def raw_figures(spec, store_root: Path) -> dict:
    store = DatasetStore(store_root, spec)
    return {r: {k: store.read_meta(r, RAW)[k] for k in ("points", "pages", "dataVersion")} for r in stage_runs(store, RAW)}


BUILD = """
import json, sys
from pathlib import Path
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.spec import parse_spec
from aml_pipeline.tsdb_open import retrying_tsdb
spec = parse_spec(json.loads(sys.argv[2]))
# lock_timeout_s: how long a reader of the embedded file waits for a writer before that open
# counts as a transient failure (short here, so the test need not hold a writer for 10 s).
with retrying_tsdb(sys.argv[1], lock_timeout_s=0.3, hold_s=float(sys.argv[6])) as db:
    out = build_dataset(spec, db, store_root=Path(sys.argv[3]), datasets_root=Path(sys.argv[4]), page_limit=int(sys.argv[5]))
print(out.sha256)
"""


def start_build(spec, url: str, tmp_path: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", BUILD, url, json.dumps(spec.to_json_dict()), str(tmp_path / "store"),
         str(tmp_path / "datasets"), str(PAGE), str(HOLD_S)],
        env=env, stdout=subprocess.PIPE, stderr=open(tmp_path / "build.err", "w"), text=True,
        cwd=str(REPO),  # the child imports aml_pipeline_tests
    )


def retry_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if "; retry " in line]


def wait_for_retries(proc: subprocess.Popen, err: Path, n: int, timeout: float = 120) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(retry_lines(err)) < n:
        assert proc.poll() is None, err.read_text()
        assert time.monotonic() < deadline, f"no {n} retries within {timeout} s: {err.read_text()}"
        time.sleep(0.05)
    return retry_lines(err)


def test_a_postgres_restart_mid_fetch_is_retried_from_the_page_cursor(server, pg_plant, make_spec, tmp_path):
    spec = make_spec()
    expected_sha, expected_raw = reference(spec, pg_plant, tmp_path)
    first_run, first_node = sorted(expected_raw)[0], spec.node_ids[0]
    assert expected_raw[first_run]["pages"][first_node] > 2  # the fetch starts with this node, in pages
    env = armed("fetch.page:2", tmp_path, {**os.environ, RETRY_ENV: "60"})
    build = start_build(spec, pg_plant, tmp_path, env)
    pid = wait_stopped(build, env, output=lambda: (tmp_path / "build.err").read_text())
    before = server.postmaster_pid
    server.restart_immediate()  # every backend killed, the build's connection with them
    # Restarted while the build stood between the second and third page of its first node.
    assert server.postmaster_pid != before and process_state(pid) == "T"
    os.kill(pid, signal.SIGCONT)
    out, _ = build.communicate(timeout=300)
    err = (tmp_path / "build.err").read_text()
    assert build.returncode == 0, err
    lines = retry_lines(tmp_path / "build.err")
    assert lines and all(line.startswith(f"TSDB_UNAVAILABLE: run {first_run}, node {first_node}: ") for line in lines), err
    assert out.strip() == expected_sha  # the same bytes as the undisturbed build
    # Each node was read in as many pages as undisturbed: the fetch went on from its cursor
    # (starting a node again would take more pages), and no point is lost or repeated.
    assert raw_figures(spec, tmp_path / "store") == expected_raw


WRITER = """
import sys
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
db = DuckDBTsdb(sys.argv[1], read_only=False, lock_timeout_s=120)
print("writing", flush=True)
sys.stdin.readline()
db.close()
"""


def test_the_embedded_file_held_by_a_writer_mid_fetch_is_retried(plant_url, make_spec, tmp_path):
    """An ingest takes the file between two pages of the build and holds it past the build's
    reader wait: the opens that time out are retried until it lets go."""
    spec = make_spec()
    expected_sha, expected_raw = reference(spec, plant_url, tmp_path)
    first_run = sorted(expected_raw)[0]
    # The fifth page is the last of the run's second node: pages of its other nodes follow.
    assert sum(list(expected_raw[first_run]["pages"].values())[:2]) == 5
    env = armed("fetch.page:5", tmp_path, {**os.environ, RETRY_ENV: "60"})
    build = start_build(spec, plant_url, tmp_path, env)
    pid = wait_stopped(build, env, output=lambda: (tmp_path / "build.err").read_text())
    # The build's hold began before it stopped and runs on while it stands: once HOLD_S has passed,
    # its next page is the last it reads on this handle. (Resumed sooner, the whole small build
    # could run within the hold and never meet the writer.)
    time.sleep(HOLD_S)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, plant_url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_queued(plant_url, writer)  # the writer waits for the file the stopped build holds
        assert process_state(pid) == "T"
        os.kill(pid, signal.SIGCONT)  # the build lets go of the file after its next page; the writer gets it
        assert writer.stdout.readline().strip() == "writing", writer.stderr.read()
        lines = wait_for_retries(build, tmp_path / "build.err", 2)
        # Retried in the run the build stood in: the writer took the file mid-fetch.
        assert all(line.startswith(f"TSDB_BUSY: run {first_run}, node ") and "in use by another process" in line
                   for line in lines), lines
        writer.stdin.write("done\n")
        writer.stdin.flush()
        assert writer.wait(timeout=60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    out, _ = build.communicate(timeout=300)
    assert build.returncode == 0, (tmp_path / "build.err").read_text()
    assert out.strip() == expected_sha
    assert raw_figures(spec, tmp_path / "store") == expected_raw


def cli_build(spec, url: str, tmp_path: Path, env: dict) -> subprocess.Popen:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_json_dict()))
    return subprocess.Popen(
        [sys.executable, "-m", "aml_pipeline.cli", "build", str(spec_file), "--tsdb", url, "--home",
         str(tmp_path / "home"), "--out", str(tmp_path / "datasets"), "--json"],
        env=env, stdout=subprocess.PIPE, stderr=open(tmp_path / "build.err", "w"), text=True, cwd=str(REPO),
    )


@pytest.fixture
def dagster_home(tmp_path) -> Path:
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    return home


def warnings_in_dagster(home: Path) -> list[str]:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return [
            e.user_message
            for run in instance.get_runs()
            for e in instance.all_logs(run.run_id)
            if e.level == logging.WARNING and "TSDB_UNAVAILABLE" in (e.user_message or "")
        ]


def test_the_cli_build_outlasts_a_postgres_outage_and_says_so(server, pg_plant, make_spec, tmp_path, dagster_home):
    """The server stopped (immediately) while the build stands between two pages, started again
    once the build has retried twice: each retry is one warning line in the CLI and in the
    Dagster run's log, and the snapshot is the undisturbed build's."""
    spec = make_spec()
    expected_sha, _ = reference(spec, pg_plant, tmp_path)
    env = armed("fetch.page:3", tmp_path, {**os.environ, RETRY_ENV: "120", "DAGSTER_HOME": str(dagster_home)})
    build = cli_build(spec, pg_plant, tmp_path, env)
    pid = wait_stopped(build, env, output=lambda: (tmp_path / "build.err").read_text())
    server.stop(remove=False)
    try:
        os.kill(pid, signal.SIGCONT)
        wait_for_retries(build, tmp_path / "build.err", 2)
    finally:
        server.start()
    out, _ = build.communicate(timeout=600)
    err = (tmp_path / "build.err").read_text()
    assert build.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["sha256"] == expected_sha and summary["published"]
    lines = retry_lines(tmp_path / "build.err")
    assert len(lines) >= 2 and all(line.startswith("warning: TSDB_UNAVAILABLE: run ") for line in lines), err
    assert len(set(lines)) == len(lines)  # one line per retry, none printed twice
    logged = warnings_in_dagster(dagster_home)
    assert [f"warning: {m}" for m in logged] == lines, (logged, lines)


def test_past_the_bound_the_build_fails_in_one_line_and_publishes_nothing(server, pg_plant, make_spec, tmp_path, dagster_home):
    spec = make_spec()
    env = armed("fetch.page:3", tmp_path, {**os.environ, RETRY_ENV: "2", "DAGSTER_HOME": str(dagster_home)})
    build = cli_build(spec, pg_plant, tmp_path, env)
    pid = wait_stopped(build, env, output=lambda: (tmp_path / "build.err").read_text())
    server.stop(remove=False)
    try:
        os.kill(pid, signal.SIGCONT)
        out, _ = build.communicate(timeout=600)
    finally:
        server.start()
    err = (tmp_path / "build.err").read_text()
    assert build.returncode == 2, err
    errors = [line for line in err.splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]
    assert line.startswith("TSDB_UNAVAILABLE: ") and "still unavailable after" in line, line
    assert f"{RETRY_ENV}=2" in line and ", node " in line and "run " in line, line
    assert retry_lines(tmp_path / "build.err")  # it did retry first
    datasets = tmp_path / "datasets"
    assert Catalog(datasets).entries(spec.id) == []
    assert not (datasets / spec.id).exists() or [p.name for p in (datasets / spec.id).iterdir()] in ([], [".lock"])


def test_the_retry_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "8")
    assert RetryPolicy.from_env() == RetryPolicy(8.0, 0.5, 16.0)
    monkeypatch.delenv(RETRY_ENV)
    assert RetryPolicy.from_env().budget_s == 60
    for bad in ("soon", "-1", "inf"):
        monkeypatch.setenv(RETRY_ENV, bad)
        with pytest.raises(AmlError, match=RETRY_ENV):
            RetryPolicy.from_env()
