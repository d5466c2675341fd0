"""Reading one run's windows stage back in pieces: model-unit grid rows and window starts.

Everything downstream of the run stages (normalisation, the snapshot writer, the report, the
checks) walks a run in fixed grid blocks (:func:`aml_pipeline.pipeline.chunks.grid_block_rows`)
with the context rows each needs around a block, so no step holds a whole run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from aml_pipeline.pipeline.chunks import grid_block_rows
from aml_pipeline.pipeline.store import DatasetStore

# Window starts read per slice of starts.npy.
_STARTS_SLICE = 1 << 20


class RunWindows:
    """A run's windows stage on disk: ``rows`` model-unit grid rows and its window starts."""

    def __init__(self, store: DatasetStore, run_id: str, meta: dict) -> None:
        self.store, self.run_id = store, run_id
        self.rows = int(meta["rows"])
        self.first_ms = int(meta["firstMs"])
        self.n_windows = int(meta["windows"])
        shape = store.array_shape(run_id, "windows", "model")
        if shape[0] != self.rows:
            raise ValueError(f"run {run_id!r}: stored grid has {shape[0]} rows, its summary says {self.rows}")
        self.n_cols = int(shape[1])
        n_starts = store.array_shape(run_id, "windows", "starts")[0]
        if n_starts != self.n_windows:
            raise ValueError(f"run {run_id!r}: {n_starts} stored window starts, its summary says {self.n_windows}")
        self.block_rows = grid_block_rows(self.n_cols)

    def grid_rows(self, r0: int, r1: int) -> np.ndarray:
        """Model-unit grid rows ``max(0, r0) .. min(rows, r1) - 1`` as ``[n, cols]`` float64."""
        r0, r1 = max(0, r0), min(self.rows, r1)
        if r1 <= r0:
            return np.empty((0, self.n_cols), dtype=np.float64)
        return self.store.read_rows(self.run_id, "windows", "model", r0, r1)

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
            more = self.store.read_flat(self.run_id, "windows", "starts", self._next, stop)
            self._buf = np.concatenate([self._buf, more[np.searchsorted(more, lo) :]])
            self._next = stop
        return self._buf[: np.searchsorted(self._buf, hi)]
