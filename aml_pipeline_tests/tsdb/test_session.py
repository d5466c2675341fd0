"""TsdbSession and the writer's turn on the embedded file, with real processes: an ingest gets the
file between two chunks of a long reader, readers queue behind a waiting writer, a killed writer
leaves nothing behind. The session API works the same on PostgreSQL (one connection kept)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from aml_pipeline.errors import TsdbBusyError, TsdbError
from aml_pipeline.tsdb import TsdbSession
from aml_pipeline_tests.tsdb.series import fetch_node_series, held
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline.tsdb.port import Node, PointColumns, Run
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema
from aml_pipeline_tests.tsdb.support import wait_until_queued

REPO = Path(__file__).resolve().parents[2]
FAR = 2**62
NODES = ["N0", "N1", "N2", "N3"]
POINTS_PER_NODE = 20_000
T0 = 1_735_718_400_000  # 2025-01-01T08:00:00Z: an ingested file must hold times a plant wrote


def plant_points(run_id: str, n: int, t0: int = T0, seed: int = 0) -> PointColumns:
    rng = np.random.default_rng(seed)
    return PointColumns(
        np.full(n * len(NODES), run_id, dtype=object),
        np.repeat(np.array(NODES, dtype=object), n),
        np.tile(t0 + 100 * np.arange(n, dtype=np.int64), len(NODES)),
        rng.normal(size=n * len(NODES)),
        np.zeros(n * len(NODES), np.int32),
    )


@pytest.fixture
def url(tmp_path) -> str:
    url = f"duckdb://{tmp_path / 'tsdb.duckdb'}"
    with DuckDBTsdb(url, read_only=False) as db:
        db.ingest(
            runs=[Run("R0", "L1", "P1", "RC", 1, "h", T0, T0 + 10**9, "simulation", True)],
            nodes=[Node(n) for n in NODES],
            points=plant_points("R0", POINTS_PER_NODE),
        )
    return url


def child(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO),
    )  # fmt: skip


def next_event(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"child said nothing; stderr: {proc.stderr.read()}")
    return json.loads(line)


READER = """
    import json, sys, time
    from aml_pipeline.errors import AmlError
    from aml_pipeline.tsdb import TsdbSession
    from aml_pipeline_tests.tsdb.series import fetch_node_series, held

    url, seconds, log = sys.argv[1], float(sys.argv[2]), open(sys.argv[3], "w")
    session = TsdbSession(url, lock_timeout_s=60)
    end = time.monotonic() + seconds
    chunks = 0
    while time.monotonic() < end:
        t0 = time.time()
        try:
            with held(session) as db:  # one chunk: every node of the run, then let go
                n = sum(len(fetch_node_series(db, node, "R0", -2**62, 2**62)) for node in ("N0", "N1", "N2", "N3"))
        except AmlError as e:
            log.write(json.dumps({"error": e.one_line()}) + "\\n")
            raise SystemExit(3)
        log.write(json.dumps({"t0": t0, "t1": time.time(), "n": n}) + "\\n")
        chunks += 1
        if chunks == 5:
            print("reading", flush=True)
    session.close()
    log.close()
    print(json.dumps({"opens": session.opens, "chunks": chunks}), flush=True)
