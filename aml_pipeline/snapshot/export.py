"""The model-unit grid of every run, rebuilt from a snapshot alone, as Parquet.

A snapshot stores windows, not the grid they were cut from; this module puts the grid back
together so that dataframe-based tools (PyTorch Forecasting, Darts, GluonTS, pandas) can use the
cleaned, aligned, unit-transformed data. Per run (one block of windows):

* every window's rows sit at known grid positions (``timestamps``, v2; in the series layout the
  window index gives them without cutting a window): history rows
  ``t-H..t-1`` carry all nodes (``x``), future rows ``t..t+F-1`` carry the controls (``u``) and
  targets (``y``); values are de-normalised to model units (float64);
* windows overlap (stride < H+F), so only a minimal set of them is read: a greedy cover of the
  run's history rows and one of its future rows, about ``rows / H`` and ``rows / F`` windows,
  each a contiguous read; the stored timestamps of every window read are checked against the
  grid positions they fill;
* the output has one row per grid timestamp covered by the run's windows; a node the snapshot
  holds no value for at that row (a feature on a row that is only ever a future row, e.g. the
  run's last F rows) is NaN, as is a step whose ``mask`` is 0.

Where history and future rows overlap, history values (``x``, all nodes) are kept; for a
control or target the two agree to float32 precision of the normalised values.

Layout of ``out_dir``: ``part-00000.parquet``, ... one file per run in snapshot order (train,
val, test), columns ``run_id, timestamp (UTC, ms), time_idx, <node ids...>, split``, units in
each node field's Parquet metadata, plus ``_export.json`` (what was exported from which
snapshot; ``_``-prefixed, so ``pandas.read_parquet(out_dir)`` skips it). The directory appears
complete or not at all (written beside it under a hidden name, then renamed). Memory is bounded
by one run's grid. pyarrow is imported when an export runs, not with this package.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .layout import DIGEST_FILE, SPLITS, SnapshotError
from .reader import Block, Snapshot, open_snapshot

EXPORT_FILE = "_export.json"
KEY_COLUMNS = ("run_id", "timestamp", "time_idx", "split")


def cover(starts: np.ndarray, length: int) -> np.ndarray:
    """Indices of a minimal subset of the intervals ``[s, s + length)`` (``starts`` ascending)
    whose union equals the union of all of them: greedy, one step per chosen interval."""
    picks: list[int] = []
    n, i = starts.shape[0], 0
    while i < n:
        picks.append(i)
        # The farthest interval that starts inside (or right at the end of) the stretch covered.
        j = int(np.searchsorted(starts, starts[i] + length, side="right")) - 1
        i = j if j > i else i + 1
    return np.asarray(picks, dtype=np.int64)


def _require_timestamps(snap: Snapshot) -> np.ndarray:
    if snap.timestamps is None:
        raise SnapshotError(
            f"{snap.root}: a v{snap.version} snapshot has no window timestamps (arrays/timestamps.f64), "
            "so its runs' grids cannot be rebuilt; build the dataset with a v2 spec (one with extras)",
            code="SNAPSHOT_NO_TIMESTAMPS",
        )
    if snap.beat_ms is None or snap.beat_ms <= 0:
        raise SnapshotError(f"{snap.root}: manifest has no positive beatMs")
    return snap.timestamps


def run_grid(snap: Snapshot, block: Block) -> tuple[np.ndarray, np.ndarray]:
    """``(timestamps int64 ms [R], values float64 [R, nodes])``: one run's model-unit grid rows
    covered by its windows, ascending in time."""
    ts = _require_timestamps(snap)
    H, F, beat = snap.history_steps, snap.horizon_steps, snap.beat_ms
    a, b = block.start, block.stop
    if b == a:
        return np.empty(0, dtype=np.int64), np.empty((0, len(snap.nodes)))
    if snap.index is not None:  # series layout: from the window index, no window is cut for it
        starts_ms = snap.index.origin_ms(np.arange(a, b, dtype=np.int64))
    else:
        starts_ms = np.asarray(ts[a:b, H], dtype=np.int64)  # row t of every window
    base = int(starts_ms[0]) - H * beat  # the run's first history row
    offset = starts_ms - base
    if np.any(offset % beat) or np.any(np.diff(offset) <= 0):
        raise SnapshotError(f"{snap.root}: run {block.run_id}: window timestamps are not ascending grid steps of {beat} ms")
    g = offset // beat  # grid row of each window's row t
    rows_total = int(g[-1]) + F
    values = np.full((rows_total, len(snap.nodes)), np.nan)
    covered = np.zeros(rows_total, dtype=bool)
    mask = snap.mask

    def fill(picks: np.ndarray, lo: int, steps: int, put: Callable[[np.ndarray, np.ndarray, np.ndarray], None]) -> None:
        rows = g[picks, None] + np.arange(lo, lo + steps)  # [P, steps]
        windows = a + picks
        stored = np.asarray(ts[windows][:, H + lo : H + lo + steps], dtype=np.int64)
        if not np.array_equal(stored, base + rows * beat):
            raise SnapshotError(f"{snap.root}: run {block.run_id}: a window's timestamps are not consecutive grid rows")
        keep = np.ones(rows.shape, dtype=bool) if mask is None else np.asarray(mask[windows][:, H + lo : H + lo + steps]) != 0
        put(rows, windows, keep)
        covered[rows] = True

    def future(rows: np.ndarray, windows: np.ndarray, keep: np.ndarray) -> None:
        for group, cols in (("u", snap.controls), ("y", snap.targets)):
            if not cols:
                continue
            idx = [snap.nodes.index(c) for c in cols]
            model = snap.to_model_units(group, snap.array(group)[windows])  # [P, F, cols]
            model = np.where(keep[..., None], model, np.nan)
            values[rows.reshape(-1)[:, None], idx] = model.reshape(-1, len(cols))

    def history(rows: np.ndarray, windows: np.ndarray, keep: np.ndarray) -> None:
        model = snap.to_model_units("x", snap.x[windows])  # [P, H, nodes]
        # A masked history step leaves what a future row may have put there.
        model = np.where(keep[..., None], model, values[rows])
        values[rows.reshape(-1)] = model.reshape(-1, len(snap.nodes))

    if F:
        fill(cover(g, F), 0, F, future)
    if H:
        fill(cover(g - H, H), -H, H, history)  # after the future rows: history wins where both exist
    rows = np.flatnonzero(covered)
    return base + rows.astype(np.int64) * beat, values[rows]


def _schema(snap: Snapshot, pa: Any) -> Any:
    fields = [
        pa.field("run_id", pa.dictionary(pa.int32(), pa.string())),
        pa.field("timestamp", pa.timestamp("ms", tz="UTC")),
        pa.field("time_idx", pa.int64()),
    ]
    for node in snap.nodes:
        v = snap.variables[node]
        meta = {"role": v.role, "unit": v.model_unit, "engineeringUnit": v.unit,
                "scale": repr(v.scale), "offset": repr(v.offset)}
        fields.append(pa.field(node, pa.float64(), metadata={k: str(val) for k, val in meta.items()}))
    fields.append(pa.field("split", pa.dictionary(pa.int32(), pa.string())))
    about = {"sha256": snap.sha256, "verified": snap.verified, "specId": snap.spec.get("id"),
             "beatMs": snap.beat_ms, "historySteps": snap.history_steps, "horizonSteps": snap.horizon_steps}
    return pa.schema(fields, metadata={"aml_pipeline.snapshot": json.dumps(about)})


def _table(snap: Snapshot, block: Block, ts: np.ndarray, values: np.ndarray, schema: Any, pa: Any) -> Any:
    n = ts.shape[0]
    step = np.int64(snap.beat_ms)
    cols: list[Any] = [
        pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([block.run_id])),
        pa.array(ts, type=pa.timestamp("ms", tz="UTC")),
        pa.array((ts - ts[0]) // step if n else ts, type=pa.int64()),
    ]
    cols += [pa.array(values[:, j]) for j in range(values.shape[1])]
    cols.append(pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([block.split])))
    return pa.Table.from_arrays(cols, schema=schema)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(err: BaseException, out: Path) -> Exception | None:
    """The package's DISK_FULL error naming ``out`` when ``err`` is running out of space: a caller
    of the library gets the one line the CLI prints, not the OS's error."""
    # Imported here, not with the module: the reader imports nothing else of aml_pipeline (the
    # export, needing pyarrow, runs where the package is installed).
    from aml_pipeline.errors import disk_full

    return disk_full(err, out) if isinstance(err, OSError) else None


