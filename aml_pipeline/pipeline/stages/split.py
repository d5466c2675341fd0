"""The split stage: the dataset's runs split into train, val and test by run, never by window.

v2 specs classify each run's lineage first (runs whose recipe does not match are excluded, with
the reason); runs without windows are excluded too. Chronological or hashed
(:func:`aml_pipeline.core.split.split_runs`); one block per run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aml_pipeline.core.lineage import RunContext, RunLineage, classify_lineage
from aml_pipeline.core.split import split_blocks, split_runs
from aml_pipeline.errors import BuildError
from aml_pipeline.pipeline.metadata import FilePath, Markdown, Table
from aml_pipeline.pipeline.reports import lineage_rows, lineage_summary, overview_markdown
from aml_pipeline.pipeline.stages.base import Stage, inputs_key
from aml_pipeline.pipeline.stages.windows import WINDOWS
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.snapshot.layout import SPLITS
from aml_pipeline.spec import DatasetSpec


def _covers(spec: DatasetSpec, j: Mapping[str, Any]) -> dict[str, Any]:
    extras = j.get("extras")
    return {
        "split": j["split"],
        # v2 lineage decides which runs are excluded.
        "lineage": None if extras is None else [extras["recipeVersion"], extras["recipeContentHash"]],
    }


SPLIT = Stage(
    name="split",
    asset="dataset_split",
    upstream="windows",
    per_run=False,
    algorithm=1,
    covers=_covers,
    files=("split.json",),
    description="Runs split by run (never by window) into train/val/test; lineage (v2); exclusions with reasons.",
)


@dataclass
class DatasetPlan:
    """Which runs go where. ``split`` is the manifest's ``split`` section; ``fingerprint`` the
    split stage's version it was planned under."""

    split: dict[str, Any]
    lineage: RunLineage | None
    runs: dict[str, dict[str, Any]]  # run id -> windows-stage summary, for runs in the dataset
    fingerprint: str

    def ordered_runs(self) -> list[tuple[str, str]]:
        """(split, run id) in snapshot order: train, val, test; runs in split order."""
        return [(part, r) for part in SPLITS for r in self.split[f"{part}RunIds"]]

    def key(self) -> str:
        """What the later stages are computed from: the split and each run's windows data version."""
        return inputs_key(
            self.fingerprint,
            self.split,
            None if self.lineage is None else self.lineage.to_json(),
            {r: m.get("dataVersion") for r, m in sorted(self.runs.items())},
        )

    def line(self) -> str:
        s = self.split
        return (
            f"split: train {len(s['trainRunIds'])} runs / {s['train']} windows, val {len(s['valRunIds'])} / "
            f"{s['val']}, test {len(s['testRunIds'])} / {s['test']}, excluded {len(s['excluded'])}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "lineage": None if self.lineage is None else self.lineage.to_json(),
            "runs": self.runs,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DatasetPlan:
        lin = obj.get("lineage")
        return cls(obj["split"], None if lin is None else RunLineage(**lin), obj["runs"], obj["fingerprint"])


def plan_dataset(store: DatasetStore, run_ids: Sequence[str]) -> DatasetPlan:
    """Split the given runs (the dataset's partitions) by run, never by window."""
    spec = store.spec
    metas: dict[str, dict[str, Any]] = {}
    excluded: list[dict[str, str]] = []
    for run_id in run_ids:
        meta = store.read_meta(run_id, WINDOWS)
        if meta is None:
            excluded.append({"runId": run_id, "reason": "run_windows not materialised for this run"})
        elif not store.versions.is_current(WINDOWS, meta):
            raise BuildError(
                f"run {run_id!r}: its windows were built for another version of spec {spec.id!r} "
                f"({meta.get('fingerprint')}, now {store.versions[WINDOWS]}); rematerialise the run partitions"
            )
        else:
            metas[run_id] = meta

    lineage: RunLineage | None = None
    if spec.extras is not None:
        lineage = classify_lineage(
            (
                RunContext(
                    r,
                    bool(m["run"]["context_confirmed"]),
                    m["run"]["recipe_version"],
                    m["run"]["recipe_content_hash"],
                )
                for r, m in metas.items()
            ),
            recipe_version=spec.extras.recipe_version,
            recipe_content_hash=spec.extras.recipe_content_hash,
        )
        excluded.extend(lineage.excluded)

    lineage_out = lineage.excluded_ids if lineage else set()
    candidates: list[tuple[str, int]] = []
    for run_id, meta in metas.items():
        if run_id in lineage_out:
            continue
        if meta["windows"] == 0:
            excluded.append({"runId": run_id, "reason": f"no windows: {meta['reason']}"})
        else:
            candidates.append((run_id, int(meta["run"]["started_at"])))
    excluded.sort(key=lambda e: e["runId"])

    if not candidates:
        reasons = "; ".join(f"{e['runId']}: {e['reason']}" for e in excluded[:3])
        more = f" (and {len(excluded) - 3} more)" if len(excluded) > 3 else ""
        stride = _stride_past_the_runs(spec, {r: m for r, m in metas.items() if r not in lineage_out})
        raise BuildError(
            f"spec {spec.id!r}: the build yields no windows from {len(run_ids)} run(s)"
            + (f": {stride}" if stride else f" — {reasons}{more}" if reasons else ""),
            code="NO_WINDOWS",
        )
    s = spec.split
    parts = split_runs(candidates, method=s.method, train=s.train, val=s.val, test=s.test, seed=s.seed)
    if not parts["train"]:
        raise BuildError(
            f"spec {spec.id!r}: no run falls into train ({len(candidates)} run(s) with windows, "
            f"split {s.method}); normalisation is fitted on train only",
            code="NO_TRAIN_RUNS",
        )
    windows = {r: int(metas[r]["windows"]) for r, _ in candidates}
    split = {
        "trainRunIds": parts["train"],
        "valRunIds": parts["val"],
        "testRunIds": parts["test"],
        "excluded": excluded,
        **{part: sum(windows[r] for r in parts[part]) for part in SPLITS},
        "blocks": split_blocks(parts, windows),
    }
    return DatasetPlan(split, lineage, {r: metas[r] for r, _ in candidates}, store.versions[SPLIT])


def _stride_past_the_runs(spec: DatasetSpec, metas: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why no run yields a window when the stride, not the data, is the reason: a stride at least
    as long as every run's possible windows tries only each run's first window, so a gap there
    (as at a run's start) costs the whole run; the runs' own reasons would name only that gap."""
    possible = {r: int(m["rows"]) - spec.history_steps - spec.horizon_steps + 1 for r, m in metas.items()}
    if not possible or spec.stride == 1:
        return None
    longest = max(possible, key=lambda r: (possible[r], r))
    n = possible[longest]
    if n <= 1 or spec.stride < n:
        return None
    return (f"stride {spec.stride} is longer than the runs (the longest, {longest}, has {metas[longest]['rows']} grid "
            f"rows: {n} possible windows), so only each run's first window is tried and none is complete; "
            f"use a stride below {n}")


def save_plan(store: DatasetStore, plan: DatasetPlan) -> Path:
    return store.write_dataset_stage(SPLIT, plan.to_json())


def load_plan(store: DatasetStore) -> DatasetPlan:
    return DatasetPlan.from_json(store.require_dataset_stage(SPLIT))


def empty_splits(spec: DatasetSpec, runs: Mapping[str, int]) -> str | None:
    """Why val or test got no runs though the spec gives it a share, naming the split rule, in one
    line; None when every split with a share has runs. ``runs``: runs per split."""
    split = spec.split
    empty = [p for p in ("val", "test") if runs[p] == 0 and getattr(split, p) > 0]
    if not empty:
        return None
    n = runs["train"] + runs["val"] + runs["test"]
    which = f"{' and '.join(empty)} {'has' if len(empty) == 1 else 'have'} no runs"
    if split.method == "chronological":
        rule = ", ".join(f"floor({n} x {getattr(split, p):g}) = 0 for {p}" for p in empty)
        return (f"{which}: the chronological split of {n} runs gives {rule} (docs/spec.md, split); "
                f"{runs_for_every_split(spec)} runs with windows give each at least one")
    shares = ", ".join(f"{p} {getattr(split, p):g}" for p in empty)
    return (f"{which}: the hashed split places each run by a hash of its id and seed {split.seed}, and none of "
            f"the {n} runs fell in the share of {shares} (docs/spec.md, split); more runs or another seed fill it")


def runs_for_every_split(spec: DatasetSpec) -> int:
    """The fewest runs a chronological split gives at least one run in every split with a share."""
    shares = [s for s in (spec.split.val, spec.split.test) if s > 0]
    return next(k for k in range(1, 1_000_000) if all(math.floor(k * s) >= 1 for s in shares))


def split_figures(store: DatasetStore, plan: DatasetPlan) -> dict[str, Any]:
    """Windows and runs per split, the exclusions with reasons, lineage, and the overview plot."""
    split = plan.split
    return {
        **{f"windows_{p}": split[p] for p in SPLITS},
        **{f"runs_{p}": len(split[f"{p}RunIds"]) for p in SPLITS},
        "runs_excluded": len(split["excluded"]),
        "excluded": Table(split["excluded"]),
        "overview": Markdown(overview_markdown(store, plan)),
        "lineage_verified": plan.lineage.lineage_verified if plan.lineage else 0,
        "lineage": lineage_summary(store, plan),
        "lineage_per_run": Table(lineage_rows(store, plan)),
        "path": FilePath(store.dataset_stage_path(SPLIT)),
    }
