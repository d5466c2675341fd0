"""Shared-environment lease (DESIGN.md section 6), both backends, with real processes.

Every test runs against the directory backend (flock) and the PostgreSQL backend (advisory
locks on the ``postgres_url`` server). Holders are separate Python processes that are released
over a pipe or SIGKILLed: the lease must disappear with a killed holder, without any cleanup.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from aml_pipeline.errors import AmlError, InvalidIdError
from aml_pipeline.lease import EnvBusy, LeaseError, open_lease
from aml_pipeline.lease.pg_lease import advisory_key, application_name, parse_application_name
from aml_pipeline_tests.lease.support import HOST, live_pids, spawn


def test_many_readers_and_exclusive_refused_naming_them(where, holders):
    names = ["train_a", "eval_b", "solve_c"]
    readers = [spawn(holders, where, "read", n) for n in names]
    for r in readers:
        r.acquired()
    lease = where.lease()

    with pytest.raises(EnvBusy) as info:
        with lease.exclusive("rebuild_shared_env"):
            pytest.fail("exclusive granted while readers hold leases")
    err = info.value
    assert "waited" not in err.message  # refused without waiting
    assert isinstance(err, AmlError) and err.code == "ENV_BUSY"
    assert "3 readers hold leases: " in err.message
    assert all(n in err.message for n in names)
    assert err.one_line().startswith("ENV_BUSY: ")

    status = lease.status()
    assert status.readers == 3 and status.exclusive is None
    assert sorted(status.holders) == sorted(names)
    assert {r.pid for r in status.reader_leases} == {r.pid for r in readers}
    assert {r.host for r in status.reader_leases} == {where.host}
    json.dumps(status.to_dict())

    # A further reader is admitted while readers hold.
    with lease.read("train_d"):
        assert lease.status().readers == 4
    for r in readers:
        r.release()
    assert lease.status().idle
    with lease.exclusive("rebuild_shared_env") as x:
        assert x.is_held()


def test_exclusive_refuses_readers_and_status_names_the_owner(where, holders):
    before = time.time()
    owner = spawn(holders, where, "exclusive", "rebuild_shared_env")
    since = owner.acquired()
    lease = where.lease()

    with pytest.raises(EnvBusy) as info:
        with lease.read("train_a"):
            pytest.fail("read lease granted while the exclusive lock is held")
    msg = info.value.message
    assert f"exclusive lock held by rebuild_shared_env (pid {owner.pid} on host " in msg
    assert " since 20" in msg and "train_a" in msg
    # Refused across processes as well, for readers and for a second exclusive.
    for mode in ("read", "exclusive"):
        other = spawn(holders, where, mode, f"other_{mode}")
        line = other.line()
        assert line.startswith("BUSY ENV_BUSY: ") and "rebuild_shared_env" in line, line

    status = lease.status()
    assert status.readers == 0 and status.holders == []
    ex = status.exclusive
    assert ex is not None and ex.holder == "rebuild_shared_env" and ex.mode == "exclusive"
    assert ex.pid == owner.pid and ex.host == where.host
    assert before - 1 <= ex.since <= time.time() + 1 and abs(ex.since - since) < 2
    d = json.loads(json.dumps(status.to_dict()))
    assert d["exclusive"]["holder"] == "rebuild_shared_env"
    assert d["exclusive"]["since_iso"].endswith("Z") and d["readers"] == 0

    owner.release()
    with lease.read("train_a"):
        pass


def test_exclusive_from_a_process_that_reads_is_refused_not_deadlocked(where):
    lease = where.lease()
    with lease.read("train_a"):
        with pytest.raises(EnvBusy) as info:
            with lease.exclusive("rebuild_shared_env"):
                pass
        assert "this process" in info.value.message and "waited" not in info.value.message and "train_a" in info.value.message
        t0 = time.monotonic()
        with pytest.raises(EnvBusy):
            with lease.exclusive("rebuild_shared_env", wait_s=0.3):
                pass
        assert time.monotonic() - t0 >= 0.3
        with lease.read("eval_b"):  # two leases of one process are two readers
            assert lease.status().readers == 2
    with lease.exclusive("rebuild_shared_env"):
        with pytest.raises(EnvBusy):
            with lease.exclusive("rebuild_again"):
                pass


def test_wait_s_succeeds_once_the_holder_releases(where, holders):
    owner = spawn(holders, where, "exclusive", "rebuild_shared_env")
    owner.acquired()
    lease = where.lease()
    timer = threading.Timer(0.6, owner.release)
    timer.start()
    try:
        t0 = time.monotonic()
        with lease.read("train_a", wait_s=20) as handle:
            waited = time.monotonic() - t0
            assert handle.is_held()
            assert lease.status().holders == ["train_a"]
    finally:
        timer.join()
    assert waited >= 0.4, waited


def test_wait_s_times_out_naming_the_holder(where, holders):
    reader = spawn(holders, where, "read", "train_a")
    reader.acquired()
    lease = where.lease()
    t0 = time.monotonic()
    with pytest.raises(EnvBusy) as info:
        with lease.exclusive("rebuild_shared_env", wait_s=0.6):
            pass
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.6, elapsed
    assert "1 reader holds a lease: train_a" in info.value.message
    assert "waited 0.6s" in info.value.message
    assert info.value.status.holders == ["train_a"]


def _assert_gone(where, lease, dead_pid: int) -> None:
    """The dead holder's lease is free for anyone, and status does not list it."""
    with lease.exclusive("rebuild_shared_env", wait_s=where.grace):
        assert dead_pid not in live_pids(lease.status())
    assert dead_pid not in live_pids(lease.status())


