"""The grid stage: each node's raw points cleaned and aligned to the run's beat grid.

Cleaning counts every cause (non-finite, bad state, out of range, duplicate timestamps, Hampel
outliers); alignment interpolates (``linear``) or holds (``hold``) within the gap limit and
never extrapolates. Streamed in point chunks (:mod:`aml_pipeline.pipeline.chunks`): memory is
bounded by the budget, not by the run's length, and the bytes do not depend on the chunk size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic.alias_generators import to_snake

from aml_pipeline.core.clean import CLEAN_CAUSES, SeriesCleaner
from aml_pipeline.core.grid import GridAligner, grid_span
from aml_pipeline.core.grid_params import NodeGridParams
from aml_pipeline.core.traces import RunTraces, TraceAccumulator
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

    @property
    def cleaning_totals(self) -> dict[str, int]:
        return {c: sum(v[c] for v in self.counts.values()) for c in ("input", *CLEAN_CAUSES, "kept")}

    def figures(self, store: DatasetStore, *, plot: bool) -> dict[str, Any]:
        """What cleaning did, per node and cause with the node's unit, and the run's plot."""
        spec = store.spec
        totals = self.cleaning_totals
        units = (store.read_meta(self.run_id, GRID) or {}).get("units", {})
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
        if plot and self.traces is not None:
            from aml_pipeline.pipeline.plots import (
                run_traces_markdown,  # matplotlib, only when drawing
            )

            figures["plot"] = Markdown(run_traces_markdown(self.traces, [units.get(n, "") for n in spec.node_ids], self.run_id))
        return figures


def clean_run(store: DatasetStore, run_id: str, *, chunk_points: int | None = None) -> GridSummary:
    """Clean each node's raw points and align them to the run's beat grid, chunk by chunk.

    The grid is stored node-major (``grid.values.npy`` is ``[nodes, rows]``), so each node's
    column is written front to back as its chunks are cleaned.
    """
    spec = store.spec
    meta = store.require(run_id, RAW)
    chunk = clean_chunk_points() if chunk_points is None else int(chunk_points)
    first, rows = grid_span(meta["fromMs"], meta["toMs"], spec.beat_ms)
    block_rows = grid_block_rows(len(spec.nodes))
    offsets = meta["offsets"]
    counts: dict[str, dict[str, int]] = {}
    missing: dict[str, float] = {}
    traces = TraceAccumulator(meta["fromMs"], meta["toMs"], spec.node_ids)
    with store.stage_writer(run_id, GRID) as writer:
        values = writer.array("values", "<f8", (rows,))
        for j, node in enumerate(spec.nodes):
            params = node_grid_params(spec, node, meta["catalogRange"][node.node_id])
            cleaner = SeriesCleaner(params)
            aligner = GridAligner(first, spec.beat_ms, rows, params, block_rows=block_rows)
            nan_rows = 0

            def emit(blocks, j=j) -> None:
                nonlocal nan_rows
                for r0, block in blocks:
                    values.append(block)
                    nan_rows += int(np.count_nonzero(np.isnan(block)))
                    traces.add_grid(j, first + spec.beat_ms * np.arange(r0, r0 + block.size, dtype=np.int64), block)

            def removed(kept, j=j) -> None:
                traces.add_removed(j, kept.outlier_ts, kept.outlier_value)

            for a in range(offsets[j], offsets[j + 1], chunk):
                b = min(a + chunk, offsets[j + 1])
                ts = store.read_flat(run_id, RAW, "ts", a, b)
                value = store.read_flat(run_id, RAW, "value", a, b)
                traces.add_raw(j, ts, value)
                kept = cleaner.feed(ts, value, store.read_flat(run_id, RAW, "state", a, b))
                removed(kept)
                emit(aligner.feed(kept.ts, kept.value))
            kept = cleaner.finish()
            removed(kept)
            emit(aligner.feed(kept.ts, kept.value))
            emit(aligner.finish())
            counts[node.node_id] = dict(cleaner.counts)
            if offsets[j + 1] - offsets[j] > chunk:
                release_freed_memory()
            # An empty grid has nothing usable (1.0), like core.grid.missing_ratio.
            missing[node.node_id] = nan_rows / rows if rows else 1.0
        run_traces = traces.result()
        run_traces.save(writer.file("traces.npz"))
        summary = derived_stage_summary(
            store.versions[GRID], meta, rows=rows, firstMs=first, counts=counts, missing=missing
        )
        writer.commit(summary)
    return GridSummary(run_id, rows, counts, missing, summary["dataVersion"], run_traces)


def read_grid_rows(store: DatasetStore, run_id: str, n_nodes: int, rows: int, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0..r1-1`` of the cleaned grid as ``[rows, nodes]`` (it is stored node-major)."""
    block = np.empty((r1 - r0, n_nodes), dtype=np.float64)
    for j in range(n_nodes):
        block[:, j] = store.read_flat(run_id, GRID, "values", j * rows + r0, j * rows + r1)
    return block

