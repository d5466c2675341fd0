"""Stress: worker processes race for read/exclusive leases while the test SIGKILLs some of them.

Each worker appends ``acquire|release|busy MODE PID MONOTONIC_NS`` lines to one O_APPEND log
(one ``write`` per line): ``acquire`` right *after* the lease is granted, ``release`` right
*before* it is released, so every logged interval lies inside the real holding interval. A
killed worker's open interval ends at the kill time the test recorded just before sending
SIGKILL (its real release comes later, so again the logged interval is inside the real one).
Replaying the log, no exclusive interval may overlap any other interval: any overlap found is a
real violation, never an artefact of logging. CLOCK_MONOTONIC is system-wide, so timestamps of
different processes compare.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from aml_pipeline.lease import open_lease

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKERS = 8
DURATION_S = 6.0
RELEASE_GRACE = {"file": 0.0, "postgres": 3.0}

WORKER = r"""
import json, os, random, sys, time
from aml_pipeline.lease import EnvBusy, open_lease
a = json.loads(sys.argv[1])
lease = open_lease(a["location"], name=a["name"])
rng = random.Random(a["seed"])
fd = os.open(a["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
pid = os.getpid()
def log(event, mode):
    os.write(fd, f"{event} {mode} {pid} {time.monotonic_ns()}\n".encode())
while time.monotonic_ns() < a["until_ns"]:
    mode = "exclusive" if rng.random() < 0.35 else "read"
    wait_s = rng.choice((0, 0, 0.05) if mode == "read" else (0, 0.05, 0.2))
    try:
        with lease.acquire(mode, f"w{a['slot']}_{mode}", wait_s=wait_s):
            log("acquire", mode)
            time.sleep(rng.uniform(0, 0.015 if mode == "read" else 0.005))
            log("release", mode)
    except EnvBusy:
        log("busy", mode)
    time.sleep(rng.uniform(0, 0.03))
"""


@dataclass
class Interval:
    mode: str
    pid: int
    start: int
    end: int
    killed: bool = False


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _holding_pids(log: Path) -> set[int]:
    """Workers whose last logged event is an acquire (they hold a lease right now)."""
    last: dict[int, str] = {}
    for line in log.read_text().splitlines():
        event, _mode, pid, _ns = line.split()
        last[int(pid)] = event
    return {pid for pid, event in last.items() if event == "acquire"}


def replay(log_text: str, kills: dict[int, int]) -> tuple[list[Interval], int]:
    """Intervals from the log; a killed worker's unreleased interval ends at its kill time."""
    intervals: list[Interval] = []
    open_: dict[int, tuple[str, int]] = {}
    busy = 0
    for line in log_text.splitlines():
        event, mode, pid_s, ns_s = line.split()
        pid, ns = int(pid_s), int(ns_s)
        if event == "busy":
            busy += 1
        elif event == "acquire":
            assert pid not in open_, f"pid {pid} acquired twice without release"
            open_[pid] = (mode, ns)
        elif event == "release":
            start_mode, start = open_.pop(pid)
            assert start_mode == mode and start <= ns
            intervals.append(Interval(mode, pid, start, ns))
        else:
            raise AssertionError(f"bad log line {line!r}")
    for pid, (mode, start) in open_.items():
        assert pid in kills, f"worker {pid} ended holding a {mode} lease without being killed"
        intervals.append(Interval(mode, pid, start, max(start, kills[pid]), killed=True))
    return intervals, busy


def check_invariant(intervals: list[Interval]) -> int:
    """Sweep the intervals; fail on any overlap with an exclusive one. Returns max readers."""
    # At equal timestamps ends go first: touching intervals do not overlap.
    events = sorted(
        [(iv.start, 1, iv) for iv in intervals] + [(iv.end, 0, iv) for iv in intervals],
        key=lambda e: (e[0], e[1]),
    )
    readers: set[int] = set()
    exclusive: Interval | None = None
    max_readers = 0
    for _t, is_start, iv in events:
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


def test_replay_catches_an_overlap():
    # The checker itself must see a violation (including one through a killed reader).
    log = "acquire read 1 100\nacquire exclusive 2 150\nrelease exclusive 2 160\n"
    intervals, _ = replay(log, kills={1: 200})
    with pytest.raises(AssertionError, match="overlaps"):
        check_invariant(intervals)
    ok = "acquire read 1 100\nrelease read 1 150\nacquire exclusive 2 150\nrelease exclusive 2 160\n"
    assert check_invariant(replay(ok, kills={})[0]) == 1


@pytest.mark.parametrize("backend", ["file", "postgres"])
def test_stress_no_exclusive_overlaps_any_holder(backend, tmp_path, request):
    if backend == "file":
        location, name = str(tmp_path / "env-lease"), "aml-shared-env"
    else:
        location, name = request.getfixturevalue("postgres_url"), f"stress-{uuid.uuid4().hex[:12]}"
    lease = open_lease(location, name=name)
    log = tmp_path / "events.log"
    log.touch()
    rng = random.Random(f"stress-{backend}")
    until_ns = time.monotonic_ns() + int(DURATION_S * 1e9)
    grace = RELEASE_GRACE[backend]

    workers: dict[int, subprocess.Popen] = {}
    spawned: list[int] = []

    def spawn(slot: int) -> None:
        args = {"location": location, "name": name, "log": str(log), "slot": slot,
                "seed": rng.random(), "until_ns": until_ns}
        proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(args)],
                                env=_env(), cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
        workers[proc.pid] = proc
        spawned.append(proc.pid)

    kills: dict[int, int] = {}
    killed_holding = 0
    try:
        for slot in range(WORKERS):
            spawn(slot)
        slot = WORKERS
        while time.monotonic_ns() < until_ns - int(0.7e9):
            time.sleep(rng.uniform(0.1, 0.35))
            alive = [pid for pid, p in workers.items() if p.poll() is None]
            holding = sorted(_holding_pids(log) & set(alive))
            pool = holding if holding and rng.random() < 0.7 else alive
            if not pool:
                continue
            victim = rng.choice(pool)
            kills[victim] = time.monotonic_ns()
            os.kill(victim, signal.SIGKILL)
            workers[victim].wait(timeout=30)
            if victim in holding:
                killed_holding += 1
            # The dead worker is never listed (PostgreSQL: once the server saw the session end).
            deadline = time.monotonic() + grace
            while True:
                st = lease.status()
                listed = {r.pid for r in st.reader_leases} | (
                    {st.exclusive.pid} if st.exclusive else set())
                if victim not in listed:
                    break
                assert time.monotonic() < deadline, f"dead worker {victim} still listed: {st}"
                time.sleep(0.02)
            spawn(slot)
            slot += 1
        for proc in workers.values():
            proc.wait(timeout=60)
    finally:
        for pid, proc in workers.items():
            if proc.poll() is None:
                os.kill(pid, signal.SIGKILL)
                proc.wait()

    for pid, proc in workers.items():
        if pid not in kills:
            assert proc.returncode == 0, f"worker {pid} failed with exit {proc.returncode}"
    assert len(set(spawned)) == len(spawned)

    intervals, busy = replay(log.read_text(), kills)
    max_readers = check_invariant(intervals)
    n_read = sum(iv.mode == "read" for iv in intervals)
    n_excl = sum(iv.mode == "exclusive" for iv in intervals)
    summary = (f"{backend}: {n_read} reads, {n_excl} exclusives, {busy} refused, "
               f"max {max_readers} concurrent readers, {len(kills)} kills "
               f"({killed_holding} while holding)")
    print(summary)
    # The run exercised what it claims to.
    assert n_read >= 20 and n_excl >= 5 and busy >= 5, summary
    assert max_readers >= 2, summary
    assert len(kills) >= 5 and killed_holding >= 1, summary

    # Nothing is left behind: the lease is free at once (PostgreSQL: within the grace).
    with lease.exclusive("final_check", wait_s=grace):
        st = lease.status()
        assert st.readers == 0 and st.exclusive.holder == "final_check"
    assert lease.status().idle