@pytest.mark.parametrize("mode", ["read", "exclusive"])
def test_sigkilled_holder_leaves_no_lock(where, holders, mode):
    lease = where.lease()
    rng = random.Random(f"{where.backend}-{mode}")
    for round_ in range(5):
        h = spawn(holders, where, mode, f"doomed_{round_}")
        if round_ % 2 == 0:
            h.acquired()  # killed while holding, at a random moment of its hold
            assert h.pid in live_pids(lease.status())
            time.sleep(rng.uniform(0, 0.05))
        else:
            time.sleep(rng.uniform(0, 0.3))  # killed at any moment: starting, acquiring, holding
        h.kill()
        _assert_gone(where, lease, h.pid)
    if where.backend == "file":
        # Its holder files went with it: the dead ones were removed by status.
        leftovers = os.listdir(Path(where.location) / f"{where.name}.holders")
        assert leftovers == []


def test_sigkilled_holder_among_live_readers_is_not_listed(where, holders):
    lease = where.lease()
    alive = spawn(holders, where, "read", "train_a")
    doomed = spawn(holders, where, "read", "eval_b")
    alive.acquired()
    doomed.acquired()
    assert sorted(lease.status().holders) == ["eval_b", "train_a"]
    doomed.kill()
    deadline = time.monotonic() + where.grace
    while lease.status().holders != ["train_a"]:
        assert time.monotonic() < deadline, lease.status()
        time.sleep(0.02)
    with pytest.raises(EnvBusy) as info:
        with lease.exclusive("rebuild_shared_env"):
            pass
    assert "1 reader holds a lease: train_a" in info.value.message
    alive.release()


def test_forked_child_does_not_keep_a_killed_holders_lease(where, holders):
    lease = where.lease()
    h = spawn(holders, where, "exclusive", "rebuild_shared_env", fork=True)
    h.acquired()
    words = h.line().split()
    assert words[0] == "GRANDCHILD"
    grandchild = int(words[1])
    try:
        h.kill()
        os.kill(grandchild, 0)  # still alive, holding copies of the holder's descriptors
        _assert_gone(where, lease, h.pid)
    finally:
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_unreleased_handle_is_released_when_collected(where):
    lease = where.lease()
    handle = lease.acquire("read", "train_a")
    assert handle.is_held() and lease.status().holders == ["train_a"]
    del handle
    gc.collect()
    with lease.exclusive("rebuild_shared_env", wait_s=where.grace):
        pass


def test_released_handle_is_not_held(where):
    lease = where.lease()
    handle = lease.acquire("exclusive", "rebuild_shared_env")
    handle.release()
    handle.release()  # idempotent
    assert not handle.is_held()
    with lease.read("train_a"):
        pass


def test_lease_names_are_independent(where):
    a = open_lease(where.location, name=where.name)
    b = open_lease(where.location, name=where.name + "-other")
    with a.exclusive("rebuild_a"), b.read("train_b"):
        assert a.status().exclusive.holder == "rebuild_a"
        assert b.status().holders == ["train_b"] and b.status().exclusive is None


