"""The series layout against the windows layout: bytes, build, floor, reading; and at plant scale.

On the standard workload, the same data and spec built in both layouts (``layout: series`` added):

* ``series_bytes_over_grid``: the series snapshot's array bytes over the float32 grid (runs x
  grid rows x nodes x 4 of the runs in the snapshot); the windows layout's ratio beside it.
* ``series_build_speedup``: ``build_dataset`` of the windows spec over ``build_dataset`` of the
  series spec; ``series_e2e_over_floor``: the series build over its I/O floor
  (:func:`bench.build_bench.io_floor`: every point of the workload read from the same DuckDB file
  into numpy in one query, plus arrays of the series snapshot's file sizes written and fsynced).
  The three sides alternate (``bench.timing.side_by_side``), fresh output directories and the
  disk settled before each.
* the series build's stage table (:func:`bench.build_bench.run_staged`), with the fetch, clean
  and align stages' points/s (thread seconds: they run in threads beside each other) and the
  points/s of ``run_stages``, the wall time of fetch, clean, align and windows together.
* ``series_open_verify_rss_mb`` and ``series_verify_over_sha256sum``: ``bench.snapshot_bench.run``
  on the series snapshot; ``series_iter_batches_gb_per_s``: every train window in shuffled batches
  of 256 (``bench.snapshot_bench.train_epoch``), the series snapshot and the windows snapshot
  alternating, and their ratio.

Cross-checks: both builds publish current snapshots whose blocking checks pass, and the series
snapshot's windows (every array, read in blocks) are the windows snapshot's bytes.

Plant scale (:func:`plant_scale`, reported, not a goal): 500 runs x 32 nodes x 30 min at stride 1,
built with ``layout: series`` through ``aml-pipeline build --json`` in a fresh ``AML_HOME`` and
``DAGSTER_HOME`` (the repository's ``dagster.yaml``): the snapshot's bytes, the build's seconds
(process start to its JSON line) and its peak RSS (``ru_maxrss`` of the build process, read by a
parent that runs nothing else).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import dir_bytes, remove_tree, settle
from bench.timing import Sample, side_by_side

PLANT_SCALE = dict(runs=500, nodes=32, minutes=30.0)


def series_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "layout": "series"}


def grid_bytes(store_root: Path, spec_dict: dict[str, Any]) -> int:
    """Float32 bytes of the grid of the runs in the snapshot: runs x grid rows x nodes x 4."""
    from aml_pipeline.pipeline.stages.split import load_plan
    from aml_pipeline.pipeline.store import DatasetStore
    from aml_pipeline.spec import parse_spec

    spec = parse_spec(spec_dict)
    plan = load_plan(DatasetStore(store_root, spec))
    rows = sum(int(plan.runs[r]["rows"]) for _, r in plan.ordered_runs())
    return rows * len(spec.nodes) * 4


def same_windows(windows_dir: Path, series_dir: Path) -> bool:
    """Every array of the series snapshot, read in blocks, hashes as the windows snapshot's file."""
    from aml_pipeline.snapshot import open_snapshot

    w, s = open_snapshot(windows_dir), open_snapshot(series_dir)
    if w.array_names != s.array_names or len(w) != len(s):
        return False
    for key in w.array_names:
        a, b = hashlib.sha256(), hashlib.sha256()
        for start in range(0, len(w), 4096):
            stop = min(len(w), start + 4096)
            a.update(w.read_windows(key, start, stop).tobytes())
            b.update(s.read_windows(key, start, stop).tobytes())
        if a.digest() != b.digest():
            return False
    return True


