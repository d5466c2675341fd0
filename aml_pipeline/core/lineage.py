"""Run lineage (manifest v2): can each run be shown to come from the spec's recipe?

verified: the run's context is confirmed and its recipe version and content hash match the
spec's extras. unknown: no confirmed context (cannot be checked either way). excluded: a
confirmed context that contradicts the spec; such runs are left out of the dataset.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunContext:
    run_id: str
    context_confirmed: bool
    recipe_version: int | None
    recipe_content_hash: str | None


@dataclass
class RunLineage:
    verified: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    excluded: list[dict[str, str]] = field(default_factory=list)  # {runId, reason}

    @property
    def lineage_verified(self) -> int:
        """1 iff every run is verified (none unknown, none excluded) and there is at least one."""
        return int(not self.unknown and not self.excluded and bool(self.verified))

    @property
    def excluded_ids(self) -> set[str]:
        return {e["runId"] for e in self.excluded}

    def to_json(self) -> dict:
        return {"verified": self.verified, "unknown": self.unknown, "excluded": self.excluded}


def classify_lineage(
    runs: Iterable[RunContext], *, recipe_version: int, recipe_content_hash: str
) -> RunLineage:
    out = RunLineage()
    for run in runs:
        if not run.context_confirmed:
            out.unknown.append(run.run_id)
            continue
        problems = []
        if run.recipe_version != recipe_version:
            problems.append(f"recipe version {run.recipe_version} != spec's {recipe_version}")
        if run.recipe_content_hash != recipe_content_hash:
            problems.append(
                f"recipe content hash {run.recipe_content_hash!r} != spec's {recipe_content_hash!r}"
            )
        if problems:
            out.excluded.append({"runId": run.run_id, "reason": "lineage: " + "; ".join(problems)})
        else:
            out.verified.append(run.run_id)
    return out
