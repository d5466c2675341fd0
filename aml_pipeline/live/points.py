"""Raw points as a model server has them, turned into one node's columns in ``(ts, seq)`` order.

Accepted forms (docs/consumers.md, running a model in the plant):

* a mapping ``{node_id: (ts, value)}``, ``{node_id: (ts, value, state)}`` or
  ``{node_id: {"ts": ..., "value": ..., "state": ...}}`` of array-likes;
* a long table with columns ``node_id``, ``ts``, ``value`` and optionally ``state``: a pandas
  DataFrame, a pyarrow Table, or :class:`~aml_pipeline.tsdb.port.PointColumns` (what
  :func:`aml_pipeline.tsdb.ingest.read_points` reads from a points file).

``ts`` is integer epoch milliseconds or ``datetime64``; a missing ``state`` is good (0). Rows with
the same timestamp keep their given order, which stands for the ingestion order (the last one
wins, as in the TSDB).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aml_pipeline.plausible_time import epoch_ms_column_problem
from aml_pipeline.errors import AmlError, cut


class LiveInputError(AmlError):
    """Live points that cannot become a model's input (a node missing, too few points, a gap in
    the history): one line naming the node and the time. A model is never handed a NaN."""

    code = "LIVE_INPUT_INVALID"


class NoPlannedPoints(LiveInputError):
    """Planned controls without a single point after the origin, where a control's history does
    not hold to the horizon: the missing plan named as such, not as a gap in the history."""

    def __init__(self, node: str, at_ms: int, origin_ms: int) -> None:
        self.node, self.at_ms = node, at_ms
        super().__init__(f"the planned controls hold no point after the origin {when(origin_ms)}, and without one "
                         f"node {node} has no value at {when(at_ms)}: give the controls' planned points")


@dataclass(frozen=True, eq=False)
class NodePoints:
    """One node's points, ordered by time (ties in their given order)."""

    ts: np.ndarray  # int64 epoch ms
    value: np.ndarray  # float64
    state: np.ndarray  # int32

    def between(self, lo: int | None, hi: int | None) -> NodePoints:
        """The points with ``lo <= ts <= hi`` (``None``: unbounded)."""
        a = 0 if lo is None else int(np.searchsorted(self.ts, lo, side="left"))
        b = self.ts.size if hi is None else int(np.searchsorted(self.ts, hi, side="right"))
        return NodePoints(self.ts[a:b], self.value[a:b], self.state[a:b])

    def __len__(self) -> int:
        return int(self.ts.size)

    @classmethod
    def concat(cls, parts: list[NodePoints]) -> NodePoints:
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("ts", "value", "state")))


EMPTY = NodePoints(np.empty(0, np.int64), np.empty(0), np.empty(0, np.int32))


# The times a message can show (``when``): years 1 to 9999, as Python's datetime has them.
MIN_MS = -62_135_596_800_000
MAX_MS = 253_402_300_799_999


def epoch_ms(t: Any, what: str = "time") -> int:
    """Epoch milliseconds from an int, a ``datetime`` (naive = UTC), ``numpy.datetime64`` or an
    ISO-8601 text, between years 1 and 9999."""
    ms = _epoch_ms(t, what)
    if not MIN_MS <= ms <= MAX_MS:
        raise LiveInputError(f"{what} {cut(t)} is out of range: a time lies between 0001-01-01 and 9999-12-31 UTC "
                             f"(epoch ms {MIN_MS} to {MAX_MS})", code="LIVE_ORIGIN_INVALID")
    return ms


def _epoch_ms(t: Any, what: str) -> int:
    if isinstance(t, (bool, np.bool_)):
        raise LiveInputError(f"{what} must be epoch milliseconds or a datetime, got {t!r}", code="LIVE_ORIGIN_INVALID")
    if isinstance(t, (int, np.integer)):
        return int(t)
    if isinstance(t, str):
        try:
            t = _dt.datetime.fromisoformat(t.strip().replace("Z", "+00:00"))
        except ValueError:
            if t.strip().lstrip("-").isdigit():
                return int(t.strip())
            raise LiveInputError(f"{what} {t!r} is neither epoch milliseconds nor an ISO-8601 time",
                                 code="LIVE_ORIGIN_INVALID") from None
    if isinstance(t, np.datetime64):
        return int(t.astype("datetime64[ms]").astype(np.int64))
    if isinstance(t, _dt.datetime):
        if t.tzinfo is None:
            t = t.replace(tzinfo=_dt.timezone.utc)
        delta = t - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
        return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000
    raise LiveInputError(f"{what} must be epoch milliseconds or a datetime, got {type(t).__name__}",
                         code="LIVE_ORIGIN_INVALID")


def when(ms: int) -> str:
    """A time for messages: ISO-8601 UTC with milliseconds, and the epoch ms (only the epoch ms
    outside the years a datetime has, e.g. a history reaching back before year 1)."""
    try:
        stamp = _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.timezone.utc).isoformat(timespec="milliseconds")
    except (ValueError, OverflowError, OSError):
        return f"epoch ms {ms}"
    return f"{stamp.replace('+00:00', 'Z')} ({ms})"


