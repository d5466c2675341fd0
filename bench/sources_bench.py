"""Mapped sources (``docs/sources.md``): a plant's own PostgreSQL table and Parquet lake, read in
place through a source description, against references measured in the same run.

The workload's points (taken from its DuckDB file through the port, put back in ingestion
order) are laid out twice, untimed:

* a narrow PostgreSQL table ``samples(id bigserial, tag, ts timestamptz, value, quality)`` with
  the index ``docs/sources.md`` recommends, ``(tag, ts) INCLUDE (value, quality)``, vacuumed (as
  autovacuum leaves a table that stopped changing), an MES table and a tag table, mapped with
  ``order: [id]``;
* a Parquet lake of hourly files in day folders (``points/date=YYYY-MM-DD/part-HH.parquet``),
  mapped with ``partition: {column: date}``, pyarrow's default encoding, each file's rows sorted
  by tag, then time (the layout ``docs/sources.md`` recommends: each node's points of a file in
  one stretch, as a ``(tag, time)`` index keeps them in PostgreSQL), and again with the rows in
  time order (as an append-only writer leaves them), measured beside it.

Then, side by side (``bench.timing.side_by_side``), every finished run of the spec:

* ``mapped_pg_fetch_over_copy``: every point of the run through the mapped table, as the build
  reads it (the adapter's ``prefetch`` of the run, then ``fetch_node_series`` per node), over a
  plain ``COPY (SELECT ts, value, quality FROM samples WHERE tag = ANY(...) AND ts BETWEEN ...)
  TO STDOUT (FORMAT BINARY)`` of the same rows, received by libpq and dropped. Beside it: the
  same fetch with the adapter's other transfer (``PostgresSource.transfer``: rows packed on the
  server and read through a cursor, or a binary COPY; the default is the faster one here) and
  ``pages`` (``fetch_node_series`` per node without the prefetch).
* ``mapped_version_over_fetch``: the runs' versions as a build reads them (``run_versions`` of
  every run: one query of one aggregate per run) over the same fetch; a call per run is
  reported beside it.
* ``parquet_over_embedded_points_per_s``: points per second of the same read path through the
  lake mapping over the embedded DuckDB file's, same points (both figures reported), for the
  lake sorted by tag; ``lake_in_time_order`` holds the same for the other layout, and
  ``lake_a_file_a_day`` for a file a day (``date=YYYY-MM-DD/day.parquet``, sorted by tag: a dozen
  runs a file, which the mapping decodes once for the runs read in time order). Beside them,
  ``scan``: DuckDB reading each run's rows from the files and nothing more (its hours' files, time
  range and nodes, as Arrow; no order, no split by node, no states), what any reader of the lake
  through DuckDB pays at least, and ``scan_over_embedded``.

Cross-checks: the mapped fetch returns every row COPY returns, the lake (both layouts) returns
exactly the embedded file's points (a digest of ts, value, state of every series), and the plain
scan reads as many points as the mapping.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench import pg_bench
from bench.common import workload_points
from bench.timing import side_by_side

OPC = np.array([192, 64, 0], dtype=np.int32)  # the plant's states 0, 1, 2 as OPC UA quality codes
QUALITY = {"column": "quality", "good": [192], "states": {64: 1}, "other": 2}


def _read_runs(db: Any, runs: list, node_ids: list[str], *, prefetch: bool = True,
               digest: Any = None) -> int:
    """Every point of every run as the build reads it; the number of points. ``digest`` (not
    while timing) is fed every series' ts, value and state."""
    from aml_pipeline.pipeline.stages.raw import clean_chunk_points
    from aml_pipeline_tests.tsdb.series import fetch_node_series

    n = 0
    for run in runs:
        if prefetch:  # with the bound the build's fetch gives it
            db.prefetch(run.run_id, node_ids, run.started_at, run.ended_at, max_points=clean_chunk_points())
        for node in node_ids:
            s = fetch_node_series(db, node, run.run_id, run.started_at, run.ended_at)
            n += len(s)
            if digest is not None:
                for a in (s.ts, s.value, s.state):
                    digest.update(np.ascontiguousarray(a).data)
    return n


def _digest(db: Any, runs: list, node_ids: list[str]) -> str:
    h = hashlib.sha256()
    _read_runs(db, runs, node_ids, digest=h)
    return h.hexdigest()


def _table_bytes(table: Any) -> bytes:
    import pyarrow.csv as pacsv

    buf = io.BytesIO()
    pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=False))
    return buf.getvalue()


