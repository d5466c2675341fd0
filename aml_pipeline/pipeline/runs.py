"""Per-run stages of a dataset build: fetch -> clean and align -> windows.

Each stage reads its input from the store (or the TSDB), calls the numeric core and writes its
result back to the store, returning a small summary. Memory is bounded by one run. The Dagster
assets ``raw_node_series``, ``cleaned_grid`` and ``run_windows`` are thin wrappers around these.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from aml_pipeline.core.clean import CLEAN_CAUSES, clean_series
from aml_pipeline.core.grid import align, grid_times, missing_ratio
from aml_pipeline.core.units import to_model_units
from aml_pipeline.core.windows import explain_no_windows, window_starts
from aml_pipeline.errors import BuildError, UnknownNodeError
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb.port import Node, Run, TsdbPort, fetch_node_series

# Bump when a numeric rule changes: it is part of every asset's code_version and of the
# fingerprint stored with each stage, so old intermediate results are never mixed in.
ALGORITHM_VERSION = "1"


def stage_fingerprint(spec: DatasetSpec) -> str:
    # Specs are frozen models, so the fingerprint of one object never changes; every stage of
    # every run asks for it (a JSON dump and a sha256 each time otherwise).
    hit = _FINGERPRINTS.get(id(spec))
    if hit is None or hit[0] is not spec:
        if len(_FINGERPRINTS) >= 64:
            _FINGERPRINTS.clear()
        hit = _FINGERPRINTS[id(spec)] = (spec, f"{spec.fingerprint()}-a{ALGORITHM_VERSION}")
    return hit[1]


_FINGERPRINTS: dict[int, tuple[DatasetSpec, str]] = {}


def run_bounds(spec: DatasetSpec, run: Run) -> tuple[int, int]:
    """The run's slice of the spec window: ``max(started, fromMs) .. min(ended, toMs)``."""
    if run.ended_at is None:
        raise BuildError(f"run {run.run_id!r} has not finished (no ended_at); it cannot be built yet")
    lo = run.started_at if spec.from_ms is None else max(run.started_at, spec.from_ms)
    hi = run.ended_at if spec.to_ms is None else min(run.ended_at, spec.to_ms)
    return lo, hi


def check_nodes_known(spec: DatasetSpec, catalog: list[Node]) -> dict[str, Node]:
    by_id = {n.node_id: n for n in catalog}
    missing = [n for n in spec.node_ids if n not in by_id]
    if missing:
        raise UnknownNodeError(
            f"spec {spec.id!r}: node {missing[0]!r} is not in the TSDB node catalog"
            + (f" (nor are {', '.join(missing[1:])})" if len(missing) > 1 else "")
        )
    return by_id


@dataclass
class RawSummary:
    run_id: str
    points: dict[str, int]
    pages: dict[str, int]
    # The arrays just written (valid while the caller keeps the summary; not re-read from disk).
    arrays: dict[str, np.ndarray] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def total_points(self) -> int:
        return sum(self.points.values())

    @property
    def data_version(self) -> str:
        """A hash of the fetched points (offsets, ts, value, state): the run's data version."""
        if self.arrays is None:
            raise ValueError("this summary does not hold the run's arrays")
        return raw_data_version(self.arrays)


def raw_data_version(arrays: dict[str, np.ndarray]) -> str:
    """sha256 (24 hex digits) over the raw stage's offsets, ts, value and state bytes."""
    h = hashlib.sha256()
    for k in ("offsets", "ts", "value", "state"):
        h.update(np.ascontiguousarray(arrays[k]).data)
    return h.hexdigest()[:24]


def fetch_run(
    tsdb: TsdbPort,
    spec: DatasetSpec,
    run: Run,
    store: DatasetStore,
    catalog: dict[str, Node],
    *,
    page_limit: int,
    max_points: int | None = None,
) -> RawSummary:
    """Read every spec node of one run from the TSDB, page by page, into the store."""
    lo, hi = run_bounds(spec, run)
    prefetch = getattr(tsdb, "prefetch", None)  # optional: one query for the run's nodes
    if callable(prefetch):
        prefetch(run.run_id, spec.node_ids, lo, hi)
    series = [
        fetch_node_series(tsdb, node_id, run.run_id, lo, hi, page_limit=page_limit, max_points=max_points)
        for node_id in spec.node_ids
    ]
    offsets = np.zeros(len(series) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in series], out=offsets[1:])
    arrays = {
        "ts": np.concatenate([s.ts for s in series]),
        "value": np.concatenate([s.value for s in series]),
        "state": np.concatenate([s.state for s in series]),
        "seq": np.concatenate([s.seq for s in series]),
        "offsets": offsets,
    }
    summary = RawSummary(
        run.run_id,
        points={s.node_id: len(s) for s in series},
        pages={s.node_id: s.pages for s in series},
        arrays=arrays,
    )
    meta = {
        "fingerprint": stage_fingerprint(spec),
        "run": dataclasses.asdict(run),
        "fromMs": lo,
        "toMs": hi,
        "nodes": spec.node_ids,
        "catalogRange": {
            n: [catalog[n].range_lo, catalog[n].range_hi] for n in spec.node_ids
        },
        "points": summary.points,
        "pages": summary.pages,
    }
    store.write_stage(run.run_id, "raw", arrays, meta)
    return summary


