"""Reading CSV/Parquet into the port's types; every error names file, row and column."""

from __future__ import annotations

import os

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aml_pipeline.errors import IngestError
from aml_pipeline.simulate.plant import simulate_plant, write_plant_files
from aml_pipeline.tsdb.duckdb import DuckDBTsdb
from aml_pipeline.tsdb.ingest import (
    ingest_files,
    normalise_column_name,
    read_nodes,
    read_points,
    read_runs,
)
from aml_pipeline.tsdb.port import Node, Run
from aml_pipeline_tests.tsdb.series import fetch_node_series

FAR = 2**62
T0 = 1_735_718_400_000  # 2025-01-01T08:00:00Z


def write(path: Path, text: str) -> Path:
    path.write_text(text.lstrip("\n"))
    return path


RUNS_CSV = """
run_id,line_id,product_id,recipe_id,recipe_version,recipe_content_hash,started_at,ended_at,evidence_source,context_confirmed
B1,L1,P100,R7,3,abc,1735718400000,1735719600000,simulation,true
B2,L1,P100,R7,,,2025-01-01T09:00:00Z,,real,false
"""
NODES_CSV = """
node_id,unit,range_lo,range_hi
TI101,degC,0,150
FIC200_SP,kg/h,,
"""
POINTS_CSV = """
run_id,node_id,ts,value,state
B1,TI101,1735718400000,50.5,0
B1,TI101,1735718401000,nan,2
B1,FIC200_SP,1735718400500,20,0
B2,TI101,1735722000000,inf,0
B2,TI101,1735722000000,-inf,1
B1,TI101,1735718402000,,0
"""


@pytest.fixture
def db(tmp_path):
    with DuckDBTsdb(f"duckdb://{tmp_path / 'tsdb.duckdb'}", read_only=False) as handle:
        yield handle


@pytest.fixture
def files(tmp_path):
    return {
        "runs": write(tmp_path / "runs.csv", RUNS_CSV),
        "nodes": write(tmp_path / "nodes.csv", NODES_CSV),
        "points": write(tmp_path / "points.csv", POINTS_CSV),
    }


def test_csv_round_trip(db, files):
    calls = []
    counts = ingest_files(db, **files, progress=lambda done, total: calls.append((done, total)))
    assert counts == {"runs": 2, "nodes": 2, "points": 6, "skipped": 0}
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert db.get_run("B1") == Run("B1", "L1", "P100", "R7", 3, "abc", T0, T0 + 1_200_000, "simulation", True)
    assert db.get_run("B2") == Run("B2", "L1", "P100", "R7", None, None, T0 + 3_600_000, None, "real", False)
    assert db.list_nodes() == [Node("FIC200_SP", "kg/h", None, None), Node("TI101", "degC", 0.0, 150.0)]
    s = fetch_node_series(db, "TI101", "B1", 0, FAR)
    assert s.ts.tolist() == [T0, T0 + 1000, T0 + 2000]
    np.testing.assert_array_equal(s.value, [50.5, np.nan, np.nan])  # nan and empty -> NaN
    assert s.state.tolist() == [0, 2, 0]
    s2 = fetch_node_series(db, "TI101", "B2", 0, FAR)
    assert s2.value.tolist() == [np.inf, -np.inf] and s2.state.tolist() == [0, 1]


def test_iso_timestamps_with_zones_naive_as_utc_and_sub_ms_floored(tmp_path):
    path = write(
        tmp_path / "p.csv",
        """
run_id,node_id,ts,value,state
B1,N,2025-01-01T08:00:00Z,1,0
B1,N,2025-01-01T09:00:00.250+01:00,2,0
B1,N,2025-01-01 08:00:00.5,3,0
B1,N,2025-01-01T08:00:01.0009Z,4,0
B1,N,1735718400007,5,0
B1,N,2025-01-01T03:00:02-05:00,6,0
""",
    )
    p = read_points(path)
    assert p.ts.tolist() == [T0, T0 + 250, T0 + 500, T0 + 1000, T0 + 7, T0 + 2000]
    assert p.ts.dtype == np.int64 and p.value.dtype == np.float64 and p.state.dtype == np.int32


