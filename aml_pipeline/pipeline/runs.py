"""Per-run stages of a dataset build: fetch -> clean and align -> windows, streamed in chunks.

Each stage reads its input from the store (or the TSDB) piece by piece, calls the numeric core and
appends its result to the store, returning a small summary. Memory is bounded by the chunk sizes
(:mod:`aml_pipeline.pipeline.chunks`), not by a run's length: a month at 1 kHz builds like an hour.
The Dagster run assets are thin wrappers around these.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from aml_pipeline.core.clean import CLEAN_CAUSES, SeriesCleaner
from aml_pipeline.core.grid import GridAligner, grid_span
from aml_pipeline.core.traces import RunTraces, TraceAccumulator
from aml_pipeline.core.windows import StartFinder, explain_no_windows
from aml_pipeline.errors import BuildError, UnknownNodeError
from aml_pipeline.pipeline.chunks import clean_chunk_points, grid_block_rows, release_freed_memory
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.pipeline.versions import chain_version, stage_versions
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb.port import Node, Run, TsdbPort, iter_node_pages

RAW_COLUMNS = (("ts", "<i8"), ("value", "<f8"), ("state", "<i4"), ("seq", "<i8"))


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


def catalog_ranges(spec: DatasetSpec, catalog: dict[str, Node]) -> dict[str, list[float | None]]:
    return {n: [catalog[n].range_lo, catalog[n].range_hi] for n in spec.node_ids}


# ---- raw ---------------------------------------------------------------------------------------


@dataclass
class RawSummary:
    run_id: str
    points: dict[str, int]
    pages: dict[str, int]
    data_version: str

    @property
    def total_points(self) -> int:
        return sum(self.points.values())


def fetch_run(
    tsdb: TsdbPort,
    spec: DatasetSpec,
    run: Run,
    store: DatasetStore,
    catalog: dict[str, Node],
    *,
    page_limit: int,
    tsdb_version: str | None = None,
) -> RawSummary:
    """Read every spec node of one run from the TSDB, page by page, appending to the store.

    ``tsdb_version`` is the run's version in the TSDB when the fetch began (recorded so a later
    build can tell whether the run changed); the stage's data version hashes what was actually
    fetched, with the run record and the catalog ranges the later stages use.
    """
    lo, hi = run_bounds(spec, run)
    # The embedded TSDB can serve a small run's nodes from one query (about twice the points/s of
    # a query per node); a run larger than one cleaning chunk is read page by page instead.
    prefetch = getattr(tsdb, "prefetch", None)
    if callable(prefetch):
        prefetch(run.run_id, spec.node_ids, lo, hi, max_points=clean_chunk_points())
    content = hashlib.sha256()
    points: dict[str, int] = {}
    pages: dict[str, int] = {}
    offsets = [0]
    with store.stage_writer(run.run_id, "raw") as writer:
        columns = {name: writer.array(name, dtype) for name, dtype in RAW_COLUMNS}
        for node_id in spec.node_ids:
            n = queries = 0
            for page, queries in iter_node_pages(tsdb, node_id, run.run_id, lo, hi, page_limit=page_limit):
                if not len(page):
                    continue
                for name, _ in RAW_COLUMNS:
                    data = getattr(page, name)
                    columns[name].append(data)
                    content.update(np.ascontiguousarray(data).data)
                n += len(page)
            points[node_id], pages[node_id] = n, queries
            offsets.append(offsets[-1] + n)
            if queries > 1:
                release_freed_memory()
        run_record = dataclasses.asdict(run)
        ranges = catalog_ranges(spec, catalog)
        content.update(json.dumps([run_record, ranges, offsets], sort_keys=True).encode())
        fingerprint = stage_versions(spec).raw
        data_version = chain_version(fingerprint, content.hexdigest())
        writer.commit(
            {
                "fingerprint": fingerprint,
                "dataVersion": data_version,
                "tsdbVersion": tsdb_version,
                "run": run_record,
                "fromMs": lo,
                "toMs": hi,
                "nodes": spec.node_ids,
                "offsets": offsets,
                "catalogRange": ranges,
                "units": {n: catalog[n].unit for n in spec.node_ids},
                "points": points,
                "pages": pages,
            }
        )
    return RawSummary(run.run_id, points, pages, data_version)


def run_fetcher(
    tsdb: TsdbPort,
    spec: DatasetSpec,
    store: DatasetStore,
    runs: Iterable[Run],
    catalog: dict[str, Node],
    *,
    page_limit: int,
    tsdb_versions: Mapping[str, str],
) -> Callable[[str], RawSummary]:
    """:func:`build_runs`'s ``fetch``: :func:`fetch_run` by run id, for the spec's finished runs in
    scope (``runs``) with their TSDB versions. Any other id is looked up in the TSDB, so that an
    unknown or unfinished run fails naming why instead of with a bare KeyError."""
    by_id = {r.run_id: r for r in runs}

    def fetch(run_id: str) -> RawSummary:
        run = by_id.get(run_id) or tsdb.get_run(run_id)
        return fetch_run(tsdb, spec, run, store, catalog, page_limit=page_limit, tsdb_version=tsdb_versions.get(run_id))

    return fetch


# ---- grid --------------------------------------------------------------------------------------


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


def _require(store: DatasetStore, spec: DatasetSpec, run_id: str, stage: str) -> dict[str, Any]:
    meta = store.read_meta(run_id, stage)
    if meta is None:
        raise BuildError(f"run {run_id!r}: {stage} stage has not been materialised for spec {spec.id!r}")
    wanted = stage_versions(spec).of(stage)
    if meta.get("fingerprint") != wanted:
        raise BuildError(
            f"run {run_id!r}: the stored {stage} stage was built for another version of spec "
            f"{spec.id!r} (fingerprint {meta.get('fingerprint')}, now {wanted}); rematerialise the run"
        )
    return meta


def clean_run(spec: DatasetSpec, run_id: str, store: DatasetStore, *, chunk_points: int | None = None) -> GridSummary:
    """Clean each node's raw points and align them to the run's beat grid, chunk by chunk.

    The grid is stored node-major (``grid.values.npy`` is ``[nodes, rows]``), so each node's
    column is written front to back as its chunks are cleaned.
    """
    meta = _require(store, spec, run_id, "raw")
    chunk = clean_chunk_points() if chunk_points is None else int(chunk_points)
    first, rows = grid_span(meta["fromMs"], meta["toMs"], spec.beat_ms)
    block_rows = grid_block_rows(len(spec.nodes))
    offsets = meta["offsets"]
    cleaning = spec.cleaning
    counts: dict[str, dict[str, int]] = {}
    missing: dict[str, float] = {}
    traces = TraceAccumulator(meta["fromMs"], meta["toMs"], spec.node_ids)
    with store.stage_writer(run_id, "grid") as writer:
        values = writer.array("values", "<f8", (rows,))
        for j, node in enumerate(spec.nodes):
            catalog_lo, catalog_hi = meta["catalogRange"][node.node_id]
            lo, hi = node.range if node.range is not None else (catalog_lo, catalog_hi)
            cleaner = SeriesCleaner(
                good_states=cleaning.good_states,
                range_lo=lo,
                range_hi=hi,
                hampel_k=cleaning.hampel_k if node.hampel_k is None else node.hampel_k,
                hampel_sigma=cleaning.hampel_sigma,
                hampel_min_dev=cleaning.hampel_min_dev if node.hampel_min_dev is None else node.hampel_min_dev,
            )
            aligner = GridAligner(
                first,
                spec.beat_ms,
                rows,
                interp=node.interp,
                max_interp_ms=spec.max_interp_ms if node.max_interp_ms is None else node.max_interp_ms,
                block_rows=block_rows,
            )
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
                ts = store.read_flat(run_id, "raw", "ts", a, b)
                value = store.read_flat(run_id, "raw", "value", a, b)
                traces.add_raw(j, ts, value)
                kept = cleaner.feed(ts, value, store.read_flat(run_id, "raw", "state", a, b))
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
        summary = _derived_stage_summary(
            stage_versions(spec).grid, meta, rows=rows, firstMs=first, counts=counts, missing=missing
        )
        writer.commit(summary)
    return GridSummary(run_id, rows, counts, missing, summary["dataVersion"], run_traces)


# ---- windows -----------------------------------------------------------------------------------


@dataclass
class WindowsSummary:
    run_id: str
    windows: int
    rows: int
    reason: str | None  # why there are no windows, when there are none
    missing: dict[str, float]
    data_version: str


def unit_columns(spec: DatasetSpec) -> list[tuple[int, float, float]]:
    """``(column, scale, offset)`` of every node with a v2 unit transform."""
    transforms = spec.unit_transforms()
    return [(j, t.scale, t.offset) for j, n in enumerate(spec.node_ids) if (t := transforms.get(n))]


def window_run(spec: DatasetSpec, run_id: str, store: DatasetStore) -> WindowsSummary:
    """Convert the grid to model units and find the run's valid window starts, block by block.

    Writes ``windows.model.npy`` (``[rows, nodes]``, model units, row-major: what the snapshot
    writer reads in row blocks) and ``windows.starts.npy``.
    """
    meta = _require(store, spec, run_id, "grid")
    rows, n_nodes = int(meta["rows"]), len(spec.nodes)
    cols = {n: j for j, n in enumerate(spec.node_ids)}
    finder = StartFinder(
        rows, n_nodes, spec.history_steps, spec.horizon_steps, spec.stride,
        [cols[n] for n in spec.control_ids], [cols[n] for n in spec.target_ids],
    )
    units = unit_columns(spec)
    block_rows = grid_block_rows(n_nodes)
    nonfinite = np.zeros(n_nodes, dtype=np.int64)
    windows = 0
    with store.stage_writer(run_id, "windows") as writer:
        model = writer.array("model", "<f8", (n_nodes,))
        starts = writer.array("starts", "<i8")
        for r0 in range(0, rows, block_rows):
            r1 = min(rows, r0 + block_rows)
            block = read_grid_rows(store, run_id, n_nodes, rows, r0, r1)
            for j, scale, offset in units:
                block[:, j] = block[:, j] * scale + offset
            model.append(block)
            nonfinite += np.count_nonzero(~np.isfinite(block), axis=0)
            found = finder.feed(block)
            starts.append(found)
            windows += found.size
        found = finder.finish()
        starts.append(found)
        windows += found.size
        if rows > block_rows:
            release_freed_memory()
        reason = None
        if windows == 0:
            reason = explain_no_windows(rows, spec.history_steps, spec.horizon_steps, nonfinite, spec.node_ids)
        summary = _derived_stage_summary(
            stage_versions(spec).windows, meta, rows=rows, firstMs=meta["firstMs"], windows=windows,
            reason=reason, missing=meta["missing"], counts=meta["counts"],
        )
        writer.commit(summary)
    return WindowsSummary(run_id, windows, rows, reason, meta["missing"], summary["dataVersion"])


def _derived_stage_summary(fingerprint: str, input_meta: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The committed summary of a stage built from the stage before it (``input_meta``): its
    version chained on the input's, the run record and units carried over, then ``fields``."""
    return {
        "fingerprint": fingerprint,
        "dataVersion": chain_version(fingerprint, input_meta["dataVersion"]),
        "inputVersion": input_meta["dataVersion"],
        "run": input_meta["run"],
        "units": input_meta["units"],
        **fields,
    }


