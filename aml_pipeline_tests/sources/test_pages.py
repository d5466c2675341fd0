"""Pages of a mapped source: points sharing a timestamp (hundreds of them, sub-millisecond ones)
are neither lost nor repeated across page boundaries, come in the documented order, and the
prefetched path serves exactly the pages the query path serves."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aml_pipeline.sources import open_source
from aml_pipeline_tests.tsdb.series import fetch_node_series
from aml_pipeline_tests.sources.layouts import write_description
from aml_pipeline_tests.sources.support import LAKE_LIMITS, T0, check_pages, expected, read_all, tie_points


RUNS = {"windows": {"every": "1d", "start": "2025-02-01T00:00:00Z", "end": "2025-02-02T00:00:00Z",
                    "line": "L1", "product": "P", "recipe": "R"}}
QUALITY = {"column": "quality", "good": [192], "states": {64: 1}, "other": 2}


def pg_table(con: Any, schema: str, rows: dict[str, np.ndarray]) -> None:
    con.execute(f"CREATE TABLE {schema}.s (id bigserial, tag text, ts timestamptz, value float8, quality int)")
    with con.cursor() as cur, cur.copy(f"COPY {schema}.s (tag, ts, value, quality) FROM STDIN") as copy:
        for tag, t, v, q in zip(rows["tag"], rows["ts"], rows["value"], rows["quality"]):
            copy.write_row((str(tag), dt.datetime.fromtimestamp(int(t) / 1000, dt.timezone.utc), float(v), int(q)))
    con.execute(f"CREATE INDEX ON {schema}.s (tag, ts)")


@pytest.fixture(scope="module")
def rows() -> dict[str, np.ndarray]:
    return tie_points()


@pytest.fixture(params=["cursor", "copy"])
def transfer(request, monkeypatch) -> str:
    """Both ways rows of points travel from PostgreSQL (the benchmark picks the default)."""
    from aml_pipeline.sources.postgres import PostgresSource

    monkeypatch.setattr(PostgresSource, "transfer", request.param)
    return request.param


def test_postgres_ties_in_insertion_order(rows, pg_schema, postgres_url, tmp_path, transfer):
    con, schema = pg_schema()
    pg_table(con, schema, rows)
    desc = {"backend": "postgresql", "connection": postgres_url,
            "points": {"table": f"{schema}.s", "node": "tag", "time": "ts", "value": "value", "quality": QUALITY,
                       "order": ["id"]},
            "runs": RUNS}
    with open_source(str(write_description(tmp_path / "s.yaml", desc))) as db:
        check_pages(db, rows)


def test_postgres_without_an_order_column_ties_follow_value_then_state(rows, pg_schema, postgres_url, tmp_path, transfer):
    con, schema = pg_schema()
    pg_table(con, schema, rows)
    desc = {"backend": "postgresql", "connection": postgres_url,
            "points": {"table": f"{schema}.s", "node": "tag", "time": "ts", "value": "value", "quality": QUALITY},
            "runs": RUNS}
    with open_source(str(write_description(tmp_path / "s.yaml", desc))) as db:
        check_pages(db, rows, tie_by_value=True)


def test_postgres_ties_of_integer_tag_ids_at_the_same_times_follow_the_order_column(pg_schema, postgres_url, tmp_path, transfer):
    """Several nodes keyed by integer ids tie at the same times, and another node has single
    points at those times: the prefetched read orders the tied points by the order column,
    node by node, and leaves the single points alone."""
    rng = np.random.default_rng(3)
    ts = T0 + np.repeat(np.arange(60) * 1000, 3)  # every time three points per node
    rows = []
    for tag_id in (11, 12):
        rows.append(np.c_[np.full(ts.size, tag_id), ts, rng.normal(size=ts.size).round(3)])
    single = T0 + np.arange(60) * 1000  # node 13: one point at each of those times
    rows.append(np.c_[np.full(single.size, 13), single, rng.normal(size=single.size).round(3)])
    table = np.concatenate(rows)
    # The order column's ids are not the rows' place in the table, so the order the server
    # returns the rows in (by their place) is not the order the mapping asks for.
    table = np.c_[table, rng.permutation(table.shape[0])]
    con, schema = pg_schema()
    con.execute(f"CREATE TABLE {schema}.s (id bigint, tag_id int, ts timestamptz, value float8)")
    with con.cursor() as cur, cur.copy(f"COPY {schema}.s (id, tag_id, ts, value) FROM STDIN") as copy:
        for tag_id, t, v, row_id in table.tolist():
            copy.write_row((int(row_id), int(tag_id), dt.datetime.fromtimestamp(t / 1000, dt.timezone.utc), v))
    con.execute(f"CREATE INDEX ON {schema}.s (tag_id, ts)")
    nodes = {"A": {"key": 11}, "B": {"key": 12}, "C": {"key": 13}}
    desc = {"backend": "postgresql", "connection": postgres_url,
            "points": {"table": f"{schema}.s", "node": "tag_id", "time": "ts", "value": "value", "order": ["id"]},
            "nodes": nodes, "runs": RUNS}
    with open_source(str(write_description(tmp_path / "s.yaml", desc))) as db:
        run = db.list_runs(finished_only=False)[0]
        assert db.prefetch(run.run_id, list(nodes), run.started_at, run.ended_at)
        for node, entry in nodes.items():
            mine = table[table[:, 0] == entry["key"]]
            want = mine[np.lexsort((mine[:, 3], mine[:, 1]))]  # time, then id
            s = fetch_node_series(db, node, run.run_id, run.started_at, run.ended_at, page_limit=50)
            np.testing.assert_array_equal(s.ts, want[:, 1].astype(np.int64))
            np.testing.assert_array_equal(s.value, want[:, 2])


def write_parquet_files(rows: dict[str, np.ndarray], folder: Path, pieces: int = 4) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for k, part in enumerate(np.array_split(np.arange(rows["ts"].size), pieces)):  # a burst may span files
        pq.write_table(pa.table({
            "tag": pa.array(rows["tag"][part].astype(str)),
            "ts": pa.array(rows["ts"][part], type=pa.int64()),
            "value": rows["value"][part], "quality": pa.array(rows["quality"][part], type=pa.int32()),
        }), folder / f"part-{k:02d}.parquet", row_group_size=50)


def test_parquet_ties_in_file_order_across_files(rows, tmp_path):
    write_parquet_files(rows, tmp_path / "lake")
    desc = {"backend": "files",
            "points": {"files": "lake/*.parquet", "node": "tag", "time": "ts", "time_type": "epoch_ms",
                       "value": "value", "quality": QUALITY},
            "runs": RUNS}
    with open_source(str(write_description(tmp_path / "s.yaml", desc))) as db:
        check_pages(db, rows, limits=LAKE_LIMITS)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_lake_prefetch_larger_than_its_bound_is_declined_and_pages_are_read(rows, tmp_path, fmt):
    """The bound holds whether the files' footers tell their row counts (Parquet: the scan has no
    LIMIT while they are below it) or not (CSV: the scan stops one row past it)."""
    if fmt == "parquet":
        write_parquet_files(rows, tmp_path / "lake")
    else:
        import pyarrow.csv as pacsv

        (tmp_path / "lake").mkdir()
        pacsv.write_csv(pa.table({"tag": rows["tag"].astype(str), "ts": rows["ts"], "value": rows["value"],
                                  "quality": rows["quality"]}), tmp_path / "lake" / "export.csv")
    desc = {"backend": "files",
            "points": {"files": f"lake/*.{fmt}", "node": "tag", "time": "ts", "time_type": "epoch_ms",
                       "value": "value", "quality": QUALITY},
            "runs": RUNS}
    n = rows["ts"].size
    with open_source(str(write_description(tmp_path / "s.yaml", desc))) as db:
        run = db.list_runs(finished_only=False)[0]
        assert not db.prefetch(run.run_id, ["TIE", "ONE"], run.started_at, run.ended_at, max_points=n - 1)
        assert db.prefetch(run.run_id, ["TIE", "ONE"], run.started_at, run.ended_at, max_points=n)
        assert not db.prefetch(run.run_id, ["TIE"], run.started_at, run.ended_at, max_points=int((rows["tag"] == "TIE").sum()) - 1)
        s = fetch_node_series(db, "TIE", run.run_id, run.started_at, run.ended_at, page_limit=13)
        np.testing.assert_array_equal(s.ts, expected(rows, "TIE")[0])


def test_csv_ties_in_file_order(rows, tmp_path):
    import pyarrow.csv as pacsv

    (tmp_path / "csv").mkdir()
    for k, part in enumerate(np.array_split(np.arange(rows["ts"].size), 3)):
        pacsv.write_csv(pa.table({"tag": rows["tag"][part].astype(str), "ts": rows["ts"][part],
                                  "value": rows["value"][part], "quality": rows["quality"][part]}),
                        tmp_path / "csv" / f"export-{k}.csv")
    desc = {"backend": "files",
            "points": {"files": "csv/export-*.csv", "node": "tag", "time": "ts", "time_type": "epoch_ms",
                       "value": "value", "quality": QUALITY},
            "runs": RUNS}
    with open_source(str(write_description(tmp_path / "s.yaml", desc))) as db:
        check_pages(db, rows, limits=LAKE_LIMITS)


def test_sub_millisecond_times_share_their_millisecond(pg_schema, postgres_url, tmp_path):
    """Readings 0.1 ms apart are points of one millisecond: ordered by their true time (not by
    the order column), numbered 0, 1, ... within it, floored to the millisecond."""
    con, schema = pg_schema()
    con.execute(f"CREATE TABLE {schema}.s (id int, tag text, t_us timestamptz, t_ns bigint, value float8)")
    base = dt.datetime(2025, 2, 1, tzinfo=dt.timezone.utc)
    micros = [700, 100, 999, 1000, 1500, 2999]  # written out of time order (id order)
    for i, us in enumerate(micros):
        con.execute(f"INSERT INTO {schema}.s VALUES (%s, 'A', %s, %s, %s)",
                    [i, base + dt.timedelta(microseconds=us), T0 * 1_000_000 + us * 1000, float(i)])
    by_time = np.argsort(micros)
    for column, ttype in (("t_us", None), ("t_ns", "epoch_ns")):
        desc = {"backend": "postgresql", "connection": postgres_url,
                "points": {"table": f"{schema}.s", "node": "tag", "time": column, "value": "value", "order": ["id"],
                           **({"time_type": ttype} if ttype else {})},
                "runs": RUNS}
        with open_source(str(write_description(tmp_path / f"{column}.yaml", desc))) as db:
            ts, value, _, seq, _ = read_all(db, "A", 2)
        np.testing.assert_array_equal(ts, T0 + np.array(micros)[by_time] // 1000)
        np.testing.assert_array_equal(value, by_time.astype(float))
        np.testing.assert_array_equal(seq, [0, 1, 2, 0, 1, 0])


def test_a_point_written_between_the_two_reads_of_a_prefetch(rows, pg_schema, postgres_url, tmp_path, transfer):
    """The prefetch reads the points, then the order columns of the points sharing a time. A point
    written in between (at a shared time) is noticed, and both reads are made again in one
    snapshot: the pages are those of the table as it is after the write."""
    con, schema = pg_schema()
    pg_table(con, schema, rows)
    desc = {"backend": "postgresql", "connection": postgres_url,
            "points": {"table": f"{schema}.s", "node": "tag", "time": "ts", "value": "value", "quality": QUALITY,
                       "order": ["id"]},
            "runs": RUNS}
    tie_ts = int(rows["ts"][rows["tag"] == "TIE"][0])
    with open_source(str(write_description(tmp_path / "s.yaml", desc))) as db:
        backend = db.backend
        real_rows = backend._rows
        calls = []

        def rows_(q, fields, most=None):
            out = real_rows(q, fields, most)
            calls.append(len(fields))
            if len(calls) == 1:  # after the first read: another sample at a shared time
                con.execute(f"INSERT INTO {schema}.s (tag, ts, value, quality) VALUES ('TIE', %s, 99.5, 192)",
                            [dt.datetime.fromtimestamp(tie_ts / 1000, dt.timezone.utc)])
            return out

        backend._rows = rows_
        run = db.list_runs(finished_only=False)[0]
        assert db.prefetch(run.run_id, ["TIE", "ONE"], run.started_at, run.ended_at)
        assert len(calls) == 4  # points, ties (changed), then both again in one snapshot
        prefetched = fetch_node_series(db, "TIE", run.run_id, run.started_at, run.ended_at)
        backend._rows = real_rows
        paged = fetch_node_series(db, "TIE", run.run_id, run.started_at, run.ended_at, page_limit=50)
    np.testing.assert_array_equal(prefetched.ts, paged.ts)
    np.testing.assert_array_equal(prefetched.value, paged.value)
    np.testing.assert_array_equal(prefetched.seq, paged.seq)
    at = prefetched.ts == tie_ts
    assert prefetched.value[at][-1] == 99.5  # the newest insert is the last of its time
