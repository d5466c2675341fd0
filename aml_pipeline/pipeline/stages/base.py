"""What a stage is, and how its version is derived from what it declares.

A stage's *fingerprint* hashes the spec fields it declares (:attr:`Stage.covers`), the fingerprint
of the stage it reads from and its own algorithm number, so editing ``split`` leaves the run
stages valid (nothing is fetched or cleaned again), editing one node's ``hampelK`` re-cleans
without refetching, and editing ``note`` only republishes. The fingerprints are the Dagster
assets' code versions, so the UI's stale markers point at exactly the stages that must rerun;
the stored stage summaries record them, so the CLI's incremental build decides the same way.

Per run, a stage's *data version* chains its fingerprint with its input's data version; the raw
stage's input is the run's version in the TSDB (``TsdbPort.run_versions``), so late points make
that run, and only that run, stale.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aml_pipeline.spec import DatasetSpec

# The spec fields a stage's output depends on, from the spec and its JSON form (``spec.json``'s
# camelCase dict, computed once for all stages).
Covers = Callable[[DatasetSpec, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Stage:
    """One stage of a dataset build, declared once in its module of :mod:`aml_pipeline.pipeline.stages`.

    ``algorithm``: bump it when the stage's numeric rule or output format changes; its stored
    results (and everything downstream) are then rebuilt, never mixed in. ``files``: what the
    stage stores (per run: array names, ``<stage>.<name>.npy``, and small files,
    ``<stage>.<name>``; per dataset: its JSON file).
    """

    name: str
    asset: str
    upstream: str | None
    per_run: bool
    algorithm: int
    covers: Covers
    files: tuple[str, ...]
    description: str

    def __str__(self) -> str:
        return self.name


def stage_digest(stage: Stage, upstream_fingerprint: str, fields: Mapping[str, Any]) -> str:
    body = json.dumps({"upstream": upstream_fingerprint, "algorithm": stage.algorithm, "fields": fields}, sort_keys=True)
    return f"{stage.name}-{hashlib.sha256(body.encode()).hexdigest()[:16]}"


def chain_version(fingerprint: str, upstream: str | None) -> str:
    """A stage's data version for one run: its fingerprint chained with its input's version."""
    return hashlib.sha256(f"{fingerprint}|{upstream}".encode()).hexdigest()[:24]


def derived_stage_summary(fingerprint: str, input_meta: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    """The committed summary of a run stage built from the stage before it (``input_meta``): its
    version chained on the input's, the run record and units carried over, then ``fields``."""
    return {
        "fingerprint": fingerprint,
        "dataVersion": chain_version(fingerprint, input_meta["dataVersion"]),
        "inputVersion": input_meta["dataVersion"],
        "run": input_meta["run"],
        "units": input_meta["units"],
        **fields,
    }


def inputs_key(*parts: Any) -> str:
    """A short, stable hash of JSON-able inputs (what a stage's result was computed from)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
