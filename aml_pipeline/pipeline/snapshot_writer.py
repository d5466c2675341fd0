"""Writing a snapshot: every artifact into a staging directory, hashed and fsynced as it goes.

The manifest stage (:mod:`aml_pipeline.pipeline.stages.manifest`) calls :func:`write_snapshot_files`
and then checks and publishes what it wrote. Runs are streamed from the store one fixed grid block
at a time (:class:`~aml_pipeline.pipeline.stages.windows.RunWindows`), so memory is bounded by a
block, not by a run or by the dataset; hashing and fsync run in background threads beside the
gathering.

Both layouts normalise the same grid rows with the same operations (:func:`apply_norm` on whole
rows): the windows layout cuts every window from them (:func:`window_blocks`), the series layout
writes each row windows read once and the window index (:func:`write_series_files`, sized by
:class:`SeriesPlan`), so its windows, cut on read, are the windows layout's bytes. The windows
layout reads the runs once per array file, the report once more beside them; the series layout
reads each grid block once, for all its files and the report.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.core.clean import CLEAN_CAUSES
from aml_pipeline.core.hashing import BackgroundSnapshotHasher
from aml_pipeline.core.manifest import build_manifest, build_sidecar, series_manifest, to_json_bytes
from aml_pipeline.core.normalize import apply_norm
from aml_pipeline.core.series import RunIndexer, covered_spans
from aml_pipeline.core.stats import LagCorrelation, NodeSummary, lag_pair_batches
from aml_pipeline.core.windows import window_block
from aml_pipeline.errors import BuildError
from aml_pipeline.faults import crash_point
from aml_pipeline.pipeline.stages.grid import node_ranges
from aml_pipeline.pipeline.stages.norm import Normalization
from aml_pipeline.pipeline.stages.split import DatasetPlan
from aml_pipeline.pipeline.stages.windows import Columns, RunWindows
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.snapshot.layout import (
    ARRAYS,
    MANIFEST_FILE,
    SEGMENT_FIELDS,
    SERIES_ARRAYS,
    SERIES_LAYOUT,
    SIDECAR_FILE,
    SPEC_FILE,
)
from aml_pipeline.spec import DatasetSpec


@dataclass
class SnapshotFiles:
    """A finished snapshot in its staging directory, with its hash (fsynced once
    ``wait_durable()`` returned)."""

    staging: Path
    manifest: dict[str, Any]
    sha256: str
    files: dict[str, str]
    report: dict[str, Any] = field(default_factory=dict)
    # Returns once every file is fsynced (already true unless written with wait_durable=False).
    wait_durable: Callable[[], None] = lambda: None


# Runs whose report contributions are computed at once, beside the arrays being written.
REPORT_THREADS = max(1, min(2, os.cpu_count() or 1))
# Windows per gathered block: the write holds a few MB per array kind whatever a run's length.
_BLOCK_BYTES = 16 << 20
# Written-but-unsynced bytes after which the syncer starts flushing the file being written, so
# the disk works while the next blocks are gathered rather than all at the final fsync.
_FLUSH_BYTES = 64 << 20


def window_blocks(
    kind: str, run: RunWindows, spec: DatasetSpec, cols: Columns, norm: Normalization
) -> Iterator[np.ndarray]:
    """The run's windows of one array kind, in order, in blocks of at most ``_BLOCK_BYTES``.

    This is how the snapshot's windows are made: per fixed grid block, x/u/y are normalised on the
    block's rows once (each grid row is normalised once per block that reads it, not once per
    window that uses it), then cut into windows.
    """
    H, F = spec.history_steps, spec.horizon_steps
    beat = spec.beat_ms
    for block in run.window_blocks(H, F):
        rel = block.starts - block.first_row
        if kind == "x":
            values, lo, hi = apply_norm(block.rows, norm.x.mean, norm.x.std), -H, 0
        elif kind == "u":
            values, lo, hi = apply_norm(block.rows[:, cols.controls], norm.u.mean, norm.u.std), 0, F
        elif kind == "y":
            values, lo, hi = apply_norm(block.rows[:, cols.targets], norm.y.mean, norm.y.std), 0, F
        elif kind == "timestamps":
            first = run.first_ms + beat * block.first_row
            ts = first + beat * np.arange(block.rows.shape[0], dtype=np.int64)
            values, lo, hi = ts.astype(np.float64)[:, None], -H, F
        elif kind == "mask":
            values, lo, hi = None, -H, F
        else:
            raise ValueError(f"unknown array kind {kind!r}")
        width = 1 if values is None else values.shape[1]
        itemsize = 4 if values is None else values.dtype.itemsize
        step = max(1, _BLOCK_BYTES // max(1, (hi - lo) * width * itemsize))
        for i in range(0, rel.shape[0], step):
            chunk = rel[i : i + step]
            if values is None:
                # Windows with a gap are dropped, so every kept step is an observed grid value.
                yield np.ones((chunk.shape[0], H + F), dtype=np.float32)
            else:
                out = window_block(values, chunk, lo, hi)
                yield out[:, :, 0] if kind == "timestamps" else out


@dataclass
class SeriesPlan:
    """The series layout's sizes, from the runs' window starts alone (no grid row is read):
    per run, in snapshot order, its stored history rows, future rows and segments."""

    spec: DatasetSpec
    runs: list[tuple[str, int, int, int]]  # (run id, history rows, future rows, segments)

    @classmethod
    def of(cls, store: DatasetStore, plan: DatasetPlan) -> SeriesPlan:
        spec = store.spec
        runs = []
        for run_id in (r for _, r in plan.ordered_runs()):
            indexer = RunIndexer(spec.history_steps, spec.horizon_steps, spec.stride)
            for starts in _starts_slices(RunWindows(store, run_id, plan.runs[run_id])):
                indexer.feed(starts)
            runs.append((run_id, indexer.x_rows, indexer.future_rows, indexer.segments))
        return cls(spec, runs)

    @property
    def x_rows(self) -> int:
        return sum(r[1] for r in self.runs)

    @property
    def future_rows(self) -> int:
        return sum(r[2] for r in self.runs)

    @property
    def segments(self) -> int:
        return sum(r[3] for r in self.runs)


def write_series_files(
    files: StagedFiles,
    store: DatasetStore,
    plan: DatasetPlan,
    norm: Normalization,
    series: SeriesPlan,
    report: _ReportFeed | None = None,
) -> dict[str, int]:
    """The series layout's row files and window index, in one pass over the runs.

    Each fixed grid block of a run is read once: its rows some window reads as history go to
    ``x_rows`` (all nodes, ``norm.x``), its rows some window reads as future to ``u_rows``
    (controls, ``norm.u``) and ``y_rows`` (targets, ``norm.y``), normalised as
    :func:`window_blocks` normalises them; its window starts give the segments of
    ``segments.i64`` (one field per row, each value written at its place, the sizes being
    :class:`SeriesPlan`'s); and ``report``, if given, takes the block for report.json. Returns
    the rows written per row file (linked files are not written).
    """
    spec = store.spec
    cols = Columns.of(spec)
    H, F = spec.history_steps, spec.horizon_steps
    names = {key: SERIES_ARRAYS[key] for key in ("xRows", "uRows", "yRows", "segments")}
    K = series.segments

    def fill(outs: Mapping[str, _Output]) -> None:
        x, u, y, seg = (outs.get(names[key][0]) for key in names)
        if seg is not None:
            seg.truncate(len(SEGMENT_FIELDS) * K * 8)
        k = window = x_base = f_base = 0
        for position, (run_id, x_rows, future_rows, segments) in enumerate(series.runs):
            run = RunWindows(store, run_id, plan.runs[run_id])
            indexer = RunIndexer(H, F, spec.stride)
            if report is not None:
                report.start_run(run_id)
            reader = run.starts()
            for r0, r1 in run.blocks():
                # The windows that read a row of r0..r1-1: history t in r0+1..r1+H-1, future t in
                # r0-F+1..r1-1; those starting in r0..r1-1 are the block's entries of the index.
                starts = reader.between(r0 - F + 1, r1 + H)
                rows = None
                if report is not None or x is not None or u is not None or y is not None:
                    rows = run.grid_rows(r0, r1)
                if report is not None:
                    report.block(r0, rows)
                if x is not None:
                    kept = _stretches(rows, *covered_spans(starts, r0, r1 - r0, -H, 0))
                    if kept is not None:
                        x.append(apply_norm(kept, norm.x.mean, norm.x.std))
                if u is not None or y is not None:
                    future = _stretches(rows, *covered_spans(starts, r0, r1 - r0, 0, F))
                    if future is not None:
                        if u is not None:
                            u.append(apply_norm(future[:, cols.controls], norm.u.mean, norm.u.std))
                        if y is not None:
                            y.append(apply_norm(future[:, cols.targets], norm.y.mean, norm.y.std))
                if seg is not None:
                    own = starts[np.searchsorted(starts, r0) : np.searchsorted(starts, r1)]
                    if not own.size:
                        continue
                    block = indexer.feed(own)
                    new = np.flatnonzero(block.new_segment)
                    first = block.starts[new]
                    fields = (
                        np.full(new.size, position, dtype=np.int64),
                        window + new,
                        first,
                        run.first_ms + spec.beat_ms * first,
                        x_base + block.x_row[new],
                        f_base + block.future_row[new],
                    )
                    for i, values in enumerate(fields):
                        seg.pwrite(np.ascontiguousarray(values, dtype="<i8"), (i * K + k) * 8)
                    k += new.size
                    window += block.starts.size
            if seg is not None and (indexer.x_rows, indexer.future_rows, indexer.segments) != (
                x_rows, future_rows, segments
            ):
                raise BuildError(f"spec {spec.id!r}: run {run_id}'s stored windows changed while the snapshot was written")
            x_base, f_base = x_base + x_rows, f_base + future_rows
        if seg is not None and k != K:
            raise BuildError(f"spec {spec.id!r}: stored windows changed while writing the window index ({k} of {K} segments)")

    written = files.write_together([names[key] for key in names], fill)
    return {key: written[name] for key, (name, _) in names.items() if key != "segments" and name in written}


def _stretches(rows: np.ndarray, begin: np.ndarray, end: np.ndarray) -> np.ndarray | None:
    """The rows ``begin[i] .. end[i] - 1`` of every stretch, in order (None: no stretch): a view
    when there is one stretch, as in a run without gaps, else gathered by index."""
    if begin.size == 0:
        return None
    if begin.size == 1:
        return rows[int(begin[0]) : int(end[0])]
    lengths = end - begin
    # Row i of the result is row i + (begin[k] - rows before stretch k) of its stretch k.
    shift = np.repeat(begin - (np.cumsum(lengths) - lengths), lengths)
    return rows.take(np.arange(shift.size) + shift, axis=0)


def _starts_slices(run: RunWindows) -> Iterator[np.ndarray]:
    """A run's window starts, ascending, a slice of ``starts.npy`` at a time."""
    reader = run.starts()
    for r0, r1 in run.blocks():
        found = reader.between(r0, r1)
        if found.size:
            yield found


def _pwrite_all(f: Any, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwrite(f.fileno(), data[done:], offset + done)


def _write_all(f: Any, data: memoryview) -> None:
    """``f.write`` until every byte is written (a raw write may be partial)."""
    while data:
        n = f.write(data)
        data = data[n:]


class _Syncer:
    """fsync in a background thread: early flushes of a file still being written, then its
    final fsync and close. :meth:`wait` returns once every file handed over is durable."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        self._flush_pending = threading.Event()
        self._thread = threading.Thread(target=self._run, name="snapshot-fsync", daemon=True)
        self._thread.start()
        self._done = False

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            op, f = item
            try:
                if op == "flush":
                    if not self._errors and not f.closed:
                        os.fdatasync(f.fileno())
                else:
                    try:
                        if not self._errors:
                            os.fsync(f.fileno())
                    finally:
                        f.close()
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self._errors.append(e)
            finally:
                if op == "flush":
                    self._flush_pending.clear()

    def flush(self, f: Any) -> None:
        """Start writing ``f``'s dirty pages to disk (skipped while a flush is still running)."""
        if not self._flush_pending.is_set():
            self._flush_pending.set()
            self._queue.put(("flush", f))

    def close(self, f: Any) -> None:
        """fsync and close ``f`` (the caller no longer writes to it)."""
        self._queue.put(("close", f))

    def wait(self) -> None:
        if not self._done:
            self._done = True
            self._queue.put(None)
            self._thread.join()
        if self._errors:
            raise self._errors[0]


def array_name(kind: str) -> str:
    """The snapshot file of an array kind (``x`` -> ``arrays/x.f32``)."""
    return ARRAYS[kind][0]


def write_snapshot_files(
    store: DatasetStore,
    plan: DatasetPlan,
    norm: Normalization,
    staging: Path,
    *,
    availability_watermark: int | None,
    captured_at: str,
    wait_durable: bool = True,
    linked: Mapping[str, Path] | None = None,
) -> SnapshotFiles:
    """Write every artifact of the snapshot into ``staging`` (fsynced), hashing as it goes.

    The spec's ``layout`` chooses the files: the windows layout's x/u/y (v2: timestamps, mask)
    or the series layout's rows and window index. ``linked`` names array files that an earlier
    snapshot already holds with identical bytes: they are hard-linked from there instead of
    gathered and written again, and hashed by reading them.

    The runs are read in snapshot order, once per array file (windows layout) or once for all
    of them (series layout); memory is bounded by a few grid blocks plus a few written blocks. Hashing (the snapshot hash and the per-file digests) and
    fsync run in background threads, so gathering, hashing and the disk work at the same time.
    With ``wait_durable=False`` it returns once every byte is written (closed) and hashed, while
    the last fsyncs may still run: call ``wait_durable()`` on the result before publishing.
    """
    spec = store.spec
    (staging / "arrays").mkdir(parents=True, exist_ok=False)
    cols = Columns.of(spec)
    spec_json = spec.to_json_bytes()
    extras = None if spec.extras is None else spec.extras.model_dump(mode="json", by_alias=True)
    watermark = availability_watermark
    if extras is not None and extras.get("availabilityWatermark") is not None:
        watermark = extras["availabilityWatermark"]
    manifest = build_manifest(
        spec.to_json_dict(),
        node_ids=spec.node_ids,
        control_ids=spec.control_ids,
        target_ids=spec.target_ids,
        history=spec.history_steps,
        horizon=spec.horizon_steps,
        beat_ms=spec.beat_ms,
        split=plan.split,
        norm=norm.to_json(spec),
        lineage=plan.lineage,
        extras=extras,
        availability_watermark=watermark,
        captured_at=captured_at,
        node_ranges=node_ranges(store, [r for _, r in plan.ordered_runs()]) if spec.causal else None,
    )
    series = SeriesPlan.of(store, plan) if spec.layout == SERIES_LAYOUT else None
    if series is not None:
        manifest = series_manifest(manifest, stride=spec.stride, x_rows=series.x_rows,
                                   future_rows=series.future_rows, segments=series.segments)
    with ExitStack() as stack, StagedFiles(staging, spec_json, linked) as files:
        files.write(MANIFEST_FILE, to_json_bytes(manifest))
        run_order = [r for _, r in plan.ordered_runs()]
        report = _ReportBuilder(spec, cols)

        # The report's contributions are computed in threads beside the arrays being gathered and
        # written (its FFTs and the writes release the GIL), REPORT_THREADS at a time, and merged
        # in snapshot order, so it is the same report, run by run and block by block.
        report_pool = stack.enter_context(ThreadPoolExecutor(REPORT_THREADS, thread_name_prefix="snapshot-report"))

        if series is None:
            # The windows layout reads each array kind in its own pass: the report reads the runs
            # on its own, beside them.
            def build_report() -> dict[str, Any]:
                def batches(run_id: str) -> _RunBatches:
                    return report.run_batches(RunWindows(store, run_id, plan.runs[run_id]), plan)

                pending: deque[Future[_RunBatches]] = deque()
                for run_id in run_order:
                    # At most REPORT_THREADS runs ahead of the merge: memory stays a few runs' batches.
                    if len(pending) > REPORT_THREADS:
                        report.merge_run(pending.popleft().result())
                    pending.append(report_pool.submit(batches, run_id))
                while pending:
                    report.merge_run(pending.popleft().result())
                return report.result(plan)

            merging = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="snapshot-report-merge"))
            reporting = merging.submit(build_report)

            def runs() -> Iterator[RunWindows]:
                for run_id in run_order:
                    yield RunWindows(store, run_id, plan.runs[run_id])

            kinds = ["x", "u", "y"] + (["timestamps", "mask"] if extras is not None else [])
            for kind in kinds:
                name = array_name(kind)
                written = files.stream(name, ARRAYS[kind][1], (
                    block for run in runs() for block in window_blocks(kind, run, spec, cols, norm)))
                if written is not None and written != manifest["shapes"]["x"][0]:
                    raise BuildError(
                        f"spec {spec.id!r}: stored windows changed while writing {name} "
                        f"({written} rows, manifest says {manifest['shapes']['x'][0]})"
                    )
            report_json = None
        else:
            # One pass over the runs writes every file of the series layout; the report takes the
            # grid blocks that pass reads instead of reading them again.
            merger = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="snapshot-report-merge"))
            feed = _ReportFeed(report, plan, report_pool, merger)
            stack.callback(feed.close)  # on an error: the merging thread stops, the pools can shut down
            rows_written = write_series_files(files, store, plan, norm, series, feed)
            for key, written in rows_written.items():
                if written != manifest["shapes"][key][0]:
                    raise BuildError(
                        f"spec {spec.id!r}: stored windows changed while writing {SERIES_ARRAYS[key][0]} "
                        f"({written} rows, the window index says {manifest['shapes'][key][0]})"
                    )
            report_json = feed.finish()
        if extras is not None:
            files.write(SIDECAR_FILE, to_json_bytes(build_sidecar(extras, plan.split, watermark)))
        if report_json is None:
            report_json = reporting.result()
        files.write("report.json", to_json_bytes(report_json), hashed=False)
        digest = files.finish(wait_durable=wait_durable)
    return SnapshotFiles(staging, manifest, digest, dict(files.hasher.files), report_json, files.syncer.wait)


