"""The raw stage: every point of each spec node in a run, read page by page from the TSDB.

Its version covers the run scope, the time window and the node ids; its data version hashes what
was fetched, with the run record and the catalog ranges the later stages use, so late or
corrected points make exactly that run stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aml_pipeline.errors import BuildError
from aml_pipeline.pipeline.chunks import clean_chunk_points, release_freed_memory
from aml_pipeline.pipeline.metadata import FilePath, Table
from aml_pipeline.pipeline.stages.base import Stage, chain_version
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb.port import Node, Run, TsdbPort, iter_node_pages

RAW_COLUMNS = (("ts", "<i8"), ("value", "<f8"), ("state", "<i4"), ("seq", "<i8"))
# What the stage stores of each point. ``seq`` (the TSDB's ingest order) only orders points of
# equal timestamps, which the stored order already holds: it is hashed into the data version
# (a corrected order makes the run stale) but no later stage reads it.
STORED_COLUMNS = RAW_COLUMNS[:3]
# Runs a fetch names to the TSDB as read next (``ahead``): the embedded file reads them in one query.
READ_AHEAD_RUNS = 7


def _covers(spec: DatasetSpec, j: Mapping[str, Any]) -> dict[str, Any]:
    return {k: j[k] for k in ("lineId", "productId", "recipeId", "fromMs", "toMs")} | {"nodes": spec.node_ids}


RAW = Stage(
    name="raw",
    asset="raw_node_series",
    upstream=None,
    per_run=True,
    algorithm=2,
    covers=_covers,
    files=tuple(name for name, _ in STORED_COLUMNS),
    description="Every point of each spec node in the run, read page by page from the TSDB. Per run: points and pages per node.",
)


def run_bounds(spec: DatasetSpec, run: Run) -> tuple[int, int]:
    """The run's slice of the spec window: ``max(started, fromMs) .. min(ended, toMs)``."""
    if run.ended_at is None:
        raise BuildError(f"run {run.run_id!r} has not finished (no ended_at); it cannot be built yet")
    lo = run.started_at if spec.from_ms is None else max(run.started_at, spec.from_ms)
    hi = run.ended_at if spec.to_ms is None else min(run.ended_at, spec.to_ms)
    return lo, hi


def catalog_ranges(spec: DatasetSpec, catalog: Mapping[str, Node]) -> dict[str, list[float | None]]:
    return {n: [catalog[n].range_lo, catalog[n].range_hi] for n in spec.node_ids}


@dataclass
class RawSummary:
    run_id: str
    points: dict[str, int]
    pages: dict[str, int]
    data_version: str

    @property
    def total_points(self) -> int:
        return sum(self.points.values())

    def figures(self, store: DatasetStore, *, plot: bool = False) -> dict[str, Any]:
        """The fetch as a person reads it: points and pages per node."""
        return {
            "points": self.total_points,
            "pages": sum(self.pages.values()),
            "per_node": Table([{"node": n, "points": self.points[n], "pages": self.pages[n]} for n in store.spec.node_ids]),
            "path": FilePath(store.run_dir(self.run_id)),
        }


def fetch_run(
    tsdb: TsdbPort,
    store: DatasetStore,
    run: Run,
    catalog: Mapping[str, Node],
    *,
    page_limit: int,
    tsdb_version: str | None = None,
    ahead: Sequence[Run] = (),
) -> RawSummary:
    """Read every spec node of one run from the TSDB, page by page, appending to the store.

    ``tsdb_version`` is the run's version in the TSDB when the fetch began (recorded so a later
    build can tell whether the run changed); the stage's data version hashes what was actually
    fetched, with the run record and the catalog ranges the later stages use. ``ahead``: the
    runs fetched next, which the TSDB may read with this one (the port's ``prefetch``).
    """
    read = read_run(tsdb, store, run, catalog, page_limit=page_limit, tsdb_version=tsdb_version, ahead=ahead)
    return read if isinstance(read, RawSummary) else read.write()


