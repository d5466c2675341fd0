"""The grid stage: each node's raw points cleaned and aligned to the run's beat grid.

Cleaning counts every cause (non-finite, bad state, out of range, duplicate timestamps, Hampel
outliers); alignment interpolates (``linear``) or holds (``hold``) within the gap limit and
never extrapolates. Streamed in point chunks (:mod:`aml_pipeline.pipeline.chunks`): memory is
bounded by the budget, not by the run's length, and the bytes do not depend on the chunk size.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic.alias_generators import to_snake as _to_snake

from aml_pipeline.core.clean import CLEAN_CAUSES, SeriesCleaner, clean_batch
from aml_pipeline.core.grid import GridAligner, SamplePeriods, align_batch, grid_span
from aml_pipeline.core.grid_params import NodeGridParams
from aml_pipeline.core.traces import RunTraces, TraceAccumulator
from aml_pipeline.errors import BuildError, disk_full
from aml_pipeline.pipeline.chunks import (
    clean_chunk_points,
    grid_block_rows,
    release_freed_memory,
)
from aml_pipeline.pipeline.metadata import Markdown, Table
from aml_pipeline.pipeline.stages.base import Stage, derived_stage_summary
from aml_pipeline.pipeline.stages.raw import RAW
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec, NodeSpec

# Where each field of the core's NodeGridParams comes from: the node's own key in its ``nodes``
# entry when the node sets it, else the spec-wide key (a dotted path in spec.json); a node without
# a ``range`` takes its catalog range. node_grid_params builds the object from this table and the
# stage's version covers exactly these keys, so a new field of the object is one row here.
FROM_SPEC: dict[str, tuple[str | None, str | None]] = {
    # field            node key         spec-wide key
    "good_states":    (None,           "cleaning.goodStates"),
    "valid_range":    ("range",        None),
    "hampel_k":       ("hampelK",      "cleaning.hampelK"),
    "hampel_sigma":   (None,           "cleaning.hampelSigma"),
    "hampel_min_dev": ("hampelMinDev", "cleaning.hampelMinDev"),
    "interp":         ("interp",       None),
    "max_interp_ms":  ("maxInterpMs",  "maxInterpMs"),
    "aggregate":      ("aggregate",    "aggregate"),
    "causal":         (None,           "causal"),
}


def node_grid_params(spec: DatasetSpec, node: NodeSpec, catalog_range: Sequence[float | None]) -> NodeGridParams:
    """How ``node``'s points are cleaned and aligned: its own settings over the spec's, per
    :data:`FROM_SPEC`; ``catalog_range`` is the node catalog's ``(range_lo, range_hi)``."""
    fields: dict[str, Any] = {}
    for name, (node_key, spec_key) in FROM_SPEC.items():
        value = None if node_key is None else getattr(node, to_snake(node_key))
        if value is None and spec_key is not None:
            value = _attribute(spec, spec_key)
        fields[name] = value
    if fields["valid_range"] is None:
        fields["valid_range"] = tuple(catalog_range)
    return NodeGridParams(**fields)


# The spec's keys are a handful of names, converted for every node of every run.
to_snake = functools.lru_cache(maxsize=256)(_to_snake)


def node_ranges(store: DatasetStore, run_ids: Sequence[str]) -> dict[str, list[float | None]]:
    """The inclusive range each node of the spec was cleaned with (``None``: unbounded on that side),
    its own or the node catalog's as the runs' raw stages recorded it: what a causal snapshot's
    manifest records for the live path. Runs fetched under different catalog ranges are refused."""
    spec = store.spec
    seen: dict[str, list[float | None]] | None = None
    for run_id in run_ids:
        catalog = store.require(run_id, RAW)["catalogRange"]
        ranges = {n.node_id: list(node_grid_params(spec, n, catalog[n.node_id]).valid_range) for n in spec.nodes}
        if seen is not None and ranges != seen:
            changed = sorted(n for n in ranges if ranges[n] != seen[n])
            raise BuildError(
                f"spec {spec.id!r}: run {run_id!r} was cleaned with other node catalog ranges than the runs before it "
                f"({', '.join(changed)}); rebuild it (aml-pipeline build --full)", code="CATALOG_CHANGED")
        seen = ranges
    return seen or {}


def _attribute(model: Any, path: str) -> Any:
    for key in path.split("."):
        model = getattr(model, to_snake(key))
    return model


