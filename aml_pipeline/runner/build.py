"""Building one dataset through its Dagster jobs from the command line (``build`` and ``demo``).

The same definitions the UI shows, executed in this process under their named jobs:
``<spec>__runs`` for the run stages, over contiguous ranges of at most
``AML_BACKFILL_RUNS_PER_CHUNK`` partitions (the backfill chunks), then ``<spec>__rebuild`` for the
dataset. Incremental: only runs with a stale stage are materialised, from that stage on, and the
rebuild publishes nothing when nothing changed (:class:`aml_pipeline.pipeline.plan.BuildPlan`). In
an instance the caller gives (``DAGSTER_HOME``), a run whose partitions it has not recorded is
materialised too, so that what the UI shows is what the snapshot holds.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import dagster as dg

from aml_pipeline import config
from aml_pipeline.components.dagster_internals import (build_event_settings, materialized_partitions, scratch_instance,
                                                          step_end_times)
from aml_pipeline.components.partitions import range_tags, run_partitions
from aml_pipeline.components.resources import StoreResource, TsdbResource
from aml_pipeline.components.schedules import build_job_name, rebuild_job_name, runs_job_name
from aml_pipeline.errors import AmlError, BuildError
from aml_pipeline.pipeline.plan import BuildPlan, run_batches
from aml_pipeline.pipeline.registry import DATASET_ASSETS, MANIFEST, RUN_ASSETS, RUN_STAGES, StageVersions
from aml_pipeline.pipeline.stages.base import Stage
from aml_pipeline.runner.interrupts import interrupts_not_lost
from aml_pipeline.runner.instance import build_tags, fail_abandoned_runs, failure_description, instance_failures, user_error
from aml_pipeline.runner.jobs import dataset_job_definitions
from aml_pipeline.runner.parallel import execute_parallel, parallel_workers, start_step_server
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb_open import retrying_tsdb

log = logging.getLogger("aml_pipeline")



def sync_run_partitions(instance: dg.DagsterInstance, spec: DatasetSpec, run_ids: list[str]) -> list[str]:
    """Make the spec's run partitions exactly ``run_ids`` (the runs in scope now)."""
    name = run_partitions(spec.id).name
    existing = instance.get_dynamic_partitions(name)
    wanted = set(run_ids)
    for key in existing:
        if key not in wanted:
            instance.delete_dynamic_partition(name, key)
    have = set(existing)
    new = [r for r in run_ids if r not in have]
    if new:
        instance.add_dynamic_partitions(name, new)
    return instance.get_dynamic_partitions(name)


def unrecorded_runs(instance: dg.DagsterInstance, spec: DatasetSpec, run_ids: list[str]) -> dict[str, Stage]:
    """``{run id: stage}`` for the runs with a run-asset partition that ``instance`` has not recorded
    as materialised, from the first such asset's stage on. A step that died after storing some of
    its runs leaves their files fresh but unrecorded; so does a build recorded in another instance."""
    recorded = {stage: materialized_partitions(instance, dg.AssetKey([spec.id, stage.asset])) for stage in RUN_STAGES}
    out = {}
    for run_id in run_ids:
        stage = next((stage for stage in RUN_STAGES if run_id not in recorded[stage]), None)
        if stage is not None:
            out[run_id] = stage
    return out


