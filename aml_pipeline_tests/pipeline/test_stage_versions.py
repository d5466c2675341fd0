"""Stage versions: pinned (existing stores stay valid) and complete (a stage reads no spec field
its version does not cover).

Completeness is tested by behaviour: every field of the spec is changed in turn, and every stage
whose version did not change must produce the same bytes as before. A stage whose code read a
field that its version does not cover would produce other bytes under the same version: exactly
the silent correctness bug (a stale result reused) this guards against.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aml_pipeline.errors import BuildError
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.registry import STAGES, StageVersions
from aml_pipeline.simulate.plant import plant_spec_dict
from aml_pipeline.spec import load_spec, parse_spec
from aml_pipeline.tsdb_open import open_tsdb

ROOT = Path(__file__).resolve().parents[2]

PINNED = {
    "plant v1": {
        "raw": "raw-400dcb701430509e", "grid": "grid-829289f18a7b17f5", "windows": "windows-1d760cb8c6e36d26",
        "split": "split-16a3dbbc97b026ac", "norm": "norm-f078193052f6783b", "manifest": "manifest-f9dc36d033a8c48d",
    },
    "plant v2": {
        "raw": "raw-400dcb701430509e", "grid": "grid-829289f18a7b17f5", "windows": "windows-20f2540b64b88f17",
        "split": "split-b87c6981e6d57382", "norm": "norm-6847e3cb3a865280", "manifest": "manifest-9cebc3fb01d70226",
    },
    "specs/reactor_a.yaml": {
        "raw": "raw-400dcb701430509e", "grid": "grid-829289f18a7b17f5", "windows": "windows-86627f61b6bab881",
        "split": "split-6ad7df0c6a3f1371", "norm": "norm-c6a9c3a0dc98e76b", "manifest": "manifest-b0568363e9c5c97b",
    },
}


def _spec_dict(plant, extras: bool) -> dict[str, Any]:
    return plant_spec_dict(plant, "plant_ds", history_steps=20, horizon_steps=10, extras=extras)


@pytest.mark.parametrize("name", list(PINNED))
def test_fingerprints_are_pinned(name: str, plant) -> None:
    """Stores built before keep their stages: a changed fingerprint would rebuild every run."""
    if name.startswith("specs/"):
        spec = load_spec(ROOT / name)
    else:
        spec = parse_spec(_spec_dict(plant, extras=name.endswith("v2")))
    versions = StageVersions.of(spec)
    assert {s.name: versions[s] for s in STAGES} == PINNED[name]


# ---- every spec field, changed in turn -----------------------------------------------------------

Change = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Change:
    def change(d: dict[str, Any]) -> None:
        *parents, last = re.findall(r"[A-Za-z_]+|\d+", path)
        target: Any = d
        for p in parents:
            target = target[int(p)] if p.isdigit() else target[p]
        target[int(last) if last.isdigit() else last] = value

    return change


def _all(*changes: Change) -> Change:
    def change(d: dict[str, Any]) -> None:
        for c in changes:
            c(d)

    return change


# One change per field of the spec (``[*]`` stands for every node or variable): a value that moves
# the output of whichever stage reads the field. The test below fails when a field of the spec has
# no entry here, so a new field cannot be added without saying how it is exercised.
CHANGES: dict[str, Change] = {
    "id": _set("id", "plant_ds_b"),
    "lineId": _set("lineId", "L2"),
    "productId": _set("productId", "P200"),
    "recipeId": _set("recipeId", "R8"),
    "fromMs": _set("fromMs", 1),
    "toMs": _set("toMs", 2),
    "beatMs": _set("beatMs", 2000),
    "maxInterpMs": _set("maxInterpMs", 1000),
    "aggregate": _set("aggregate", "mean"),
    "causal": _set("causal", True),
    "historySteps": _set("historySteps", 15),
    "horizonSteps": _set("horizonSteps", 5),
    "stride": _set("stride", 3),
    "nodes[*].nodeId": lambda d: _rename_node(d, "TI900", "TI900_B"),
    "nodes[*].role": _set("nodes.4.role", "control"),
    "nodes[*].interp": _set("nodes.0.interp", "hold"),
    "nodes[*].range": _set("nodes.0.range", [0.0, 30.0]),
    "nodes[*].hampelK": _set("nodes.0.hampelK", 2),
    "nodes[*].hampelMinDev": _set("nodes.0.hampelMinDev", 0.5),
    "nodes[*].maxInterpMs": _set("nodes.0.maxInterpMs", 1000),
    "nodes[*].aggregate": _set("nodes.0.aggregate", "mean"),
    "cleaning.hampelK": _set("cleaning.hampelK", 3),
    "cleaning.hampelSigma": _set("cleaning.hampelSigma", 2.0),
    "cleaning.hampelMinDev": _set("cleaning.hampelMinDev", 0.2),
    "cleaning.goodStates": _set("cleaning.goodStates", [0, 1]),
    "split.method": _set("split.method", "hashed"),
    "split.train": _all(_set("split.train", 0.5), _set("split.val", 0.25), _set("split.test", 0.25)),
    "split.val": _all(_set("split.val", 0.3), _set("split.test", 0.0)),
    "split.test": _all(_set("split.train", 0.55), _set("split.test", 0.3)),
    "split.seed": _all(_set("split.method", "hashed"), _set("split.seed", 5)),
    "note": _set("note", "another note"),
    "layout": _set("layout", "series"),
    "schedule": _set("schedule", "0 * * * *"),
    "extras.specRef": _set("extras.specRef", "specs/other.yaml"),
    "extras.specVersion": _set("extras.specVersion", 2),
    "extras.trainerRef": _set("extras.trainerRef", "trainer@1"),
    "extras.conditionId": _set("extras.conditionId", "L1/P100/R7/b"),
    "extras.recipeVersion": _set("extras.recipeVersion", 4),
    "extras.recipeContentHash": _set("extras.recipeContentHash", "0" * 64),
    "extras.evidenceSource": _set("extras.evidenceSource", "real"),
    "extras.availabilityWatermark": _set("extras.availabilityWatermark", 123),
    "extras.variables[*].id": _set("extras.variables.0.id", "ti101_b"),
    "extras.variables[*].nodeId": _all(_set("extras.variables.4.nodeId", "AI910"), _set("extras.variables.5.nodeId", "TI900")),
    "extras.variables[*].role": _set("extras.variables.0.role", "feature"),
    "extras.variables[*].unit": _set("extras.variables.0.unit", "K"),
    "extras.variables[*].modelUnit": _set("extras.variables.0.modelUnit", "degC"),
    "extras.variables[*].scale": _set("extras.variables.0.scale", 2.0),
    "extras.variables[*].offset": _set("extras.variables.0.offset", 1.0),
    "extras.variables[*].delayMs": _set("extras.variables.0.delayMs", 500),
}


def _rename_node(d: dict[str, Any], old: str, new: str) -> None:
    for item in [*d["nodes"], *(d.get("extras") or {}).get("variables", [])]:
        if item["nodeId"] == old:
            item["nodeId"] = new


def _leaf_paths(obj: Any, prefix: str = "") -> set[str]:
    if isinstance(obj, dict):
        out: set[str] = set()
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else k
            # A mapping field whose value is a plain list (range, goodStates) is one field.
            out |= _leaf_paths(v, path) if isinstance(v, (dict, list)) and not _is_value_list(v) else {path}
        return out
    if isinstance(obj, list):
        return set().union(*(_leaf_paths(v, f"{prefix}[*]") for v in obj)) if obj else {f"{prefix}[*]"}
    return {prefix}


def _is_value_list(v: Any) -> bool:
    return isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v)


def test_every_spec_field_has_a_change(plant) -> None:
    spec = parse_spec(_spec_dict(plant, extras=True) | {"schedule": "15 * * * *"})
    fields = _leaf_paths(spec.model_dump(mode="json", by_alias=True))
    assert fields == set(CHANGES), (
        f"fields without a change: {sorted(fields - set(CHANGES))}; changes of no field: {sorted(set(CHANGES) - fields)}"
    )


def _stage_files(store_dir: Path, datasets_dir: Path, stage: str) -> dict[str, bytes]:
    """The bytes a stage produced, by path relative to its dataset (the snapshot's capture time,
    which differs between any two builds, left out)."""
    out: dict[str, bytes] = {}
    if stage in ("raw", "grid", "windows"):
        for f in sorted((store_dir / "runs").glob(f"*/{stage}.*")):
            out[str(f.relative_to(store_dir))] = f.read_bytes()
    elif stage in ("split", "norm"):
        f = store_dir / f"{stage}.json"
        out[f.name] = f.read_bytes()
    else:
        current = (datasets_dir / "current").resolve()
        for f in sorted(p for p in current.rglob("*") if p.is_file()):
            if f.name == "sha256.json":
                continue  # the hash of the files compared here, the capture time included
            data = f.read_bytes()
            if f.name == "manifest.json":
                manifest = json.loads(data)
                manifest.pop("capturedAt", None)
                manifest.get("provenance", {}).pop("capturedAt", None)
                data = json.dumps(manifest, sort_keys=True).encode()
            out[str(f.relative_to(current))] = data
    return out


def _build(spec, url: str, root: Path) -> None:
    with open_tsdb(url) as db:
        try:
            build_dataset(spec, db, store_root=root / "store", datasets_root=root / "datasets")
        except BuildError:
            pass  # e.g. every run excluded by lineage: the run stages built before it are compared


@pytest.mark.parametrize("extras", [False, True], ids=["v1", "v2"])
def test_a_stage_reads_only_what_its_version_covers(extras: bool, plant, plant_url: str, tmp_path: Path) -> None:
    base = _spec_dict(plant, extras=extras)
    base_spec = parse_spec(base)
    base_versions = StageVersions.of(base_spec)
    _build(base_spec, plant_url, tmp_path / "base")
    checked: dict[str, list[str]] = {}
    for field, change in CHANGES.items():
        if field.startswith("extras") and not extras:
            continue
        data = copy.deepcopy(base)
        change(data)
        spec = parse_spec(data)
        versions = StageVersions.of(spec)
        same = [s.name for s in STAGES if versions[s] == base_versions[s]]
        assert len(same) < len(STAGES) or field == "schedule", f"changing {field} changes no stage version"
        if not same:
            continue  # covered by the first stage, hence by every stage after it
        root = tmp_path / field.replace("[*]", "_").replace(".", "_")
        _build(spec, plant_url, root)
        for stage in same:
            a = _stage_files(tmp_path / "base/store" / base_spec.id, tmp_path / "base/datasets" / base_spec.id, stage)
            b = _stage_files(root / "store" / spec.id, root / "datasets" / spec.id, stage)
            assert a, f"the base build left no {stage} output to compare"
            assert a == b, f"changing {field} changes the {stage} stage's output, but not its version"
        checked[field] = same
    # The changes exercised something: each stage was compared under some change that kept it.
    assert {s for kept in checked.values() for s in kept} == {s.name for s in STAGES}