def _covers(spec: DatasetSpec, j: Mapping[str, Any]) -> dict[str, Any]:
    """The grid's period and every key of :data:`FROM_SPEC`, spec-wide and per node (the node id
    keeps the column order). A key spec.json leaves out is left out here too, so a field added to
    the spec later and written to spec.json only when it is set keeps the stored grids of specs
    that do not set it."""
    covers: dict[str, Any] = {"beatMs": j["beatMs"]}
    for _, spec_key in FROM_SPEC.values():
        if spec_key is None:
            continue
        *parents, last = spec_key.split(".")
        source = j
        for key in parents:
            source = source.get(key, {})
        if last in source:
            target = covers
            for key in parents:
                target = target.setdefault(key, {})
            target[last] = source[last]
    node_keys = ("nodeId", *(k for k, _ in FROM_SPEC.values() if k is not None))
    covers["nodes"] = [{k: n[k] for k in node_keys if k in n} for n in j["nodes"]]
    return covers


log = logging.getLogger("aml_pipeline")

# The ``sampled_faster_than_beat`` figure of a run whose nodes are all sampled at most twice a beat.
NO_FAST_NODES = "none"


def fast_nodes(figures: Mapping[str, Any]) -> str | None:
    """The ``sampled_faster_than_beat`` figure of a run's grid figures when it names nodes, else None."""
    value = figures.get("sampled_faster_than_beat", NO_FAST_NODES)
    return None if value == NO_FAST_NODES else value


GRID = Stage(
    name="grid",
    asset="cleaned_grid",
    upstream="raw",
    per_run=True,
    algorithm=2,
    covers=_covers,
    files=("values", "traces.npz"),
    description=(
        "Points cleaned (non-finite, bad state, range, duplicates, Hampel) and aligned to the beat grid. "
        "Per run: counts per cause and node, missing ratios and the run's plot."
    ),
)


def fast_sampled(periods: Mapping[str, float | None], aggregates: Mapping[str, str], beat_ms: int) -> dict[str, float]:
    """The nodes taking point values (no ``aggregate: mean``) whose median sample period is less
    than half the beat: more than one point per beat is ignored, and what varies faster than the
    grid can see shows as a slower variation that is not there (aliasing)."""
    return {n: p for n, p in periods.items() if p is not None and p < beat_ms / 2 and aggregates.get(n) != "mean"}


def fast_sampled_line(node: str, period_ms: float, beat_ms: int) -> str:
    return (f"node {node} is sampled faster than twice the beat (median sample period {period_ms:g} ms, "
            f"beat {beat_ms} ms) and its grid takes the value at each grid time, ignoring the points between: "
            "set aggregate: mean on it (or for the whole spec) to take each beat's time-weighted mean (docs/spec.md)")


def worst_missing(missing: Mapping[str, float]) -> str:
    """The node missing the largest share of the grid, with that share."""
    node, ratio = max(missing.items(), key=lambda kv: kv[1])
    return f"{node} ({ratio:.1%})"


@dataclass
class GridSummary:
    run_id: str
    rows: int
    counts: dict[str, dict[str, int]]  # node -> cause -> count
    missing: dict[str, float]  # node -> missing ratio on the grid
    data_version: str
    traces: RunTraces | None = None  # what the run's plot needs, summarised while streaming
    # node -> median interval between its kept points (None: fewer than two, or a beat or more)
    sample_period_ms: dict[str, float | None] = field(default_factory=dict)
    fast: dict[str, float] = field(default_factory=dict)  # nodes sampled faster than beat / 2 taking point values
    units: dict[str, str] = field(default_factory=dict)  # node -> unit, as the stage's summary stores them

    @property
    def cleaning_totals(self) -> dict[str, int]:
        return {c: sum(v[c] for v in self.counts.values()) for c in ("input", *CLEAN_CAUSES, "kept")}

    def figures(self, store: DatasetStore, *, plot: bool) -> dict[str, Any]:
        """What cleaning did, per node and cause with the node's unit, and the run's plot."""
        spec = store.spec
        totals = self.cleaning_totals
        units = self.units
        figures: dict[str, Any] = {
            "grid_rows": self.rows,
            "points_kept": totals["kept"],
            "points_removed": totals["input"] - totals["kept"],
            # Two narrow tables rather than one with a column per cause: the partition view gives a
            # table the width of its metadata column, which is narrow on a laptop screen.
            "cleaning": Table(
                [{"node": n, "unit": units.get(n, ""), "input": self.counts[n]["input"],
                  "removed": self.counts[n]["input"] - self.counts[n]["kept"], "kept": self.counts[n]["kept"],
                  "missing_ratio": round(self.missing[n], 4)} for n in spec.node_ids]
            ),
            "removed_by_cause": Table(
                [{"node": n, "cause": c, "points": self.counts[n][c]} for n in spec.node_ids for c in CLEAN_CAUSES
                 if self.counts[n][c]]
            ),
            "max_missing_ratio": max(self.missing.values()),
            "worst_missing_node": worst_missing(self.missing),
        }
        # Always present (the partitions of an asset show the same keys): "none", or the nodes.
        figures["sampled_faster_than_beat"] = "; ".join(
            f"{n}: median sample period {p:g} ms, beat {spec.beat_ms} ms" for n, p in self.fast.items()) or NO_FAST_NODES
        if plot and self.traces is not None:
            from aml_pipeline.pipeline.plots import (
                run_traces_markdown,  # matplotlib, only when drawing
            )

            figures["plot"] = Markdown(run_traces_markdown(self.traces, [units.get(n, "") for n in spec.node_ids], self.run_id))
        return figures


