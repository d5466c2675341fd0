"""Consumers of a snapshot: memory of opening it, speed of verifying it, speed of batches.

    .venv/bin/python -m bench.snapshot_bench SNAPSHOT_DIR [--repeat 5] [--json out.json]
    .venv/bin/python -m bench.snapshot_bench --workload DIR   # build the standard 32 x 120 min snapshot there first

* ``open_verify_rss_mb``: peak RSS (``VmHWM``) of a fresh Python process that runs
  ``open_snapshot(SNAPSHOT_DIR)`` (hash verified by streaming) and touches one window of each
  array; ``baseline_rss_mb`` is the same process importing the package and doing nothing else.
* ``verify_over_sha256sum``: the time of ``open_snapshot`` (verification included) over the time
  of coreutils' ``sha256sum`` of the same files (``spec.json`` and every hashed file: the same
  bytes read), alternating, ``repeat`` times after one untimed warm-up of each (both read from the
  page cache); median, min and max of the per-repetition ratios.
* ``iter_batches_gb_per_s``: every train window in shuffled batches of 256 (``x``, ``u``, ``y``;
  bytes of the yielded arrays over wall time), ``repeat`` times; median, min, max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import print_results  # noqa: E402

GOALS = {  # key: (target, direction)
    "open_verify_rss_mb": (150.0, "<="),
    "verify_over_sha256sum": (1.2, "<="),
    "iter_batches_gb_per_s": (1.0, ">="),
}

_CHILD = textwrap.dedent("""
    import json, sys
    from aml_pipeline.snapshot import open_snapshot
    def hwm_kb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    if sys.argv[2] == "open":
        snap = open_snapshot(sys.argv[1])
        touched = sum(float(snap.array(k)[i].sum()) for k in snap.array_names for i in (0, len(snap) - 1))
        print(json.dumps({"hwm_kb": hwm_kb(), "sha256": snap.sha256, "verified": snap.verified}))
    else:
        print(json.dumps({"hwm_kb": hwm_kb()}))
""")


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def _child_rss(snapshot_dir: Path, mode: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(snapshot_dir), mode], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(snapshot_dir: Path, repeat: int = 5) -> dict[str, Any]:
    from aml_pipeline.snapshot import SPEC_FILE, hashed_files, open_snapshot

    snapshot_dir = Path(snapshot_dir)
    snap = open_snapshot(snapshot_dir)
    files = [snapshot_dir / SPEC_FILE, *(snapshot_dir / n for n in hashed_files(snap.manifest))]
    total_bytes = sum(f.stat().st_size for f in files)
    res: dict[str, Any] = {
        "snapshot": {"dir": str(snapshot_dir), "sha256": snap.sha256, "bytes": total_bytes, "files": len(files),
                     "windows": snap.counts, "shapes": {k: list(snap.array(k).shape) for k in snap.array_names}},
        "repeat": repeat,
    }

    opened = _child_rss(snapshot_dir, "open")
    baseline = _child_rss(snapshot_dir, "import")
    assert opened["verified"] and opened["sha256"] == snap.sha256
    res["open_verify_rss_mb"] = opened["hwm_kb"] / 1024
    res["baseline_rss_mb"] = baseline["hwm_kb"] / 1024

    def ours() -> float:
        t = time.perf_counter()
        open_snapshot(snapshot_dir).close()
        return time.perf_counter() - t

    def coreutils() -> float:
        t = time.perf_counter()
        subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - t

    ours(), coreutils()  # warm-up: both read from the page cache from here on
    times: dict[str, list[float]] = {"ours": [], "sha256sum": []}
    for _ in range(repeat):
        times["ours"].append(ours())
        times["sha256sum"].append(coreutils())
    ratios = [a / b for a, b in zip(times["ours"], times["sha256sum"], strict=True)]
    res["verify_over_sha256sum"] = statistics.median(ratios)
    res["verify"] = {"ratio": _spread(ratios), "ours_s": _spread(times["ours"]), "sha256sum_s": _spread(times["sha256sum"]),
                     "ours_gb_per_s": total_bytes / statistics.median(times["ours"]) / 1e9}

    speeds, epochs = [], []
    for epoch in range(repeat):
        nbytes, windows, seconds = train_epoch(snap, epoch)
        speeds.append(nbytes / seconds / 1e9)
        epochs.append(windows)
    assert all(w == snap.counts["train"] for w in epochs), epochs
    res["iter_batches_gb_per_s"] = statistics.median(speeds)
    res["iter_batches"] = {"gb_per_s": _spread(speeds), "windows": snap.counts["train"], "batch_size": 256,
                           "bytes_per_epoch": nbytes}
    res["goals"] = {
        key: {"value": res[key], "target": target, "met": res[key] <= target if op == "<=" else res[key] >= target}
        for key, (target, op) in GOALS.items()
    }
    return res


def train_epoch(snap: Any, epoch: int) -> tuple[int, int, float]:
    """Every train window in shuffled batches of 256 (x, u, y): bytes yielded, windows, seconds."""
    t = time.perf_counter()
    nbytes = windows = 0
    for batch in snap.iter_batches("train", 256, shuffle=True, seed=0, epoch=epoch):
        nbytes += batch["x"].nbytes + batch["u"].nbytes + batch["y"].nbytes
        windows += batch["index"].shape[0]
    return nbytes, windows, time.perf_counter() - t


def build_standard_snapshot(directory: Path) -> Path:
    """The benchmark workload (32 runs x 120 min, 616 MB of arrays) built by the library build."""
    from bench.build_bench import e2e_build
    from bench.workload import make_workload

    w = make_workload(directory / "workload", runs=32, minutes=120.0, reuse=True)
    return Path(e2e_build(w.spec, w.tsdb_url, directory / "out")["snapshot_dir"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.snapshot_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot_dir", nargs="?", type=Path)
    ap.add_argument("--workload", type=Path, help="build the standard snapshot in this directory and measure it")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if (a.snapshot_dir is None) == (a.workload is None):
        ap.error("give a SNAPSHOT_DIR or --workload DIR")
    snapshot = a.snapshot_dir or build_standard_snapshot(a.workload)
    res = run(snapshot, a.repeat)
    print_results(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
