"""The artifact store: per-run intermediate results of one dataset, as ``.npy`` files.

Layout: ``<root>/<spec id>/runs/<run id>/<stage>.<array>.npy`` plus ``<stage>.json`` (the stage's
summary), and dataset-level JSON files in ``<root>/<spec id>/``. Arrays are standard NumPy
``.npy`` files (``np.load(path, mmap_mode="r")`` opens any of them), written by appending, so a
stage never holds a whole run in memory, and read back in slices of the first axis.

A stage is committed in this order: its summary is removed (from then on the stage reads as
absent), its arrays are written to temporary files and renamed into place, then the summary is
written (atomically) last. The summary names the stage version it was built for, so a reader never
mixes a half-written stage, or a stage built for another version of the spec, into a dataset.
Running out of space is reported as ``DISK_FULL`` naming the path; nothing partial stays.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib import format as npy

from aml_pipeline.errors import BuildError, disk_full
from aml_pipeline.fsutil import dir_lock
from aml_pipeline.ids import check_external_id, check_spec_id
from aml_pipeline.pipeline.stages.base import Stage
from aml_pipeline.spec import DatasetSpec

if TYPE_CHECKING:
    from aml_pipeline.pipeline.registry import StageVersions


class DatasetStore:
    """Intermediate artifacts of one dataset spec, and whether each is current for its
    :class:`~aml_pipeline.pipeline.stages.StageVersions` (derived once, here or by the caller)."""

    def __init__(self, root: str | Path, spec: DatasetSpec, versions: StageVersions | None = None) -> None:
        self.root = Path(root)
        self.spec = spec
        self.spec_id = check_spec_id(spec.id, what="spec id")
        self.dir = self.root / spec.id
        if versions is None:
            # Imported here: the registry imports every stage module, and each of those imports
            # this one (a module-level import would be a circle).
            from aml_pipeline.pipeline.registry import StageVersions

            versions = StageVersions.of(spec)
        self.versions = versions
        # Run id -> its folder, validated once: every array read and written names it.
        self._run_dirs: dict[str, Path] = {}

    def run_dir(self, run_id: str) -> Path:
        found = self._run_dirs.get(run_id) if isinstance(run_id, str) else None
        if found is None:
            found = self._run_dirs[run_id] = self.dir / "runs" / check_external_id(run_id, what="run id")
        return found

    def meta_path(self, run_id: str, stage: Stage) -> Path:
        return self.run_dir(run_id) / f"{_run_stage(stage)}.json"

    def array_path(self, run_id: str, stage: Stage, name: str) -> Path:
        return self.run_dir(run_id) / f"{_run_stage(stage)}.{name}.npy"

    def file_path(self, run_id: str, stage: Stage, name: str) -> Path:
        """Where a small whole file of a stage (:meth:`StageWriter.file`) is once committed."""
        return self.run_dir(run_id) / f"{_run_stage(stage)}.{name}"

    @contextmanager
    def in_use(self, wait_s: float = 300.0) -> Iterator[None]:
        """Hold the spec's intermediates shared while building (``gc`` takes them exclusively)."""
        with dir_lock(self.dir, shared=True, wait_s=wait_s) as locked:
            if not locked:
                raise BuildError(
                    f"{self.dir}: gc is cleaning this dataset's intermediates; waited {wait_s:g} s", code="STORE_BUSY"
                )
            yield

    def read_meta(self, run_id: str, stage: Stage) -> dict[str, Any] | None:
        """The stored summary of a run's stage, current or not (None: not stored)."""
        try:
            return json.loads(self.meta_path(run_id, stage).read_bytes())
        except FileNotFoundError:
            return None

    def require(self, run_id: str, stage: Stage) -> dict[str, Any]:
        """The current summary of a run's stage, which a later stage reads; else a BuildError."""
        meta = self.read_meta(run_id, stage)
        if meta is None:
            raise BuildError(f"run {run_id!r}: {stage} stage has not been materialised for spec {self.spec_id!r}")
        if not self.versions.is_current(stage, meta):
            raise BuildError(
                f"run {run_id!r}: the stored {stage} stage was built for another version of spec "
                f"{self.spec_id!r} (fingerprint {meta.get('fingerprint')}, now {self.versions[stage]}); rematerialise the run"
            )
        return meta

    @contextmanager
    def stage_writer(self, run_id: str, stage: Stage) -> Iterator[StageWriter]:
        """Write a stage: arrays through the writer, then :meth:`StageWriter.commit` the summary."""
        writer = StageWriter(self, run_id, stage)
        try:
            yield writer
            if not writer.committed:
                raise RuntimeError(f"run {run_id!r}: {stage} stage was written but not committed")
        finally:
            writer.discard()

    def read_flat(self, run_id: str, stage: Stage, name: str, start: int, stop: int) -> np.ndarray:
        """Elements ``start..stop-1`` of an array, in C order (a flat copy, no memory map)."""
        return read_npy_flat(self.array_path(run_id, stage, name), start, stop)

    def read_rows(self, run_id: str, stage: Stage, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start..stop-1`` (first axis) of an array."""
        return read_npy_rows(self.array_path(run_id, stage, name), start, stop)

    def array_shape(self, run_id: str, stage: Stage, name: str) -> tuple[int, ...]:
        return npy_header(self.array_path(run_id, stage, name))[0]

    # ---- dataset stages: one JSON file each ---------------------------------------------------

    def dataset_stage_path(self, stage: Stage) -> Path:
        return self.dir / _dataset_stage_file(stage)

    def write_dataset_stage(self, stage: Stage, body: Mapping[str, Any]) -> Path:
        """A dataset stage's result, stamped with its current fingerprint."""
        return self.write_json(_dataset_stage_file(stage), {"fingerprint": self.versions[stage], **body})

    def current_dataset_stage(self, stage: Stage) -> dict[str, Any] | None:
        """A dataset stage's stored result if it was built for the spec's current version."""
        try:
            stored = self.read_json(_dataset_stage_file(stage))
        except FileNotFoundError:
            return None
        return stored if self.versions.is_current(stage, stored) else None

    def require_dataset_stage(self, stage: Stage) -> dict[str, Any]:
        """A dataset stage's current result, which a later stage reads; else a BuildError."""
        try:
            stored = self.read_json(_dataset_stage_file(stage))
        except FileNotFoundError:
            raise BuildError(f"spec {self.spec_id!r}: {stage.asset} has not been materialised yet") from None
        if not self.versions.is_current(stage, stored):
            raise BuildError(
                f"spec {self.spec_id!r}: the stored {stage.asset} was built for another version of the spec; "
                f"rematerialise {stage.asset}"
            )
        return stored

    def write_json(self, name: str, obj: Any) -> Path:
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(obj, indent=1, allow_nan=False).encode())
        return path

    def read_json(self, name: str) -> Any:
        return json.loads((self.dir / name).read_bytes())


