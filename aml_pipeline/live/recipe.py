"""A snapshot's recipe from raw points to a model's input, applied at a forecast origin.

:class:`LiveRecipe` reads everything from the snapshot: the spec it was built from (cleaning, grid,
``causal``, ``aggregate``), the node ranges the cleaning used, the unit contract and the
normalisation statistics. :meth:`LiveRecipe.inputs` cleans and aligns each node's points before
the origin by the grid stage's rules (the same :class:`~aml_pipeline.core.grid_params.NodeGridParams`,
and :func:`~aml_pipeline.core.clean.clean_batch` / :func:`~aml_pipeline.core.grid.align_batch`, which
give every node what :class:`~aml_pipeline.core.clean.SeriesCleaner` and
:class:`~aml_pipeline.core.grid.GridAligner` give it, all nodes in one pass), converts units and
normalises as the windows are written, and returns ``x`` and ``u`` as the snapshot's windows hold
them. For a causal snapshot that is the window's ``x`` bit for bit; for another it says which rows
may differ, and why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aml_pipeline.core.clean import clean_batch
from aml_pipeline.core.grid import align_batch
from aml_pipeline.core.grid_params import NodeGridParams
from aml_pipeline.core.normalize import apply_norm
from aml_pipeline.live.points import EMPTY, LiveInputError, NodePoints, NoPlannedPoints, epoch_ms, points_by_node, when
from aml_pipeline.pipeline.stages.grid import node_grid_params
from aml_pipeline.pipeline.stages.windows import unit_columns
from aml_pipeline.snapshot import Snapshot, open_snapshot
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb.port import Run, RunScope, TsdbPort, iter_node_pages


@dataclass(frozen=True, eq=False)
class LiveInputs:
    """A model's input at one forecast origin, as the snapshot's windows hold it.

    ``x`` ``[H, nodes]`` and ``u`` ``[F, controls]`` (``None`` without planned controls) are
    float32, normalised with the snapshot's statistics, in its model units. ``times_ms`` are the
    grid times of ``x``'s rows (the last is one beat before ``origin_ms``). ``may_differ`` marks
    the rows of ``x`` that the snapshot's windows could hold otherwise for this origin (never in a
    causal snapshot), with the reason per node in ``why``.
    """

    origin_ms: int
    times_ms: np.ndarray
    x: np.ndarray
    u: np.ndarray | None
    nodes: tuple[str, ...]
    controls: tuple[str, ...]
    causal: bool
    may_differ: np.ndarray
    why: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None


@dataclass(frozen=True)
class _Short:
    node: str
    have: int  # surviving points before ``before``
    need: int
    before: int


class _NeedsEarlier(Exception):
    """Internal: nodes whose points do not reach back far enough for their cleaning (read more)."""

    def __init__(self, short: list[_Short]) -> None:
        super().__init__(", ".join(s.node for s in short))
        self.short = short


@dataclass(frozen=True, eq=False)
class _Column:
    values: np.ndarray  # grid values, NaN where missing
    kept_ts: np.ndarray
    survivor_ts: np.ndarray  # every point Hampel judged (kept and removed), ascending


class LiveRecipe:
    """The way from raw points to a model's input of one snapshot, and back for its predictions.

    ``snapshot``: an opened :class:`~aml_pipeline.snapshot.Snapshot` or its directory (opened and
    verified here). ``node_ranges`` (``{node: (lo, hi)}``, ``None`` for an open side) supplies the
    node catalog's range of a node whose spec entry sets none, for a snapshot that does not record
    it (one built without ``causal: true``); a causal snapshot records every range it used, and
    with a TSDB the catalog is asked.
    """

    def __init__(self, snapshot: Snapshot | str | os.PathLike[str], *,
                 node_ranges: Mapping[str, Sequence[float | None]] | None = None) -> None:
        snap = snapshot if isinstance(snapshot, Snapshot) else open_snapshot(snapshot)
        self.snapshot = snap
        self.spec: DatasetSpec = parse_spec(snap.spec, source=f"{snap.root}/spec.json")
        spec = self.spec
        self.nodes: tuple[str, ...] = tuple(spec.node_ids)
        self.controls: tuple[str, ...] = tuple(spec.control_ids)
        self.targets: tuple[str, ...] = tuple(spec.target_ids)
        self.history_steps, self.horizon_steps, self.beat_ms = spec.history_steps, spec.horizon_steps, spec.beat_ms
        self.causal = bool(spec.causal)
        recorded = snap.manifest.get("nodeRanges") or {}
        given = {str(k): tuple(v) for k, v in (node_ranges or {}).items()}
        self._params: dict[str, NodeGridParams] = {}
        self._unranged: list[str] = []
        for node in spec.nodes:
            catalog = recorded.get(node.node_id) or given.get(node.node_id)
            if node.range is None and catalog is None:
                self._unranged.append(node.node_id)
                continue
            self._params[node.node_id] = node_grid_params(spec, node, catalog or (None, None))
        self._units = unit_columns(spec)
        self._control_cols = [self.nodes.index(c) for c in self.controls]
        self._norm = {g: (snap.norm[g].mean, snap.norm[g].std) for g in ("x", "u", "y")}

    # ---- the model's input -------------------------------------------------------------------

    def inputs(
        self,
        origin: int | Any,
        points: Any = None,
        *,
        controls: Any = None,
        run_start_ms: int | None = None,
        tsdb: TsdbPort | str | None = None,
        run_id: str | None = None,
    ) -> LiveInputs:
        """The model's input at forecast origin ``origin`` (epoch ms or a datetime; a grid time,
        a multiple of ``beatMs``): ``x`` from each node's points before it, and ``u`` from
        ``controls`` when given.

        Points come from ``points`` (see :mod:`aml_pipeline.live.points`; points at or after the
        origin are ignored) or are read from ``tsdb`` (a port or URL) for run ``run_id`` (default:
        the run of the spec's line, product and recipe under way at the origin), only as far back
        as the history and its cleaning reach. ``run_start_ms``: when the run started (points
        before it are not the run's); without it, given points must reach far enough back for
        the cleaning (``LIVE_TOO_FEW_POINTS`` says how far).

        ``controls``: the planned control moves, either ``[F, controls]`` values in source units
        at the grid times ``origin .. origin + (F-1) beat``, or points of the control nodes from
        the origin on (any form ``points`` takes; cleaned and aligned with the history's points),
        or, with ``tsdb``, ``"realised"``: the points the TSDB holds after the origin (for
        back-testing: ``u`` then equals the window's).

        Raises :class:`~aml_pipeline.live.points.LiveInputError` naming the node and the time
        when a node has no points, too few for its cleaning, or a gap in the history.
        """
        origin_ms = epoch_ms(origin, "origin")
        beat, H = self.beat_ms, self.history_steps
        if origin_ms % beat:
            raise LiveInputError(
                f"origin {when(origin_ms)} is not a grid time: grid times are multiples of beatMs {beat} ms "
                f"(the last before it is {when(origin_ms - origin_ms % beat)})", code="LIVE_ORIGIN_INVALID")
        first = origin_ms - H * beat
        if tsdb is not None:
            if points is not None:
                raise LiveInputError("give either points or tsdb, not both", code="LIVE_INPUT_INVALID")
            return self._from_tsdb(tsdb, origin_ms, run_id, controls)
        if isinstance(controls, str):
            raise LiveInputError(f"controls={controls!r} needs a tsdb to read the realised controls from",
                                 code="LIVE_INPUT_INVALID")
        given = points_by_node(points, list(self.nodes))
        lo = self._run_lower_bound(run_start_ms)
        hist = {n: given.get(n, EMPTY).between(lo, self._upper(origin_ms - 1)) for n in self.nodes}
        planned = None if controls is None or _is_array(controls) else points_by_node(controls, list(self.controls), what="controls")
        try:
            return self._compute(origin_ms, hist, complete=set(self.nodes) if run_start_ms is not None else set(), run_start=lo,
                                 planned=planned, planned_values=controls if _is_array(controls) else None)
        except _NeedsEarlier as e:
            raise LiveInputError(self._too_few(e.short[0], first), code="LIVE_TOO_FEW_POINTS") from None

    def to_source_units(self, y: np.ndarray) -> np.ndarray:
        """A model's prediction ``[..., F, targets]`` in the stored (normalised) form back to each
        target's source units: de-normalised with the snapshot's ``norm.y``, then the v2 unit
        transform inverted (float64)."""
        return self.snapshot.to_engineering_units("y", y)

    def read_range(self, origin_ms: int, node: str) -> tuple[int, int]:
        """The times ``[from, to]`` whose points node ``node``'s history at ``origin_ms`` may use,
        before the cleaning's context (the Hampel window's points before them)."""
        params = self._node_params(node)
        reach = self.beat_ms if params.aggregate == "mean" else 0
        return origin_ms - self.history_steps * self.beat_ms - reach - params.max_interp_ms, origin_ms - 1

    # ---- internals ---------------------------------------------------------------------------

    def _node_params(self, node: str) -> NodeGridParams:
        if node not in self._params:
            raise LiveInputError(
                f"node {node} sets no range in the spec and the snapshot (built without causal: true) does not record "
                "the node catalog's range its cleaning used: read the points from the TSDB, whose node catalog has it, "
                "or give it (LiveRecipe(..., node_ranges=...))",
                code="LIVE_RANGE_UNKNOWN")
        return self._params[node]

    def _run_lower_bound(self, run_start_ms: int | None) -> int | None:
        """The first time a run's point may have: its start and the spec's ``fromMs``."""
        bounds = [b for b in (run_start_ms, self.spec.from_ms) if b is not None]
        return max(bounds) if bounds else None

    def _upper(self, t: int) -> int:
        return t if self.spec.to_ms is None else min(t, self.spec.to_ms)

    def _too_few(self, e: _Short, first: int) -> str:
        k = self._params[e.node].hampel_k
        window = f"the {2 * k} surviving points before each point" if self.causal else f"the {k} surviving points around each point"
        return (f"node {e.node}: {e.have} surviving points before {when(e.before)}, where the history from {when(first)} "
                f"needs {e.need} (Hampel hampelK {k} judges a point with {window}): give points from further back, "
                "or run_start_ms when the run started after them")

    def _columns(self, nodes: Sequence[str], pts: Sequence[NodePoints], first: int, rows: int, *,
                 complete: set[str]) -> list[_Column]:
        """The nodes' points cleaned and aligned onto ``rows`` grid times from ``first``, as the grid
        stage does each node (all nodes in one pass of the core's batch functions); refuses
        (``_NeedsEarlier``) a node whose points do not reach back to the cleaning's context of the
        first row, unless it is in ``complete`` (its points start at the run's start)."""
        params = [self._node_params(n) for n in nodes]
        starts = np.cumsum([0, *(len(p) for p in pts[:-1])])
        ts, value, state = (np.concatenate([getattr(p, f) for p in pts]) for f in ("ts", "value", "state"))
        cleaned = clean_batch(ts, value, state, starts, params)
        bounds = [*starts.tolist(), ts.size]
        out, short = [], []
        for j, node in enumerate(nodes):
            a, b = bounds[j], bounds[j + 1]
            node_ts = ts[a:b]
            survivors = node_ts[cleaned.judged[a:b]]
            need = (2 if params[j].causal else 1) * params[j].hampel_k
            if need and node not in complete:
                before, _ = self.read_range(first + self.history_steps * self.beat_ms, node)
                have = int(np.searchsorted(survivors, before, side="left"))
                if have < need:
                    short.append(_Short(node, have, need, before))
            out.append(_Column(np.empty(0), node_ts[cleaned.kept[a:b]], survivors))
        if short:
            raise _NeedsEarlier(short)
        kept = np.flatnonzero(cleaned.kept)
        values = align_batch(ts[kept], value[kept], np.searchsorted(kept, starts), params, first, self.beat_ms, rows)
        return [_Column(values[j], c.kept_ts, c.survivor_ts) for j, c in enumerate(out)]

    def _compute(self, origin: int, hist: Mapping[str, NodePoints], *, complete: set[str], run_start: int | None,
                 planned: Mapping[str, NodePoints] | None, planned_values: Any, run_id: str | None = None,
                 realised: bool = False) -> LiveInputs:
        beat, H = self.beat_ms, self.history_steps
        first = origin - H * beat
        if run_start is not None and first < -(-run_start // beat) * beat:
            raise LiveInputError(
                f"the history at origin {when(origin)} starts at {when(first)}, before the run's first grid time "
                f"{when(-(-run_start // beat) * beat)}: the run needs {H} grid rows (historySteps) before the origin",
                code="LIVE_TOO_FEW_POINTS")
        times = first + beat * np.arange(H, dtype=np.int64)
        for node in self.nodes:
            if not len(hist[node]):
                raise LiveInputError(f"node {node}: no points before the origin {when(origin)}", code="LIVE_NODE_MISSING")
        columns = self._columns(self.nodes, [hist[n] for n in self.nodes], first, H, complete=complete)
        grid = np.empty((H, len(self.nodes)))
        may_differ = np.zeros((H, len(self.nodes)), dtype=bool)
        why: dict[str, str] = {}
        for j, (node, col) in enumerate(zip(self.nodes, columns)):
            if not self.causal:
                rows, reason = self._may_differ(node, col, times)
                may_differ[:, j] = rows
                if rows.any():
                    why[node] = reason
            self._no_gap(node, col, times, origin, may_differ[:, j])
            grid[:, j] = col.values
        for j, scale, offset in self._units:
            grid[:, j] = grid[:, j] * scale + offset
        x = apply_norm(grid, *self._norm["x"])
        u = None
        if planned_values is not None:
            u = self._u_from_values(planned_values, origin)
        elif planned is not None:
            u = self._u_from_points(hist, planned, origin, complete=complete, realised=realised)
        return LiveInputs(origin, times, x, u, self.nodes, self.controls, self.causal, may_differ, why, run_id)

    def _no_gap(self, node: str, col: _Column, times: np.ndarray, origin: int, unsettled: np.ndarray | None = None,
                *, part: str = "the history") -> None:
        missing = np.flatnonzero(np.isnan(col.values))
        if not missing.size:
            return
        g = int(times[missing[0]])
        params = self._params[node]
        i = int(np.searchsorted(col.kept_ts, g, side="right"))
        last = int(col.kept_ts[i - 1]) if i else None
        nxt = int(col.kept_ts[i]) if i < col.kept_ts.size else None
        if last is None:
            reason = "no kept point at or before it"
        elif params.interp == "hold" or (params.causal and (nxt is None or nxt - g >= self.beat_ms)):
            reason = f"the last kept point, at {when(last)}, is more than maxInterpMs {params.max_interp_ms} ms older"
        elif nxt is None:
            reason = (f"no kept point between it and the origin {when(origin)} to interpolate towards: this snapshot was "
                      "built without causal: true, so its windows interpolate towards the first point after their origin")
        else:
            reason = (f"a gap of {nxt - last} ms between kept points at {when(last)} and {when(nxt)}, more than "
                      f"maxInterpMs {params.max_interp_ms} ms")
        if params.aggregate == "mean":
            reason = f"its beat ({when(g - self.beat_ms)}, {when(g)}] has no mean: {reason}"
        if unsettled is not None and unsettled[missing[0]] and nxt is not None:
            reason += (f"; this snapshot was built without causal: true, so its windows judged the last {params.hampel_k} "
                       "points before their origin with points after it, which a live input cannot see")
        more = f" (and {missing.size - 1} more rows)" if missing.size > 1 else ""
        raise LiveInputError(f"node {node} at {when(g)}: missing from {part}: {reason}{more}", code="LIVE_GAP")

    def _may_differ(self, node: str, col: _Column, times: np.ndarray) -> tuple[np.ndarray, str]:
        """Rows whose value in the snapshot's windows could differ (a snapshot built without
        ``causal``): the centred Hampel window judged the last k points before the origin with up
        to k points after it, and a row uses one of them."""
        params = self._params[node]
        k = params.hampel_k
        if k == 0 or not col.survivor_ts.size:
            return np.zeros(times.size, dtype=bool), ""
        unsettled = int(col.survivor_ts[max(0, col.survivor_ts.size - k)])  # first point judged with later points
        if params.interp == "hold":
            rows = times >= unsettled
        else:
            settled = col.kept_ts[col.kept_ts < unsettled]
            rows = times > settled[-1] if settled.size else np.ones(times.size, dtype=bool)
        reason = (f"built without causal: true, the snapshot's Hampel window (hampelK {k}) judged the points from "
                  f"{when(unsettled)} on with up to {k} points after the origin, which a live input cannot see")
        return rows, reason

    def _u_from_values(self, values: Any, origin: int) -> np.ndarray:
        F, nc = self.horizon_steps, len(self.controls)
        u = np.array(values, dtype=np.float64)
        if u.shape != (F, nc):
            raise LiveInputError(f"planned controls must be [F, controls] = [{F}, {nc}] ({', '.join(self.controls)}), "
                                 f"got shape {list(u.shape)}", code="LIVE_INPUT_INVALID")
        bad = np.argwhere(~np.isfinite(u))
        if bad.size:
            r, c = (int(v) for v in bad[0])
            raise LiveInputError(f"node {self.controls[c]} at {when(origin + r * self.beat_ms)}: the planned control "
                                 f"is {u[r, c]}, not a number", code="LIVE_GAP")
        cols = {self._control_cols.index(j): (s, o) for j, s, o in self._units if j in self._control_cols}
        for c, (scale, offset) in cols.items():
            u[:, c] = u[:, c] * scale + offset
        return apply_norm(u, *self._norm["u"])

    def _u_from_points(self, hist: Mapping[str, NodePoints], planned: Mapping[str, NodePoints], origin: int,
                       *, complete: set[str], realised: bool = False) -> np.ndarray:
        beat, H, F = self.beat_ms, self.history_steps, self.horizon_steps
        first = origin - H * beat
        times = first + beat * np.arange(H + F, dtype=np.int64)
        # A control without points after the origin holds (or interpolates) what the history
        # leaves it, as far as its rules allow: a setpoint logged on change often has none.
        future = {n: planned.get(n, EMPTY).between(origin, self._upper(origin + F * beat - 1)) for n in self.controls}
        columns = self._columns(self.controls, [NodePoints.concat([hist[n], future[n]]) for n in self.controls],
                                first, H + F, complete=complete)
        u = np.empty((F, len(self.controls)))
        # Points given as a plan without one after the origin: the plan is what is missing (the
        # realised controls' absence is a gap in the run, named as such).
        unplanned = not realised and not any(len(p) for p in future.values())
        for c, (node, col) in enumerate(zip(self.controls, columns)):
            ahead = col.values[H:]
            if unplanned and np.isnan(ahead).any():
                raise NoPlannedPoints(node, int(times[H + np.argmax(np.isnan(ahead))]), origin)
            self._no_gap(node, _Column(ahead, col.kept_ts, col.survivor_ts), times[H:], origin + F * beat,
                         part="the run's controls after the origin" if realised else "the planned controls")
            u[:, c] = ahead
        for j, scale, offset in self._units:
            if j in self._control_cols:
                c = self._control_cols.index(j)
                u[:, c] = u[:, c] * scale + offset
        return apply_norm(u, *self._norm["u"])

    # ---- reading from a TSDB ------------------------------------------------------------------

    def _from_tsdb(self, tsdb: TsdbPort | str, origin: int, run_id: str | None, controls: Any) -> LiveInputs:
        if isinstance(tsdb, str):
            from aml_pipeline.tsdb_open import open_tsdb

            with open_tsdb(tsdb) as db:
                return self._from_tsdb(db, origin, run_id, controls)
        if self._unranged:
            ranges = {n.node_id: (n.range_lo, n.range_hi) for n in tsdb.list_nodes() if n.node_id in self._unranged}
            for node in self._unranged:
                if node in ranges:
                    spec_node = self.spec.nodes[self.nodes.index(node)]
                    self._params[node] = node_grid_params(self.spec, spec_node, ranges[node])
            self._unranged = [n for n in self._unranged if n not in ranges]
        run = tsdb.get_run(run_id) if run_id is not None else self._run_at(tsdb, origin)
        if run.ended_at is not None and run.ended_at < origin - self.beat_ms:
            raise LiveInputError(f"run {run.run_id} ended at {when(run.ended_at)}, before the history at {when(origin)} ends",
                                 code="LIVE_TOO_FEW_POINTS")
        start = self._run_lower_bound(run.started_at)
        end = self._upper(origin - 1 if run.ended_at is None else min(origin - 1, run.ended_at))
        realised = isinstance(controls, str)
        if realised and controls != "realised":
            raise LiveInputError(f"controls={controls!r}: the only text accepted is 'realised'", code="LIVE_INPUT_INVALID")
        stop = end
        if realised:  # the controls' points after the origin, read with the history's
            stop = self._upper(origin + self.horizon_steps * self.beat_ms - 1)
            if run.ended_at is not None:
                stop = min(stop, run.ended_at)
        # Every node from the same time, as far back as the furthest reaching one needs: a first
        # guess of how far back the Hampel window's surviving points reach, two beats each (more
        # is read for a node sampled slower, or with gaps there). One slice of the run, so the
        # port's prefetch serves every node from one read where the adapter takes the hint.
        common = max(start, min(self.read_range(origin, n)[0] - (2 * self._node_params(n).hampel_k + 1) * 2 * self.beat_ms
                                for n in self.nodes))
        prefetch = getattr(tsdb, "prefetch", None)
        if callable(prefetch):
            prefetch(run.run_id, list(self.nodes), common, stop)
        read = {n: _read(tsdb, n, run.run_id, common, stop) for n in self.nodes}
        hist = {n: p.between(None, end) for n, p in read.items()}
        read_from = dict.fromkeys(self.nodes, common)
        planned = None
        if realised:
            planned = {c: read[c].between(origin, stop) for c in self.controls}
        elif controls is not None and not _is_array(controls):
            planned = points_by_node(controls, list(self.controls), what="controls")
        values = controls if _is_array(controls) else None
        while True:
            # A node read from the run's start has every point its cleaning can use.
            complete = {n for n, t in read_from.items() if t <= start}
            try:
                return self._compute(origin, hist, complete=complete, run_start=start, planned=planned,
                                     planned_values=values, run_id=run.run_id, realised=realised)
            except _NeedsEarlier as e:
                for short in e.short:
                    node, lo = short.node, short.before
                    earlier_from = max(start, read_from[node] - 4 * (lo - read_from[node] + self.beat_ms))
                    earlier = _read(tsdb, node, run.run_id, earlier_from, read_from[node] - 1)
                    hist[node] = NodePoints.concat([earlier, hist[node]])
                    read_from[node] = earlier_from

    def _run_at(self, tsdb: TsdbPort, origin: int) -> Run:
        spec = self.spec
        scope = RunScope(spec.line_id, spec.product_id, spec.recipe_id, to_ms=origin)
        runs = [r for r in tsdb.list_runs(scope, finished_only=False)
                if r.started_at < origin and (r.ended_at is None or r.ended_at >= origin - self.beat_ms)]
        if not runs:
            raise LiveInputError(f"no run of {scope} is under way at {when(origin)}: give run_id", code="LIVE_NO_RUN")
        return runs[-1]


def _read(tsdb: TsdbPort, node: str, run_id: str, lo: int, hi: int) -> NodePoints:
    if hi < lo:
        return EMPTY
    pages = [p for p, _ in iter_node_pages(tsdb, node, run_id, lo, hi) if len(p)]
    if not pages:
        return EMPTY
    return NodePoints(*(np.concatenate([getattr(p, f) for p in pages]) for f in ("ts", "value", "state")))


def _is_array(v: Any) -> bool:
    """Planned controls given as values ``[F, controls]`` (not as points)."""
    return isinstance(v, np.ndarray) or (isinstance(v, list) and bool(v) and isinstance(v[0], (list, tuple, np.ndarray)))


def live_inputs(snapshot: Snapshot | str | os.PathLike[str], origin: int | Any, points: Any = None, **kwargs: Any) -> LiveInputs:
    """:meth:`LiveRecipe.inputs` of a snapshot in one call (a model server keeps a
    :class:`LiveRecipe` instead, which reads the snapshot once)."""
    return LiveRecipe(snapshot).inputs(origin, points, **kwargs)


__all__ = ["LiveInputError", "LiveInputs", "LiveRecipe", "live_inputs"]
