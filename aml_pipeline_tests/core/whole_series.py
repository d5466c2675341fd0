"""The core's streaming classes fed a whole series in one call.

The product only streams (``SeriesCleaner``, ``GridAligner`` and ``StartFinder`` are fed in chunks);
the tests state small cases and compare chunked feeds against these whole-series forms, and the
benchmark cleans and aligns whole series with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from aml_pipeline.core.clean import SeriesCleaner
from aml_pipeline.core.grid import GridAligner, align_hold, align_linear, grid_span
from aml_pipeline.core.grid_params import NodeGridParams
from aml_pipeline.core.windows import StartFinder

# Every rule but the state check off: tests switch on what they exercise.
_PLAIN = NodeGridParams(
    good_states=(0,), valid_range=(None, None), hampel_k=0, hampel_sigma=3.0, hampel_min_dev=0.0,
    interp="linear", max_interp_ms=5000,
)


def node_params(**fields: Any) -> NodeGridParams:
    """A node's parameters: good state 0, no range, Hampel off, linear within 5 s, then ``fields``."""
    return dataclasses.replace(_PLAIN, **fields)


@dataclasses.dataclass(frozen=True, eq=False)  # eq on numpy fields would be ambiguous
class CleanedSeries:
    ts: np.ndarray  # int64, strictly increasing
    value: np.ndarray  # float64, finite
    counts: dict[str, int]  # "input", each of CLEAN_CAUSES, "kept"
    outlier_ts: np.ndarray  # int64: the points Hampel removed
    outlier_value: np.ndarray  # float64


def clean_series(ts: np.ndarray, value: np.ndarray, state: np.ndarray, params: NodeGridParams) -> CleanedSeries:
    """One node's points, in ``(ts, seq)`` order, cleaned by :class:`SeriesCleaner` in one chunk."""
    cleaner = SeriesCleaner(params)
    first = cleaner.feed(ts, value, state)
    last = cleaner.finish()
    return CleanedSeries(
        ts=np.concatenate([first.ts, last.ts]),
        value=np.concatenate([first.value, last.value]),
        counts=cleaner.counts,
        outlier_ts=np.concatenate([first.outlier_ts, last.outlier_ts]),
        outlier_value=np.concatenate([first.outlier_value, last.outlier_value]),
    )


def grid_times(start_ms: int, end_ms: int, beat_ms: int) -> np.ndarray:
    """The grid timestamps (int64 epoch ms) within the inclusive ``[start_ms, end_ms]``."""
    first, count = grid_span(start_ms, end_ms, beat_ms)
    return first + beat_ms * np.arange(count, dtype=np.int64)


def align(ts: np.ndarray, value: np.ndarray, grid: np.ndarray, *, interp: str, max_interp_ms: int) -> np.ndarray:
    """The kept points at the ``grid`` times by the checked whole-series kernel of ``interp``."""
    return {"linear": align_linear, "hold": align_hold}[interp](ts, value, grid, max_interp_ms)


def grid_column(
    ts: np.ndarray, value: np.ndarray, state: np.ndarray, first_ms: int, beat_ms: int, n_rows: int,
    params: NodeGridParams,
) -> tuple[np.ndarray, dict[str, int]]:
    """One node's column of the cleaned grid and its cleaning counts, as the grid stage makes it
    (:class:`SeriesCleaner` into :class:`GridAligner`, both given ``params``), in one chunk."""
    cleaner = SeriesCleaner(params)
    aligner = GridAligner(first_ms, beat_ms, n_rows, params)
    blocks = [*aligner.feed(*_kept(cleaner.feed(ts, value, state))), *aligner.feed(*_kept(cleaner.finish())),
              *aligner.finish()]
    column = np.concatenate([b for _, b in blocks]) if blocks else np.empty(0)
    return column, cleaner.counts


def _kept(chunk) -> tuple[np.ndarray, np.ndarray]:
    return chunk.ts, chunk.value


def window_starts(
    grid: np.ndarray, history: int, horizon: int, stride: int, control_cols: Sequence[int], target_cols: Sequence[int]
) -> np.ndarray:
    """Start rows of the complete windows of a whole ``[rows, nodes]`` grid, by :class:`StartFinder`."""
    finder = StartFinder(grid.shape[0], grid.shape[1], history, horizon, stride, control_cols, target_cols)
    return np.concatenate([finder.feed(grid), finder.finish()])
