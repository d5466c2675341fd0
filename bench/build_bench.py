"""The library build: per-stage throughput, end to end, and the I/O floor it is compared with.

* :func:`staged_build` runs the stages of ``pipeline.build.build_dataset`` one by one with a
  timer around each (``clean_run`` is split into cleaning and alignment by timing the
  ``align`` calls inside it). Its snapshot hash must equal the end-to-end build's, which shows
  the staged copy did the same work.
* :func:`e2e_build` is ``build_dataset`` itself, as a user calls it.
* :func:`io_floor` moves the same bytes with nothing else: every point of the workload read
  from the same DuckDB file into numpy (one query), and arrays of the snapshot's array sizes
  written with ``ndarray.tofile`` and fsynced.

:func:`run` alternates the end-to-end build and the floor (``bench.timing.side_by_side``) and
keeps the last build's store and snapshot for the parts that read them (windows, snapshot).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import dir_bytes, fresh_dir, settle
from bench.timing import Sample, side_by_side, summarize


def _spec(spec_dict: dict[str, Any]):
    from aml_pipeline.spec import parse_spec

    return parse_spec(spec_dict)


def e2e_build(spec_dict: dict[str, Any], tsdb_url: str, out: Path) -> dict[str, Any]:
    """``build_dataset`` into fresh directories under ``out``; wall seconds and the summary."""
    from aml_pipeline.pipeline.build import build_dataset
    from aml_pipeline.tsdb import open_tsdb

    spec = _spec(spec_dict)
    fresh_dir(out)
    t0 = time.perf_counter()
    with open_tsdb(tsdb_url) as db:
        published = build_dataset(spec, db, store_root=out / "store", datasets_root=out / "datasets")
    seconds = time.perf_counter() - t0
    arrays = published.snapshot_dir / "arrays"
    sizes = {p.name: p.stat().st_size for p in sorted(arrays.iterdir()) if p.suffix in (".f32", ".f64")}
    return {
        "seconds": seconds,
        "sha256": published.sha256,
        "summary": published.summary(),
        "array_bytes": sizes,
        "snapshot_dir": str(published.snapshot_dir),
    }


def staged_build(spec_dict: dict[str, Any], tsdb_url: str, out: Path) -> dict[str, Any]:
    """The stages of ``build_dataset``, each timed; returns seconds per stage and counts.

    The per-run loop and the split/fit are ``build_dataset``'s own steps called one by one;
    the snapshot is written, checked and published by ``publish_dataset`` itself, which reports
    its own phases (write, checks, the fsync left after the checks, publish).
    """
    import aml_pipeline.pipeline.runs as runs_mod
    from aml_pipeline.pipeline.build import publish_dataset, run_scope
    from aml_pipeline.pipeline.dataset import fit_normalization, plan_dataset, save_norm, save_plan
    from aml_pipeline.pipeline.runs import check_nodes_known, clean_run, fetch_run, window_run
    from aml_pipeline.pipeline.store import DatasetStore
    from aml_pipeline.tsdb import open_tsdb
    from aml_pipeline.tsdb.port import DEFAULT_PAGE_LIMIT

    spec = _spec(spec_dict)
    fresh_dir(out)
    t: dict[str, float] = defaultdict(float)
    align_time = [0.0]
    real_align = runs_mod.align

    def timed_align(*a: Any, **k: Any) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return real_align(*a, **k)
        finally:
            align_time[0] += time.perf_counter() - t0

    points = grid_rows = windows = 0
    store = DatasetStore(out / "store", spec.id)
    t_all = time.perf_counter()
    runs_mod.align = timed_align
    try:
        with open_tsdb(tsdb_url) as db:
            t0 = time.perf_counter()
            catalog = check_nodes_known(spec, db.list_nodes())
            runs = db.list_runs(run_scope(spec), finished_only=True)
            t["setup"] += time.perf_counter() - t0
            for run in runs:
                t0 = time.perf_counter()
                raw = fetch_run(db, spec, run, store, catalog, page_limit=DEFAULT_PAGE_LIMIT)
                t1 = time.perf_counter()
                align_time[0] = 0.0
                g = clean_run(spec, run.run_id, store)
                t2 = time.perf_counter()
                w = window_run(spec, run.run_id, store)
                t3 = time.perf_counter()
                t["fetch"] += t1 - t0
                t["align"] += align_time[0]
                t["clean"] += (t2 - t1) - align_time[0]
                t["windows"] += t3 - t2
                points += raw.total_points
                grid_rows += g.rows
                windows += w.windows
            t0 = time.perf_counter()
            plan = plan_dataset(spec, [r.run_id for r in runs], store)
            save_plan(spec, plan, store)
            norm = fit_normalization(spec, plan, store)
            save_norm(spec, norm, store)
            t["split_fit"] += time.perf_counter() - t0
            watermark = db.availability_watermark()
        phases: dict[str, float] = {}
        published = publish_dataset(
            spec, plan, norm, store, out / "datasets", availability_watermark=watermark, timings=phases
        )
        t["write"] += phases["write"]
        t["checks"] += phases["checks"]
        t["fsync_tail"] += phases["durable"]
        t["publish"] += phases["publish"]
    finally:
        runs_mod.align = real_align
    total = time.perf_counter() - t_all
    out_bytes = dir_bytes(published.snapshot_dir / "arrays")
    return {
        "seconds": dict(t),
        "total_seconds": total,
        "points": points,
        "grid_rows": grid_rows,
        "windows": windows,
        "output_bytes": out_bytes,
        "sha256": published.sha256,
        "current": published.current,
        "checks": {c.name: c.passed for c in published.checks},
        "check_descriptions": {c.name: c.description for c in published.checks},
    }


def io_floor(spec_dict: dict[str, Any], tsdb_url: str, array_bytes: dict[str, int], out: Path) -> dict[str, Any]:
    """Read every point of the spec's runs and nodes from the same DuckDB file into numpy (one
    query, DuckDB's own parallel scan), then write arrays of the snapshot's sizes with
    ``ndarray.tofile`` and fsync each. The arrays are allocated (and touched) before the clock."""
    import duckdb

    from aml_pipeline.pipeline.build import run_scope
    from aml_pipeline.tsdb import open_tsdb
    from aml_pipeline.tsdb.duckdb import parse_duckdb_url

    spec = _spec(spec_dict)
    with open_tsdb(tsdb_url) as db:
        run_ids = [r.run_id for r in db.list_runs(run_scope(spec), finished_only=True)]
    arrays = {name: np.ones(n // 4, dtype=np.float32) for name, n in array_bytes.items()}
    fresh_dir(out)

    t0 = time.perf_counter()
    con = duckdb.connect(str(parse_duckdb_url(tsdb_url)), read_only=True)
    try:
        wanted_runs, wanted_nodes = set(run_ids), set(spec.node_ids)
        run_keys = [int(k) for i, k in con.execute("SELECT run_id, run_key FROM runs").fetchall() if i in wanted_runs]
        node_keys = [int(k) for i, k in con.execute("SELECT node_id, node_key FROM nodes").fetchall() if i in wanted_nodes]
        # Integer literals (from the database itself): a plain IN list is pushed into the scan.
        cols = con.execute(
            "SELECT ts, value, state, seq FROM points "
            f"WHERE run_key IN ({','.join(map(str, run_keys))}) AND node_key IN ({','.join(map(str, node_keys))})"
        ).fetchnumpy()
        cols = {k: np.asarray(v) for k, v in cols.items()}
    finally:
        con.close()
    t_read = time.perf_counter() - t0
    n_points = int(cols["ts"].shape[0])
    del cols

    t0 = time.perf_counter()
    for name, a in arrays.items():
        with open(out / name, "wb") as f:
            a.tofile(f)
            f.flush()
            os.fsync(f.fileno())
    t_write = time.perf_counter() - t0
    written = sum(a.nbytes for a in arrays.values())
    for name in arrays:
        (out / name).unlink()
    return {
        "seconds": t_read + t_write,
        "read_seconds": t_read,
        "write_seconds": t_write,
        "points": n_points,
        "bytes_written": written,
    }


def summarize_stages(staged: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for the stage table: seconds, points/s (input points of the workload) and share."""
    order = ("fetch", "clean", "align", "windows", "split_fit", "write", "checks", "fsync_tail", "publish", "setup")
    total = staged["total_seconds"]
    rows = []
    for name in order:
        s = staged["seconds"].get(name, 0.0)
        rows.append({
            "stage": name,
            "seconds": s,
            "points_per_s": staged["points"] / s if s else None,
            "share": s / total if total else None,
            "mb_per_s": (staged["output_bytes"] / s / 1e6) if name == "write" and s else None,
        })
    return rows


