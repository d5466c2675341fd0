"""PostgreSQL adapter specifics, against a real server: URL, schema, connections, concurrency.

The port's behaviour (pages, catalog, ingest atomicity, watermark) is in
``test_port_conformance.py``, which runs against this adapter too.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import numpy as np
import psycopg
import pytest
from psycopg import sql

from aml_pipeline.errors import (
    DiskFullError,
    IngestError,
    TsdbBusyError,
    TsdbError,
    TsdbUnavailableError,
    UnknownRunError,
)
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.tsdb import postgres as pg_adapter
from aml_pipeline.tsdb.port import Cursor, Node, PointColumns, Run
from aml_pipeline_tests.tsdb.series import fetch_node_series, point_count
from aml_pipeline.tsdb.postgres import SCHEMA_VERSION, PostgresTsdb, parse_postgres_url
from aml_pipeline.urls import redact_url
from aml_pipeline_tests.tsdb.support import points, run, small_dataset
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema

FAR = 2**62


@pytest.fixture
def schema(postgres_url) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:16]}"
    try:
        yield name
    finally:
        drop_schema(postgres_url, name)


@pytest.fixture
def url(postgres_url, schema) -> str:
    return with_schema(postgres_url, schema)


@pytest.fixture
def admin(postgres_url) -> Iterator[psycopg.Connection]:
    with psycopg.connect(postgres_url, autocommit=True) as con:
        yield con


def with_password(url: str, password: str) -> str:
    """The test server trusts local connections, so any password is accepted (and ignored)."""
    scheme, rest = url.split("://", 1)
    user, hostpart = rest.split("@", 1)
    return f"{scheme}://{user}:{password}@{hostpart}"


# ---- URL -----------------------------------------------------------------------------------


def test_url_schema_parameter_and_redaction():
    p = parse_postgres_url("postgresql://me:pa%3Ass@db.example:5433/plant?schema=aml_prod&sslmode=require")
    assert p.schema == "aml_prod"
    assert p.conninfo == "postgresql://me:pa%3Ass@db.example:5433/plant?sslmode=require"
    assert p.redacted == "postgresql://me:***@db.example:5433/plant?schema=aml_prod&sslmode=require"
    assert parse_postgres_url("postgres://h/db").schema == "aml"
    q = parse_postgres_url("postgresql:///db?host=/tmp&password=hunter2")
    assert "hunter2" not in q.redacted and "password=***" in q.redacted
    assert "hunter2" in q.conninfo


@pytest.mark.parametrize(
    "bad",
    [
        "postgresql://h/db?schema=",
        "postgresql://h/db?schema=Upper",
        "postgresql://h/db?schema=a-b",
        "postgresql://h/db?schema=x;drop",
        'postgresql://h/db?schema="x"',
        "postgresql://h/db?schema=pg_catalog",
        "postgresql://h/db?schema=information_schema",
        "postgresql://h/db?schema=" + "a" * 64,
        "postgresql://h/db?schema=a&schema=b",
        "postgresql://h/db#frag",
        "mysql://h/db",
    ],
)
def test_bad_urls_are_refused_before_connecting(bad):
    with pytest.raises(TsdbError) as info:
        PostgresTsdb(bad)
    assert info.value.code == "TSDB_URL_INVALID"


def test_open_tsdb_dispatches_postgres_urls(url):
    for u in (url, url.replace("postgresql://", "postgres://", 1)):
        with open_tsdb(u, read_only=False) as db:  # a writer creates the schema
            assert isinstance(db, PostgresTsdb) and not db.read_only
        with open_tsdb(u) as db:  # builds and sensors open read-only
            assert isinstance(db, PostgresTsdb) and db.read_only
            assert db.list_runs() == []


# ---- connection failures never show the password ---------------------------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["netloc", "query"])
def test_connection_failure_is_one_clear_line_without_the_password(where):
    port = _closed_port()
    secret = "s3cr3t-Pa55"
    if where == "netloc":
        url = f"postgresql://aml:{secret}@127.0.0.1:{port}/plant?connect_timeout=3"
    else:
        url = f"postgresql://aml@127.0.0.1:{port}/plant?password={secret}&connect_timeout=3"
    with pytest.raises(TsdbUnavailableError) as info:  # refused: a build retries it
        PostgresTsdb(url)
    err = info.value
    assert err.code == "TSDB_UNAVAILABLE"
    assert "cannot connect" in err.message and str(port) in err.message
    assert secret not in err.message and secret not in err.one_line() and secret not in repr(err)
    assert "\n" not in err.one_line()
    assert err.__cause__ is None and err.__suppress_context__  # no chained libpq text either


def test_unknown_database_is_reported_without_the_password(postgres_url):
    secret = "an0ther-secret"
    url = with_password(postgres_url, secret).rsplit("/", 1)[0] + "/no_such_db_here"
    with pytest.raises(TsdbError, match="no_such_db_here") as info:
        PostgresTsdb(url)
    assert secret not in info.value.one_line()


def test_password_is_redacted_in_url_and_messages(postgres_url, schema):
    secret = "pw-in-url-123"
    url = with_schema(with_password(postgres_url, secret), schema)
    with PostgresTsdb(url) as db:
        assert secret not in db.url and ":***@" in db.url
        assert secret not in repr(db)
        with pytest.raises(UnknownRunError) as info:
            db.get_run("NOPE")
        assert secret not in str(info.value)


# ---- schema ------------------------------------------------------------------------------------


def _tables(admin, schema: str) -> set[str]:
    rows = admin.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind IN ('r', 'v', 'p')",
        [schema],
    ).fetchall()
    return {r[0] for r in rows}


def test_schema_is_created_once_and_versioned(url, schema, admin):
    for _ in range(3):
        PostgresTsdb(url).close()
    ident = sql.Identifier(schema)
    versions = admin.execute(sql.SQL("SELECT version FROM {}.schema_version ORDER BY 1").format(ident)).fetchall()
    assert versions == [(1,), (SCHEMA_VERSION,)]  # created at version 1 and migrated, like any version-1 schema
    assert {"schema_version", "ingest_state", "runs", "run_state", "nodes", "points", "points_by_id"} <= _tables(admin, schema)
    with PostgresTsdb(url, read_only=True) as db:
        assert db.list_runs() == [] and db.list_nodes() == [] and db.availability_watermark() is None


def test_concurrent_first_opens_create_the_schema_once(url, schema, admin):
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def opener() -> None:
        try:
            barrier.wait()
            PostgresTsdb(url).close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=opener) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    versions = admin.execute(
        sql.SQL("SELECT version FROM {}.schema_version ORDER BY 1").format(sql.Identifier(schema))
    ).fetchall()
    assert versions == [(1,), (SCHEMA_VERSION,)]  # created and migrated once


@pytest.mark.parametrize(("version", "advice"), [(SCHEMA_VERSION + 1, "upgrade aml_pipeline"), (0, "re-ingest")])
def test_other_schema_versions_are_refused(url, schema, admin, version, advice):
    PostgresTsdb(url).close()
    admin.execute(
        sql.SQL("UPDATE {}.schema_version SET version = %s").format(sql.Identifier(schema)),
        [version],
    )
    for read_only in (True, False):
        with pytest.raises(TsdbError, match=advice) as info:
            PostgresTsdb(url, read_only=read_only)
        assert info.value.code == "TSDB_SCHEMA_VERSION"


def test_foreign_schema_with_clashing_tables_is_left_alone(url, schema, admin):
    ident = sql.Identifier(schema)
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
    admin.execute(sql.SQL("CREATE TABLE {}.points (x int)").format(ident))
    with pytest.raises(TsdbError, match="belongs to something else") as info:
        PostgresTsdb(url)
    assert info.value.code == "TSDB_SCHEMA_VERSION"
    assert _tables(admin, schema) == {"points"}


def test_existing_empty_schema_is_used(url, schema, admin):
    """A DBA may create the schema and grant it; the adapter then only creates tables."""
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    with PostgresTsdb(url) as db:
        db.ingest(runs=[run("R1")], nodes=[Node("A")], points=points([("R1", "A", 1, 1.0)]))
        assert point_count(db) == 1


def test_read_only_open_of_a_missing_schema_says_ingest_first(url, schema, admin):
    with pytest.raises(TsdbError, match="ingest data first") as info:
        PostgresTsdb(url, read_only=True)
    assert info.value.code == "TSDB_EMPTY"
    assert _tables(admin, schema) == set()


def test_every_unique_index_on_points_includes_the_time_column(url, schema, admin):
    """What TimescaleDB's create_hypertable requires of ``points`` (see docs/postgres.md)."""
    PostgresTsdb(url).close()
    rows = admin.execute(
        """SELECT i.indexrelid::regclass::text, array_agg(a.attname ORDER BY k.ord)
        FROM pg_index i
        JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) ON true
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE i.indrelid = %s::regclass AND i.indisunique
        GROUP BY 1""",
        [f'"{schema}".points'],
    ).fetchall()
    assert rows, "points has its primary key"
    for name, columns in rows:
        assert "ts" in columns, name
    assert [c for _, c in rows] == [["run_key", "node_key", "ts", "seq"]]


