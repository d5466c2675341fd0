"""Building one dataset through its Dagster jobs from the command line (``build`` and ``demo``).

The same definitions the UI shows, executed in this process under their named jobs:
``<spec>__runs`` for the run stages, over contiguous ranges of at most
``AML_BACKFILL_RUNS_PER_CHUNK`` partitions (the backfill chunks), then ``<spec>__rebuild`` for the
dataset. Incremental: only runs with a stale stage are materialised, from that stage on, and the
rebuild publishes nothing when nothing changed (:mod:`aml_pipeline.pipeline.incremental`). In an
instance the caller gives (``DAGSTER_HOME``), a run whose partitions it has not recorded is
materialised too, so that what the UI shows is what the snapshot holds.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import dagster as dg

from aml_pipeline import config
from aml_pipeline.defs.datasets import dataset_definitions
from aml_pipeline.defs.partitions import range_tags, run_partitions
from aml_pipeline.defs.resources import StoreResource, TsdbResource
from aml_pipeline.defs.schedules import build_job_name, rebuild_job_name, runs_job_name
from aml_pipeline.defs.shared_env import default_shared_env_resources
from aml_pipeline.defs.sources import tsdb_points
from aml_pipeline.errors import AmlError, BuildError
from aml_pipeline.fsutil import process_alive
from aml_pipeline.pipeline.plan import BuildPlan, run_batches
from aml_pipeline.pipeline.stages import DATASET_ASSETS, RUN_ASSETS, RUN_STAGES, Stage
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb import open_tsdb


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
    recorded = {stage: instance.get_materialized_partitions(dg.AssetKey([spec.id, stage.asset])) for stage in RUN_STAGES}
    out = {}
    for run_id in run_ids:
        stage = next((stage for stage in RUN_STAGES if run_id not in recorded[stage]), None)
        if stage is not None:
            out[run_id] = stage
    return out


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception behind it (Dagster's ``user_exception``, causes, contexts), once each."""
    seen = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend([getattr(e, "user_exception", None), e.__cause__, e.__context__])


def user_error(exc: BaseException) -> AmlError | None:
    """The AmlError behind a Dagster step failure, if a user error caused it."""
    return next((e for e in _exception_chain(exc) if isinstance(e, AmlError)), None)


def _failure_description(exc: BaseException) -> str | None:
    return next((e.description for e in _exception_chain(exc) if isinstance(e, dg.Failure) and e.description), None)


# Which build executes a Dagster run: one that dies before recording a run's end (killed, or its
# instance database stopped answering) leaves the run "started"; the next build on the host finds
# it by these tags and records it as failed, so the UI does not show it running for ever.
BUILD_HOST_TAG, BUILD_PID_TAG = "aml/build_host", "aml/build_pid"


def build_tags() -> dict[str, str]:
    """:data:`BUILD_HOST_TAG` and :data:`BUILD_PID_TAG` of this process, for every run it executes;
    and no retry by the daemon (``run_retries`` in a deployment): it cannot relaunch a run executed
    in this process, while the same build again redoes what the run did not record."""
    return {BUILD_HOST_TAG: socket.gethostname(), BUILD_PID_TAG: str(os.getpid()), "dagster/max_retries": "0"}


def fail_abandoned_runs(instance: dg.DagsterInstance, spec: DatasetSpec) -> None:
    """Record as failed the spec's Dagster runs that a build on this host executed and never
    ended, its process being gone. The runs they did not record, the build materialises again
    (:func:`unrecorded_runs`)."""
    jobs = {build_job_name(spec.id), runs_job_name(spec.id), rebuild_job_name(spec.id)}
    host = socket.gethostname()
    unfinished = [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=unfinished, tags={BUILD_HOST_TAG: host})):
        pid = run.tags.get(BUILD_PID_TAG, "")
        if run.job_name in jobs and pid.isdigit() and not process_alive(int(pid)):
            instance.report_run_failed(
                run, f"the build that executed this run (process {pid} on {host}) ended before it could record "
                     "the run's end; the next build materialised again what this run had not recorded",
            )


