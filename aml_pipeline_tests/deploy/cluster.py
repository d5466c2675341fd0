"""A production-shaped deployment on loopback, every part a separate process as on real hosts.

What :func:`deployment` starts (each in its own session, its output in ``<root>/logs/<name>.log``):

- the instance database: a fresh database on the session's PostgreSQL server, prepared by
  ``deploy/init-instance.sh`` (migrations, pool limits);
- the TSDB: a fresh schema on the same server, seeded with the simulated plant;
- ``dagster code-server start`` (the code location; it also starts the run workers),
  ``dagster-webserver`` and ``dagster-daemon run``, all with ``deploy/dagster.yaml`` as
  ``$DAGSTER_HOME/dagster.yaml`` and ``deploy/workspace.yaml``, used verbatim;
- with ``workers > 0``: ``redis-server`` as the Celery broker and result backend, and that many
  Celery workers (``celery -A aml_pipeline.workers worker``), ``AML_EXECUTOR=celery``.

Every process is stopped at the end, whatever happened (SIGTERM to its process group, then
SIGKILL to what is left, including anything carrying the process's marker in its environment),
and the database and schema are dropped. Waits poll with generous deadlines, never fixed sleeps.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import yaml
from psycopg import sql

from aml_pipeline import config
from aml_pipeline.demo import DEMO_SPEC, seed_demo
from aml_pipeline.pipeline.plan import run_scope
from aml_pipeline.pipeline.registry import RUN_ASSETS
from aml_pipeline.spec import DatasetSpec, load_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.dagster_server import (
    MARKER_ENV,
    DagsterDev,
    free_port,
    wait_for,
)
from aml_pipeline_tests.dagster_graphql import (
    ADD_PARTITION,
    BACKFILL,
    LAUNCH_BACKFILL,
    LAUNCH_RUN,
    PARTITIONS,
    TERMINAL_BACKFILL,
    TERMINAL_RUN,
)
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema

DEPLOY = config.REPO_ROOT / "deploy"
BIN = Path(sys.executable).parent
LOCATION = "aml_pipeline"
# A busy 2-core machine loads the code location in several processes at once.
LOAD_TIMEOUT = 420
# The deployment tests' plant: the simulator leaves the last run unfinished, so 8 finished runs,
# backfilled three per chunk: ceil(8 / 3) = 3 Dagster runs.
SEEDED = 9
RUNS_PER_CHUNK = 3
RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


def chunk_range(run: Mapping[str, Any]) -> tuple[str, str]:
    """(first, last) run partition of a chunk's Dagster run (tags as a list or a mapping)."""
    tags = run["tags"]
    tags = {t["key"]: t["value"] for t in tags} if isinstance(tags, list) else tags
    return tags[RANGE_START], tags[RANGE_END]


class Service(DagsterDev):
    """One long-running process of the deployment; the GraphQL client works for the webserver."""

    def __init__(self, name: str, cmd: Sequence[str], *, env: Mapping[str, str], cwd: Path, log_dir: Path,
                 port: int | None = None) -> None:
        super().__init__(module=name, env=env, cwd=cwd, log_path=log_dir / f"{name}.log", port=port)
        self.name = name
        self.cmd = [str(c) for c in cmd]

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    def diagnostics(self) -> str:
        state = "not started" if self.proc is None else (
            "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
        )
        return f"--- {self.name} ({state}), last lines of {self.log_path} ---\n{self.log_tail()}"

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is this service or one of its descendants (they carry its marker)."""
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return f"{MARKER_ENV}={self.marker}".encode() in environ

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as if its host had died."""
        assert self.proc is not None, f"{self.name} was never started"
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


