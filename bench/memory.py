"""Peak memory and throughput of the library build by run length, each build in a fresh process.

Two builds compared: one run of 2 days and one run of 16 days (the standard plant: 16 nodes
at a 1 s base rate; spec H = 60, F = 30, stride 30), each in its own DuckDB file made by another
process (``bench.workload``, the run made of back-to-back days of the simulator). Each build runs in a child (``python -m bench.memory SPEC_JSON
TSDB_URL OUT``) that imports the package, notes its RSS, builds with ``build_dataset`` and
reports, as its last stdout line, the build's wall time (measured inside the child, so the
interpreter's start-up is not counted), the input points (``report.json``'s cleaning totals)
and the peak RSS (``VmHWM`` from ``/proc/self/status``, and ``ru_maxrss``). The two lengths
alternate (``bench.timing.side_by_side``); a memory bounded by a budget gives a ratio near 1
whatever the run's length.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import proc_status_kb, remove_tree, settle
from bench.timing import Sample, side_by_side

ROOT = Path(__file__).resolve().parent.parent
STRIDE = 30


def build_in_child(spec_dict: dict[str, Any], tsdb_url: str, out: Path) -> dict[str, Any]:
    out.parent.mkdir(parents=True, exist_ok=True)
    spec_path = out.parent / f"{out.name}.spec.json"
    spec_path.write_text(json.dumps(spec_dict))
    remove_tree(out)
    cmd = [sys.executable, "-m", "bench.memory", str(spec_path), tsdb_url, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"build child failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        remove_tree(out)
        spec_path.unlink(missing_ok=True)


def run(work: Path, *, piece_minutes: float, short_pieces: int, long_pieces: int, repeat: int,
        reuse: bool) -> dict[str, Any]:
    """Build one run of ``short_pieces`` and one of ``long_pieces`` x ``piece_minutes``."""
    from bench.workload import make_workload_in_subprocess

    pieces = {"short": short_pieces, "long": long_pieces}
    plants = {
        name: make_workload_in_subprocess(work / f"plant-{name}", runs=n, minutes=piece_minutes, stride=STRIDE,
                                          merge_runs=True, reuse=reuse)
        for name, n in pieces.items()
    }

    def side(name: str):
        def call() -> Sample:
            r = build_in_child(plants[name].spec, plants[name].tsdb_url, work / f"build-{name}")
            return Sample(r["seconds"], r, {"peak_rss_mb": r["peak_rss_mb"], "points": r["points"]})

        return call

    cmp = side_by_side({"short": side("short"), "long": side("long")}, repeat=repeat,
                       prepare=lambda side, i: settle())
    points = {name: cmp.values[name]["points"] for name in plants}
    return {
        "runs": {name: {"minutes": n * piece_minutes, "points": points[name], "windows": cmp.values[name]["windows"],
                        "rss_before_build_mb": cmp.values[name]["rss_before_build_mb"],
                        "current": cmp.values[name]["current"]}
                 for name, n in pieces.items()},
        "spec": {"H": plants["long"].spec["historySteps"], "F": plants["long"].spec["horizonSteps"], "stride": STRIDE},
        "timings": cmp.to_json(),
        "rss_ratio": cmp.ratio("long", "short", metric="peak_rss_mb"),
        "rss_long_mb": cmp.metric("long", "peak_rss_mb"),
        "points_per_s": {name: points[name] / cmp.timing(name)["median"] for name in plants},
        "points_per_s_ratio": cmp.rate_ratio("long", "short", points["long"], points["short"]),
        "all_current": all(cmp.values[n]["current"] for n in plants),
        "points_deterministic": all(len(set(cmp.metrics[n]["points"])) == 1 for n in plants),
    }


def _child(spec_path: str, tsdb_url: str, out: str) -> int:
    from aml_pipeline_tests.library_build import build_dataset
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb_open import open_tsdb

    spec = parse_spec(json.loads(Path(spec_path).read_text()))
    before = proc_status_kb("VmRSS")
    t0 = time.perf_counter()
    with open_tsdb(tsdb_url) as db:
        published = build_dataset(spec, db, store_root=Path(out) / "store", datasets_root=Path(out) / "datasets")
    seconds = time.perf_counter() - t0
    summary = published.summary()
    print(json.dumps({
        "runs": sum(summary["runs"][p] for p in ("train", "val", "test")),
        "windows": sum(summary["windows"].values()),
        "points": int(published.report["cleaning"]["totals"]["input"]),
        "seconds": seconds,
        "rss_before_build_mb": (before or 0) / 1024,
        "peak_rss_mb": (proc_status_kb("VmHWM") or 0) / 1024,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "current": summary["current"],
        "sha256": published.sha256,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:4]))