def test_camel_case_and_odd_header_spelling(tmp_path):
    runs = write(
        tmp_path / "runs.csv",
        """
runId,lineId,productId,recipeId,startedAt,endedAt,evidenceSource,contextConfirmed,recipeVersion,recipeContentHash
B1,L1,P1,R1,1735718400000,1735718400010,unassessed,yes,7,h
""",
    )
    assert read_runs(runs) == [Run("B1", "L1", "P1", "R1", 7, "h", T0, T0 + 10, "unassessed", True)]
    nodes = write(tmp_path / "nodes.csv", "NodeId , Unit,rangeLo,RANGE_HI\nA,bar,-1,1\n")
    assert read_nodes(nodes) == [Node("A", "bar", -1.0, 1.0)]
    assert normalise_column_name("recipeContentHash") == "recipe_content_hash"
    assert normalise_column_name(" run id ") == "run_id"


def test_optional_run_columns_default(tmp_path):
    runs = write(tmp_path / "runs.csv", "run_id,line_id,product_id,recipe_id,started_at,ended_at\nB1,L,P,R,1735718400005,\n")
    assert read_runs(runs) == [Run("B1", "L", "P", "R", None, None, T0 + 5, None, "unassessed", False)]
    nodes = write(tmp_path / "nodes.csv", "node_id\nA\n")
    assert read_nodes(nodes) == [Node("A", "", None, None)]


def test_blanks_around_numbers_are_tolerated(tmp_path):
    p = read_points(write(tmp_path / "p.csv", "run_id,node_id,ts,value,state\nB,N, 1735718400007 , 2.5 , 1 \nB,N,1735718400008,  ,0\n"))
    assert p.ts.tolist() == [T0 + 7, T0 + 8] and p.state.tolist() == [1, 0]
    np.testing.assert_array_equal(p.value, [2.5, np.nan])


def test_extra_columns_are_ignored_and_header_only_file_is_empty(tmp_path):
    p = read_points(write(tmp_path / "p.csv", "run_id,node_id,ts,value,state,comment\nB,N,1735718400001,2,0,hello\n"))
    assert len(p) == 1 and p.run_id.tolist() == ["B"]
    empty = read_points(write(tmp_path / "e.csv", "run_id,node_id,ts,value,state\n"))
    assert len(empty) == 0


def test_parquet_with_typed_and_string_columns(tmp_path, db):
    ts_aware = pa.array([T0, T0 + 1000], type=pa.timestamp("ms", tz="Europe/Berlin"))
    ts_naive = pa.array([T0 * 1000 + 1500, T0 * 1000 + 2999], type=pa.timestamp("us"))
    pq.write_table(
        pa.table({"runId": ["B1", "B1"], "nodeId": ["A", "A"], "ts": ts_aware, "value": [1.0, None], "state": pa.array([0, 3], pa.int16())}),
        tmp_path / "p1.parquet",
    )
    pq.write_table(
        pa.table({"run_id": ["B1", "B1"], "node_id": ["A", "A"], "ts": ts_naive, "value": [3, 4], "state": [0, 0]}),
        tmp_path / "p2.parquet",
    )
    pq.write_table(
        pa.table({"run_id": ["B1"], "node_id": ["A"], "ts": ["2025-01-01T08:00:05Z"], "value": ["7.25"], "state": ["0"]}),
        tmp_path / "p3.parquet",
    )
    pq.write_table(
        pa.table(
            {
                "run_id": ["B1"],
                "line_id": ["L"],
                "product_id": ["P"],
                "recipe_id": ["R"],
                "started_at": pa.array([T0], pa.timestamp("ms", tz="UTC")),
                "ended_at": pa.array([None], pa.timestamp("ms", tz="UTC")),
                "recipe_version": pa.array([2.0]),
                "context_confirmed": [True],
            }
        ),
        tmp_path / "runs.parquet",
    )
    pq.write_table(pa.table({"node_id": ["A"], "range_lo": [None], "range_hi": [3.5]}), tmp_path / "nodes.pq")
    counts = ingest_files(
        db,
        points=[tmp_path / "p1.parquet", tmp_path / "p2.parquet", tmp_path / "p3.parquet"],
        runs=tmp_path / "runs.parquet",
        nodes=tmp_path / "nodes.pq",
    )
    assert counts == {"runs": 1, "nodes": 1, "points": 5, "skipped": 0}
    assert db.get_run("B1") == Run("B1", "L", "P", "R", 2, None, T0, None, "unassessed", True)
    assert db.list_nodes() == [Node("A", "", None, 3.5)]
    s = fetch_node_series(db, "A", "B1", 0, FAR)
    # tz-aware: the instant; naive: taken as UTC, 1.5 ms and 2.999 ms floored
    assert s.ts.tolist() == [T0, T0 + 1, T0 + 2, T0 + 1000, T0 + 5000]
    np.testing.assert_array_equal(s.value, [1.0, 3.0, 4.0, np.nan, 7.25])
    assert s.state.tolist() == [0, 0, 0, 3, 0]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_simulated_plant_files_round_trip(tmp_path, db, fmt):
    plant = simulate_plant(n_runs=3, run_minutes=5)
    paths = write_plant_files(plant, tmp_path / fmt, fmt=fmt)
    p = read_points(paths["points"])
    for name in ("run_id", "node_id", "ts", "state"):
        assert getattr(p, name).tolist() == getattr(plant.points, name).tolist()
    np.testing.assert_array_equal(p.value, plant.points.value)
    assert read_runs(paths["runs"]) == plant.runs
    assert read_nodes(paths["nodes"]) == plant.nodes
    counts = ingest_files(db, **paths)
    assert counts == {"runs": 3, "nodes": len(plant.nodes), "points": len(plant.points), "skipped": 0}
    assert db.list_runs(finished_only=False) == plant.runs


