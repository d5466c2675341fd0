"""The library build: every stage of a dataset in this process, run after run, then publish.

No Dagster: the package's stages, plan and publish composed as the Dagster build composes them,
for tests that build without an instance and as the benchmark's reference for the Dagster build.
Incremental like the Dagster build: only runs with a stale stage are processed, from that stage
on, and nothing is published when nothing changed. Users build with ``aml-pipeline build`` or
the Dagster definitions; this module is not part of the package.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from pathlib import Path

from aml_pipeline.errors import BuildError
from aml_pipeline.pipeline.plan import BuildPlan
from aml_pipeline.pipeline.registry import RAW
from aml_pipeline.pipeline.runs import build_runs
from aml_pipeline.pipeline.stages.manifest import PublishedDataset, publish_dataset
from aml_pipeline.pipeline.stages.norm import fit_or_reuse_normalization
from aml_pipeline.pipeline.stages.split import plan_dataset, save_plan
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb.port import DEFAULT_PAGE_LIMIT, TsdbPort
from aml_pipeline.tsdb.retry import retrying

Progress = Callable[[str, int, int], None]


def build_dataset(
    spec: DatasetSpec,
    tsdb: TsdbPort,
    *,
    store_root: Path,
    datasets_root: Path,
    page_limit: int = DEFAULT_PAGE_LIMIT,
    progress: Progress | None = None,
    full: bool = False,
) -> PublishedDataset:
    """Every stage in this process, run after run, then publish (no Dagster).

    ``full`` rebuilds every run from its raw stage; ``progress(run id, done, total)`` is called
    after each run in scope. A TSDB briefly unavailable is retried (:mod:`aml_pipeline.tsdb.retry`).
    """
    tsdb = retrying(tsdb)
    store = DatasetStore(store_root, spec)
    with store.in_use():
        plan = BuildPlan.read(tsdb, store, full=full)
        work = plan.work()
        fetch = plan.fetcher(tsdb, page_limit=page_limit, order=[r for r, stages in work if RAW in stages])
        with closing(build_runs(store, work, fetch)) as results:
            for i, run in enumerate(plan.runs):
                if run.run_id in plan.stale:
                    result = next(results)
                    if result.error is not None:
                        raise result.error
                if progress:
                    progress(run.run_id, i + 1, len(plan.runs))
        split = plan_dataset(store, plan.run_ids)
        save_plan(store, split)
        norm, _ = fit_or_reuse_normalization(store, split)
        published = publish_dataset(
            store, split, norm, datasets_root, availability_watermark=tsdb.availability_watermark()
        )
    if not published.current:
        failed = [c for c in published.checks if not c.passed]
        raise BuildError(
            f"spec {spec.id!r}: snapshot {published.snapshot_dir} failed blocking checks "
            + "; ".join(f"{c.name}: {c.description}" for c in failed),
            code="CHECK_FAILED",
        )
    return published
