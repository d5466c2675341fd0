"""A real ``dagster dev`` (webserver + daemon + code server) on loopback, for the tests.

:class:`DagsterDev` starts ``python -m dagster dev -m <module> -h 127.0.0.1 -p <free port>`` in its
own session (process group), with its output in a log file, and talks to the webserver's GraphQL
API with plain HTTP. :meth:`DagsterDev.stop` ends the whole process tree: SIGTERM to the group
(``dagster dev`` shuts its children down), SIGKILL to whatever is left, and — because a child could
have moved to a session of its own — SIGKILL to any process still carrying this server's marker
in its environment (Linux ``/proc``).

Everything waits by polling with generous deadlines, never by fixed sleeps: the machine running
the tests may be small and busy.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import requests
import yaml

from aml_pipeline import config
from aml_pipeline_tests.pg_server import free_port

T = TypeVar("T")

MARKER_ENV = "AML_TEST_DAGSTER_SERVER"
TERMINAL_RUN_STATUSES = frozenset({"SUCCESS", "FAILURE", "CANCELED"})
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class DagsterServerError(RuntimeError):
    pass


def wait_for(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.5,
    max_interval: float = 2.0,
    diagnostics: Callable[[], str] | None = None,
) -> T:
    """Call ``probe`` until it returns something other than None (or False); fail after ``timeout`` s.

    The interval grows to ``max_interval`` so a long wait does not hammer a busy server (equal to
    ``interval`` for a steady poll, where the moment matters).
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = probe()
        except DagsterServerError:
            raise
        except Exception as e:  # noqa: BLE001 - keep polling; report the last error on timeout
            last_error, value = e, None
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            detail = f"; last error: {type(last_error).__name__}: {last_error}" if last_error else ""
            extra = f"\n{diagnostics()}" if diagnostics else ""
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{detail}{extra}")
        time.sleep(interval)
        interval = min(interval * 1.5, max_interval)


def write_instance_yaml(dagster_home: Path, template: Path | None = None) -> Path:
    """``dagster_home/dagster.yaml``: the repository's instance settings (concurrency pools, ...)
    with every storage directory moved under ``dagster_home`` (absolute) and telemetry off."""
    template = template or config.REPO_ROOT / "dagster.yaml"
    settings: dict[str, Any] = (yaml.safe_load(template.read_text()) or {}) if template.exists() else {}
    storage_root = dagster_home / "storage"
    if "storage" in settings:
        settings["storage"] = {"sqlite": {"base_dir": str(storage_root)}}
    for section, sub in (("local_artifact_storage", "artifacts"), ("compute_logs", "logs")):
        cfg = (settings.get(section) or {}).get("config")
        if isinstance(cfg, dict) and "base_dir" in cfg:
            cfg["base_dir"] = str(dagster_home / sub)
    settings["telemetry"] = {"enabled": False}
    dagster_home.mkdir(parents=True, exist_ok=True)
    path = dagster_home / "dagster.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