# ---- errors ---------------------------------------------------------------------------------

GOOD_POINTS = "run_id,node_id,ts,value,state\nB1,TI101,1735718400001,1.0,0\nB1,TI101,1735718400002,2.0,0\n"


def bad_points(row: str) -> str:
    """The good file with one more data row (line 4)."""
    return GOOD_POINTS + row + "\n"


@pytest.mark.parametrize(
    ("text", "column", "problem"),
    [
        (bad_points("B1,TI101,1735718400003,abc,0"), "value", "not a number: 'abc'"),
        (bad_points("B1,TI101,1735718400003,1.0.0,0"), "value", "not a number"),
        (bad_points("B1,TI101,1735718400003,1e400,0"), "value", "'1e400' is beyond the range of a 64-bit float"),
        (bad_points("B1,TI101,1735718400003,-1E999,0"), "value", "'-1E999' is beyond the range of a 64-bit float"),
        (bad_points("B1,TI101,yesterday,1,0"), "ts", "unparseable timestamp 'yesterday'"),
        (bad_points("B1,TI101,2025-13-01T00:00:00Z,1,0"), "ts", "unparseable timestamp"),
        (bad_points("B1,TI101,,1,0"), "ts", "empty value"),
        (bad_points("B1,TI101,99999999999999999999,1,0"), "ts", "out of range"),
        (bad_points("B1,TI101,1735718400003,1,"), "state", "empty value"),
        (bad_points("B1,TI101,1735718400003,1,1.5"), "state", "not an integer: '1.5'"),
        (bad_points("B1,TI101,1735718400003,1,3000000000"), "state", "out of range"),
        (bad_points("B1,TI 101,1735718400003,1,0"), "node_id", "invalid id 'TI 101'"),
        (bad_points("../etc,TI101,1735718400003,1,0"), "run_id", "invalid id '../etc'"),
        (bad_points(",TI101,1735718400003,1,0"), "run_id", "missing run_id"),
    ],
)
def test_points_errors_name_file_line_and_column(tmp_path, text, column, problem):
    path = write(tmp_path / "points.csv", text)
    with pytest.raises(IngestError) as info:
        read_points(path)
    msg = info.value.message
    assert msg.startswith(f"{path}: line 4, column '{column}': "), msg
    assert problem in msg
    assert "\n" not in msg


