"""``open_snapshot``: a verified snapshot whose arrays are memory maps.

Opening reads only the small JSON files into memory; verification streams every hashed byte
through sha256 in a 1 MiB buffer, and the arrays are then ``numpy.memmap`` views (mode ``'r'``)
of the very files that were hashed. Nothing is loaded until it is indexed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .batches import iter_batches, whole_number
from .layout import (
    ARRAYS,
    LAYOUTS,
    SEGMENT_FIELDS,
    SERIES_ARRAYS,
    SERIES_LAYOUT,
    SPLITS,
    V1_ARRAYS,
    SnapshotError,
    manifest_layout,
)
from .series import MaskWindows, RowWindows, SeriesIndex, TimestampWindows, WindowArray
from .verify import FileId, OpenedSnapshot, file_id, open_files

GROUPS = ("x", "u", "y")


@dataclass(frozen=True)
class Block:
    """One run's windows: ``start:stop`` in the snapshot's window order."""

    run_id: str
    split: str
    start: int
    stop: int

    @property
    def windows(self) -> range:
        return range(self.start, self.stop)

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Norm:
    """Normalisation of one array's columns: stored = float32((model value - mean) / std)."""

    columns: tuple[str, ...]
    mean: np.ndarray  # float64 [columns]
    std: np.ndarray  # float64 [columns]; 1 where the train std was 0 (listed in zero_std)
    zero_std: tuple[str, ...]

    def denormalize(self, values: np.ndarray) -> np.ndarray:
        """Stored (normalised) values -> model units, float64; the last axis is the columns."""
        return np.asarray(values, dtype=np.float64) * self.std + self.mean

    def normalize(self, values: np.ndarray) -> np.ndarray:
        """Model units -> the stored form (float32), e.g. for inputs at inference time."""
        return ((np.asarray(values, dtype=np.float64) - self.mean) / self.std).astype(np.float32)


@dataclass(frozen=True)
class Variable:
    """A node's units: model value = engineering value * scale + offset (manifest v2
    ``variables``; a node without a variable has unit '' and the identity transform)."""

    node_id: str
    role: str
    unit: str  # engineering unit
    model_unit: str
    scale: float
    offset: float


def _int_list(value: Any, what: str, root: Path) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise SnapshotError(f"{root}: manifest {what} must be a list of non-negative integers, got {value!r}")
    return value


