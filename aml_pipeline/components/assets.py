"""Dataset assets, one group per spec: keys ``[<spec id>, <stage's asset>]``.

Run-partitioned: ``raw_node_series`` -> ``cleaned_grid`` -> ``run_windows``, one multi-asset step
per chunk of runs (the three stages of a run back to back, any subset of them). Then, over all run
partitions: ``dataset_split`` -> ``normalization_stats`` -> ``dataset_manifest``. Each asset is its
stage (:mod:`aml_pipeline.pipeline.stages`): its key, description and code version (the stage's
fingerprint, so editing a spec marks exactly the stages it changes as stale) come from the stage's
declaration, its work from the stage's code, its metadata from the stage's figures. Assets manage
their own I/O through the store resource (nothing goes through an IO manager), so downstream steps
stream runs from disk.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from aml_pipeline import config, progress
from aml_pipeline.components.dagster_internals import add_partition_metadata
from aml_pipeline.components.metadata import to_metadata
from aml_pipeline.components.partitions import run_backfill_policy, run_partitions
from aml_pipeline.components.resources import StoreResource, TsdbResource
from aml_pipeline.errors import AmlError
from aml_pipeline.pipeline.checks import MANIFEST_CHECKS, CheckOutcome, check_current
from aml_pipeline.pipeline.plan import BuildPlan
from aml_pipeline.pipeline.runs import RunOutcome, progress_line_due, run_outcomes
from aml_pipeline.pipeline.registry import (
    DATASET_STAGES, GRID, MANIFEST, NORM, RAW, RUN_STAGES, SPLIT, STAGES, WINDOWS, StageVersions,
)
from aml_pipeline.pipeline.stages.base import Stage
from aml_pipeline.pipeline.stages.grid import fast_nodes
from aml_pipeline.pipeline.stages.manifest import publish_dataset
from aml_pipeline.pipeline.stages.norm import fit_or_reuse_normalization, load_norm, norm_figures, norm_line
from aml_pipeline.pipeline.stages.split import empty_splits, load_plan, plan_dataset, save_plan, split_figures
from aml_pipeline.pipeline.stages.windows import MISSING_WARN_RATIO, window_findings
from aml_pipeline.spec import DatasetSpec

TSDB_POINTS = dg.AssetKey(["tsdb", "points"])
PLOTS_OFF = " (no plot: AML_RUN_PLOTS=off)"
# Where a run's figures are (see _record).
FIGURES_WHERE = "The partition's metadata table in the UI (the asset's Partitions tab) shows a run's figures."


def dataset_assets(spec: DatasetSpec, versions: StageVersions) -> list[dg.AssetsDefinition]:
    """The assets of one dataset spec: the run stages (one multi-asset) and the dataset stages."""
    return [run_stage_assets(spec, versions), *dataset_stage_assets(spec, versions)]


def asset_key(spec: DatasetSpec, stage: Stage) -> dg.AssetKey:
    return dg.AssetKey([spec.id, stage.asset])


@contextmanager
def failing_as_one_line() -> Iterator[None]:
    """A user error (bad input, a full disk) fails the step with its one line as the description
    and its code in the failure's metadata."""
    try:
        yield
    except AmlError as e:
        raise dg.Failure(description=e.one_line(), metadata={"code": e.code}) from e


# ---- run stages ----------------------------------------------------------------------------------


