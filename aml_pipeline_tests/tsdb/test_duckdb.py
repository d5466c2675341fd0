"""DuckDB adapter specifics: URL forms, schema, file locking across real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from contextlib import closing
from pathlib import Path

import duckdb
import numpy as np
import pytest

from aml_pipeline.errors import AmlError, IngestError, TsdbBusyError, TsdbError
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.tsdb.duckdb import SCHEMA_VERSION, DuckDBTsdb, parse_duckdb_url
from aml_pipeline.tsdb.port import Node, PointColumns, Run
from aml_pipeline_tests.tsdb.series import fetch_node_series, point_count

REPO = Path(__file__).resolve().parents[2]
FAR = 2**62


def url_of(path: Path) -> str:
    return f"duckdb://{path}"


def small_dataset(n_runs: int = 3, n_nodes: int = 4, n_points: int = 500):
    runs = [Run(f"R{r}", "L1", "P1", "R7", 1, "h", r * 10**6, r * 10**6 + 10**5, "simulation", True) for r in range(n_runs)]
    nodes = [Node(f"N{k}", "u", 0.0, 1.0) for k in range(n_nodes)]
    run_id, node_id, ts, value = [], [], [], []
    for r in runs:
        for k, n in enumerate(nodes):
            run_id += [r.run_id] * n_points
            node_id += [n.node_id] * n_points
            ts += list(r.started_at + 100 * np.arange(n_points))
            value += list(np.arange(n_points) * 0.5 + k)
    points = PointColumns(
        np.array(run_id, dtype=object),
        np.array(node_id, dtype=object),
        np.array(ts, dtype=np.int64),
        np.array(value, dtype=np.float64),
        np.zeros(len(ts), dtype=np.int32),
    )
    return runs, nodes, points


def checksum(db) -> dict:
    total, count = 0.0, 0
    for r in db.list_runs(finished_only=False):
        for n in db.list_nodes():
            s = fetch_node_series(db, n.node_id, r.run_id, 0, FAR, page_limit=97)
            total += float(s.value.sum())
            count += len(s)
    return {"count": count, "sum": total}


@pytest.fixture
def populated(tmp_path) -> tuple[str, dict]:
    url = url_of(tmp_path / "tsdb.duckdb")
    with DuckDBTsdb(url, read_only=False) as db:
        runs, nodes, points = small_dataset()
        db.ingest(runs=runs, nodes=nodes, points=points)
        expected = checksum(db)
    return url, expected


# ---- child processes -----------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys, time
    from aml_pipeline.errors import AmlError
    from aml_pipeline.tsdb.duckdb import DuckDBTsdb
    from aml_pipeline_tests.tsdb.series import fetch_node_series

    url, mode, hold_s, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])

    def checksum(db):
        total, count = 0.0, 0
        for r in db.list_runs(finished_only=False):
            for n in db.list_nodes():
                s = fetch_node_series(db, n.node_id, r.run_id, 0, 2**62, page_limit=97)
                total += float(s.value.sum()); count += len(s)
        return {"count": count, "sum": total}

    def say(**kw):
        print(json.dumps(kw), flush=True)

    try:
        db = DuckDBTsdb(url, read_only=True, lock_timeout_s=timeout_s)
    except AmlError as e:
        say(event="error", code=e.code, message=e.message)
        sys.exit(3)
    say(event="open", t=time.time(), **checksum(db))
    if mode == "wait_stdin":
        sys.stdin.readline()  # hold the file until the parent says so
    else:
        time.sleep(hold_s)
    result = checksum(db)
    db.close()
    say(event="closed", t=time.time(), **result)
    """
)


@pytest.fixture
def child_script(tmp_path) -> Path:
    path = tmp_path / "reader_child.py"
    path.write_text(CHILD)
    return path


def spawn_reader(script: Path, url: str, mode: str = "sleep", hold_s: float = 0.0, timeout_s: float = 10.0):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, str(script), url, mode, str(hold_s), str(timeout_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(REPO),
    )


