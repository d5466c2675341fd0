"""The standard benchmark workload: a simulated plant in a DuckDB file, and a spec over it.

Standard (full) workload: 32 finished runs x 16 nodes (4 controls, 4 targets, 8 features), 2 h
each at 1 Hz base rate (targets every 1 s / 2 s, features every 2 s / 0.5 s, one control logged
on change), about 3.7 M points; spec beat 1 s, H = 60, F = 30, stride 1, Hampel k = 5. ``nodes``
(a multiple of 4) scales the plant: a quarter controls, a quarter targets, half features.

Run as a module to generate a workload in its own process (the memory benchmark does this so
that the build process's peak RSS is the build's alone)::

    python -m bench.workload DIR --runs 16 --minutes 1440 --merge-runs --stride 30 [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

N_CONTROLS, N_TARGETS, N_FEATURES = 4, 4, 8
HISTORY, HORIZON = 60, 30
SPEC_ID = "bench"


@dataclass
class Workload:
    dir: Path
    tsdb_url: str
    spec: dict[str, Any]  # camelCase spec dict
    runs: list[dict[str, Any]]  # run_id, started_at, ended_at (in start order)
    points: int
    nodes: int
    seconds_simulate: float = 0.0
    seconds_ingest: float = 0.0
    params: tuple = ()  # (runs, minutes, seed, stride, merge_runs[, nodes when not 16])

    def spec_for_runs(self, n: int) -> dict[str, Any]:
        """The spec restricted (by ``toMs``) to the first ``n`` runs of the plant."""
        if not 1 <= n <= len(self.runs):
            raise ValueError(f"the workload has {len(self.runs)} runs, asked for the first {n}")
        spec = dict(self.spec)
        if n < len(self.runs):
            # Runs are 5-15 min apart: the end of run n-1 admits exactly the first n runs.
            spec["toMs"] = int(self.runs[n - 1]["ended_at"])
        return spec

    def to_json(self) -> dict[str, Any]:
        return {
            "dir": str(self.dir),
            "tsdb_url": self.tsdb_url,
            "spec": self.spec,
            "runs": self.runs,
            "points": self.points,
            "nodes": self.nodes,
            "seconds_simulate": self.seconds_simulate,
            "seconds_ingest": self.seconds_ingest,
            "params": list(self.params),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Workload:
        return cls(
            Path(obj["dir"]), obj["tsdb_url"], obj["spec"], obj["runs"], obj["points"], obj["nodes"],
            obj.get("seconds_simulate", 0.0), obj.get("seconds_ingest", 0.0), tuple(obj.get("params", ())),
        )


def make_workload(
    directory: Path,
    *,
    runs: int,
    minutes: float,
    seed: int = 1,
    stride: int = 1,
    merge_runs: bool = False,
    reuse: bool = False,
    nodes: int = 16,
) -> Workload:
    """Simulate the plant and ingest it into ``directory/tsdb.duckdb`` (created fresh, unless
    ``reuse`` and the directory already holds this very workload).

    ``merge_runs`` makes one long run of ``runs`` back-to-back pieces of ``minutes`` each (the
    simulator's cost grows faster than linearly with one run's length, through its dropouts;
    pieces keep it linear). The run keeps the first piece's record, ends when the last piece
    ends, and every point is relabelled to it.
    """
    import dataclasses

    import numpy as np

    from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
    from aml_pipeline.tsdb_open import open_tsdb

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if nodes % 4 or nodes < 4:
        raise ValueError(f"nodes must be a positive multiple of 4, got {nodes}")
    params = (runs, minutes, seed, stride, merge_runs) + (() if nodes == 16 else (nodes,))
    meta = directory / "workload.json"
    if reuse and meta.exists() and (directory / "tsdb.duckdb").exists():
        w = Workload.from_json(json.loads(meta.read_text()))
        if w.params == params:
            return w
    db_path = directory / "tsdb.duckdb"
    for stale in (db_path, directory / "tsdb.duckdb.wal"):
        stale.unlink(missing_ok=True)
    t0 = time.perf_counter()
    plant = simulate_plant(
        n_runs=runs,
        run_minutes=minutes,
        seed=seed,
        n_controls=N_CONTROLS * nodes // 16,
        n_targets=N_TARGETS * nodes // 16,
        n_features=N_FEATURES * nodes // 16,
        unfinished_last_run=False,
        **({"run_gap_minutes": (0.0, 0.0)} if merge_runs else {}),
    )
    plant_runs, points = plant.runs, plant.points
    if merge_runs:
        plant_runs = [dataclasses.replace(plant.runs[0], ended_at=plant.runs[-1].ended_at)]
        points = dataclasses.replace(points, run_id=np.full(len(points), plant_runs[0].run_id, dtype=object))
    t1 = time.perf_counter()
    url = f"duckdb://{db_path}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant_runs, nodes=plant.nodes, points=points)
    t2 = time.perf_counter()
    spec = plant_spec_dict(plant, SPEC_ID, history_steps=HISTORY, horizon_steps=HORIZON, beat_ms=1000, stride=stride)
    w = Workload(
        dir=directory,
        tsdb_url=url,
        spec=spec,
        runs=[{"run_id": r.run_id, "started_at": r.started_at, "ended_at": r.ended_at} for r in plant_runs],
        points=len(plant.points),
        nodes=len(plant.nodes),
        seconds_simulate=t1 - t0,
        seconds_ingest=t2 - t1,
        params=params,
    )
    (directory / "workload.json").write_text(json.dumps(w.to_json(), indent=1))
    return w


def make_workload_in_subprocess(
    directory: Path,
    *,
    runs: int,
    minutes: float,
    seed: int = 1,
    stride: int = 1,
    merge_runs: bool = False,
    reuse: bool = False,
    nodes: int = 16,
) -> Workload:
    """:func:`make_workload` in a fresh Python process (its memory never touches ours)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "bench.workload", str(directory), "--runs", str(runs),
           "--minutes", str(minutes), "--seed", str(seed), "--stride", str(stride), "--nodes", str(nodes)]
    cmd += (["--merge-runs"] if merge_runs else []) + (["--reuse"] if reuse else [])
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"workload generation failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    return Workload.from_json(json.loads((Path(directory) / "workload.json").read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.workload", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--runs", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stride", type=int, default=1)
    ap.add_argument("--merge-runs", action="store_true", help="one long run made of RUNS back-to-back pieces")
    ap.add_argument("--reuse", action="store_true", help="keep the directory's workload if it is this one")
    ap.add_argument("--nodes", type=int, default=16, help="nodes of the plant (a multiple of 4)")
    a = ap.parse_args(argv)
    w = make_workload(a.dir, runs=a.runs, minutes=a.minutes, seed=a.seed, stride=a.stride,
                      merge_runs=a.merge_runs, reuse=a.reuse, nodes=a.nodes)
    print(json.dumps({"points": w.points, "runs": len(w.runs), "seconds_simulate": w.seconds_simulate,
                      "seconds_ingest": w.seconds_ingest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
