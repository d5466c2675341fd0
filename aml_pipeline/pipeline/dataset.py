"""Dataset-level stages: split runs, fit normalisation on train, write the snapshot.

Runs are streamed from the store one fixed grid block at a time
(:mod:`aml_pipeline.pipeline.run_reader`), so memory is bounded by a block, not by a run or by the
dataset.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.core.clean import CLEAN_CAUSES
from aml_pipeline.core.hashing import BackgroundSnapshotHasher, SnapshotHasher
from aml_pipeline.core.lineage import RunContext, RunLineage, classify_lineage
from aml_pipeline.core.manifest import SPLITS, build_manifest, build_sidecar, to_json_bytes
from aml_pipeline.core.normalize import MomentAccumulator, NormStats, accumulate_window_stats, apply_norm
from aml_pipeline.core.split import split_blocks, split_runs
from aml_pipeline.core.stats import LagCorrelation, NodeSummary, add_lag_pairs
from aml_pipeline.core.windows import window_block
from aml_pipeline.errors import BuildError
from aml_pipeline.pipeline.incremental import inputs_key
from aml_pipeline.pipeline.run_reader import RunWindows
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.pipeline.versions import stage_versions
from aml_pipeline.spec import DatasetSpec

SPLIT_FILE = "split.json"
NORM_FILE = "norm.json"


@dataclass
class DatasetPlan:
    """Which runs go where. ``split`` is the manifest's ``split`` section."""

    split: dict[str, Any]
    lineage: RunLineage | None
    runs: dict[str, dict[str, Any]]  # run id -> windows-stage summary, for runs in the dataset

    def ordered_runs(self) -> list[tuple[str, str]]:
        """(split, run id) in snapshot order: train, val, test; runs in split order."""
        return [(part, r) for part in SPLITS for r in self.split[f"{part}RunIds"]]

    def key(self, spec: DatasetSpec) -> str:
        """What the later stages are computed from: the split and each run's windows data version."""
        return inputs_key(
            stage_versions(spec).split,
            self.split,
            None if self.lineage is None else self.lineage.to_json(),
            {r: m.get("dataVersion") for r, m in sorted(self.runs.items())},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "lineage": None if self.lineage is None else self.lineage.to_json(),
            "runs": self.runs,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DatasetPlan:
        lin = obj.get("lineage")
        return cls(obj["split"], None if lin is None else RunLineage(**lin), obj["runs"])


def plan_dataset(spec: DatasetSpec, run_ids: Sequence[str], store: DatasetStore) -> DatasetPlan:
    """Split the given runs (the dataset's partitions) by run, never by window."""
    fingerprint = stage_versions(spec).windows
    metas: dict[str, dict[str, Any]] = {}
    excluded: list[dict[str, str]] = []
    for run_id in run_ids:
        meta = store.read_meta(run_id, "windows")
        if meta is None:
            excluded.append({"runId": run_id, "reason": "run_windows not materialised for this run"})
        elif meta.get("fingerprint") != fingerprint:
            raise BuildError(
                f"run {run_id!r}: its windows were built for another version of spec {spec.id!r} "
                f"({meta.get('fingerprint')}, now {fingerprint}); rematerialise the run partitions"
            )
        else:
            metas[run_id] = meta

    lineage: RunLineage | None = None
    if spec.extras is not None:
        lineage = classify_lineage(
            (
                RunContext(
                    r,
                    bool(m["run"]["context_confirmed"]),
                    m["run"]["recipe_version"],
                    m["run"]["recipe_content_hash"],
                )
                for r, m in metas.items()
            ),
            recipe_version=spec.extras.recipe_version,
            recipe_content_hash=spec.extras.recipe_content_hash,
        )
        excluded.extend(lineage.excluded)

    lineage_out = lineage.excluded_ids if lineage else set()
    candidates: list[tuple[str, int]] = []
    for run_id, meta in metas.items():
        if run_id in lineage_out:
            continue
        if meta["windows"] == 0:
            excluded.append({"runId": run_id, "reason": f"no windows: {meta['reason']}"})
        else:
            candidates.append((run_id, int(meta["run"]["started_at"])))
    excluded.sort(key=lambda e: e["runId"])

    if not candidates:
        reasons = "; ".join(f"{e['runId']}: {e['reason']}" for e in excluded[:3])
        more = f" (and {len(excluded) - 3} more)" if len(excluded) > 3 else ""
        raise BuildError(
            f"spec {spec.id!r}: the build yields no windows from {len(run_ids)} run(s)"
            + (f" — {reasons}{more}" if reasons else ""),
            code="NO_WINDOWS",
        )
    s = spec.split
    parts = split_runs(candidates, method=s.method, train=s.train, val=s.val, test=s.test, seed=s.seed)
    if not parts["train"]:
        raise BuildError(
            f"spec {spec.id!r}: no run falls into train ({len(candidates)} run(s) with windows, "
            f"split {s.method}); normalisation is fitted on train only",
            code="NO_TRAIN_RUNS",
        )
    windows = {r: int(metas[r]["windows"]) for r, _ in candidates}
    split = {
        "trainRunIds": parts["train"],
        "valRunIds": parts["val"],
        "testRunIds": parts["test"],
        "excluded": excluded,
        **{part: sum(windows[r] for r in parts[part]) for part in SPLITS},
        "blocks": split_blocks(parts, windows),
    }
    return DatasetPlan(split, lineage, {r: metas[r] for r, _ in candidates})


def _checked(spec: DatasetSpec, store: DatasetStore, name: str, asset: str, stage: str) -> dict[str, Any]:
    try:
        obj = store.read_json(name)
    except FileNotFoundError:
        raise BuildError(f"spec {spec.id!r}: {asset} has not been materialised yet") from None
    if obj.get("fingerprint") != stage_versions(spec).of(stage):
        raise BuildError(
            f"spec {spec.id!r}: the stored {asset} was built for another version of the spec; "
            f"rematerialise {asset}"
        )
    return obj


def save_plan(spec: DatasetSpec, plan: DatasetPlan, store: DatasetStore) -> Path:
    return store.write_json(SPLIT_FILE, {"fingerprint": stage_versions(spec).split, **plan.to_json()})


def load_plan(spec: DatasetSpec, store: DatasetStore) -> DatasetPlan:
    return DatasetPlan.from_json(_checked(spec, store, SPLIT_FILE, "dataset_split", "split"))


def run_windows(store: DatasetStore, plan: DatasetPlan, run_id: str) -> RunWindows:
    """The stored windows stage of a run of the plan."""
    return RunWindows(store, run_id, plan.runs[run_id])


@dataclass
class Columns:
    """Column indices of the three window groups in the node-ordered grid."""

    controls: list[int]
    targets: list[int]

    @classmethod
    def of(cls, spec: DatasetSpec) -> Columns:
        idx = {n: j for j, n in enumerate(spec.node_ids)}
        return cls([idx[n] for n in spec.control_ids], [idx[n] for n in spec.target_ids])


@dataclass
class Normalization:
    x: NormStats
    u: NormStats
    y: NormStats

    def to_json(self, spec: DatasetSpec) -> dict[str, Any]:
        out = {}
        for key, stats, names in (
            ("x", self.x, spec.node_ids),
            ("u", self.u, spec.control_ids),
            ("y", self.y, spec.target_ids),
        ):
            out[key] = stats.to_json()
            out[key]["zeroStd"] = [n for n, z in zip(names, stats.zero_std, strict=True) if z]
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any], spec: DatasetSpec) -> Normalization:
        def stats(key: str, names: list[str]) -> NormStats:
            g = obj[key]
            if len(g["mean"]) != len(names):
                raise BuildError(
                    f"spec {spec.id!r}: stored normalisation of {key} has {len(g['mean'])} columns, "
                    f"the spec {len(names)}; rematerialise normalization_stats"
                )
            return NormStats(
                mean=np.asarray(g["mean"], dtype=np.float64),
                std=np.asarray(g["std"], dtype=np.float64),
                zero_std=np.asarray([n in g["zeroStd"] for n in names], dtype=bool),
                count=float("nan"),
            )

        return cls(stats("x", spec.node_ids), stats("u", spec.control_ids), stats("y", spec.target_ids))


