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
    files=tuple(name for name, _ in RAW_COLUMNS),
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
    spec = store.spec
    lo, hi = run_bounds(spec, run)
    # A TSDB may serve a small run's nodes from one read (a query per node costs more), and the
    # next runs' from the same read; a run larger than one cleaning chunk is read page by page.
    tsdb.prefetch(run.run_id, spec.node_ids, lo, hi, max_points=clean_chunk_points(),
                  ahead=[(r.run_id, *run_bounds(spec, r)) for r in ahead])
    content = hashlib.sha256()
    points: dict[str, int] = {}
    pages: dict[str, int] = {}
    offsets = [0]
    with store.stage_writer(run.run_id, RAW) as writer:
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


def run_fetcher(
    tsdb: TsdbPort,
    store: DatasetStore,
    runs: Iterable[Run],
    catalog: Mapping[str, Node],
    *,
    page_limit: int,
    tsdb_versions: Mapping[str, str],
    order: Sequence[str] = (),
) -> Callable[[str], RawSummary]:
    """:func:`~aml_pipeline.pipeline.runs.build_runs`'s ``fetch``: :func:`fetch_run` by run id, for
    the spec's finished runs in scope (``runs``) with their TSDB versions. Any other id is looked up
    in the TSDB, so that an unknown or unfinished run fails naming why instead of with a bare
    KeyError. ``order``: the run ids in the order they will be fetched; each fetch passes the next
    :data:`READ_AHEAD_RUNS` of them in scope as ``ahead``."""
    by_id = {r.run_id: r for r in runs}
    position = {r: i for i, r in enumerate(order)}

    def fetch(run_id: str) -> RawSummary:
        run = by_id.get(run_id) or tsdb.get_run(run_id)
        ahead = []
        if run_id in position:
            for next_id in order[position[run_id] + 1 : position[run_id] + 1 + READ_AHEAD_RUNS]:
                if next_id not in by_id:
                    break
                ahead.append(by_id[next_id])
        return fetch_run(tsdb, store, run, catalog, page_limit=page_limit, tsdb_version=tsdb_versions.get(run_id),
                         ahead=ahead)

    return fetch


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