@dataclass
class PendingRaw:
    """A run read from the TSDB whose raw stage is not written yet: :meth:`write` stores it,
    exactly as :func:`fetch_run` would have, in any thread (it no longer needs the TSDB). Its
    pages are views of the prefetch's read, which they keep alive until written: a build holds
    the runs it has in flight, at most one read beyond the one the TSDB holds."""

    store: DatasetStore
    run: Run
    catalog: Mapping[str, Node]
    tsdb_version: str | None
    bounds: tuple[int, int]
    pages: dict[str, tuple[list[Any], int]]  # node -> (its pages, queries)

    def columns(self) -> dict[str, np.ndarray]:
        """``ts``, ``value`` and ``state`` of every node, back to back in the spec's node order: the
        raw stage's arrays as :meth:`write` stores them (new arrays, the cleaning's to keep)."""
        out = {}
        for name, dtype in STORED_COLUMNS:
            parts = [getattr(page, name) for pages, _ in self.pages.values() for page in pages if len(page)]
            out[name] = np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
        return out

    def write(self) -> RawSummary:
        return write_raw(self.store, self.run, self.catalog, self.tsdb_version, self.bounds,
                         ((node, [(pages, queries)], queries) for node, (pages, queries) in self.pages.items()))


def read_run(
    tsdb: TsdbPort,
    store: DatasetStore,
    run: Run,
    catalog: Mapping[str, Node],
    *,
    page_limit: int,
    tsdb_version: str | None = None,
    ahead: Sequence[Run] = (),
) -> RawSummary | PendingRaw:
    """:func:`fetch_run`'s reading: a run the TSDB serves from one read (its prefetch) is read
    whole and returned to be written later (:class:`PendingRaw`), so the thread that holds the
    TSDB handle only reads; a larger run is read and written page by page, as :func:`fetch_run`
    does, and its summary returned."""
    spec = store.spec
    lo, hi = run_bounds(spec, run)
    # A TSDB may serve a small run's nodes from one read (a query per node costs more), and the
    # next runs' from the same read; a run larger than one cleaning chunk is read page by page.
    held = tsdb.prefetch(run.run_id, spec.node_ids, lo, hi, max_points=clean_chunk_points(),
                         ahead=[(r.run_id, *run_bounds(spec, r)) for r in ahead])

    def node_pages(node_id: str) -> Iterable[tuple[Any, int]]:
        return iter_node_pages(tsdb, node_id, run.run_id, lo, hi, page_limit=page_limit)

    if not held:
        return write_raw(store, run, catalog, tsdb_version, (lo, hi), ((n, node_pages(n), 0) for n in spec.node_ids))
    # Served from memory: the pages are views of what the prefetch holds (nothing is copied),
    # at most one prefetch's points.
    pages: dict[str, tuple[list[Any], int]] = {}
    for node_id in spec.node_ids:
        got, queries = [], 0
        for page, queries in node_pages(node_id):
            got.append(page)
        pages[node_id] = (got, queries)
    return PendingRaw(store, run, catalog, tsdb_version, (lo, hi), pages)


def write_raw(
    store: DatasetStore,
    run: Run,
    catalog: Mapping[str, Node],
    tsdb_version: str | None,
    bounds: tuple[int, int],
    nodes: Iterable[tuple[str, Iterable[tuple[Any, int]], int]],
) -> RawSummary:
    """The raw stage of ``run`` from its pages: ``nodes`` gives, per spec node in order, the
    node id, its ``(page, queries so far)`` pairs and the queries when none is given (a node
    whose pages were read before)."""
    spec = store.spec
    lo, hi = bounds
    content = hashlib.sha256()
    points: dict[str, int] = {}
    pages: dict[str, int] = {}
    offsets = [0]
    with store.stage_writer(run.run_id, RAW) as writer:
        columns = {name: writer.array(name, dtype) for name, dtype in STORED_COLUMNS}
        # Pages given in lists (a run read whole, held in memory) are written together, a few
        # writes per column for the run; pages read one by one are written as they come.
        held: dict[str, list[Any]] = {name: [] for name in columns}

        def write_held() -> None:
            for name, parts in held.items():
                if parts:
                    columns[name].extend(parts)
                    parts.clear()

        for node_id, node_pages, queries in nodes:
            n = 0
            for item, queries in node_pages:
                listed = isinstance(item, list)
                if not listed:
                    write_held()
                for page in item if listed else (item,):
                    if not len(page):
                        continue
                    for name, _ in RAW_COLUMNS:
                        data = np.ascontiguousarray(getattr(page, name))
                        content.update(data.data)
                        if name not in columns:
                            continue  # hashed, not stored
                        if listed:
                            held[name].append(data)
                        else:
                            columns[name].append(data)
                    n += len(page)
            points[node_id], pages[node_id] = n, queries
            offsets.append(offsets[-1] + n)
            if queries > 1:
                release_freed_memory()
        write_held()
        run_record = dataclasses.asdict(run)
        ranges = catalog_ranges(spec, catalog)
        content.update(json.dumps([run_record, ranges, offsets], sort_keys=True).encode())
        fingerprint = store.versions[RAW]
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