"""


def test_an_ingest_gets_the_file_between_two_chunks_of_long_readers(url, tmp_path):
    """Three processes read chunk after chunk for 20 s, so at almost every moment one of them
    holds the file: the ingest gets in because new chunks wait while it waits (without the
    writer's place in the queue it fails with TSDB_BUSY after its 10 s)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = len(NODES) * POINTS_PER_NODE
    late = plant_points("R0", 500, t0=T0 + 10**8, seed=1)
    pq.write_table(
        pa.table({"run_id": late.run_id.astype(str), "node_id": late.node_id.astype(str), "ts": late.ts,
                  "value": late.value, "state": late.state}),
        tmp_path / "late.parquet",
    )  # fmt: skip
    logs = [tmp_path / f"reader{i}.jsonl" for i in range(3)]
    readers = [child(READER, url, "20", str(log)) for log in logs]
    try:
        for r in readers:
            assert r.stdout.readline().strip() == "reading", r.stderr.read()
        ingest = subprocess.run(
            [sys.executable, "-m", "aml_pipeline.cli", "ingest", "--tsdb", url, "--points",
             str(tmp_path / "late.parquet"), "--lock-timeout-s", "10"],
            capture_output=True, text=True, cwd=str(REPO),
            env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")),
        )  # fmt: skip
        finished = time.time()
        assert ingest.returncode == 0, ingest.stderr  # not TSDB_BUSY after its 10 s
        assert json.loads(ingest.stdout.splitlines()[-1])["points"] == len(late)
        summaries = [json.loads(r.communicate(timeout=120)[0].splitlines()[-1]) for r in readers]
        assert [r.returncode for r in readers] == [0, 0, 0]
    finally:
        for r in readers:
            if r.poll() is None:
                r.kill()
                r.wait()
    for log, summary in zip(logs, summaries):
        chunks = [json.loads(line) for line in log.read_text().splitlines()]
        assert summary == {"opens": len(chunks), "chunks": len(chunks)}  # a handle per chunk
        seen = [c["n"] for c in chunks]
        assert set(seen) <= {base, base + len(late)}  # never a half-written state
        assert seen == sorted(seen) and seen[0] == base  # once seen, the new points stay
        after = [c for c in chunks if c["t0"] > finished]
        assert after and all(c["n"] == base + len(late) for c in after)  # the next chunk sees them
        assert chunks[-1]["t1"] - finished > 5  # and the readers went on after the ingest


HOLDER = """
    import json, sys
    from aml_pipeline.tsdb.duckdb import DuckDBTsdb

    url, mode, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    try:
        db = DuckDBTsdb(url, read_only=(mode == "read"), lock_timeout_s=timeout)
    except Exception as e:
        print(json.dumps({"event": "error", "code": getattr(e, "code", type(e).__name__)}), flush=True)
        raise SystemExit(0)
    print(json.dumps({"event": "open"}), flush=True)
    sys.stdin.readline()
    db.close()
    print(json.dumps({"event": "closed"}), flush=True)
"""


def test_new_readers_wait_while_a_writer_waits_for_the_file(url):
    reader = child(HOLDER, url, "read", "5")  # holds the file and does not let go
    writer = None
    try:
        assert next_event(reader)["event"] == "open"
        writer = child(HOLDER, url, "write", "4")  # queues for the file behind the reader
        wait_until_queued(url, writer)
        # Without the writer's place in the queue this open would succeed at once (readers share).
        with pytest.raises(TsdbBusyError, match="an ingest is writing it") as info:
            DuckDBTsdb(url, lock_timeout_s=0.5)
        assert info.value.code == "TSDB_BUSY"
        assert next_event(writer) == {"event": "error", "code": "TSDB_BUSY"}  # the reader never let go
        with DuckDBTsdb(url, lock_timeout_s=0.5) as db:  # the writer gave up: readers go on
            assert len(fetch_node_series(db, "N0", "R0", -FAR, FAR)) == POINTS_PER_NODE
    finally:
        for p in (reader, writer):
            if p is not None and p.poll() is None:
                p.stdin.write("go\n")
                p.stdin.flush()
                p.communicate(timeout=30)


def test_a_killed_writer_leaves_nothing_to_clean_up(url):
    writer = child(HOLDER, url, "write", "5")
    assert next_event(writer)["event"] == "open"  # holds the file and its place in the queue
    with pytest.raises(TsdbBusyError):
        DuckDBTsdb(url, lock_timeout_s=0.3)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    with DuckDBTsdb(url, lock_timeout_s=2.0) as db:
        assert len(fetch_node_series(db, "N0", "R0", -FAR, FAR)) == POINTS_PER_NODE
    with DuckDBTsdb(url, read_only=False, lock_timeout_s=2.0) as db:
        assert db.ingest(points=plant_points("R0", 10, t0=T0 + 10**8)) == 10 * len(NODES)


# ---- the session API, both adapters ---------------------------------------------------------


@pytest.fixture(params=["duckdb", "postgres"])
def any_url(request, tmp_path):
    if request.param == "duckdb":
        url = f"duckdb://{tmp_path / 's.duckdb'}"
        cleanup = None
    else:
        server = request.getfixturevalue("postgres_url")
        schema = f"t_{uuid.uuid4().hex[:16]}"
        url, cleanup = with_schema(server, schema), (server, schema)
    from aml_pipeline.tsdb_open import open_tsdb

    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=[Run("R0", "L1", "P1", "RC", 1, "h", T0, T0 + 10**9)], nodes=[Node(n) for n in NODES],
                  points=plant_points("R0", 50))  # fmt: skip
    try:
        yield url
    finally:
        if cleanup is not None:
            drop_schema(*cleanup)


