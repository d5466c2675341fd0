"""Verifying a snapshot by streaming its files: one sha256 pass in bounded memory.

Every hashed file is opened once; the hash is computed through those open files (1 MiB at a
time, the buffer reused) and the same open files are what the reader memory-maps afterwards,
so the bytes it serves are the bytes it hashed even if a path is swapped meanwhile. Per-file
digests, which name what changed, are computed (a second pass) only when the hash does not
match, as ``aml_pipeline/core/hashing.py`` does.

The expected hash is ``sha256.json``'s and, when known, the catalog's (``catalog.sqlite`` of the
datasets root the snapshot was published under, looked up read-only): rewriting both a file and
``sha256.json`` still fails against the catalog.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .layout import (
    CATALOG_FILE,
    DIGEST_FILE,
    MANIFEST_FILE,
    SPEC_FILE,
    SnapshotError,
    SnapshotHasher,
    hashed_files,
    inside,
)

_CHUNK = 1 << 20  # the hash runs at memory speed from 256 KiB up; RSS stays flat
_SMALL_FILE = 64 << 20  # JSON artifacts up to this size are kept (parsed from the hashed bytes)

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")

FileId = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


@dataclass
class OpenedSnapshot:
    """A snapshot's files, open, and what is known of their integrity."""

    root: Path
    spec_bytes: bytes
    manifest_bytes: bytes
    manifest: dict[str, Any]
    recorded: dict[str, Any]  # sha256.json ({} if absent and not needed)
    sha256: str | None  # recomputed when verified, else the recorded one
    verified: bool
    files: dict[str, BinaryIO] = field(default_factory=dict)  # hashed files other than spec/manifest
    small: dict[str, bytes] = field(default_factory=dict)  # JSON artifacts' bytes, as hashed
    identity: dict[str, FileId] = field(default_factory=dict)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def file_id(f: BinaryIO) -> FileId:
    st = os.fstat(f.fileno())
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def catalog_sha256(root: Path) -> str | None:
    """The hash the catalog recorded for this snapshot directory, if it sits in a datasets root
    with a catalog (``<root>/<spec id>/<sha256[:16]>``): by path, else by spec id and the
    directory's name (a copied datasets root keeps its catalog, not its paths)."""
    snap = root.resolve()
    catalog = snap.parent.parent / CATALOG_FILE
    if not catalog.is_file():
        return None
    try:
        conn = sqlite3.connect(f"{catalog.as_uri()}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute("SELECT sha256 FROM snapshots WHERE path = ?", (str(snap),)).fetchone()
        if row is None and len(snap.name) == 16:
            row = conn.execute(
                "SELECT sha256 FROM snapshots WHERE spec_id = ? AND substr(sha256, 1, 16) = ?",
                (snap.parent.name, snap.name),
            ).fetchone()
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    return None if row is None else str(row[0])


def _read_json(root: Path, name: str, data: bytes, *, code: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as e:
        raise SnapshotError(f"{root}: {name} is not JSON ({e})", code=code, changed=[name]) from None
    if not isinstance(value, dict):
        raise SnapshotError(f"{root}: {name} is not a JSON object", code=code, changed=[name])
    return value


def _stream(f: BinaryIO, buf: bytearray, *hashes: Any) -> None:
    """Feed the whole file (from its start, whatever its offset) to ``hashes``."""
    view = memoryview(buf)
    fd, offset = f.fileno(), 0
    while n := os.preadv(fd, [buf], offset):
        for h in hashes:
            h.update(view[:n])
        offset += n


def _digests(opened: OpenedSnapshot, names: list[str], buf: bytearray) -> tuple[str, dict[str, str]]:
    """The snapshot hash and the per-file digests (``spec.json`` included)."""
    hasher = _hash(opened, names, buf, per_file=True)
    return hasher.hexdigest(), hasher.files


def _total(opened: OpenedSnapshot, names: list[str], buf: bytearray) -> str:
    """The snapshot hash alone: one sha256 pass over every hashed byte."""
    return _hash(opened, names, buf, per_file=False).hexdigest()


def _hash(opened: OpenedSnapshot, names: list[str], buf: bytearray, *, per_file: bool) -> SnapshotHasher:
    """The hash rule over the snapshot's open files (the manifest as it was read)."""
    hasher = SnapshotHasher(opened.spec_bytes, per_file=per_file)
    for name in names:
        hasher.begin(name)
        if name == MANIFEST_FILE:
            hasher.update(opened.manifest_bytes)
        else:
            _stream(opened.files[name], buf, hasher)
        hasher.end()
    return hasher


def check_looks_like_a_snapshot(root: Path) -> None:
    """``NOT_A_SNAPSHOT`` if the folder ``root`` has none of a snapshot's files: it is something
    else (a datasets root, a spec's folder, a typo), not a snapshot that was tampered with. A
    snapshot with some files missing passes here; verifying it names what is missing."""
    names = (SPEC_FILE, MANIFEST_FILE, DIGEST_FILE)
    if not root.is_dir() or any((root / n).exists() for n in (*names, "arrays")):
        return
    hint = ""
    if (root / "current").is_dir():
        hint = f"; its current snapshot is {root / 'current'}"
    elif (root / CATALOG_FILE).is_file():
        hint = "; it is a datasets root: `aml-pipeline datasets --root` lists its snapshots"
    raise SnapshotError(f"{root} is not a snapshot: it has none of {', '.join(names)}{hint}", code="NOT_A_SNAPSHOT")


def open_files(root: str | os.PathLike[str], *, verify: bool = True, expected_sha256: str | None = None,
               use_catalog: bool = True) -> OpenedSnapshot:
    """Open every hashed file of the snapshot at ``root`` and, with ``verify``, check its hash.

    Raises :class:`SnapshotError` (``SNAPSHOT_TAMPERED``) naming the changed or missing files.
    ``expected_sha256`` (e.g. from a catalog on another machine) is checked in addition to
    ``sha256.json``; with ``use_catalog`` the datasets root's catalog is consulted too.
    """
    if expected_sha256 and not (isinstance(expected_sha256, str) and _HEX64.fullmatch(expected_sha256)):
        raise ValueError(f"expected_sha256 must be a sha256 as 64 hex digits, got {expected_sha256!r}")
    root = Path(root)
    if not root.is_dir():
        raise SnapshotError(f"{root}: not a snapshot directory", code="SNAPSHOT_INVALID")
    check_looks_like_a_snapshot(root)
    try:
        recorded_bytes: bytes | None = (root / DIGEST_FILE).read_bytes()
    except FileNotFoundError:
        recorded_bytes = None
    try:
        spec_bytes = (root / SPEC_FILE).read_bytes()
        manifest_bytes = (root / MANIFEST_FILE).read_bytes()
    except FileNotFoundError as e:
        name = Path(e.filename).name
        raise SnapshotError(f"{root}: {name} is missing", code="SNAPSHOT_TAMPERED", changed=[name]) from None
    recorded: dict[str, Any] = {}
    if recorded_bytes is not None:
        try:
            recorded = _read_json(root, DIGEST_FILE, recorded_bytes, code="SNAPSHOT_TAMPERED")
        except SnapshotError:
            if verify:
                raise
    try:
        manifest = _read_json(root, MANIFEST_FILE, manifest_bytes, code="SNAPSHOT_INVALID")
    except SnapshotError as e:
        if not verify:
            raise
        # Without a manifest there is no file list to hash; a published one always parses.
        raise SnapshotError(f"{e}; hash mismatch: it is not the manifest of snapshot {recorded.get('sha256')} "
                            f"recorded in {DIGEST_FILE}; changed: {MANIFEST_FILE}",
                            code="SNAPSHOT_TAMPERED", changed=[MANIFEST_FILE]) from None

    expected: list[tuple[str, Any]] = []
    if verify:
        if recorded_bytes is not None:
            expected.append((DIGEST_FILE, recorded.get("sha256")))
        catalog = catalog_sha256(root) if use_catalog else None
        if catalog:
            expected.append(("the catalog", catalog))
        if expected_sha256:
            expected.append(("expected_sha256", expected_sha256.lower()))
        if not expected:
            raise SnapshotError(f"{root}: {DIGEST_FILE} is missing; refusing an unverifiable snapshot",
                                code="SNAPSHOT_TAMPERED", changed=[DIGEST_FILE])

    try:
        names = hashed_files(manifest)
    except ValueError as e:
        raise SnapshotError(f"{root}: {e}", code="SNAPSHOT_TAMPERED" if verify else "SNAPSHOT_INVALID",
                            changed=[MANIFEST_FILE]) from None
    recorded_sha = recorded.get("sha256") if isinstance(recorded.get("sha256"), str) else None
    opened = OpenedSnapshot(root, spec_bytes, manifest_bytes, manifest, recorded, recorded_sha, False)
    try:
        for name in names:
            if name == MANIFEST_FILE:
                continue
            try:
                f = open(inside(root, name), "rb", buffering=0)  # noqa: SIM115 - kept open, closed by the reader
            except FileNotFoundError:
                raise SnapshotError(f"{root}: {name} is missing", code="SNAPSHOT_TAMPERED", changed=[name]) from None
            except IsADirectoryError:
                raise SnapshotError(f"{root}: {name} is a directory, not the file it should be",
                                    code="SNAPSHOT_TAMPERED", changed=[name]) from None
            opened.files[name] = f
            opened.identity[name] = file_id(f)
            if name.endswith(".json") and opened.identity[name][2] <= _SMALL_FILE:
                opened.small[name] = f.read()
        if verify:
            _check(opened, names, expected)
    except BaseException:
        opened.close()
        raise
    return opened


def _check(opened: OpenedSnapshot, names: list[str], expected: list[tuple[str, Any]]) -> None:
    buf = bytearray(_CHUNK)
    actual = _total(opened, names, buf)
    for name, f in opened.files.items():
        if file_id(f) != opened.identity[name]:
            raise SnapshotError(f"{opened.root}: {name} changed while it was being verified",
                                code="SNAPSHOT_TAMPERED", changed=[name])
    for source, value in expected:
        if isinstance(value, str) and hmac.compare_digest(value, actual):
            continue
        # The one pass did not match: a second one with per-file digests names what changed.
        _, per_file = _digests(opened, names, buf)
        rec_files = opened.recorded.get("files")
        rec_files = rec_files if isinstance(rec_files, dict) else {}
        changed = sorted(n for n in set(per_file) | set(rec_files) if per_file.get(n) != rec_files.get(n))
        if not rec_files:
            changed, what = [], f"unknown: no per-file digests in {DIGEST_FILE}"
        elif changed:
            what = ", ".join(changed)
        elif source == DIGEST_FILE:
            what = f"(the recorded digest in {DIGEST_FILE} itself)"
        else:
            what = f"unknown: {DIGEST_FILE} was rewritten to match the files"
        raise SnapshotError(
            f"{opened.root}: hash mismatch: recomputed sha256 {actual} != {value} recorded in {source}; "
            f"changed: {what}",
            code="SNAPSHOT_TAMPERED",
            changed=changed,
        )
    opened.sha256, opened.verified = actual, True
