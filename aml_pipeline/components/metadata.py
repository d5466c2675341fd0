"""A stage's figures (:mod:`aml_pipeline.pipeline.metadata`) as Dagster metadata."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from aml_pipeline.pipeline.metadata import FilePath, Json, Markdown, Table


def table(rows: Sequence[Mapping[str, Any]]) -> dg.MetadataValue:
    if not rows:
        return dg.MetadataValue.md("_(none)_")
    columns = []
    for name, value in rows[0].items():
        kind = "float" if isinstance(value, float) else "int" if isinstance(value, int) else "string"
        columns.append(dg.TableColumn(name, kind))
    return dg.MetadataValue.table(
        records=[dg.TableRecord(dict(r)) for r in rows], schema=dg.TableSchema(columns=columns)
    )


def to_metadata(figures: Mapping[str, Any]) -> dict[str, Any]:
    """Dagster metadata for ``figures``: tables, markdown, paths and JSON wrapped, the rest as is."""
    out: dict[str, Any] = {}
    for name, value in figures.items():
        if isinstance(value, Table):
            out[name] = table(value.rows)
        elif isinstance(value, Markdown):
            out[name] = dg.MetadataValue.md(value.text)
        elif isinstance(value, FilePath):
            out[name] = dg.MetadataValue.path(str(value.path))
        elif isinstance(value, Json):
            out[name] = dg.MetadataValue.json(value.value)
        else:
            out[name] = value
    return out
