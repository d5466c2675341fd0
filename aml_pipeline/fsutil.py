"""Filesystem helpers: durability of atomic publication, directory locks, removing read-only trees."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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


def make_tree_writable(path: Path) -> None:
    """Give the owner write access again to a published (read-only) tree, so it can be removed."""
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, 0o644)


def remove_tree(path: Path) -> None:
    """Remove a directory tree, read-only parts included."""
    if path.exists():
        make_tree_writable(path)
        shutil.rmtree(path, ignore_errors=True)