class StagedFiles:
    """A snapshot's files written into ``directory`` in hash order (``spec.json`` first, then
    each hashed file), each hashed as written (the snapshot hash and per-file digests, in
    background threads) and fsynced in the background. Array files named in ``linked`` are
    hard links to the earlier snapshot's identical file, hashed by reading them.

    Used as a context manager: an error leaves the threads stopped, and the caller removes the
    directory. :meth:`finish` returns the hash once every byte is hashed (and, with
    ``wait_durable``, fsynced).
    """

    def __init__(self, directory: Path, spec_json: bytes, linked: Mapping[str, Path] | None = None) -> None:
        self.dir = directory
        self.linked = dict(linked or {})
        self.hasher = BackgroundSnapshotHasher(spec_json)
        self.syncer = _Syncer()
        try:
            self.write(SPEC_FILE, spec_json, hashed=False)
        except BaseException:
            self._stop()
            raise

    def __enter__(self) -> StagedFiles:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self._stop()

    def _stop(self) -> None:
        for finish in (self.hasher.close, self.syncer.wait):
            try:
                finish()
            except BaseException:  # noqa: BLE001 - the original error is the one to report
                pass

    def write(self, name: str, data: bytes, *, hashed: bool = True) -> None:
        """A small file, whole (hashed next unless ``hashed`` is False, e.g. report.json)."""
        f = open(self.dir / name, "wb", buffering=0)
        try:
            _write_all(f, memoryview(data))
        except BaseException:
            f.close()
            raise
        self.syncer.close(f)
        if hashed:
            self.hasher.begin(name)
            self.hasher.update(data)
            self.hasher.end()

    def _link(self, name: str) -> bool:
        if name not in self.linked:
            return False
        os.link(self.linked[name], self.dir / name)
        self.hasher.add_file(name, self.dir / name)
        crash_point("publish.array_written")
        return True

    def stream(self, name: str, dtype: str, blocks: Iterator[np.ndarray]) -> int | None:
        """Write ``blocks`` (arrays of rows, not modified afterwards) as ``name``; returns the
        rows written (None when the file was linked)."""
        if self._link(name):
            return None
        rows = 0
        self.hasher.begin(name)
        f = open(self.dir / name, "wb", buffering=0)
        try:
            unsynced = 0
            for block in blocks:
                rows += block.shape[0]
                data = memoryview(np.ascontiguousarray(block, dtype=dtype).reshape(-1).view(np.uint8))
                if not data.nbytes:
                    continue
                _write_all(f, data)
                self.hasher.update(data)  # hashed in the background; block is not reused
                unsynced += data.nbytes
                if unsynced >= _FLUSH_BYTES:
                    self.syncer.flush(f)
                    unsynced = 0
        except BaseException:
            f.close()
            raise
        self.syncer.close(f)
        self.hasher.end()
        crash_point("publish.array_written")
        return rows

    def write_together(self, files: list[tuple[str, str]], fill: Callable[[Mapping[str, _Output]], None]) -> dict[str, int]:
        """Several files ``(name, dtype)`` written at once by ``fill(outputs)``, which appends
        blocks to them (or writes at known offsets) in any interleaving; the outputs are keyed by
        name, linked files have none. Returns the rows appended per written file.

        The hash takes the files in the order given: the first written one is hashed as it is
        appended (after any linked ones before it), the later ones by reading them once written.
        """
        outputs: dict[str, _Output] = {}
        later: list[str] = []
        try:
            for name, dtype in files:
                if name in self.linked:
                    os.link(self.linked[name], self.dir / name)
                    if outputs or later:
                        later.append(name)
                    else:
                        self.hasher.add_file(name, self.dir / name)
                        crash_point("publish.array_written")
                    continue
                hashed = not outputs and not later
                outputs[name] = _Output(self, open(self.dir / name, "wb+", buffering=0), dtype, hashed)
                if hashed:
                    self.hasher.begin(name)
                else:
                    later.append(name)
            fill(outputs)
        except BaseException:
            for out in outputs.values():
                out.f.close()
            raise
        for name, out in outputs.items():
            self.syncer.close(out.f)
            if out.hashed:
                self.hasher.end()
                crash_point("publish.array_written")
        for name in later:
            self.hasher.add_file(name, self.dir / name)
            crash_point("publish.array_written")
        return {name: out.rows for name, out in outputs.items()}

    def finish(self, *, wait_durable: bool = True) -> str:
        digest = self.hasher.hexdigest()
        if wait_durable:
            self.syncer.wait()
        return digest