class StageWriter:
    """Arrays of one stage of one run, appended to temporary files until :meth:`commit`."""

    def __init__(self, store: DatasetStore, run_id: str, stage: str) -> None:
        self.store, self.run_id, self.stage = store, run_id, stage
        self.dir = store.run_dir(run_id)
        _os_call(self.dir.mkdir, parents=True, exist_ok=True, path=self.dir)
        # From here until commit the stage reads as absent.
        store.meta_path(run_id, stage).unlink(missing_ok=True)
        self._arrays: dict[str, NpyAppender] = {}
        self._files: dict[str, Path] = {}
        self.committed = False

    def array(self, name: str, dtype: Any, tail_shape: tuple[int, ...] = (), *, rows: int | None = None) -> NpyAppender:
        """An array of ``dtype`` whose first axis grows as data is appended (C order); ``rows``:
        the first axis's length when a row holds no values (a tail with a 0), which the values
        appended cannot tell."""
        if name in self._arrays:
            raise ValueError(f"array {name!r} of the {self.stage} stage is already open")
        tmp = self.dir / f".{self.stage}.{name}.{uuid.uuid4().hex[:12]}.tmp"
        appender = NpyAppender(tmp, dtype, tail_shape, rows=rows)
        self._arrays[name] = appender
        return appender

    def file(self, name: str) -> Path:
        """A temporary path for a small whole file of the stage (``<stage>.<name>`` once committed)."""
        tmp = self.dir / f".{self.stage}.{name}.{uuid.uuid4().hex[:12]}.tmp"
        self._files[name] = tmp
        return tmp

    def commit(self, meta: Mapping[str, Any]) -> None:
        """Finish every array, rename them into place, then write the summary (last)."""
        for name, appender in self._arrays.items():
            appender.close()
            target = self.store.array_path(self.run_id, self.stage, name)
            _os_call(os.replace, appender.path, target, path=target)
        for name, tmp in self._files.items():
            target = self.store.file_path(self.run_id, self.stage, name)
            _os_call(os.replace, tmp, target, path=target)
        self._files.clear()
        # Compact: with ``indent`` json uses its pure-Python encoder, several ms per stage.
        data = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
        atomic_write_bytes(self.store.meta_path(self.run_id, self.stage), data)
        self.committed = True
        self._arrays.clear()

    def discard(self) -> None:
        for appender in self._arrays.values():
            appender.abort()
        self._arrays.clear()
        for tmp in self._files.values():
            tmp.unlink(missing_ok=True)
        self._files.clear()