class Snapshot:
    """A published snapshot, opened (and by default verified) by :func:`open_snapshot`.

    Arrays (windows ordered train, val, test; within a split, runs in split order and windows
    ascending in time): ``x [N, H, nodes]``, ``u [N, F, controls]``, ``y [N, F, targets]``,
    normalised float32, and in manifest v2 ``timestamps [N, H+F]`` (epoch ms, float64) and
    ``mask [N, H+F]``; ``None`` where a v1 snapshot has none. In the windows layout each is a
    read-only ``numpy.memmap`` (a zero-size array is a plain empty array: nothing to map); in
    the series layout a :class:`~.series.WindowArray` that indexes the same way and cuts the
    windows from the stored rows when read (``index`` is then its :class:`~.series.SeriesIndex`).
    """

    def __init__(self, opened: OpenedSnapshot) -> None:
        self._opened = opened
        self.root = opened.root
        self.sha256 = opened.sha256
        self.verified = opened.verified
        self.manifest: dict[str, Any] = opened.manifest
        try:
            try:
                self.spec: dict[str, Any] = json.loads(opened.spec_bytes)
            except ValueError as e:
                raise SnapshotError(f"{self.root}: spec.json is not JSON ({e})") from None
            self._read_layout()
        except SnapshotError:
            opened.close()
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            opened.close()
            raise SnapshotError(f"{self.root}: manifest.json lacks what a reader needs ({type(e).__name__}: {e})") from None

    # ---- layout ---------------------------------------------------------------------------

    def _read_layout(self) -> None:
        m, root = self.manifest, self.root
        self.version = int(m["version"])
        self.layout = manifest_layout(m)
        if self.layout not in LAYOUTS:
            raise SnapshotError(f"{root}: manifest layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        self.nodes: list[str] = [str(n) for n in m["allNodes"]]
        self.controls: list[str] = [str(n) for n in m["controls"]]
        self.targets: list[str] = [str(n) for n in m["targets"]]
        self.history_steps = int(m["historySteps"])
        self.horizon_steps = int(m["horizonSteps"])
        self.beat_ms = int(m["beatMs"]) if m.get("beatMs") is not None else None
        counts = [int(m["split"][p]) for p in SPLITS]
        self.counts = dict(zip(SPLITS, counts, strict=True))
        n = sum(counts)
        H, F = self.history_steps, self.horizon_steps
        expected = {
            "x": [n, H, len(self.nodes)], "u": [n, F, len(self.controls)], "y": [n, F, len(self.targets)],
            "timestamps": [n, H + F], "mask": [n, H + F],
        }
        artifacts = (m.get("artifacts") or {}) if self.version >= 2 or self.layout == SERIES_LAYOUT else {}
        self.files: dict[str, str] = {}
        self._arrays: dict[str, np.ndarray | WindowArray] = {}
        self.index: SeriesIndex | None = None
        if self.layout == SERIES_LAYOUT:
            names = V1_ARRAYS + (("timestamps", "mask") if self.version >= 2 else ())
            for key in names:
                if _int_list(m["shapes"].get(key), f"shapes.{key}", root) != expected[key]:
                    raise SnapshotError(f"{root}: manifest shapes.{key} is not {expected[key]} (split counts, "
                                        "historySteps/horizonSteps and the node lists)")
            self.blocks: list[Block] = self._read_blocks()
            self._read_series(artifacts, n)
        else:
            names = V1_ARRAYS + tuple(k for k in ("timestamps", "mask") if k in artifacts)
            for key in names:
                name = str(artifacts.get(key, ARRAYS[key][0]))
                shape = _int_list(m["shapes"].get(key), f"shapes.{key}", root)
                if shape != expected[key]:
                    raise SnapshotError(
                        f"{root}: {name} has manifest shape {shape}, but split counts, historySteps/horizonSteps "
                        f"and the node lists give {expected[key]}"
                    )
                self.files[key] = name
                self._arrays[key] = self._map(name, ARRAYS[key][1], shape)
            self.blocks = self._read_blocks()
        self.norm: dict[str, Norm] = {
            g: Norm(
                tuple(cols),
                np.asarray(m["norm"][g]["mean"], dtype=np.float64),
                np.asarray(m["norm"][g]["std"], dtype=np.float64),
                tuple(m["norm"][g].get("zeroStd") or ()),
            )
            for g, cols in (("x", self.nodes), ("u", self.controls), ("y", self.targets))
        }
        for g, norm in self.norm.items():
            if norm.mean.shape != (len(norm.columns),) or norm.std.shape != (len(norm.columns),):
                raise SnapshotError(f"{root}: manifest norm.{g} needs {len(norm.columns)} means and stds")
            if not (np.all(np.isfinite(norm.mean)) and np.all(np.isfinite(norm.std)) and np.all(norm.std > 0)):
                raise SnapshotError(f"{root}: manifest norm.{g} has a non-finite mean or a std that is not > 0")
        self.variables: dict[str, Variable] = self._read_variables()
        sidecar = artifacts.get("sidecar")
        self.sidecar = json.loads(self._opened.small[sidecar]) if sidecar in self._opened.small else None

    def _read_series(self, artifacts: dict[str, Any], n: int) -> None:
        """The series layout: map the row files and the window index, check that the index
        describes exactly these windows and rows, and present x/u/y (v2: timestamps, mask)."""
        m, root = self.manifest, self.root
        rows: dict[str, np.ndarray] = {}
        for key, (_, dtype) in SERIES_ARRAYS.items():
            if not artifacts.get(key):
                raise SnapshotError(f"{root}: a series manifest must list artifacts.{key}")
            name = str(artifacts[key])
            self.files[key] = name
            rows[key] = self._map(name, dtype, _int_list(m["shapes"].get(key), f"shapes.{key}", root))
        x_rows, future_rows = rows["xRows"].shape[0], rows["uRows"].shape[0]
        for key, width in (("xRows", len(self.nodes)), ("uRows", len(self.controls)), ("yRows", len(self.targets))):
            want = [x_rows if key == "xRows" else future_rows, width]
            if list(rows[key].shape) != want:
                raise SnapshotError(f"{root}: manifest shapes.{key} is {list(rows[key].shape)}, the node lists and "
                                    f"shapes.uRows give {want}")
        if rows["segments"].shape[0] != len(SEGMENT_FIELDS):
            raise SnapshotError(f"{root}: manifest shapes.segments must be [{len(SEGMENT_FIELDS)}, K]")
        if self.beat_ms is None or self.beat_ms <= 0:
            raise SnapshotError(f"{root}: a series manifest needs a positive beatMs")
        stride = (m.get("series") or {}).get("stride")
        if not isinstance(stride, int) or stride < 1:
            raise SnapshotError(f"{root}: a series manifest needs series.stride, a positive integer")
        if n and not self.blocks:
            raise SnapshotError(f"{root}: a series manifest needs split.blocks (the runs its window index names)")
        index = SeriesIndex(rows["segments"], windows=n, history=self.history_steps, horizon=self.horizon_steps,
                            stride=stride, beat_ms=self.beat_ms)
        index.validate(root, run_windows=[len(b) for b in self.blocks], x_rows=x_rows, future_rows=future_rows)
        self.index = index
        files = self._opened.files
        self._arrays["x"] = RowWindows("x", index, rows["xRows"], files[self.files["xRows"]], self.history_steps)
        self._arrays["u"] = RowWindows("u", index, rows["uRows"], files[self.files["uRows"]], self.horizon_steps)
        self._arrays["y"] = RowWindows("y", index, rows["yRows"], files[self.files["yRows"]], self.horizon_steps)
        if self.version >= 2:
            self._arrays["timestamps"] = TimestampWindows(index)
            self._arrays["mask"] = MaskWindows(index)

    def _map(self, name: str, dtype: Any, shape: list[int]) -> np.ndarray:
        dtype = np.dtype(dtype)
        f = self._opened.files[name]
        size = self._opened.identity[name][2]
        needed = math.prod(shape) * dtype.itemsize
        if size != needed:
            raise SnapshotError(f"{self.root}: {name} has {size} bytes, manifest shape {shape} needs {needed}")
        if needed == 0:
            empty = np.zeros(shape, dtype=dtype)
            empty.flags.writeable = False
            return empty
        return np.memmap(f, dtype=dtype, mode="r", shape=tuple(shape))

    def _read_blocks(self) -> list[Block]:
        raw = self.manifest["split"].get("blocks")
        if raw is None:
            return []
        blocks, start = [], 0
        for b in raw:
            size = int(b["uniqueSteps"])
            if b["split"] not in SPLITS or size < 0:
                raise SnapshotError(f"{self.root}: manifest split.blocks has an invalid block {b!r}")
            blocks.append(Block(str(b["runId"]), str(b["split"]), start, start + size))
            start += size
        # Blocks are in snapshot order, so each split's blocks must tile exactly its range.
        for part in SPLITS:
            mine = [b for b in blocks if b.split == part]
            r = self.split_range(part)
            if sum(len(b) for b in mine) != len(r) or (mine and (mine[0].start != r.start or mine[-1].stop != r.stop)):
                raise SnapshotError(
                    f"{self.root}: manifest split.blocks do not tile the {part} windows {r.start}..{r.stop}"
                )
        return blocks

    def _read_variables(self) -> dict[str, Variable]:
        roles = {n: "feature" for n in self.nodes}
        roles.update({n: "control" for n in self.controls})
        roles.update({n: "target" for n in self.targets})
        out = {n: Variable(n, roles[n], "", "", 1.0, 0.0) for n in self.nodes}
        for v in self.manifest.get("variables") or []:
            node = str(v.get("nodeId") or v.get("id"))
            if node not in out:
                continue
            scale, offset = float(v["scale"]), float(v["offset"])
            if not (math.isfinite(scale) and scale != 0 and math.isfinite(offset)):
                raise SnapshotError(f"{self.root}: variable {node!r} has an unusable unit transform ({scale}, {offset})")
            unit = str(v.get("unit") or "")
            out[node] = Variable(node, str(v.get("role") or roles[node]), unit, str(v.get("modelUnit") or unit), scale, offset)
        return out

    # ---- arrays ---------------------------------------------------------------------------

    @property
    def x(self) -> np.ndarray | WindowArray:
        return self._arrays["x"]

    @property
    def u(self) -> np.ndarray | WindowArray:
        return self._arrays["u"]

    @property
    def y(self) -> np.ndarray | WindowArray:
        return self._arrays["y"]

    @property
    def timestamps(self) -> np.ndarray | WindowArray | None:
        return self._arrays.get("timestamps")

    @property
    def mask(self) -> np.ndarray | WindowArray | None:
        return self._arrays.get("mask")

    def array(self, key: str) -> np.ndarray | WindowArray:
        """``x``, ``u``, ``y``, ``timestamps`` or ``mask`` by name."""
        if key not in self._arrays:
            have = ", ".join(self._arrays)
            raise KeyError(f"{self.root}: no array {key!r} in this v{self.version} snapshot (it has {have})")
        return self._arrays[key]

    @property
    def array_names(self) -> tuple[str, ...]:
        return tuple(self._arrays)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    # ---- split, runs, units --------------------------------------------------------------

    def split_range(self, split: str) -> range:
        """Window indices of one split (``train``, ``val``, ``test``; ``all`` for every window)."""
        c = self.counts
        if split == "all":
            return range(0, c["train"] + c["val"] + c["test"])
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)} or 'all', got {split!r}")
        start = {"train": 0, "val": c["train"], "test": c["train"] + c["val"]}[split]
        return range(start, start + c[split])

    def runs(self, split: str | None = None) -> list[Block]:
        """The blocks (one per run) of ``split``, or all, in snapshot order."""
        if split is not None:
            self.split_range(split)  # a name that is no split is refused, not an empty list
        return [b for b in self.blocks if split in (None, "all", b.split)]

    def columns(self, group: str) -> list[str]:
        """Node ids of the last axis of ``x`` (all nodes), ``u`` (controls) or ``y`` (targets)."""
        return {"x": self.nodes, "u": self.controls, "y": self.targets}[group]

    def to_model_units(self, group: str, values: np.ndarray) -> np.ndarray:
        """Stored values of ``x``/``u``/``y`` (or a model's output shaped like them) -> model units."""
        values = np.asarray(values)
        columns = self.columns(group)
        if values.ndim == 0 or values.shape[-1] != len(columns):
            raise ValueError(f"{group} values must have {len(columns)} columns ({', '.join(columns)}) on their last "
                             f"axis, got shape {values.shape}")
        return self.norm[group].denormalize(values)

    def to_engineering_units(self, group: str, values: np.ndarray) -> np.ndarray:
        """Stored values -> engineering units: de-normalised, then the v2 unit transform inverted."""
        model = self.to_model_units(group, values)
        cols = self.columns(group)
        scale = np.array([self.variables[c].scale for c in cols])
        offset = np.array([self.variables[c].offset for c in cols])
        return (model - offset) / scale

    def units(self, group: str = "x", *, engineering: bool = False) -> list[str]:
        """Unit of each column of ``group`` (model units unless ``engineering``; '' if unknown)."""
        return [self.variables[c].unit if engineering else self.variables[c].model_unit for c in self.columns(group)]

    # ---- batches --------------------------------------------------------------------------

    def iter_batches(
        self,
        split: str = "train",
        batch_size: int = 256,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        *,
        epoch: int = 0,
        fields: Sequence[str] = GROUPS,
        buffer_bytes: int | None = None,
        block_windows: int | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches of one split as dicts of new numpy arrays; see :func:`.batches.iter_batches`."""
        return iter_batches(self, split, batch_size, shuffle, seed, drop_last, epoch=epoch, fields=fields,
                            buffer_bytes=buffer_bytes, block_windows=block_windows)

    def read_windows(self, key: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Windows ``start:stop`` of one array, read from its file into ``out`` (or a new array),
        not through the map: a bounded copy that leaves nothing mapped behind."""
        arr = self.array(key)
        start, stop = whole_number("start", start, -(1 << 63)), whole_number("stop", stop, -(1 << 63))
        if not 0 <= start <= stop <= arr.shape[0]:
            raise IndexError(f"windows {start}:{stop} out of range for {key} with {arr.shape[0]} windows")
        shape = (stop - start, *arr.shape[1:])
        if out is None:
            out = np.empty(shape, dtype=arr.dtype)
        elif (not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != arr.dtype
              or not out.flags.c_contiguous or not out.flags.writeable):
            raise ValueError(f"out must be a writable C-contiguous {arr.dtype} numpy array of shape {shape} for "
                             f"windows {start}:{stop} of {key}")
        if out.size == 0:
            return out
        if isinstance(arr, WindowArray):
            return arr.read(start, stop, out)
        row = arr.dtype.itemsize * math.prod(arr.shape[1:])
        view = memoryview(out.reshape(-1).view(np.uint8))
        fd, offset, done = self._opened.files[self.files[key]].fileno(), start * row, 0
        while done < view.nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise SnapshotError(f"{self.root}: {self.files[key]} ended early (truncated since it was opened?)")
            done += n
        return out

    # ---- lifetime, pickling -----------------------------------------------------------------

    @property
    def file_ids(self) -> dict[str, FileId]:
        """(device, inode, size, mtime) of each hashed file, as opened (and verified)."""
        return dict(self._opened.identity)

    def close(self) -> None:
        """Close the files. Arrays already taken from the snapshot stay valid (a map outlives
        its file descriptor); new reads through :meth:`read_windows` fail."""
        self._opened.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Pickling the memmaps would copy every byte; a worker process reopens the same files.
        return {"root": str(self.root), "sha256": self.sha256, "verified": self.verified, "ids": self.file_ids}

    def __setstate__(self, state: dict[str, Any]) -> None:
        opened = reopen_files(Path(state["root"]), state["ids"])
        opened.sha256, opened.verified = state["sha256"], state["verified"]
        self.__init__(opened)  # type: ignore[misc]

    def reopen(self) -> Snapshot:
        """The same snapshot opened again (new file descriptors and maps, e.g. in a worker
        process), without hashing again: refused unless every file is still the one verified."""
        opened = reopen_files(self.root, self.file_ids)
        opened.sha256, opened.verified = self.sha256, self.verified
        return Snapshot(opened)

    def __repr__(self) -> str:
        c = self.counts
        state = "verified" if self.verified else "NOT verified"
        return (f"<Snapshot {self.root} v{self.version} {self.layout} sha256 {str(self.sha256)[:16]} ({state}); windows "
                f"train {c['train']} val {c['val']} test {c['test']}; x{list(self.x.shape)} u{list(self.u.shape)} "
                f"y{list(self.y.shape)}>")


def reopen_files(root: Path, ids: dict[str, FileId]) -> OpenedSnapshot:
    opened = open_files(root, verify=False)
    for name, f in opened.files.items():
        if name in ids and file_id(f) != tuple(ids[name]):
            opened.close()
            raise SnapshotError(f"{root}: {name} is not the file that was verified (replaced or modified since)",
                                code="SNAPSHOT_TAMPERED", changed=[name])
    return opened


def open_snapshot(
    path: str | os.PathLike[str],
    verify: bool = True,
    *,
    expected_sha256: str | None = None,
    use_catalog: bool = True,
) -> Snapshot:
    """Open the snapshot directory ``path`` (e.g. ``datasets/<spec>/current``).

    With ``verify`` (the default) every hashed byte is streamed through sha256 first (bounded
    memory, one pass) and compared with ``sha256.json``, with the datasets root's catalog when
    the snapshot sits in one (``use_catalog``), and with ``expected_sha256`` when given;
    :class:`SnapshotError` (``SNAPSHOT_TAMPERED``) names the files that changed. A snapshot
    whose manifest does not describe its files raises ``SNAPSHOT_INVALID``.
    """
    return Snapshot(open_files(path, verify=verify, expected_sha256=expected_sha256, use_catalog=use_catalog))