class DagsterDev:
    """One ``dagster dev`` process tree and a GraphQL client for its webserver."""

    def __init__(
        self,
        *,
        module: str,
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path,
        port: int | None = None,
        python: str = sys.executable,
    ) -> None:
        self.module = module
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cwd = cwd
        self.marker = uuid.uuid4().hex
        self.env = {**env, MARKER_ENV: self.marker}
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        # {"repositoryLocationName", "repositoryName"} of the loaded location (set by the caller).
        self.repository: dict[str, str] | None = None
        self._session = requests.Session()
        self._session.trust_env = False  # never send loopback requests through a proxy

    # ---- process ---------------------------------------------------------------------------

    def start(self) -> None:
        cmd = [
            self.python, "-m", "dagster", "dev",
            "-m", self.module, "-h", "127.0.0.1", "-p", str(self.port),
            "--log-level", "info", "--log-format", "colored",
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no dagster dev log: {e})"
        return "\n".join(_ANSI.sub("", line) for line in text.splitlines()[-lines:])

    def diagnostics(self) -> str:
        state = "not started" if self.proc is None else (
            "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
        )
        return f"--- dagster dev ({state}), last lines of {self.log_path} ---\n{self.log_tail()}"

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise DagsterServerError(f"dagster dev exited with {self.proc.returncode}\n{self.diagnostics()}")

    def stop(self, timeout: float = 60.0) -> None:
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        # dagster dev's children get a moment to follow it out, then whatever is left is killed.
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not self._leftovers(proc.pid) or None, timeout=15, what="children to exit")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in self._leftovers(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        self._session.close()
        self.proc = None

    def _leftovers(self, pgid: int) -> list[int]:
        """Live processes of this server: its process group, or its marker in their environment."""
        found = []
        proc_root = Path("/proc")
        if not proc_root.is_dir():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, 0)
                return [pgid]
            return []
        needle = f"{MARKER_ENV}={self.marker}".encode()
        for entry in proc_root.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            pid = int(entry.name)
            try:
                stat = (entry / "stat").read_text()
                state = stat.rsplit(")", 1)[1].split()[0]
                if state == "Z":
                    continue
                if os.getpgid(pid) == pgid or needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(pid)
            except (OSError, IndexError, ValueError):
                continue
        return found

    # ---- GraphQL ---------------------------------------------------------------------------

    def graphql(self, query: str, variables: Mapping[str, Any] | None = None, *, timeout: float = 120) -> dict[str, Any]:
        """``data`` of a GraphQL request; GraphQL errors raise :class:`DagsterServerError`."""
        self._check_alive()
        response = self._session.post(
            f"{self.url}/graphql", json={"query": query, "variables": dict(variables or {})}, timeout=timeout
        )
        try:
            body = response.json()
        except ValueError:
            response.raise_for_status()
            raise
        if body.get("errors"):
            raise DagsterServerError(f"GraphQL errors: {body['errors']}")
        response.raise_for_status()
        return body["data"]

    def wait_for_graphql(self, timeout: float) -> None:
        """Until the webserver answers a GraphQL query."""
        wait_for(
            lambda: self.graphql("{ version }", timeout=10).get("version"),
            timeout=timeout, what=f"the GraphQL endpoint {self.url}/graphql", diagnostics=self.diagnostics,
        )

    def wait_for_location(self, timeout: float) -> dict[str, Any]:
        """Until a code location is LOADED; its entry (``name``, ``repositories``). A location
        that loaded with an error fails at once with that error."""

        def probe() -> dict[str, Any] | None:
            data = self.graphql(WORKSPACE_QUERY, timeout=30)["workspaceOrError"]
            if data["__typename"] != "Workspace":
                raise DagsterServerError(f"workspaceOrError: {data}")
            for entry in data["locationEntries"]:
                if entry["loadStatus"] != "LOADED":
                    continue
                loc = entry["locationOrLoadError"] or {}
                if loc.get("__typename") == "PythonError":
                    raise DagsterServerError(
                        f"code location {entry['name']!r} failed to load: {loc['message']}\n"
                        + "".join(loc.get("stack") or [])
                        + _causes(loc)
                        + f"\n{self.diagnostics()}"
                    )
                if loc.get("__typename") == "RepositoryLocation":
                    return {"name": loc["name"], "repositories": [r["name"] for r in loc["repositories"]]}
            return None

        return wait_for(probe, timeout=timeout, what="the code location to load", diagnostics=self.diagnostics)

    def wait_for_run(self, run_id: str, timeout: float) -> str:
        """Until the run reaches a terminal status; that status."""

        def probe() -> str | None:
            run = self.graphql(RUN_STATUS_QUERY, {"runId": run_id}, timeout=30)["runOrError"]
            if run["__typename"] != "Run":
                raise DagsterServerError(f"runOrError({run_id}): {run}")
            return run["status"] if run["status"] in TERMINAL_RUN_STATUSES else None

        return wait_for(
            probe, timeout=timeout, what=f"run {run_id} to finish",
            diagnostics=lambda: self.run_failures(run_id) + "\n" + self.diagnostics(),
        )

    def run_failures(self, run_id: str) -> str:
        """The run's status, its failure events and error-level messages, as text (for assertion messages)."""
        try:
            run = self.graphql(RUN_EVENTS_QUERY, {"runId": run_id}, timeout=60)["runOrError"]
        except Exception as e:  # noqa: BLE001 - diagnostics must not hide the original failure
            return f"run {run_id}: could not fetch its events: {e}"
        if run["__typename"] != "Run":
            return f"run {run_id}: {run}"
        out = [f"run {run_id} ({run['jobName']}) status {run['status']}"]
        for ev in run["eventConnection"]["events"]:
            kind = ev["__typename"]
            error = ev.get("error")
            if error or kind in ("ExecutionStepFailureEvent", "RunFailureEvent") or ev.get("level") in ("ERROR", "CRITICAL"):
                out.append(f"  [{kind}] step={ev.get('stepKey')} {ev.get('message', '')}")
                if error:
                    out.append("    " + error["message"] + "".join(error.get("stack") or []) + _causes(error))
        return "\n".join(out)


def _causes(error: Mapping[str, Any]) -> str:
    return "".join(
        f"\ncaused by: {c['message']}" + "".join(c.get("stack") or []) for c in error.get("causes") or []
    )


WORKSPACE_QUERY = """
query Workspace {
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name
        loadStatus
        locationOrLoadError {
          __typename
          ... on RepositoryLocation { name repositories { name } }
          ... on PythonError { message stack causes { message stack } }
        }
      }
    }
    ... on PythonError { message stack }
  }
}
"""

RUN_STATUS_QUERY = """
query RunStatus($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run { runId status }
    ... on RunNotFoundError { message }
    ... on PythonError { message stack }
  }
}
"""

RUN_EVENTS_QUERY = """
query RunEvents($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run {
      runId
      jobName
      status
      eventConnection(limit: 5000) {
        events {
          __typename
          ... on MessageEvent { message level stepKey }
          ... on ErrorEvent { error { message stack causes { message stack } } }
        }
      }
    }
    ... on RunNotFoundError { message }
    ... on PythonError { message stack }
  }
}
"""


@contextlib.contextmanager
def running(server: DagsterDev) -> Iterator[DagsterDev]:
    """Start ``server``; stop its whole process tree on the way out, however the block ends."""
    try:
        server.start()
        yield server
    finally:
        server.stop()