@contextmanager
def instance_failures(where: str) -> Iterator[None]:
    """Dagster's storage failing, as one ``INSTANCE_UNAVAILABLE`` line naming the instance
    (``where``) and what its database said; ``INSTANCE_CONFIG_INVALID`` when its settings cannot
    be loaded. Nothing is lost: what the instance recorded stays, and the same build, once the
    instance is back, redoes only the runs it has not recorded."""
    try:
        yield
    except AmlError:
        raise
    except dg.DagsterInvalidConfigError as e:
        # Loading the instance: its dagster.yaml names environment variables (deploy/dagster.yaml).
        unset = sorted(set(re.findall(r'environment variable "(\w+)" which is not set', "\n".join(
            getattr(err, "message", "") for err in e.errors))))
        problem = (f"reads environment variables that are not set: {', '.join(unset)}" if unset
                   else " ".join(str(e).split())[:300])
        raise AmlError(f"the Dagster instance {where}: its dagster.yaml {problem}", code="INSTANCE_CONFIG_INVALID") from None
    except Exception as e:
        # Only the instance's storages go through SQLAlchemy here (a PostgreSQL instance that stopped
        # answering past Dagster's connection retries, SQLite on a full disk): the TSDB adapters and
        # the catalog use their drivers directly.
        import sqlalchemy.exc

        failed = next((f for f in _exception_chain(e) if isinstance(f, sqlalchemy.exc.DBAPIError)), None)
        if failed is None:
            raise
        lines = str(failed.orig if failed.orig is not None else failed).strip().splitlines()
        said = lines[0] if lines else type(failed).__name__
        raise AmlError(
            f"the Dagster instance {where} failed: {said}; the chunks it recorded are kept, and the same "
            "build again, once the instance is back (its database answering, room on its disk), redoes only "
            "the runs it has not recorded",
            code="INSTANCE_UNAVAILABLE",
        ) from e


