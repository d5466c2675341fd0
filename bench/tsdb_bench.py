"""The TSDB adapters in steady-state use: re-ingest, opening a handle per chunk, per-node pages.

    .venv/bin/python -m bench.tsdb_bench [--repeat 5] [--quick] [--pg] [--json PATH] [--workdir DIR]

On the standard workload (``bench/workload.py``: 32 runs x 16 nodes, 3.7 M points), each figure
against a reference measured in the same run, the same work and repetitions on both sides,
alternating; median with min and max:

* ``ingest``: re-ingest of every point (all skipped as already stored) / the first ingest of the
  same points into a fresh file (the reference), a ``--replace-run`` of every run, and late
  points (2 000 rows of one run, half of them stored already) into the full database.
* ``open``: opening and closing a read-only handle (an ATTACH to the process's DuckDB instance)
  / ``duckdb.connect(path, read_only=True)`` and close (a database started per open, the cost
  before this change).
* ``fetch``: ``fetch_node_series`` for all 512 (run, node) series, through one handle, a handle
  per run (a ``TsdbSession`` chunk per run), a handle per series (a chunk per node), and with
  the bounded ``prefetch`` per run; reference: one ``SELECT`` of every point into numpy.
* ``--pg``: the same re-ingest / first-ingest ratio on PostgreSQL (``$AML_BENCH_PG_URL`` or a
  throwaway server).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import print_results  # noqa: E402
from bench.workload import N_CONTROLS, N_FEATURES, N_TARGETS, make_workload  # noqa: E402

FAR = 2**62


def stats(times: list[float], work: float | None = None) -> dict[str, Any]:
    """median/min/max seconds (and work per second at the median)."""
    out: dict[str, Any] = {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}
    if work is not None:
        out["per_s_median"] = work / out["median"]
    return out


def alternate(repeat: int, **sides: Callable[[], Any]) -> dict[str, list[float]]:
    """Time each side ``repeat`` times, interleaved (a, b, c, a, b, c, ...)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeat):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def bench_ingest(make_url: Callable[[], str], plant: Any, repeat: int, drop: Callable[[str], None]) -> dict[str, Any]:
    import numpy as np

    from aml_pipeline.tsdb import PointColumns
    from aml_pipeline.tsdb_open import open_tsdb

    # Late points: 2 000 rows of one run, every other one with a new value (1 000 stored already).
    p = plant.points
    sel = np.flatnonzero(p.run_id == plant.runs[len(plant.runs) // 2].run_id)[:2000]
    shift = np.where(np.arange(sel.size) % 2 == 0, 0.0, 0.5)
    late_points = PointColumns(p.run_id[sel], p.node_id[sel], p.ts[sel], p.value[sel] + shift, p.state[sel])
    first, again, replace, late = [], [], [], []
    counts: dict[str, int] = {}
    for _ in range(repeat):
        url = make_url()
        try:
            with open_tsdb(url, read_only=False) as db:
                t0 = time.perf_counter()
                counts["first"] = db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
                t1 = time.perf_counter()
                counts["again"] = db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
                t2 = time.perf_counter()
                counts["replace"] = db.ingest(points=plant.points, replace_runs=True)
                t3 = time.perf_counter()
                counts["late"] = db.ingest(points=late_points)
                t4 = time.perf_counter()
            first.append(t1 - t0)
            again.append(t2 - t1)
            replace.append(t3 - t2)
            late.append(t4 - t3)
        finally:
            drop(url)
    n = len(plant.points)
    return {
        "points": n,
        "written": counts,
        "first": stats(first, n),
        "reingest": stats(again, n),
        "replace": stats(replace, n),
        "late_points": len(late_points),
        "late_ms": {k: v * 1e3 for k, v in stats(late).items() if k != "n"},
        "reingest_over_first": statistics.median(again) / statistics.median(first),
        "replace_over_first": statistics.median(replace) / statistics.median(first),
    }


def bench_open(url: str, repeat: int) -> dict[str, Any]:
    import duckdb

    from aml_pipeline.tsdb.duckdb import DuckDBTsdb, parse_duckdb_url

    path = str(parse_duckdb_url(url))
    times = alternate(
        repeat,
        adapter=lambda: DuckDBTsdb(url).close(),
        connect=lambda: duckdb.connect(path, read_only=True).close(),
    )
    return {
        "adapter_ms": {k: v * 1e3 for k, v in stats(times["adapter"]).items() if k != "n"},
        "connect_ms": {k: v * 1e3 for k, v in stats(times["connect"]).items() if k != "n"},
        "n": repeat,
        "adapter_over_connect": statistics.median(times["adapter"]) / statistics.median(times["connect"]),
    }


def bench_fetch(url: str, run_ids: list[str], node_ids: list[str], repeat: int) -> dict[str, Any]:
    import duckdb
    import numpy as np

    from aml_pipeline.tsdb import TsdbSession
    from aml_pipeline_tests.tsdb.series import fetch_node_series, held
    from aml_pipeline.tsdb.duckdb import DuckDBTsdb, parse_duckdb_url

    got: dict[str, int] = {}

    def one_handle() -> None:
        with DuckDBTsdb(url) as db:
            got["one_handle"] = sum(len(fetch_node_series(db, n, r, -FAR, FAR)) for r in run_ids for n in node_ids)

    def handle_per_run() -> None:
        total = 0
        with TsdbSession(url) as s:
            for r in run_ids:
                with held(s) as db:
                    total += sum(len(fetch_node_series(db, n, r, -FAR, FAR)) for n in node_ids)
        got["handle_per_run"] = total

    def handle_per_series() -> None:
        total = 0
        with TsdbSession(url) as s:
            for r in run_ids:
                for n in node_ids:
                    with held(s) as db:
                        total += len(fetch_node_series(db, n, r, -FAR, FAR))
        got["handle_per_series"] = total

    def prefetch_per_run() -> None:
        total = 0
        with TsdbSession(url) as s:
            for r in run_ids:
                with held(s) as db:
                    assert db.prefetch(r, node_ids, -FAR, FAR)
                    total += sum(len(fetch_node_series(db, n, r, -FAR, FAR)) for n in node_ids)
        got["prefetch_per_run"] = total

    path = str(parse_duckdb_url(url))

    def select_all() -> None:  # the floor: every point into numpy in one query, unordered
        with duckdb.connect(path, read_only=True) as con:
            cols = con.execute("SELECT ts, value, state, seq FROM points").fetchnumpy()
        got["select_all"] = int(np.asarray(cols["ts"]).shape[0])

    times = alternate(
        repeat,
        one_handle=one_handle,
        handle_per_run=handle_per_run,
        handle_per_series=handle_per_series,
        prefetch_per_run=prefetch_per_run,
        select_all=select_all,
    )
    points = got["select_all"]
    out: dict[str, Any] = {"points": points, "series": len(run_ids) * len(node_ids), "same_points": len(set(got.values())) == 1}
    for name, t in times.items():
        out[name] = stats(t, points)
    med = {name: statistics.median(t) for name, t in times.items()}
    out["per_node_over_prefetch"] = med["one_handle"] / med["prefetch_per_run"]
    out["handle_per_run_over_one_handle"] = med["handle_per_run"] / med["one_handle"]
    out["handle_per_series_over_one_handle"] = med["handle_per_series"] / med["one_handle"]
    out["prefetch_over_select_all"] = med["prefetch_per_run"] / med["select_all"]
    out["one_handle_over_select_all"] = med["one_handle"] / med["select_all"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tsdb_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="4 runs x 10 min, 2 repetitions")
    ap.add_argument("--pg", action="store_true", help="also measure re-ingest on PostgreSQL")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path, help="scratch (default: a new directory under $TMPDIR; kept if given)")
    a = ap.parse_args(argv)
    runs, minutes, repeat = (4, 10.0, 2) if a.quick else (32, 120.0, a.repeat)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="aml-tsdb-bench-"))
    from aml_pipeline.simulate.plant import simulate_plant

    w = make_workload(work / "workload", runs=runs, minutes=minutes, reuse=True)
    plant = simulate_plant(n_runs=runs, run_minutes=minutes, seed=1, n_controls=N_CONTROLS, n_targets=N_TARGETS,
                           n_features=N_FEATURES, unfinished_last_run=False)  # fmt: skip
    res: dict[str, Any] = {"workload": {"runs": runs, "minutes": minutes, "points": w.points, "nodes": w.nodes},
                           "repeat": repeat, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip

    def new_file() -> str:
        return f"duckdb://{work / f'ingest-{uuid.uuid4().hex[:8]}.duckdb'}"

    def drop_file(url: str) -> None:
        p = Path(url[len("duckdb://") :])
        for f in (p, p.with_name(p.name + ".wal"), p.with_name(p.name + ".lock")):
            f.unlink(missing_ok=True)

    print(f"ingest: {len(plant.points):,} points, first vs again, {repeat}x", file=sys.stderr)
    res["ingest_duckdb"] = bench_ingest(new_file, plant, repeat, drop_file)
    print("open: adapter vs duckdb.connect", file=sys.stderr)
    res["open"] = bench_open(w.tsdb_url, max(30, 10 * repeat))
    run_ids = [r["run_id"] for r in w.runs]
    node_ids = [n["nodeId"] for n in w.spec["nodes"]]
    print(f"fetch: {len(run_ids) * len(node_ids)} series, five ways", file=sys.stderr)
    res["fetch"] = bench_fetch(w.tsdb_url, run_ids, node_ids, repeat)
    if a.pg:
        res["ingest_postgres"] = _pg_ingest(plant, repeat)
    print_results(res, a.json)
    if a.workdir is None:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0 if res["fetch"]["same_points"] else 1


def _pg_ingest(plant: Any, repeat: int) -> dict[str, Any]:
    env_url = os.environ.get("AML_BENCH_PG_URL")
    if env_url:
        ctx: Any = contextlib.nullcontext(env_url)
    else:
        from aml_pipeline_tests.pg_server import server_url

        ctx = server_url()
    with ctx as base:
        import psycopg

        def new_schema() -> str:
            sep = "&" if "?" in base else "?"
            return f"{base}{sep}schema=aml_bench_{uuid.uuid4().hex[:8]}"

        def drop(url: str) -> None:
            schema = url.rsplit("schema=", 1)[1]
            with psycopg.connect(base, autocommit=True) as c:
                c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

        print("ingest on PostgreSQL: first vs again", file=sys.stderr)
        return bench_ingest(new_schema, plant, repeat, drop)


if __name__ == "__main__":
    sys.exit(main())
