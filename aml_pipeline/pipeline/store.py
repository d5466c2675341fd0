"""The artifact store: per-run intermediate results of one dataset, as numpy files.

Layout: ``<root>/<spec id>/runs/<run id>/<stage>.npz`` plus ``<stage>.json`` (the stage's
summary). The JSON is written last and names the spec fingerprint it was made for, so a reader
never mixes a half-written stage or a stage built for another version of the spec. Every write
is a rename of a finished temporary file.
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
        return d / f"{stage}.npz", d / f"{stage}.json"

    def write_stage(
        self, run_id: str, stage: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]
    ) -> None:
        npz, js = self._stage_paths(run_id, stage)
        npz.parent.mkdir(parents=True, exist_ok=True)
        # Drop the summary first: from here until the new one lands the stage reads as absent.
        js.unlink(missing_ok=True)
        _atomic_write(npz, lambda f: np.savez(f, **arrays))
        _atomic_write(js, lambda f: f.write(json.dumps(meta, indent=1, allow_nan=False).encode()))

    def read_meta(self, run_id: str, stage: str) -> dict[str, Any] | None:
        _, js = self._stage_paths(run_id, stage)
        try:
            return json.loads(js.read_bytes())
        except FileNotFoundError:
            return None

    def read_arrays(self, run_id: str, stage: str) -> dict[str, np.ndarray]:
        npz, _ = self._stage_paths(run_id, stage)
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