def test_a_session_holds_a_handle_per_chunk_and_sees_new_data_in_the_next(any_url):
    from aml_pipeline.tsdb_open import open_tsdb

    embedded = any_url.startswith("duckdb://")
    with TsdbSession(any_url) as session:
        assert not session.holding and session.opens == 0  # opened lazily
        for _ in range(3):
            with held(session) as db:
                assert session.holding
                assert len(fetch_node_series(db, "N0", "R0", -FAR, FAR)) == 50
            # The embedded file is let go after each chunk; a PostgreSQL connection is kept.
            assert session.holding is (not embedded)
        assert session.opens == (3 if embedded else 1)
        # between chunks a writer gets in at once (no waiting: a zero lock timeout)
        with open_tsdb(any_url, read_only=False, lock_timeout_s=0) as writer:
            assert writer.ingest(points=plant_points("R0", 5, t0=T0 + 10**8)) == 5 * len(NODES)
        with held(session) as db:
            assert len(fetch_node_series(db, "N0", "R0", -FAR, FAR)) == 55
        with pytest.raises(RuntimeError), held(session):
            raise RuntimeError("a chunk that fails still lets go")
        assert session.holding is (not embedded)
    assert not session.holding
    with pytest.raises(TsdbError, match="session is closed"):
        session.acquire()


def test_a_writer_in_the_same_process_is_refused_at_once_while_a_chunk_reads(url):
    with TsdbSession(url) as session, held(session):
        with pytest.raises(TsdbBusyError, match="already open in this process") as info:
            DuckDBTsdb(url, read_only=False, lock_timeout_s=5)
        assert "waited" not in info.value.message  # no point in waiting for ourselves


def test_a_forked_child_does_not_keep_the_writers_turn(url):
    """A forked child shares the parent's open files, and flock follows the open file: had the
    child kept its copy of the intent file, readers would wait for the child to exit."""
    writer = DuckDBTsdb(url, read_only=False)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: touches nothing, lives until the parent is done
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        writer.close()
        with DuckDBTsdb(url, lock_timeout_s=0.5) as db:  # the child is alive
            assert len(fetch_node_series(db, "N0", "R0", -FAR, FAR)) == POINTS_PER_NODE
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