def run(w: Any, work: Path, *, repeat: int, build_repeat: int) -> dict[str, Any]:
    from aml_pipeline.snapshot import open_snapshot
    from bench import build_bench, snapshot_bench

    specs = {"windows": w.spec, "series": series_spec(w.spec)}
    out: dict[str, Any] = {}
    builds: dict[str, dict[str, Any]] = {}
    sizes: dict[str, int] = {}

    def build(layout: str):
        def call() -> Sample:
            r = build_bench.e2e_build(specs[layout], w.tsdb_url, work / layout)
            builds[layout] = r
            if layout == "series":
                sizes.clear()
                sizes.update(r["array_bytes"])
            return Sample(r["seconds"], r)

        return call

    def floor() -> Sample:
        # The floor writes the series snapshot's file sizes: the first repetition runs the sides
        # in the order given, so the series build has run before it.
        f = build_bench.io_floor(specs["series"], w.tsdb_url, sizes, work / "floor")
        return Sample(f["seconds"], f, {"read_seconds": f["read_seconds"], "write_seconds": f["write_seconds"]})

    cmp = side_by_side({"windows": build("windows"), "series": build("series"), "floor": floor}, repeat=build_repeat,
                       prepare=lambda side, i: settle(work / ("floor" if side == "floor" else side)))
    out["timings"] = cmp.to_json()
    out["build_speedup"] = cmp.ratio("windows", "series")
    out["e2e_over_floor"] = cmp.ratio("series", "floor")
    fl = cmp.values["floor"]
    out["floor"] = {"points": fl["points"], "bytes_written": fl["bytes_written"],
                    "read_seconds": cmp.metric("floor", "read_seconds"),
                    "write_seconds": cmp.metric("floor", "write_seconds"),
                    "read_points_per_s": fl["points"] / cmp.metric("floor", "read_seconds")["median"]}
    out["points_per_s"] = {k: w.points / cmp.timing(k)["median"] for k in ("windows", "series")}
    grid = grid_bytes(work / "series" / "store", specs["series"])
    arrays = {k: sum(b["array_bytes"].values()) for k, b in builds.items()}
    out["bytes"] = {"grid": grid, "series": arrays["series"], "windows": arrays["windows"],
                    "series_files": builds["series"]["array_bytes"], "windows_files": builds["windows"]["array_bytes"]}
    out["bytes_over_grid"] = {k: arrays[k] / grid for k in arrays}
    windows_dir, series_dir = (Path(builds[k]["snapshot_dir"]) for k in ("windows", "series"))
    out["checks_pass"] = all(b["summary"]["current"] and all(b["summary"]["checks"].values()) for b in builds.values())
    out["same_windows"] = same_windows(windows_dir, series_dir)

    staged = build_bench.run_staged(specs["series"], w.tsdb_url, work / "staged", repeat=build_repeat)
    remove_tree(work / "staged")
    out["stages"] = staged
    out["stage_points_per_s"] = {r["stage"]: r["points_per_s"] for r in staged["stages"]
                                 if r["stage"] in ("fetch", "clean", "align", "run_stages")}

    snap = snapshot_bench.run(series_dir, repeat=repeat)
    out["snapshot"] = {k: snap[k] for k in ("snapshot", "open_verify_rss_mb", "baseline_rss_mb",
                                            "verify_over_sha256sum", "verify")}
    opened = {"windows": open_snapshot(windows_dir), "series": open_snapshot(series_dir)}
    epoch = {"windows": 0, "series": 0}

    def epoch_of(layout: str):
        def call() -> Sample:
            nbytes, windows, seconds = snapshot_bench.train_epoch(opened[layout], epoch[layout])
            epoch[layout] += 1
            return Sample(seconds, windows, {"gb_per_s": nbytes / seconds / 1e9})

        return call

    batches = side_by_side({"windows": epoch_of("windows"), "series": epoch_of("series")}, repeat=repeat)
    out["iter_batches"] = {"timings": batches.to_json(), "windows": batches.values["windows"],
                           "same_windows_per_epoch": batches.values["windows"] == batches.values["series"]}
    out["iter_batches_gb_per_s"] = {k: batches.metric(k, "gb_per_s") for k in ("windows", "series")}
    out["iter_batches_over_windows"] = batches.ratio("series", "windows", metric="gb_per_s")
    return out


def plant_scale(work: Path, *, runs: int, nodes: int, minutes: float, reuse: bool) -> dict[str, Any]:
    """The series layout at plant scale through ``aml-pipeline build`` (see the module docstring)."""
    from bench.workload import make_workload_in_subprocess

    plant = make_workload_in_subprocess(work / "plant", runs=runs, minutes=minutes, nodes=nodes, reuse=reuse)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(series_spec(plant.spec)))
    run = work / "run"
    remove_tree(run)
    (run / "dagster").mkdir(parents=True)
    repo_yaml = (Path(__file__).resolve().parent.parent / "dagster.yaml").read_text()
    (run / "dagster" / "dagster.yaml").write_text(repo_yaml.replace(".aml/dagster", str(run / "dagster")))
    settle()
    cli = Path(sys.executable).parent / "aml-pipeline"
    # A parent of its own: its RUSAGE_CHILDREN is the build process's alone.
    parent = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
              "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); s = time.perf_counter() - t; "
              "sys.stderr.write(p.stderr); print(p.stdout.strip().splitlines()[-1] if p.returncode == 0 else ''); "
              "print(s, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode)")
    done = subprocess.run(
        [sys.executable, "-c", parent, str(cli), "build", str(spec_path), "--tsdb", plant.tsdb_url, "--json"],
        env={**os.environ, "AML_HOME": str(run / "aml"), "DAGSTER_HOME": str(run / "dagster"),
             "DAGSTER_DISABLE_TELEMETRY": "1"},
        capture_output=True, text=True, timeout=4 * 3600,
    )
    lines = done.stdout.strip().splitlines()
    seconds, maxrss_kb, rc = lines[-1].split()
    if int(rc) != 0:
        raise RuntimeError(f"aml-pipeline build at plant scale failed: {done.stderr.strip()[-2000:]}")
    summary = json.loads(lines[-2])
    snapshot = Path(summary["snapshotDir"])
    result = {
        "runs": len(plant.runs), "nodes": plant.nodes, "run_minutes": minutes, "points": plant.points,
        "stride": plant.spec["stride"], "windows": summary["windows"], "sha256": summary["sha256"],
        "snapshot_bytes": dir_bytes(snapshot), "array_bytes": dir_bytes(snapshot / "arrays"),
        "windows_layout_array_bytes": _windows_layout_bytes(snapshot),
        "build_seconds": float(seconds), "peak_rss_mb": int(maxrss_kb) / 1024,
        "checks": summary["checks"], "current": summary["current"],
        "simulate_seconds": plant.seconds_simulate, "ingest_seconds": plant.seconds_ingest,
    }
    remove_tree(run)
    return result


def _windows_layout_bytes(snapshot: Path) -> int:
    """What the windows layout's arrays of the same windows would take (from the manifest's shapes)."""
    m = json.loads((snapshot / "manifest.json").read_text())
    total = 0
    for key, itemsize in (("x", 4), ("u", 4), ("y", 4), ("timestamps", 8), ("mask", 4)):
        if key in m["shapes"] and (key in ("x", "u", "y") or m["version"] == 2):
            n = 1
            for d in m["shapes"][key]:
                n *= int(d)
            total += n * itemsize
    return total


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.series_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--plant-scale", action="store_true", help="only the plant-scale run")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    res = plant_scale(a.workdir, **PLANT_SCALE, reuse=True) if a.plant_scale else None
    print(json.dumps({"plant_scale": res, "seconds": time.perf_counter() - t}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
