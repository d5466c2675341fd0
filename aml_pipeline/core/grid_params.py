"""How one node's raw points become its column of the cleaned grid: one object per node.

:class:`NodeGridParams` holds a node's cleaning rules and its alignment, resolved (the node's own
settings applied over the spec-wide ones). The grid stage builds it from the spec in one place
(:func:`aml_pipeline.pipeline.stages.grid.node_grid_params`) and hands it whole to
:class:`~aml_pipeline.core.clean.SeriesCleaner` and :class:`~aml_pipeline.core.grid.GridAligner`,
so a new setting is a field here, read where it acts, and nowhere a list of arguments to extend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aml_pipeline.core.args import as_int
from aml_pipeline.core.hampel import hampel_outliers

INTERP_METHODS: tuple[str, ...] = ("linear", "hold")
AGGREGATES: tuple[str, ...] = ("point", "mean")


@dataclass(frozen=True)
class NodeGridParams:
    """A node's cleaning and alignment, validated once (a bad value is a ``ValueError`` naming it).

    Cleaning (docs/spec.md, in rule order): a point survives if its state is one of
    ``good_states`` and its value lies in the inclusive ``valid_range`` (``None`` = unbounded on
    that side); Hampel then removes outliers with half window ``hampel_k`` (0 = off), threshold
    ``hampel_sigma`` robust standard deviations and floor ``hampel_min_dev``. Alignment:
    ``interp`` ("linear" or "hold") onto the grid, bridging at most ``max_interp_ms``, taking
    the value at each grid time (``aggregate`` "point") or the time-weighted mean over the beat
    that ends there ("mean"; ``None`` is "point").

    ``causal``: a grid row depends only on points before the next grid time, so a window's
    history depends only on points before its origin: Hampel judges each point by the point and
    the ``2k`` before it (about the median of the newest of them), and linear alignment interpolates only towards a point less than one
    beat after the grid time, else holds the last kept value within ``max_interp_ms``
    (docs/spec.md, causal).
    """

    good_states: tuple[int, ...]
    valid_range: tuple[float | None, float | None]
    hampel_k: int
    hampel_sigma: float
    hampel_min_dev: float
    interp: str
    max_interp_ms: int
    aggregate: str | None = "point"
    causal: bool = False

    def __post_init__(self) -> None:
        good = np.asarray(list(self.good_states))
        if good.size == 0:
            raise ValueError("NodeGridParams: good_states is empty, so every point would be dropped")
        if not np.issubdtype(good.dtype, np.integer):
            raise ValueError(f"NodeGridParams: good_states must be integers, got {list(self.good_states)!r}")
        lo_hi = tuple(self.valid_range)
        if len(lo_hi) != 2:
            raise ValueError(f"NodeGridParams: valid_range must be (range_lo, range_hi), got {self.valid_range!r}")
        lo, hi = _bound("range_lo", lo_hi[0]), _bound("range_hi", lo_hi[1])
        if lo == math.inf or hi == -math.inf:
            raise ValueError(f"NodeGridParams: valid_range ({lo}, {hi}) holds no number, so every point would be dropped")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"NodeGridParams: range_lo ({lo}) is greater than range_hi ({hi})")
        # Validates k, sigma and min_dev with hampel_outliers' own messages.
        hampel_outliers(np.empty(0), self.hampel_k, self.hampel_sigma, self.hampel_min_dev)
        if self.interp not in INTERP_METHODS:
            raise ValueError(f"NodeGridParams: interp must be one of {INTERP_METHODS}, got {self.interp!r}")
        max_interp = as_int("max_interp_ms", self.max_interp_ms)
        if max_interp < 0:
            raise ValueError(f"NodeGridParams: max_interp_ms must be >= 0, got {max_interp}")
        aggregate = "point" if self.aggregate is None else self.aggregate
        if aggregate not in AGGREGATES:
            raise ValueError(f"NodeGridParams: aggregate must be one of {AGGREGATES} (or None), got {self.aggregate!r}")
        if not isinstance(self.causal, (bool, np.bool_)):
            raise ValueError(f"NodeGridParams: causal must be True or False, got {self.causal!r}")
        # Plain Python values: the object compares, hashes and prints the same whatever it was built from.
        for name, v in (("good_states", tuple(int(g) for g in good.tolist())), ("valid_range", (lo, hi)),
                        ("hampel_k", int(self.hampel_k)), ("hampel_sigma", float(self.hampel_sigma)),
                        ("hampel_min_dev", float(self.hampel_min_dev)), ("max_interp_ms", max_interp),
                        ("aggregate", aggregate), ("causal", bool(self.causal))):
            object.__setattr__(self, name, v)


def _bound(name: str, v: float | None) -> float | None:
    if v is None:
        return None
    f = float(v)
    if math.isnan(f):
        raise ValueError(f"NodeGridParams: {name} must be a number or None, got NaN")
    return f