def test_a_brief_handle_lets_an_ingest_in_while_a_long_fetch_runs(url, tmp_path):
    """What the run stages hold while they fetch (BriefHandle): a handle reopened between pages
    once held for ``hold_s``, so an ingest from another process gets the file during a long fetch
    (a handle held for the whole fetch would make it fail with TSDB_BUSY)."""
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq

    from aml_pipeline.tsdb.session import BriefHandle

    late = plant_points("R0", 300, t0=T0 + 10**8, seed=2)
    pq.write_table(
        pa.table({"run_id": late.run_id.astype(str), "node_id": late.node_id.astype(str), "ts": late.ts,
                  "value": late.value, "state": late.state}),
        tmp_path / "late.parquet",
    )  # fmt: skip
    session = TsdbSession(url, lock_timeout_s=60)
    brief = BriefHandle(session, hold_s=0.05)
    fetched: list[int] = []

    def fetch() -> None:  # slow on purpose: many small pages, several passes
        for _ in range(6):
            fetched.append(sum(len(fetch_node_series(brief, n, "R0", -FAR, FAR, page_limit=500)) for n in NODES))

    reader = threading.Thread(target=fetch)
    reader.start()
    while session.opens < 2:
        time.sleep(0.01)
    ingest = subprocess.run(
        [sys.executable, "-m", "aml_pipeline.cli", "ingest", "--tsdb", url, "--points", str(tmp_path / "late.parquet"),
         "--lock-timeout-s", "10"],
        capture_output=True, text=True, cwd=str(REPO),
        env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )  # fmt: skip
    done_at_ingest = len(fetched)
    reader.join()
    session.close()
    assert ingest.returncode == 0, ingest.stderr
    assert done_at_ingest < len(fetched) == 6  # the fetch was still going when the ingest ran
    assert session.opens > 6  # reopened between pages, not once per pass
    assert fetched[-1] == len(NODES) * POINTS_PER_NODE + len(late)  # a later pass sees the new points


def test_a_brief_handle_ends_its_hold_even_when_every_chunk_starts_with_a_prefetch(url):
    """A build of short runs calls ``prefetch`` at the start of each: the hold is measured from the
    open, not from the last prefetch, so the handle is let go within about ``hold_s`` plus one
    chunk, however many short chunks follow (a waiting ingest is not kept out until the last)."""
    from aml_pipeline.tsdb.session import BriefHandle

    session = TsdbSession(url, lock_timeout_s=60)
    brief = BriefHandle(session, hold_s=0.2)
    start = time.monotonic()
    chunks = 0
    while time.monotonic() - start < 1.0:
        assert brief.prefetch("R0", NODES, -FAR, FAR, max_points=10**6)
        time.sleep(0.05)  # each chunk far shorter than the hold
        assert sum(len(fetch_node_series(brief, n, "R0", -FAR, FAR)) for n in NODES) == len(NODES) * POINTS_PER_NODE
        chunks += 1
    session.close()
    assert chunks >= 8
    # One hold per hold_s of the second: not one hold for all of it.
    assert session.opens >= 3, session.opens


def test_a_brief_handle_reads_ahead_only_what_its_hold_will_serve(monkeypatch):
    """What a prefetch names as read next is cut to the slices the prefetches' pace asks for before
    the hold ends: a hold that ends drops what it read ahead, so reading more is wasted."""
    import aml_pipeline.tsdb.session as session_mod
    from aml_pipeline.tsdb.session import BriefHandle

    clock = [100.0]
    monkeypatch.setattr(session_mod.time, "monotonic", lambda: clock[0])
    asked: list[int] = []

    class Handle:
        def prefetch(self, run_id, node_ids, from_ms, to_ms, *, ahead=(), **kw):
            asked.append(len(ahead))
            return True

    class Session:
        url, holding, opens = "duckdb:///x", False, 0

        def acquire(self):
            if not self.holding:
                self.holding, self.opens = True, self.opens + 1
            return Handle()

        def release(self):
            self.holding = False

    session = Session()
    brief = BriefHandle(session, hold_s=1.0)
    ahead = [(f"R{i}", 0, 1) for i in range(1, 8)]
    brief.prefetch("R0", NODES, 0, 1, ahead=ahead)  # no pace yet: all of it
    clock[0] += 0.3  # a prefetch every 0.3 s: 0.7 s of the hold left, two more before it ends
    brief.prefetch("R1", NODES, 0, 1, ahead=ahead[1:])
    clock[0] += 0.3  # 0.4 s left: one more
    brief.prefetch("R2", NODES, 0, 1, ahead=ahead[2:])
    clock[0] += 0.5  # the hold is over: a new one, its second at a prefetch every 0.5 s
    brief.prefetch("R3", NODES, 0, 1, ahead=ahead[3:])
    assert asked == [7, 2, 1, 2] and session.opens == 2
