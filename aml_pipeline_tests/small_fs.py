"""A small filesystem that really fills up: tmpfs mounted for one test (needs root, as CI has)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def small_filesystem(path: Path, size_kb: int) -> Iterator[Path]:
    """Mount a ``size_kb`` tmpfs at ``path`` for the duration; a write past it gets ENOSPC."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"cannot mount a tmpfs at {path} ({done.stderr.strip()}); these tests need root (CI runs as root)"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave_kb: int) -> Path:
    """Use up the filesystem at ``path`` but ``leave_kb``; the file that does it (delete it to
    make room again)."""
    import os

    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    block = max(0, free - leave_kb * 1024)
    ballast = path / ".ballast"
    with open(ballast, "wb") as f:
        f.write(b"\0" * block)
    return ballast
