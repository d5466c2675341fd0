"""PostgreSQL: the adapter's fetch path against a raw ``COPY ... TO STDOUT`` of the same rows.

The workload's points are copied from its DuckDB file into a fresh schema (the adapter's own
``ingest``, one transaction). Then, in the same process, ``repeat`` times each:

* fetch: ``fetch_node_series`` (keyset pages through ``PostgresTsdb.query_page``) for every
  (run, node) of the spec, as ``pipeline.runs.fetch_run`` reads them;
* COPY: ``bench.pg_copy.copy_points`` - ``COPY (SELECT ts, value, state FROM points WHERE
  run_key = ANY(...) AND node_key = ANY(...)) TO STDOUT``, rows received and dropped by libpq.

The three alternate (``bench.timing.side_by_side``), each timed around the whole call.

The server is ``$AML_BENCH_PG_URL`` if set, else ``$AML_TEST_PG_URL``, else a throwaway one
started with ``aml_pipeline_tests.pg_server`` (``initdb``). Only when there is none of these -
no URL and no ``initdb`` on this machine - is the figure null, with that reason; any other
failure (a server that does not start, an adapter bug) is raised, so the benchmark fails.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


from bench.pg_copy import copy_points
from bench.timing import side_by_side


def _with_schema(url: str, schema: str | None) -> str:
    """``url`` with the adapter's ``schema`` parameter set (or removed, for plain libpq)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "schema"]
    if schema is not None:
        query.append(("schema", schema))
    return urlunsplit(parts._replace(query=urlencode(query)))


def unavailable(reason: str) -> dict[str, Any]:
    return {"available": False, "ratio": None, "reason": reason}


class NoServer(Exception):
    """No PostgreSQL server to measure with (the reason is the message)."""


@contextlib.contextmanager
def postgres_server() -> Iterator[tuple[str, str]]:
    """``(base URL, where it comes from)`` of the server the benchmark uses: ``$AML_BENCH_PG_URL``,
    else ``$AML_TEST_PG_URL``, else a throwaway one (stopped on exit). :class:`NoServer` only
    when there is no URL and no ``initdb`` on this machine."""
    from aml_pipeline_tests.pg_server import PgServerError, find_bindir, server_url

    env_url = os.environ.get("AML_BENCH_PG_URL")
    if env_url:
        yield env_url, "AML_BENCH_PG_URL"
        return
    if not os.environ.get("AML_TEST_PG_URL"):
        try:
            find_bindir()
        except PgServerError as e:
            raise NoServer(f"no PostgreSQL server: AML_BENCH_PG_URL is not set and {e}") from e
    with server_url() as url:
        yield url, "AML_TEST_PG_URL" if os.environ.get("AML_TEST_PG_URL") else "throwaway server (aml_pipeline_tests.pg_server)"


@contextlib.contextmanager
def pooler(base_url: str) -> Iterator[str]:
    """The URL of a PgBouncer (session pooling, as docs/deployment.md deploys it) in front of the
    server of ``base_url``, stopped on exit. :class:`NoServer` when there is no ``pgbouncer``."""
    from aml_pipeline_tests.pgbouncer import (
        PgBouncerMissing,
        find_pgbouncer,
        pooled_url,
    )

    try:
        find_pgbouncer()
    except PgBouncerMissing as e:
        raise NoServer(str(e)) from e
    with pooled_url(base_url) as url:
        yield url


def run(tsdb_url: str, spec_dict: dict[str, Any], *, repeat: int) -> dict[str, Any]:
    from aml_pipeline.tsdb.postgres import PostgresTsdb

    try:
        with postgres_server() as (base_url, server):
            return _measure(PostgresTsdb, base_url, tsdb_url, spec_dict, repeat=repeat, server=server)
    except NoServer as e:
        return unavailable(str(e))


def _measure(PostgresTsdb: Any, base_url: str, tsdb_url: str, spec_dict: dict[str, Any], *, repeat: int,
             server: str) -> dict[str, Any]:
    import psycopg

    from aml_pipeline.pipeline.stages.raw import run_bounds
    from aml_pipeline.spec import parse_spec
    from aml_pipeline_tests.tsdb.series import fetch_node_series

    from bench.common import workload_points

    spec = parse_spec(spec_dict)
    schema = f"aml_bench_{os.getpid()}"
    url = _with_schema(base_url, schema)
    runs, nodes, points = workload_points(tsdb_url, spec)
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

        def copy(fmt: str):
            return lambda: copy_points(url, run_ids, spec.node_ids, fmt=fmt)[0]

        cmp = side_by_side({"fetch": fetch, "copy_text": copy("text"), "copy_binary": copy("binary")}, repeat=repeat)
        fetched, copied = cmp.values["fetch"], cmp.values["copy_text"]
        return {
            "available": True,
            "server": server,
            "points": fetched,
            "copy_rows": copied,
            "same_rows": fetched == copied == cmp.values["copy_binary"],
            "ingest_seconds": ingest_seconds,
            "timings": cmp.to_json(),
            "fetch_points_per_s": fetched / cmp.timing("fetch")["median"],
            "copy_points_per_s": copied / cmp.timing("copy_text")["median"],
            "ratio": cmp.ratio("fetch", "copy_text"),
            "ratio_over_binary_copy": cmp.ratio("fetch", "copy_binary"),
        }
    finally:
        db.close()
        with contextlib.suppress(Exception), psycopg.connect(_with_schema(base_url, None), autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
