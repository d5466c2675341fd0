"""What one ingest transaction does, the same in every adapter.

An adapter opens the transaction and hands :func:`write_ingest` its :class:`IngestStatements`
(the few statements that differ per database); everything else is decided here, once: which run
records changed, which points are already stored (idempotent ingest), ``seq`` in row order for
what is written, ``--replace-run`` semantics and the new per-run data versions
(:mod:`aml_pipeline.tsdb.versions`).

Points already stored are skipped: a point is stored iff a point with the same run, node, ``ts``,
``value`` and ``state`` is. Values are compared as stored numbers, except that every NaN equals
every NaN (so a file with missing readings re-ingests as a no-op) and ``-0.0`` differs from
``0.0`` (they normalise to different bytes downstream). Rows of one input are not compared with
each other: a file stores what it holds, and ingesting it again stores nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa

from aml_pipeline.faults import crash_point
from aml_pipeline.tsdb.columns import PreparedPoints, codes_to_keys
from aml_pipeline.tsdb.port import Run
from aml_pipeline.tsdb.versions import chain, points_digests, record_digest


@dataclass(frozen=True)
class StoredRun:
    """A run as the database holds it, with its data version and point count."""

    key: int
    record: Run
    version: str
    points: int


@dataclass(frozen=True)
class RunState:
    key: int
    version: str
    points: int


@dataclass(frozen=True)
class PointRows:
    """Points on their way into the ``points`` table (keys resolved, ``seq`` assigned)."""

    run_key: np.ndarray  # int32
    node_key: np.ndarray  # int32
    ts: np.ndarray  # int64
    value: np.ndarray  # float64
    state: np.ndarray  # int32
    seq: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.ts.shape[0])


@dataclass(frozen=True)
class IngestOutcome:
    written: int
    skipped: int
    changed_runs: tuple[str, ...]  # runs whose data version changed


class IngestStatements(Protocol):
    """The database side of one ingest, called inside the adapter's open transaction."""

    def stored_runs(self, run_ids: list[str]) -> dict[str, StoredRun]: ...

    def upsert_nodes(self, nodes: pa.Table) -> None: ...

    def upsert_runs(self, runs: pa.Table) -> None: ...

    def key_maps(self, run_ids: list[str], node_ids: list[str]) -> tuple[dict[str, int], dict[str, int]]: ...

    def stored_point_rows(self, candidates: pa.Table, run_keys: list[int]) -> np.ndarray:
        """``idx`` of the candidate rows (``idx, run_key, node_key, ts, value, state, neg_zero``)
        that equal a stored point (NaN = NaN, ``neg_zero`` must match too)."""

    def delete_points(self, run_keys: list[int]) -> None: ...

    def next_seq(self) -> int:
        """The ``seq`` of the first point this ingest writes."""

    def append_points(self, rows: PointRows) -> None: ...

    def save_run_states(self, states: list[RunState]) -> None: ...


