"""manifest.json and the v2 sidecar: what a consumer needs to read a snapshot without this code.

camelCase throughout (the predecessor's contract). v1 keeps the predecessor's fields; v2 (a spec
with ``extras``) adds data kind, spec ref, variables, artifacts and provenance. A series snapshot's
manifest is the windows layout's for the same spec and data (:func:`build_manifest`) with the
series files added (:func:`series_manifest`), and :func:`windows_manifest` takes them out again,
byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from aml_pipeline.core.lineage import RunLineage
from aml_pipeline.snapshot.layout import (
    ARRAYS,
    SEGMENT_FIELDS,
    SERIES_ARRAYS,
    SERIES_LAYOUT,
    SIDECAR_FILE,
    SPLITS,
    V1_ARRAYS,
    manifest_layout,
)

ARRAYS_V1 = {k: ARRAYS[k][0] for k in V1_ARRAYS}
ARTIFACTS_V2 = {**{k: f for k, (f, _) in ARRAYS.items()}, "sidecar": SIDECAR_FILE}


def to_json_bytes(obj: Any) -> bytes:
    """The one JSON encoding of snapshot files: stable key order as built, 2-space indent."""
    return (json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def build_manifest(
    spec_json: Mapping[str, Any],
    *,
    node_ids: Sequence[str],
    control_ids: Sequence[str],
    target_ids: Sequence[str],
    history: int,
    horizon: int,
    beat_ms: int,
    split: Mapping[str, Any],
    norm: Mapping[str, Any],
    lineage: RunLineage | None,
    extras: Mapping[str, Any] | None,
    availability_watermark: int | None,
    captured_at: str,
    node_ranges: Mapping[str, Sequence[float | None]] | None = None,
) -> dict[str, Any]:
    """The manifest. ``node_ranges`` (a causal dataset's: the range each node was cleaned with,
    its own or the node catalog's) adds ``causal: true`` and ``nodeRanges``, so the snapshot holds
    everything the live path needs; without it the manifest is the predecessor's."""
    n = int(split["train"]) + int(split["val"]) + int(split["test"])
    manifest: dict[str, Any] = {
        "version": 1,
        "spec": dict(spec_json),
        "allNodes": list(node_ids),
        "controls": list(control_ids),
        "targets": list(target_ids),
        "historySteps": history,
        "horizonSteps": horizon,
        "shapes": {
            "x": [n, history, len(node_ids)],
            "u": [n, horizon, len(control_ids)],
            "y": [n, horizon, len(target_ids)],
        },
        "split": dict(split),
        "norm": dict(norm),
        "beatMs": beat_ms,
        "lineageVerified": 0,
    }
    if extras is None:
        return _with_ranges(manifest, node_ranges)
    run_ids = [r for part in SPLITS for r in split[f"{part}RunIds"]]
    lineage = lineage or RunLineage()
    manifest.update(
        {
            "version": 2,
            "lineageVerified": lineage.lineage_verified,
            "dataKind": "static" if extras.get("trainerRef") == "static_response@1" else "dynamic",
            "specHash": extras.get("specRef", ""),
            "specVersion": extras.get("specVersion"),
            "recipeVersion": extras.get("recipeVersion"),
            "variables": list(extras.get("variables") or []),
            "artifacts": dict(ARTIFACTS_V2),
            "provenance": {
                "lineId": spec_json["lineId"],
                "productId": spec_json["productId"],
                "recipeId": spec_json["recipeId"],
                "recipeVersion": extras.get("recipeVersion"),
                "runIds": run_ids,
                "recipeContentHash": extras.get("recipeContentHash"),
                "evidenceSource": extras.get("evidenceSource"),
                "availabilityWatermark": availability_watermark,
                "capturedAt": captured_at,
                "lineageVerified": lineage.lineage_verified,
                "runLineage": lineage.to_json(),
            },
        }
    )
    manifest["shapes"].update({"timestamps": [n, history + horizon], "mask": [n, history + horizon]})
    return _with_ranges(manifest, node_ranges)


def _with_ranges(manifest: dict[str, Any], node_ranges: Mapping[str, Sequence[float | None]] | None) -> dict[str, Any]:
    if node_ranges is not None:
        manifest["causal"] = True
        manifest["nodeRanges"] = {node: list(r) for node, r in node_ranges.items()}
    return manifest


def series_manifest(
    manifest: Mapping[str, Any], *, stride: int, x_rows: int, future_rows: int, segments: int
) -> dict[str, Any]:
    """The series layout's manifest: the windows layout's ``manifest`` (whose ``spec`` already
    names the layout) with ``layout``, the series files' shapes and, as ``artifacts``, the files
    hashed after the manifest (v2: the series files, then the sidecar)."""
    out = {k: v for k, v in manifest.items()}
    nodes, controls, targets = (len(manifest[k]) for k in ("allNodes", "controls", "targets"))
    out["shapes"] = {
        **manifest["shapes"],
        "xRows": [x_rows, nodes],
        "uRows": [future_rows, controls],
        "yRows": [future_rows, targets],
        "segments": [len(SEGMENT_FIELDS), segments],
    }
    artifacts = {k: f for k, (f, _) in SERIES_ARRAYS.items()}
    if manifest["version"] == 2:
        artifacts["sidecar"] = SIDECAR_FILE
    out["artifacts"] = artifacts  # v2: in the place of the windows layout's list
    out["layout"] = SERIES_LAYOUT
    out["series"] = {"stride": stride, "segmentFields": list(SEGMENT_FIELDS)}
    return out


def windows_manifest(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The windows layout's manifest for the same spec and data as the series ``manifest``
    (the inverse of :func:`series_manifest`; the spec without its ``layout``)."""
    if manifest_layout(manifest) != SERIES_LAYOUT:
        return dict(manifest)
    out = {k: v for k, v in manifest.items() if k not in ("layout", "series")}
    out["spec"] = {k: v for k, v in manifest["spec"].items() if k != "layout"}
    out["shapes"] = {k: v for k, v in manifest["shapes"].items() if k not in SERIES_ARRAYS}
    if manifest["version"] == 2:
        out["artifacts"] = dict(ARTIFACTS_V2)
    else:
        del out["artifacts"]
    return out


def build_sidecar(
    extras: Mapping[str, Any], split: Mapping[str, Any], availability_watermark: int | None
) -> dict[str, Any]:
    variables = list(extras.get("variables") or [])
    return {
        "delays": {v["id"]: v.get("delayMs") or 0 for v in variables},
        "units": [
            {
                "id": v["id"],
                "unit": v.get("unit", ""),
                "modelUnit": v.get("modelUnit") or v.get("unit", ""),
                "scale": v["scale"],
                "offset": v["offset"],
            }
            for v in variables
        ],
        "variableOrder": [v["id"] for v in variables],
        "trainerRef": extras.get("trainerRef", ""),
        "conditionId": extras.get("conditionId", ""),
        "recipeContentHash": extras.get("recipeContentHash"),
        "evidenceSource": extras.get("evidenceSource"),
        "availabilityWatermark": availability_watermark,
        "splitRunIds": {part: list(split[f"{part}RunIds"]) for part in SPLITS},
    }