# ---- runs, stage after stage -------------------------------------------------------------------


@dataclass
class RunResult:
    """What one run's stages produced (None: not built), or the error that stopped the run."""

    run_id: str
    raw: RawSummary | None = None
    grid: GridSummary | None = None
    windows: WindowsSummary | None = None
    error: Exception | None = None


def build_runs(
    spec: DatasetSpec,
    store: DatasetStore,
    work: Sequence[tuple[str, Sequence[str]]],
    fetch: Callable[[str], RawSummary] | None,
) -> Iterator[RunResult]:
    """Each run of ``work`` (run id, stages to build) through its stages, in order, yielding what it
    produced; a run that fails yields its error and the next run goes on.

    ``fetch`` (the raw stage of one run, from the TSDB) runs in a thread, one run ahead: the next
    run is fetched while this one is cleaned and windowed. The database and numpy release the
    GIL, so the two overlap on two cores. Fetches run one at a time, in run order, so the TSDB
    handle is never used by two threads at once, and at most one more run is in flight.
    """
    to_fetch = iter([run_id for run_id, stages in work if "raw" in stages])
    if fetch is None and next(to_fetch, None) is not None:
        raise ValueError("build_runs: a run needs its raw stage, but no fetch was given")
    pool = ThreadPoolExecutor(1, thread_name_prefix="fetch")

    def fetch_next() -> Future[RawSummary] | None:
        run_id = next(to_fetch, None)
        return None if run_id is None else pool.submit(fetch, run_id)

    try:
        pending = fetch_next()
        for run_id, stages in work:
            result = RunResult(run_id)
            try:
                if "raw" in stages:
                    fetched, pending = pending, fetch_next()
                    result.raw = fetched.result()
                if "grid" in stages:
                    result.grid = clean_run(spec, run_id, store)
                if "windows" in stages:
                    result.windows = window_run(spec, run_id, store)
            except Exception as e:  # noqa: BLE001 - reported per run; the caller decides what it stops
                result.error = e
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def read_grid_rows(store: DatasetStore, run_id: str, n_nodes: int, rows: int, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0..r1-1`` of the cleaned grid as ``[rows, nodes]`` (it is stored node-major)."""
    block = np.empty((r1 - r0, n_nodes), dtype=np.float64)
    for j in range(n_nodes):
        block[:, j] = store.read_flat(run_id, "grid", "values", j * rows + r0, j * rows + r1)
    return block
