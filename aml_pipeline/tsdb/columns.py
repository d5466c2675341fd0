"""Adapter-neutral handling of the port's types on their way into and out of a database.

Validation and coercion of ingest input (runs, nodes, point columns) before any transaction
starts, so every adapter refuses the same input with the same message, and the small
conversions back (rows to :class:`Run`, empty pages). Shared by the DuckDB and PostgreSQL
adapters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from aml_pipeline.errors import IngestError, InvalidIdError, TsdbError, quote
from aml_pipeline.ids import check_external_id
from aml_pipeline.tsdb.port import EVIDENCE_SOURCES, Cursor, Node, Page, PointColumns, Run

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


class PreparedPoints:
    __slots__ = ("n", "run_codes", "run_uniques", "node_codes", "node_uniques", "ts", "value", "state")

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


def prepare_points(points: PointColumns) -> PreparedPoints:
    """Coerce and check the columns (vectorised) before the transaction starts."""
    n = len(points)
    for name in ("run_id", "node_id", "value", "state"):
        if np.shape(getattr(points, name))[0] != n:
            raise IngestError(
                f"points: column {name} has {np.shape(getattr(points, name))[0]} rows, ts has {n}"
            )
    ts = int_column(points.ts, "ts", I64_MIN, I64_MAX, np.int64)
    state = int_column(points.state, "state", I32_MIN, I32_MAX, np.int32)
    value = np.asarray(points.value)
    if value.dtype.kind not in "fiu":
        raise IngestError(f"points: column value must be numeric, got dtype {value.dtype}")
    value = value.astype(np.float64, copy=False)
    run_codes, run_uniques = pd.factorize(np.asarray(points.run_id, dtype=object), use_na_sentinel=True)
    node_codes, node_uniques = pd.factorize(np.asarray(points.node_id, dtype=object), use_na_sentinel=True)
    for codes, what in ((run_codes, "run_id"), (node_codes, "node_id")):
        if codes.size and codes.min() < 0:
            i = int(np.argmax(codes < 0))
            raise IngestError(f"points: point at index {i} has no {what}; nothing written")
    return PreparedPoints(
        n=n,
        run_codes=run_codes,
        run_uniques=list(run_uniques),
        node_codes=node_codes,
        node_uniques=list(node_uniques),
        ts=ts,
        value=value,
        state=state,
    )


def int_column(values: Any, name: str, lo: int, hi: int, dtype: type) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        raise IngestError(f"points: column {name} must be integer, got dtype {arr.dtype}")
    if arr.size and (arr.min() < lo or arr.max() > hi):
        bad = int(np.argmax((arr < lo) | (arr > hi)))
        raise IngestError(f"points: point at index {bad} has {name} {arr[bad]} out of range")
    return arr.astype(dtype, copy=False)


def codes_to_keys(
    p: PreparedPoints, codes: np.ndarray, uniques: list[Any], key_map: dict[str, int], what: str
) -> np.ndarray:
    lookup = np.empty(len(uniques), dtype=np.int64)
    missing = []
    for j, u in enumerate(uniques):
        k = key_map.get(u) if isinstance(u, str) else None
        if k is None:
            missing.append(j)
            lookup[j] = -1
        else:
            lookup[j] = k
    if missing:
        first = min(int(np.argmax(codes == j)) for j in missing)
        bad = uniques[int(codes[first])]
        raise IngestError(
            f"points: point at index {first} references {what} {bad!r}, which is neither in the "
            "database nor in this ingest; nothing written"
        )
    return lookup[codes]


def runs_table(runs: list[Run]) -> pa.Table | None:
    if not runs:
        return None
    seen: set[str] = set()
    for i, r in enumerate(runs):
        where = f"runs[{i}]"
        check_id(r.run_id, f"{where}: run_id")
        if r.run_id in seen:
            raise IngestError(f"{where}: run_id {r.run_id!r} appears twice in one ingest")
        seen.add(r.run_id)
        for field in ("line_id", "product_id", "recipe_id"):
            v = getattr(r, field)
            if not isinstance(v, str) or not v.strip():
                raise IngestError(f"{where} ({r.run_id}): {field} must be a non-empty string")
        if r.evidence_source not in EVIDENCE_SOURCES:
            raise IngestError(
                f"{where} ({r.run_id}): evidence_source {quote(r.evidence_source)} is not one of "
                + ", ".join(EVIDENCE_SOURCES)
            )
        if r.ended_at is not None and r.ended_at < r.started_at:
            raise IngestError(
                f"{where} ({r.run_id}): ended_at {r.ended_at} is before started_at {r.started_at}"
            )
        if r.recipe_version is not None and not (I32_MIN <= r.recipe_version <= I32_MAX):
            raise IngestError(f"{where} ({r.run_id}): recipe_version {r.recipe_version} out of range")
    return pa.table(
        {
            "ord": pa.array(range(len(runs)), type=pa.int64()),
            "run_id": pa.array([r.run_id for r in runs], type=pa.string()),
            "line_id": pa.array([r.line_id for r in runs], type=pa.string()),
            "product_id": pa.array([r.product_id for r in runs], type=pa.string()),
            "recipe_id": pa.array([r.recipe_id for r in runs], type=pa.string()),
            "recipe_version": pa.array(
                [None if r.recipe_version is None else int(r.recipe_version) for r in runs],
                type=pa.int32(),
            ),
            "recipe_content_hash": pa.array([r.recipe_content_hash for r in runs], type=pa.string()),
            "started_at": pa.array([int(r.started_at) for r in runs], type=pa.int64()),
            "ended_at": pa.array(
                [None if r.ended_at is None else int(r.ended_at) for r in runs], type=pa.int64()
            ),
            "evidence_source": pa.array([r.evidence_source for r in runs], type=pa.string()),
            "context_confirmed": pa.array([bool(r.context_confirmed) for r in runs], type=pa.bool_()),
        }
    )


def nodes_table(nodes: list[Node]) -> pa.Table | None:
    if not nodes:
        return None
    seen: set[str] = set()
    for i, n in enumerate(nodes):
        where = f"nodes[{i}]"
        check_id(n.node_id, f"{where}: node_id")
        if n.node_id in seen:
            raise IngestError(f"{where}: node_id {n.node_id!r} appears twice in one ingest")
        seen.add(n.node_id)
        lo, hi = n.range_lo, n.range_hi
        for name, v in (("range_lo", lo), ("range_hi", hi)):
            if v is not None and not np.isfinite(float(v)):
                shown = "NaN" if np.isnan(float(v)) else repr(float(v))
                raise IngestError(f"{where} ({n.node_id}): {name} is {shown}; leave it empty (None)")
        if lo is not None and hi is not None and float(lo) > float(hi):
            raise IngestError(f"{where} ({n.node_id}): range_lo {lo} is above range_hi {hi}")
    return pa.table(
        {
            "ord": pa.array(range(len(nodes)), type=pa.int64()),
            "node_id": pa.array([n.node_id for n in nodes], type=pa.string()),
            "unit": pa.array([n.unit or "" for n in nodes], type=pa.string()),
            "range_lo": pa.array([opt_float(n.range_lo) for n in nodes], type=pa.float64()),
            "range_hi": pa.array([opt_float(n.range_hi) for n in nodes], type=pa.float64()),
        }
    )


def check_schema_version(version: int, newest: int, where: str, kind: str) -> None:
    """Refuse a TSDB schema version this code cannot read: newer than ``newest``, or below 1."""
    if not 1 <= version <= newest:
        raise TsdbError(
            f"{where} has TSDB schema version {version}, this aml_pipeline reads versions 1 to "
            f"{newest}" + ("; upgrade aml_pipeline" if version > newest else f"; re-ingest into a new {kind}"),
            code="TSDB_SCHEMA_VERSION",
        )


def check_id(value: Any, what: str) -> None:
    try:
        check_external_id(value, what=what)
    except InvalidIdError as e:
        raise IngestError(e.message) from None


def sorted_by_ts_seq(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ts, seq = cols["ts"], cols["seq"]
    if ts.shape[0] < 2:
        return cols
    dts = np.diff(ts)
    if bool(np.all((dts > 0) | ((dts == 0) & (np.diff(seq) > 0)))):
        return cols
    order = np.lexsort((seq, ts))
    return {k: np.asarray(v)[order] for k, v in cols.items()}


def empty_page(cursor: Cursor | None) -> Page:
    return Page(
        np.empty(0, np.int64),
        np.empty(0, np.float64),
        np.empty(0, np.int32),
        np.empty(0, np.int64),
        cursor,
        True,
    )


def run_from_row(r: tuple[Any, ...]) -> Run:
    return Run(
        run_id=r[0],
        line_id=r[1],
        product_id=r[2],
        recipe_id=r[3],
        recipe_version=None if r[4] is None else int(r[4]),
        recipe_content_hash=r[5],
        started_at=int(r[6]),
        ended_at=None if r[7] is None else int(r[7]),
        evidence_source=r[8],
        context_confirmed=bool(r[9]),
    )


def opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def clamp_i64(v: int) -> int:
    v = int(v)
    return I64_MIN if v < I64_MIN else I64_MAX if v > I64_MAX else v

