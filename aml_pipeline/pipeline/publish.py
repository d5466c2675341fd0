"""Publishing snapshots: atomic rename into place, the ``current`` pointer, and the catalog.

A snapshot is built in ``<root>/<spec>/.staging-*``, fsynced, then renamed to
``<root>/<spec>/<sha256[:16]>`` (content-addressed and immutable: files 0444, directories 0555, made
so before the rename; :func:`aml_pipeline.fsutil.remove_tree` removes such a tree). A crash at any moment leaves
either no new directory or a complete one; the previous snapshots are never touched.
``current`` is a symlink replaced atomically once the blocking checks have passed.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aml_pipeline.core.hashing import DIGEST_FILE, SnapshotDigest, verify_snapshot
from aml_pipeline.errors import AmlError, disk_full
from aml_pipeline.faults import crash_point
from aml_pipeline.fsutil import fsync_dir, make_read_only, process_alive, remove_tree
from aml_pipeline.ids import check_spec_id
from aml_pipeline.snapshot.layout import manifest_layout

CATALOG_FILE = "catalog.sqlite"
CURRENT_LINK = "current"


def remove_abandoned_staging(parent: Path) -> list[Path]:
    """Staging directories of builds that died (killed mid-write) on this host."""
    removed = []
    for path in parent.glob(".staging-*"):
        try:
            pid = int(path.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not process_alive(pid):
            remove_tree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextmanager
def staging_dir(root: Path, spec_id: str) -> Iterator[Path]:
    """A fresh staging directory, removed again unless it was published (renamed away).

    Hidden (dot-prefixed) and never listed in the catalog, so a build killed mid-write leaves
    nothing that looks like a snapshot; the next build removes it.
    """
    parent = Path(root) / check_spec_id(spec_id, what="spec id")
    parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(parent)
    path = parent / f".staging-{os.getpid()}-{uuid.uuid4().hex}"
    path.mkdir()
    try:
        yield path
    finally:
        remove_tree(path, ignore_errors=True)


def publish_staged(staging: Path, digest: SnapshotDigest) -> Path:
    """Record the digest beside the files, make them read-only, fsync everything and rename
    into place (an accidental write to a published snapshot fails; ``verify`` catches a
    deliberate one)."""
    data = digest.to_json_bytes()
    try:
        (staging / DIGEST_FILE).write_bytes(data)
        with open(staging / DIGEST_FILE, "rb+") as f:
            os.fsync(f.fileno())
    except OSError as e:
        # The snapshot's files are written: what ran out is the room for this one small file,
        # so the line states its size, not the snapshot's.
        full = disk_full(e, staging.parent, needed_bytes=len(data))
        if full is not None:
            raise full from None
        raise
    make_read_only(staging)
    for d in (staging / "arrays", staging):
        if d.is_dir():
            fsync_dir(d)
    target = staging.parent / digest.sha256[:16]
    if target.exists():
        # Same content was published before: keep the existing (immutable) snapshot if intact.
        check = verify_snapshot(target, digest.sha256)
        if check.ok:
            return target
        broken = target.with_name(f".broken-{target.name}-{uuid.uuid4().hex[:8]}")
        os.rename(target, broken)
    crash_point("publish.fsynced")
    os.rename(staging, target)
    fsync_dir(staging.parent)
    crash_point("publish.renamed")
    return target


def set_current(snapshot_dir: Path) -> None:
    """Point ``<spec>/current`` at ``snapshot_dir`` atomically."""
    parent = snapshot_dir.parent
    tmp = parent / f".current-{uuid.uuid4().hex}"
    os.symlink(snapshot_dir.name, tmp)
    os.replace(tmp, parent / CURRENT_LINK)
    fsync_dir(parent)


def current_snapshot(root: Path, spec_id: str) -> Path | None:
    link = Path(root) / check_spec_id(spec_id, what="spec id") / CURRENT_LINK
    return link.resolve() if link.is_symlink() else None


# ---- catalog ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CatalogEntry:
    spec_id: str
    sha256: str
    path: str
    manifest_version: int
    created_at: str
    windows: dict[str, int]
    runs: dict[str, int]
    lineage_verified: int
    current: bool
    build_key: str | None = None  # what it was built from (spec stages, runs and their data versions)
    checks: dict[str, Any] | None = None  # the blocking checks' outcomes at publication
    layout: str = "windows"  # how the snapshot stores its windows (docs/snapshot.md)

    def to_json(self) -> dict[str, Any]:
        return {
            "specId": self.spec_id,
            "sha256": self.sha256,
            "snapshotDir": self.path,
            "manifestVersion": self.manifest_version,
            "createdAt": self.created_at,
            "windows": self.windows,
            "runs": self.runs,
            "lineageVerified": self.lineage_verified,
            "current": self.current,
            "layout": self.layout,
        }


_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    spec_id TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    path TEXT NOT NULL,
    manifest_version INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    windows_train INTEGER, windows_val INTEGER, windows_test INTEGER,
    runs_train INTEGER, runs_val INTEGER, runs_test INTEGER, runs_excluded INTEGER,
    lineage_verified INTEGER NOT NULL,
    current INTEGER NOT NULL DEFAULT 0,
    build_key TEXT,
    checks TEXT,
    layout TEXT,
    PRIMARY KEY (spec_id, sha256)
)
"""
# Columns added after the first catalogs were written (added in place to an older catalog; a
# snapshot recorded before there was a layout column has the windows layout).
_ADDED_COLUMNS = (("build_key", "TEXT"), ("checks", "TEXT"), ("layout", "TEXT"))
_COLUMNS = (
    "spec_id, sha256, path, manifest_version, created_at, windows_train, windows_val, windows_test, "
    "runs_train, runs_val, runs_test, runs_excluded, lineage_verified, current, build_key, checks, layout"
)