def run(spec_dict: dict[str, Any], tsdb_url: str, points: int, work: Path, *, repeat: int) -> dict[str, Any]:
    """End-to-end build vs I/O floor, alternating; the last build stays in ``work / "e2e"``."""
    sizes: dict[str, int] = {}

    def build() -> Sample:
        r = e2e_build(spec_dict, tsdb_url, work / "e2e")
        sizes.update(r["array_bytes"])
        return Sample(r["seconds"], r)

    def floor() -> Sample:
        f = io_floor(spec_dict, tsdb_url, sizes, work / "floor")
        return Sample(f["seconds"], f, {"read_seconds": f["read_seconds"], "write_seconds": f["write_seconds"]})

    def prepare(side: str, i: int) -> None:
        settle(work / "e2e" if side == "build" else work / "floor")

    cmp = side_by_side({"build": build, "floor": floor}, repeat=repeat, prepare=prepare)
    e2e, fl = cmp.values["build"], cmp.values["floor"]
    read, write = cmp.metric("floor", "read_seconds"), cmp.metric("floor", "write_seconds")
    return {
        "timings": cmp.to_json(),
        "ratio": cmp.ratio("build", "floor"),
        "e2e": {"sha256": e2e["sha256"], "summary": e2e["summary"], "snapshot_dir": e2e["snapshot_dir"],
                "store": str(work / "e2e" / "store"), "output_bytes": sum(e2e["array_bytes"].values()),
                "points_per_s": points / cmp.timing("build")["median"]},
        "floor": {"points": fl["points"], "bytes_written": fl["bytes_written"],
                  "read_seconds": read, "write_seconds": write,
                  "read_points_per_s": fl["points"] / read["median"],
                  "write_mb_per_s": fl["bytes_written"] / write["median"] / 1e6},
    }


def run_staged(spec_dict: dict[str, Any], tsdb_url: str, out: Path, *, repeat: int) -> dict[str, Any]:
    """:func:`staged_build` ``repeat`` times: per stage the median, min and max."""
    builds = []
    for _ in range(repeat):
        settle(out)
        builds.append(staged_build(spec_dict, tsdb_url, out))
    last = builds[-1]
    per_stage = {name: summarize([b["seconds"].get(name, 0.0) for b in builds]) for name in last["seconds"]}
    median_build = {**last, "seconds": {k: v["median"] for k, v in per_stage.items()},
                    "total_seconds": summarize([b["total_seconds"] for b in builds])["median"]}
    return {
        "stages": summarize_stages(median_build),
        "stage_seconds": per_stage,
        "total_seconds": summarize([b["total_seconds"] for b in builds]),
        "sha256": sorted({b["sha256"] for b in builds}),
        **{k: last[k] for k in ("points", "grid_rows", "windows", "output_bytes", "current", "checks")},
    }
