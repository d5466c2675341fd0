"""Argument checks shared by the core modules: a bad argument is a ValueError naming it."""

from __future__ import annotations

import operator

import numpy as np


def as_int(name: str, v: object) -> int:
    """``v`` as an int (numpy integers included); bools and non-integers are refused."""
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None


def positive_int(name: str, v: object) -> int:
    i = as_int(name, v)
    if i < 1:
        raise ValueError(f"{name} must be >= 1, got {i}")
    return i


def window_spans(fn: str, starts: object, lo: object, hi: object, n_rows: int) -> tuple[np.ndarray, int, int]:
    """Check windows ``[t + lo, t + hi)`` for every start ``t`` lie within ``n_rows`` grid rows;
    return the starts as int64 and ``lo``, ``hi`` as ints."""
    lo, hi = as_int("lo", lo), as_int("hi", hi)
    if lo >= hi:
        raise ValueError(f"{fn}: need lo < hi, got lo={lo}, hi={hi}")
    arr = np.asarray(starts)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{fn}: starts must be a 1-D integer array")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (int(arr.min()) + lo < 0 or int(arr.max()) + hi > n_rows):
        raise ValueError(f"{fn}: a window [t{lo:+d}, t{hi:+d}) falls outside the {n_rows} grid rows")
    return arr, lo, hi