def _load_postgres(con: Any, schema: str, runs: list, nodes: list, p: dict[str, np.ndarray]) -> None:
    import pyarrow as pa

    con.execute(f'CREATE SCHEMA "{schema}"')
    s = f'"{schema}"'
    con.execute(f"CREATE TABLE {s}.samples (id bigserial PRIMARY KEY, tag text NOT NULL, ts timestamptz NOT NULL, "
                "value double precision, quality int NOT NULL)")
    ts = pa.array(p["ts"], type=pa.timestamp("ms", tz="UTC"))
    value = pa.array(p["value"], mask=np.isnan(p["value"]))
    table = pa.table({"tag": p["node_id"].astype(str), "ts": ts, "value": value, "quality": OPC[p["state"]]})
    data = _table_bytes(table)
    with con.cursor() as cur, cur.copy(f"COPY {s}.samples (tag, ts, value, quality) FROM STDIN (FORMAT csv)") as copy:
        for start in range(0, len(data), 1 << 24):
            copy.write(data[start:start + (1 << 24)])
    # The index docs/sources.md recommends: pages and version queries read it alone.
    con.execute(f"CREATE INDEX ON {s}.samples (tag, ts) INCLUDE (value, quality)")
    con.execute(f"CREATE TABLE {s}.batches (batch text PRIMARY KEY, started timestamptz, finished timestamptz, "
                "line text, product text, recipe text)")
    with con.cursor() as cur, cur.copy(f"COPY {s}.batches FROM STDIN") as copy:
        for r in runs:
            copy.write_row((r.run_id, _utc(r.started_at), _utc(r.ended_at), r.line_id, r.product_id, r.recipe_id))
    con.execute(f"CREATE TABLE {s}.tags (name text PRIMARY KEY, unit text, lo float8, hi float8)")
    with con.cursor() as cur, cur.copy(f"COPY {s}.tags FROM STDIN") as copy:
        for n in nodes:
            copy.write_row((n.node_id, n.unit, n.range_lo, n.range_hi))
    # What autovacuum does, in time, to a table whose rows stopped changing: every page all-visible.
    con.execute(f"VACUUM (FREEZE, ANALYZE) {s}.samples")


def _utc(ms: int | None) -> Any:
    import datetime as dt

    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)


def _write_lake(root: Path, runs: list, p: dict[str, np.ndarray], *, sorted_by_tag: bool, hours_a_file: int = 1) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "mes").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "batch": [r.run_id for r in runs],
        "started": pa.array([r.started_at for r in runs], type=pa.timestamp("ms", tz="UTC")),
        "finished": pa.array([r.ended_at for r in runs], type=pa.timestamp("ms", tz="UTC")),
        "line": [r.line_id for r in runs], "product": [r.product_id for r in runs], "recipe": [r.recipe_id for r in runs],
    }), root / "mes" / "batches.parquet")

    hours = p["ts"] // 3_600_000 // hours_a_file * hours_a_file
    files = 0
    for hour in np.unique(hours):
        sel = np.flatnonzero(hours == hour)
        if sorted_by_tag:  # each file's rows by tag, then time; ties keep their ingestion order
            sel = sel[np.lexsort((sel, p["ts"][sel], p["node_id"][sel].astype(str)))]
        when = np.datetime64(int(hour), "h").astype("datetime64[s]").astype(object)
        folder = root / "points" / f"date={when:%Y-%m-%d}"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({
            "tag": p["node_id"][sel].astype(str),
            "time": pa.array(p["ts"][sel], type=pa.timestamp("ms", tz="UTC")),
            "value": p["value"][sel],
            "quality": OPC[p["state"][sel]],
        }), folder / (f"part-{when:%H}.parquet" if hours_a_file < 24 else "day.parquet"))
        files += 1
    return files


def _describe(path: Path, desc: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(desc, sort_keys=False))
    return str(path)


