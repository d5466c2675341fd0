"""The snapshot's files and the one error a reader raises.

A published snapshot directory holds ``spec.json``, ``manifest.json``, ``sha256.json`` (the
recorded hash, beside the hashed files), ``report.json`` (diagnostics, not hashed) and
``arrays/``: ``x.f32 [N, H, nodes]``, ``u.f32 [N, F, controls]``, ``y.f32 [N, F, targets]``
(little-endian float32, C order, stored normalised) and, in manifest v2, ``timestamps.f64
[N, H+F]`` (epoch ms as float64), ``mask.f32 [N, H+F]`` and ``sidecar.json``.

The hash: sha256 over the bytes of ``spec.json``, then for each name of :func:`hashed_files`
in order, the name (UTF-8) followed by the file's bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SPEC_FILE = "spec.json"
MANIFEST_FILE = "manifest.json"
DIGEST_FILE = "sha256.json"
CATALOG_FILE = "catalog.sqlite"
V1_FILES = (MANIFEST_FILE, "arrays/x.f32", "arrays/u.f32", "arrays/y.f32")
SPLITS = ("train", "val", "test")
# Array name -> (manifest artifact key, file, dtype). timestamps and mask exist in v2 only.
ARRAYS = {
    "x": ("arrays/x.f32", "<f4"),
    "u": ("arrays/u.f32", "<f4"),
    "y": ("arrays/y.f32", "<f4"),
    "timestamps": ("arrays/timestamps.f64", "<f8"),
    "mask": ("arrays/mask.f32", "<f4"),
}
V1_ARRAYS = ("x", "u", "y")

# The pipeline's rule for run ids (aml_pipeline/ids.py), repeated here because this package
# imports nothing else of aml_pipeline: a snapshot whose run ids break it was not made by it.
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}$")


class SnapshotError(Exception):
    """A snapshot that must not be used.

    ``code`` is ``SNAPSHOT_TAMPERED`` (bytes differ from the recorded hash, or a hashed file is
    missing) or ``SNAPSHOT_INVALID`` (it verifies, but does not describe readable arrays);
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
    arrays, v2 also every other artifact the manifest lists."""
    files = list(V1_FILES)
    if manifest.get("version") == 2:
        for name in (manifest.get("artifacts") or {}).values():
            if name not in files:
                files.append(str(name))
    return files


def inside(root: Path, name: str) -> Path:
    """``root / name``, refusing a name that leaves the snapshot (``..``, absolute, a symlink out)."""
    path = (root / name).resolve()
    if root.resolve() not in path.parents:
        raise SnapshotError(f"{root}: manifest artifact {name!r} points outside the snapshot")
    return path
