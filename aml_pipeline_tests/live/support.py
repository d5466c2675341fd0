"""Helpers of the live-path tests: snapshots of a simulated plant built by the library build, and
points before an origin in the form the live API takes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aml_pipeline.live.points import NodePoints
from aml_pipeline.pipeline.registry import WINDOWS
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.simulate.plant import SimulatedPlant, plant_spec_dict
from aml_pipeline.snapshot import Snapshot, open_snapshot
from aml_pipeline.spec import DatasetSpec, parse_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.library_build import build_dataset


def before(points: dict[str, NodePoints], t: int, since: int | None = None) -> dict[str, tuple[np.ndarray, ...]]:
    """The points before ``t`` (and from ``since``), in the mapping form the live API takes."""
    out = {}
    for node, p in points.items():
        part = p.between(since, t - 1)
        out[node] = (part.ts, part.value, part.state)
    return out


@dataclass
class Built:
    spec: DatasetSpec
    snap: Snapshot
    store: DatasetStore

    def windows(self) -> Iterator[tuple[int, str, int]]:
        """Every window of the snapshot: (index, run id, origin in epoch ms)."""
        for block in self.snap.runs():
            meta = self.store.read_meta(block.run_id, WINDOWS)
            starts = self.store.read_flat(block.run_id, WINDOWS, "starts", 0, len(block))
            for i, start in zip(block.windows, starts.tolist(), strict=True):
                yield i, block.run_id, int(meta["firstMs"]) + start * self.spec.beat_ms


def spec_dict(plant: SimulatedPlant, *, extras: bool = True, point_nodes: tuple[str, ...] = (), **overrides: Any) -> dict[str, Any]:
    """The plant's spec (H 20, F 10), v2 with ``extras``; ``point_nodes`` set ``aggregate: point``."""
    data = plant_spec_dict(plant, "live_ds", history_steps=20, horizon_steps=10, extras=extras,
                           split={"method": "chronological", "train": 0.5, "val": 0.25, "test": 0.25, "seed": 0})
    for node in data["nodes"]:
        if node["nodeId"] in point_nodes:
            node["aggregate"] = "point"
    data.update(overrides)
    return data


def build(data: dict[str, Any], url: str, root: Path) -> Built:
    spec = parse_spec(data)
    with open_tsdb(url) as db:
        published = build_dataset(spec, db, store_root=root / "store", datasets_root=root / "datasets")
    return Built(spec, open_snapshot(published.snapshot_dir), DatasetStore(root / "store", spec))
