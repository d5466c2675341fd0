"""A run's stages back to back: fetch -> clean and align -> windows, runs overlapped.

Each stage (:mod:`aml_pipeline.pipeline.stages`) reads its input from the store (or the TSDB) piece
by piece and appends its result to the store, returning a small summary; memory is bounded by the
chunk sizes (:mod:`aml_pipeline.pipeline.chunks`), not by a run's length. A run small enough to
be read and cleaned whole is passed from stage to stage in memory as well as stored (its raw
points to the cleaning, its grid to the windows), so the stages after the fetch do not read back
what the one before just wrote; the stored bytes are the same either way. The run-stage assets
and the CLI's build (and the tests' library build) all go through :func:`build_runs`.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from aml_pipeline.pipeline.registry import GRID, RAW, WINDOWS

from aml_pipeline.pipeline.stages.base import Stage
from aml_pipeline.pipeline.stages.grid import GridSummary, clean_run
from aml_pipeline.pipeline.stages.raw import RawSummary
from aml_pipeline.pipeline.stages.windows import WindowsSummary, window_run
from aml_pipeline.pipeline.store import DatasetStore


@dataclass
class RunResult:
    """What one run's stages produced (None: not built), or the error that stopped the run."""

    run_id: str
    raw: RawSummary | None = None
    grid: GridSummary | None = None
    windows: WindowsSummary | None = None
    error: Exception | None = None


# Runs cleaned and windowed at once. Their numpy work releases the GIL, so two runs (and the
# fetch thread) share two cores; each run's stages write its own files, so the bytes are the same.
RUN_THREADS = max(1, min(2, os.cpu_count() or 1))
# Runs the fetch thread may read beyond those in flight. A read that serves several runs (the
# TSDB's read-ahead, :data:`~aml_pipeline.pipeline.stages.raw.READ_AHEAD_RUNS`) takes as long as
# a few runs' cleaning: started only when its first run is admitted, the run threads would wait
# for it. The runs read ahead are views of at most the TSDB's current read and the one before.
FETCH_AHEAD = 4