def write_ingest(
    db: IngestStatements,
    runs: list[Run],
    runs_tab: pa.Table | None,
    nodes_tab: pa.Table | None,
    points: PreparedPoints | None,
    *,
    replace_runs: bool = False,
) -> IngestOutcome:
    """Write one validated ingest through ``db``, inside the adapter's open transaction.

    Run records equal to the stored ones are not rewritten; points already stored are skipped
    (or, with ``replace_runs``, the stored points of every run in ``points`` are deleted first);
    the written points get ``seq`` from ``db.next_seq()`` on in row order; every run whose
    record or points changed gets its next data version and point count.
    """
    point_run_ids = [str(u) for u in points.run_uniques] if points is not None else []
    stored = db.stored_runs(list(dict.fromkeys([r.run_id for r in runs] + point_run_ids)))
    changed = [r for r in runs if r.run_id not in stored or stored[r.run_id].record != r]
    if nodes_tab is not None:
        db.upsert_nodes(nodes_tab)
    if changed and runs_tab is not None:
        changed_ids = {r.run_id for r in changed}
        mask = pa.array([rid in changed_ids for rid in runs_tab.column("run_id").to_pylist()])
        db.upsert_runs(runs_tab.filter(mask))

    run_map, node_map = db.key_maps(
        list(dict.fromkeys([r.run_id for r in changed] + point_run_ids)),
        [str(u) for u in points.node_uniques] if points is not None else [],
    )
    # state[run_id] = (key, version, points): what the transaction will leave for each touched run
    state: dict[str, tuple[int, str, int]] = {}
    for r in changed:
        before = stored.get(r.run_id)
        previous = before.version if before is not None else ""
        count = before.points if before is not None else 0
        state[r.run_id] = (run_map[r.run_id], chain(previous, "record", record_digest(r)), count)

    written = skipped = 0
    if points is not None:
        run_keys = codes_to_keys(points, points.run_codes, points.run_uniques, run_map, "run")
        node_keys = codes_to_keys(points, points.node_codes, points.node_uniques, node_map, "node")

        def current(run_id: str) -> tuple[int, str, int]:
            if run_id in state:
                return state[run_id]
            s = stored[run_id]
            return s.key, s.version, s.points

        # Before any delete: seq never goes back, also when the replaced points held the last ones.
        base = db.next_seq()
        keep = np.ones(points.n, dtype=bool)
        if replace_runs:
            db.delete_points([run_map[rid] for rid in point_run_ids])
        else:
            # Only runs that have points can hold this ingest's points already.
            with_points = np.array([current(rid)[2] > 0 for rid in point_run_ids], dtype=bool)
            if with_points.any():
                checked = [run_map[rid] for rid, has in zip(point_run_ids, with_points) if has]
                rows = slice(None) if with_points.all() else np.flatnonzero(with_points[points.run_codes])
                keep[_stored_rows(db, points, rows, run_keys, node_keys, checked)] = False
        sel = slice(None) if keep.all() else np.flatnonzero(keep)
        written = int(keep.sum())
        skipped = points.n - written
        w_run_codes, w_node_codes = points.run_codes[sel], points.node_codes[sel]
        w_ts, w_value, w_state = points.ts[sel], points.value[sel], points.state[sel]
        if written:
            db.append_points(
                PointRows(
                    run_key=run_keys[sel].astype(np.int32, copy=False),
                    node_key=node_keys[sel].astype(np.int32, copy=False),
                    ts=w_ts,
                    value=w_value,
                    state=w_state,
                    seq=np.arange(base, base + written, dtype=np.int64),
                )
            )
        n_runs = len(point_run_ids)
        digests = points_digests(w_run_codes, n_runs, w_node_codes, points.node_uniques, w_ts, w_value, w_state)
        counts = np.bincount(w_run_codes, minlength=n_runs)
        kind = "replace" if replace_runs else "append"
        for code, rid in enumerate(point_run_ids):
            if digests[code] is None and not replace_runs:
                continue  # every point of this run was already stored: its version stays
            key, version, count = current(rid)
            total = (0 if replace_runs else count) + int(counts[code])
            state[rid] = (key, chain(version, kind, digests[code] or b""), total)

    crash_point("ingest.mid_transaction")
    if state:
        db.save_run_states([RunState(k, v, n) for k, v, n in state.values()])
    return IngestOutcome(written, skipped, tuple(state))


def _stored_rows(
    db: IngestStatements,
    points: PreparedPoints,
    rows: np.ndarray | slice,
    run_keys: np.ndarray,
    node_keys: np.ndarray,
    checked_run_keys: list[int],
) -> np.ndarray:
    """Indices (into the input) of the ``rows`` (all: a slice) whose point is already stored."""
    value = points.value[rows]
    idx = np.arange(points.n, dtype=np.int64) if isinstance(rows, slice) else rows.astype(np.int64, copy=False)
    candidates = pa.table(
        {
            "idx": pa.array(idx, type=pa.int64()),
            "run_key": pa.array(run_keys[rows], type=pa.int32()),
            "node_key": pa.array(node_keys[rows], type=pa.int32()),
            "ts": pa.array(points.ts[rows], type=pa.int64()),
            "value": pa.array(value, type=pa.float64()),
            "state": pa.array(points.state[rows], type=pa.int32()),
            "neg_zero": pa.array((value == 0) & np.signbit(value), type=pa.bool_()),
        }
    )
    return np.asarray(db.stored_point_rows(candidates, sorted(checked_run_keys)), dtype=np.int64)