def dataset_job_definitions(spec: DatasetSpec, resources: dict[str, Any]) -> dg.Definitions:
    """The spec's definitions (as the code location has them) with these resources."""
    return dg.Definitions.merge(
        dataset_definitions(spec),
        dg.Definitions(assets=[tsdb_points], resources={**default_shared_env_resources(), **resources}),
    )


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

    ``workers`` > 1 spreads the run stages over that many processes through Dagster's execution:
    the runs needing work are cut into at least ``workers`` chunks, each a Dagster run of the
    ``<spec>__runs`` job executed by the multiprocess executor (its step in a process Dagster
    forks), ``workers`` of them at a time; a persistent instance is needed for that (a temporary
    one when ``instance`` is not given). The output is byte-identical to ``workers=1``.
    """
    if workers < 1:
        raise AmlError(f"--workers must be >= 1, got {workers}", code="USAGE")
    if workers > 1:
        start_step_server()
    store = StoreResource(home=str(home), datasets_dir=str(datasets_dir) if datasets_dir else None)
    with open_tsdb(tsdb_url) as db:
        plan = BuildPlan.read(db, store.dataset_store(spec), full=full)
    defs = dataset_job_definitions(spec, {"tsdb": TsdbResource(url=tsdb_url), "store": store})
    run_config = {"loggers": {"console": {"config": {"log_level": console_log_level}}}}
    where = "of this build" if instance is None else f"in {instance.root_directory}"
    with build_event_settings(), instance_failures(where):
        own = instance is None
        scratch = None
        if own and workers > 1:
            scratch = tempfile.TemporaryDirectory(prefix="aml-instance-")
            instance = dg.DagsterInstance.local_temp(scratch.name)  # multiprocess execution needs one on disk
        instance = instance or dg.DagsterInstance.ephemeral()
        try:
            if not own:
                fail_abandoned_runs(instance, spec)
            keys = sync_run_partitions(instance, spec, plan.run_ids)
            if not own and not full:
                for run_id, stage in unrecorded_runs(instance, spec, keys).items():
                    plan.mark_stale(run_id, stage)
            todo = plan.stale
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
                    chunk_runs_done = _execute_parallel(spec, batches, instance, workers, console_log_level,
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
                if mat.asset_key == dg.AssetKey([spec.id, "dataset_manifest"]):
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
                    return {**summary, "materialized": materialized, "seconds": seconds}
            raise BuildError(f"spec {spec.id!r}: dataset_manifest was not materialised")
        finally:
            if own:
                instance.dispose()
            if scratch is not None:
                scratch.cleanup()


def _run_stages_done(instance: dg.DagsterInstance, run_id: str, spec_id: str, started_at: float) -> float | None:
    """Seconds from ``started_at`` (wall clock) to the end of the run's run-stage step, or None
    when it had none (nothing to rematerialise).

    From the step's end event alone: Dagster's step statistics (``get_run_step_stats``) read and
    decode every materialisation of the run, plot and table included, to derive them (about
    1 ms a built run through PgBouncer, for a figure the build only reports)."""
    step = f"{spec_id}__run_stages"
    ended = instance.get_records_for_run(
        run_id, of_type={dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE},
    ).records
    ends = [r.event_log_entry.timestamp for r in ended if r.event_log_entry.step_key == step]
    return round(max(ends) - started_at, 3) if ends else None


# Dagster's own switches for a run over a range of partitions, set for this process's builds (and
# the step processes they start); docs/deployment.md sets them for a deployment's run workers.
BUILD_EVENT_SETTINGS = {
    # One "materialisation planned" event per asset instead of one per partition (half of a
    # chunk's events). The cost: partitions of a failed chunk show as missing rather than failed
    # in the UI, while the run itself shows the failure.
    "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS": "true",
    # A step's per-partition materialisations of one asset are written to the instance in one
    # batch (PostgreSQL: one connection and one insert per batch instead of per event; SQLite
    # storage writes them one by one either way).
    "DAGSTER_EVENT_BATCH_SIZE": "1000",
}


# What a run step reads from the environment besides what its job is built with (the per-run
# plot, the memory budget, Dagster's event switches). A --workers step process forks from the step
# server, whose environment is the one it started with: possibly before this build's settings
# (another build may have started it), so the build hands them over with the job.
STEP_SETTINGS = ("AML_MEMORY_MB", "AML_RUN_PLOTS", *BUILD_EVENT_SETTINGS)


def step_settings() -> str:
    """:data:`STEP_SETTINGS` as this process has them now, for :func:`reconstruct_runs_job` (JSON)."""
    return json.dumps({name: os.environ[name] for name in STEP_SETTINGS if name in os.environ}, sort_keys=True)


@contextmanager
def build_event_settings() -> Iterator[None]:
    """:data:`BUILD_EVENT_SETTINGS` in the environment for the duration (a value already set wins)."""
    before = {name: os.environ.get(name) for name in BUILD_EVENT_SETTINGS}
    for name, value in BUILD_EVENT_SETTINGS.items():
        os.environ[name] = before[name] or value
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)


STEP_PRELOAD_MODULES = [
    "dagster",
    "aml_pipeline.defs.inprocess",
    "aml_pipeline.tsdb.duckdb",
    "aml_pipeline.pipeline.plots",
    "matplotlib.backends.backend_agg",
    "matplotlib.figure",
    "matplotlib.lines",
    "matplotlib.patches",
    "PIL.ImageFont",
    "sqlalchemy",  # the instance's storage, opened by every step process
    # Dagster's SQL storages (SQLite and PostgreSQL alike) come with it: imported on first use,
    # they took 0.4 s of every step process's start (measured: instance from its ref 0.46 s cold,
    # 0.09 s preloaded). Part of the deploy extra; without it the forkserver skips the name and
    # each step imports them itself.
    "dagster_postgres",
    "alembic.command",
    "alembic.config",
    "alembic.runtime.environment",
]


def start_step_server() -> None:
    """Start the forkserver the step processes of ``--workers`` fork from, now.

    Its imports (:data:`STEP_PRELOAD_MODULES`, about 2.5 s here) then overlap the build's own
    planning (TSDB listing, stale runs, the chunk runs' creation) instead of delaying the first
    step. It is the server Dagster's multiprocess executor uses (one per process); one already
    running is kept.
    """
    multiprocessing.get_context("forkserver").set_forkserver_preload(STEP_PRELOAD_MODULES)
    multiprocessing.forkserver.ensure_running()


@lru_cache(maxsize=4)
def reconstruct_runs_job(spec_json: str, tsdb_url: str, home: str, datasets_dir: str | None, settings: str,
                         build_id: str) -> dg.JobDefinition:
    """The ``<spec>__runs`` job, rebuilt in a process Dagster starts for a step (``--workers``),
    with the build's :data:`STEP_SETTINGS` (``settings``, from :func:`step_settings`) in that
    process's environment.

    Cached per build (``build_id``): Dagster rebuilds the job about ten times per chunk run while
    it plans and launches it (25 ms each, in the process driving the chunks), while the next build
    may see other settings (the definitions read the environment).
    """
    given = json.loads(settings)
    for name in STEP_SETTINGS:
        if name in given:
            os.environ[name] = given[name]
        else:
            os.environ.pop(name, None)
    spec = parse_spec(json.loads(spec_json), source="build")
    store = StoreResource(home=home, datasets_dir=datasets_dir)
    defs = dataset_job_definitions(spec, {"tsdb": TsdbResource(url=tsdb_url), "store": store})
    return defs.resolve_job_def(runs_job_name(spec.id))


def _execute_parallel(
    spec: DatasetSpec,
    batches: list[tuple[list[str], list[str]]],
    instance: dg.DagsterInstance,
    workers: int,
    console_log_level: str,
    *,
    tsdb_url: str,
    home: Path,
    datasets_dir: Path | None,
) -> list[str]:
    """Execute the chunk runs, ``workers`` at a time, each by Dagster's multiprocess executor;
    return their run ids."""
    job = dg.build_reconstructable_job(
        __name__,
        "reconstruct_runs_job",
        reconstructable_args=(
            json.dumps(spec.to_json_dict() | {"schedule": spec.schedule}),
            tsdb_url,
            str(home),
            None if datasets_dir is None else str(datasets_dir),
            step_settings(),
            uuid.uuid4().hex,
        ),
    )
    run_config = {
        "loggers": {"console": {"config": {"log_level": console_log_level}}},
        # forkserver with the project and what a step imports on first use preloaded: a step's
        # process starts in a fraction of a second instead of importing them again (measured:
        # about 1 s per step process for pandas, pyarrow and matplotlib alone).
        "execution": {"config": {"multiprocess": {
            "max_concurrent": 1,
            "start_method": {"forkserver": {"preload_modules": STEP_PRELOAD_MODULES}},
        }}},
    }

    # The chunk runs are driven from threads; Dagster configures Python logging from the
    # instance's settings at every run start (logging.config.dictConfig), which deadlocks against
    # another thread's run logging at the same moment. The runs therefore go through the same
    # storage without the instance's settings (its telemetry switch, pool limits, python_logs);
    # the steps' processes get that instance too. docs/operations.md says what shows of it.
    quiet = dg.DagsterInstance.from_ref(instance.get_ref()._replace(settings={}))

    def one(batch: tuple[list[str], list[str]]) -> str:
        names, chunk = batch
        result = dg.execute_job(
            job, quiet, run_config=run_config, tags={**build_tags(), **range_tags(chunk)},
            asset_selection=[dg.AssetKey([spec.id, n]) for n in names],
        )
        if not result.success:
            failures = [e for e in result.all_events if e.is_step_failure]
            data = failures[0].step_failure_data if failures else None
            if data and data.error and data.error.cls_name == "ChildProcessCrashException":
                raise AmlError(
                    f"the step process building runs {chunk[0]} .. {chunk[-1]} ({len(chunk)} runs, Dagster run "
                    f"{result.run_id[:8]}) {_how_it_ended(result.all_events)}; the runs of chunks that finished are "
                    "recorded, and the same build again redoes only what is missing",
                    code="WORKER_LOST",
                )
            description = data.user_failure_data.description if data and data.user_failure_data else None
            message = description or (data.error.message.strip() if data and data.error else "the run failed")
            code = message.split(":", 1)[0] if message[:1].isupper() and ":" in message else "BUILD_FAILED"
            raise AmlError(message.split(": ", 1)[1] if code != "BUILD_FAILED" else message, code=code)
        return result.run_id

    # Threads only wait for Dagster: each chunk run's step runs in its own process. The first
    # failure stops chunks that have not started; those running finish (and are recorded).
    pool = ThreadPoolExecutor(workers, thread_name_prefix="chunk-run")
    try:
        return [future.result() for future in as_completed([pool.submit(one, b) for b in batches])]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        quiet.dispose()


def _how_it_ended(events: list[dg.DagsterEvent]) -> str:
    """How a step's process ended, from the multiprocess executor's engine event about it
    (e.g. "was terminated by signal 9 (SIGKILL)")."""
    for event in events:
        message = event.message or ""
        found = re.search(r"child process for step \S+ (was terminated by signal \d+ \(\w+\)|unexpectedly exited with code -?\d+)", message)
        if found:
            return found.group(1)
    return "died before it finished"


def _execute(job: dg.JobDefinition, instance: dg.DagsterInstance, run_config: dict, **kwargs: Any):
    """Run ``job`` in this process, tagged with :func:`build_tags`; a user error becomes the AmlError
    it was (one line, no traceback)."""
    tags = {**build_tags(), **kwargs.pop("tags", {})}
    try:
        return job.execute_in_process(run_config=run_config, instance=instance, tags=tags, **kwargs)
    except Exception as e:
        err = user_error(e)
        if err is not None:
            description = _failure_description(e)
            if description and description != err.one_line() and err.one_line() in description:
                raise AmlError(description.replace(f"{err.code}: ", "", 1), code=err.code) from e
            raise err from e
        raise
