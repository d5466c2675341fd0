"""The registry of the six stages of a dataset build, and every stage's fingerprint for a spec.

Per run: ``raw`` (fetch from the TSDB) -> ``grid`` (clean and align) -> ``windows`` (model units,
window starts); per dataset: ``split`` -> ``norm`` -> ``manifest`` (the published snapshot). Each
stage module declares its :class:`~aml_pipeline.pipeline.stages.base.Stage`: name, Dagster asset,
upstream, the spec fields its version covers, its files. Everything else (store paths, asset
keys, jobs, the sensor, checks, gc) derives from these declarations, and :class:`StageVersions`
derives every stage's fingerprint from them once per spec.

The registry lives apart from the stages' package (``pipeline/stages/__init__.py`` imports
nothing), so the store and the stage modules import one another's value classes from
``stages/base.py`` without passing through a half-initialised package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from aml_pipeline.pipeline.stages.base import Stage, stage_digest
from aml_pipeline.pipeline.stages.grid import GRID
from aml_pipeline.pipeline.stages.manifest import MANIFEST
from aml_pipeline.pipeline.stages.norm import NORM
from aml_pipeline.pipeline.stages.raw import RAW
from aml_pipeline.pipeline.stages.split import SPLIT
from aml_pipeline.pipeline.stages.windows import WINDOWS
from aml_pipeline.spec import DatasetSpec

STAGES: tuple[Stage, ...] = (RAW, GRID, WINDOWS, SPLIT, NORM, MANIFEST)
RUN_STAGES: tuple[Stage, ...] = tuple(s for s in STAGES if s.per_run)
DATASET_STAGES: tuple[Stage, ...] = tuple(s for s in STAGES if not s.per_run)
RUN_ASSETS: tuple[str, ...] = tuple(s.asset for s in RUN_STAGES)
DATASET_ASSETS: tuple[str, ...] = tuple(s.asset for s in DATASET_STAGES)


def stages_from(stage: Stage) -> tuple[Stage, ...]:
    """The run stage and every run stage after it."""
    return RUN_STAGES[RUN_STAGES.index(stage) :]


@dataclass(frozen=True)
class StageVersions:
    """Every stage's fingerprint for one spec, derived once (:meth:`of`) and carried."""

    fingerprints: Mapping[str, str]

    @classmethod
    def of(cls, spec: DatasetSpec) -> StageVersions:
        j = spec.to_json_dict()
        out: dict[str, str] = {}
        for stage in STAGES:
            upstream = out[stage.upstream] if stage.upstream else ""
            out[stage.name] = stage_digest(stage, upstream, stage.covers(spec, j))
        return cls(MappingProxyType(out))

    def __getitem__(self, stage: Stage) -> str:
        return self.fingerprints[stage.name]

    def is_current(self, stage: Stage, stored: Mapping[str, Any] | None) -> bool:
        """Whether a stored result of ``stage`` (its summary) was built for this version."""
        return stored is not None and stored.get("fingerprint") == self[stage]


__all__ = [
    "DATASET_ASSETS", "DATASET_STAGES", "GRID", "MANIFEST", "NORM", "RAW", "RUN_ASSETS", "RUN_STAGES", "SPLIT",
    "STAGES", "WINDOWS", "StageVersions", "stages_from",
]