@dataclass
class Deployment:
    root: Path
    env: dict[str, str]
    spec: DatasetSpec
    server_url: str  # the PostgreSQL server's database holding the TSDB schema
    tsdb_schema: str
    tsdb_url: str
    finished: list[str]
    webserver: Service
    services: dict[str, Service] = field(default_factory=dict)
    workers: list[Service] = field(default_factory=list)
    repository: dict[str, str] = field(default_factory=dict)

    def diagnostics(self) -> str:
        return "\n".join(s.diagnostics() for s in self.services.values())

    def graphql(self, query: str, variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self.webserver.graphql(query, variables)

    def key(self, name: str) -> dict[str, list[str]]:
        return {"path": [self.spec.id, name]}

    def add_run_partitions(self, run_ids: Sequence[str]) -> None:
        """Add runs as partitions, as the new-run sensor does."""
        for run_id in run_ids:
            added = self.graphql(ADD_PARTITION, {
                "name": f"{self.spec.id}__runs", "key": run_id, "selector": self.repository,
            })["addDynamicPartition"]
            assert added["__typename"] == "AddDynamicPartitionSuccess", added

    def launch_backfill(self, partitions: Sequence[str], title: str, tags: Mapping[str, str] | None = None) -> str:
        """The run assets' backfill over ``partitions``, as the UI's launch dialog sends it (with its *Add tags*)."""
        launched = self.graphql(LAUNCH_BACKFILL, {"params": {
            "assetSelection": [self.key(n) for n in RUN_ASSETS], "partitionNames": list(partitions), "title": title,
            "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()],
        }})["launchPartitionBackfill"]
        assert launched["__typename"] == "LaunchBackfillSuccess", launched
        return launched["backfillId"]

    def launch_chunks(self, partitions: Sequence[str], title: str) -> list[str]:
        """The run assets' backfills over contiguous ranges of at most ``runs_per_chunk`` of
        ``partitions``, one Dagster run each (the run stages' single-run policy): the chunks the
        new-run sensor requests, launched as the UI's backfill dialog would, range by range."""
        size = int(self.env["AML_BACKFILL_RUNS_PER_CHUNK"])
        return [self.launch_backfill(partitions[i:i + size], f"{title} ({partitions[i]}...)")
                for i in range(0, len(partitions), size)]

    def chunk_runs(self, backfill_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The runs of these backfills (``runId``, ``status``, ``tags``), in their order."""
        return [r for b in backfill_ids for r in self.backfill(b)["runs"]]

    def reexecute_backfill_from_failure(self, backfill_id: str) -> str:
        launched = self.graphql(REEXECUTE_BACKFILL, {"params": {
            "parentRunId": backfill_id, "strategy": "FROM_FAILURE",
        }})["reexecutePartitionBackfill"]
        assert launched["__typename"] == "LaunchBackfillSuccess", launched
        return launched["backfillId"]

    def backfill(self, backfill_id: str) -> dict[str, Any]:
        backfill = self.graphql(BACKFILL, {"id": backfill_id})["partitionBackfillOrError"]
        assert backfill["__typename"] == "PartitionBackfill", backfill
        return backfill

    def wait_for_backfill(self, backfill_id: str, timeout: float = 900) -> dict[str, Any]:
        """Until the backfill is done and none of its runs is still going (retries included)."""

        def probe() -> dict[str, Any] | None:
            backfill = self.backfill(backfill_id)
            done = backfill["status"] in TERMINAL_BACKFILL and all(r["status"] in TERMINAL_RUN for r in backfill["runs"])
            return backfill if done else None

        return wait_for(probe, timeout=timeout, what=f"backfill {backfill_id}", diagnostics=lambda: self.backfill_diagnostics(backfill_id))

    def backfill_diagnostics(self, backfill_id: str) -> str:
        try:
            backfill = self.backfill(backfill_id)
        except Exception as e:  # noqa: BLE001 - diagnostics must not hide the original failure
            return f"backfill {backfill_id}: {e}\n{self.diagnostics()}"
        runs = "\n".join(self.webserver.run_failures(r["runId"]) for r in backfill["runs"])
        return f"backfill: {backfill}\n{runs}\n{self.diagnostics()}"

    def run(self, run_id: str) -> dict[str, Any]:
        """The run: status, tags, start/end time and its events (step keys, metadata, timestamps)."""
        run = self.graphql(RUN_DETAILS, {"runId": run_id})["runOrError"]
        assert run["__typename"] == "Run", run
        run["tags"] = {t["key"]: t["value"] for t in run["tags"]}
        return run

    def materialized(self, asset: str) -> list[str]:
        node = self.graphql(PARTITIONS, {"key": self.key(asset)})["assetNodeOrError"]
        assert node["__typename"] == "AssetNode", node
        return sorted(node["assetPartitionStatuses"]["materializedPartitions"])

    def materializations(self, asset: str) -> list[dict[str, Any]]:
        """Every materialisation of the asset: ``runId``, ``partition``, ``timestamp`` (ms)."""
        node = self.graphql(MATERIALIZATIONS, {"key": self.key(asset)})["assetNodeOrError"]
        assert node["__typename"] == "AssetNode", node
        return node["assetMaterializations"]

    def failed(self, asset: str) -> list[str]:
        node = self.graphql(PARTITIONS, {"key": self.key(asset)})["assetNodeOrError"]
        return sorted(node["assetPartitionStatuses"]["failedPartitions"])

    def points_locked(self) -> contextlib.AbstractContextManager[None]:
        return points_locked(self.server_url, self.tsdb_schema)

    def fetches_waiting(self) -> int:
        return fetches_waiting(self.server_url)

    def restart_code_server(self) -> None:
        """Start the code server again (after :meth:`Service.kill`), as a service manager would on a
        rebooted host, and wait until it answers."""
        code_server = self.services["code_server"]
        code_server.start()
        port = int(self.env["AML_CODE_SERVER_PORT"])
        wait_for(lambda: _code_server_ready(port), timeout=LOAD_TIMEOUT, what="the code server, started again",
                 diagnostics=code_server.diagnostics)

    def launch_job(self, job: str) -> str:
        launched = self.graphql(LAUNCH_RUN, {"params": {"selector": {**self.repository, "jobName": job}}})["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        return launched["run"]["runId"]


def raw_step_process(d: Deployment, backfill_ids: Sequence[str], first_run: str, spared: set[str]) -> tuple[str, int] | None:
    """(Dagster run, pid) of the raw step of the chunk starting at ``first_run``, once it waits
    inside its fetch; runs in ``spared`` are skipped (already killed)."""
    started = []
    for r in d.chunk_runs(backfill_ids):
        if r["runId"] in spared:
            continue
        run = d.run(r["runId"])
        for e in run["eventConnection"]["events"]:
            if e["__typename"] == "StepWorkerStartedEvent" and (e.get("stepKey") or "").endswith("run_stages"):
                pid = {m["label"]: m.get("text") for m in e["metadataEntries"]}["pid"]
                started.append((run, int(pid)))
    ours = [(run["runId"], pid) for run, pid in started if run["tags"][RANGE_START] == first_run]
    # Every raw step that has started is inside its fetch, waiting for the lock.
    if ours and d.fetches_waiting() >= len(started):
        return ours[0]
    return None


@contextlib.contextmanager
def points_locked(server_url: str, schema: str) -> Iterator[None]:
    """Hold an exclusive lock on the points table of the TSDB in ``schema``: every fetch waits
    inside its query, so a step that reads points cannot finish until the block ends (nothing in
    the product is changed for the test; a slow database looks the same)."""
    con = psycopg.connect(server_url)
    try:
        con.execute(sql.SQL("LOCK TABLE {}.points IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(schema)))
        yield
    finally:
        con.rollback()
        con.close()


def fetches_waiting(server_url: str) -> int:
    """Queries of the pipeline waiting for a lock in the database of ``server_url`` (the TSDB's)."""
    with psycopg.connect(server_url, autocommit=True) as con:
        row = con.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'aml_pipeline' AND wait_event_type = 'Lock'"
        ).fetchone()
    return int(row[0]) if row else 0


def pg_env(url: str) -> dict[str, str]:
    u = urlsplit(url)
    return {
        "DAGSTER_PG_HOST": u.hostname or "127.0.0.1",
        "DAGSTER_PG_PORT": str(u.port or 5432),
        "DAGSTER_PG_USER": u.username or "postgres",
        "DAGSTER_PG_PASSWORD": u.password or "",
    }


def production_home(root: Path, instance_settings: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    """``root/dagster_home`` holding deploy/dagster.yaml, as ``$DAGSTER_HOME`` on a deployment's hosts.

    ``instance_settings`` replaces single settings of it, section by section (a test that waits
    for a timeout shortens it); everything else is used verbatim."""
    home = root / "dagster_home"
    home.mkdir()
    shutil.copy(DEPLOY / "dagster.yaml", home / "dagster.yaml")
    if instance_settings:
        instance_yaml = yaml.safe_load((home / "dagster.yaml").read_text())
        for section, settings in instance_settings.items():
            assert section in instance_yaml, f"deploy/dagster.yaml has no {section!r} section"
            instance_yaml[section].update(settings)
        (home / "dagster.yaml").write_text(yaml.safe_dump(instance_yaml, sort_keys=False))
    return home


def instance_env(connect_url: str, db_name: str, max_concurrent_runs: int) -> dict[str, str]:
    """What deploy/dagster.yaml reads from the environment: the instance database ``db_name``
    reached at ``connect_url``'s host and port (the server, or a pooler in front of it)."""
    return {**pg_env(connect_url), "DAGSTER_PG_DB": db_name, "AML_MAX_CONCURRENT_RUNS": str(max_concurrent_runs)}


@contextlib.contextmanager
def database(server_url: str) -> Iterator[str]:
    """A new, empty database on the server; its name. Dropped at the end (connections and all)."""
    name = f"dagster_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as con:
        con.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(server_url, autocommit=True) as con:
            con.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def redis_server_binary() -> str:
    found = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None)
    if not found:
        # Never skip: a missing broker is a set-up error (scripts/test.sh installs it).
        pytest.fail("no redis-server on PATH; run scripts/test.sh (it installs Debian's redis-server)")
    return found


def _redis_ready(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        return bool(client.ping())
    finally:
        client.close()


def workers_answering(broker_url: str) -> set[str]:
    """Names of the Celery workers that answer a ping through the broker."""
    from celery import Celery

    app = Celery(broker=broker_url)
    try:
        replies = app.control.ping(timeout=2.0) or []
    finally:
        app.close()
    return {name for reply in replies for name in reply}


REEXECUTE_BACKFILL = """
mutation Reexecute($params: ReexecutionParams!) {
  reexecutePartitionBackfill(reexecutionParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on Error { message }
    ... on PythonError { stack }
  }
}
"""

RUN_DETAILS = """
query RunDetails($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run {
      runId
      status
      startTime
      endTime
      tags { key value }
      eventConnection(limit: 20000) {
        events {
          __typename
          ... on MessageEvent { message stepKey timestamp eventType }
          ... on DisplayableEvent { metadataEntries { label ... on TextMetadataEntry { text } } }
          ... on MaterializationEvent { assetKey { path } partition }
        }
      }
    }
    ... on RunNotFoundError { message }
    ... on PythonError { message stack }
  }
}
"""

def _code_server_ready(port: int) -> bool:
    check = subprocess.run(
        [BIN / "dagster", "api", "grpc-health-check", "-h", "127.0.0.1", "-p", str(port)],
        capture_output=True, timeout=60,
    )
    return check.returncode == 0


MATERIALIZATIONS = """
query Materializations($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    __typename
    ... on AssetNode { assetMaterializations(limit: 10000) { runId partition timestamp } }
  }
}
"""

DAEMON_HEALTH = """
query DaemonHealth {
  instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } }
}
"""


def _daemons_healthy(server: Service) -> bool:
    statuses = server.graphql(DAEMON_HEALTH, timeout=30)["instance"]["daemonHealth"]["allDaemonStatuses"]
    wanted = {"BACKFILL", "QUEUED_RUN_COORDINATOR", "MONITORING", "SENSOR"}
    healthy = {s["daemonType"] for s in statuses if s["healthy"]}
    return wanted <= healthy


@contextlib.contextmanager
def deployment(
    root: Path,
    postgres_url: str,
    *,
    seeded_runs: int,
    runs_per_chunk: int,
    max_concurrent_runs: int,
    tsdb_pool_limit: int,
    workers: int = 0,
    extra_env: Mapping[str, str] | None = None,
    instance_settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> Iterator[Deployment]:
    """Start the deployment described in the module docstring; stop and remove it on exit.
    ``instance_settings``: as :func:`production_home` takes them."""
    home, specs, logs = (root / n for n in ("aml", "specs", "logs"))
    for d in (home, specs, logs):
        d.mkdir(parents=True)
    shutil.copy(DEMO_SPEC, specs / DEMO_SPEC.name)
    dagster_home = production_home(root, instance_settings)
    spec = load_spec(specs / DEMO_SPEC.name)

    with contextlib.ExitStack() as stack:
        schema = f"t_{uuid.uuid4().hex[:16]}"
        tsdb_url = with_schema(postgres_url, schema)
        stack.callback(drop_schema, postgres_url, schema)
        assert seed_demo(tsdb_url, runs=seeded_runs).written > 0
        with open_tsdb(tsdb_url) as db:
            finished = [r.run_id for r in db.list_runs(run_scope(spec), finished_only=True)]
        db_name = stack.enter_context(database(postgres_url))

        code_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "AML_", "PG"))}
        env.update(
            pg_env(postgres_url),
            DAGSTER_PG_DB=db_name,
            DAGSTER_HOME=str(dagster_home),
            AML_MAX_CONCURRENT_RUNS=str(max_concurrent_runs),
            AML_TSDB_POOL_LIMIT=str(tsdb_pool_limit),
            AML_CODE_SERVER_HOST="127.0.0.1",
            AML_CODE_SERVER_PORT=str(code_port),
            AML_HOME=str(home),
            AML_TSDB_URL=tsdb_url,
            AML_SPECS=str(specs),
            AML_ENV_LOCATION=str(home / "env"),
            AML_BACKFILL_RUNS_PER_CHUNK=str(runs_per_chunk),
            PYTHONUNBUFFERED="1",
            PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        services: dict[str, Service] = {}

        def service(name: str, cmd: Sequence[str], port: int | None = None) -> Service:
            s = Service(name, cmd, env=env, cwd=root, log_dir=logs, port=port)
            services[name] = s
            stack.callback(s.stop)
            s.start()
            return s

        if workers:
            redis_port = free_port()
            broker = f"redis://127.0.0.1:{redis_port}/0"
            service("redis", [
                redis_server_binary(), "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(root), "--protected-mode", "yes",
            ])
            wait_for(lambda: _redis_ready(broker), timeout=60, what="redis-server", diagnostics=services["redis"].diagnostics)
            env.update(AML_EXECUTOR="celery", AML_CELERY_BROKER_URL=broker)
        env.update(extra_env or {})

        init = subprocess.run(
            ["bash", str(DEPLOY / "init-instance.sh")], cwd=root, env=env, capture_output=True, text=True, timeout=600,
        )
        assert init.returncode == 0, f"init-instance.sh failed:\n{init.stdout}\n{init.stderr}"

        service("code_server", [
            sys.executable, "-m", "dagster", "code-server", "start", "-h", "127.0.0.1", "-p", str(code_port),
            "-m", "aml_pipeline.definitions", "--location-name", LOCATION,
        ])
        # As a service manager would: the webserver and the daemon start once the code server answers.
        wait_for(
            lambda: _code_server_ready(code_port), timeout=LOAD_TIMEOUT, what="the code server",
            diagnostics=services["code_server"].diagnostics,
        )
        web = service("webserver", [
            BIN / "dagster-webserver", "-w", DEPLOY / "workspace.yaml", "-h", "127.0.0.1", "-p", str(port := free_port()),
        ], port=port)
        service("daemon", [BIN / "dagster-daemon", "run", "-w", DEPLOY / "workspace.yaml"])
        started_workers = [
            service(f"worker{i}", [
                BIN / "celery", "-A", "aml_pipeline.workers", "worker", "-Q", "dagster", "-n", f"worker{i}@%h",
                "--concurrency", "1", "--loglevel", "INFO",
            ])
            for i in range(1, workers + 1)
        ]
        deployment = Deployment(
            root=root, env=env, spec=spec, server_url=postgres_url, tsdb_schema=schema, tsdb_url=tsdb_url,
            finished=finished, webserver=web,
            services=services, workers=started_workers,
        )
        web.wait_for_graphql(LOAD_TIMEOUT)
        location = web.wait_for_location(LOAD_TIMEOUT)
        deployment.repository = {"repositoryLocationName": location["name"], "repositoryName": location["repositories"][0]}
        wait_for(lambda: _daemons_healthy(web), timeout=LOAD_TIMEOUT, what="the daemons", diagnostics=deployment.diagnostics)
        if workers:
            wanted = {f"worker{i}" for i in range(1, workers + 1)}
            wait_for(
                lambda: wanted <= {w.split("@")[0] for w in workers_answering(env["AML_CELERY_BROKER_URL"])},
                timeout=LOAD_TIMEOUT, what=f"{workers} Celery workers", diagnostics=deployment.diagnostics,
            )
        yield deployment
