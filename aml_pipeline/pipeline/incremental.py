"""What a rebuild must redo: per run, the first stale stage; per dataset, whether anything changed.

A run stage is stale when it is missing, was built for another stage version (its fingerprint,
see :mod:`aml_pipeline.pipeline.versions`), or its input changed: for the raw stage the run in
the TSDB (its record, its version from ``TsdbPort.run_versions``, the catalog ranges), for the
later stages the data version of the stage they read. Everything downstream of a stale stage is
stale too. The CLI's incremental build, the new-run sensor and the UI's stale markers (code
versions) all follow these rules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aml_pipeline.pipeline.runs import catalog_ranges
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.pipeline.versions import RUN_STAGES, stage_versions
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb.port import Node, Run


def first_stale_stage(
    spec: DatasetSpec,
    store: DatasetStore,
    run: Run,
    *,
    tsdb_version: str | None,
    catalog: Mapping[str, Node],
) -> str | None:
    """The first of ``raw``, ``grid``, ``windows`` that must be rebuilt for ``run`` (None: fresh)."""
    versions = stage_versions(spec)
    upstream: str | None = None
    for stage in RUN_STAGES:
        meta = store.read_meta(run.run_id, stage)
        if meta is None or meta.get("fingerprint") != versions.of(stage):
            return stage
        if stage == "raw":
            if (
                meta.get("tsdbVersion") != tsdb_version
                or meta.get("run") != dataclasses.asdict(run)
                or meta.get("catalogRange") != catalog_ranges(spec, catalog)
            ):
                return stage
        elif meta.get("inputVersion") != upstream:
            return stage
        upstream = meta.get("dataVersion")
    return None


def stale_runs(
    spec: DatasetSpec,
    store: DatasetStore,
    runs: Iterable[Run],
    *,
    tsdb_versions: Mapping[str, str] | None,
    catalog: Mapping[str, Node],
) -> dict[str, str]:
    """``{run id: first stale stage}`` for the runs that need work (fresh runs are left out)."""
    out = {}
    for run in runs:
        stage = first_stale_stage(
            spec, store, run, tsdb_version=None if tsdb_versions is None else tsdb_versions.get(run.run_id), catalog=catalog
        )
        if stage is not None:
            out[run.run_id] = stage
    return out


def stages_from(stage: str) -> tuple[str, ...]:
    """The stage and every run stage after it."""
    return RUN_STAGES[RUN_STAGES.index(stage) :]


def contiguous_ranges(keys: Sequence[str], wanted: Iterable[str], max_len: int) -> list[list[str]]:
    """``wanted`` as runs of consecutive ``keys`` (partition order), each at most ``max_len`` long."""
    want = set(wanted)
    out: list[list[str]] = []
    current: list[str] = []
    for key in keys:
        if key in want and len(current) < max_len:
            current.append(key)
            continue
        if current:
            out.append(current)
            current = []
        if key in want:
            current.append(key)
    if current:
        out.append(current)
    return out


def inputs_key(*parts: Any) -> str:
    """A short, stable hash of JSON-able inputs (what a dataset stage was computed from)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
