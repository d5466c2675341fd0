"""Lease holders as real processes, for the lease tests (see ``test_lease.py``)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from aml_pipeline.lease import LeaseStatus, open_lease
from aml_pipeline.lease.base import short_host

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()

# How long a killed holder's lock may linger. flock: none (the kernel drops it before the
# holder can be reaped). PostgreSQL: the server ends the session when it sees the socket close,
# a few milliseconds after the client died; the tests wait up to GRACE.
RELEASE_GRACE = {"file": 0.0, "postgres": 3.0}

# A holder process: takes one lease, reports on stdout, then waits for "release" on stdin (or
# its SIGKILL). With "fork", it first forks a grandchild that just sleeps: the grandchild must
# not keep the lease alive once its parent is dead. (Between fork() and the child's at-fork
# handler there is an instant when the child still has the descriptors; the grandchild reports
# only after that, so the test does not kill its parent inside that instant.) With "log", it
# records its request, grant, release or refusal in that event log (``eventlog.py``).
CHILD = r"""
import json, os, sys, time
from aml_pipeline.lease import EnvBusy, open_lease
a = json.loads(sys.argv[1])
lease = open_lease(a["location"], name=a["name"])
log = None
if a.get("log"):
    from aml_pipeline_tests.lease.eventlog import EventLog
    log = EventLog(a["log"])
def say(*words):
    sys.stdout.write(" ".join(str(w) for w in words) + "\n"); sys.stdout.flush()
try:
    log and log.request(a["mode"])
    handle = lease.acquire(a["mode"], a["holder"], wait_s=a["wait_s"])
except EnvBusy as exc:
    log and log.busy(a["mode"], exc)
    say("BUSY", exc.one_line()); sys.exit(0)
log and log.acquire(a["mode"])
say("ACQUIRED", os.getpid(), handle.since)
if a.get("fork"):
    if os.fork() == 0:
        # os.fork() returns here after the at-fork handlers ran: the report comes after them.
        say("GRANDCHILD", os.getpid())
        time.sleep(120); os._exit(0)
if sys.stdin.readline().strip() == "release":
    log and log.release(a["mode"])
    handle.release()
    say("RELEASED")
"""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def start_worker(location: str, name: str, **args) -> subprocess.Popen:
    """A process running ``eventlog.WORKER`` (leases in a loop, logged) with ``args``."""
    from aml_pipeline_tests.lease.eventlog import WORKER

    args = {"location": location, "name": name, **args}
    return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(args)],
                            env=child_env(), cwd=REPO_ROOT, stdin=subprocess.DEVNULL)


class Holder:
    """A holder process with one lease; ``line()`` reads its reports with a timeout."""

    def __init__(self, where, mode: str, holder: str, *, wait_s: float = 0, fork: bool = False,
                 log: str | None = None, script: str = CHILD):
        args = {"location": where.location, "name": where.name, "mode": mode,
                "holder": holder, "wait_s": wait_s, "fork": fork, "log": log}
        self.holder = holder
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(), cwd=REPO_ROOT,
        )
        self.pid = self.proc.pid
        self._buf = b""

    def line(self, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"holder {self.holder} said nothing for {timeout}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise AssertionError(f"holder {self.holder} exited: {self.proc.wait()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def acquired(self) -> float:
        words = self.line().split(" ", 2)
        assert words[0] == "ACQUIRED", f"{self.holder}: {' '.join(words)}"
        assert int(words[1]) == self.pid
        return float(words[2])

    def release(self) -> None:
        self.proc.stdin.write(b"release\n")
        self.proc.stdin.flush()
        assert self.line() == "RELEASED"
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class Where:
    def __init__(self, backend: str, location: str, name: str):
        self.backend, self.location, self.name = backend, location, name
        self.grace = RELEASE_GRACE[backend]
        # The PostgreSQL backend keeps a short host label (application_name has 63 bytes).
        self.host = HOST if backend == "file" else short_host(HOST)

    def lease(self):
        return open_lease(self.location, name=self.name)


def spawn(holders, where, mode, holder, **kw) -> Holder:
    h = Holder(where, mode, holder, **kw)
    holders.append(h)
    return h


def live_pids(status: LeaseStatus) -> set[int]:
    pids = {r.pid for r in status.reader_leases}
    if status.exclusive is not None:
        pids.add(status.exclusive.pid)
    return pids
