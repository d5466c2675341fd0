"""The artifact store: per-run intermediate results of one dataset, as numpy files.

Layout: ``<root>/<spec id>/runs/<run id>/<stage>.arr`` plus ``<stage>.json`` (the stage's
summary). The JSON is written last and names the spec fingerprint it was made for, so a reader
never mixes a half-written stage or a stage built for another version of the spec. Every write
is a rename of a finished temporary file.

``.arr`` is a minimal container for named numeric arrays: a magic line, a JSON header (name,
dtype, shape, offset of each array) and the arrays' bytes, each 64-byte aligned. Reading is
one ``readinto`` per array, with no checksum pass (``.npz``, a zip file, computes a CRC32 over
every byte on write and on read, which cost more than the I/O itself here). Stages written as
``.npz`` by earlier versions are still read.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.ids import check_external_id, check_spec_id

STAGES = ("raw", "grid", "windows")


class DatasetStore:
    """Intermediate artifacts of one dataset spec."""

    def __init__(self, root: str | Path, spec_id: str) -> None:
        self.root = Path(root)
        self.spec_id = check_spec_id(spec_id, what="spec id")
        self.dir = self.root / spec_id

    def run_dir(self, run_id: str) -> Path:
        return self.dir / "runs" / check_external_id(run_id, what="run id")

    def _stage_paths(self, run_id: str, stage: str) -> tuple[Path, Path]:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        d = self.run_dir(run_id)
        return d / f"{stage}.arr", d / f"{stage}.json"

    def write_stage(
        self, run_id: str, stage: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]
    ) -> None:
        arr, js = self._stage_paths(run_id, stage)
        arr.parent.mkdir(parents=True, exist_ok=True)
        # Drop the summary first: from here until the new one lands the stage reads as absent.
        js.unlink(missing_ok=True)
        arr.with_suffix(".npz").unlink(missing_ok=True)  # an earlier version's copy
        _atomic_write(arr, lambda f: write_arrays(f, arrays))
        # Compact: with ``indent`` json uses its pure-Python encoder, several ms per stage.
        _atomic_write(js, lambda f: f.write(json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()))

    def read_meta(self, run_id: str, stage: str) -> dict[str, Any] | None:
        _, js = self._stage_paths(run_id, stage)
        try:
            return json.loads(js.read_bytes())
        except FileNotFoundError:
            return None

    def read_arrays(self, run_id: str, stage: str) -> dict[str, np.ndarray]:
        arr, _ = self._stage_paths(run_id, stage)
        try:
            return read_arrays(arr)
        except FileNotFoundError:
            npz = arr.with_suffix(".npz")
            if not npz.exists():
                raise
        with np.load(npz, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}

    def write_json(self, name: str, obj: Any) -> Path:
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1, allow_nan=False).encode()))
        return path

    def read_json(self, name: str) -> Any:
        return json.loads((self.dir / name).read_bytes())

    def stage_runs(self, stage: str) -> list[str]:
        """Runs that have a finished ``stage``."""
        runs = self.dir / "runs"
        if not runs.is_dir():
            return []
        return sorted(p.parent.name for p in runs.glob(f"*/{stage}.json"))

    def remove_run(self, run_id: str) -> None:
        shutil.rmtree(self.run_dir(run_id), ignore_errors=True)


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_MAGIC = b"AML-ARRAYS 1\n"
_ALIGN = 64


def write_arrays(f: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """Write named numeric arrays to the binary file ``f`` (see the module docstring)."""
    items = []
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.kind not in "biuf" or a.dtype.hasobject:
            raise ValueError(f"array {name!r}: dtype {a.dtype} is not a plain numeric type")
        items.append((str(name), np.ascontiguousarray(a)))
    entries, offset = [], 0
    for name, a in items:
        entries.append([name, a.dtype.str, list(a.shape), offset, a.nbytes])
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    header = json.dumps({"arrays": entries}).encode()
    start = -(-(len(_MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN
    f.write(_MAGIC + len(header).to_bytes(8, "little") + header)
    f.write(b"\0" * (start - len(_MAGIC) - 8 - len(header)))
    pos = 0
    for (_, a), (_, _, _, off, nbytes) in zip(items, entries, strict=True):
        if off > pos:
            f.write(b"\0" * (off - pos))
        if nbytes:
            f.write(memoryview(a.reshape(-1)).cast("B"))
        pos = off + nbytes


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """Read a file written by :func:`write_arrays`; a truncated or foreign file is an error."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(len(_MAGIC) + 8)
        if len(head) < len(_MAGIC) + 8 or not head.startswith(_MAGIC):
            raise ValueError(f"{path}: not an array file of this store")
        size = int.from_bytes(head[len(_MAGIC):], "little")
        header = json.loads(f.read(size))
        start = -(-(len(_MAGIC) + 8 + size) // _ALIGN) * _ALIGN
        out: dict[str, np.ndarray] = {}
        for name, dtype, shape, off, nbytes in header["arrays"]:
            dt = np.dtype(dtype)
            if dt.kind not in "biuf":
                raise ValueError(f"{path}: array {name!r} has dtype {dt}, not a plain numeric type")
            a = np.empty(shape, dtype=dt)
            if a.nbytes != nbytes:
                raise ValueError(f"{path}: array {name!r} is {nbytes} bytes for shape {shape} of {dt}")
            if nbytes:
                f.seek(start + off)
                view = memoryview(a.reshape(-1)).cast("B")
                got = 0
                while got < nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise ValueError(f"{path}: truncated (array {name!r})")
                    got += n
            out[name] = a
    return out
