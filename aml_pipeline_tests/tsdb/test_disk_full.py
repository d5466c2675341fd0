"""A full disk during an ingest is one ``DISK_FULL`` line, nothing is written, and the TSDB stays
usable: on a small tmpfs that really fills up (DuckDB file and WAL; a PostgreSQL tablespace).

Mounting needs root, as in CI; these tests never skip: without root they fail, saying why.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from psycopg import sql

from aml_pipeline.errors import DiskFullError
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline.tsdb.port import Node, PointColumns, Run
from aml_pipeline_tests.tsdb.series import fetch_node_series
from aml_pipeline.tsdb.postgres import PostgresTsdb
from aml_pipeline.urls import redact_url
from aml_pipeline_tests.thin_fs import thin_ext4
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema

REPO = Path(__file__).resolve().parents[2]
FAR = 2**62


@contextlib.contextmanager
def small_filesystem(size: str, *, uid: int = 0, gid: int = 0) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on a fresh directory under /tmp, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.fail("DISK_FULL tests mount a small tmpfs and need root (CI runs them as root)")
    where = Path(tempfile.mkdtemp(prefix="aml-full-", dir="/tmp"))
    os.chmod(where, 0o755)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700,uid={uid},gid={gid}", "tmpfs", str(where)],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            where.rmdir()


T0 = 1_735_718_400_000  # 2025-01-01T08:00:00Z: a file ingested through the CLI holds a plant's times


def noisy_points(run_id: str, node_ids: list[str], n: int, seed: int) -> PointColumns:
    """Random values compress badly: ``n`` points take about 16 bytes each on disk."""
    rng = np.random.default_rng(seed)
    return PointColumns(
        np.full(n, run_id, dtype=object),
        np.array(node_ids, dtype=object)[rng.integers(0, len(node_ids), n)],
        np.sort(rng.integers(0, 10**9, n)).astype(np.int64),
        rng.normal(size=n),
        np.zeros(n, np.int32),
    )


RUNS = [Run(f"R{i}", "L1", "P1", "RC", 1, "h", 0, 10**9, "simulation", True) for i in range(2)]
NODES = [Node("A"), Node("B")]


def state_of(db) -> dict:
    return {
        "versions": db.run_versions([r.run_id for r in RUNS]),
        "series": {
            (r.run_id, n.node_id): fetch_node_series(db, n.node_id, r.run_id, -FAR, FAR).value.tolist()
            for r in RUNS
            for n in NODES
        },
        "runs": db.list_runs(finished_only=False),
    }


def test_duckdb_file_and_wal_filling_up_is_one_line_and_writes_nothing(tmp_path):
    with small_filesystem("8m") as fs:
        ballast = fs / "ballast"  # what the user deletes to make room again
        ballast.write_bytes(b"\0" * 2 * 2**20)
        url = f"duckdb://{fs / 'tsdb.duckdb'}"
        with DuckDBTsdb(url, read_only=False) as db:
            db.ingest(runs=RUNS, nodes=NODES, points=noisy_points("R0", ["A", "B"], 2_000, 1))
            before = state_of(db)
            # Too big for the file system: written straight into the database file.
            with pytest.raises(DiskFullError) as info:
                db.ingest(points=noisy_points("R1", ["A", "B"], 1_000_000, 2))
            line = info.value.one_line()
            assert line.startswith(f"DISK_FULL: {fs}/tsdb.duckdb"), line
            assert "ingest of 1,000,000 points and 0 runs failed, nothing written" in line
            assert "no space left on the device" in line and "\n" not in line
            assert state_of(db) == before
            # Small enough for the file but not for the WAL: the commit fails.
            filler = fs / "filler"
            free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
            filler.write_bytes(b"\0" * max(0, free - 64 * 1024))
            with pytest.raises(DiskFullError) as info:
                db.ingest(points=noisy_points("R1", ["A", "B"], 20_000, 3))
            assert info.value.one_line().startswith(f"DISK_FULL: {fs}/tsdb.duckdb")
            assert state_of(db) == before
            filler.unlink()
            ballast.unlink()
            # The same handle is still usable once there is room again.
            assert db.ingest(points=noisy_points("R1", ["A"], 500, 4)) == 500
            after = state_of(db)
        assert after["versions"]["R0"] == before["versions"]["R0"]
        assert after["versions"]["R1"] != before["versions"]["R1"]
        with DuckDBTsdb(url) as ro:  # and the file reopens with everything committed
            assert state_of(ro) == after


def test_cli_ingest_into_a_new_file_on_a_full_disk_leaves_nothing(tmp_path):
    points = noisy_points("R0", ["A", "B"], 1_000_000, 5)
    pq.write_table(
        pa.table({"run_id": points.run_id.astype(str), "node_id": points.node_id.astype(str), "ts": T0 + points.ts,
                  "value": points.value, "state": points.state}),
        tmp_path / "points.parquet",
    )  # fmt: skip
    (tmp_path / "runs.csv").write_text(f"run_id,line_id,product_id,recipe_id,started_at,ended_at\nR0,L1,P1,RC,{T0},{T0 + 10**9}\n")
    (tmp_path / "nodes.csv").write_text("node_id\nA\nB\n")
    with small_filesystem("4m") as fs:
        target = fs / "plant" / "tsdb.duckdb"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = subprocess.run(
            [sys.executable, "-m", "aml_pipeline.cli", "ingest", "--tsdb", f"duckdb://{target}",
             "--points", str(tmp_path / "points.parquet"), "--runs", str(tmp_path / "runs.csv"),
             "--nodes", str(tmp_path / "nodes.csv")],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith(f"DISK_FULL: {fs}/plant/tsdb.duckdb"), out.stderr
        assert "Traceback" not in out.stderr
        assert list(fs.iterdir()) == []  # no database, WAL, lock file or the directory made for them


def test_creating_a_tsdb_on_a_full_disk_is_disk_full_and_leaves_nothing():
    with small_filesystem("1m") as fs:
        (fs / "filler").write_bytes(b"\0" * (os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize - 4096))
        with pytest.raises(DiskFullError) as info:
            DuckDBTsdb(f"duckdb://{fs / 'tsdb.duckdb'}", read_only=False)
        assert info.value.one_line().startswith(f"DISK_FULL: {fs}")
        assert sorted(p.name for p in fs.iterdir()) == ["filler"]


@pytest.fixture
def server_admin(postgres_url) -> Iterator[psycopg.Connection]:
    with psycopg.connect(postgres_url, autocommit=True) as con:
        yield con


def test_postgres_server_out_of_space_is_one_line_and_writes_nothing(postgres_url, server_admin):
    """The schema's tables live in a tablespace on a small tmpfs (``default_tablespace`` through the
    URL's libpq ``options``): the server's ENOSPC (SQLSTATE 53100) becomes DISK_FULL."""
    data_dir = server_admin.execute("SELECT current_setting('data_directory')").fetchone()[0]
    owner = os.stat(data_dir)
    schema, space = f"t_{uuid.uuid4().hex[:16]}", f"aml_full_{uuid.uuid4().hex[:8]}"
    with small_filesystem("8m", uid=owner.st_uid, gid=owner.st_gid) as fs:
        ballast = fs / "ballast"  # what the DBA deletes to make room again
        ballast.write_bytes(b"\0" * 2 * 2**20)
        server_admin.execute(sql.SQL("CREATE TABLESPACE {} LOCATION {}").format(sql.Identifier(space), sql.Literal(str(fs))))
        try:
            url = with_schema(postgres_url, schema) + f"&options=-c%20default_tablespace%3D{space}"
            with PostgresTsdb(url) as db:
                db.ingest(runs=RUNS, nodes=NODES, points=noisy_points("R0", ["A", "B"], 2_000, 1))
                before = state_of(db)
                with pytest.raises(DiskFullError) as info:
                    db.ingest(points=noisy_points("R1", ["A", "B"], 400_000, 2))
                line = info.value.one_line()
                assert line.startswith(f"DISK_FULL: {redact_url(url)} (PostgreSQL server: "), line
                assert "No space left on device" in line and "nothing written" in line and "\n" not in line
                assert state_of(db) == before  # rolled back, and the handle still reads
                ballast.unlink()
                assert db.ingest(points=noisy_points("R1", ["A"], 500, 4)) == 500
                assert state_of(db)["versions"]["R0"] == before["versions"]["R0"]
        finally:
            drop_schema(postgres_url, schema)
            server_admin.execute(sql.SQL("DROP TABLESPACE IF EXISTS {}").format(sql.Identifier(space)))


def test_duckdb_on_a_disk_that_fills_at_fsync_is_one_line_and_loses_nothing():
    """ext4 on a thin loop device (``thin_fs.py``) accepts the ingest's writes and reports ENOSPC
    when DuckDB makes its commit durable: one DISK_FULL line; once there is room, the file opens
    with exactly what was committed before, and the same ingest succeeds."""
    with thin_ext4(64) as fs:
        url = f"duckdb://{fs.root / 'tsdb.duckdb'}"
        with DuckDBTsdb(url, read_only=False) as db:
            db.ingest(runs=RUNS, nodes=NODES, points=noisy_points("R0", ["A", "B"], 2_000, 1))
            before = state_of(db)
        with DuckDBTsdb(url, read_only=False) as db:
            fs.exhaust()
            with pytest.raises(DiskFullError) as info:
                db.ingest(points=noisy_points("R1", ["A", "B"], 200_000, 2))
            line = info.value.one_line()
            assert line.startswith(f"DISK_FULL: {fs.root}/tsdb.duckdb"), line
            assert "nothing written" in line and "\n" not in line
            assert "Could not fsync" in str(info.value.__context__)  # DuckDB's own words: at fsync
        fs.relieve()
        with DuckDBTsdb(url) as ro:
            assert state_of(ro) == before
        with DuckDBTsdb(url, read_only=False) as db:
            assert db.ingest(points=noisy_points("R1", ["A", "B"], 200_000, 2)) == 200_000
            after = state_of(db)
        assert after["versions"]["R0"] == before["versions"]["R0"] and after["versions"]["R1"] != before["versions"]["R1"]
