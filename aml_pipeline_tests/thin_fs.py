"""An ext4 filesystem that runs out of space where real ones do: at fsync, not at write.

tmpfs refuses a write at once when it is full (``small_fs.py``); ext4, xfs and NFS accept the
write into the page cache and report ENOSPC when the data is written back, that is at ``fsync``
or ``close``. This helper makes that happen for real: an ext4 image on a loop device
(``mkfs.ext4`` + ``mount -o loop``) whose image file is thin (sparse) on a small tmpfs, like a
thin-provisioned volume. ext4 sees room and accepts writes; the loop device fails their
writeback with ENOSPC (``BLK_STS_NOSPC``) once the tmpfs under it is full, and ext4 reports that
from ``fsync``. :meth:`ThinExt4.exhaust` fills the tmpfs underneath, :meth:`ThinExt4.relieve`
makes room again.

Only the blocks free after ``mkfs`` are thin: the superblock, group descriptors, bitmaps, inode
tables and the journal are written out in the tmpfs first, so ext4's own bookkeeping never hits
the full device and the filesystem stays read-write. Needs root and a kernel with loop devices
(``e2fsprogs`` and ``mount`` provide the tools; ``scripts/system_packages.sh`` installs them).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BLOCK = 4096


def _run(*cmd: str) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _free_ranges(image: Path) -> list[tuple[int, int]]:
    """The block ranges (first, last) ext4 reports free in ``image``."""
    out = _run("dumpe2fs", str(image))
    ranges = []
    for line in out.splitlines():
        m = re.match(r"\s+Free blocks: (.+)$", line)
        if not m:
            continue
        for part in m.group(1).split(","):
            part = part.strip()
            if part:
                first, _, last = part.partition("-")
                ranges.append((int(first), int(last or first)))
    return ranges


@dataclass
class ThinExt4:
    root: Path  # the mounted ext4
    backing: Path  # the tmpfs holding its image

    def exhaust(self, leave_kb: int = 0) -> Path:
        """Fill the tmpfs under the image but ``leave_kb``: writeback beyond that fails."""
        os.sync()  # what is dirty now reaches the device while it has room
        st = os.statvfs(self.backing)
        ballast = self.backing / "ballast"
        with open(ballast, "ab") as f:
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave_kb * 1024))
        return ballast

    def relieve(self) -> None:
        """Room under the image again."""
        (self.backing / "ballast").unlink(missing_ok=True)


@contextlib.contextmanager
def thin_ext4(size_mb: int) -> Iterator[ThinExt4]:
    """An ext4 of ``size_mb`` whose blocks live in a tmpfs (module doc), mounted on a fresh
    directory under /tmp; unmounted and removed afterwards."""
    if os.geteuid() != 0:
        raise RuntimeError("a loop-mounted ext4 needs root (CI runs the tests as root)")
    where = Path(tempfile.mkdtemp(prefix="aml-thin-", dir="/tmp"))
    backing, root = where / "backing", where / "fs"
    backing.mkdir()
    root.mkdir()
    mounted: list[Path] = []
    try:
        # Room for the whole image while it is written out once, below.
        _run("mount", "-t", "tmpfs", "-o", f"size={size_mb + 16}m", "tmpfs", str(backing))
        mounted.append(backing)
        image = backing / "ext4.img"
        with open(image, "wb") as f:
            f.truncate(size_mb * 2**20)
        _run("mkfs.ext4", "-q", "-F", "-b", str(BLOCK), "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard",
             str(image))
        # Write every block out, then give the free ones back: only data written later is thin.
        with open(image, "r+b") as f:
            while chunk := f.read(2**20):
                f.seek(-len(chunk), os.SEEK_CUR)
                f.write(chunk)
        for first, last in _free_ranges(image):
            _run("fallocate", "--punch-hole", "--keep-size", "--offset", str(first * BLOCK),
                 "--length", str((last - first + 1) * BLOCK), str(image))
        _run("mount", "-o", "loop,errors=continue", str(image), str(root))
        mounted.append(root)
        yield ThinExt4(root, backing)
    finally:
        for path in reversed(mounted):
            if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True)
        for path in (root, backing, where):
            with contextlib.suppress(OSError):
                path.rmdir()