def test_page_query_is_an_index_range_scan_without_a_sort(url, schema, admin):
    with PostgresTsdb(url) as db:
        db.ingest(runs=[run("R1")], nodes=[Node("A")], points=points([("R1", "A", t, 1.0) for t in range(500)]))
    admin.execute(sql.SQL("ANALYZE {}.points").format(sql.Identifier(schema)))
    plan = admin.execute(
        sql.SQL(
            "EXPLAIN SELECT ts, value, state, seq FROM {}.points WHERE run_key = 1 AND node_key = 1 "
            "AND ts BETWEEN 10 AND 400 AND (ts, seq) > (20, 5) ORDER BY ts, seq LIMIT 11"
        ).format(sql.Identifier(schema))
    ).fetchall()
    text = "\n".join(r[0] for r in plan)
    assert "points_pkey" in text and "Sort" not in text, text


# ---- handle behaviour ----------------------------------------------------------------------------


def test_read_only_handle_refuses_ingest_and_closed_handle_refuses_everything(url):
    PostgresTsdb(url).close()
    db = PostgresTsdb(url, read_only=True)
    with pytest.raises(TsdbError, match="read-only"):
        db.ingest(nodes=[Node("X")])
    db.close()
    db.close()  # idempotent
    for call in (db.list_runs, db.list_nodes, db.availability_watermark, lambda: db.query_page("N", "R", 0, FAR)):
        with pytest.raises(TsdbError, match="closed"):
            call()
    assert "closed" in repr(db)