def test_first_bad_row_is_found_in_a_large_file(tmp_path):
    n = 200_000
    ts = (T0 + np.arange(n)).astype(str).astype(object)
    ts[150_123] = "12:00"
    ts[180_000] = "also bad"
    table = pa.table({"run_id": ["B"] * n, "node_id": ["N"] * n, "ts": pa.array(ts, pa.string()), "value": np.ones(n), "state": np.zeros(n, np.int32)})
    pq.write_table(table, tmp_path / "big.parquet")
    with pytest.raises(IngestError, match=r"big\.parquet: row 150124, column 'ts': unparseable timestamp '12:00'"):
        read_points(tmp_path / "big.parquet")
    values = np.full(n, "1.5", dtype=object)
    values[123_456] = "1,5"
    table = table.set_column(2, "ts", pa.array(T0 + np.arange(n))).set_column(3, "value", pa.array(values, pa.string()))
    pq.write_table(table, tmp_path / "big2.parquet")
    with pytest.raises(IngestError, match=r"big2\.parquet: row 123457, column 'value': not a number: '1,5'"):
        read_points(tmp_path / "big2.parquet")


def test_missing_column(tmp_path):
    path = write(tmp_path / "points.csv", "run_id,node_id,ts,value\nB,N,1,2\n")
    with pytest.raises(IngestError, match=r"points\.csv: missing column 'state'"):
        read_points(path)
    path = write(tmp_path / "runs.csv", "runId,lineId,productId,recipeId,startedAt\nB,L,P,R,1\n")
    with pytest.raises(IngestError, match=r"runs\.csv: missing column 'ended_at'"):
        read_runs(path)


RUNS_HEADER = "run_id,line_id,product_id,recipe_id,recipe_version,started_at,ended_at,evidence_source,context_confirmed\n"


@pytest.mark.parametrize(
    ("rows", "line", "column", "problem"),
    [
        ("B1,L,P,R,1,1735718400000,1735718400010,simulation,true\nB1,L,P,R,1,1735718400020,1735718400030,simulation,true", 3, "run_id", "duplicate run_id 'B1' (first at line 2)"),
        ("B1,L,P,R,1,1735718400100,1735718400050,simulation,true", 2, "ended_at", "ended_at 1735718400050 is before started_at 1735718400100"),
        ("B1,L,P,R,1,1735718400000,1735718400010,measured,true", 2, "evidence_source", "unknown evidence_source 'measured'"),
        ("B1,L,P,R,v3,1735718400000,1735718400010,real,true", 2, "recipe_version", "not an integer: 'v3'"),
        ("B1,L,P,R,1,1735718400000,1735718400010,real,maybe", 2, "context_confirmed", "not a boolean: 'maybe'"),
        ("B1,L,P,R,1,,1735718400010,real,true", 2, "started_at", "empty value"),
        ("B1,L,P,R,1,1735718400000,soon,real,true", 2, "ended_at", "unparseable timestamp 'soon'"),
        ("B1,,P,R,1,1735718400000,1735718400010,real,true", 2, "line_id", "missing line_id"),
        ("B/1,L,P,R,1,1735718400000,1735718400010,real,true", 2, "run_id", "invalid id 'B/1'"),
    ],
)
def test_runs_errors(tmp_path, rows, line, column, problem):
    path = write(tmp_path / "runs.csv", RUNS_HEADER + rows + "\n")
    with pytest.raises(IngestError) as info:
        read_runs(path)
    assert info.value.message.startswith(f"{path}: line {line}, column '{column}': ")
    assert problem in info.value.message


@pytest.mark.parametrize(
    ("rows", "column", "problem"),
    [
        ("A,u,1,x", "range_hi", "not a number: 'x'"),
        ("A,u,2,1", "range_hi", "below range_lo"),
        ("A,u,nan,1", "range_lo", "NaN is not a range bound"),
        ("A,u,inf,inf", "range_lo", "inf is not a range bound"),
        ("A,u,1,-inf", "range_hi", "-inf is not a range bound"),
        ("A,u,,\nA,v,,", "node_id", "duplicate node_id 'A'"),
    ],
)
def test_nodes_errors(tmp_path, rows, column, problem):
    path = write(tmp_path / "nodes.csv", "node_id,unit,range_lo,range_hi\n" + rows + "\n")
    with pytest.raises(IngestError) as info:
        read_nodes(path)
    assert f", column '{column}': " in info.value.message and problem in info.value.message
    assert info.value.message.startswith(f"{path}: line ")