class _Output:
    """One file of :meth:`StagedFiles.write_together`: blocks appended in order (hashed as
    written when ``hashed``), or values written at an offset (the file then hashed once closed)."""

    def __init__(self, files: StagedFiles, f: Any, dtype: str, hashed: bool) -> None:
        self.files, self.f, self.dtype, self.hashed = files, f, dtype, hashed
        self.rows = 0
        self._unsynced = 0

    def append(self, block: np.ndarray) -> None:
        """Append ``block``'s rows (an array not modified afterwards: it may still be hashed)."""
        self.rows += block.shape[0]
        data = memoryview(np.ascontiguousarray(block, dtype=self.dtype).reshape(-1).view(np.uint8))
        if not data.nbytes:
            return
        _write_all(self.f, data)
        if self.hashed:
            self.files.hasher.update(data)
        self._unsynced += data.nbytes
        if self._unsynced >= _FLUSH_BYTES:
            self.files.syncer.flush(self.f)
            self._unsynced = 0

    def truncate(self, size: int) -> None:
        self.f.truncate(size)

    def pwrite(self, values: np.ndarray, offset: int) -> None:
        """``values`` (C-contiguous) at byte ``offset``; only in a file hashed once closed."""
        if self.hashed:
            raise RuntimeError("a file hashed as it is appended is written in order")
        _pwrite_all(self.f, memoryview(values.reshape(-1).view(np.uint8)), offset)