def read_event(proc) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"child said nothing; stderr: {proc.stderr.read()}")
    return json.loads(line)


def test_ingest_waits_for_a_reader_in_another_process_then_reports_busy(child_script, populated):
    url, expected = populated
    reader = spawn_reader(child_script, url, mode="wait_stdin")
    try:
        opened = read_event(reader)
        assert opened["event"] == "open" and opened["count"] == expected["count"]

        t0 = time.monotonic()
        with pytest.raises(TsdbBusyError) as info:
            DuckDBTsdb(url, read_only=False, lock_timeout_s=1.0)
        waited = time.monotonic() - t0
        assert waited >= 0.9
        err = info.value
        assert err.code == "TSDB_BUSY"
        assert "is in use by another process (a build reading it, or another ingest)" in err.message
        assert "try again when it finishes" in err.message
        assert str(Path(url[len("duckdb://"):])) in err.message
        assert "\n" not in err.one_line()

        reader.stdin.write("go\n")
        reader.stdin.flush()
        closed = read_event(reader)  # the reader was not disturbed by the failed writer
        assert closed["event"] == "closed"
        assert {"count": closed["count"], "sum": closed["sum"]} == expected
        assert reader.wait(timeout=30) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()

    # the file is intact and writable once the reader is gone
    with DuckDBTsdb(url, read_only=False, lock_timeout_s=5.0) as db:
        assert checksum(db) == expected
        runs, nodes, points = small_dataset(n_runs=1, n_points=10)
        points = PointColumns(points.run_id, points.node_id, points.ts, points.value + 1000.0, points.state)
        assert db.ingest(points=points) == len(points)  # new values: not skipped as stored


def test_ingest_waits_and_succeeds_when_the_reader_finishes_in_time(child_script, populated):
    url, expected = populated
    reader = spawn_reader(child_script, url, mode="sleep", hold_s=1.5)
    try:
        assert read_event(reader)["event"] == "open"
        t0 = time.monotonic()
        with DuckDBTsdb(url, read_only=False, lock_timeout_s=20.0) as db:
            waited = time.monotonic() - t0
            assert checksum(db) == expected
        assert waited > 0.5
        assert reader.wait(timeout=30) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()


def test_reader_in_another_process_is_busy_while_an_ingest_holds_the_file(child_script, populated):
    url, expected = populated
    writer = DuckDBTsdb(url, read_only=False)
    try:
        reader = spawn_reader(child_script, url, timeout_s=0.5)
        event = read_event(reader)
        assert reader.wait(timeout=30) == 3
        assert event["event"] == "error" and event["code"] == "TSDB_BUSY"
        assert "in use by another process" in event["message"]
    finally:
        writer.close()
    reader = spawn_reader(child_script, url, timeout_s=5.0)
    event = read_event(reader)
    assert event["event"] == "open" and event["count"] == expected["count"]
    assert reader.wait(timeout=30) == 0


def test_concurrent_read_only_readers_in_several_processes(child_script, populated):
    url, expected = populated
    readers = [spawn_reader(child_script, url, mode="wait_stdin") for _ in range(3)]
    try:
        opened = [read_event(p) for p in readers]  # all three hold the file now...
        with DuckDBTsdb(url) as db:  # ...and a reader in this process can join them
            assert checksum(db) == expected
        for p in readers:
            p.stdin.write("go\n")
            p.stdin.flush()
        closed = [read_event(p) for p in readers]
        assert [p.wait(timeout=30) for p in readers] == [0, 0, 0]
    finally:
        for p in readers:
            if p.poll() is None:
                p.kill()
                p.wait()
    for o, c in zip(opened, closed):
        assert o["event"] == "open" and c["event"] == "closed"
        assert {"count": o["count"], "sum": o["sum"]} == expected
        assert {"count": c["count"], "sum": c["sum"]} == expected
    assert max(o["t"] for o in opened) < min(c["t"] for c in closed)  # held at the same time


