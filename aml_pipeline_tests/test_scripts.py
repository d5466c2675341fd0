"""The scripts as a user runs them: ui.sh stops cleanly on SIGTERM and Ctrl-C, setup.sh replaces
a .venv made with an unsupported Python and says what it does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from aml_pipeline.config import REPO_ROOT

# Generous bounds, only so that a broken script fails the test instead of hanging it; ui.sh
# itself gives Dagster STOP_TIMEOUT_S to stop, then terminates what is left.
START_DEADLINE_S = 300
STOP_DEADLINE_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_processes(sid: int) -> dict[int, str]:
    """Live (not zombie) processes of a session, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
            if int(fields[3]) == sid and fields[0] != "Z":
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except (OSError, ValueError):
            continue
    return found


def start_ui(tmp_path: Path, *, ignore_sigint: bool = False, stop_timeout_s: int = 30):
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "DAGSTER_", "VIRTUAL_ENV"))}
    env.update(DAGSTER_HOME=str(home), AML_HOME=str(tmp_path / "aml"), PORT=str(port), STOP_TIMEOUT_S=str(stop_timeout_s))
    log = open(tmp_path / "ui.log", "w+")

    def as_from_a_terminal() -> None:
        # The dispositions a shell gives a command, not this process's: Dagster, run in this
        # process by earlier tests, points SIGTERM at SIGINT's handler, which is "ignore" when
        # pytest itself runs as a background job. A script cannot trap a signal ignored on entry.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)

    proc = subprocess.Popen(
        [str(REPO_ROOT / "scripts" / "ui.sh")], stdout=log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True,  # its own session: every process it starts can be found and cleaned up
        preexec_fn=as_from_a_terminal,
    )
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_all(proc)
            pytest.fail(f"the webserver did not answer on port {port}:\n{read(log)}")
        time.sleep(0.5)
    proc.port = port
    return proc, log


def read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def stop_all(proc: subprocess.Popen) -> None:
    for pid in session_processes(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_all_gone(proc: subprocess.Popen, log) -> float:
    started = time.monotonic()
    while session_processes(proc.pid) and time.monotonic() - started < STOP_DEADLINE_S:
        time.sleep(0.1)
    left = session_processes(proc.pid)
    if left:
        stop_all(proc)
        pytest.fail(f"still running {STOP_DEADLINE_S} s after the signal: {left}\n{read(log)}")
    assert proc.wait(timeout=10) == 0, read(log)
    return time.monotonic() - started


WORKSPACE_QUERY = """{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus
  locationOrLoadError { __typename ... on RepositoryLocation { repositories {
    jobs { name } schedules { name scheduleState { status } } } } ... on PythonError { message } } } } } }"""


def loaded_location(port: int) -> dict:
    """The code location ``dg dev`` serves, once it has loaded (or failed to)."""
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": WORKSPACE_QUERY}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            entries = json.load(r)["data"]["workspaceOrError"]["locationEntries"]
        if (entries and entries[0]["loadStatus"] == "LOADED") or time.monotonic() > deadline:
            return entries[0]
        time.sleep(1)


@pytest.mark.parametrize("ignore_sigint", [False, True], ids=["foreground", "started-with-sigint-ignored"])
def test_ui_stops_cleanly_on_sigterm(tmp_path, ignore_sigint):
    proc, log = start_ui(tmp_path, ignore_sigint=ignore_sigint)
    # What `dg dev` serves: the project's code location, with its jobs and schedules. The UI is
    # stopped once that has loaded, as a person stops it: a code server signalled while it still
    # starts can outlive `dg dev` until its heartbeat times out, which is the lingering case
    # ui.sh ends itself (the next test).
    location = loaded_location(proc.port)
    assert location["name"] == "aml_pipeline", location
    [repo] = location["locationOrLoadError"]["repositories"]
    assert {"observe_tsdb", "reactor_a__rebuild"} <= {j["name"] for j in repo["jobs"]}, repo
    states = {s["name"]: s["scheduleState"]["status"] for s in repo["schedules"]}
    assert states["observe_tsdb_schedule"] == "RUNNING", states
    children = session_processes(proc.pid)
    assert any("dg dev" in c for c in children.values()), children
    assert any("dagster_webserver" in c for c in children.values()), children
    os.kill(proc.pid, signal.SIGTERM)
    wait_all_gone(proc, log)
    out = read(log)
    # Dagster shut its services down itself, nothing had to be killed
    assert "Dagster services shut down." in out and "ui.sh: stopped" in out, out
    assert "terminating its processes" not in out
    assert "superseded" not in out  # `dg dev`, not the deprecated `dagster dev`


def test_ui_stops_on_ctrl_c_even_when_dagster_lingers(tmp_path):
    """Ctrl-C reaches the terminal's foreground process group: the script's. With no time allowed
    for a graceful stop, what is left is terminated."""
    proc, log = start_ui(tmp_path, stop_timeout_s=0)
    os.killpg(proc.pid, signal.SIGINT)
    wait_all_gone(proc, log)
    out = read(log)
    assert "ui.sh: stopping Dagster" in out and "terminating its processes" in out and "ui.sh: stopped" in out, out


def other_python() -> str | None:
    """An interpreter that is neither 3.11 nor 3.12, if this machine has one."""
    names = ["python3.13", "python3.10", "python3.9", "python3.14"]
    roots = [Path("/usr/bin"), Path("/usr/local/bin"), *sorted(Path.home().glob(".pyenv/versions/*/bin"))]
    for root in roots:
        for name in names:
            path = root / name
            if path.is_file() and os.access(path, os.X_OK):
                ok = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
                if ok.returncode == 0 and ok.stdout.strip() not in ("(3, 11)", "(3, 12)"):
                    return str(path)
    return None


def test_setup_replaces_a_venv_of_an_unsupported_python_and_says_so(tmp_path):
    repo = tmp_path / "repo"
    for name in ("scripts", "requirements", "aml_pipeline"):
        shutil.copytree(REPO_ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, repo / name)
    foreign = other_python()
    if foreign:
        subprocess.run([foreign, "-m", "venv", "--without-pip", str(repo / ".venv")], check=True)
    else:  # a broken venv takes the same path
        (repo / ".venv" / "bin").mkdir(parents=True)
        (repo / ".venv" / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
        (repo / ".venv" / "bin" / "python").chmod(0o755)
    # Offline with no packages: the install fails fast, after the parts under test.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(PYTHON=sys.executable if sys.version_info[:2] in ((3, 11), (3, 12)) else "python3.11",
               PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "no-wheels"), PIP_CONFIG_FILE=os.devnull)
    proc = subprocess.run([str(repo / "scripts" / "setup.sh")], capture_output=True, text=True, env=env, timeout=600)
    err = proc.stderr
    assert "not 3.11 or 3.12" in err and "replacing it" in err, err
    assert "setup: creating .venv with Python 3.1" in err
    assert "setup: upgrading pip" in err and "setup: installing aml_pipeline" in err
    version = subprocess.run([repo / ".venv" / "bin" / "python", "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True)
    assert version.stdout.strip() in ("(3, 11)", "(3, 12)")
    # the failed install is one clear message with pip's own last lines, and no stamp
    assert proc.returncode == 1 and "setup: pip failed; the last lines of .venv/setup.log" in err, err
    assert not list((repo / ".venv").glob(".installed-*"))
