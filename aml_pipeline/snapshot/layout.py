"""The snapshot's files and the one error a reader raises.

A published snapshot directory holds ``spec.json``, ``manifest.json``, ``sha256.json`` (the
recorded hash, beside the hashed files), ``report.json`` (diagnostics, not hashed) and
``arrays/``, in one of two layouts (the manifest's ``layout``; absent means ``windows``):

* ``windows`` (the predecessor's): ``x.f32 [N, H, nodes]``, ``u.f32 [N, F, controls]``,
  ``y.f32 [N, F, targets]`` (little-endian float32, C order, stored normalised) and, in manifest
  v2, ``timestamps.f64 [N, H+F]`` (epoch ms as float64), ``mask.f32 [N, H+F]`` and
  ``sidecar.json``;
* ``series``: every grid row windows read, once: ``x_rows.f32 [Rx, nodes]`` (rows some window
  reads as history), ``u_rows.f32 [Rf, controls]`` and ``y_rows.f32 [Rf, targets]`` (rows some
  window reads as future), normalised as the windows layout stores them, and the window index
  ``segments.i64 [6, K]`` (:data:`SEGMENT_FIELDS`; v2 adds ``sidecar.json``). Windows are cut
  from the rows when read (:mod:`aml_pipeline.snapshot.series`).

The hash: sha256 over the bytes of ``spec.json``, then for each name of :func:`hashed_files`
in order, the name (UTF-8) followed by the file's bytes.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SPEC_FILE = "spec.json"
MANIFEST_FILE = "manifest.json"
DIGEST_FILE = "sha256.json"
CATALOG_FILE = "catalog.sqlite"
SPLITS = ("train", "val", "test")
# Array kind (the manifest's artifact key) -> (file, dtype). timestamps and mask exist in v2 only.
ARRAYS = {
    "x": ("arrays/x.f32", "<f4"),
    "u": ("arrays/u.f32", "<f4"),
    "y": ("arrays/y.f32", "<f4"),
    "timestamps": ("arrays/timestamps.f64", "<f8"),
    "mask": ("arrays/mask.f32", "<f4"),
}
V1_ARRAYS = ("x", "u", "y")
SIDECAR_FILE = "arrays/sidecar.json"
V1_FILES = (MANIFEST_FILE, *(ARRAYS[k][0] for k in V1_ARRAYS))

WINDOWS_LAYOUT, SERIES_LAYOUT = "windows", "series"
LAYOUTS = (WINDOWS_LAYOUT, SERIES_LAYOUT)
# The series layout's files (the manifest's artifact and shape keys) -> (file, dtype), in hash order.
SERIES_ARRAYS = {
    "xRows": ("arrays/x_rows.f32", "<f4"),
    "uRows": ("arrays/u_rows.f32", "<f4"),
    "yRows": ("arrays/y_rows.f32", "<f4"),
    "segments": ("arrays/segments.i64", "<i8"),
}
# The row file each window group is cut from.
SERIES_ROWS = {"x": "xRows", "u": "uRows", "y": "yRows"}
# The rows of segments.i64, one field per row (each field contiguous). A segment is a maximal
# stretch of one run's windows whose starts are ``stride`` apart; its windows are ``window ..``
# the next segment's ``window - 1`` (the last segment's: ``.. N - 1``).
SEGMENT_FIELDS = (
    "run",  # the run's position in the snapshot's run order (``split.blocks``)
    "window",  # index of the segment's first window
    "start",  # grid row of the run at which that window's future starts (its row t)
    "startMs",  # epoch ms of that grid row
    "xRow",  # row of x_rows.f32 holding the window's first history row (grid row t - H)
    "futureRow",  # row of u_rows.f32 and y_rows.f32 holding grid row t
)


def manifest_layout(manifest: Mapping[str, Any]) -> str:
    """The manifest's ``layout`` (absent: ``windows``, every snapshot written before there was a choice)."""
    return str(manifest.get("layout") or WINDOWS_LAYOUT)

