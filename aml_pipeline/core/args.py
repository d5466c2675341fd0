"""Argument checks shared by the core modules: a bad argument is a ValueError naming it."""

from __future__ import annotations

import operator


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