def materialize_dataset(
    spec: DatasetSpec,
    *,
    tsdb_url: str,
    home: Path,
    datasets_dir: Path | None = None,
    instance: dg.DagsterInstance | None = None,
    console_log_level: str = "INFO",
    full: bool = False,
    workers: int = 1,
) -> dict[str, Any]:
    """Build and publish ``spec`` through its Dagster jobs; return the build summary.

    Everything is recorded in ``instance`` (run logs, materialisations, checks); the console shows
    Dagster's log at ``console_log_level`` (the CLI passes CRITICAL and draws progress bars).
    ``full`` rematerialises every run partition. The summary adds ``materialized`` (run
    partitions materialised by this build, per asset) and ``published``.

    ``workers`` > 1 spreads the run stages over up to that many processes through Dagster's
    execution: the runs needing work are cut into at least as many chunks, each a Dagster run of
    the ``<spec>__runs`` job executed by the multiprocess executor (its step in a process Dagster
    forks), that many at a time; a persistent instance is needed for that (a temporary one when
    ``instance`` is not given). Where more workers cannot help (:func:`parallel_workers`: too few
    cores, runs or grid cells), the build uses fewer and says why in the summary's ``workers`` and
    one warning line. The output is byte-identical to ``workers=1``.
    """
    if workers < 1:
        raise AmlError(f"--workers must be >= 1, got {workers}", code="USAGE")
    asked = workers
    store = StoreResource(home=str(home), datasets_dir=str(datasets_dir) if datasets_dir else None)
    versions = StageVersions.of(spec)  # once for the plan and the definitions
    with retrying_tsdb(tsdb_url) as db:
        plan = BuildPlan.read(db, store.dataset_store(spec, versions), full=full)
    defs = dataset_job_definitions(spec, {"tsdb": TsdbResource(url=tsdb_url), "store": store}, versions)
    run_config = {"loggers": {"console": {"config": {"log_level": console_log_level}}}}
    where = "of this build" if instance is None else f"in {instance.root_directory}"
    with build_event_settings(), instance_failures(where):
        own = instance is None
        scratch = None
        try:
            if not own:
                fail_abandoned_runs(instance, spec)
                keys = sync_run_partitions(instance, spec, plan.run_ids)
                if not full:
                    for run_id, stage in unrecorded_runs(instance, spec, keys).items():
                        plan.mark_stale(run_id, stage)
            todo = plan.stale
            used, why = parallel_workers(workers, runs=len(todo), cells=plan.grid_cells(todo))
            if why:
                log.warning(f"--workers {workers}: building with {used} worker{'s' if used > 1 else ''}: {why}")
            if used > 1:
                start_step_server()
            if own:
                if used > 1:  # multiprocess execution needs an instance on disk
                    scratch = tempfile.TemporaryDirectory(prefix="aml-instance-")
                    instance = scratch_instance(scratch.name)  # one that captures no compute logs
                else:
                    instance = dg.DagsterInstance.ephemeral()
                keys = sync_run_partitions(instance, spec, plan.run_ids)
            workers = used
            materialized = dict.fromkeys(RUN_ASSETS, 0)
            chunk_runs = config.backfill_runs_per_chunk()
            if workers > 1 and todo:
                chunk_runs = max(1, min(chunk_runs, -(-len(todo) // workers)))
            batches = [([s.asset for s in stages], chunk) for stages, chunk in run_batches(keys, todo, chunk_runs)]
            dataset_keys = [dg.AssetKey([spec.id, n]) for n in DATASET_ASSETS]
            started, started_at = time.perf_counter(), time.time()
            run_stages_s: float | None = None
            if workers == 1 and len(batches) == 1:
                # One chunk: its run stages and the dataset in one Dagster run (the `__build` job).
                [(names, chunk)] = batches
                result = _execute(
                    defs.resolve_job_def(build_job_name(spec.id)), instance, run_config,
                    asset_selection=[*(dg.AssetKey([spec.id, n]) for n in names), *dataset_keys], tags=range_tags(chunk),
                )
                run_stages_s = _run_stages_done(instance, result.run_id, spec.id, started_at)
            else:
                if workers == 1:
                    runs_job = defs.resolve_job_def(runs_job_name(spec.id))
                    chunk_runs_done = [
                        _execute(runs_job, instance, run_config, asset_selection=[dg.AssetKey([spec.id, n]) for n in names],
                                 tags=range_tags(chunk)).run_id
                        for names, chunk in batches
                    ]
                else:
                    chunk_runs_done = execute_parallel(spec, batches, instance, workers, console_log_level,
                                                        tsdb_url=tsdb_url, home=home, datasets_dir=datasets_dir)
                # Up to the end of the last chunk's step, as for the one-chunk build (not the end of
                # its Dagster run, which records the run's end after the step).
                ends = [_run_stages_done(instance, run_id, spec.id, started_at) for run_id in chunk_runs_done]
                run_stages_s = max((e for e in ends if e is not None), default=None)
                result = _execute(defs.resolve_job_def(rebuild_job_name(spec.id)), instance, run_config)
            for names, chunk in batches:
                for n in names:
                    materialized[n] += len(chunk)
            for event in result.get_asset_materialization_events():
                mat = event.materialization
                if mat.asset_key == dg.AssetKey([spec.id, MANIFEST.asset]):
                    summary = dict(mat.metadata["summary"].value)
                    if not summary.get("current"):
                        failed = [name for name, ok in summary["checks"].items() if not ok]
                        raise BuildError(
                            f"spec {spec.id!r}: snapshot {summary['snapshotDir']} failed blocking checks: {', '.join(failed)}",
                            code="CHECK_FAILED",
                        )
                    total = time.perf_counter() - started
                    seconds = {"total": round(total, 3)}
                    if run_stages_s is not None:
                        seconds.update(runStages=round(run_stages_s, 3), dataset=round(total - run_stages_s, 3))
                    return {**summary, "materialized": materialized, "seconds": seconds,
                            "workers": {"asked": asked, "used": used, **({"why": why} if why else {})}}
            raise BuildError(f"spec {spec.id!r}: dataset_manifest was not materialised")
        finally:
            if own and instance is not None:
                instance.dispose()
            if scratch is not None:
                scratch.cleanup()


def _run_stages_done(instance: dg.DagsterInstance, run_id: str, spec_id: str, started_at: float) -> float | None:
    """Seconds from ``started_at`` (wall clock) to the end of the run's run-stage step, or None
    when it had none (nothing to rematerialise), from the step's end event alone
    (:func:`~aml_pipeline.components.dagster_internals.step_end_times`)."""
    ends = step_end_times(instance, run_id, f"{spec_id}__run_stages")
    return round(max(ends) - started_at, 3) if ends else None


def _execute(job: dg.JobDefinition, instance: dg.DagsterInstance, run_config: dict, **kwargs: Any):
    """Run ``job`` in this process, tagged with :func:`build_tags`; a user error becomes the AmlError
    it was (one line, no traceback)."""
    tags = {**build_tags(), **kwargs.pop("tags", {})}
    try:
        with interrupts_not_lost():  # a Ctrl-C Dagster captured and then forgot stops the build here
            return job.execute_in_process(run_config=run_config, instance=instance, tags=tags, **kwargs)
    except dg.DagsterExecutionInterruptedError:
        # Ctrl-C inside a step: Dagster raises its own interruption (not an Exception); the caller
        # sees the KeyboardInterrupt it was.
        raise KeyboardInterrupt from None
    except Exception as e:
        err = user_error(e)
        if err is not None:
            description = failure_description(e)
            if description and description != err.one_line() and err.one_line() in description:
                raise AmlError(description.replace(f"{err.code}: ", "", 1), code=err.code) from e
            raise err from e
        raise