def test_read_only_session_cannot_write_even_with_sql(url):
    PostgresTsdb(url).close()
    with PostgresTsdb(url, read_only=True) as db:
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            db._c.execute(f"INSERT INTO {db._s}.nodes (node_key, node_id) VALUES (99, 'x')")


def test_query_page_rejects_a_non_positive_limit(url):
    with PostgresTsdb(url) as db, pytest.raises(ValueError):
        db.query_page("N0", "R0", 0, FAR, None, 0)


def test_one_connection_per_handle_reused_for_every_page(url):
    with PostgresTsdb(url) as db:
        db.ingest(runs=[run("R1")], nodes=[Node("A")], points=points([("R1", "A", t, 1.0) for t in range(300)]))
        pid = db._c.info.backend_pid
        s = fetch_node_series(db, "A", "R1", 0, FAR, page_limit=7)
        assert len(s) == 300 and s.pages == 43
        assert db._c.info.backend_pid == pid


def test_handle_reconnects_after_the_server_dropped_its_connection(url, admin):
    with PostgresTsdb(url) as db:
        db.ingest(runs=[run("R1")], nodes=[Node("A")], points=points([("R1", "A", 1, 2.0)]))
        pid = db._c.info.backend_pid
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        with pytest.raises(TsdbUnavailableError):  # the call that finds the connection dead fails cleanly
            db.list_runs()
        assert [r.run_id for r in db.list_runs()] == ["R1"]  # the next one reconnects
        assert db._c.info.backend_pid != pid
        assert fetch_node_series(db, "A", "R1", 0, FAR).value.tolist() == [2.0]