@dataclass
class _RunBatches:
    """One run's part of report.json before it is merged: its cleaning counts, and per grid
    block the node summaries' and lag correlations' batches."""

    counts: Mapping[str, Mapping[str, int]]
    blocks: list[tuple[list[Any], list[Any]]]


class _ReportBuilder:
    """report.json: cleaning counts, per-node summary (model units), lag cross-correlation."""

    def __init__(self, spec: DatasetSpec, cols: Columns) -> None:
        self.spec = spec
        self.cols = cols
        self.nodes = [NodeSummary() for _ in spec.node_ids]
        self.max_lag = spec.history_steps + spec.horizon_steps
        self.lags = {
            (c, t): LagCorrelation(self.max_lag) for c in spec.control_ids for t in spec.target_ids
        }
        self.counts = {n: dict.fromkeys(("input", *CLEAN_CAUSES, "kept"), 0) for n in spec.node_ids}
        self.columns = {n: j for j, n in enumerate(spec.node_ids)}
        self.max_lags = {key: lag.max_lag for key, lag in self.lags.items()}

    def add_run(self, run: RunWindows, plan: DatasetPlan) -> None:
        self.merge_run(self.run_batches(run, plan))

    def run_batches(self, run: RunWindows, plan: DatasetPlan) -> _RunBatches:
        """One run's contributions, computed without touching the accumulators (so runs can be
        computed in threads at once); :meth:`merge_run` adds them, runs in snapshot order."""
        meta = plan.runs[run.run_id]
        # Lag estimates, like every fitted statistic, come from train runs only.
        train = run.run_id in plan.split["trainRunIds"]
        blocks = []
        for r0, r1 in run.blocks():
            rows = run.grid_rows(r0, r1)
            segment, first = rows, 0
            if train:
                # The differences ending in this block, and the max_lag before them as partners.
                c0 = max(0, r0 - 1 - self.max_lag)
                segment = rows if c0 == r0 else run.grid_rows(c0, r1)
                first = max(0, r0 - c0 - 1)
            blocks.append(self.block_batches(rows, segment, first, train))
        return _RunBatches(meta["counts"], blocks)

    def block_batches(self, rows: np.ndarray, segment: np.ndarray, first: int, train: bool) -> tuple[list[Any], list[Any]]:
        """One grid block's contributions: the node summaries of ``rows`` and, for a train run,
        the lag correlations of ``segment`` (the block's rows with the rows before them that
        pair with its differences; its differences before ``first`` are partners only)."""
        nodes = [NodeSummary.batch(rows[:, j]) for j in range(len(self.nodes))]
        lags = []
        if train:
            lags = lag_pair_batches(self.max_lags, {n: segment[:, j] for n, j in self.columns.items()}, first)
        return nodes, lags

    def merge_counts(self, counts: Mapping[str, Mapping[str, int]]) -> None:
        for node, by_cause in counts.items():
            for cause, n in by_cause.items():
                self.counts[node][cause] += int(n)

    def merge_block(self, nodes: list[Any], lags: list[Any]) -> None:
        for summary, batch in zip(self.nodes, nodes, strict=True):
            summary.merge(batch)
        for key, batch in lags:
            self.lags[key].merge(batch)

    def merge_run(self, batches: _RunBatches) -> None:
        self.merge_counts(batches.counts)
        for nodes, lags in batches.blocks:
            self.merge_block(nodes, lags)

    def result(self, plan: DatasetPlan) -> dict[str, Any]:
        totals = {k: sum(c[k] for c in self.counts.values()) for k in ("input", *CLEAN_CAUSES, "kept")}
        return {
            "cleaning": {"totals": totals, "byNode": self.counts},
            "nodes": {n: s.result() for n, s in zip(self.spec.node_ids, self.nodes, strict=True)},
            "lagCrossCorrelation": [
                {"control": c, "target": t, **lag.result(self.spec.beat_ms)}
                for (c, t), lag in self.lags.items()
            ],
            "excluded": plan.split["excluded"],
            "missing": {r: m["missing"] for r, m in plan.runs.items()},
        }


