"""The build's Dagster instance: its failures as one line, runs left behind by a dead build."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from aml_pipeline.components.dagster_internals import report_run_failed
from aml_pipeline.components.schedules import build_job_name, rebuild_job_name, runs_job_name
from aml_pipeline.errors import AmlError
from aml_pipeline.fsutil import process_alive
from aml_pipeline.spec import DatasetSpec


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


def failure_description(exc: BaseException) -> str | None:
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
    for record in instance.get_run_records(filters=dg.RunsFilter(statuses=unfinished, tags={BUILD_HOST_TAG: host})):
        run = record.dagster_run
        pid = run.tags.get(BUILD_PID_TAG, "")
        if run.job_name in jobs and pid.isdigit() and not process_alive(int(pid)):
            report_run_failed(
                instance, run, f"the build that executed this run (process {pid} on {host}) ended before it could record "
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
