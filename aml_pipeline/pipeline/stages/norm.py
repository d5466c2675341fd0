"""The normalisation stage: mean/std per column over train windows only.

x per node over all H steps, u per control and y per target over the F steps, accumulated in
float64 one fixed grid block at a time (the block size is part of the numeric definition, see
:mod:`aml_pipeline.pipeline.chunks`); std 0 becomes 1 and is flagged. Fitted once per plan:
a rebuild whose split and run data did not change reuses the stored statistics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.core.normalize import (
    MomentAccumulator,
    NormStats,
    window_batches,
)
from aml_pipeline.errors import BuildError
from aml_pipeline.pipeline.metadata import FilePath, Table
from aml_pipeline.pipeline.reports import model_units
from aml_pipeline.pipeline.stages.base import Stage
from aml_pipeline.pipeline.stages.split import DatasetPlan
from aml_pipeline.pipeline.stages.windows import Columns, RunWindows
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec


def _covers(spec: DatasetSpec, j: Mapping[str, Any]) -> dict[str, Any]:
    return {}  # everything it reads is the split's and the windows' (its upstream versions)


NORM = Stage(
    name="norm",
    asset="normalization_stats",
    upstream="split",
    per_run=False,
    algorithm=2,
    covers=_covers,
    files=("norm.json",),
    description="mean/std per column of x, u and y over train windows only, in model units (float64; std 0 -> 1, flagged).",
)


@dataclass
class Normalization:
    x: NormStats
    u: NormStats
    y: NormStats

    def to_json(self, spec: DatasetSpec) -> dict[str, Any]:
        out = {}
        for key, stats, names in (
            ("x", self.x, spec.node_ids),
            ("u", self.u, spec.control_ids),
            ("y", self.y, spec.target_ids),
        ):
            out[key] = stats.to_json()
            out[key]["zeroStd"] = [n for n, z in zip(names, stats.zero_std, strict=True) if z]
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], spec: DatasetSpec) -> Normalization:
        def stats(key: str, names: list[str]) -> NormStats:
            g = obj[key]
            if len(g["mean"]) != len(names):
                raise BuildError(
                    f"spec {spec.id!r}: stored normalisation of {key} has {len(g['mean'])} columns, "
                    f"the spec {len(names)}; rematerialise normalization_stats"
                )
            return NormStats(
                mean=np.asarray(g["mean"], dtype=np.float64),
                std=np.asarray(g["std"], dtype=np.float64),
                zero_std=np.asarray([n in g["zeroStd"] for n in names], dtype=bool),
                count=float("nan"),
            )

        return cls(stats("x", spec.node_ids), stats("u", spec.control_ids), stats("y", spec.target_ids))


def save_norm(store: DatasetStore, norm: Normalization, plan: DatasetPlan) -> Path:
    return store.write_dataset_stage(NORM, {"inputs": plan.key(), **norm.to_json(store.spec)})


def fit_or_reuse_normalization(store: DatasetStore, plan: DatasetPlan) -> tuple[Normalization, bool]:
    """The stored statistics when they were fitted on exactly this plan (nothing is read again),
    else freshly fitted and saved. Returns them and whether they were reused."""
    stored = store.current_dataset_stage(NORM)
    if stored and stored.get("inputs") == plan.key():
        return Normalization.from_json(stored, store.spec), True
    norm = fit_normalization(store, plan)
    save_norm(store, norm, plan)
    return norm, False


def load_norm(store: DatasetStore, plan: DatasetPlan) -> Normalization:
    """The stored statistics, which must have been fitted on ``plan``."""
    obj = store.require_dataset_stage(NORM)
    if obj.get("inputs") != plan.key():
        raise BuildError(
            f"spec {store.spec_id!r}: the stored normalization_stats were fitted on another split or other "
            "run data than the current dataset_split; rematerialise normalization_stats"
        )
    return Normalization.from_json(obj, store.spec)


# Threads computing runs' block batches at once, and the most runs handed to them ahead of the merge
# (a thread holds one grid block at a time, a run's batches are a few vectors per block, so memory
# stays a few blocks whatever the dataset).
FIT_THREADS = 2
FIT_RUNS_AHEAD = 4


def fit_normalization(store: DatasetStore, plan: DatasetPlan) -> Normalization:
    """mean/std per column over train windows only (float64), streamed block by block.

    Each fixed grid block of a run is one batch of the moment accumulators, with the starts of
    every window that reads a row of it; runs are merged in split order. The runs' block batches
    (reading each block and its window starts, its row weights, the two-pass moments: numpy and
    file reads release the GIL) are computed in a few threads at once, a run in one thread, and
    merged here strictly in block and run order, so the bits are those of merging them one after
    another.
    """
    spec = store.spec
    cols = Columns.of(spec)
    H, F = spec.history_steps, spec.horizon_steps
    n = len(spec.node_ids)
    total = tuple(MomentAccumulator(w) for w in (n, len(cols.controls), len(cols.targets)))

    def run_batches(run_id: str) -> list[tuple]:
        run = RunWindows(store, run_id, plan.runs[run_id])
        reader = run.starts()
        out = []
        for r0, r1 in run.blocks():
            # Windows t read rows t-H..t+F-1: those touching rows r0..r1-1 start in r0-F+1..r1+H-1.
            starts = reader.between(r0 - F + 1, r1 + H)
            out.append(window_batches(run.grid_rows(r0, r1), starts, H, F, cols.controls, cols.targets, first_row=r0))
        return out

    def merge(done: list[tuple]) -> None:
        acc = tuple(MomentAccumulator(a.n_cols) for a in total)
        for batches in done:
            for a, b in zip(acc, batches, strict=True):
                a.add_batch(b)
        for a, p in zip(total, acc, strict=True):
            a.merge(p)

    with ThreadPoolExecutor(FIT_THREADS, thread_name_prefix="norm-fit") as pool:
        pending: deque[Future] = deque()
        try:
            for run_id in plan.split["trainRunIds"]:
                pending.append(pool.submit(run_batches, run_id))
                if len(pending) > FIT_RUNS_AHEAD:
                    merge(pending.popleft().result())
            while pending:
                merge(pending.popleft().result())
        finally:
            for fut in pending:
                fut.cancel()
    if total[0].count == 0:
        raise BuildError(f"spec {spec.id!r}: no train windows to fit normalisation on", code="NO_TRAIN_RUNS")
    return Normalization(*(a.result() for a in total))


def norm_figures(store: DatasetStore, plan: DatasetPlan, norm: Normalization, *, reused: bool) -> dict[str, Any]:
    """The statistics per column with the column's model unit, zero-std columns flagged."""
    spec = store.spec
    stats = norm.to_json(spec)
    units = model_units(store, plan)
    rows = [
        {"array": group, "node": n, "model_unit": units.get(n, ""), "mean": stats[group]["mean"][i],
         "std": stats[group]["std"][i], "zero_std": str(n in stats[group]["zeroStd"])}
        for group, names in (("x", spec.node_ids), ("u", spec.control_ids), ("y", spec.target_ids))
        for i, n in enumerate(names)
    ]
    return {
        "stats": Table(rows),
        "reused": reused,
        "train_runs": len(plan.split["trainRunIds"]),
        "zero_std_columns": sum(len(stats[g]["zeroStd"]) for g in "xuy"),
        "path": FilePath(store.dataset_stage_path(NORM)),
    }


def norm_line(plan: DatasetPlan, *, reused: bool) -> str:
    return ("statistics unchanged since the last fit (same runs and data): reused" if reused
            else f"fitted on {len(plan.split['trainRunIds'])} train runs")