def build_runs(
    store: DatasetStore,
    work: Sequence[tuple[str, Sequence[Stage]]],
    fetch: Callable[[str], RawSummary] | None,
    *,
    then: Callable[[RunResult], Any] | None = None,
) -> Iterator[Any]:
    """Each run of ``work`` (run id, stages to build) through its stages, yielding what it
    produced in ``work``'s order; a run that fails yields its error and the next run goes on.
    ``then`` (given the run's :class:`RunResult`, in the run's own thread) makes what is yielded
    instead: work on a run's result that would hold up the consumer (its figures and plot), done
    beside the other runs instead of between taking one result and the next, which is when
    the next run is admitted.

    ``fetch`` (the raw stage of one run, from the TSDB) runs in a thread of its own, ahead of the
    cleaning: fetches run one at a time, in run order, so the TSDB handle is never used by two
    threads at once. A fetch with a ``read`` method (:class:`~aml_pipeline.pipeline.stages.raw.RunFetcher`)
    only reads there; the run's own thread writes what it read. The later stages of up to :data:`RUN_THREADS` runs run at once in a pool (the
    database and numpy release the GIL); at most ``RUN_THREADS + 1`` runs are in flight, and the
    fetch thread reads up to :data:`FETCH_AHEAD` runs beyond them.
    """
    work = list(work)
    if fetch is None and any(RAW in stages for _, stages in work):
        raise ValueError("build_runs: a run needs its raw stage, but no fetch was given")
    fetch_pool = ThreadPoolExecutor(1, thread_name_prefix="fetch")
    run_pool = ThreadPoolExecutor(RUN_THREADS, thread_name_prefix="run-stages")

    # A fetch that can read without writing (stages.raw.RunFetcher) reads in the fetch thread and
    # leaves the raw stage's writing and hashing to the run's thread: the thread that holds the
    # TSDB handle is the one every run waits on, so it only reads.
    read = getattr(fetch, "read", None) or fetch

    def process(run_id: str, stages: Sequence[Stage], fetched: Future[Any] | None) -> RunResult:
        result = RunResult(run_id)
        try:
            held = None
            if fetched is not None:
                raw = fetched.result()
                result.raw = raw if isinstance(raw, RawSummary) else raw.write()
                # The cleaning takes the points it would read back from what was just written.
                held = None if isinstance(raw, RawSummary) else raw.columns
            grid: list[Any] = []  # the grid the cleaning holds, which the windows stage would read back
            if GRID in stages:
                result.grid = clean_run(store, run_id, raw_columns=held, on_grid=grid.append)
            if WINDOWS in stages:
                result.windows = window_run(store, run_id, grid=grid[0] if grid else None)
        except Exception as e:  # noqa: BLE001 - reported per run; the caller decides what it stops
            result.error = e
        return result if then is None else then(result)

    pending: deque[Future[RunResult]] = deque()
    fetches: dict[int, Future[Any]] = {}  # run index -> its fetch, submitted ahead of the run
    admitted = fetched_to = 0

    def admit() -> None:
        nonlocal admitted, fetched_to
        # The fetch thread reads in run order, up to FETCH_AHEAD runs beyond those in flight.
        while fetched_to < min(len(work), admitted + 1 + FETCH_AHEAD):
            run_id, stages = work[fetched_to]
            if RAW in stages:
                fetches[fetched_to] = fetch_pool.submit(read, run_id)
            fetched_to += 1
        run_id, stages = work[admitted]
        pending.append(run_pool.submit(process, run_id, stages, fetches.pop(admitted, None)))
        admitted += 1

    try:
        while admitted < len(work) and len(pending) <= RUN_THREADS:
            admit()
        while pending:
            result = pending.popleft().result()
            if admitted < len(work):
                admit()
            yield result
    finally:
        run_pool.shutdown(wait=True, cancel_futures=True)
        fetch_pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class RunOutcome:
    """One run of a chunk as the Dagster step records it: per stage built, its figures and data
    version; or the error that stopped the run (the stages built before it are kept)."""

    run_id: str
    figures: dict[Stage, dict[str, Any]] = field(default_factory=dict)
    data_versions: dict[Stage, str] = field(default_factory=dict)
    windows: WindowsSummary | None = None
    error: BaseException | None = None

    def line(self) -> str:
        """The run in one progress line."""
        parts = []
        if (raw := self.figures.get(RAW)) is not None:
            parts.append(f"{raw['points']} points")
        if (grid := self.figures.get(GRID)) is not None:
            parts.append(f"{grid['grid_rows']} grid rows, {grid['points_removed']} points removed")
        if (win := self.figures.get(WINDOWS)) is not None:
            parts.append(f"{win['windows']} windows" + (f" ({win['reason']})" if win["reason"] else ""))
        return "; ".join(parts)


def run_outcomes(
    store: DatasetStore,
    work: Sequence[tuple[str, Sequence[Stage]]],
    fetch: Callable[[str], RawSummary] | None,
    *,
    plot: bool,
) -> Iterator[RunOutcome]:
    """:func:`build_runs`, with each built stage's figures (its plot too when ``plot``), made in
    the run's thread; a run whose figures fail is a failed run like one whose stage failed."""

    def outcome_of(result: RunResult) -> RunOutcome:
        outcome = RunOutcome(result.run_id, windows=result.windows, error=result.error)
        try:
            for stage, summary in ((RAW, result.raw), (GRID, result.grid), (WINDOWS, result.windows)):
                if summary is not None:
                    outcome.figures[stage] = summary.figures(store, plot=plot)
                    outcome.data_versions[stage] = summary.data_version
        except Exception as e:  # noqa: BLE001 - one run's failure must not lose the others
            outcome.error = outcome.error or e
        return outcome

    with closing(build_runs(store, work, fetch, then=outcome_of)) as outcomes:
        yield from outcomes


# Progress lines per chunk of runs, at most (plus one per failed run): each is an event in the
# run's log, while every run's figures are in its partitions' metadata.
PROGRESS_LINES = 10


def progress_line_due(i: int, runs: int) -> bool:
    """Whether a progress line is due after the ``i``-th run (1-based) of ``runs``: every
    ``ceil(runs / PROGRESS_LINES)``-th run and the last, so at most :data:`PROGRESS_LINES` lines."""
    return i == runs or i % -(-runs // PROGRESS_LINES) == 0