def run_stage_assets(spec: DatasetSpec, versions: StageVersions) -> dg.AssetsDefinition:
    about = (
        f"line {spec.line_id}, product {spec.product_id}, recipe {spec.recipe_id}; "
        f"{len(spec.nodes)} nodes, beat {spec.beat_ms} ms, H={spec.history_steps}, F={spec.horizon_steps}"
    )
    plots = config.run_plots()
    specs = [
        dg.AssetSpec(
            asset_key(spec, stage),
            deps=[asset_key(spec, s) for s in RUN_STAGES if s.name == stage.upstream],
            code_version=versions[stage],
            description=f"{stage.description}{PLOTS_OFF if stage is GRID and not plots else ''} ({about}). {FIGURES_WHERE}",
            group_name=spec.id,
            kinds={"numpy"},
            partitions_def=run_partitions(spec.id),
        )
        for stage in RUN_STAGES
    ]
    windows_key = asset_key(spec, WINDOWS)
    check_specs = [
        dg.AssetCheckSpec("has_windows", asset=windows_key, description="warns about runs with zero windows, with the reason"),
        dg.AssetCheckSpec(
            "missing_ratio_below_threshold", asset=windows_key,
            description=f"warns when a node misses more than {MISSING_WARN_RATIO:.0%} of a run's grid",
        ),
    ]

    @dg.multi_asset(
        name=f"{spec.id}__run_stages",
        specs=specs,
        check_specs=check_specs,
        can_subset=True,
        backfill_policy=run_backfill_policy(),
        pool="aml_tsdb",
    )
    def run_stages(context: dg.AssetExecutionContext, tsdb: TsdbResource, store: StoreResource):
        """For every run partition of the step, its selected stages back to back. A run that fails
        does not lose the others: the stages that succeeded are recorded as materialisations of
        their partitions before the step fails, naming the failed runs."""
        stages = [s for s in RUN_STAGES if asset_key(spec, s) in context.selected_asset_keys]
        run_ids = list(context.partition_keys)
        ds = store.dataset_store(spec, versions)
        with failing_as_one_line(), ds.in_use(), tsdb.brief(on_retry=context.log.warning) as db:
            fetch = None
            if RAW in stages:
                # A partition that is not a finished run in scope is looked up: an unfinished run fails naming why.
                plan = BuildPlan.read(db, ds, run_ids=run_ids, require_runs=False)
                fetch = plan.fetcher(db, page_limit=tsdb.page_limit, order=run_ids)
            outcomes = []
            for i, outcome in enumerate(run_outcomes(ds, [(r, stages) for r in run_ids], fetch, plot=plots), 1):
                outcomes.append(outcome)
                for stage in outcome.figures:
                    progress.report(stage.asset, i, len(run_ids), outcome.run_id)
                if outcome.error is not None:
                    context.log.error(f"run {outcome.run_id} ({i}/{len(run_ids)}) failed: {_describe(outcome.error)}")
                elif progress_line_due(i, len(run_ids)):
                    context.log.info(f"run {outcome.run_id} ({i}/{len(run_ids)}): {outcome.line()}")
            # (the figure is always there: "none" for a run without such nodes)
            fast = [(o.run_id, nodes) for o in outcomes if (nodes := fast_nodes(o.figures.get(GRID, {}))) is not None]
            if fast:
                context.log.warning(
                    f"{len(fast)} of {len(outcomes)} runs have nodes sampled faster than twice the beat that take the "
                    f"value at each grid time (set aggregate: mean to take each beat's mean, docs/spec.md); "
                    f"run {fast[0][0]}: {fast[0][1]}")
        yield from _record(context, spec, stages, outcomes)

    return run_stages


