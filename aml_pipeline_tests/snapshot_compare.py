"""Two v2 snapshots of the same data compared byte for byte (all but the build time)."""

from __future__ import annotations

import json
from pathlib import Path


ARRAYS = ("x.f32", "u.f32", "y.f32", "timestamps.f64", "mask.f32")


def snapshot_files(snapshot: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(snapshot)): p.read_bytes() for p in sorted(snapshot.rglob("*")) if p.is_file()
    }


def without_captured_at(manifest_bytes: bytes) -> dict:
    m = json.loads(manifest_bytes)
    assert isinstance(m["provenance"].pop("capturedAt"), str)
    return m


def assert_same_v2_snapshot(reference: Path, other: Path, what: str) -> None:
    """Two v2 snapshots of the same data hold the same bytes but for the build time in the
    manifest (``capturedAt``) and so the digest file's manifest entry and overall hash."""
    a, b = snapshot_files(reference), snapshot_files(other)
    assert sorted(a) == sorted(b)
    for name in ARRAYS:
        assert len(a[f"arrays/{name}"]) > 0, name
    assert without_captured_at(a.pop("manifest.json")) == without_captured_at(b.pop("manifest.json"))
    # The digest file covers the manifest (capturedAt); its digests of every other file agree.
    da, db = (json.loads(files.pop("sha256.json"))["files"] for files in (a, b))
    assert {k: v for k, v in da.items() if k != "manifest.json"} == {k: v for k, v in db.items() if k != "manifest.json"}
    for name in a:
        assert a[name] == b[name], f"{name} differs between {what}"
