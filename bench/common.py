"""Small helpers shared by the benchmark modules: memory, scratch directories."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def proc_status_kb(field: str, pid: int | str = "self") -> int | None:
    """A ``/proc/<pid>/status`` field in kB (VmRSS, VmHWM, ...), None where unavailable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total