def run(tsdb_url: str, spec_dict: dict[str, Any], work: Path, *, repeat: int) -> dict[str, Any]:
    from aml_pipeline.sources import open_source
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb_open import open_tsdb

    spec = parse_spec(spec_dict)
    runs, nodes, pc = workload_points(tsdb_url, spec)
    points = {"run_id": pc.run_id, "node_id": pc.node_id, "ts": pc.ts, "value": pc.value, "state": pc.state}
    del pc
    node_ids = list(spec.node_ids)
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"runs": len(runs), "nodes": len(node_ids), "points": int(points["ts"].shape[0])}

    # ---- the Parquet lake against the embedded file: each file's rows sorted by tag as
    # docs/sources.md recommends (the key figure), and in time order beside it
    out["lake"] = _measure_lake(work / "lake", tsdb_url, runs, nodes, node_ids, points, repeat, sorted_by_tag=True)
    out["lake_in_time_order"] = _measure_lake(work / "lake-in-time-order", tsdb_url, runs, nodes, node_ids, points,
                                              repeat, sorted_by_tag=False)
    out["lake_a_file_a_day"] = _measure_lake(work / "lake-daily", tsdb_url, runs, nodes, node_ids, points, repeat,
                                             sorted_by_tag=True, hours_a_file=24)

    # ---- PostgreSQL: the mapped narrow table against a plain binary COPY
    try:
        with pg_bench.postgres_server() as (base_url, server):
            out["pg"] = _measure_pg(base_url, server, runs, nodes, node_ids, points, work, repeat)
    except pg_bench.NoServer as e:
        out["pg"] = {"available": False, "reason": str(e)}
    return out


def _plain_scan(root: Path, runs: list, node_ids: list[str], hours_a_file: int = 1):
    """DuckDB reading each run's rows from the lake and nothing more: the files of the run's
    hours, its time range and nodes, as Arrow (DuckDB's fastest result), one query a run; no
    order, no split by node, no states. What any reader of these files through DuckDB pays at
    least."""
    import datetime as dt

    import duckdb

    con = duckdb.connect(":memory:")
    query = ("SELECT tag, time, value, quality FROM read_parquet($files) "
             "WHERE time BETWEEN $t0 AND $t1 AND list_contains($tags, tag)")

    def files_of(t0: dt.datetime, t1: dt.datetime) -> list[str]:  # the files of the run's hours
        hour = t0.replace(minute=0, second=0, microsecond=0)
        out = []
        while hour <= t1:
            name = f"part-{hour:%H}.parquet" if hours_a_file < 24 else "day.parquet"
            f = root / "points" / f"date={hour:%Y-%m-%d}" / name
            if f.exists() and str(f) not in out:
                out.append(str(f))
            hour += dt.timedelta(hours=1)
        return out

    def read() -> int:
        n = 0
        for run in runs:
            t0, t1 = _utc(run.started_at), _utc(run.ended_at)
            n += con.sql(query, params={"files": files_of(t0, t1), "t0": t0, "t1": t1,
                                        "tags": node_ids}).to_arrow_table().num_rows
        return n
    return read


def _measure_lake(root: Path, tsdb_url: str, runs: list, nodes: list, node_ids: list[str], points: dict[str, np.ndarray],
                  repeat: int, *, sorted_by_tag: bool, hours_a_file: int = 1) -> dict[str, Any]:
    from aml_pipeline.sources import open_source
    from aml_pipeline.tsdb_open import open_tsdb

    t0 = time.perf_counter()
    files = _write_lake(root, runs, points, sorted_by_tag=sorted_by_tag, hours_a_file=hours_a_file)
    out: dict[str, Any] = {"files": files, "rows": "sorted by tag, then time" if sorted_by_tag else "in time order",
                           "hours_a_file": hours_a_file,
                           "write_seconds": time.perf_counter() - t0}
    lake_url = _describe(root / "plant.yaml", {
        "backend": "files",
        "points": {"files": "points/**/*.parquet", "node": "tag", "time": "time", "value": "value",
                   "quality": QUALITY, "partition": {"column": "date", "every": "day"}},
        "runs": {"files": "mes/batches.parquet", "id": "batch", "start": "started", "end": "finished",
                 "line": "line", "product": "product", "recipe": "recipe"},
        "nodes": {n.node_id: {"unit": n.unit} for n in nodes},
    })
    scan = _plain_scan(root, runs, node_ids, hours_a_file)
    with open_source(lake_url) as lake, open_tsdb(tsdb_url) as embedded:
        assert [r.run_id for r in lake.list_runs()] == [r.run_id for r in runs]
        cmp = side_by_side({"lake": lambda: _read_runs(lake, runs, node_ids),
                            "embedded": lambda: _read_runs(embedded, runs, node_ids),
                            "scan": scan}, repeat=repeat)
        d_lake, d_emb = _digest(lake, runs, node_ids), _digest(embedded, runs, node_ids)
    n_lake, n_emb, n_scan = cmp.values["lake"], cmp.values["embedded"], cmp.values["scan"]
    out.update({
        "timings": cmp.to_json(),
        "points_per_s": {"lake": n_lake / cmp.timing("lake")["median"],
                         "embedded": n_emb / cmp.timing("embedded")["median"],
                         "scan": n_scan / cmp.timing("scan")["median"]},
        "ratio": cmp.rate_ratio("lake", "embedded", n_lake, n_emb),
        "scan_over_embedded": cmp.rate_ratio("scan", "embedded", n_scan, n_emb),
        "same_points": n_lake == n_emb == int(points["ts"].shape[0]) and d_lake == d_emb,
        "scan_same_count": n_scan == n_lake,
    })
    return out


