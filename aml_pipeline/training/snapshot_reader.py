"""Read a published snapshot through its manifest, verifying its hash first.

Self-contained on purpose (standard library + numpy only, no ``aml_pipeline`` import): it runs
inside the shared environment, next to the training scripts, and is what a consumer on another
machine needs to trust and read a snapshot. The hash is DESIGN.md section 4.9, exactly as
``aml_pipeline/core/hashing.py`` computes it: sha256 over the bytes of ``spec.json``, then for
each of ``manifest.json``, ``arrays/x.f32``, ``arrays/u.f32``, ``arrays/y.f32`` and (manifest v2)
every other artifact in ``manifest.artifacts`` not already listed: the relative name (UTF-8),
then the file's bytes. The recorded digest is ``sha256.json``'s ``"sha256"``.

The arrays are parsed from the very bytes that were hashed (no re-read after verification).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SPEC_FILE = "spec.json"
MANIFEST_FILE = "manifest.json"
DIGEST_FILE = "sha256.json"
ARRAY_FILES = {"x": "arrays/x.f32", "u": "arrays/u.f32", "y": "arrays/y.f32"}
V1_FILES = (MANIFEST_FILE, ARRAY_FILES["x"], ARRAY_FILES["u"], ARRAY_FILES["y"])
SPLITS = ("train", "val", "test")
_CHUNK = 8 << 20


class SnapshotError(Exception):
    """A snapshot that must not be trained on. ``code``: SNAPSHOT_TAMPERED or SNAPSHOT_INVALID."""

    def __init__(self, message: str, *, code: str = "SNAPSHOT_INVALID", changed: list[str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.changed = list(changed or [])


def hashed_files(manifest: dict[str, Any]) -> list[str]:
    files = list(V1_FILES)
    if manifest.get("version") == 2:
        for name in (manifest.get("artifacts") or {}).values():
            if name not in files:
                files.append(str(name))
    return files


def _safe_path(root: Path, name: str) -> Path:
    path = (root / name).resolve()
    if root.resolve() not in path.parents:
        raise SnapshotError(f"{root}: manifest artifact {name!r} points outside the snapshot")
    return path


@dataclass
class Digest:
    sha256: str
    files: dict[str, str]  # per-file sha256, to name what changed
    kept: dict[str, bytes]  # bytes of the files asked to keep (hashed and returned as one read)


def digest_snapshot(root: str | os.PathLike[str], keep: tuple[str, ...] = ()) -> Digest:
    """Recompute the snapshot hash; keep the bytes of the files named in ``keep``."""
    root = Path(root)
    try:
        spec_bytes = (root / SPEC_FILE).read_bytes()
        manifest_bytes = (root / MANIFEST_FILE).read_bytes()
    except FileNotFoundError as e:
        raise SnapshotError(f"{root}: {Path(e.filename).name} is missing", code="SNAPSHOT_TAMPERED",
                            changed=[Path(e.filename).name]) from None
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError as e:
        raise SnapshotError(f"{root}: manifest.json is not JSON ({e}); hash mismatch, refusing to train",
                            code="SNAPSHOT_TAMPERED",
                            changed=[MANIFEST_FILE]) from None
    total = hashlib.sha256(spec_bytes)
    files = {SPEC_FILE: hashlib.sha256(spec_bytes).hexdigest()}
    kept: dict[str, bytes] = {}
    for name in hashed_files(manifest):
        total.update(name.encode("utf-8"))
        one = hashlib.sha256()
        if name == MANIFEST_FILE:
            total.update(manifest_bytes)
            one.update(manifest_bytes)
            kept[name] = manifest_bytes
        else:
            path = _safe_path(root, name)
            try:
                if name in keep:
                    data = path.read_bytes()
                    total.update(data)
                    one.update(data)
                    kept[name] = data
                else:
                    with open(path, "rb") as f:
                        while chunk := f.read(_CHUNK):
                            total.update(chunk)
                            one.update(chunk)
            except FileNotFoundError:
                raise SnapshotError(f"{root}: {name} is missing", code="SNAPSHOT_TAMPERED", changed=[name]) from None
        files[name] = one.hexdigest()
    return Digest(total.hexdigest(), files, kept)


def verify_snapshot(
    root: str | os.PathLike[str], expected_sha256: str | None = None, keep: tuple[str, ...] = ()
) -> Digest:
    """The snapshot's digest if it matches ``sha256.json`` (and ``expected_sha256``, e.g. the
    catalog's, when given); else :class:`SnapshotError` naming the changed files and both hashes."""
    root = Path(root)
    try:
        recorded = json.loads((root / DIGEST_FILE).read_bytes())
    except FileNotFoundError:
        raise SnapshotError(f"{root}: {DIGEST_FILE} is missing; refusing an unverifiable snapshot",
                            code="SNAPSHOT_TAMPERED", changed=[DIGEST_FILE]) from None
    except ValueError as e:
        raise SnapshotError(f"{root}: {DIGEST_FILE} is unreadable ({e})", code="SNAPSHOT_TAMPERED",
                            changed=[DIGEST_FILE]) from None
    digest = digest_snapshot(root, keep)
    wanted = [("sha256.json", recorded.get("sha256"))]
    if expected_sha256:
        wanted.append(("the catalog", expected_sha256))
    for source, value in wanted:
        if not isinstance(value, str) or not hmac.compare_digest(value, digest.sha256):
            rec_files = recorded.get("files") or {}
            changed = sorted(n for n in set(digest.files) | set(rec_files) if digest.files.get(n) != rec_files.get(n))
            if changed:
                what = ", ".join(changed)
            elif source == "the catalog":
                what = f"unknown: {DIGEST_FILE} was rewritten to match the files"
            else:
                what = f"(the recorded digest in {DIGEST_FILE} itself)"
            raise SnapshotError(
                f"{root}: hash mismatch, refusing to train: recomputed sha256 {digest.sha256} != {value} "
                f"recorded in {source}; changed: {what}",
                code="SNAPSHOT_TAMPERED",
                changed=changed,
            )
    return digest