# ---- opening -------------------------------------------------------------------------------


def test_same_process_mode_conflict_is_reported_at_once(populated):
    url, _ = populated
    with DuckDBTsdb(url, read_only=False):
        with pytest.raises(TsdbBusyError, match="already open in this process") as info:
            DuckDBTsdb(url, read_only=True, lock_timeout_s=5.0)
        assert "waited" not in info.value.message  # reported without waiting for the lock


def test_read_only_open_of_a_missing_file_says_ingest_first(tmp_path):
    with pytest.raises(TsdbError, match="ingest") as info:
        DuckDBTsdb(url_of(tmp_path / "missing.duckdb"))
    assert info.value.code == "TSDB_EMPTY"
    assert not (tmp_path / "missing.duckdb").exists()
    with pytest.raises(TsdbError, match="ingest"):
        open_tsdb(url_of(tmp_path / "missing.duckdb"))


def test_read_only_open_of_a_file_without_schema_says_ingest_first(tmp_path):
    path = tmp_path / "foreign.duckdb"
    duckdb.connect(str(path)).close()
    with pytest.raises(TsdbError, match="ingest") as info:
        DuckDBTsdb(url_of(path))
    assert info.value.code == "TSDB_EMPTY"


def test_foreign_duckdb_file_with_clashing_tables_is_left_alone(tmp_path):
    path = tmp_path / "theirs.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE runs (id INTEGER)")
    con.close()
    with pytest.raises(TsdbError, match="refusing to change it"):
        DuckDBTsdb(url_of(path), read_only=False)
    con = duckdb.connect(str(path), read_only=True)
    try:
        tables = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()]
    finally:
        con.close()
    assert tables == ["runs"]


def _sqlite_file() -> bytes:
    import sqlite3
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with closing(sqlite3.connect(Path(d) / "f.sqlite")) as con, con:
            con.execute("CREATE TABLE t (a)")
        return (Path(d) / "f.sqlite").read_bytes()


NOT_DATABASES = {
    "plant.yaml": b"backend: postgres\n",  # a source description named with the duckdb:// scheme
    "garbage.duckdb": b"this is not a database" * 1000,
    "empty.duckdb": b"",
    "notes.txt": b"hello\n",
    # DuckDB would open it through its sqlite extension (downloading it first), and a writer would
    # add the TSDB's tables to it.
    "catalog.sqlite": _sqlite_file(),
}


@pytest.mark.parametrize("read_only", [True, False], ids=["read", "ingest"])
@pytest.mark.parametrize("name", [*NOT_DATABASES, "a_directory"])
def test_a_path_that_is_not_a_duckdb_file_is_one_line_and_left_as_it_is(tmp_path, name, read_only):
    path = tmp_path / name
    if name == "a_directory":
        path.mkdir()
    else:
        path.write_bytes(NOT_DATABASES[name])
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(TsdbError) as info:
        open_tsdb(url_of(path), read_only=read_only)
    line = info.value.one_line()
    kind = "a directory, not a DuckDB database file" if name == "a_directory" else "not a DuckDB database file"
    assert line.startswith(f"TSDB_NOT_A_DATABASE: {path} is {kind} (left as it is)") and "\n" not in line, line
    # The source description's form is offered only for a file named like one.
    assert (f"use source://{path} (docs/sources.md)" in line) == name.endswith(".yaml"), line
    # Nothing made beside it (no intent file, no WAL), and it is unchanged.
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if name != "a_directory":
        assert path.read_bytes() == NOT_DATABASES[name]


def test_a_read_of_a_missing_path_makes_nothing_and_an_ingest_creates_it(tmp_path):
    path = tmp_path / "new" / "tsdb.duckdb"
    with pytest.raises(TsdbError) as info:
        open_tsdb(url_of(path))
    assert info.value.code == "TSDB_EMPTY" and str(path) in info.value.message
    assert list(tmp_path.iterdir()) == []  # not even its folder
    with open_tsdb(url_of(path), read_only=False) as db:  # how a user starts
        runs, nodes, points = small_dataset(n_runs=1, n_nodes=1, n_points=3)
        db.ingest(runs=runs, nodes=nodes, points=points)
    with open_tsdb(url_of(path)) as db:
        assert [r.run_id for r in db.list_runs()] == ["R0"]