def _record(context: dg.AssetExecutionContext, spec: DatasetSpec, stages: Sequence[Stage],
            outcomes: list[RunOutcome]) -> Iterator[Any]:
    """The step's events: each stage's materialisation of each run partition, with that run's
    figures for the stage as the materialisation's metadata (the partition's metadata table in the
    UI), the checks with them; or, when a run failed, the others' materialisations before the
    failure.

    The figures are put on the materialisations Dagster records for the step's partitions
    (:func:`~aml_pipeline.components.dagster_internals.add_partition_metadata`), which Dagster
    writes in one batch per asset: no event of their own per run and stage, and nothing that
    grows with the spec's runs (the ``orchestration`` and ``run_figures`` benchmarks measure it)."""
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        for o in outcomes:
            for stage, figures in o.figures.items():
                yield dg.AssetMaterialization(asset_key=asset_key(spec, stage), partition=o.run_id,
                                              metadata=to_metadata(figures))
        first = failed[0]
        raise dg.Failure(
            description=f"{len(failed)} of {len(outcomes)} runs failed; first: run {first.run_id}: {_describe(first.error)}",
            metadata={"failed_runs": ", ".join(o.run_id for o in failed), "succeeded": len(outcomes) - len(failed)},
        ) from first.error
    for o in outcomes:
        for stage, figures in o.figures.items():
            add_partition_metadata(context, asset_key(spec, stage), o.run_id, to_metadata(figures))
    single = len(outcomes) == 1
    for stage in stages:
        yield dg.MaterializeResult(
            asset_key=asset_key(spec, stage),
            # A data version per partition is only expressible for a one-partition step; the
            # partitions of a chunk get Dagster's logical version (code + upstream).
            data_version=dg.DataVersion(outcomes[0].data_versions[stage]) if single else None,
            check_results=_window_checks(spec, outcomes) if stage is WINDOWS else None,
        )


def _window_checks(spec: DatasetSpec, outcomes: list[RunOutcome]) -> list[dg.AssetCheckResult]:
    empty, high = window_findings({o.run_id: o.windows for o in outcomes if o.windows is not None})
    key = asset_key(spec, WINDOWS)
    return [
        dg.AssetCheckResult(
            asset_key=key,
            check_name="has_windows",
            passed=not empty,
            severity=dg.AssetCheckSeverity.WARN,
            description="; ".join(f"{r}: {why}" for r, why in empty.items()) or "every run has windows",
            metadata={"runs_without_windows": len(empty)},
        ),
        dg.AssetCheckResult(
            asset_key=key,
            check_name="missing_ratio_below_threshold",
            passed=not high,
            severity=dg.AssetCheckSeverity.WARN,
            description="; ".join(f"{r}: {n} {v:.0%} missing" for r, (n, v) in high.items())
            or f"no node misses more than {MISSING_WARN_RATIO:.0%} of a run's grid",
            metadata={"threshold": MISSING_WARN_RATIO, "runs_over": len(high)},
        ),
    ]


def _describe(e: BaseException) -> str:
    return e.one_line() if isinstance(e, AmlError) else f"{type(e).__name__}: {e}"


# ---- dataset stages ------------------------------------------------------------------------------


def dataset_stage_assets(spec: DatasetSpec, versions: StageVersions) -> list[dg.AssetsDefinition]:
    """One asset per dataset stage, in the registry's order: its key, upstream, code version and
    description from the stage's declaration, its work from :data:`_DATASET_WORK`."""
    return [_dataset_stage_asset(spec, versions, stage) for stage in DATASET_STAGES]


def _dataset_stage_asset(spec: DatasetSpec, versions: StageVersions, stage: Stage) -> dg.AssetsDefinition:
    work = _DATASET_WORK[stage.name]
    key = asset_key(spec, stage)
    upstream = next(s for s in STAGES if s.name == stage.upstream)
    deps = [asset_key(spec, upstream), *(asset_key(spec, s) for s in work.reads if s is not upstream), *work.sources]

    @dg.multi_asset(
        name=f"{spec.id}__{stage.asset}",
        specs=[dg.AssetSpec(key, deps=deps, kinds=work.kinds, code_version=versions[stage], group_name=spec.id,
                            description=stage.description)],
        check_specs=[dg.AssetCheckSpec(name, asset=key, blocking=True, description=desc) for name, desc in work.checks.items()],
        can_subset=bool(work.checks),
        required_resource_keys=work.resources,
    )
    def dataset_stage(context: dg.AssetExecutionContext):
        yield from work.build(context, spec, versions, key)

    return dataset_stage


@dataclass(frozen=True)
class _DatasetWork:
    """What a dataset stage's asset does (``build`` yields its results) and shows (``kinds``, its
    checks), and what it reads besides its upstream stage: other stages' results, source assets."""

    build: Callable[[dg.AssetExecutionContext, DatasetSpec, StageVersions, dg.AssetKey], Iterator[Any]]
    kinds: set[str]
    resources: set[str]
    reads: tuple[Stage, ...] = ()
    sources: tuple[dg.AssetKey, ...] = ()
    checks: Mapping[str, str] = field(default_factory=dict)