@dataclass
class GridSummary:
    run_id: str
    rows: int
    counts: dict[str, dict[str, int]]  # node -> cause -> count
    missing: dict[str, float]  # node -> missing ratio on the grid
    # The raw stage's arrays and the grid stage's arrays just written, e.g. for the run's plot
    # (valid while the caller keeps the summary; not re-read from disk).
    raw_arrays: dict[str, np.ndarray] | None = dataclasses.field(default=None, repr=False, compare=False)
    grid_arrays: dict[str, np.ndarray] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def cleaning_totals(self) -> dict[str, int]:
        return {c: sum(v[c] for v in self.counts.values()) for c in ("input", *CLEAN_CAUSES, "kept")}


def _require(store: DatasetStore, spec: DatasetSpec, run_id: str, stage: str) -> dict[str, Any]:
    meta = store.read_meta(run_id, stage)
    if meta is None:
        raise BuildError(f"run {run_id!r}: {stage} stage has not been materialised for spec {spec.id!r}")
    if meta.get("fingerprint") != stage_fingerprint(spec):
        raise BuildError(
            f"run {run_id!r}: the stored {stage} stage was built for another version of spec "
            f"{spec.id!r} (fingerprint {meta.get('fingerprint')}, now {stage_fingerprint(spec)}); "
            "rematerialise the run"
        )
    return meta


def clean_run(spec: DatasetSpec, run_id: str, store: DatasetStore) -> GridSummary:
    """Clean each node's raw points and align them to the run's beat grid."""
    meta = _require(store, spec, run_id, "raw")
    raw = store.read_arrays(run_id, "raw")
    grid_ts = grid_times(meta["fromMs"], meta["toMs"], spec.beat_ms)
    values = np.full((grid_ts.shape[0], len(spec.nodes)), np.nan, dtype=np.float64)
    counts: dict[str, dict[str, int]] = {}
    outliers_ts, outliers_value, outlier_offsets = [], [], [0]
    off = raw["offsets"]
    cleaning = spec.cleaning
    for j, node in enumerate(spec.nodes):
        sl = slice(int(off[j]), int(off[j + 1]))
        catalog_lo, catalog_hi = meta["catalogRange"][node.node_id]
        lo, hi = node.range if node.range is not None else (catalog_lo, catalog_hi)
        cleaned = clean_series(
            raw["ts"][sl],
            raw["value"][sl],
            raw["state"][sl],
            good_states=cleaning.good_states,
            range_lo=lo,
            range_hi=hi,
            hampel_k=cleaning.hampel_k if node.hampel_k is None else node.hampel_k,
            hampel_sigma=cleaning.hampel_sigma,
            hampel_min_dev=cleaning.hampel_min_dev if node.hampel_min_dev is None else node.hampel_min_dev,
        )
        max_interp = spec.max_interp_ms if node.max_interp_ms is None else node.max_interp_ms
        values[:, j] = align(cleaned.ts, cleaned.value, grid_ts, interp=node.interp, max_interp_ms=max_interp)
        counts[node.node_id] = {k: int(v) for k, v in cleaned.counts.items()}
        outliers_ts.append(cleaned.outlier_ts)
        outliers_value.append(cleaned.outlier_value)
        outlier_offsets.append(outlier_offsets[-1] + len(cleaned.outlier_ts))
    missing = {n: float(missing_ratio(values[:, j])) for j, n in enumerate(spec.node_ids)}
    grid_arrays = {
        "grid_ts": grid_ts,
        "values": values,
        "outlier_ts": np.concatenate(outliers_ts).astype(np.int64, copy=False),
        "outlier_value": np.concatenate(outliers_value).astype(np.float64, copy=False),
        "outlier_offsets": np.asarray(outlier_offsets, dtype=np.int64),
    }
    store.write_stage(
        run_id,
        "grid",
        grid_arrays,
        {
            "fingerprint": stage_fingerprint(spec),
            "run": meta["run"],
            "rows": int(grid_ts.shape[0]),
            "counts": counts,
            "missing": missing,
        },
    )
    return GridSummary(run_id, int(grid_ts.shape[0]), counts, missing, raw, grid_arrays)


@dataclass
class WindowsSummary:
    run_id: str
    windows: int
    rows: int
    reason: str | None  # why there are no windows, when there are none
    missing: dict[str, float]


def window_run(spec: DatasetSpec, run_id: str, store: DatasetStore) -> WindowsSummary:
    """Convert the grid to model units and find the run's valid window starts."""
    meta = _require(store, spec, run_id, "grid")
    grid = store.read_arrays(run_id, "grid")
    transforms = spec.unit_transforms()
    # Without a unit contract the grid is already in model units (and was just read: ours).
    model = to_model_units(grid["values"], spec.node_ids, transforms) if transforms else grid["values"]
    cols = {n: j for j, n in enumerate(spec.node_ids)}
    ctrl = [cols[n] for n in spec.control_ids]
    tgt = [cols[n] for n in spec.target_ids]
    starts = window_starts(model, spec.history_steps, spec.horizon_steps, spec.stride, ctrl, tgt)
    reason = None
    if starts.size == 0:
        reason = explain_no_windows(
            model, spec.history_steps, spec.horizon_steps, ctrl, tgt, spec.node_ids
        )
    store.write_stage(
        run_id,
        "windows",
        {"grid": model, "grid_ts": grid["grid_ts"], "starts": starts.astype(np.int64, copy=False)},
        {
            "fingerprint": stage_fingerprint(spec),
            "run": meta["run"],
            "rows": meta["rows"],
            "windows": int(starts.size),
            "reason": reason,
            "missing": meta["missing"],
            "counts": meta["counts"],
        },
    )
    return WindowsSummary(run_id, int(starts.size), meta["rows"], reason, meta["missing"])