@dataclass
class Snapshot:
    """A verified snapshot: manifest, arrays (float32, windows ordered train, val, test)."""

    root: Path
    sha256: str
    manifest: dict[str, Any]
    x: np.ndarray  # [N, H, nodes]  normalised
    u: np.ndarray  # [N, F, controls]
    y: np.ndarray  # [N, F, targets]

    @property
    def counts(self) -> dict[str, int]:
        split = self.manifest["split"]
        return {p: int(split[p]) for p in SPLITS}

    def part(self, name: str) -> slice:
        """Windows of one split (they are stored train, then val, then test)."""
        c = self.counts
        start = {"train": 0, "val": c["train"], "test": c["train"] + c["val"]}[name]
        return slice(start, start + c[name])

    def norm(self, group: str) -> tuple[np.ndarray, np.ndarray]:
        g = self.manifest["norm"][group]
        return np.asarray(g["mean"], dtype=np.float64), np.asarray(g["std"], dtype=np.float64)

    @property
    def targets(self) -> list[str]:
        return list(self.manifest["targets"])

    def units(self) -> dict[str, str]:
        """Model unit per node id (manifest v2 variables), '' when unknown."""
        return {v.get("nodeId", v.get("id")): v.get("modelUnit") or v.get("unit") or "" for v in self.manifest.get("variables") or []}


def _array(data: bytes, shape: list[int], name: str, root: Path) -> np.ndarray:
    expected = int(np.prod(shape, dtype=np.int64)) * 4
    if len(data) != expected:
        raise SnapshotError(f"{root}: {name} has {len(data)} bytes, manifest shape {shape} needs {expected}")
    return np.frombuffer(data, dtype="<f4").reshape(shape)


def load_snapshot(root: str | os.PathLike[str], expected_sha256: str | None = None) -> Snapshot:
    """Verify, then parse the hashed bytes: :class:`SnapshotError` if anything does not match."""
    root = Path(root)
    digest = verify_snapshot(root, expected_sha256, keep=tuple(ARRAY_FILES.values()))
    manifest = json.loads(digest.kept[MANIFEST_FILE])
    try:
        shapes = manifest["shapes"]
        arrays = {k: _array(digest.kept[name], shapes[k], name, root) for k, name in ARRAY_FILES.items()}
        counts = [int(manifest["split"][p]) for p in SPLITS]
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"{root}: manifest.json lacks what a reader needs ({type(e).__name__}: {e})") from None
    n = shapes["x"][0]
    if sum(counts) != n or shapes["u"][0] != n or shapes["y"][0] != n:
        raise SnapshotError(f"{root}: split counts {counts} and shapes {shapes} disagree")
    return Snapshot(root, digest.sha256, manifest, arrays["x"], arrays["u"], arrays["y"])


__all__ = ["Snapshot", "SnapshotError", "digest_snapshot", "hashed_files", "load_snapshot", "verify_snapshot"]