# Buffers per writev call (POSIX guarantees at least 16; Linux takes 1024).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16


class NpyAppender:
    """A ``.npy`` file written by appending along the first axis.

    The header is written first for an empty array and rewritten in place with the final shape on
    :meth:`close`; NumPy pads every header so that the first axis can grow to 21 digits without
    changing its length (``numpy.lib.format.GROWTH_AXIS_MAX_DIGITS``), which is what makes this
    legal ``.npy``.
    """

    def __init__(self, path: Path, dtype: Any, tail_shape: tuple[int, ...] = (), *, rows: int | None = None) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.tail = tuple(int(d) for d in tail_shape)
        self._per_row = int(np.prod(self.tail, dtype=np.int64)) if self.tail else 1
        self._empty_rows = rows
        self.elements = 0
        self._f = _os_call(open, self.path, "wb", buffering=0, path=self.path)
        self._header_len = self._write_header(0)
        self.closed = False

    def _write_header(self, rows: int) -> int:
        header = {"descr": npy.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (rows, *self.tail)}
        self._f.seek(0)
        start = self._f.tell()
        _os_call(npy.write_array_header_1_0, self._f, header, path=self.path)
        return self._f.tell() - start

    def append(self, data: np.ndarray) -> None:
        a = np.ascontiguousarray(data, dtype=self.dtype)
        if a.size:
            view = memoryview(a.reshape(-1)).cast("B")
            while view:
                n = _os_call(self._f.write, view, path=self.path)
                view = view[n:]
            self.elements += a.size

    def extend(self, parts: list[np.ndarray]) -> None:
        """:meth:`append` of each of ``parts`` in order, in as few writes as the OS allows: the
        file system's cost is per write as much as per byte, and a run read whole comes in one
        small page per node."""
        views = []
        for data in parts:
            a = np.ascontiguousarray(data, dtype=self.dtype)
            if a.size:
                views.append(memoryview(a.reshape(-1)).cast("B"))
                self.elements += a.size
        fd = self._f.fileno()
        while views:
            n = _os_call(os.writev, fd, views[:_IOV_MAX], path=self.path)
            while views and n >= len(views[0]):  # whole buffers written; a partial one goes on
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]

    def close(self) -> tuple[int, ...]:
        if self._per_row == 0:  # rows of no values: as many as the writer said
            if self.elements or self._empty_rows is None:
                raise ValueError(f"{self.path}: rows of shape {self.tail} hold no values; give their number (rows=)")
            rows = self._empty_rows
        elif self.elements % self._per_row:
            raise ValueError(
                f"{self.path}: {self.elements} values do not fill whole rows of shape {self.tail}"
            )
        else:
            rows = self.elements // self._per_row
        end = self._f.tell()
        if self._write_header(rows) != self._header_len:
            raise AssertionError(f"{self.path}: the .npy header changed length")
        self._f.seek(end)
        self._f.close()
        self.closed = True
        return (rows, *self.tail)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.path.unlink(missing_ok=True)


def npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """Shape, dtype and data offset of a C-ordered ``.npy`` file."""
    st = os.stat(path)
    # Stage files are replaced by rename, never rewritten: (inode, mtime, size) names one version.
    return _npy_header(str(path), st.st_ino, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4096)
def _npy_header(path: str, ino: int, mtime_ns: int, size: int) -> tuple[tuple[int, ...], np.dtype, int]:
    with open(path, "rb") as f:
        version = npy.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npy.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = npy.read_array_header_2_0(f)
        else:
            raise ValueError(f"{path}: .npy format version {version} is not supported")
        if fortran:
            raise ValueError(f"{path}: Fortran-ordered arrays are not written by this store")
        return tuple(shape), dtype, f.tell()


def read_npy_flat(path: Path, start: int, stop: int) -> np.ndarray:
    """Elements ``start..stop-1`` (C order) of a ``.npy`` file, read without a memory map (the
    pages of a map would count against the process's memory for as long as it exists)."""
    shape, dtype, offset = npy_header(path)
    total = int(np.prod(shape, dtype=np.int64))
    if not 0 <= start <= stop <= total:
        raise ValueError(f"{path}: elements {start}..{stop} outside an array of {total}")
    out = np.fromfile(path, dtype=dtype, count=stop - start, offset=offset + start * dtype.itemsize)
    if out.size != stop - start:
        raise ValueError(f"{path}: truncated (wanted {stop - start} values at {start}, got {out.size})")
    return out


def read_npy_rows(path: Path, start: int, stop: int) -> np.ndarray:
    """Rows ``start..stop-1`` (first axis) of a ``.npy`` file, without a memory map."""
    shape, _, _ = npy_header(path)
    per_row = int(np.prod(shape[1:], dtype=np.int64))
    stop = min(stop, shape[0]) if shape else stop
    return read_npy_flat(path, start * per_row, stop * per_row).reshape(-1, *shape[1:])


def _write_and_close(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and one rename. An error is named by
    ``path``, not by the temporary file, which is gone and was never the caller's (a directory or
    a missing folder where ``path`` goes shows as the temporary file's or the rename's error)."""
    tmp = None
    try:
        fd, tmp = _os_call(tempfile.mkstemp, prefix=f".{path.name}.", suffix=".tmp", dir=path.parent, path=path)
        # The whole write, close included: a small file reaches the disk only when its buffer is
        # flushed as it closes, and that is where a full disk shows.
        _os_call(_write_and_close, fd, data, path=path)
        _os_call(os.replace, tmp, path, path=path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and _names_the_temporary(e.filename, path):
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def _names_the_temporary(filename: object, path: Path) -> bool:
    if filename is None:
        return True
    return isinstance(filename, (str, bytes)) and Path(os.fsdecode(filename)).name.startswith(f".{path.name}.")


def _os_call(fn, *args, path: Path, **kwargs):
    """``fn(*args, **kwargs)``, with running out of space reported as DISK_FULL naming ``path``."""
    try:
        return fn(*args, **kwargs)
    except OSError as e:
        full = disk_full(e, path.parent if path.name.startswith(".") else path)
        if full is not None:
            raise full from None
        raise


def _run_stage(stage: Stage) -> str:
    if not stage.per_run:
        raise ValueError(f"{stage} is a dataset stage; it has no per-run files")
    return stage.name


def _dataset_stage_file(stage: Stage) -> str:
    if stage.per_run:
        raise ValueError(f"{stage} is a run stage; its results are per run")
    return stage.files[0]
