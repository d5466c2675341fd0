"""A waiting rebuild is not starved: while an exclusive request waits (with its deadline), new
read leases are refused, on both backends, with real processes.

Readers already holding keep their lease; the rebuild gets the lock once they are done; when it
has the lock, gives up at its deadline or is SIGKILLed, readers are admitted again. What was
granted when is checked on an independent event log (``eventlog.py``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from aml_pipeline.lease import EnvBusy, open_lease
from aml_pipeline.lease.pg_lease import (
    _key_parts,
    application_name,
    application_wait,
    parse_application_name,
)
from aml_pipeline_tests.lease.eventlog import check_invariant, check_waiting, parse, replay
from aml_pipeline_tests.lease.support import spawn, start_worker

STREAM_READERS = 4
# Each reader re-takes a read lease at once after holding it 30-80 ms: with four of them, some
# reader holds the lease nearly all the time, which starves an exclusive request without a gate.
STREAM = {
    "p_exclusive": 0.0,
    "exclusive_waits": [0],
    "read_waits": [0],
    "hold_s": {"read": [0.03, 0.08], "exclusive": [0, 0]},
    "gap_s": [0, 0.005],
}
REBUILD_WAIT_S = 20.0
REBUILD_TRIES = 5


def _refused_naming(events, pid: int) -> list:
    """Read requests refused while the exclusive request of ``pid`` waited, naming it."""
    mine = {e.kind: e for e in events if e.pid == pid}
    asked, granted = mine["request"].ns, mine["acquire"].ns
    return [e for e in events if e.kind == "busy" and e.mode == "read" and asked < e.ns < granted and e.waiter == pid]


def wait_for(what, check, timeout: float = 30.0, every: float = 0.01):
    """Poll ``check()`` until it returns something true (the test's own patience, not a figure)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(every)


def waiting_pid(lease):
    st = lease.status()
    return st.waiting.pid if st.waiting is not None else None


def _waiting_phrase(holder: str, pid: int, host: str) -> str:
    return f"a rebuild is waiting for the exclusive lock: {holder} (pid {pid} on host {host} since "


def _coverage(intervals, lo: int, hi: int) -> float:
    """Share of [lo, hi] during which some logged read interval was open."""
    spans = sorted((max(iv.start, lo), min(iv.end, hi)) for iv in intervals if iv.mode == "read")
    covered, reach = 0, lo
    for start, end in spans:
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered / (hi - lo)


def test_stream_of_readers_does_not_starve_a_waiting_rebuild(where, holders, tmp_path):
    where.lease()  # creates the lease's files before the holders start
    log, stop = tmp_path / "events.log", tmp_path / "stop"
    log.touch()
    far = time.monotonic_ns() + int(600e9)  # the stop file ends the stream, this only bounds it
    readers = [
        start_worker(where.location, where.name, log=str(log), stop=str(stop), slot=i,
                     seed=f"{where.backend}-{i}", until_ns=far, **STREAM)
        for i in range(STREAM_READERS)
    ]
    try:
        # Let the stream run for a second of overlapping holds before the rebuild asks.
        first = wait_for("the first read lease", lambda: [e for e in parse(log.read_text())
                                                           if e.kind == "acquire"])
        wait_for("a second of reading", lambda: time.monotonic_ns() > first[0].ns + 1e9)
        # A rebuild may get the lock before any reader asks again (the holders' last holds end
        # within tens of ms, and a loaded host can delay the readers' next request): it asks
        # again, a few times at most, until readers were refused while it waited.
        rebuilds = []
        for _ in range(REBUILD_TRIES):
            if rebuilds:  # a second of reading again before it asks
                time.sleep(1.0)
            rebuild = spawn(holders, where, "exclusive", "rebuild_shared_env",
                            wait_s=REBUILD_WAIT_S, log=str(log))
            rebuilds.append(rebuild)
            rebuild.acquired()
            time.sleep(0.1)  # hold it for a moment while the readers keep asking
            rebuild.release()

            def readers_back():
                events = parse(log.read_text())
                released = [e.ns for e in events if e.pid == rebuild.pid and e.kind == "release"]
                return [e for e in events if e.kind == "acquire" and e.mode == "read"
                        and e.ns > released[0]]

            wait_for("readers admitted after the rebuild", lambda: len(readers_back()) >= 3)
            if _refused_naming(parse(log.read_text()), rebuild.pid):
                break
    finally:
        stop.touch()
        for proc in readers:
            try:
                assert proc.wait(timeout=60) == 0, f"reader {proc.pid} failed"
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    events = parse(log.read_text())
    intervals, _busy = replay(events, kills={})
    max_readers = check_invariant(intervals)
    phases, checked = check_waiting(events, kills={})
    rebuild = rebuilds[-1]
    mine = {e.kind: e for e in events if e.pid == rebuild.pid}
    asked, granted = mine["request"].ns, mine["acquire"].ns
    # The stream was on: readers held the lease when the rebuild asked, and for most of the
    # second before (logged holds are inside the real ones, so this undercounts).
    assert any(iv.start < asked < iv.end for iv in intervals if iv.mode == "read")
    coverage = _coverage(intervals, asked - int(1e9), asked)
    # Readers kept asking while the rebuild waited, and were refused naming it.
    during = [e for e in events if e.kind == "busy" and e.mode == "read" and asked < e.ns < granted]
    named = [e for e in during if e.waiter == rebuild.pid]
    print(f"{where.backend}: rebuild {len(rebuilds)} waited {(granted - asked) / 1e9:.3f}s of {REBUILD_WAIT_S:g}s; "
          f"{len(during)} reads refused meanwhile ({len(named)} naming it); "
          f"reader coverage before it asked {coverage:.0%}; max {max_readers} concurrent readers")
    assert coverage >= 0.5, coverage
    assert max_readers >= 2
    assert named, "no reader was refused naming the waiting rebuild"
    for e in named:
        assert e.message.startswith("ENV_BUSY: cannot take the read lease")
        assert _waiting_phrase("rebuild_shared_env", rebuild.pid, where.host) in e.message
        assert " until 20" in e.message and "no new read lease until it has the lock" in e.message
    # ... and nobody was admitted between its taking the gate and its lock (independent check).
    assert phases == 1 and checked >= 1, (phases, checked)


def test_killed_waiting_rebuild_readmits_readers_at_once(where, holders):
    lease = where.lease()
    reader = spawn(holders, where, "read", "train_a")
    reader.acquired()
    rng = random.Random(f"kill-waiting-{where.backend}")
    for round_ in range(6):
        rebuild = spawn(holders, where, "exclusive", f"rebuild_{round_}", wait_s=120)
        if round_ % 2 == 0:
            # Killed while it waits, at a random moment of its wait.
            wait_for("the rebuild to wait", lambda: waiting_pid(lease) == rebuild.pid)
            with pytest.raises(EnvBusy) as info:
                lease.acquire("read", "train_b")
            assert _waiting_phrase(f"rebuild_{round_}", rebuild.pid, where.host) in info.value.message
            time.sleep(rng.uniform(0, 0.1))
        else:
            time.sleep(rng.uniform(0, 0.6))  # at any moment: starting, taking the gate, waiting
        rebuild.kill()
        with lease.read("train_b", wait_s=where.grace):
            status = lease.status()
        assert status.waiting is None and sorted(status.holders) == ["train_a", "train_b"]
    reader.release()
    with lease.exclusive("rebuild_after", wait_s=where.grace):
        pass
    if where.backend == "file":
        # The dead rebuilds' holder files were removed by status; nothing else is left.
        assert os.listdir(Path(where.location) / f"{where.name}.holders") == []


def test_rebuild_that_gives_up_readmits_readers(where, holders):
    lease = where.lease()
    reader = spawn(holders, where, "read", "train_a")
    reader.acquired()
    in_process = lease.acquire("read", "eval_b")
    rebuild = spawn(holders, where, "exclusive", "rebuild_shared_env", wait_s=1.5)
    wait_for("the rebuild to wait", lambda: waiting_pid(lease) == rebuild.pid)

    status = lease.status()
    w = status.waiting
    assert w.holder == "rebuild_shared_env" and w.mode == "exclusive" and w.host == where.host
    assert w.deadline - w.since == pytest.approx(1.5, abs=1e-3)
    assert abs(w.since - time.time()) < 30
    assert sorted(status.holders) == ["eval_b", "train_a"] and status.exclusive is None
    assert not status.idle
    d = json.loads(json.dumps(status.to_dict()))
    assert d["waiting"]["pid"] == rebuild.pid and d["waiting"]["deadline_iso"].endswith("Z")
    assert d["waiting"]["since_iso"] <= d["waiting"]["deadline_iso"]

    # New readers are refused, in this process and in others; readers holding keep their lease.
    with pytest.raises(EnvBusy) as info:
        lease.acquire("read", "train_c")
    msg = info.value.message
    assert _waiting_phrase("rebuild_shared_env", rebuild.pid, where.host) in msg
    assert f" until {d['waiting']['deadline_iso']})" in msg
    assert "2 readers hold leases: " in msg and info.value.status.waiting.pid == rebuild.pid
    other = spawn(holders, where, "read", "train_d")
    line = other.line()
    assert line.startswith("BUSY ENV_BUSY: ") and "a rebuild is waiting" in line, line
    assert in_process.is_held()

    # It gives up at its deadline, naming the readers (not itself), and readers are back at once.
    line = rebuild.line()
    assert line.startswith("BUSY ENV_BUSY: cannot take the exclusive lock"), line
    assert "2 readers hold leases: " in line and "waited 1.5s" in line
    assert "a rebuild is waiting" not in line
    with lease.read("train_c"):
        assert lease.status().waiting is None
    in_process.release()
    reader.release()
    assert lease.status().idle


def test_waiting_rebuild_gets_the_lock_when_the_readers_are_done(where, holders):
    lease = where.lease()
    readers = [spawn(holders, where, "read", n) for n in ("train_a", "eval_b")]
    for r in readers:
        r.acquired()
    rebuild = spawn(holders, where, "exclusive", "rebuild_shared_env", wait_s=REBUILD_WAIT_S)
    wait_for("the rebuild to wait", lambda: waiting_pid(lease) == rebuild.pid)

    # A second rebuild queues behind the first: with a wait it gives up naming the waiting one;
    # without a wait it is refused at once, like a reader.
    for wait_s in (0.3, 0):
        with pytest.raises(EnvBusy) as info:
            lease.acquire("exclusive", "rebuild_again", wait_s=wait_s)
        assert _waiting_phrase("rebuild_shared_env", rebuild.pid, where.host) in info.value.message
        assert "2 readers hold leases" in info.value.message

    readers[0].release()
    assert waiting_pid(lease) == rebuild.pid  # one reader left: still waiting
    readers[1].release()
    rebuild.acquired()
    status = lease.status()
    assert status.exclusive.pid == rebuild.pid and status.waiting is None
    with pytest.raises(EnvBusy) as info:
        lease.acquire("read", "train_c")
    assert f"exclusive lock held by rebuild_shared_env (pid {rebuild.pid}" in info.value.message
    assert "a rebuild is waiting" not in info.value.message
    rebuild.release()
    with lease.read("train_c"):
        pass


# A process whose second thread waits for the exclusive lock while the main thread forks a
# grandchild: the grandchild must not keep the gate once the waiting process is dead.
FORK_WHILE_WAITING = r"""
import json, os, sys, threading, time
from aml_pipeline.lease import EnvBusy, open_lease
a = json.loads(sys.argv[1])
lease = open_lease(a["location"], name=a["name"])
def wait_for_the_lock():
    try:
        lease.acquire("exclusive", a["holder"], wait_s=a["wait_s"])
    except EnvBusy:
        pass
threading.Thread(target=wait_for_the_lock, daemon=True).start()
while not ((w := lease.status().waiting) and w.pid == os.getpid()):
    time.sleep(0.01)
if os.fork() == 0:
    sys.stdout.write(f"GRANDCHILD {os.getpid()}\n"); sys.stdout.flush()
    time.sleep(120); os._exit(0)
time.sleep(120)
"""


def test_forked_child_does_not_keep_a_killed_rebuilds_wait(where, holders):
    lease = where.lease()
    reader = spawn(holders, where, "read", "train_a")
    reader.acquired()
    rebuild = spawn(holders, where, "exclusive", "rebuild_shared_env", wait_s=120,
                    script=FORK_WHILE_WAITING)
    words = rebuild.line().split()
    assert words[0] == "GRANDCHILD"
    grandchild = int(words[1])
    try:
        assert waiting_pid(lease) == rebuild.pid
        rebuild.kill()
        os.kill(grandchild, 0)  # still alive, holding copies of the rebuild's descriptors
        with lease.read("train_b", wait_s=where.grace):
            pass
        assert lease.status().waiting is None
    finally:
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass
    reader.release()


def test_postgres_requests_pass_the_gate_without_keeping_it(postgres_url):
    lease = open_lease(postgres_url, name=f"test-{uuid.uuid4().hex[:12]}")
    gate_hi, gate_lo = _key_parts(lease.gate_key)
    key_hi, key_lo = _key_parts(lease.key)
    count = """SELECT count(*) FILTER (WHERE classid::int8 = %s AND objid::int8 = %s),
                      count(*) FILTER (WHERE classid::int8 = %s AND objid::int8 = %s)
                 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"""
    with lease.read("train_a"), lease.read("eval_b"), psycopg.connect(postgres_url) as conn:
        gate, held = conn.execute(count, (gate_hi, gate_lo, key_hi, key_lo)).fetchone()
        assert (gate, held) == (0, 2)
        with pytest.raises(EnvBusy):
            lease.acquire("exclusive", "rebuild", wait_s=0.2)
        gate, held = conn.execute(count, (gate_hi, gate_lo, key_hi, key_lo)).fetchone()
        assert (gate, held) == (0, 2)  # the rebuild that gave up let go of the gate
    with lease.exclusive("rebuild", wait_s=0.2), psycopg.connect(postgres_url) as conn:
        assert conn.execute(count, (gate_hi, gate_lo, key_hi, key_lo)).fetchone() == (0, 1)


def test_postgres_application_name_carries_the_wait():
    app = application_name("exclusive", "rebuild_shared_env", 4242, "build-01", 30)
    assert app == "aml-lease:x30:4242@build-01:rebuild_shared_env"
    assert parse_application_name(app) == ("rebuild_shared_env", 4242, "build-01")
    assert application_wait(app) == 30.0
    assert application_wait(application_name("exclusive", "r", 1, "h", 0.25)) == 0.25
    assert application_wait(application_name("read", "train", 1, "h")) is None
    assert application_wait("aml-lease:status") is None and application_wait("psql") is None
    long = application_name("exclusive", "rebuild_" + "x" * 100, 4194304, "h" * 40, 3600)
    assert len(long.encode()) == 63 and application_wait(long) == 3600.0