def test_invalid_requests_are_refused(tmp_path):
    lease = open_lease(tmp_path)
    with pytest.raises(InvalidIdError):
        lease.acquire("read", "")
    with pytest.raises(InvalidIdError):
        lease.acquire("read", "bad\nname")
    for wait in (-1, float("inf"), float("nan"), "soon"):
        with pytest.raises(LeaseError):
            lease.acquire("read", "x", wait_s=wait)
    with pytest.raises(LeaseError):
        lease.acquire("write", "x")
    with pytest.raises(InvalidIdError):
        open_lease(tmp_path, name="../escape")
    with pytest.raises(LeaseError):
        open_lease("http://example.invalid/env")
    assert lease.status().idle  # nothing was taken


def test_default_location_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AML_ENV_LOCATION", str(tmp_path / "envloc"))
    lease = open_lease()
    assert lease.backend == "file" and lease.location == str(tmp_path / "envloc")


def test_postgres_location_never_shows_its_password():
    # Port 1 on localhost refuses at once: the error must name the server, not the password.
    lease = open_lease("postgresql://aml:s3cr3t-pw@127.0.0.1:1/aml?sslmode=disable")
    assert lease.backend == "postgres" and "s3cr3t" not in lease.location
    assert lease.location == "postgresql://aml:***@127.0.0.1:1/aml?sslmode=disable"  # the one redaction rule (aml_pipeline.urls)
    for call in (lease.status, lambda: lease.acquire("read", "train_a")):
        with pytest.raises(LeaseError) as info:
            call()
        assert info.value.code == "ENV_LEASE_ERROR"
        assert "s3cr3t" not in info.value.message and "127.0.0.1" in info.value.message


def test_file_status_ignores_and_removes_files_of_dead_holders(tmp_path):
    lease = open_lease(tmp_path)
    with lease.read("warm_up"):
        pass
    holders_dir = tmp_path / "aml-shared-env.holders"
    # What a SIGKILLed holder leaves: a holder file that no one holds a lock on.
    stale = holders_dir / "exclusive-99999-0123456789abcdef.json"
    stale.write_text(json.dumps({"holder": "ghost", "mode": "exclusive", "pid": 99999,
                                 "host": HOST, "since": time.time()}))
    status = lease.status()
    assert status.idle and status.exclusive is None
    assert not stale.exists()
    with lease.exclusive("rebuild_shared_env"):
        pass


def test_file_lease_needs_no_preexisting_directory(tmp_path):
    lease = open_lease(tmp_path / "a" / "b")
    assert lease.status().idle  # status of a lease never taken: nothing to read
    with lease.read("train_a"):
        assert lease.status().holders == ["train_a"]


def test_postgres_application_name_fits_and_round_trips():
    app = application_name("exclusive", "rebuild_shared_env", 4242, "build-01.example.org")
    assert app == "aml-lease:x:4242@build-01:rebuild_shared_env"
    assert parse_application_name(app) == ("rebuild_shared_env", 4242, "build-01")
    long = application_name("read", "train_" + "x" * 100 + ":é", 4194304, "h" * 40)
    assert len(long.encode()) == 63 and long.isascii() and long.endswith("...")
    holder, pid, host = parse_application_name(long)
    assert holder.startswith("train_xxx") and pid == 4194304 and host == "h" * 16
    assert parse_application_name("psql") is None
    assert parse_application_name("aml-lease:status") is None
    # The advisory key is a stable signed 64-bit value of the name alone.
    assert advisory_key("aml-shared-env") == advisory_key("aml-shared-env")
    assert advisory_key("aml-shared-env") != advisory_key("other-env")
    assert -(2**63) <= advisory_key("aml-shared-env") < 2**63


def test_postgres_long_and_non_ascii_holder_names(postgres_url):
    lease = open_lease(postgres_url, name=f"test-{uuid.uuid4().hex[:12]}")
    long_name = "train_model_for_line_7_product_A_recipe_12_partition_2024_01_01"
    with lease.read(long_name), lease.read("modèle_é"):
        holders = lease.status().holders
    assert any(h.endswith("...") and long_name.startswith(h[:-3]) for h in holders), holders
    assert "mod?le_?" in holders