def save_norm(spec: DatasetSpec, norm: Normalization, store: DatasetStore, plan: DatasetPlan) -> Path:
    return store.write_json(
        NORM_FILE, {"fingerprint": stage_versions(spec).norm, "inputs": plan.key(spec), **norm.to_json(spec)}
    )


def fit_or_reuse_normalization(spec: DatasetSpec, plan: DatasetPlan, store: DatasetStore) -> tuple[Normalization, bool]:
    """The stored statistics when they were fitted on exactly this plan (nothing is read again),
    else freshly fitted and saved. Returns them and whether they were reused."""
    try:
        stored = store.read_json(NORM_FILE)
    except FileNotFoundError:
        stored = None
    if stored and stored.get("fingerprint") == stage_versions(spec).norm and stored.get("inputs") == plan.key(spec):
        return Normalization.from_json(stored, spec), True
    norm = fit_normalization(spec, plan, store)
    save_norm(spec, norm, store, plan)
    return norm, False


def load_norm(spec: DatasetSpec, store: DatasetStore, plan: DatasetPlan) -> Normalization:
    """The stored statistics, which must have been fitted on ``plan``."""
    obj = _checked(spec, store, NORM_FILE, "normalization_stats", "norm")
    if obj.get("inputs") != plan.key(spec):
        raise BuildError(
            f"spec {spec.id!r}: the stored normalization_stats were fitted on another split or other "
            "run data than the current dataset_split; rematerialise normalization_stats"
        )
    return Normalization.from_json(obj, spec)