# Nodes already warned about in this process, per spec: a build of many runs says it once.
_warned: set[tuple[str, str]] = set()


def clean_run(store: DatasetStore, run_id: str, *, chunk_points: int | None = None,
              raw_columns: Callable[[], Mapping[str, np.ndarray]] | None = None,
              on_grid: Callable[[np.ndarray], None] | None = None) -> GridSummary:
    """Clean each node's raw points and align them to the run's beat grid, chunk by chunk.

    The grid is stored node-major (``grid.values.npy`` is ``[nodes, rows]``), so each node's
    column is written front to back as its chunks are cleaned. ``raw_columns``: gives the raw
    stage's ``ts``, ``value`` and ``state`` arrays as stored (the fetch that just wrote them
    holds them), taken instead of reading them back when the run is cleaned whole; ``on_grid``
    is given the grid (``[nodes, rows]``, as stored) of a run cleaned whole, for the windows stage.
    """
    spec = store.spec
    meta = store.require(run_id, RAW)
    chunk = clean_chunk_points() if chunk_points is None else int(chunk_points)
    first, rows = grid_span(meta["fromMs"], meta["toMs"], spec.beat_ms)
    block_rows = grid_block_rows(len(spec.nodes))
    offsets = meta["offsets"]
    counts: dict[str, dict[str, int]] = {}
    missing: dict[str, float] = {}
    periods: dict[str, float | None] = {}
    aggregates: dict[str, str] = {}
    traces = TraceAccumulator(meta["fromMs"], meta["toMs"], spec.node_ids)
    # A run whose points and grid both fit one cleaning chunk is cleaned and aligned with every
    # node in one call of each kernel: the same bytes (each node's series alone, exactly), without
    # the per-node, per-chunk calls that dominate short runs.
    whole = offsets[-1] <= chunk and rows * len(spec.nodes) <= chunk
    with store.stage_writer(run_id, GRID) as writer:
        # rows= for a run no grid time falls in (a beat longer than the run): (nodes, 0)
        values = writer.array("values", "<f8", (rows,), rows=len(spec.nodes))
        for j, node in enumerate(spec.nodes if not whole else ()):
            params = node_grid_params(spec, node, meta["catalogRange"][node.node_id])
            cleaner = SeriesCleaner(params)
            aligner = GridAligner(first, spec.beat_ms, rows, params, block_rows=block_rows)
            sampling = SamplePeriods(spec.beat_ms)
            aggregates[node.node_id] = params.aggregate
            nan_rows = 0

            def emit(blocks, j=j) -> None:
                nonlocal nan_rows
                for r0, block in blocks:
                    values.append(block)
                    nan_rows += int(np.count_nonzero(np.isnan(block)))
                    traces.add_grid(j, first + spec.beat_ms * np.arange(r0, r0 + block.size, dtype=np.int64), block)

            def cleaned(kept, j=j, sampling=sampling) -> None:
                traces.add_removed(j, kept.outlier_ts, kept.outlier_value)
                sampling.feed(kept.ts)

            for a in range(offsets[j], offsets[j + 1], chunk):
                b = min(a + chunk, offsets[j + 1])
                ts = store.read_flat(run_id, RAW, "ts", a, b)
                value = store.read_flat(run_id, RAW, "value", a, b)
                traces.add_raw(j, ts, value)
                kept = cleaner.feed(ts, value, store.read_flat(run_id, RAW, "state", a, b))
                cleaned(kept)
                emit(aligner.feed(kept.ts, kept.value))
            kept = cleaner.finish()
            cleaned(kept)
            emit(aligner.feed(kept.ts, kept.value))
            emit(aligner.finish())
            counts[node.node_id] = dict(cleaner.counts)
            periods[node.node_id] = sampling.median_ms
            if offsets[j + 1] - offsets[j] > chunk:
                release_freed_memory()
            # An empty grid has nothing usable (1.0), like core.grid.missing_ratio.
            missing[node.node_id] = nan_rows / rows if rows else 1.0
        if whole:
            grid = _clean_whole_run(store, run_id, meta, first, rows, values, traces, counts, missing, periods,
                                    aggregates, raw_columns)
            if on_grid is not None:
                on_grid(grid)
        run_traces = traces.result()
        traces_tmp = writer.file("traces.npz")
        try:
            run_traces.save(traces_tmp, atomic=False)  # the stage writer's own temporary, renamed on commit
        except OSError as e:
            full = disk_full(e, traces_tmp.parent)  # DISK_FULL naming the store, like its arrays
            if full is not None:
                raise full from None
            raise
        summary = derived_stage_summary(
            store.versions[GRID], meta, rows=rows, firstMs=first, counts=counts, missing=missing
        )
        writer.commit(summary)
    fast = fast_sampled(periods, aggregates, spec.beat_ms)
    for node, period in fast.items():
        if (spec.id, node) not in _warned:
            _warned.add((spec.id, node))
            log.warning(f"spec {spec.id}: {fast_sampled_line(node, period, spec.beat_ms)}")
    return GridSummary(run_id, rows, counts, missing, summary["dataVersion"], run_traces, periods, fast,
                       dict(summary.get("units") or {}))


