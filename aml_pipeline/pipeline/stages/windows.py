"""The windows stage: the run's valid window starts, on its grid in model units.

A window at start t reads history rows t-H..t-1 (every node), then controls and targets over rows
t..t+F-1; it is valid when none of what it reads is missing. Starts are found block by block
(:class:`~aml_pipeline.core.windows.StartFinder`), so a run of any length fits the budget.

The stage stores the starts alone: the model-unit rows are the grid stage's values with the unit
transforms applied, computed again where they are read (:class:`RunWindows`) rather than stored a
second time. Stores built before keep a ``windows.model.npy`` that nothing reads; ``gc`` removes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aml_pipeline.core.windows import StartFinder, explain_no_windows
from aml_pipeline.errors import BuildError
from aml_pipeline.pipeline.chunks import grid_block_rows, release_freed_memory
from aml_pipeline.pipeline.stages.base import Stage, derived_stage_summary
from aml_pipeline.pipeline.stages.grid import GRID, read_grid_rows
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec


def _covers(spec: DatasetSpec, j: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "historySteps": j["historySteps"],
        "horizonSteps": j["horizonSteps"],
        "stride": j["stride"],
        "roles": [n["role"] for n in j["nodes"]],
        "units": {n: [t.scale, t.offset] for n, t in sorted(spec.unit_transforms().items())},
    }


WINDOWS = Stage(
    name="windows",
    asset="run_windows",
    upstream="grid",
    per_run=True,
    algorithm=2,
    covers=_covers,
    files=("starts",),
    description=(
        "The run's valid window starts on its grid in model units (no gap in what a window uses). "
        "Per run: windows, and why there are none."
    ),
)


@dataclass
class Columns:
    """Column indices of the control and target groups in the node-ordered grid."""

    controls: list[int]
    targets: list[int]

    @classmethod
    def of(cls, spec: DatasetSpec) -> Columns:
        idx = {n: j for j, n in enumerate(spec.node_ids)}
        return cls([idx[n] for n in spec.control_ids], [idx[n] for n in spec.target_ids])


@dataclass
class WindowsSummary:
    run_id: str
    windows: int
    rows: int
    reason: str | None  # why there are no windows, when there are none
    missing: dict[str, float]
    data_version: str

    def figures(self, store: DatasetStore, *, plot: bool = False) -> dict[str, Any]:
        return {"windows": self.windows, "reason": self.reason or "", "grid_rows": self.rows}


# A node missing more than this share of a run's grid is worth a look (a warning, not an error).
MISSING_WARN_RATIO = 0.2


def window_findings(summaries: Mapping[str, WindowsSummary]) -> tuple[dict[str, str], dict[str, tuple[str, float]]]:
    """Runs without windows (with the reason), and runs with a node missing more than
    :data:`MISSING_WARN_RATIO` of the grid (the worst such node and its share)."""
    empty = {r: s.reason or "" for r, s in summaries.items() if s.windows == 0}
    worst = {r: max(s.missing.items(), key=lambda kv: kv[1]) for r, s in summaries.items()}
    return empty, {r: nv for r, nv in worst.items() if nv[1] > MISSING_WARN_RATIO}


def unit_columns(spec: DatasetSpec) -> list[tuple[int, float, float]]:
    """``(column, scale, offset)`` of every node with a v2 unit transform."""
    transforms = spec.unit_transforms()
    return [(j, t.scale, t.offset) for j, n in enumerate(spec.node_ids) if (t := transforms.get(n))]


def to_model_units(block: np.ndarray, units: list[tuple[int, float, float]]) -> np.ndarray:
    """``block`` (grid rows, ``[rows, nodes]``) converted to model units in place (:func:`unit_columns`)."""
    for j, scale, offset in units:
        block[:, j] = block[:, j] * scale + offset
    return block


def window_run(store: DatasetStore, run_id: str, *, grid: np.ndarray | None = None) -> WindowsSummary:
    """Find the run's valid window starts on its grid in model units, block by block.

    Writes ``windows.starts.npy``. ``grid``: the run's stored grid (``[nodes, rows]``) when the
    cleaning that wrote it holds it, taken instead of reading it back.
    """
    spec = store.spec
    meta = store.require(run_id, GRID)
    rows, n_nodes = int(meta["rows"]), len(spec.nodes)
    cols = Columns.of(spec)
    finder = StartFinder(rows, n_nodes, spec.history_steps, spec.horizon_steps, spec.stride, cols.controls, cols.targets)
    units = unit_columns(spec)
    block_rows = grid_block_rows(n_nodes)
    nonfinite = np.zeros(n_nodes, dtype=np.int64)
    windows = 0
    with store.stage_writer(run_id, WINDOWS) as writer:
        starts = writer.array("starts", "<i8")
        for r0 in range(0, rows, block_rows):
            r1 = min(rows, r0 + block_rows)
            if grid is not None and grid.shape == (n_nodes, rows):
                # Only the rows' finiteness is read here: without a unit transform the held grid's
                # rows serve as they are (a transposed view), else a copy is converted.
                block = grid[:, r0:r1].T
                if units:
                    block = to_model_units(np.ascontiguousarray(block), units)
            else:
                block = to_model_units(read_grid_rows(store, run_id, n_nodes, rows, r0, r1), units)
            nonfinite += np.count_nonzero(~np.isfinite(block), axis=0)
            found = finder.feed(block)
            starts.append(found)
            windows += found.size
        found = finder.finish()
        starts.append(found)
        windows += found.size
        if rows > block_rows:
            release_freed_memory()
        reason = None
        if windows == 0:
            reason = explain_no_windows(rows, spec.history_steps, spec.horizon_steps, nonfinite, spec.node_ids)
        summary = derived_stage_summary(
            store.versions[WINDOWS], meta, rows=rows, firstMs=meta["firstMs"], windows=windows,
            reason=reason, missing=meta["missing"], counts=meta["counts"],
        )
        writer.commit(summary)
    return WindowsSummary(run_id, windows, rows, reason, meta["missing"], summary["dataVersion"])


# ---- reading the stage back -----------------------------------------------------------------
# Everything downstream of the run stages (normalisation, the snapshot writer, the report) walks a
# run in fixed grid blocks with the context rows each needs around a block, so no step holds a
# whole run.

# Window starts read per slice of starts.npy.
_STARTS_SLICE = 1 << 20


class RunWindows:
    """A run's windows stage on disk: its window starts, and the ``rows`` model-unit grid rows
    they index (the grid stage's values, converted as the windows stage converted them)."""

    def __init__(self, store: DatasetStore, run_id: str, meta: dict) -> None:
        self.store, self.run_id = store, run_id
        self.rows = int(meta["rows"])
        self.first_ms = int(meta["firstMs"])
        self.n_windows = int(meta["windows"])
        # The starts were found on one version of the run's grid: rows of another (a grid rebuilt
        # after the windows, which the build would rebuild too) would not be the rows they index.
        grid = store.read_meta(run_id, GRID)
        if grid is None or grid.get("dataVersion") != meta.get("inputVersion"):
            raise BuildError(
                f"run {run_id!r}: its windows were built from another version of its cleaned grid than the "
                "one stored; rematerialise the run's windows")
        shape = store.array_shape(run_id, GRID, "values")
        if shape[1] != self.rows:
            raise ValueError(f"run {run_id!r}: stored grid has {shape[1]} rows, its summary says {self.rows}")
        self.n_cols = int(shape[0])
        n_starts = store.array_shape(run_id, WINDOWS, "starts")[0]
        if n_starts != self.n_windows:
            raise ValueError(f"run {run_id!r}: {n_starts} stored window starts, its summary says {self.n_windows}")
        self.block_rows = grid_block_rows(self.n_cols)
        self.units = unit_columns(store.spec)

    def grid_rows(self, r0: int, r1: int) -> np.ndarray:
        """Model-unit grid rows ``max(0, r0) .. min(rows, r1) - 1`` as ``[n, cols]`` float64."""
        r0, r1 = max(0, r0), min(self.rows, r1)
        if r1 <= r0:
            return np.empty((0, self.n_cols), dtype=np.float64)
        return to_model_units(read_grid_rows(self.store, self.run_id, self.n_cols, self.rows, r0, r1), self.units)

    def blocks(self) -> Iterator[tuple[int, int]]:
        """The fixed blocks ``(r0, r1)`` covering the run's rows."""
        for r0 in range(0, self.rows, self.block_rows):
            yield r0, min(self.rows, r0 + self.block_rows)

    def starts(self) -> StartsReader:
        return StartsReader(self.store, self.run_id, self.n_windows)

    def window_blocks(self, history: int, horizon: int) -> Iterator[WindowBlock]:
        """Per fixed block: the windows starting in it and every row they read
        (``r0 - H .. r1 + F - 1``), for gathering windows block by block, in order."""
        reader = self.starts()
        for r0, r1 in self.blocks():
            starts = reader.between(r0, r1)
            if not starts.size:
                continue
            base = max(0, r0 - history)
            yield WindowBlock(base, self.grid_rows(base, r1 + horizon - 1), starts)


@dataclass
class WindowBlock:
    first_row: int  # grid row of rows[0]
    rows: np.ndarray  # [n, cols] model units
    starts: np.ndarray  # window starts (grid rows) inside the block, ascending


class StartsReader:
    """Window starts of a run in ascending ranges, read from ``starts.npy`` a slice at a time."""

    def __init__(self, store: DatasetStore, run_id: str, total: int) -> None:
        self.store, self.run_id, self.total = store, run_id, total
        self._buf = np.empty(0, dtype=np.int64)
        self._next = 0  # index of the next start to read from disk
        self._lo = None

    def between(self, lo: int, hi: int) -> np.ndarray:
        """Starts ``s`` with ``lo <= s < hi``; ``lo`` must not decrease from one call to the next."""
        if self._lo is not None and lo < self._lo:
            raise ValueError(f"StartsReader: ranges must not move back ({lo} after {self._lo})")
        self._lo = lo
        self._buf = self._buf[np.searchsorted(self._buf, lo) :]
        while self._next < self.total and (not self._buf.size or self._buf[-1] < hi):
            stop = min(self.total, self._next + _STARTS_SLICE)
            more = self.store.read_flat(self.run_id, WINDOWS, "starts", self._next, stop)
            self._buf = np.concatenate([self._buf, more[np.searchsorted(more, lo) :]])
            self._next = stop
        return self._buf[: np.searchsorted(self._buf, hi)]