def test_parquet_errors_count_rows_from_one(tmp_path):
    pq.write_table(
        pa.table({"run_id": ["B", "B", "B"], "node_id": ["N", "N", "N"], "ts": [1.0, 2.0, 2.5], "value": [1.0, 2.0, 3.0], "state": [0, 0, 0]}),
        tmp_path / "p.parquet",
    )
    with pytest.raises(IngestError, match=r"p\.parquet: row 3, column 'ts': not an integer: 2\.5"):
        read_points(tmp_path / "p.parquet")


def test_unsupported_or_unreadable_files(tmp_path):
    with pytest.raises(IngestError, match="unsupported file type"):
        read_points(write(tmp_path / "p.json", "{}"))
    with pytest.raises(IngestError, match="no such file"):
        read_points(tmp_path / "nope.csv")
    os.mkfifo(tmp_path / "pipe.csv")  # exists, but no file to read (opening it would wait for a writer)
    with pytest.raises(IngestError, match=r"pipe\.csv: not a regular file \(a pipe, socket or device\)"):
        read_points(tmp_path / "pipe.csv")
    with pytest.raises(IngestError, match="empty file"):
        read_points(write(tmp_path / "empty.csv", ""))
    with pytest.raises(IngestError, match=r"p\.csv: line 2: 7 fields where the header has 5$"):
        read_points(write(tmp_path / "p.csv", "run_id,node_id,ts,value,state\nB,N,1,2,0,9,9\n"))
    with pytest.raises(IngestError, match="both mean 'run_id'"):
        read_points(write(tmp_path / "dup.csv", "run_id,runId,node_id,ts,value,state\nB,B,N,1,2,0\n"))


def test_points_must_reference_known_runs_and_nodes_nothing_half_ingested(tmp_path, db, files):
    points = write(tmp_path / "points2.csv", POINTS_CSV + "B9,TI101,1735718400001,1,0\n")
    with pytest.raises(IngestError) as info:
        ingest_files(db, points=points, runs=files["runs"], nodes=files["nodes"])
    assert info.value.message.startswith(f"{points}: line 8, column 'run_id': run 'B9'")
    assert db.list_runs(finished_only=False) == [] and db.list_nodes() == []

    # a later file in the same call fails: the earlier (valid) files are not written either
    bad = write(tmp_path / "points3.csv", "run_id,node_id,ts,value,state\nB1,TI101,1735718400001,oops,0\n")
    with pytest.raises(IngestError, match=r"points3\.csv: line 2, column 'value'"):
        ingest_files(db, points=[files["points"], bad], runs=files["runs"], nodes=files["nodes"])
    assert db.list_runs(finished_only=False) == [] and db.availability_watermark() is None

    # runs and nodes already in the database count as known
    ingest_files(db, runs=files["runs"], nodes=files["nodes"])
    unknown_node = write(tmp_path / "points4.csv", "run_id,node_id,ts,value,state\nB1,TI101,1735718400001,1,0\nB1,XX9,1735718400001,1,0\n")
    with pytest.raises(IngestError, match=r"points4\.csv: line 3, column 'node_id': node 'XX9'"):
        ingest_files(db, points=unknown_node)
    assert ingest_files(db, points=files["points"]) == {"runs": 0, "nodes": 0, "points": 6, "skipped": 0}


def test_the_same_run_in_two_runs_files_is_refused(tmp_path, db, files):
    other = write(tmp_path / "runs2.csv", RUNS_CSV)
    with pytest.raises(IngestError, match=re.escape(f"{other}: run_id 'B1' is also in {files['runs']}")):
        ingest_files(db, runs=[files["runs"], other])


