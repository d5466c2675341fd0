"""The library build: per-stage throughput, end to end, and the I/O floor it is compared with.

* :func:`staged_build` is ``aml_pipeline_tests.library_build.build_dataset`` with a timer around
  each stage function it calls (``clean_run`` is split into cleaning and alignment by timing the ``align``
  calls inside it, where it has them). Its snapshot hash must equal the end-to-end build's.
* :func:`e2e_build` is ``build_dataset`` itself, with no timer inside it.
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
    from aml_pipeline_tests.library_build import build_dataset
    from aml_pipeline.tsdb_open import open_tsdb

    spec = _spec(spec_dict)
    fresh_dir(out)
    t0 = time.perf_counter()
    with open_tsdb(tsdb_url) as db:
        published = build_dataset(spec, db, store_root=out / "store", datasets_root=out / "datasets")
    seconds = time.perf_counter() - t0
    arrays = published.snapshot_dir / "arrays"
    sizes = {p.name: p.stat().st_size for p in sorted(arrays.iterdir()) if p.suffix != ".json"}
    return {
        "seconds": seconds,
        "sha256": published.sha256,
        "summary": published.summary(),
        "array_bytes": sizes,
        "snapshot_dir": str(published.snapshot_dir),
    }


# build_dataset's stages, by the names it calls them (a name it no longer calls is left out).
_STAGE_FUNCTIONS = {
    "fetch_run": "fetch",
    "read_run": "fetch",  # the fetch thread's reading (stages.raw.RunFetcher.read) ...
    "clean_run": "clean",
    "window_run": "windows",
    "plan_dataset": "split_fit",
    "save_plan": "split_fit",
    "fit_normalization": "split_fit",
    "fit_or_reuse_normalization": "split_fit",
    "save_norm": "split_fit",
}


def staged_build(spec_dict: dict[str, Any], tsdb_url: str, out: Path) -> dict[str, Any]:
    """``build_dataset`` itself, with a timer around each stage function it calls; returns
    seconds per stage and counts.

    The stage functions are wrapped where ``aml_pipeline_tests.library_build`` and its run loop
    (``pipeline.runs.build_runs``) look them up, so the stages are timed as they are called; cleaning is split from alignment by timing
    ``pipeline.runs.align`` where the cleaning stage calls it. ``publish_dataset`` reports its
    own phases (write, checks, the fsync left after the checks, publish).
    """
    import aml_pipeline.pipeline.runs as runs_mod
    import aml_pipeline.pipeline.stages.raw as raw_mod
    import aml_pipeline_tests.library_build as build_mod
    from aml_pipeline.tsdb_open import open_tsdb

    spec = _spec(spec_dict)
    fresh_dir(out)
    t: dict[str, float] = defaultdict(float)
    patched: list[tuple[Any, str, Any]] = []

    def timed(module: Any, name: str, stage: str) -> None:
        real = getattr(module, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                t[stage] += time.perf_counter() - t0

        patched.append((module, name, real))
        setattr(module, name, wrapper)

    # Where build_dataset, its run loop (pipeline.runs.build_runs) and the plan's fetcher
    # (pipeline.stages.raw.run_fetcher) look the stages up; each module holds the real function,
    # so a stage called through any of them is timed once.
    for name, stage in _STAGE_FUNCTIONS.items():
        for module in (build_mod, runs_mod, raw_mod):
            if hasattr(module, name):
                timed(module, name, stage)
    if hasattr(raw_mod, "PendingRaw"):  # ... and the writing of what it read, in the run's thread
        timed(raw_mod.PendingRaw, "write", "fetch")
    if hasattr(runs_mod, "align"):
        timed(runs_mod, "align", "align")
    # The run stages' wall time: build_runs overlaps the fetch and the runs' cleaning and windows in
    # threads, so the stage timers above sum thread seconds; this is the span they take together.
    real_build_runs = build_mod.build_runs

    def build_runs(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            yield from real_build_runs(*a, **k)
        finally:
            t["run_stages"] += time.perf_counter() - t0

    build_mod.build_runs = build_runs
    patched.append((build_mod, "build_runs", real_build_runs))
    phases: dict[str, float] = {}
    real_publish = build_mod.publish_dataset

    def publish(*a: Any, **k: Any) -> Any:
        return real_publish(*a, **k, timings=phases)

    build_mod.publish_dataset = publish
    patched.append((build_mod, "publish_dataset", real_publish))
    t_all = time.perf_counter()
    try:
        with open_tsdb(tsdb_url) as db:
            published = build_mod.build_dataset(spec, db, store_root=out / "store", datasets_root=out / "datasets")
    finally:
        for module, name, real in reversed(patched):
            setattr(module, name, real)
    total = time.perf_counter() - t_all
    if "align" in t and "clean" in t:
        t["clean"] -= t["align"]  # align runs inside the cleaning stage
    for phase, stage in (("write", "write"), ("checks", "checks"), ("durable", "fsync_tail"), ("publish", "publish")):
        t[stage] += phases.get(phase, 0.0)
    # build_dataset fetches runs in a thread and cleans and windows runs in a pool beside it, so
    # those stages overlap each other: "run_stages" is their span, and "other" is the rest of the
    # wall time (listing runs and nodes, locks).
    t["other"] = total - sum(v for k, v in t.items() if k not in ("other", *OVERLAPPED))
    summary = published.summary()
    return {
        "seconds": dict(t),
        "total_seconds": total,
        "points": int(published.report["cleaning"]["totals"]["input"]),
        "windows": sum(summary["windows"].values()),
        "output_bytes": dir_bytes(published.snapshot_dir / "arrays"),
        "sha256": published.sha256,
        "current": published.current,
        "checks": {c.name: c.passed for c in published.checks},
    }


def io_floor(spec_dict: dict[str, Any], tsdb_url: str, array_bytes: dict[str, int], out: Path) -> dict[str, Any]:
    """Read every point of the spec's runs and nodes from the same DuckDB file into numpy (one
    query, DuckDB's own parallel scan), then write arrays of the snapshot's sizes with
    ``ndarray.tofile`` and fsync each. The arrays are allocated (and touched) before the clock."""
    import duckdb

    from aml_pipeline.pipeline.plan import run_scope
    from aml_pipeline.tsdb_open import open_tsdb
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


# Stages timed in threads beside each other (thread seconds, their shares overlap); "run_stages"
# is the wall time they take together.
OVERLAPPED = ("fetch", "clean", "align", "windows")


def summarize_stages(staged: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for the stage table: seconds, points/s (input points of the workload) and share."""
    order = ("fetch", "clean", "align", "windows", "run_stages", "split_fit", "write", "checks", "fsync_tail", "publish", "other")
    total = staged["total_seconds"]
    rows = []
    for name in order:
        if name not in staged["seconds"]:
            continue
        s = staged["seconds"][name]
        rows.append({
            "stage": name,
            "seconds": s,
            "points_per_s": staged["points"] / s if s else None,
            "share": s / total if total else None,
            "mb_per_s": (staged["output_bytes"] / s / 1e6) if name == "write" and s else None,
            "overlapped": name in OVERLAPPED,
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
        **{k: last[k] for k in ("points", "windows", "output_bytes", "current", "checks")},
    }