def fit_normalization(spec: DatasetSpec, plan: DatasetPlan, store: DatasetStore) -> Normalization:
    """mean/std per column over train windows only (float64), streamed block by block.

    Each fixed grid block of a run is one batch of the moment accumulators, with the starts of
    every window that reads a row of it; runs are merged in split order.
    """
    cols = Columns.of(spec)
    H, F = spec.history_steps, spec.horizon_steps
    n = len(spec.node_ids)
    total = tuple(MomentAccumulator(w) for w in (n, len(cols.controls), len(cols.targets)))
    for run_id in plan.split["trainRunIds"]:
        run = run_windows(store, plan, run_id)
        acc = tuple(MomentAccumulator(a.n_cols) for a in total)
        reader = run.starts()
        for r0, r1 in run.blocks():
            # Windows t read rows t-H..t+F-1: those touching rows r0..r1-1 start in r0-F+1..r1+H-1.
            starts = reader.between(r0 - F + 1, r1 + H)
            accumulate_window_stats(*acc, run.grid_rows(r0, r1), starts, H, F, cols.controls, cols.targets, first_row=r0)
        for a, p in zip(total, acc, strict=True):
            a.merge(p)
    if total[0].count == 0:
        raise BuildError(f"spec {spec.id!r}: no train windows to fit normalisation on", code="NO_TRAIN_RUNS")
    return Normalization(*(a.result() for a in total))


# ---- snapshot writing ------------------------------------------------------------------------


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
    return f"arrays/{kind}.{'f64' if kind == 'timestamps' else 'f32'}"


def write_snapshot_files(
    spec: DatasetSpec,
    plan: DatasetPlan,
    norm: Normalization,
    store: DatasetStore,
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
                report.add_run(run_windows(store, plan, run_id), plan)
        for kind in kinds:
            name = array_name(kind)
            dtype = "<f8" if kind == "timestamps" else "<f4"
            if name in linked:
                os.link(linked[name], staging / name)
                hasher.add_file(name, staging / name)
                continue
            expected_rows = 0
            hasher.begin(name)
            f = open(staging / name, "wb", buffering=0)
            try:
                unsynced = 0
                for run_id in run_order:
                    run = run_windows(store, plan, run_id)
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
            if expected_rows != manifest["shapes"]["x"][0]:
                raise BuildError(
                    f"spec {spec.id!r}: stored windows changed while writing {name} "
                    f"({expected_rows} rows, manifest says {manifest['shapes']['x'][0]})"
                )
        if extras is not None:
            sidecar = to_json_bytes(build_sidecar(extras, plan.split, watermark))
            _write_file(staging / "arrays" / "sidecar.json", sidecar, syncer, hasher, "arrays/sidecar.json")
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