# The pipeline's rule for run ids (aml_pipeline/ids.py), repeated here because this package
# imports nothing else of aml_pipeline: a snapshot whose run ids break it was not made by it.
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}$")


class SnapshotError(Exception):
    """A snapshot that must not be used.

    ``code`` is ``SNAPSHOT_TAMPERED`` (bytes differ from the recorded hash, or a hashed file is
    missing), ``SNAPSHOT_INVALID`` (it verifies, but does not describe readable arrays) or
    ``NOT_A_SNAPSHOT`` (a folder with none of a snapshot's files);
    ``changed`` names the files that differ, as relative paths.
    """

    def __init__(self, message: str, *, code: str = "SNAPSHOT_INVALID", changed: list[str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.changed = list(changed or [])

    def one_line(self) -> str:
        return f"{self.code}: {' '.join(str(self).split())}"


def hashed_files(manifest: Mapping[str, Any]) -> list[str]:
    """Relative names hashed after ``spec.json``, in hash order: v1 the manifest and the three
    arrays, v2 also every other artifact the manifest lists. A series snapshot lists every file
    it hashes after the manifest in ``artifacts`` (it has no ``x.f32``, ``u.f32``, ``y.f32``).
    A manifest of another shape (not an object, ``artifacts`` not an object of file names) is a
    ``ValueError`` naming it: no snapshot this project wrote has one."""
    if not isinstance(manifest, Mapping):
        raise ValueError(f"{MANIFEST_FILE} is not a JSON object")
    artifacts = manifest.get("artifacts") or {}
    if not isinstance(artifacts, Mapping) or not all(isinstance(n, str) and n for n in artifacts.values()):
        raise ValueError(f"{MANIFEST_FILE}: artifacts is not an object of file names")
    series = manifest_layout(manifest) == SERIES_LAYOUT
    files = [MANIFEST_FILE] if series else list(V1_FILES)
    if series or manifest.get("version") == 2:
        for name in artifacts.values():
            if name not in files:
                files.append(name)
    return files


class SnapshotHasher:
    """The snapshot hash, fed as the files are read or written: ``spec.json``'s bytes, then for
    each hashed file (:func:`hashed_files` order) :meth:`begin` with its name, its bytes through
    :meth:`update`, :meth:`end`. With ``per_file`` it also keeps each file's own sha256
    (:attr:`files`), which names what changed when the hash does not match."""

    def __init__(self, spec_json: bytes, *, per_file: bool = True) -> None:
        self._total = hashlib.sha256(spec_json)
        self.per_file = per_file
        self.files: dict[str, str] = {SPEC_FILE: hashlib.sha256(spec_json).hexdigest()} if per_file else {}
        self._name: str | None = None
        self._file: Any = None

    def begin(self, name: str) -> None:
        if self._name is not None:
            raise RuntimeError(f"file {self._name} is still open in the hasher")
        self._total.update(name.encode("utf-8"))
        self._name, self._file = name, hashlib.sha256() if self.per_file else None

    def update(self, data: bytes | memoryview) -> None:
        self._total.update(data)
        if self._file is not None:
            self._file.update(data)

    def end(self) -> None:
        assert self._name is not None
        if self._file is not None:
            self.files[self._name] = self._file.hexdigest()
        self._name, self._file = None, None

    def add_file(self, name: str, path: Path) -> None:
        self.begin(name)
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(_HASH_CHUNK):
                self.update(chunk)
        self.end()

    def hexdigest(self) -> str:
        return self._total.hexdigest()


_HASH_CHUNK = 8 << 20


def inside(root: Path, name: str) -> Path:
    """``root / name``, refusing a name that leaves the snapshot (``..``, absolute, a symlink out)."""
    path = (root / name).resolve()
    if root.resolve() not in path.parents:
        raise SnapshotError(f"{root}: manifest artifact {name!r} points outside the snapshot")
    return path