def test_schema_is_created_once_and_versioned(tmp_path):
    url = url_of(tmp_path / "sub" / "dir" / "tsdb.duckdb")
    for _ in range(3):
        DuckDBTsdb(url, read_only=False).close()
    con = duckdb.connect(str(tmp_path / "sub" / "dir" / "tsdb.duckdb"), read_only=True)
    try:
        # created at version 1 and migrated, the path every version-1 file takes
        assert con.execute("SELECT version FROM schema_version ORDER BY 1").fetchall() == [(1,), (SCHEMA_VERSION,)]
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        assert {"schema_version", "runs", "run_state", "nodes", "points", "points_by_id"} <= tables
    finally:
        con.close()
    with DuckDBTsdb(url) as db:
        assert db.list_runs() == [] and db.list_nodes() == [] and db.availability_watermark() is None


def test_newer_schema_version_is_refused(tmp_path):
    path = tmp_path / "tsdb.duckdb"
    DuckDBTsdb(url_of(path), read_only=False).close()
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO schema_version VALUES (?, 0)", [SCHEMA_VERSION + 1])
    con.close()
    for read_only in (True, False):
        with pytest.raises(TsdbError, match="upgrade") as info:
            DuckDBTsdb(url_of(path), read_only=read_only)
        assert info.value.code == "TSDB_SCHEMA_VERSION"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("duckdb:///data/x.duckdb", "/data/x.duckdb"),
        ("duckdb:////data/x.duckdb", "/data/x.duckdb"),
        ("duckdb:///./x.duckdb", "{cwd}/x.duckdb"),
        ("duckdb:///../x.duckdb", "{parent}/x.duckdb"),
        ("duckdb://x.duckdb", "{cwd}/x.duckdb"),
        ("duckdb://sub/x.duckdb", "{cwd}/sub/x.duckdb"),
    ],
)
def test_url_forms(url, expected, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    want = Path(expected.format(cwd=work, parent=tmp_path))
    assert parse_duckdb_url(url) == want


@pytest.mark.parametrize(
    "url", ["duckdb://", "duckdb:///", "sqlite:///x.db", "duckdb:///x.duckdb?mode=ro", "duckdb:///:memory:"]
)
def test_bad_urls(url):
    with pytest.raises(TsdbError) as info:
        parse_duckdb_url(url)
    assert info.value.code == "TSDB_URL_INVALID"


def test_relative_url_creates_the_file_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open_tsdb("duckdb:///./rel.duckdb", read_only=False) as db:
        assert isinstance(db, DuckDBTsdb)
    assert (tmp_path / "rel.duckdb").is_file()


# ---- handle behaviour ---------------------------------------------------------------------


def test_read_only_handle_refuses_ingest_and_closed_handle_refuses_everything(populated):
    url, _ = populated
    db = DuckDBTsdb(url)
    with pytest.raises(TsdbError, match="read-only"):
        db.ingest(nodes=[Node("X")])
    db.close()
    db.close()  # idempotent
    with pytest.raises(TsdbError, match="closed"):
        db.list_runs()
    with pytest.raises(TsdbError, match="closed"):
        db.query_page("N0", "R0", 0, FAR)


def test_query_page_rejects_a_non_positive_limit(populated):
    url, _ = populated
    with DuckDBTsdb(url) as db, pytest.raises(ValueError):
        db.query_page("N0", "R0", 0, FAR, None, 0)


def test_points_are_stored_clustered_by_series_and_time(tmp_path):
    url = url_of(tmp_path / "tsdb.duckdb")
    runs, nodes, points = small_dataset(n_runs=3, n_nodes=3, n_points=50)
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(points))  # file order shuffled: ingest must sort
    shuffled = PointColumns(*(getattr(points, f)[perm] for f in ("run_id", "node_id", "ts", "value", "state")))
    with DuckDBTsdb(url, read_only=False) as db:
        db.ingest(runs=runs, nodes=nodes, points=shuffled)
        rows = np.array(db._c.execute("SELECT run_key, node_key, ts, seq FROM points").fetchall())
        # seq is the file row order
        page = db.query_page("N1", "R2", 0, FAR)
        file_rows = np.flatnonzero((shuffled.run_id == "R2") & (shuffled.node_id == "N1"))
        by_ts = file_rows[np.argsort(shuffled.ts[file_rows], kind="stable")]
        assert page.seq.tolist() == by_ts.tolist()
    order = np.lexsort((rows[:, 3], rows[:, 2], rows[:, 1], rows[:, 0]))
    assert order.tolist() == list(range(len(rows)))