def _ms_array(ts: Any, where: str) -> np.ndarray:
    a = np.asarray(ts)
    if a.ndim != 1:
        raise LiveInputError(f"{where}: ts must be 1-D, got shape {a.shape}")
    if a.dtype.kind == "M":  # datetime64
        if a.size and np.isnat(a).any():
            raise LiveInputError(f"{where}: ts has a missing time (NaT) at row {int(np.flatnonzero(np.isnat(a))[0])}")
        return a.astype("datetime64[ms]").astype(np.int64)
    if a.size and a.dtype.kind not in "iu":
        raise LiveInputError(f"{where}: ts must be integer epoch milliseconds or datetime64, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def node_points(ts: Any, value: Any, state: Any = None, *, where: str = "points") -> NodePoints:
    """One node's columns checked and put in time order (a stable sort: ties keep their order)."""
    t = _ms_array(ts, where)
    # Times in seconds would be points of 1970, all before the run, and the node said to have none.
    if (found := epoch_ms_column_problem(t, written_as="integer epoch milliseconds or datetime64")) is not None:
        raise LiveInputError(f"{where}: ts at row {found[0]}: {found[1]}")
    try:
        v = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise LiveInputError(f"{where}: value must be numbers ({e})") from None
    s = np.zeros(t.size, dtype=np.int32) if state is None else np.asarray(state)
    if v.ndim != 1 or s.ndim != 1 or not (t.size == v.size == s.size):
        raise LiveInputError(f"{where}: ts, value and state must be 1-D of one length, got {t.size}, {v.size}, {s.size}")
    if s.size and s.dtype.kind not in "iu":
        raise LiveInputError(f"{where}: state must be integer quality codes, got dtype {s.dtype}")
    s = s.astype(np.int32, copy=False)
    if t.size > 1 and bool(np.any(np.diff(t) < 0)):
        order = np.argsort(t, kind="stable")
        t, v, s = t[order], v[order], s[order]
    return NodePoints(t, v, s)


def points_by_node(points: Any, nodes: list[str] | None = None, *, what: str = "points") -> dict[str, NodePoints]:
    """``points`` in any accepted form, per node id (only ``nodes`` when given)."""
    if points is None:
        return {}
    if isinstance(points, Mapping):
        out = {}
        for node, cols in points.items():
            if nodes is not None and node not in nodes:
                continue
            where = f"{what} of node {node}"
            if isinstance(cols, Mapping):
                missing = [k for k in ("ts", "value") if k not in cols]
                if missing:
                    raise LiveInputError(f"{where}: needs keys ts and value (and optionally state), missing {', '.join(missing)}")
                out[str(node)] = node_points(cols["ts"], cols["value"], cols.get("state"), where=where)
            elif isinstance(cols, (tuple, list)) and len(cols) in (2, 3):
                out[str(node)] = node_points(*cols, where=where)
            else:
                raise LiveInputError(f"{where}: give (ts, value), (ts, value, state) or a mapping with ts, value, state")
        return out
    columns = _long_columns(points, what)
    node_ids = np.asarray(columns["node_id"]).astype(str)
    out = {}
    for node in (nodes if nodes is not None else sorted(set(node_ids.tolist()))):
        rows = np.flatnonzero(node_ids == node)
        if rows.size:
            state = None if columns.get("state") is None else np.asarray(columns["state"])[rows]
            out[node] = node_points(np.asarray(columns["ts"])[rows], np.asarray(columns["value"])[rows], state,
                                    where=f"{what} of node {node}")
    return out


def _long_columns(points: Any, what: str) -> dict[str, Any]:
    """The ``node_id``, ``ts``, ``value`` (and ``state``) columns of a long table."""
    names: list[str]
    if hasattr(points, "column_names") and hasattr(points, "column"):  # pyarrow.Table
        names = list(points.column_names)

        def get(n: str) -> Any:
            return points.column(n).to_numpy()
    elif hasattr(points, "columns") and hasattr(points, "__getitem__"):  # pandas.DataFrame
        names = [str(c) for c in points.columns]

        def get(n: str) -> Any:
            return points[n].to_numpy()
    elif all(hasattr(points, k) for k in ("node_id", "ts", "value")):  # PointColumns
        names = [k for k in ("node_id", "ts", "value", "state") if getattr(points, k, None) is not None]

        def get(n: str) -> Any:
            return getattr(points, n)
    else:
        raise LiveInputError(
            f"{what}: give a mapping {{node_id: (ts, value[, state])}} or a table with columns node_id, ts, value "
            f"[, state] (a pandas DataFrame, a pyarrow Table, PointColumns), got {type(points).__name__}")
    missing = [k for k in ("node_id", "ts", "value") if k not in names]
    if missing:
        raise LiveInputError(f"{what}: the table has no column {', '.join(missing)} (it has {', '.join(names)})")
    return {k: (get(k) if k in names else None) for k in ("node_id", "ts", "value", "state")}
