"""Peak RSS of the library build for growing numbers of runs, each build in a fresh process.

The plant is generated and ingested by another process (``bench.workload``); each build runs
in a child (``python -m bench.memory SPEC_JSON TSDB_URL OUT``) that imports the package, notes
its RSS, builds with ``build_dataset`` and reports the peak (``VmHWM`` from
``/proc/self/status``, and ``ru_maxrss``) as its last stdout line. Every build reads the same
database; the spec's ``toMs`` admits the first N runs.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import proc_status_kb

ROOT = Path(__file__).resolve().parent.parent


def build_in_child(spec_dict: dict[str, Any], tsdb_url: str, out: Path) -> dict[str, Any]:
    spec_path = out.parent / f"{out.name}.spec.json"
    spec_path.write_text(json.dumps(spec_dict))
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "bench.memory", str(spec_path), tsdb_url, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"build child failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)
        spec_path.unlink(missing_ok=True)


def _child(spec_path: str, tsdb_url: str, out: str) -> int:
    from aml_pipeline.pipeline.build import build_dataset
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb import open_tsdb

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
