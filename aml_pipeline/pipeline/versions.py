"""Stage-scoped versions: each stage's fingerprint covers only what changes its output.

A stage's fingerprint hashes the spec fields it reads, the fingerprint of the stage it reads from
and its own algorithm version, so editing ``split`` leaves the run stages valid (nothing is fetched
or cleaned again), editing one node's ``hampelK`` re-cleans without refetching, and editing ``note``
only republishes. The fingerprints are the Dagster assets' code versions, so the UI's stale markers
point at exactly the stages that must rerun, and the stored stage summaries record them, so the
CLI's incremental build decides the same way.

Per run, a stage's *data version* chains its fingerprint with its input's data version; the raw
stage's input is the run's version in the TSDB (``TsdbPort.run_versions``), so late points make
that run, and only that run, stale.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from aml_pipeline.spec import DatasetSpec

# Bump a stage's number when its numeric rule or output format changes: its stored results (and
# everything downstream) are then rebuilt, never mixed in.
ALGORITHMS = {"raw": 2, "grid": 2, "windows": 2, "split": 1, "norm": 2, "manifest": 2}

RUN_STAGES = ("raw", "grid", "windows")
DATASET_STAGES = ("split", "norm", "manifest")


@dataclass(frozen=True)
class StageVersions:
    raw: str
    grid: str
    windows: str
    split: str
    norm: str
    manifest: str

    def of(self, stage: str) -> str:
        return getattr(self, stage)


def _digest(stage: str, upstream: str, fields: dict[str, Any]) -> str:
    body = json.dumps({"upstream": upstream, "algorithm": ALGORITHMS[stage], "fields": fields}, sort_keys=True)
    return f"{stage}-{hashlib.sha256(body.encode()).hexdigest()[:16]}"


def stage_versions(spec: DatasetSpec) -> StageVersions:
    """The fingerprint of every stage of ``spec`` (cached per spec object; specs are frozen)."""
    hit = _CACHE.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    j = spec.to_json_dict()
    raw = _digest(
        "raw",
        "",
        {k: j[k] for k in ("lineId", "productId", "recipeId", "fromMs", "toMs")} | {"nodes": spec.node_ids},
    )
    grid = _digest(
        "grid",
        raw,
        {
            "beatMs": j["beatMs"],
            "maxInterpMs": j["maxInterpMs"],
            "cleaning": j["cleaning"],
            "nodes": [
                {k: n[k] for k in ("nodeId", "interp", "range", "hampelK", "hampelMinDev", "maxInterpMs")}
                for n in j["nodes"]
            ],
        },
    )
    transforms = spec.unit_transforms()
    windows = _digest(
        "windows",
        grid,
        {
            "historySteps": j["historySteps"],
            "horizonSteps": j["horizonSteps"],
            "stride": j["stride"],
            "roles": [n["role"] for n in j["nodes"]],
            "units": {n: [t.scale, t.offset] for n, t in sorted(transforms.items())},
        },
    )
    extras = j.get("extras")
    split = _digest(
        "split",
        windows,
        {
            "split": j["split"],
            # v2 lineage decides which runs are excluded.
            "lineage": None if extras is None else [extras["recipeVersion"], extras["recipeContentHash"]],
        },
    )
    norm = _digest("norm", split, {})
    manifest = _digest("manifest", norm, {"spec": spec.fingerprint()})
    versions = StageVersions(raw, grid, windows, split, norm, manifest)
    if len(_CACHE) >= 64:
        _CACHE.clear()
    _CACHE[id(spec)] = (spec, versions)
    return versions


_CACHE: dict[int, tuple[DatasetSpec, StageVersions]] = {}


def chain_version(fingerprint: str, upstream: str | None) -> str:
    """A stage's data version for one run: its fingerprint chained with its input's version."""
    return hashlib.sha256(f"{fingerprint}|{upstream}".encode()).hexdigest()[:24]