def _clean_whole_run(store: DatasetStore, run_id: str, meta: Mapping[str, Any], first: int, rows: int, values: Any,
                     traces: TraceAccumulator, counts: dict[str, dict[str, int]], missing: dict[str, float],
                     periods: dict[str, float | None], aggregates: dict[str, str],
                     raw_columns: Callable[[], Mapping[str, np.ndarray]] | None = None) -> np.ndarray:
    """:func:`clean_run`'s work for a run small enough to hold at once: every node's points read,
    cleaned (:func:`~aml_pipeline.core.clean.clean_batch`) and aligned
    (:func:`~aml_pipeline.core.grid.align_batch`) together, with what the per-node path gives."""
    spec = store.spec
    offsets = np.asarray(meta["offsets"], dtype=np.int64)
    starts = offsets[:-1]
    n = int(offsets[-1])
    params = [node_grid_params(spec, node, meta["catalogRange"][node.node_id]) for node in spec.nodes]
    held = raw_columns() if raw_columns is not None else None
    if held is not None and all(held[k].shape == (n,) for k in ("ts", "value", "state")):
        ts, value, state = held["ts"], held["value"], held["state"]
    else:
        ts = store.read_flat(run_id, RAW, "ts", 0, n)
        value = store.read_flat(run_id, RAW, "value", 0, n)
        state = store.read_flat(run_id, RAW, "state", 0, n)
    traces.add_series("raw", starts, ts, value)
    cleaned = clean_batch(ts, value, state, starts, params)
    node_counts = cleaned.counts(starts)
    outliers = np.flatnonzero(cleaned.judged & ~cleaned.kept)
    traces.add_series("removed", np.searchsorted(outliers, starts), ts[outliers], value[outliers])
    kept_ts, kept_value = ts[cleaned.kept], value[cleaned.kept]
    kept_starts = np.cumsum([0] + [c["kept"] for c in node_counts])
    grid = align_batch(kept_ts, kept_value, kept_starts[:-1], params, first, spec.beat_ms, rows)
    values.append(grid)
    traces.add_grid_rows(first + spec.beat_ms * np.arange(rows, dtype=np.int64), grid)
    nan_rows = np.count_nonzero(np.isnan(grid), axis=1).tolist()
    for j, (node, p, c) in enumerate(zip(spec.nodes, params, node_counts)):
        sampling = SamplePeriods(spec.beat_ms)
        sampling.feed(kept_ts[kept_starts[j] : kept_starts[j + 1]])
        counts[node.node_id] = c
        periods[node.node_id] = sampling.median_ms
        aggregates[node.node_id] = p.aggregate
        missing[node.node_id] = nan_rows[j] / rows if rows else 1.0
    return grid


def read_grid_rows(store: DatasetStore, run_id: str, n_nodes: int, rows: int, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0..r1-1`` of the cleaned grid as ``[rows, nodes]`` (it is stored node-major)."""
    block = np.empty((r1 - r0, n_nodes), dtype=np.float64)
    if n_nodes and 2 * (r1 - r0) >= rows:
        # Most of each node's rows: one read from the first node's r0 to the last node's r1 (at
        # most twice what is kept) instead of a read per node.
        span = store.read_flat(run_id, GRID, "values", r0, (n_nodes - 1) * rows + r1)
        nodes = np.lib.stride_tricks.as_strided(span, (n_nodes, r1 - r0), (rows * span.itemsize, span.itemsize))
        block[:] = nodes.T
        return block
    for j in range(n_nodes):
        block[:, j] = store.read_flat(run_id, GRID, "values", j * rows + r0, j * rows + r1)
    return block