class _ReportFeed:
    """report.json from the grid blocks a pass over the runs reads anyway (the series writer's):
    each block's contributions computed in ``pool``, merged by a thread of ``merger`` in the
    order the blocks are fed, so it is :meth:`_ReportBuilder.run_batches`' report, run by run.

    Feed a run with :meth:`start_run`, then each of its blocks in order with :meth:`block`;
    :meth:`finish` returns the report. At most a few blocks wait to be merged (the feeder waits
    beyond that), so memory stays a few blocks. :meth:`close` stops the merging early (on error).
    """

    def __init__(self, report: _ReportBuilder, plan: DatasetPlan, pool: ThreadPoolExecutor,
                 merger: ThreadPoolExecutor) -> None:
        self.report, self.plan, self.pool = report, plan, pool
        self.train_runs = set(plan.split["trainRunIds"])
        self.context = report.max_lag + 1  # rows before a block its lag pairs reach back to
        self.train = False
        self.tail: np.ndarray | None = None  # the run's last rows fed, at most ``context`` of them
        self._queue: queue.Queue = queue.Queue(2 * REPORT_THREADS)
        self._closed = False
        self._merged = merger.submit(self._merge_all)

    def start_run(self, run_id: str) -> None:
        self._queue.put(self.plan.runs[run_id]["counts"])
        self.train = run_id in self.train_runs
        self.tail = None

    def block(self, r0: int, rows: np.ndarray) -> None:
        """The run's grid rows ``r0 ..`` (a fixed block; not modified afterwards)."""
        segment, first = rows, 0
        if self.train:
            # As run_batches: the rows c0..r0-1 before the block are the end of the run's rows fed.
            c0 = max(0, r0 - 1 - self.report.max_lag)
            if c0 < r0:
                segment = np.concatenate([self.tail[self.tail.shape[0] - (r0 - c0):], rows])
            first = max(0, r0 - c0 - 1)
            both = rows if rows.shape[0] >= self.context or self.tail is None else np.concatenate([self.tail, rows])
            self.tail = both[max(0, both.shape[0] - self.context):]
        self._queue.put(self.pool.submit(self.report.block_batches, rows, segment, first, self.train))

    def _merge_all(self) -> dict[str, Any]:
        error: BaseException | None = None
        while (item := self._queue.get()) is not None:
            if error is not None:
                continue  # keep taking items so the feeder never waits for nothing
            try:
                if isinstance(item, Future):
                    self.report.merge_block(*item.result())
                else:
                    self.report.merge_counts(item)
            except BaseException as e:  # noqa: BLE001 - re-raised by finish()
                error = e
        if error is not None:
            raise error
        return self.report.result(self.plan)

    def finish(self) -> dict[str, Any]:
        self.close()
        return self._merged.result()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
