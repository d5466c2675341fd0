"""Filesystem helpers: durability of atomic publication, directory locks, removing read-only trees,
and whether the process that left something behind on this host still runs."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aml_pipeline.snapshot.export import process_alive  # noqa: F401 - the one definition, re-exported


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def dir_lock(directory: Path, *, shared: bool, wait_s: float = 0.0) -> Iterator[bool]:
    """``flock`` on ``<directory>/.lock``: shared by builds, exclusive for ``gc``. Yields whether
    it was taken (False once ``wait_s`` has passed without it). The kernel drops the lock with its
    holder, so a killed build or gc never leaves one behind."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + max(0.0, wait_s)
    try:
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)


# Published snapshots are read-only on disk (files 0444, directories 0555), so a stray write
# fails instead of silently corrupting a dataset; verification catches a deliberate one.
READ_ONLY_FILE = 0o444
READ_ONLY_DIR = 0o555


def make_read_only(root: Path) -> None:
    """Files under ``root`` 0444, directories 0555 (``root`` last); symlinks are left alone."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, READ_ONLY_FILE)
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, READ_ONLY_DIR)
    os.chmod(root, READ_ONLY_DIR)


def make_tree_writable(path: Path) -> None:
    """Give the owner write permission on ``path`` and every directory below it, so their
    entries can be removed or renamed. Files keep their mode: a file may be a hard link shared
    with another (kept) snapshot, whose file it also is."""
    if os.path.islink(path) or not os.path.isdir(path):
        return
    os.chmod(path, os.stat(path).st_mode | 0o700)
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode | 0o700)


def remove_tree(path: Path, *, ignore_errors: bool = True) -> None:
    """Remove a directory tree, read-only parts included (published snapshots, staging
    directories made read-only before their rename); a missing ``path`` is not an error."""
    try:
        make_tree_writable(path)
    except FileNotFoundError:
        return
    except OSError:
        if not ignore_errors:
            raise
    shutil.rmtree(path, ignore_errors=ignore_errors)


    return True
