"""The build plan: what a build of a dataset must do, read once from the TSDB and the store.

The spec's nodes must be in the TSDB's node catalog; the runs are the finished runs in the spec's
scope, with their TSDB data versions; per run, the first stale stage: a run stage is stale when it
is missing, was built for another stage version, or its input changed (for the raw stage the run
in the TSDB: its record, its version, the catalog ranges; for the later stages the data version
of the stage they read). Everything downstream of a stale stage is stale too. The CLI's build,
the new-run sensor, the run-stage assets and the tests' library build all plan through
:meth:`BuildPlan.read`, so they decide alike, and alike with the UI's stale markers (code
versions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from aml_pipeline.errors import BuildError, UnknownNodeError
from aml_pipeline.pipeline.registry import RAW, RUN_STAGES, stages_from
from aml_pipeline.pipeline.stages.base import Stage
from aml_pipeline.pipeline.stages.raw import RawSummary, is_raw_current, run_bounds, run_fetcher
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb.port import Node, Run, RunScope, TsdbPort


def run_scope(spec: DatasetSpec) -> RunScope:
    return RunScope(spec.line_id, spec.product_id, spec.recipe_id, spec.from_ms, spec.to_ms)


def check_nodes_known(spec: DatasetSpec, catalog: Iterable[Node]) -> dict[str, Node]:
    by_id = {n.node_id: n for n in catalog}
    missing = [(i, n) for i, n in enumerate(spec.node_ids) if n not in by_id]
    if missing:
        i, first = missing[0]
        others = [n for _, n in missing[1:]]
        shown = ", ".join(others[:10]) + (f" and {len(others) - 10} more" if len(others) > 10 else "")
        raise UnknownNodeError(
            f"spec {spec.id!r}: nodes[{i}]: node {first!r} is not in the TSDB node catalog"
            + (f" (nor are {shown})" if others else "")
        )
    return by_id


@dataclass
class BuildPlan:
    """The nodes, the finished runs in scope, their TSDB versions and (:attr:`stale`) the first
    stale stage of each run that needs work."""

    store: DatasetStore
    catalog: dict[str, Node]
    runs: list[Run]
    tsdb_versions: dict[str, str]
    full: bool = False

    @classmethod
    def read(cls, tsdb: TsdbPort, store: DatasetStore, *, run_ids: Sequence[str] | None = None,
             full: bool = False, require_runs: bool = True) -> BuildPlan:
        """Read the plan from ``tsdb`` and ``store``. ``run_ids``: only these runs' TSDB versions are
        read (a step over some partitions); ``full``: every run from its raw stage on;
        ``require_runs``: no finished run in scope is a ``NO_RUNS`` error."""
        spec = store.spec
        catalog = check_nodes_known(spec, tsdb.list_nodes())
        runs = tsdb.list_runs(run_scope(spec), finished_only=True)
        if require_runs and not runs:
            raise BuildError(f"spec {spec.id!r}: no finished runs in scope {run_scope(spec)}", code="NO_RUNS")
        versions = tsdb.run_versions(list(run_ids) if run_ids is not None else [r.run_id for r in runs])
        return cls(store, catalog, runs, versions, full)

    @property
    def run_ids(self) -> list[str]:
        return [r.run_id for r in self.runs]

    @cached_property
    def stale(self) -> dict[str, Stage]:
        """``{run id: first stale stage}`` in run order, for the runs that need work."""
        if self.full:
            return dict.fromkeys(self.run_ids, RAW)
        out = {}
        for run in self.runs:
            stage = first_stale_stage(self.store, run, tsdb_version=self.tsdb_versions.get(run.run_id), catalog=self.catalog)
            if stage is not None:
                out[run.run_id] = stage
        return out

    def mark_stale(self, run_id: str, stage: Stage) -> None:
        """Rebuild ``run_id`` from ``stage`` on (or from its earlier stale stage), e.g. a run whose
        stages are stored but which an instance has not recorded."""
        current = self.stale.get(run_id)
        if current is None or RUN_STAGES.index(stage) < RUN_STAGES.index(current):
            self.stale[run_id] = stage

    def work(self) -> list[tuple[str, tuple[Stage, ...]]]:
        """``(run id, stages to build)`` for the stale runs, in run order."""
        order = {r: i for i, r in enumerate(self.run_ids)}
        return [(r, stages_from(s)) for r, s in sorted(self.stale.items(), key=lambda kv: order.get(kv[0], len(order)))]

    def grid_cells(self, run_ids: Iterable[str]) -> int:
        """Grid rows times nodes of ``run_ids``: the size of their run stages' work, from the run
        records alone (nothing is fetched)."""
        spec = self.store.spec
        by_id = {r.run_id: r for r in self.runs}
        rows = 0
        for run_id in run_ids:
            run = by_id.get(run_id)
            if run is not None and run.ended_at is not None:
                lo, hi = run_bounds(spec, run)
                rows += max(0, hi - lo) // spec.beat_ms + 1
        return rows * len(spec.nodes)

    def fetcher(self, tsdb: TsdbPort, *, page_limit: int, order: Sequence[str] = ()) -> Callable[[str], RawSummary]:
        """:func:`~aml_pipeline.pipeline.stages.raw.run_fetcher` for the plan's runs; ``order``: the
        run ids in the order they will be fetched (each fetch names the next ones to the TSDB)."""
        return run_fetcher(tsdb, self.store, self.runs, self.catalog, page_limit=page_limit,
                           tsdb_versions=self.tsdb_versions, order=order)


def first_stale_stage(
    store: DatasetStore, run: Run, *, tsdb_version: str | None, catalog: Mapping[str, Node]
) -> Stage | None:
    """The first run stage that must be rebuilt for ``run`` (None: every stage is fresh)."""
    upstream: str | None = None
    for stage in RUN_STAGES:
        meta = store.read_meta(run.run_id, stage)
        if stage is RAW:
            if not is_raw_current(store, run, meta, tsdb_version=tsdb_version, catalog=catalog):
                return stage
        elif not store.versions.is_current(stage, meta) or meta.get("inputVersion") != upstream:
            return stage
        upstream = meta.get("dataVersion")
    return None


def run_batches(
    partition_keys: Sequence[str], first_stale: Mapping[str, Stage], chunk_runs: int
) -> list[tuple[tuple[Stage, ...], list[str]]]:
    """``(stages, run ids)`` per Dagster run: runs grouped by their first stale stage, in contiguous
    partition ranges of at most ``chunk_runs``."""
    batches = []
    for stage in RUN_STAGES:
        runs = [r for r, s in first_stale.items() if s is stage]
        batches += [(stages_from(stage), chunk) for chunk in contiguous_ranges(partition_keys, runs, chunk_runs)]
    return batches


def contiguous_ranges(keys: Sequence[str], wanted: Iterable[str], max_len: int) -> list[list[str]]:
    """``wanted`` as runs of consecutive ``keys`` (partition order), each at most ``max_len`` long."""
    want = set(wanted)
    out: list[list[str]] = []
    current: list[str] = []
    for key in keys:
        if key in want and len(current) < max_len:
            current.append(key)
            continue
        if current:
            out.append(current)
            current = []
        if key in want:
            current.append(key)
    if current:
        out.append(current)
    return out