def test_ingest_error_messages_name_the_offender(tmp_path):
    with DuckDBTsdb(url_of(tmp_path / "t.duckdb"), read_only=False) as db:
        with pytest.raises(IngestError, match="run_id 'bad id'"):
            db.ingest(runs=[Run("bad id", "L", "P", "R", None, None, 0, None)])
        with pytest.raises(IngestError, match="appears twice"):
            db.ingest(nodes=[Node("A"), Node("A")])
        with pytest.raises(IngestError, match="range_lo 2.0 is above range_hi 1.0"):
            db.ingest(nodes=[Node("A", "", 2.0, 1.0)])
        with pytest.raises(IngestError, match=r"nodes\[0\] \(A\): range_hi is inf; leave it empty"):
            db.ingest(nodes=[Node("A", "", 0.0, float("inf"))])
        db.ingest(runs=[Run("R", "L", "P", "R", None, None, 0, None)], nodes=[Node("A")])
        with pytest.raises(IngestError, match="index 1 has no node_id"):
            db.ingest(
                points=PointColumns(
                    np.array(["R", "R"], dtype=object),
                    np.array(["A", None], dtype=object),
                    np.array([1, 2]),
                    np.array([1.0, 2.0]),
                    np.array([0, 0], dtype=np.int32),
                )
            )
        with pytest.raises(IngestError, match="ts must be integer"):
            db.ingest(
                points=PointColumns(
                    np.array(["R"], dtype=object),
                    np.array(["A"], dtype=object),
                    np.array([1.5]),
                    np.array([1.0]),
                    np.array([0], dtype=np.int32),
                )
            )
        assert point_count(db) == 0


# ---- schema version 1 -> 2 -----------------------------------------------------------------

# Schema version 1 exactly as aml_pipeline created it before run versions existed, with data.
V1_FILE = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL, applied_at_ms BIGINT NOT NULL)",
    """CREATE TABLE runs (run_id VARCHAR PRIMARY KEY, run_key INTEGER NOT NULL UNIQUE,
        line_id VARCHAR NOT NULL, product_id VARCHAR NOT NULL, recipe_id VARCHAR NOT NULL,
        recipe_version INTEGER, recipe_content_hash VARCHAR, started_at BIGINT NOT NULL, ended_at BIGINT,
        evidence_source VARCHAR NOT NULL CHECK (evidence_source IN ('simulation', 'real', 'unassessed')),
        context_confirmed BOOLEAN NOT NULL DEFAULT FALSE, CHECK (ended_at IS NULL OR ended_at >= started_at))""",
    """CREATE TABLE nodes (node_id VARCHAR PRIMARY KEY, node_key INTEGER NOT NULL UNIQUE,
        unit VARCHAR NOT NULL DEFAULT '', range_lo DOUBLE, range_hi DOUBLE)""",
    """CREATE TABLE points (run_key INTEGER NOT NULL, node_key INTEGER NOT NULL, ts BIGINT NOT NULL,
        value DOUBLE NOT NULL, state INTEGER NOT NULL, seq BIGINT NOT NULL)""",
    """CREATE OR REPLACE VIEW points_by_id AS SELECT r.run_id, n.node_id, p.ts, p.value, p.state, p.seq
        FROM points p JOIN runs r USING (run_key) JOIN nodes n USING (node_key)""",
    "INSERT INTO schema_version VALUES (1, 0)",
    """INSERT INTO runs VALUES ('R1', 1, 'L1', 'P1', 'R1', 1, 'h', 0, 1000000, 'simulation', true),
        ('R2', 2, 'L1', 'P1', 'R1', 1, 'h', 0, NULL, 'simulation', true),
        ('R3', 3, 'L1', 'P1', 'R1', NULL, NULL, 0, 10, 'unassessed', false)""",
    "INSERT INTO nodes VALUES ('A', 1, '', NULL, NULL), ('B', 2, 'bar', 0, 1)",
    "INSERT INTO points VALUES (1, 1, 10, 1.0, 0, 0), (1, 1, 20, 2.0, 0, 1), (2, 1, 10, 3.0, 0, 2), (1, 2, 10, 4.0, 1, 3)",
)