class RunFetcher:
    """:func:`~aml_pipeline.pipeline.runs.build_runs`'s ``fetch``: called with a run id, it is
    :func:`fetch_run` of that run; :meth:`read` is its reading alone (:func:`read_run`), which
    ``build_runs`` calls in its fetch thread, leaving the writing to the run's own thread."""

    def __init__(self, tsdb: TsdbPort, store: DatasetStore, runs: Iterable[Run], catalog: Mapping[str, Node], *,
                 page_limit: int, tsdb_versions: Mapping[str, str], order: Sequence[str] = ()) -> None:
        self.tsdb, self.store, self.catalog = tsdb, store, catalog
        self.page_limit, self.tsdb_versions, self.order = page_limit, tsdb_versions, list(order)
        self.by_id = {r.run_id: r for r in runs}
        self.position = {r: i for i, r in enumerate(self.order)}

    def read(self, run_id: str) -> RawSummary | PendingRaw:
        run = self.by_id.get(run_id) or self.tsdb.get_run(run_id)
        ahead = []
        if run_id in self.position:
            # The build's first reads read fewer runs ahead (none, then 1, 3, 7): every run thread
            # waits for the first, and a read takes as long as the runs it reads.
            at = self.position[run_id]
            for next_id in self.order[at + 1 : at + 1 + min(READ_AHEAD_RUNS, at)]:
                if next_id not in self.by_id:
                    break
                ahead.append(self.by_id[next_id])
        return read_run(self.tsdb, self.store, run, self.catalog, page_limit=self.page_limit,
                        tsdb_version=self.tsdb_versions.get(run_id), ahead=ahead)

    def __call__(self, run_id: str) -> RawSummary:
        read = self.read(run_id)
        return read if isinstance(read, RawSummary) else read.write()


def run_fetcher(
    tsdb: TsdbPort,
    store: DatasetStore,
    runs: Iterable[Run],
    catalog: Mapping[str, Node],
    *,
    page_limit: int,
    tsdb_versions: Mapping[str, str],
    order: Sequence[str] = (),
) -> RunFetcher:
    """:func:`~aml_pipeline.pipeline.runs.build_runs`'s ``fetch``: :func:`fetch_run` by run id, for
    the spec's finished runs in scope (``runs``) with their TSDB versions. Any other id is looked up
    in the TSDB, so that an unknown or unfinished run fails naming why instead of with a bare
    KeyError. ``order``: the run ids in the order they will be fetched; each fetch passes the next
    :data:`READ_AHEAD_RUNS` of them in scope as ``ahead``."""
    return RunFetcher(tsdb, store, runs, catalog, page_limit=page_limit, tsdb_versions=tsdb_versions, order=order)


def is_raw_current(store: DatasetStore, run: Run, meta: Mapping[str, Any] | None, *, tsdb_version: str | None,
                   catalog: Mapping[str, Node]) -> bool:
    """Whether a run's stored raw stage still holds what the TSDB holds for it: built for this
    version, from this TSDB version of the run, this run record and these catalog ranges."""
    return (
        store.versions.is_current(RAW, meta)
        and meta.get("tsdbVersion") == tsdb_version
        and meta.get("run") == dataclasses.asdict(run)
        and meta.get("catalogRange") == catalog_ranges(store.spec, catalog)
    )
