"""Snapshot hash: tamper evidence that travels with the snapshot.

sha256 over the bytes of ``spec.json``, then for each hashed file, in order, its relative name
(UTF-8) followed by its bytes. v1 hashes ``manifest.json`` and the three arrays; v2 adds every
other artifact listed in ``manifest.artifacts`` (the predecessor's algorithm, kept so that old
hashes still verify). The digest is stored beside the hashed files, never inside one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# One definition of the layout and the hashed file list, shared with the consumers' reader
# (aml_pipeline.snapshot, which imports nothing of the pipeline). DIGEST_FILE sits beside the
# hashed files and is not itself hashed.
from aml_pipeline.snapshot.layout import DIGEST_FILE, MANIFEST_FILE, SPEC_FILE, SnapshotHasher, hashed_files

_CHUNK = 8 << 20


class BackgroundSnapshotHasher(SnapshotHasher):
    """:class:`SnapshotHasher` whose hashing runs in two background threads (the snapshot hash
    and the per-file digests), overlapping with whatever the caller does next.

    sha256 releases the GIL, so a writer can gather and write the next block while the previous
    ones are hashed. ``update`` keeps a reference to ``data`` instead of copying it: the caller
    must not modify it afterwards. At most ``max_pending`` updates wait in each queue, which
    bounds the memory held. :meth:`hexdigest` (or :meth:`close`) waits for the threads and
    re-raises an error of theirs.
    """

    def __init__(self, spec_json: bytes, *, max_pending: int = 4) -> None:
        super().__init__(spec_json)
        self._queues: list[queue.Queue] = [queue.Queue(max_pending), queue.Queue(max_pending)]
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run_total, name="snapshot-hash-total", daemon=True),
            threading.Thread(target=self._run_files, name="snapshot-hash-files", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._closed = False

    def _put(self, item: tuple) -> None:
        if self._errors:
            raise RuntimeError("snapshot hashing failed") from self._errors[0]
        for q in self._queues:
            q.put(item)

    def begin(self, name: str) -> None:
        if self._name is not None:
            raise RuntimeError(f"file {self._name} is still open in the hasher")
        self._name = name
        self._put(("begin", name))

    def update(self, data: bytes | memoryview) -> None:
        self._put(("data", data))

    def end(self) -> None:
        assert self._name is not None
        self._put(("end", self._name))
        self._name = None

    def add_file(self, name: str, path: Path) -> None:
        self.begin(name)
        with open(path, "rb", buffering=0) as f:
            # A new buffer per chunk, handed over as read (the threads hash it later): no copy.
            while chunk := f.read(_CHUNK):
                self.update(chunk)
        self.end()

    def _run_total(self) -> None:
        self._drain(self._queues[0], self._total_op)

    def _run_files(self) -> None:
        self._drain(self._queues[1], self._file_op)

    def _drain(self, q: queue.Queue, op: Any) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            if self._errors:
                continue  # keep draining so the producer never blocks
            try:
                op(*item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._errors.append(e)

    def _total_op(self, kind: str, payload: Any) -> None:
        if kind == "begin":
            self._total.update(payload.encode("utf-8"))
        elif kind == "data":
            self._total.update(payload)

    def _file_op(self, kind: str, payload: Any) -> None:
        if kind == "begin":
            self._file = hashlib.sha256()
        elif kind == "data":
            self._file.update(payload)
        else:
            self.files[payload] = self._file.hexdigest()
            self._file = None

    def close(self) -> None:
        """Wait until everything queued is hashed."""
        if not self._closed:
            self._closed = True
            for q in self._queues:
                q.put(None)
            for t in self._threads:
                t.join()
        if self._errors:
            raise RuntimeError("snapshot hashing failed") from self._errors[0]

    def hexdigest(self) -> str:
        self.close()
        return self._total.hexdigest()


@dataclass(frozen=True)
class SnapshotDigest:
    sha256: str
    files: dict[str, str]
    # What each large file was computed from, so the next snapshot can share a file whose inputs
    # did not change (a hard link) instead of writing it again. Not part of the hash.
    file_keys: dict[str, str] | None = None

    def to_json_bytes(self) -> bytes:
        body: dict[str, Any] = {"sha256": self.sha256, "files": self.files}
        if self.file_keys:
            body["fileKeys"] = self.file_keys
        return (json.dumps(body, indent=2) + "\n").encode()


def digest_snapshot(snapshot_dir: str | Path) -> SnapshotDigest:
    """Recompute the hash of a snapshot directory from its files, with per-file digests."""
    hasher = _hash_files(Path(snapshot_dir), per_file=True)
    return SnapshotDigest(hasher.hexdigest(), hasher.files)


def snapshot_sha256(snapshot_dir: str | Path) -> str:
    """The snapshot hash alone (one sha256 pass over the bytes; no per-file digests)."""
    return _hash_files(Path(snapshot_dir), per_file=False).hexdigest()


def _hash_files(root: Path, *, per_file: bool) -> SnapshotHasher:
    manifest = json.loads((root / MANIFEST_FILE).read_bytes())
    hasher = SnapshotHasher((root / SPEC_FILE).read_bytes(), per_file=per_file)
    for name in hashed_files(manifest):
        hasher.add_file(name, root / name)
    return hasher


@dataclass(frozen=True)
class Verification:
    ok: bool
    expected: str | None
    actual: str | None
    changed: list[str]  # files whose bytes differ from those recorded at publication
    problem: str = ""


def verify_snapshot(
    snapshot_dir: str | Path,
    expected_sha256: str | None = None,
    expected_files: Mapping[str, str] | None = None,
) -> Verification:
    """Check every hashed byte of a snapshot against its recorded digest.

    The hash must match ``expected_sha256`` (e.g. from the catalog) and the digest file's, as
    the reader checks them (:mod:`aml_pipeline.snapshot.verify`): a snapshot whose files and
    digest file were both rewritten fails against the catalog, and a digest file edited alone
    fails too. ``expected_files`` (per-file digests, e.g. the writer's, before the digest file
    exists) replaces the digest file's ``files`` when naming what changed.
    """
    root = Path(snapshot_dir)
    recorded: Any = {}
    present = True
    try:
        recorded = json.loads((root / DIGEST_FILE).read_bytes())
    except FileNotFoundError:
        present = False
        if expected_sha256 is None:
            return Verification(False, None, None, [], f"{root / DIGEST_FILE} is missing")
    except (OSError, ValueError) as e:
        if expected_sha256 is None or expected_files is None:
            return Verification(False, expected_sha256, None, [DIGEST_FILE], f"{DIGEST_FILE} unreadable: {e}")
        present, recorded = False, {}
    if not isinstance(recorded, dict):
        if expected_sha256 is None or expected_files is None:
            return Verification(False, expected_sha256, None, [DIGEST_FILE], f"{DIGEST_FILE} is not a JSON object")
        present, recorded = False, {}
    recorded_sha = recorded.get("sha256") if isinstance(recorded.get("sha256"), str) else None
    if present and recorded_sha is None:
        return Verification(False, expected_sha256, None, [DIGEST_FILE], f"{DIGEST_FILE} records no sha256")
    if expected_files is not None:
        recorded = {**recorded, "files": dict(expected_files)}
    expected = [e for e in (expected_sha256, recorded_sha) if e is not None]
    try:
        # One pass for the common case (intact); per-file digests, which name what changed,
        # only when the hash does not match.
        total = snapshot_sha256(root)
        if all(hmac.compare_digest(e, total) for e in expected):
            return Verification(True, expected[0], total, [])
        actual = digest_snapshot(root)
    except FileNotFoundError as e:
        missing = Path(e.filename).relative_to(root).as_posix() if e.filename else "?"
        return Verification(False, expected[0], None, [missing], f"{missing} is missing")
    except (OSError, ValueError) as e:
        # A file the system refuses (a directory where it belongs, no permission) is named; else
        # the manifest, which lists the files, is what could not be read.
        named = getattr(e, "filename", None)
        where = Path(named).relative_to(root).as_posix() if named and Path(named).is_relative_to(root) else MANIFEST_FILE
        return Verification(False, expected[0], None, [where], f"cannot read snapshot: {e}")
    wrong = next(e for e in expected if not hmac.compare_digest(e, actual.sha256))
    recorded_files = recorded.get("files") if isinstance(recorded.get("files"), dict) else {}
    changed = sorted(
        name
        for name in set(actual.files) | set(recorded_files)
        if actual.files.get(name) != recorded_files.get(name)
    )
    # As the reader says it: without per-file digests nothing can be named; with them all
    # matching, the hash that differs is the digest file's own (its sha256 edited) or, against
    # the catalog, the digest file was rewritten to match the files.
    if not recorded_files:
        changed = [f"unknown: no per-file digests in {DIGEST_FILE}"]
    elif not changed:
        changed = ([f"(the recorded digest in {DIGEST_FILE} itself)"] if wrong == recorded_sha
                   else [f"unknown: {DIGEST_FILE} was rewritten to match the files"])
    return Verification(False, wrong, actual.sha256, changed, "hash mismatch")
