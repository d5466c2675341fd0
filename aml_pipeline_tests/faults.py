"""Killing a process at a named crash point (``aml_pipeline.faults``) and proving where it was.

``armed(point, tmp)`` gives the environment that makes a child stop itself at ``point``;
``wait_stopped`` waits (polling, with a deadline) until the child is stopped there: the marker
file names the point and the pid, and the kernel reports that pid as stopped (state ``T``).
``kill_stopped`` then SIGKILLs it; the kill lands at the point and nowhere else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

from aml_pipeline.faults import CRASH_AT_ENV, MARKER_ENV, POINTS, TRACE_ENV

STOP_TIMEOUT_S = 300.0


def armed(point: str, tmp: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) plus what stops a child at ``point``."""
    assert point.split(":")[0] in POINTS, point
    marker = tmp / f"crash-{point.replace(':', '_')}.marker"
    marker.unlink(missing_ok=True)
    return {**(os.environ if env is None else env), CRASH_AT_ENV: point, MARKER_ENV: str(marker)}


def process_state(pid: int) -> str | None:
    """``T`` once every thread of ``pid`` is stopped, else the kernel's one-letter state of a
    thread that is not; None once the process is gone."""
    states = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            states.append(Path(task, "stat").read_text().rsplit(")", 1)[1].split()[0])
    except OSError:
        return None
    running = [s for s in states if s != "T"]
    return running[0] if running else ("T" if states else None)


def wait_stopped(proc: subprocess.Popen, env: Mapping[str, str], *, timeout: float = STOP_TIMEOUT_S,
                 output: Callable[[], str] | None = None) -> int:
    """The pid (``proc`` or a process it started) stopped at the armed point; fails if ``proc``
    ends first or nothing stops there within ``timeout`` seconds."""
    point = env[CRASH_AT_ENV].split(":")[0]
    marker = Path(env[MARKER_ENV])
    deadline = time.monotonic() + timeout
    while True:
        if marker.exists():
            for line in marker.read_text().splitlines():
                name, _, pid = line.partition(" ")
                if name == point and pid.strip().isdigit() and process_state(int(pid)) == "T":
                    return int(pid)
        if proc.poll() is not None:
            detail = output() if output else ""
            raise AssertionError(f"the process ended (exit {proc.returncode}) without stopping at {point}: {detail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing stopped at {point} within {timeout:g} s")
        time.sleep(0.01)


def kill_stopped(pid: int, proc: subprocess.Popen | None = None) -> None:
    """SIGKILL ``pid``, stopped at its crash point (asserted), and reap ``proc``."""
    assert process_state(pid) == "T", f"process {pid} is not stopped at a crash point"
    os.kill(pid, signal.SIGKILL)
    if proc is not None:
        proc.wait(timeout=60)
        if proc.pid == pid:
            assert proc.returncode == -signal.SIGKILL


def traced(tmp: Path, name: str, env: Mapping[str, str] | None = None) -> tuple[dict[str, str], Path]:
    """``env`` plus a fault trace file (every crash point reached, one line each), and the file."""
    trace = tmp / f"{name}.trace"
    trace.unlink(missing_ok=True)
    return {**(os.environ if env is None else env), TRACE_ENV: str(trace)}, trace


def last_point(trace: Path, pid: int, *, since: str | None = None) -> str | None:
    """The last crash point process ``pid`` reached (after its last ``since`` line, if given)."""
    if not trace.exists():
        return None
    last = None
    for line in trace.read_text().splitlines():
        name, _, who = line.rpartition(" ")
        if not who.isdigit() or int(who) != pid:
            continue
        last = None if name == since else name
    return last


def count_phases(phases: list[str]) -> dict[str, int]:
    return dict(sorted(Counter(phases).items()))
