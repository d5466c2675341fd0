"""PostgreSQL: the adapter's fetch path against a raw ``COPY ... TO STDOUT`` of the same rows.

The workload's points are copied from its DuckDB file into a fresh schema (the adapter's own
``ingest``, one transaction). Then, in the same process and alternately, best of ``repeat``:

* fetch: ``fetch_node_series`` (keyset pages through ``PostgresTsdb.query_page``) for every
  (run, node) of the spec, as ``pipeline.runs.fetch_run`` reads them;
* COPY: ``PostgresTsdb.copy_reference`` - ``COPY (SELECT ts, value, state FROM points WHERE
  run_key = ANY(...) AND node_key = ANY(...)) TO STDOUT``, rows received and dropped by libpq.

The server is ``$AML_BENCH_PG_URL`` if set, else a throwaway one started with
``aml_pipeline_tests.pg_server.server_url()`` (which itself prefers ``$AML_TEST_PG_URL``).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np


def _with_schema(url: str, schema: str | None) -> str:
    """``url`` with the adapter's ``schema`` parameter set (or removed, for plain libpq)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "schema"]
    if schema is not None:
        query.append(("schema", schema))
    return urlunsplit(parts._replace(query=urlencode(query)))


def unavailable(reason: str) -> dict[str, Any]:
    return {"available": False, "ratio": None, "reason": reason}


def run(tsdb_url: str, spec_dict: dict[str, Any], *, repeat: int) -> dict[str, Any]:
    try:
        from aml_pipeline.tsdb.postgres import PostgresTsdb
    except ImportError as e:
        return unavailable(f"aml_pipeline/tsdb/postgres.py not importable ({e})")
    if not hasattr(PostgresTsdb, "copy_reference"):
        return unavailable("PostgresTsdb has no copy_reference() (raw COPY measurement) yet")
    env_url = os.environ.get("AML_BENCH_PG_URL")
    try:
        if env_url:
            ctx: Any = contextlib.nullcontext(env_url)
        else:
            from aml_pipeline_tests.pg_server import server_url

            ctx = server_url()
        with ctx as base_url:
            return _measure(PostgresTsdb, base_url, tsdb_url, spec_dict, repeat=repeat,
                            server="AML_BENCH_PG_URL" if env_url else "aml_pipeline_tests.pg_server.server_url()")
    except Exception as e:  # noqa: BLE001 - reported, the rest of the benchmark goes on
        return unavailable(f"no PostgreSQL server usable: {type(e).__name__}: {' '.join(str(e).split())[:300]}")


def _measure(PostgresTsdb: Any, base_url: str, tsdb_url: str, spec_dict: dict[str, Any], *, repeat: int,
             server: str) -> dict[str, Any]:
    import duckdb
    import psycopg

    from aml_pipeline.pipeline.build import run_scope
    from aml_pipeline.pipeline.runs import run_bounds
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb import PointColumns, fetch_node_series, open_tsdb
    from aml_pipeline.tsdb.duckdb import parse_duckdb_url

    spec = parse_spec(spec_dict)
    schema = f"aml_bench_{os.getpid()}"
    url = _with_schema(base_url, schema)
    with open_tsdb(tsdb_url) as src:
        runs = src.list_runs(run_scope(spec), finished_only=True)
        nodes = src.list_nodes()
    con = duckdb.connect(str(parse_duckdb_url(tsdb_url)), read_only=True)
    try:  # every point, in ingestion order (so the copy gets the same seq order)
        cols = con.execute("SELECT run_id, node_id, ts, value, state FROM points_by_id ORDER BY seq").fetchnumpy()
    finally:
        con.close()
    points = PointColumns(
        np.asarray(cols["run_id"], dtype=object), np.asarray(cols["node_id"], dtype=object),
        np.asarray(cols["ts"], np.int64), np.asarray(cols["value"], np.float64), np.asarray(cols["state"], np.int32),
    )
    del cols
    db = PostgresTsdb(url)
    try:
        t0 = time.perf_counter()
        db.ingest(runs=runs, nodes=nodes, points=points)
        ingest_seconds = time.perf_counter() - t0
        del points
        run_ids = [r.run_id for r in runs]

        def fetch() -> int:
            n = 0
            for run in runs:
                lo, hi = run_bounds(spec, run)
                for node in spec.node_ids:
                    n += len(fetch_node_series(db, node, run.run_id, lo, hi))
            return n

        fetch_times, copy_times, copy_bin_times = [], [], []
        fetched = copied = 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            fetched = fetch()
            fetch_times.append(time.perf_counter() - t0)
            copied, s = db.copy_reference(run_ids, spec.node_ids, fmt="text")
            copy_times.append(s)
            _, s = db.copy_reference(run_ids, spec.node_ids, fmt="binary")
            copy_bin_times.append(s)
        best_fetch, best_copy = min(fetch_times), min(copy_times)
        return {
            "available": True,
            "server": server,
            "points": fetched,
            "copy_rows": copied,
            "same_rows": fetched == copied,
            "ingest_seconds": ingest_seconds,
            "fetch_seconds": best_fetch,
            "copy_text_seconds": best_copy,
            "copy_binary_seconds": min(copy_bin_times),
            "fetch_points_per_s": fetched / best_fetch,
            "copy_points_per_s": copied / best_copy,
            "ratio": best_fetch / best_copy,
        }
    finally:
        db.close()
        with contextlib.suppress(Exception), psycopg.connect(_with_schema(base_url, None), autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