def staging_beside(out: Path) -> Path:
    """Where an export to ``out`` is written before its one rename: a hidden folder beside it,
    named for this host and process. What an earlier export to ``out`` on this host left when it
    was killed (its process gone) is removed first; nothing else would ever remove it."""
    host = socket.gethostname().replace("-", "_")
    prefix = f".{out.name}.partial-{host}-"
    for old in out.parent.glob(glob.escape(prefix) + "*"):
        pid = old.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return out.parent / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user counts). Defined here,
    where the snapshot package (which imports nothing of the rest) needs it;
    ``aml_pipeline.fsutil`` gives it to the rest of the package."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def snapshot_containing(path: str | os.PathLike[str]) -> Path | None:
    """The snapshot folder ``path`` would be inside (one of its parents holds a digest file),
    or None: an export written there would sit among files the snapshot's hash does not cover."""
    for parent in Path(path).resolve().parents:
        if (parent / DIGEST_FILE).is_file():
            return parent
    return None


def export_parquet(
    snapshot: Snapshot | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    splits: Sequence[str] = SPLITS,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write the model-unit grid of every run of ``splits`` to ``out_dir`` (see the module doc);
    a path is opened (and verified) first. Returns what ``_export.json`` records.

    ``out_dir`` must not exist or be empty (:class:`FileExistsError` otherwise).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    snap = snapshot if isinstance(snapshot, Snapshot) else open_snapshot(snapshot)
    for s in splits:
        if s not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {s!r}")
    clash = sorted(set(snap.nodes) & set(KEY_COLUMNS))
    if clash:
        raise SnapshotError(f"{snap.root}: node ids {clash} collide with the export's columns {list(KEY_COLUMNS)}")
    if not snap.blocks and len(snap):
        raise SnapshotError(f"{snap.root}: manifest split.blocks is missing; windows cannot be assigned to runs")
    _require_timestamps(snap)
    out = Path(out_dir)
    if (inside := snapshot_containing(out)) is not None:
        raise ValueError(f"{out} is inside the snapshot {inside}; a published snapshot is not written to")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_beside(out)
    try:
        tmp.mkdir()
        schema = _schema(snap, pa)
        blocks = [b for b in snap.blocks if b.split in splits]
        files: list[dict[str, Any]] = []
        for i, block in enumerate(blocks):
            ts, values = run_grid(snap, block)
            name = f"part-{i:05d}.parquet"
            pq.write_table(_table(snap, block, ts, values, schema, pa), tmp / name)
            _fsync(tmp / name)
            files.append({"file": name, "runId": block.run_id, "split": block.split, "rows": int(ts.shape[0]),
                          "windows": len(block), "firstMs": int(ts[0]) if ts.size else None,
                          "lastMs": int(ts[-1]) if ts.size else None})
            if progress:
                progress(i + 1, len(blocks))
        summary = {
            "format": "parquet",
            "snapshotDir": str(snap.root),
            "sha256": snap.sha256,
            "verified": snap.verified,
            "specId": snap.spec.get("id"),
            "manifestVersion": snap.version,
            "beatMs": snap.beat_ms,
            "splits": list(splits),
            "columns": ["run_id", "timestamp", "time_idx", *snap.nodes, "split"],
            "units": {n: {"role": v.role, "modelUnit": v.model_unit, "unit": v.unit, "scale": v.scale,
                          "offset": v.offset} for n, v in snap.variables.items()},
            "valuesIn": "model units (engineering value * scale + offset), float64; NaN where the snapshot holds no value",
            "rows": sum(f["rows"] for f in files),
            "files": files,
        }
        (tmp / EXPORT_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        _fsync(tmp / EXPORT_FILE)
        _fsync(tmp)
        os.rename(tmp, out)  # replaces an empty directory, fails on a non-empty one
        _fsync(out.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = _disk_full(e, out)
        if full is not None:
            raise full from None
        raise
    return {**summary, "outDir": str(out)}
