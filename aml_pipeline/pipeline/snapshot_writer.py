"""Writing a snapshot: every artifact into a staging directory, hashed and fsynced as it goes.

The manifest stage (:mod:`aml_pipeline.pipeline.stages.manifest`) calls :func:`write_snapshot_files`
and then checks and publishes what it wrote. Runs are streamed from the store one fixed grid block
at a time (:mod:`aml_pipeline.pipeline.run_reader`), so memory is bounded by a block, not by a run
or by the dataset; hashing and fsync run in background threads beside the gathering.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.core.clean import CLEAN_CAUSES
from aml_pipeline.core.hashing import BackgroundSnapshotHasher
from aml_pipeline.snapshot.layout import SnapshotHasher
from aml_pipeline.core.manifest import build_manifest, build_sidecar, to_json_bytes
from aml_pipeline.core.normalize import apply_norm
from aml_pipeline.core.stats import LagCorrelation, NodeSummary, add_lag_pairs
from aml_pipeline.core.windows import window_block
from aml_pipeline.errors import BuildError
from aml_pipeline.faults import crash_point
from aml_pipeline.pipeline.stages.grid import node_ranges
from aml_pipeline.pipeline.stages.norm import Normalization
from aml_pipeline.pipeline.stages.split import DatasetPlan
from aml_pipeline.pipeline.stages.windows import Columns, RunWindows
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.snapshot.layout import ARRAYS, SIDECAR_FILE
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


def _write_file(path: Path, data: bytes, syncer: _Syncer, hasher: SnapshotHasher | None = None, name: str = "") -> None:
    f = open(path, "wb", buffering=0)
    try:
        _write_all(f, memoryview(data))
    except BaseException:
        f.close()
        raise
    syncer.close(f)
    if hasher is not None:
        hasher.begin(name)
        hasher.update(data)
        hasher.end()


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

    ``linked`` names array files (``arrays/x.f32``, ...) that an earlier snapshot already holds
    with identical bytes: they are hard-linked from there instead of gathered and written again,
    and hashed by reading them.

    One pass per array kind over the runs, in snapshot order; memory is bounded by one run's
    grid plus a few blocks. Hashing (the snapshot hash and the per-file digests) and fsync run
    in background threads, so gathering, hashing and the disk work at the same time. With
    ``wait_durable=False`` it returns once every byte is written (closed) and hashed, while
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
    hasher = BackgroundSnapshotHasher(spec_json)
    syncer = _Syncer()
    try:
        _write_file(staging / "spec.json", spec_json, syncer)
        _write_file(staging / "manifest.json", to_json_bytes(manifest), syncer, hasher, "manifest.json")

        run_order = [r for _, r in plan.ordered_runs()]
        kinds = ["x", "u", "y"] + (["timestamps", "mask"] if extras is not None else [])
        report = _ReportBuilder(spec, cols)
        linked = dict(linked or {})
        if array_name("x") in linked:
            for run_id in run_order:  # the report is otherwise built during the x pass
                report.add_run(RunWindows(store, run_id, plan.runs[run_id]), plan)
        for kind in kinds:
            name = array_name(kind)
            dtype = ARRAYS[kind][1]
            if name in linked:
                os.link(linked[name], staging / name)
                hasher.add_file(name, staging / name)
                crash_point("publish.array_written")
                continue
            expected_rows = 0
            hasher.begin(name)
            f = open(staging / name, "wb", buffering=0)
            try:
                unsynced = 0
                for run_id in run_order:
                    run = RunWindows(store, run_id, plan.runs[run_id])
                    if kind == "x":
                        report.add_run(run, plan)
                    for block in window_blocks(kind, run, spec, cols, norm):
                        data = memoryview(np.ascontiguousarray(block, dtype=dtype).reshape(-1).view(np.uint8))
                        if not data.nbytes:
                            continue
                        _write_all(f, data)
                        hasher.update(data)  # hashed in the background; block is not reused
                        unsynced += data.nbytes
                        if unsynced >= _FLUSH_BYTES:
                            syncer.flush(f)
                            unsynced = 0
                    expected_rows += run.n_windows
            except BaseException:
                f.close()
                raise
            syncer.close(f)
            hasher.end()
            crash_point("publish.array_written")
            if expected_rows != manifest["shapes"]["x"][0]:
                raise BuildError(
                    f"spec {spec.id!r}: stored windows changed while writing {name} "
                    f"({expected_rows} rows, manifest says {manifest['shapes']['x'][0]})"
                )
        if extras is not None:
            sidecar = to_json_bytes(build_sidecar(extras, plan.split, watermark))
            _write_file(staging / SIDECAR_FILE, sidecar, syncer, hasher, SIDECAR_FILE)
        report_json = report.result(plan)
        _write_file(staging / "report.json", to_json_bytes(report_json), syncer)
        digest = hasher.hexdigest()
        if wait_durable:
            syncer.wait()
    except BaseException:
        for finish in (hasher.close, syncer.wait):
            try:
                finish()
            except BaseException:  # noqa: BLE001 - the original error is the one to report
                pass
        raise
    return SnapshotFiles(staging, manifest, digest, dict(hasher.files), report_json, syncer.wait)


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

    def add_run(self, run: RunWindows, plan: DatasetPlan) -> None:
        meta = plan.runs[run.run_id]
        for node, counts in meta["counts"].items():
            for cause, n in counts.items():
                self.counts[node][cause] += int(n)
        # Lag estimates, like every fitted statistic, come from train runs only.
        train = run.run_id in plan.split["trainRunIds"]
        for r0, r1 in run.blocks():
            rows = run.grid_rows(r0, r1)
            for j, summary in enumerate(self.nodes):
                summary.add(rows[:, j])
            if train:
                # The differences ending in this block, and the max_lag before them as partners.
                c0 = max(0, r0 - 1 - self.max_lag)
                segment = rows if c0 == r0 else run.grid_rows(c0, r1)
                first = max(0, r0 - c0 - 1)
                add_lag_pairs(self.lags, {n: segment[:, j] for n, j in self.columns.items()}, first)

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
