"""What a stage says about its result, in plain values the Dagster layer shows as metadata.

Numbers and strings stand for themselves; these wrappers say how a richer value is meant to be
shown (a table, markdown with an image, a path, JSON), without the pipeline importing Dagster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Table:
    """Rows of equal keys; a column's type is taken from its first row."""

    rows: Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Markdown:
    text: str


@dataclass(frozen=True)
class FilePath:
    path: Path | str


@dataclass(frozen=True)
class Json:
    value: Any


Figures = dict[str, Any]