def test_a_version_1_file_is_read_as_it_is_then_migrated_in_place(tmp_path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    for ddl in V1_FILE:
        con.execute(ddl)
    con.close()

    def versions_recorded() -> list[int]:
        with duckdb.connect(str(path), read_only=True) as c:
            return [r[0] for r in c.execute("SELECT version FROM schema_version ORDER BY 1").fetchall()]

    with DuckDBTsdb(url_of(path)) as ro:  # a build on an old file keeps working
        assert ro.schema_version == 1
        old = ro.run_versions(["R1", "R2", "R3", "NOPE"])
        assert set(old) == {"R1", "R2", "R3"} and len(set(old.values())) == 3
        assert fetch_node_series(ro, "A", "R1", 0, FAR).value.tolist() == [1.0, 2.0]
    assert versions_recorded() == [1]  # reading did not migrate

    with DuckDBTsdb(url_of(path), read_only=False) as rw:  # the first writer migrates
        assert rw.schema_version == 2
        assert rw.run_versions(["R1", "R2", "R3"]) == old  # migrating makes no run stale
        assert rw.ingest(points=PointColumns(
            np.array(["R1", "R2", "R1"], dtype=object), np.array(["A", "A", "A"], dtype=object),
            np.array([10, 10, 30]), np.array([1.0, 3.0, 5.0]), np.zeros(3, np.int32),
        )) == 1  # two were stored already
        after = rw.run_versions(["R1", "R2", "R3"])
        assert after["R1"] != old["R1"] and after["R2"] == old["R2"] and after["R3"] == old["R3"]
        assert fetch_node_series(rw, "A", "R1", 0, FAR).seq.tolist() == [0, 1, 4]
    assert versions_recorded() == [1, 2]
    with duckdb.connect(str(path), read_only=True) as c:
        assert dict(c.execute("SELECT run_key, point_count FROM run_state").fetchall()) == {1: 4, 2: 1, 3: 0}


def test_a_failed_migration_leaves_version_1(tmp_path, monkeypatch):
    from aml_pipeline.tsdb import duckdb as adapter

    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    for ddl in V1_FILE:
        con.execute(ddl)
    con.close()

    def broken(self, states):
        raise duckdb.IOException('Could not write file "x": No space left on device')

    monkeypatch.setattr(adapter._Statements, "save_run_states", broken)
    with pytest.raises(AmlError) as info:
        DuckDBTsdb(url_of(path), read_only=False)
    assert info.value.code == "DISK_FULL"
    assert path.exists()  # an existing file is never removed
    with duckdb.connect(str(path), read_only=True) as c:
        assert c.execute("SELECT max(version) FROM schema_version").fetchall() == [(1,)]
        tables = {r[0] for r in c.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        assert "run_state" not in tables
    monkeypatch.undo()
    with DuckDBTsdb(url_of(path), read_only=False) as rw:
        assert rw.schema_version == 2
