"""An independent record of what lease holders did, and the checks replayed over it.

Worker processes append one line per event to one O_APPEND file (one ``write`` per line)::

    request MODE PID NS                   just *before* asking for a lease
    acquire MODE PID NS                   right *after* it was granted
    release MODE PID NS                   right *before* it is released
    busy    MODE PID NS WAITER [MESSAGE]  right *after* it was refused; WAITER is the pid of the
                                          rebuild the refusal's status showed waiting, or ``-``

NS is CLOCK_MONOTONIC (system-wide, so the times of different processes compare). Each logged
interval lies inside the real one it stands for: [acquire, release] inside the real hold,
[request, busy] around the moment the refused request read the status. That is what lets the
checks below call anything they find a real violation, never an artefact of logging.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

# A worker: takes leases in a loop until ``until_ns`` (or until the file ``stop``, if given,
# exists), logging every step. ``p_exclusive`` of the
# requests are exclusive (with a wait drawn from ``exclusive_waits``), the rest read leases
# (``read_waits``); holds and gaps are drawn uniformly from the given ranges in seconds.
WORKER = r"""
import json, os, random, sys, time
from aml_pipeline.lease import EnvBusy, open_lease
from aml_pipeline_tests.lease.eventlog import EventLog
a = json.loads(sys.argv[1])
lease = open_lease(a["location"], name=a["name"])
rng = random.Random(a["seed"])
log = EventLog(a["log"])
while time.monotonic_ns() < a["until_ns"] and not os.path.exists(a.get("stop") or ""):
    mode = "exclusive" if rng.random() < a["p_exclusive"] else "read"
    wait_s = rng.choice(a["exclusive_waits"] if mode == "exclusive" else a["read_waits"])
    log.request(mode)
    try:
        with lease.acquire(mode, f"w{a['slot']}_{mode}", wait_s=wait_s):
            log.acquire(mode)
            time.sleep(rng.uniform(*a["hold_s"][mode]))
            log.release(mode)
    except EnvBusy as exc:
        log.busy(mode, exc)
    time.sleep(rng.uniform(*a["gap_s"]))
"""


class EventLog:
    """The writing side, used inside worker processes."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pid = os.getpid()

    def _write(self, event: str, mode: str, extra: str = "") -> None:
        line = f"{event} {mode} {self.pid} {time.monotonic_ns()}{extra}\n"
        os.write(self.fd, line.encode())

    def request(self, mode: str) -> None:
        self._write("request", mode)

    def acquire(self, mode: str) -> None:
        self._write("acquire", mode)

    def release(self, mode: str) -> None:
        self._write("release", mode)

    def busy(self, mode: str, exc) -> None:
        waiting = exc.status.waiting if exc.status is not None else None
        waiter = waiting.pid if waiting is not None and waiting.pid is not None else "-"
        self._write("busy", mode, f" {waiter} {exc.one_line()}")


@dataclass
class Event:
    kind: str
    mode: str
    pid: int
    ns: int
    waiter: int | None = None
    message: str = ""


@dataclass
class Interval:
    mode: str
    pid: int
    start: int
    end: int
    killed: bool = False


@dataclass
class Request:
    """One request of one process: from its ``request`` line to its outcome."""

    mode: str
    pid: int
    start: int
    outcome: str | None = None  # "acquire" | "busy" | None (killed, or still running at the end)
    end: int | None = None  # the outcome's time
    waiter: int | None = None  # refused: the pid its status showed waiting
    observations: list[tuple[int, int]] = field(default_factory=list)  # see check_waiting


def parse(log_text: str) -> list[Event]:
    events = []
    for line in log_text.splitlines():
        parts = line.split(" ", 5)
        if len(parts) < 4 or parts[0] not in ("request", "acquire", "release", "busy"):
            raise AssertionError(f"bad log line {line!r}")
        waiter = int(parts[4]) if len(parts) > 4 and parts[4] != "-" else None
        message = parts[5] if len(parts) > 5 else ""
        events.append(Event(parts[0], parts[1], int(parts[2]), int(parts[3]), waiter, message))
    return events