@pytest.mark.parametrize(
    ("kind", "text", "column", "unit"),
    [
        ("points", "run_id,node_id,ts,value,state\nB1,N,1735718400,1,0\nB1,N,1735718401,1,0\n", "ts", "epoch seconds"),
        ("points", "run_id,node_id,ts,value,state\nB1,N,1735718400000,1,0\nB1,N,1735718401000000,1,0\n", "ts", None),
        ("points", "run_id,node_id,ts,value,state\nB1,N,1735718400000000,1,0\n", "ts", "epoch microseconds"),
        ("points", "run_id,node_id,ts,value,state\nB1,N,1985-06-01T00:00:00Z,1,0\n", "ts", None),
        ("runs", RUNS_HEADER + "B1,L,P,R,1,1735718400,1735722000,real,true\n", "started_at", "epoch seconds"),
        ("runs", RUNS_HEADER + "B1,L,P,R,1,1735718400000,1735722000,real,true\n", "ended_at", "epoch seconds"),
    ],
)
def test_times_no_plant_wrote_are_refused_naming_the_unit_they_look_like(tmp_path, db, kind, text, column, unit):
    """A file in seconds would be stored as points (or runs) of 1970, outside every run, where no
    build reads them: refused, with the row, the column and the unit the values look like."""
    path = write(tmp_path / f"{kind}.csv", text)
    with pytest.raises(IngestError) as info:
        ingest_files(db, **{kind: path}) if kind == "runs" else read_points(path)
    msg = info.value.message
    assert msg.startswith(f"{path}: line ") and f"column '{column}': " in msg, msg
    assert "is not between 1990-01-01 and" in msg and "write epoch milliseconds or ISO-8601" in msg
    assert (f"the column looks like {unit}" in msg) if unit else ("looks like" not in msg), msg
    assert db.list_runs(finished_only=False) == []


def test_a_running_run_and_times_near_now_are_plausible(tmp_path):
    now = int(np.datetime64("now", "ms").astype(np.int64))
    runs = write(tmp_path / "runs.csv", f"run_id,line_id,product_id,recipe_id,started_at,ended_at\nB1,L,P,R,{now},\n")
    assert read_runs(runs)[0].ended_at is None
    points = write(tmp_path / "p.csv", f"run_id,node_id,ts,value,state\nB1,N,1990-01-01T00:00:00Z,1,0\nB1,N,{now + 86_400_000},1,0\n")
    assert read_points(points).ts.tolist() == [631_152_000_000, now + 86_400_000]


def test_csv_errors_name_the_line_a_text_editor_shows(tmp_path):
    """Blank lines (which the reader skips) and a value quoted across two lines are counted; a
    record with too many fields and bytes that are not UTF-8 are placed too, compressed or not."""
    import gzip

    header = "run_id,node_id,ts,value,state\n"
    cases = {
        "blank": (f"{header}\nB,N,{T0},1,0\n\n\nB,N,{T0 + 1},x,0\n".encode(), r"line 6, column 'value': not a number: 'x'"),
        "quoted": (f'{header}B,"a note\nacross lines",{T0},1,0\nB,N,{T0 + 1},y,0\n'.encode(), r"line 2, column 'node_id'"),
        "fields": (f"{header}B,N,{T0},1,0\n\nB,N,{T0 + 1},1,0,extra\n".encode(), r"line 4: 6 fields where the header has 5$"),
        "bytes": (f"{header}B,N,{T0},1,0\n".encode() + b"B,N\xe9,1,1,0\n", r"line 3: byte 0xe9 \(byte 4 of the line\) is not UTF-8"),
    }
    for name, (data, where) in cases.items():
        plain = tmp_path / f"{name}.csv"
        plain.write_bytes(data)
        packed = tmp_path / f"{name}.csv.gz"
        packed.write_bytes(gzip.compress(data))
        for path in (plain, packed):
            with pytest.raises(IngestError, match=re.escape(f"{path}: ") + where):
                read_points(path)
    # a record after a value quoted across lines 3 and 4 starts on line 5
    with pytest.raises(IngestError, match=r"quoted2\.csv: line 5, column 'value': not a number: 'y'"):
        read_points(write(tmp_path / "quoted2.csv", f'{header}B,N,{T0},1,0\nB,N,{T0},"2\n",0\nB,N,{T0 + 1},y,0\n'))


def test_a_file_the_system_refuses_is_a_file_error(tmp_path, monkeypatch):
    """A directory where a file belongs, or a file without read permission: FILE_ERROR, as every
    command says it (docs/cli.md), still an IngestError for callers of the Python API."""
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(IngestError) as info:
        read_points(tmp_path / "dir.csv")
    assert info.value.one_line() == f"FILE_ERROR: {tmp_path / 'dir.csv'}: a directory, not a file"
    locked = write(tmp_path / "locked.csv", "run_id,node_id,ts,value,state\n")
    real_open = open

    def refuse(path, *args, **kwargs):  # the tests run as root, whom a chmod does not stop
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(IngestError) as info:
        read_points(locked)
    assert info.value.one_line() == f"FILE_ERROR: {locked}: Permission denied"
