"""``--workers N``: the chunk runs of a build, N at a time, each step in a process of its own."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import re
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import lru_cache
from pathlib import Path

import dagster as dg

from aml_pipeline import config
from aml_pipeline.components.dagster_internals import BUILD_EVENT_SETTINGS, instance_without_settings
from aml_pipeline.components.resources import StoreResource, TsdbResource
from aml_pipeline.components.partitions import range_tags
from aml_pipeline.components.schedules import runs_job_name
from aml_pipeline.errors import AmlError
from aml_pipeline.runner.instance import build_tags
from aml_pipeline.runner.jobs import dataset_job_definitions
from aml_pipeline.spec import DatasetSpec, parse_spec


# What a run step reads from the environment besides what its job is built with (the per-run
# plot, the memory budget, Dagster's event switches). A --workers step process forks from the step
# server, whose environment is the one it started with: possibly before this build's settings
# (another build may have started it), so the build hands them over with the job.
STEP_SETTINGS = ("AML_MEMORY_MB", "AML_RUN_PLOTS", *BUILD_EVENT_SETTINGS)


def step_settings() -> str:
    """:data:`STEP_SETTINGS` as this process has them now, for :func:`reconstruct_runs_job` (JSON)."""
    return json.dumps({name: os.environ[name] for name in STEP_SETTINGS if name in os.environ}, sort_keys=True)


# The work (grid rows times nodes of the runs to build) each worker beyond the first must have
# for its chunk runs to save more than starting them costs (the chunk runs' creation and step
# processes, their events written side by side); bench/run.py's ``parallel`` part measures both
# sides on the standard workload. AML_PARALLEL_MIN_CELLS overrides it for another host.
DEFAULT_MIN_CELLS_PER_WORKER = 10_000_000


def parallel_workers(asked: int, *, runs: int, cells: int) -> tuple[int, str | None]:
    """How many workers a build uses for ``runs`` runs of ``cells`` grid cells when ``asked`` for
    some, and why fewer (None: as asked). More workers than cores, or than runs, cannot help;
    nor can a worker whose share of the work is smaller than what starting it costs."""
    if asked <= 1:
        return 1, None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    min_cells = config.whole_number_env("AML_PARALLEL_MIN_CELLS", DEFAULT_MIN_CELLS_PER_WORKER, minimum=0,
                                        unit="a whole number of grid cells")
    used, reasons = asked, []
    if cores < used:
        used = cores
        reasons.append(f"this host has {cores} core{'s' if cores > 1 else ''}")
    if runs < used:
        used = max(1, runs)
        reasons.append(f"{runs} run{'s' if runs != 1 else ''} to build")
    by_work = 1 + cells // min_cells if min_cells else used
    if by_work < used:
        used = by_work
        reasons.append(
            f"{cells / 1e6:.1f} M grid cells to build, under {min_cells / 1e6:g} M per extra worker, where starting "
            "parallel chunk runs costs more than they save (AML_PARALLEL_MIN_CELLS)"
        )
    return used, ("; ".join(reasons) if used < asked else None)


STEP_PRELOAD_MODULES = [
    "dagster",
    "aml_pipeline.runner.parallel",
    "aml_pipeline.tsdb.duckdb",
    "aml_pipeline.pipeline.plots",
    "matplotlib.backends.backend_agg",
    "matplotlib.figure",
    "matplotlib.lines",
    "matplotlib.patches",
    "PIL.ImageFont",
    "sqlalchemy",  # the instance's storage, opened by every step process
    # Dagster's SQL storages (SQLite and PostgreSQL alike) come with it: imported on first use,
    # they are most of a step process's start. Part of the deploy extra; without it the
    # forkserver skips the name and each step imports them itself.
    "dagster_postgres",
    "alembic.command",
    "alembic.config",
    "alembic.runtime.environment",
]


def start_step_server() -> None:
    """Start the forkserver the step processes of ``--workers`` fork from, now.

    Its imports (:data:`STEP_PRELOAD_MODULES`, seconds) then overlap the build's own
    planning (TSDB listing, stale runs, the chunk runs' creation) instead of delaying the first
    step. It is the server Dagster's multiprocess executor uses (one per process); one already
    running is kept.
    """
    multiprocessing.get_context("forkserver").set_forkserver_preload(STEP_PRELOAD_MODULES)
    if threading.current_thread() is not threading.main_thread():
        multiprocessing.forkserver.ensure_running()
        return
    # Started with Ctrl-C ignored, which the server keeps while it imports (a Ctrl-C there printed
    # its import's traceback); its step processes still stop on Ctrl-C: Dagster's step installs
    # its own handler.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


@lru_cache(maxsize=4)
def reconstruct_runs_job(spec_json: str, tsdb_url: str, home: str, datasets_dir: str | None, settings: str,
                         build_id: str) -> dg.JobDefinition:
    """The ``<spec>__runs`` job, rebuilt in a process Dagster starts for a step (``--workers``),
    with the build's :data:`STEP_SETTINGS` (``settings``, from :func:`step_settings`) in that
    process's environment.

    Cached per build (``build_id``): Dagster rebuilds the job several times per chunk run while
    it plans and launches it, in the process driving the chunks, while the next build may see
    other settings (the definitions read the environment).
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


def execute_parallel(
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
        "aml_pipeline.runner.parallel",
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
        # process starts without importing pandas, pyarrow, matplotlib and the rest again.
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
    quiet = instance_without_settings(instance)

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
