"""v2 unit contract: source units -> model units as ``v * scale + offset``.

Fails closed: a variable whose scale is missing, zero or non-finite, or whose offset is missing
or non-finite, stops the build. Defaulting to 1/0 would silently train a model in the wrong
units (train/serve skew).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from aml_pipeline.errors import UnitContractError


@dataclass(frozen=True)
class UnitTransform:
    scale: float
    offset: float


def check_unit_contract(
    variables: Iterable[tuple[str, str, object, object]], node_ids: Sequence[str]
) -> dict[str, UnitTransform]:
    """Validate ``(variable_id, node_id, scale, offset)`` rows; return transforms by node id."""
    known = set(node_ids)
    transforms: dict[str, UnitTransform] = {}
    for var_id, node_id, scale, offset in variables:
        if node_id not in known:
            raise UnitContractError(
                f"variable {var_id!r} names node {node_id!r}, which is not in the spec's nodes"
            )
        if node_id in transforms:
            raise UnitContractError(f"node {node_id!r} has more than one variable (variable {var_id!r})")
        s, o = _as_float(scale), _as_float(offset)
        if s is None or not math.isfinite(s) or s == 0.0 or o is None or not math.isfinite(o):
            raise UnitContractError(
                f"variable {var_id!r} (node {node_id!r}) has an invalid unit transform "
                f"(scale={scale!r}, offset={offset!r}); scale must be finite and non-zero, offset "
                "finite, and neither is defaulted"
            )
        transforms[node_id] = UnitTransform(s, o)
    return transforms


def _as_float(value: object) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def to_model_units(
    grid: np.ndarray, node_ids: Sequence[str], transforms: dict[str, UnitTransform]
) -> np.ndarray:
    """Apply the transforms column-wise to a ``[T, nodes]`` float64 grid (NaN stays NaN)."""
    if grid.ndim != 2 or grid.shape[1] != len(node_ids):
        raise ValueError(f"grid has shape {grid.shape}, expected [T, {len(node_ids)}]")
    out = np.array(grid, dtype=np.float64, copy=True)
    for j, node_id in enumerate(node_ids):
        t = transforms.get(node_id)
        if t is not None:
            out[:, j] = out[:, j] * t.scale + t.offset
    return out