def test_pages_larger_than_one_server_round_trip(url, monkeypatch):
    monkeypatch.setattr(pg_adapter, "_MAX_ROWS_PER_QUERY", 3)
    rows = [("R1", "A", t // 3, float(i)) for i, t in enumerate(range(40))]
    with PostgresTsdb(url) as db:
        db.ingest(runs=[run("R1")], nodes=[Node("A")], points=points(rows))
        page = db.query_page("A", "R1", 0, FAR, None, 10)
        assert page.value.tolist() == [float(i) for i in range(10)] and not page.done
        rest = db.query_page("A", "R1", 0, FAR, page.next_cursor, 100)
        assert rest.value.tolist() == [float(i) for i in range(10, 40)] and rest.done
        assert db.query_page("A", "R1", 0, FAR, Cursor(3, int(page.seq[-1])), 1000).value.tolist()[0] == 10.0


# ---- ingest ----------------------------------------------------------------------------------


def test_points_are_stored_clustered_by_series_and_time(url, schema, admin):
    runs, nodes, pts = small_dataset()
    perm = np.random.default_rng(0).permutation(len(pts))  # file order shuffled: ingest sorts
    shuffled = PointColumns(*(getattr(pts, f)[perm] for f in ("run_id", "node_id", "ts", "value", "state")))
    with PostgresTsdb(url) as db:
        assert db.ingest(runs=runs, nodes=nodes, points=shuffled) == len(pts)
        page = db.query_page("N1", "R2", 0, FAR)
        file_rows = np.flatnonzero((shuffled.run_id == "R2") & (shuffled.node_id == "N1"))
        by_ts = file_rows[np.argsort(shuffled.ts[file_rows], kind="stable")]
        assert page.seq.tolist() == by_ts.tolist()  # seq = file row order
        assert point_count(db) == len(pts) and point_count(db, "R2", "N1") == 50
    rows = np.array(
        admin.execute(
            sql.SQL("SELECT run_key, node_key, ts, seq FROM {}.points ORDER BY ctid").format(sql.Identifier(schema))
        ).fetchall()
    )
    order = np.lexsort((rows[:, 3], rows[:, 2], rows[:, 1], rows[:, 0]))
    assert order.tolist() == list(range(len(rows)))  # heap order = (run, node, ts, seq)


def test_seq_and_keys_match_the_embedded_adapter(url, tmp_path):
    from aml_pipeline.tsdb.duckdb import DuckDBTsdb

    runs, nodes, pts = small_dataset(n_points=20)
    with PostgresTsdb(url) as pg, DuckDBTsdb(f"duckdb://{tmp_path / 't.duckdb'}", read_only=False) as dd:
        for db in (pg, dd):
            db.ingest(runs=runs[:2], nodes=nodes)
            db.ingest(runs=runs, points=pts)
            db.ingest(points=points([("R0", "N0", 5, 9.0)]))
        for r in runs:
            for n in nodes:
                a = fetch_node_series(pg, n.node_id, r.run_id, 0, FAR, page_limit=13)
                b = fetch_node_series(dd, n.node_id, r.run_id, 0, FAR, page_limit=13)
                for f in ("ts", "value", "state", "seq"):
                    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert pg.availability_watermark() == dd.availability_watermark()
        # versions hash what was ingested: the same history gives the same versions in both
        ids = [r.run_id for r in runs]
        assert pg.run_versions(ids) == dd.run_versions(ids) and len(pg.run_versions(ids)) == len(runs)
        for db in (pg, dd):
            db.ingest(points=points([("R0", "N0", 5, 9.0), ("R1", "N1", 5, 9.0)]), replace_runs=True)
            assert db.ingest(points=pts) == 2 * len(nodes) * 20  # R0's and R1's points again; R2's skipped
        assert pg.run_versions(ids) == dd.run_versions(ids)


def test_concurrent_ingests_get_disjoint_contiguous_seq_ranges(url):
    PostgresTsdb(url).close()
    n_writers, batches, batch = 4, 5, 400
    with PostgresTsdb(url) as db:
        db.ingest(runs=[run(f"R{w}") for w in range(n_writers)], nodes=[Node("A")])
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_writers)

    def writer(w: int) -> None:
        try:
            with PostgresTsdb(url) as db:
                barrier.wait()
                for b in range(batches):
                    rows = [(f"R{w}", "A", b * batch + i, float(b * batch + i)) for i in range(batch)]
                    db.ingest(points=points(rows))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(n_writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with PostgresTsdb(url) as db:
        all_seq = []
        for w in range(n_writers):
            s = fetch_node_series(db, "A", f"R{w}", 0, FAR, page_limit=333)
            assert s.value.tolist() == [float(i) for i in range(batches * batch)]
            # each ingest is one contiguous seq block, in row order
            blocks = s.seq.reshape(batches, batch)
            assert (np.diff(blocks, axis=1) == 1).all()
            assert (np.diff(blocks[:, 0]) > 0).all()
            all_seq.append(s.seq)
        seq = np.sort(np.concatenate(all_seq))
        assert seq.tolist() == list(range(n_writers * batches * batch))
        assert db.availability_watermark() == batches * batch - 1


def test_ingest_error_messages_name_the_offender(url):
    with PostgresTsdb(url) as db:
        with pytest.raises(IngestError, match="run_id 'bad id'"):
            db.ingest(runs=[Run("bad id", "L", "P", "R", None, None, 0, None)])
        with pytest.raises(IngestError, match="appears twice"):
            db.ingest(nodes=[Node("A"), Node("A")])
        with pytest.raises(IngestError, match="range_lo 2.0 is above range_hi 1.0"):
            db.ingest(nodes=[Node("A", "", 2.0, 1.0)])
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
            db.ingest(points=PointColumns(*(np.array(v) for v in (["R"], ["A"], [1.5], [1.0], [0]))))
        assert point_count(db) == 0
        assert db.availability_watermark() is None


def test_failure_inside_the_copy_rolls_back_runs_nodes_and_points(url, monkeypatch):
    with PostgresTsdb(url) as db:
        db.ingest(runs=[run("R1")], nodes=[Node("A")], points=points([("R1", "A", 1, 1.0)]))
        # A corrupt COPY stream: the server rejects it after the upserts ran in the transaction.
        monkeypatch.setattr(pg_adapter, "_PGCOPY_TRAILER", b"\x00\x07")
        with pytest.raises(IngestError, match="nothing written"):
            db.ingest(runs=[run("R2")], nodes=[Node("B")], points=points([("R2", "B", 50, 1.0)]))
        monkeypatch.undo()
        assert [r.run_id for r in db.list_runs()] == ["R1"]
        assert [n.node_id for n in db.list_nodes()] == ["A"]
        assert point_count(db) == 1 and db.availability_watermark() == 1
        assert db.ingest(runs=[run("R2")], nodes=[Node("B")], points=points([("R2", "B", 50, 1.0)])) == 1
        assert int(db.query_page("B", "R2", 0, FAR).seq[0]) == 1  # the failed ingest used no seq


# ---- schema version 1 -> 2 -----------------------------------------------------------------

# The tables of schema version 1 exactly as aml_pipeline created them before run versions existed.
V1_DDL = (
    "CREATE SCHEMA {s}",
    "CREATE TABLE {s}.schema_version (version integer NOT NULL, applied_at_ms bigint NOT NULL)",
    "CREATE TABLE {s}.ingest_state (id boolean PRIMARY KEY DEFAULT true CHECK (id), next_seq bigint NOT NULL, max_ts bigint)",
    "INSERT INTO {s}.ingest_state (id, next_seq, max_ts) VALUES (true, 0, NULL)",
    """CREATE TABLE {s}.runs (run_key integer PRIMARY KEY, run_id text NOT NULL UNIQUE, line_id text NOT NULL,
        product_id text NOT NULL, recipe_id text NOT NULL, recipe_version integer, recipe_content_hash text,
        started_at bigint NOT NULL, ended_at bigint,
        evidence_source text NOT NULL CHECK (evidence_source IN ('simulation', 'real', 'unassessed')),
        context_confirmed boolean NOT NULL DEFAULT false, CHECK (ended_at IS NULL OR ended_at >= started_at))""",
    """CREATE TABLE {s}.nodes (node_key integer PRIMARY KEY, node_id text NOT NULL UNIQUE,
        unit text NOT NULL DEFAULT '', range_lo double precision, range_hi double precision)""",
    """CREATE TABLE {s}.points (ts bigint NOT NULL, seq bigint NOT NULL, value double precision NOT NULL,
        run_key integer NOT NULL, node_key integer NOT NULL, state integer NOT NULL,
        CONSTRAINT points_pkey PRIMARY KEY (run_key, node_key, ts, seq))""",
    """CREATE VIEW {s}.points_by_id AS SELECT r.run_id, n.node_id, p.ts, p.value, p.state, p.seq
        FROM {s}.points p JOIN {s}.runs r USING (run_key) JOIN {s}.nodes n USING (node_key)""",
    "INSERT INTO {s}.schema_version VALUES (1, 0)",
    """INSERT INTO {s}.runs VALUES (1, 'R1', 'L1', 'P1', 'R1', 1, 'h', 0, 1000000, 'simulation', true),
        (2, 'R2', 'L1', 'P1', 'R1', 1, 'h', 0, NULL, 'simulation', true),
        (3, 'R3', 'L1', 'P1', 'R1', NULL, NULL, 0, 10, 'unassessed', false)""",
    "INSERT INTO {s}.nodes VALUES (1, 'A', '', NULL, NULL), (2, 'B', 'bar', 0, 1)",
    """INSERT INTO {s}.points (ts, seq, value, run_key, node_key, state) VALUES
        (10, 0, 1.0, 1, 1, 0), (20, 1, 2.0, 1, 1, 0), (10, 2, 3.0, 2, 1, 0), (10, 3, 4.0, 1, 2, 1)""",
    "UPDATE {s}.ingest_state SET next_seq = 4, max_ts = 20",
)


def test_a_version_1_schema_is_read_as_it_is_then_migrated_in_place(url, schema, admin):
    ident = sql.Identifier(schema)
    with admin.transaction():
        for ddl in V1_DDL:
            admin.execute(sql.SQL(ddl).format(s=ident))

    def versions_recorded() -> list[int]:
        rows = admin.execute(sql.SQL("SELECT version FROM {}.schema_version ORDER BY 1").format(ident)).fetchall()
        return [r[0] for r in rows]

    with PostgresTsdb(url, read_only=True) as ro:  # a build on an old schema keeps working
        assert ro.schema_version == 1
        old = ro.run_versions(["R1", "R2", "R3", "NOPE"])
        assert set(old) == {"R1", "R2", "R3"} and len(set(old.values())) == 3
        assert fetch_node_series(ro, "A", "R1", 0, FAR).value.tolist() == [1.0, 2.0]
    assert versions_recorded() == [1]  # reading did not migrate

    with PostgresTsdb(url) as rw:  # the first read-write open migrates, in one transaction
        assert rw.schema_version == 2
        assert rw.run_versions(["R1", "R2", "R3"]) == old  # migrating makes no run stale
        assert rw.ingest(points=points([("R1", "A", 10, 1.0), ("R2", "A", 10, 3.0)])) == 0  # stored already
        assert rw.ingest(points=points([("R1", "A", 30, 5.0)])) == 1
        after = rw.run_versions(["R1", "R2", "R3"])
        assert after["R1"] != old["R1"] and after["R2"] == old["R2"] and after["R3"] == old["R3"]
        assert fetch_node_series(rw, "A", "R1", 0, FAR).seq.tolist() == [0, 1, 4]
    assert versions_recorded() == [1, 2]
    counts = dict(admin.execute(sql.SQL("SELECT run_key, point_count FROM {}.run_state").format(ident)).fetchall())
    assert counts == {1: 4, 2: 1, 3: 0}


def test_a_failed_migration_leaves_version_1(url, schema, admin, monkeypatch):
    ident = sql.Identifier(schema)
    with admin.transaction():
        for ddl in V1_DDL:
            admin.execute(sql.SQL(ddl).format(s=ident))

    def broken(self, states):
        raise psycopg.errors.DiskFull("could not extend file: No space left on device")

    monkeypatch.setattr(pg_adapter._Statements, "save_run_states", broken)
    with pytest.raises(DiskFullError) as info:
        PostgresTsdb(url)
    assert info.value.one_line().startswith(f"DISK_FULL: {redact_url(url)} (PostgreSQL server: ")
    assert not admin.execute(
        "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = 'run_state'", [schema]
    ).fetchone()
    monkeypatch.undo()
    with PostgresTsdb(url) as rw:
        assert rw.schema_version == 2


def test_an_ingest_waits_for_another_ones_commit_at_most_its_lock_timeout(url, schema, admin):
    with PostgresTsdb(url) as db:
        db.ingest(runs=[run("R1")], nodes=[Node("A")])
    ident = sql.Identifier(schema)
    with psycopg.connect(admin.info.dsn, autocommit=False) as other:
        other.execute(sql.SQL("SELECT next_seq FROM {}.ingest_state FOR UPDATE").format(ident))  # an ingest in progress
        with PostgresTsdb(url, lock_timeout_s=0.3) as db:
            with pytest.raises(TsdbBusyError, match="another ingest") as info:
                db.ingest(points=points([("R1", "A", 1, 1.0)]))
            assert info.value.code == "TSDB_BUSY"
            other.rollback()
            assert db.ingest(points=points([("R1", "A", 1, 1.0)])) == 1