def _measure_pg(base_url: str, server: str, runs, nodes, node_ids, points, work: Path, repeat: int) -> dict[str, Any]:
    import psycopg

    from aml_pipeline.sources import open_source
    from aml_pipeline.sources.postgres import PostgresSource
    from bench.pg_copy import _drain_copy_out

    schema = f"aml_src_bench_{os.getpid()}"
    url = pg_bench._with_schema(base_url, None)
    con = psycopg.connect(url, autocommit=True)
    try:
        t0 = time.perf_counter()
        _load_postgres(con, schema, runs, nodes, points)
        load_seconds = time.perf_counter() - t0
        desc = _describe(work / "pg.yaml", {
            "backend": "postgresql",
            "connection": url,
            "points": {"table": f"{schema}.samples", "node": "tag", "time": "ts", "value": "value",
                       "quality": QUALITY, "order": ["id"]},
            "runs": {"table": f"{schema}.batches", "id": "batch", "start": "started", "end": "finished",
                     "line": "line", "product": "product", "recipe": "recipe"},
            "node_table": {"table": f"{schema}.tags", "id": "name", "unit": "unit", "low": "lo", "high": "hi"},
        })
        reference = psycopg.connect(url, autocommit=True)

        def copy() -> int:
            rows = 0
            for run in runs:
                statement = psycopg.ClientCursor(reference).mogrify(
                    f'COPY (SELECT ts, value, quality FROM "{schema}".samples WHERE tag = ANY(%s) '
                    "AND ts BETWEEN %s AND %s) TO STDOUT (FORMAT BINARY)",
                    [node_ids, _utc(run.started_at), _utc(run.ended_at)])
                reference.pgconn.send_query(statement.encode())
                rows += _drain_copy_out(reference.pgconn, reference.info.encoding)
            return rows

        def versions(db) -> int:
            return len(db.run_versions([r.run_id for r in runs]))  # as a build asks: one call

        def versions_one_by_one(db) -> int:
            for run in runs:
                db.run_versions([run.run_id])
            return len(runs)

        default = PostgresSource.transfer

        def fetch(transfer: str):
            def read() -> int:
                PostgresSource.transfer = transfer
                try:
                    return _read_runs(db, runs, node_ids)
                finally:
                    PostgresSource.transfer = default
            return read

        other = "copy" if default == "cursor" else "cursor"
        with open_source(desc) as db, contextlib.closing(reference):
            assert [r.run_id for r in db.list_runs()] == [r.run_id for r in runs]
            cmp = side_by_side({
                "fetch": fetch(default),
                f"fetch_{other}": fetch(other),
                "copy_binary": copy,
                "pages": lambda: _read_runs(db, runs, node_ids, prefetch=False),
                "versions": lambda: versions(db),
                "versions_one_by_one": lambda: versions_one_by_one(db),
            }, repeat=repeat)
        fetched, copied = cmp.values["fetch"], cmp.values["copy_binary"]
        return {
            "available": True,
            "server": server,
            "load_seconds": load_seconds,
            "timings": cmp.to_json(),
            "points": fetched,
            "copy_rows": copied,
            "same_rows": fetched == copied == cmp.values["pages"] == cmp.values[f"fetch_{other}"] == int(points["ts"].shape[0]),
            "fetch_points_per_s": fetched / cmp.timing("fetch")["median"],
            "transfer": default,
            "ratio": cmp.ratio("fetch", "copy_binary"),
            f"{other}_transfer_over_{default}": cmp.ratio(f"fetch_{other}", "fetch"),
            "pages_over_copy": cmp.ratio("pages", "copy_binary"),
            "version_over_fetch": cmp.ratio("versions", "fetch"),
            "version_one_by_one_over_fetch": cmp.ratio("versions_one_by_one", "fetch"),
        }
    finally:
        with contextlib.suppress(Exception):
            con.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        con.close()