class Catalog:
    """Published snapshots of every spec under a datasets root (SQLite, safe across processes)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.path = self.root / CATALOG_FILE

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """A connection, closed after; a file that is not an SQLite catalog (truncated, garbage) is
        one CATALOG_INVALID line naming it."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            with closing(sqlite3.connect(self.path, timeout=30)) as conn:
                conn.execute(_SCHEMA)
                have = {r[1] for r in conn.execute("PRAGMA table_info(snapshots)")}
                for name, kind in _ADDED_COLUMNS:
                    if name not in have:
                        conn.execute(f"ALTER TABLE snapshots ADD COLUMN {name} {kind}")
                yield conn
        except sqlite3.OperationalError:
            raise  # a full disk, a lock held too long: the caller says which
        except sqlite3.DatabaseError as e:
            raise AmlError(
                f"{self.path}: not a readable catalog ({e}); the snapshots beside it are untouched "
                "(`aml-pipeline verify` checks each against its sha256.json): restore the catalog from a backup "
                "or move it aside",
                code="CATALOG_INVALID",
            ) from None

    def record(
        self,
        snapshot_dir: Path,
        manifest: dict[str, Any],
        sha256: str,
        *,
        current: bool,
        build_key: str | None = None,
        checks: dict[str, Any] | None = None,
    ) -> CatalogEntry:
        split = manifest["split"]
        spec_id = manifest["spec"]["id"]
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        row = (
            spec_id,
            sha256,
            str(snapshot_dir),
            manifest["version"],
            created,
            split["train"],
            split["val"],
            split["test"],
            len(split["trainRunIds"]),
            len(split["valRunIds"]),
            len(split["testRunIds"]),
            len(split["excluded"]),
            int(manifest.get("lineageVerified", 0)),
            int(current),
            build_key,
            None if checks is None else json.dumps(checks),
            manifest_layout(manifest),
        )
        with self._connect() as conn, conn:
            if current:
                conn.execute("UPDATE snapshots SET current = 0 WHERE spec_id = ?", (spec_id,))
            conn.execute(
                f"INSERT INTO snapshots ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
                "ON CONFLICT (spec_id, sha256) DO UPDATE SET path = excluded.path, "
                "current = excluded.current, build_key = excluded.build_key, checks = excluded.checks",
                row,
            )
        return self.get(spec_id, sha256)  # type: ignore[return-value]

    def entries(self, spec_id: str | None = None) -> list[CatalogEntry]:
        if not self.path.exists():
            return []
        sql = f"SELECT {_COLUMNS} FROM snapshots"
        args: tuple = ()
        if spec_id is not None:
            sql += " WHERE spec_id = ?"
            args = (spec_id,)
        with self._connect() as conn:
            rows = conn.execute(sql + " ORDER BY spec_id, created_at, sha256", args).fetchall()
        return [_entry(r) for r in rows]

    def get(self, spec_id: str, sha256: str) -> CatalogEntry | None:
        with self._connect() as conn:
            r = conn.execute(
                f"SELECT {_COLUMNS} FROM snapshots WHERE spec_id = ? AND sha256 = ?", (spec_id, sha256)
            ).fetchone()
        return None if r is None else _entry(r)

    def delete(self, spec_id: str, sha256: str) -> None:
        with self._connect() as conn, conn:
            conn.execute("DELETE FROM snapshots WHERE spec_id = ? AND sha256 = ? AND current = 0", (spec_id, sha256))

    def current(self, spec_id: str) -> CatalogEntry | None:
        """The entry ``current`` points at, if its directory is still there."""
        if not self.path.exists():
            return None
        with self._connect() as conn:
            r = conn.execute(
                f"SELECT {_COLUMNS} FROM snapshots WHERE spec_id = ? AND current = 1", (spec_id,)
            ).fetchone()
        if r is None:
            return None
        entry = _entry(r)
        link = current_snapshot(self.root, spec_id)
        if link is None or not link.is_dir():
            return None
        if link == Path(entry.path).resolve():
            return entry
        # A copied (or moved) datasets root keeps its catalog, whose paths name the original: the
        # entry is this root's current snapshot when ``current`` names the entry's directory here
        # (``<spec id>/<sha256[:16]>``, as verify finds it), and its files are read from here.
        here = (self.root / spec_id).resolve()
        if link.parent == here and link.name == Path(entry.path).name == entry.sha256[:16]:
            return replace(entry, path=str(link))
        return None

    def find_by_path(self, snapshot_dir: Path) -> CatalogEntry | None:
        if not self.path.exists():
            return None
        with self._connect() as conn:
            r = conn.execute(
                f"SELECT {_COLUMNS} FROM snapshots WHERE path = ?", (str(Path(snapshot_dir).resolve()),)
            ).fetchone()
        return None if r is None else _entry(r)


def _entry(r: tuple) -> CatalogEntry:
    return CatalogEntry(
        spec_id=r[0],
        sha256=r[1],
        path=r[2],
        manifest_version=r[3],
        created_at=r[4],
        windows={"train": r[5], "val": r[6], "test": r[7]},
        runs={"train": r[8], "val": r[9], "test": r[10], "excluded": r[11]},
        lineage_verified=r[12],
        current=bool(r[13]),
        build_key=r[14],
        checks=None if r[15] is None else json.loads(r[15]),
        layout=r[16] or "windows",
    )