def _split(context: dg.AssetExecutionContext, spec: DatasetSpec, versions: StageVersions, key: dg.AssetKey) -> Iterator[Any]:
    ds = context.resources.store.dataset_store(spec, versions)
    with failing_as_one_line(), ds.in_use():
        plan = plan_dataset(ds, context.instance.get_dynamic_partitions(run_partitions(spec.id).name))
        save_plan(ds, plan)
        figures = split_figures(ds, plan)
    context.log.info(plan.line())
    why = empty_splits(spec, {p: len(plan.split[f"{p}RunIds"]) for p in ("train", "val", "test")})
    if why is not None:
        context.log.warning(why)
    yield dg.MaterializeResult(asset_key=key, metadata=to_metadata(figures))


def _norm(context: dg.AssetExecutionContext, spec: DatasetSpec, versions: StageVersions, key: dg.AssetKey) -> Iterator[Any]:
    ds = context.resources.store.dataset_store(spec, versions)
    with failing_as_one_line(), ds.in_use():
        plan = load_plan(ds)
        norm, reused = fit_or_reuse_normalization(ds, plan)
    context.log.info(norm_line(plan, reused=reused))
    yield dg.MaterializeResult(asset_key=key, metadata=to_metadata(norm_figures(ds, plan, norm, reused=reused)))


def _manifest(context: dg.AssetExecutionContext, spec: DatasetSpec, versions: StageVersions, key: dg.AssetKey) -> Iterator[Any]:
    store: StoreResource = context.resources.store
    selected_checks = {c.name for c in context.selected_asset_check_keys}
    if key not in context.selected_asset_keys:
        # Only the checks (the verify job): re-check the published snapshot from its bytes.
        entry, outcomes = check_current(store.datasets_root, spec.id)
        if entry is not None:
            context.log.info(f"re-checking {entry.path} (sha256 {entry.sha256} in the catalog)")
        yield from _check_results(key, outcomes, selected_checks)
        return
    ds = store.dataset_store(spec, versions)
    tsdb: TsdbResource = context.resources.tsdb
    with tsdb.brief(on_retry=context.log.warning) as db:
        watermark = db.availability_watermark()
    with failing_as_one_line(), ds.in_use():
        plan = load_plan(ds)
        norm = load_norm(ds, plan)
        published = publish_dataset(ds, plan, norm, store.datasets_root, availability_watermark=watermark)
    context.log.info(published.line())
    yield dg.MaterializeResult(
        asset_key=key,
        metadata=to_metadata(published.figures(ds, plan)),
        check_results=list(_check_results(key, published.checks, selected_checks)),
    )


_DATASET_WORK: Mapping[str, _DatasetWork] = {
    SPLIT.name: _DatasetWork(_split, kinds={"json"}, resources={"store"}),
    NORM.name: _DatasetWork(_norm, kinds={"json"}, resources={"store"}),
    # The TSDB's availability watermark is part of a v2 snapshot's provenance. (It is not
    # upstream of the run stages: any ingest moves it, and would mark every run stale;
    # a run's own TSDB version decides whether that run is rebuilt.)
    MANIFEST.name: _DatasetWork(_manifest, kinds={"json", "numpy"}, resources={"store", "tsdb"}, reads=(SPLIT,),
                                sources=(TSDB_POINTS,), checks=MANIFEST_CHECKS),
}


def _check_results(key: dg.AssetKey, outcomes: list[CheckOutcome], selected: set[str]) -> Iterator[dg.AssetCheckResult]:
    for c in outcomes:
        if c.name in selected:
            yield dg.AssetCheckResult(asset_key=key, check_name=c.name, passed=c.passed, description=c.description,
                                      metadata=c.metadata)
