"""A snapshot rewritten in the windows layout: what the predecessor's trainers read.

``aml-pipeline export SNAPSHOT --layout windows --out DIR`` turns a series snapshot into the
snapshot the same spec without ``layout`` builds from the same data: ``spec.json`` without the
key, the windows layout's manifest (:func:`~aml_pipeline.core.manifest.windows_manifest`), the
windows read through :func:`~aml_pipeline.snapshot.open_snapshot` (verified first) and written
as ``x.f32``, ``u.f32``, ``y.f32`` (v2: ``timestamps.f64``, ``mask.f32``), the sidecar, and the
hash over them; so the arrays are byte-identical and, for v1, the sha256 too (a v2 manifest keeps
the series build's ``capturedAt``). A windows snapshot is copied as it is.

Windows are read and written a block at a time, hashed and fsynced as written; ``DIR`` (which
must not exist, or be empty) appears complete or not at all.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.core.hashing import SnapshotDigest
from aml_pipeline.core.manifest import to_json_bytes, windows_manifest
from aml_pipeline.errors import disk_full
from aml_pipeline.faults import crash_point
from aml_pipeline.fsutil import fsync_dir, remove_tree
from aml_pipeline.pipeline.snapshot_writer import StagedFiles
from aml_pipeline.snapshot import Snapshot, SnapshotError, open_snapshot
from aml_pipeline.snapshot.export import staging_beside
from aml_pipeline.snapshot.layout import ARRAYS, DIGEST_FILE, MANIFEST_FILE, SIDECAR_FILE, SPEC_FILE

# Bytes of windows read per block: the export holds a few of these whatever the snapshot's size.
_BLOCK_BYTES = 16 << 20


def _blocks(snap: Snapshot, kind: str) -> Iterator[np.ndarray]:
    """All windows of one array, in order, a new array per block (the hasher keeps each one)."""
    arr = snap.array(kind)
    per_window = max(1, arr.dtype.itemsize * int(np.prod(arr.shape[1:])))
    step = max(1, _BLOCK_BYTES // per_window)
    for start in range(0, len(snap), step):
        yield snap.read_windows(kind, start, min(len(snap), start + step))


def export_windows_layout(snapshot: Snapshot | str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Write ``snapshot`` (a path is opened and verified first; an open snapshot must have been
    verified) in the windows layout to ``out_dir``; returns ``{outDir, layout, sha256, verified, files}``.

    ``out_dir`` must not exist or be empty (:class:`FileExistsError` otherwise).
    """
    snap = snapshot if isinstance(snapshot, Snapshot) else open_snapshot(snapshot)
    if not snap.verified:
        # The result is a snapshot with a hash of its own: written from unchecked bytes, that hash
        # would vouch for them.
        raise SnapshotError(f"{snap.root}: opened without verifying; the windows layout is written only from a "
                            "verified snapshot (its new hash would vouch for bytes nobody checked)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_beside(out)
    try:
        (tmp / "arrays").mkdir(parents=True)
        spec = {k: v for k, v in snap.spec.items() if k != "layout"}
        spec_json = (json.dumps(spec, indent=2, ensure_ascii=False) + "\n").encode()
        manifest = windows_manifest(snap.manifest)
        if manifest["spec"] != spec:
            raise ValueError(f"{snap.root}: the manifest's spec is not spec.json's")
        with StagedFiles(tmp, spec_json) as files:
            files.write(MANIFEST_FILE, to_json_bytes(manifest))
            kinds = ["x", "u", "y"] + (["timestamps", "mask"] if manifest["version"] == 2 else [])
            for kind in kinds:
                name, dtype = ARRAYS[kind]
                files.stream(name, dtype, _blocks(snap, kind))
            if manifest["version"] == 2:
                files.write(SIDECAR_FILE, to_json_bytes(snap.sidecar))
            report = snap.root / "report.json"
            if report.is_file():  # diagnostics, not hashed: the same for both layouts
                files.write("report.json", report.read_bytes(), hashed=False)
            digest = files.finish()
        digests = dict(files.hasher.files)
        with open(tmp / DIGEST_FILE, "wb") as f:  # beside the hashed files, as a published snapshot's
            f.write(SnapshotDigest(digest, digests).to_json_bytes())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp / "arrays")
        fsync_dir(tmp)
        crash_point("export.staged")
        os.rename(tmp, out)  # replaces an empty directory, fails on a non-empty one
        fsync_dir(out.parent)
    except BaseException as e:
        remove_tree(tmp, ignore_errors=True)
        # DISK_FULL naming --out for any caller, not only the CLI's.
        full = disk_full(e, out) if isinstance(e, OSError) else None
        if full is not None:
            raise full from None
        raise
    return {"outDir": str(out), "layout": "windows", "sha256": digest, "verified": snap.verified,
            "files": len(digests)}
