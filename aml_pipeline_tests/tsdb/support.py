"""Helpers of the TSDB tests used by other folders too: small catalogs and points, a plant ingested
in two parts, waiting for a queued writer of the embedded file."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from aml_pipeline.simulate.plant import SimulatedPlant
from aml_pipeline.tsdb.port import Node, PointColumns, Run, TsdbPort
from aml_pipeline.tsdb.writer_intent import intent_path


def run(run_id: str, started: int = 0, ended: int | None = 10**6) -> Run:
    return Run(run_id, "L1", "P1", "R1", 1, "h", started, ended, "simulation", True)


def points(rows: list[tuple]) -> PointColumns:
    return PointColumns(
        np.array([r[0] for r in rows], dtype=object),
        np.array([r[1] for r in rows], dtype=object),
        np.array([r[2] for r in rows], dtype=np.int64),
        np.array([r[3] for r in rows], dtype=np.float64),
        np.array([r[4] if len(r) > 4 else 0 for r in rows], dtype=np.int32),
    )


def small_dataset(n_runs: int = 3, n_nodes: int = 3, n_points: int = 50):
    runs = [run(f"R{r}", r * 10**6, r * 10**6 + 10**5) for r in range(n_runs)]
    nodes = [Node(f"N{k}", "u", 0.0, 1.0) for k in range(n_nodes)]
    rows = []
    for r in runs:
        for k, n in enumerate(nodes):
            rows += [(r.run_id, n.node_id, r.started_at + 100 * i, i * 0.5 + k) for i in range(n_points)]
    return runs, nodes, points(rows)


def wait_until_queued(url: str, writer: subprocess.Popen, timeout: float = 60) -> None:
    """Until ``writer`` holds its place in the queue: the intent file locked exclusively (a shared
    lock on it is refused; taking one for a moment is what every reader's open does anyway)."""
    intent = intent_path(Path(url[len("duckdb://"):]))
    deadline = time.monotonic() + timeout
    while True:
        assert writer.poll() is None, writer.communicate()
        if intent.exists():
            fd = os.open(intent, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            finally:
                os.close(fd)  # releases the shared lock if it was taken
        assert time.monotonic() < deadline, "the writer never queued for the file"
        time.sleep(0.01)


def ingest_plant(db: TsdbPort, plant: SimulatedPlant) -> None:
    """Catalog first, then the points in two ingests (seq continues across them)."""
    db.ingest(runs=plant.runs, nodes=plant.nodes)
    p = plant.points
    half = len(p) // 2
    for part in (slice(0, half), slice(half, len(p))):
        db.ingest(points=PointColumns(p.run_id[part], p.node_id[part], p.ts[part], p.value[part], p.state[part]))
