"""Snapshots for the reader's tests: small synthetic ones in the published layout (hashed by
``aml_pipeline.core.hashing``, the writer's own code) and byte-level tampering."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typing import Any

import numpy as np

from aml_pipeline.core.hashing import digest_snapshot as core_digest
from aml_pipeline.pipeline.stages.manifest import PublishedDataset
from aml_pipeline.simulate.plant import SimulatedPlant, plant_spec_dict
from aml_pipeline.spec import parse_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.library_build import build_dataset


def write_snapshot(root: Path, *, n=(6, 2, 2), H=4, F=3, nodes=("T1", "Q1", "C1", "F1"), controls=("C1",),
                   targets=("T1", "Q1"), version=2, seed=0, runs=None, sparse_x=False) -> Path:
    """A small snapshot in the published layout, hashed by aml_pipeline.core.hashing.

    ``runs``: window counts per run per split (default one run per split); ``sparse_x``: x is
    a sparse file of zeros (large snapshots without writing their bytes)."""
    rng = np.random.default_rng(seed)
    N = sum(n)
    root.mkdir(parents=True)
    (root / "arrays").mkdir()
    shapes = {"x": (N, H, len(nodes)), "u": (N, F, len(controls)), "y": (N, F, len(targets))}
    for k, shape in shapes.items():
        path = root / "arrays" / f"{k}.f32"
        if k == "x" and sparse_x:
            with open(path, "wb") as f:
                f.truncate(int(np.prod(shape)) * 4)
        else:
            path.write_bytes(np.ascontiguousarray(rng.normal(size=shape), dtype="<f4").tobytes())
    spec = {"id": "synthetic", "note": "test"}
    (root / "spec.json").write_text(json.dumps(spec))
    runs = runs or {"train": [n[0]], "val": [n[1]], "test": [n[2]]}
    blocks, ids = [], {}
    for part in ("train", "val", "test"):
        ids[part] = [f"{part}-{i}" for i in range(len(runs[part]))]
        blocks += [{"blockId": f"{r}#0", "runId": r, "split": part, "purgeBeforeSteps": 0, "purgeAfterSteps": 0,
                    "uniqueSteps": c} for r, c in zip(ids[part], runs[part], strict=True)]
    manifest = {
        "version": version, "spec": spec, "allNodes": list(nodes), "controls": list(controls), "targets": list(targets),
        "historySteps": H, "horizonSteps": F, "beatMs": 1000,
        "shapes": {k: list(s) for k, s in shapes.items()},
        "split": {"train": n[0], "val": n[1], "test": n[2], "trainRunIds": ids["train"], "valRunIds": ids["val"],
                  "testRunIds": ids["test"], "excluded": [], "blocks": blocks},
        "norm": {g: {"mean": [0.0] * len(c), "std": [1.0] * len(c), "zeroStd": []}
                 for g, c in (("x", nodes), ("u", controls), ("y", targets))},
    }
    if version == 2:
        manifest["artifacts"] = {"x": "arrays/x.f32", "u": "arrays/u.f32", "y": "arrays/y.f32", "sidecar": "arrays/sidecar.json"}
        (root / "arrays" / "sidecar.json").write_text(json.dumps({"units": []}))
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    rehash(root)
    return root


def rehash(root: Path) -> None:
    """Record the snapshot's current bytes in sha256.json (what a tamperer who re-hashes does)."""
    path = root / "sha256.json"
    if path.exists():
        os.chmod(path, 0o644)
    path.write_bytes(core_digest(root).to_json_bytes())


def rewrite_manifest(root: Path, change) -> None:
    """Apply ``change(manifest)`` and re-hash: a consistent, verifying snapshot."""
    m = json.loads((root / "manifest.json").read_text())
    change(m)
    (root / "manifest.json").write_text(json.dumps(m))
    rehash(root)


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Change one byte in place, as root (published files are read-only to everyone else)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    with open(path, "r+b") as f:
        f.write(bytes(data))


def write_series_snapshot(root: Path, *, runs=(50, 20, 20), H=4, F=3, nodes=("T1", "Q1", "C1", "F1"), controls=("C1",),
                          targets=("T1", "Q1"), seed=0) -> Path:
    """A small series-layout snapshot (v1): one run per split, each its given number of windows
    at stride 1 (one segment), rows random, hashed by aml_pipeline.core.hashing."""
    from aml_pipeline.snapshot.layout import SEGMENT_FIELDS, SERIES_ARRAYS

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    (root / "arrays").mkdir()
    x_rows = sum(n + H - 1 for n in runs)
    f_rows = sum(n + F - 1 for n in runs)
    files = {"xRows": (x_rows, len(nodes)), "uRows": (f_rows, len(controls)), "yRows": (f_rows, len(targets))}
    for key, shape in files.items():
        rng.normal(size=shape).astype("<f4").tofile(root / SERIES_ARRAYS[key][0])
    seg, window, x0, f0 = [], 0, 0, 0
    for i, n in enumerate(runs):
        seg.append((i, window, H, 1_700_000_000_000 + i * 10**7 + H * 1000, x0, f0))
        window, x0, f0 = window + n, x0 + n + H - 1, f0 + n + F - 1
    np.asarray(seg, dtype="<i8").T.copy().tofile(root / SERIES_ARRAYS["segments"][0])
    spec = {"id": "synthetic", "note": "test", "stride": 1, "layout": "series"}
    (root / "spec.json").write_text(json.dumps(spec))
    parts = ("train", "val", "test")
    blocks = [{"blockId": f"{p}-0#0", "runId": f"{p}-0", "split": p, "purgeBeforeSteps": 0, "purgeAfterSteps": 0,
               "uniqueSteps": n} for p, n in zip(parts, runs, strict=True)]
    N = sum(runs)
    manifest = {
        "version": 1, "spec": spec, "allNodes": list(nodes), "controls": list(controls), "targets": list(targets),
        "historySteps": H, "horizonSteps": F, "beatMs": 1000,
        "shapes": {"x": [N, H, len(nodes)], "u": [N, F, len(controls)], "y": [N, F, len(targets)],
                   **{k: list(s) for k, s in files.items()}, "segments": [len(SEGMENT_FIELDS), len(runs)]},
        "split": {**dict(zip(parts, runs, strict=True)), "trainRunIds": ["train-0"], "valRunIds": ["val-0"],
                  "testRunIds": ["test-0"], "excluded": [], "blocks": blocks},
        "norm": {g: {"mean": [0.0] * len(c), "std": [1.0] * len(c), "zeroStd": []}
                 for g, c in (("x", nodes), ("u", controls), ("y", targets))},
        "lineageVerified": 0,
        "artifacts": {k: f for k, (f, _) in SERIES_ARRAYS.items()},
        "layout": "series",
        "series": {"stride": 1, "segmentFields": list(SEGMENT_FIELDS)},
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    rehash(root)
    return root


def publish(plant: SimulatedPlant, url: str, root: Path, *, extras: bool | dict = True, **overrides: Any) -> PublishedDataset:
    """Build and publish a snapshot under ``root`` (``root/datasets/<spec>/<sha>``, with a catalog);
    ``extras``: v2 with the plant's variables, v1, or these extras."""
    data = plant_spec_dict(plant, "snap_ds", history_steps=20, horizon_steps=10, extras=bool(extras),
                           split={"method": "chronological", "train": 0.5, "val": 0.25, "test": 0.25, "seed": 0})
    if isinstance(extras, dict):
        data["extras"] = extras
    data.update(overrides)
    with open_tsdb(url) as db:
        return build_dataset(parse_spec(data), db, store_root=root / "store", datasets_root=root / "datasets")
