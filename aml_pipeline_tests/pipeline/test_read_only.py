"""Published snapshots are read-only on disk; removal and replacement still work.

Tests run as root, whom permission bits do not stop. So the accidental writer is a forked child
that drops to uid/gid 65534 (nobody) and owns the snapshot (chown), exactly as a pipeline user
owns what it published: only the mode bits stand between it and the bytes. A forked child (not
a new interpreter) because the interpreter under /root is not reachable by nobody.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline.fsutil import READ_ONLY_DIR, READ_ONLY_FILE, remove_tree
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.publish import remove_abandoned_staging
from aml_pipeline.snapshot import SnapshotError, open_snapshot
from aml_pipeline.tsdb_open import open_tsdb

NOBODY = 65534


def as_nobody(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child running as uid/gid 65534; its JSON result, or its error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = json.dumps({"ok": fn()})
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out, code = json.dumps({"error": f"{type(e).__name__}: {e}"}), 1
        os.write(write, out.encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        data = f.read()
    os.waitpid(pid, 0)
    result = json.loads(data)
    if "error" in result:
        raise AssertionError(f"child as nobody failed: {result['error']}")
    return result["ok"]


def chown_tree(root: Path, uid: int = NOBODY) -> None:
    os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def attempt(action: Callable[[], Any]) -> str:
    """'ok' or the errno name of the OSError the action raised."""
    try:
        action()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    return "ok"


@pytest.fixture
def home():
    """A build root nobody can reach (pytest's tmp_path is 0700 to root alone)."""
    path = Path(tempfile.mkdtemp(prefix="aml-read-only-"))
    os.chmod(path, 0o755)
    yield path
    remove_tree(path)


def build(make_spec, plant_url, home: Path, **spec):
    with open_tsdb(plant_url) as db:
        return build_dataset(make_spec(**spec), db, store_root=home / "store", datasets_root=home / "datasets")


def test_published_files_and_directories_are_read_only(make_spec, plant_url, home):
    snap = build(make_spec, plant_url, home, extras=True).snapshot_dir
    modes = {p.relative_to(snap).as_posix(): stat.S_IMODE(p.lstat().st_mode) for p in [snap, *snap.rglob("*")]}
    assert modes.pop(".") == READ_ONLY_DIR and modes.pop("arrays") == READ_ONLY_DIR
    assert {"manifest.json", "sha256.json", "report.json", "arrays/x.f32", "arrays/sidecar.json"} <= set(modes)
    assert set(modes.values()) == {READ_ONLY_FILE}, modes


def test_an_accidental_write_by_the_owner_fails(make_spec, plant_url, home):
    snap = build(make_spec, plant_url, home, extras=True).snapshot_dir
    chown_tree(snap)  # published by nobody: the owner, stopped by the mode bits alone
    x = snap / "arrays" / "x.f32"
    before = x.read_bytes()

    def try_everything() -> dict[str, str]:
        return {
            "read": attempt(lambda: open(x, "rb").read(16)),
            "write": attempt(lambda: open(x, "r+b").write(b"\0")),
            "truncate": attempt(lambda: os.truncate(x, 0)),
            "create": attempt(lambda: open(snap / "arrays" / "new.f32", "wb")),
            "delete": attempt(lambda: os.unlink(snap / "manifest.json")),
            "rename": attempt(lambda: os.rename(snap / "spec.json", snap / "spec.old")),
        }

    assert as_nobody(try_everything) == {"read": "ok", "write": "EACCES", "truncate": "EACCES", "create": "EACCES",
                                         "delete": "EACCES", "rename": "EACCES"}
    assert x.read_bytes() == before and open_snapshot(snap).verified
    # Control: the same owner with the write bit back writes; so it was the mode that stopped it.
    os.chmod(x, 0o644)
    assert as_nobody(lambda: attempt(lambda: open(x, "r+b").write(b"\0"))) == "ok"
    assert x.read_bytes() != before
    with pytest.raises(SnapshotError, match=r"arrays/x\.f32"):
        open_snapshot(snap)


def test_a_deliberate_write_by_root_is_caught_by_verify(make_spec, plant_url, home):
    published = build(make_spec, plant_url, home, extras=True)
    y = published.snapshot_dir / "arrays" / "y.f32"
    with open(y, "r+b") as f:  # root ignores the mode bits
        f.seek(100)
        f.write(b"\x7f")
    result = verify_snapshot(published.snapshot_dir, published.sha256)
    assert not result.ok and result.changed == ["arrays/y.f32"]
    with pytest.raises(SnapshotError, match=r"hash mismatch.*arrays/y\.f32"):
        open_snapshot(published.snapshot_dir)


def test_republishing_identical_content_removes_the_read_only_staging(make_spec, plant_url, home):
    first = build(make_spec, plant_url, home)  # v1: byte-identical when rebuilt
    second = build(make_spec, plant_url, home)
    assert second.snapshot_dir == first.snapshot_dir and second.sha256 == first.sha256
    assert not list(first.snapshot_dir.parent.glob(".staging-*"))


def test_a_broken_snapshot_is_moved_aside_and_replaced(make_spec, plant_url, home):
    first = build(make_spec, plant_url, home)
    with open(first.snapshot_dir / "arrays" / "u.f32", "r+b") as f:
        f.write(b"\1\2\3\4")
    # Without a current snapshot the rebuild writes again (else nothing changed, nothing is
    # published) and finds its content-addressed directory taken by the damaged copy.
    (first.snapshot_dir.parent / "current").unlink()
    second = build(make_spec, plant_url, home)
    assert second.snapshot_dir == first.snapshot_dir and open_snapshot(second.snapshot_dir).verified
    [broken] = first.snapshot_dir.parent.glob(".broken-*")
    assert stat.S_IMODE(broken.stat().st_mode) == READ_ONLY_DIR
    assert not list(first.snapshot_dir.parent.glob(".staging-*"))
    remove_tree(broken)
    assert not broken.exists()


def test_remove_tree_removes_a_read_only_tree_its_owner_could_not_rmtree(make_spec, plant_url, home):
    snap = build(make_spec, plant_url, home).snapshot_dir
    spec_dir = snap.parent
    copy = spec_dir / "copy"
    shutil.copytree(snap, copy)  # keeps the modes: read-only
    chown_tree(spec_dir)
    assert as_nobody(lambda: attempt(lambda: shutil.rmtree(copy))) == "EACCES"
    assert copy.exists()
    assert as_nobody(lambda: attempt(lambda: remove_tree(copy))) == "ok"
    assert not copy.exists()
    # Files keep their mode (a file may be a hard link into a snapshot that is kept).
    assert stat.S_IMODE((snap / "arrays" / "x.f32").stat().st_mode) == READ_ONLY_FILE


def test_a_dead_builds_read_only_staging_is_removed_by_the_next(make_spec, plant_url, home):
    snap = build(make_spec, plant_url, home).snapshot_dir
    spec_dir = snap.parent
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    staging = spec_dir / f".staging-{dead}-abandoned"
    shutil.copytree(snap, staging)  # a build killed after making its staging read-only
    chown_tree(spec_dir)
    removed = as_nobody(lambda: [p.name for p in remove_abandoned_staging(spec_dir)])
    assert removed == [staging.name] and not staging.exists() and snap.exists()


@pytest.mark.parametrize("layout,name", [("windows", "x.f32"), ("series", "x_rows.f32"), ("series", "segments.i64")])
def test_gc_of_a_snapshot_leaves_the_hard_links_it_shares_read_only(make_spec, plant_url, home, layout, name):
    """A rebuild after a spec note edit hard-links the unchanged arrays of the current snapshot;
    removing the old snapshot (gc) must not make the kept snapshot's shared files writable."""
    from aml_pipeline.pipeline.retention import collect_garbage

    old = build(make_spec, plant_url, home, note="first", layout=layout)
    spec = make_spec(note="second", layout=layout)
    with open_tsdb(plant_url) as db:
        new = build_dataset(spec, db, store_root=home / "store", datasets_root=home / "datasets")
    assert new.linked == sorted(str(p.relative_to(old.snapshot_dir)) for p in (old.snapshot_dir / "arrays").iterdir())
    shared = new.snapshot_dir / "arrays" / name
    assert shared.stat().st_ino == (old.snapshot_dir / "arrays" / name).stat().st_ino  # one file, two snapshots
    report = collect_garbage(home / "datasets", home / "store", {spec.id: spec}, keep=0)
    assert str(old.snapshot_dir) in map(str, report.removed_snapshots) and not old.snapshot_dir.exists()
    assert stat.S_IMODE(shared.stat().st_mode) == READ_ONLY_FILE and shared.stat().st_nlink == 1
    assert open_snapshot(new.snapshot_dir).verified