def replay(events: list[Event], kills: dict[int, int]) -> tuple[list[Interval], int]:
    """Hold intervals from the log; a killed worker's unreleased interval ends at its kill time
    (recorded just before SIGKILL, so before the real release). Also returns the refusals."""
    intervals: list[Interval] = []
    open_: dict[int, tuple[str, int]] = {}
    busy = 0
    for e in events:
        if e.kind == "busy":
            busy += 1
        elif e.kind == "acquire":
            assert e.pid not in open_, f"pid {e.pid} acquired twice without release"
            open_[e.pid] = (e.mode, e.ns)
        elif e.kind == "release":
            start_mode, start = open_.pop(e.pid)
            assert start_mode == e.mode and start <= e.ns
            intervals.append(Interval(e.mode, e.pid, start, e.ns))
    for pid, (mode, start) in open_.items():
        assert pid in kills, f"worker {pid} ended holding a {mode} lease without being killed"
        intervals.append(Interval(mode, pid, start, max(start, kills[pid]), killed=True))
    return intervals, busy


def check_invariant(intervals: list[Interval]) -> int:
    """Sweep the intervals; fail on any overlap with an exclusive one. Returns max readers."""
    # At equal timestamps ends go first: touching intervals do not overlap.
    marks = sorted(
        [(iv.start, 1, iv) for iv in intervals] + [(iv.end, 0, iv) for iv in intervals],
        key=lambda e: (e[0], e[1]),
    )
    readers: set[int] = set()
    exclusive: Interval | None = None
    max_readers = 0
    for _t, is_start, iv in marks:
        key = id(iv)
        if not is_start:
            if iv.mode == "read":
                readers.discard(key)
            elif exclusive is iv:
                exclusive = None
            continue
        assert exclusive is None, f"{iv} overlaps the exclusive {exclusive}"
        if iv.mode == "exclusive":
            assert not readers, f"exclusive {iv} overlaps {len(readers)} reader(s)"
            exclusive = iv
        else:
            readers.add(key)
            max_readers = max(max_readers, len(readers))
    return max_readers


def requests(events: list[Event], kills: dict[int, int]) -> list[Request]:
    """Every request with its outcome; a killed worker's open request ends at its kill time."""
    found: list[Request] = []
    current: dict[int, Request] = {}
    for e in events:
        if e.kind == "request":
            assert e.pid not in current, f"pid {e.pid} made a request inside a request"
            current[e.pid] = Request(e.mode, e.pid, e.ns)
        elif e.kind in ("acquire", "busy") and e.pid in current:
            req = current.pop(e.pid)
            assert req.mode == e.mode, f"pid {e.pid}: {req.mode} request ended as {e}"
            req.outcome, req.end, req.waiter = e.kind, e.ns, e.waiter
            found.append(req)
    for pid, req in current.items():
        req.end = kills.get(pid)  # None: still running when the log was read
        found.append(req)
    return found


def check_waiting(events: list[Event], kills: dict[int, int]) -> tuple[int, int]:
    """No lease is granted while an exclusive request waits (holds the gate).

    A refusal whose status showed W waiting read that status inside the refused request's
    [request, busy] span; if that span lies inside one request R of W, W held the gate for R at
    that moment. R took the gate before the earliest such refusal's ``busy`` (``lo``) and held it
    until after the latest one's ``request``, and from its grant on it holds the lock; so up to
    ``hi`` = max(latest ``request``, R's ``acquire`` if granted) nobody else may be admitted.
    Any other request that started after ``lo`` and logged its ``acquire`` before ``hi`` was
    granted inside [lo, hi]: a real violation. Returns (waiting phases checked, requests made
    inside them that were checked).
    """
    reqs = requests(events, kills)
    by_pid: dict[int, list[Request]] = {}
    for r in reqs:
        by_pid.setdefault(r.pid, []).append(r)
    for r in reqs:
        if r.outcome != "busy" or r.end is None or r.waiter is None or r.waiter == r.pid:
            continue
        for w in by_pid.get(r.waiter, []):
            w_end = w.end if w.end is not None else float("inf")
            if w.mode == "exclusive" and w.start <= r.start and r.end <= w_end:
                w.observations.append((r.start, r.end))
                break
    phases = checked = 0
    for w in reqs:
        if not w.observations:
            continue
        phases += 1
        lo = min(end for _start, end in w.observations)
        hi = max(start for start, _end in w.observations)
        if w.outcome == "acquire":
            hi = max(hi, w.end)
        for other in reqs:
            if other is w or other.start <= lo or other.start >= hi:
                continue
            checked += 1
            if other.outcome != "acquire":
                continue
            assert not other.end < hi, (
                f"{other.mode} lease of pid {other.pid} (requested {other.start}, granted by "
                f"{other.end}) was granted while pid {w.pid} waited for the exclusive lock "
                f"(waiting at {lo}..{hi})"
            )
    return phases, checked
