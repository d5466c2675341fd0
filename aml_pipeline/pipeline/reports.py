"""What the dataset stages tell a person about a dataset: the overview plot, lineage, units.

Drawn from the stored run summaries and the plan (no run is read again); the dataset stages'
figures (:mod:`aml_pipeline.pipeline.stages`) use them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from aml_pipeline.pipeline.stages.windows import WINDOWS
from aml_pipeline.pipeline.store import DatasetStore

if TYPE_CHECKING:
    from aml_pipeline.pipeline.stages.split import DatasetPlan

OVERVIEW_FILE = "overview.json"


def overview_markdown(store: DatasetStore, plan: DatasetPlan) -> str:
    """Runs (in snapshot order, then the excluded ones) x nodes: missing and outlier ratios, and
    windows per run by split, from the stored run summaries. Drawn again only when the plan
    changed (a rebuild with nothing new reuses it)."""
    key = plan.key()
    try:
        cached = store.read_json(OVERVIEW_FILE)
        if cached.get("key") == key:
            return cached["markdown"]
    except (FileNotFoundError, ValueError, KeyError):
        pass
    markdown = _draw_overview(store, plan)
    store.write_json(OVERVIEW_FILE, {"key": key, "markdown": markdown})
    return markdown


def _draw_overview(store: DatasetStore, plan: DatasetPlan) -> str:
    from aml_pipeline.pipeline.plots import dataset_overview_markdown  # matplotlib, only when drawing

    spec = store.spec
    rows = [(r, part, int(plan.runs[r]["windows"])) for part, r in plan.ordered_runs()]
    metas = dict(plan.runs)
    for e in plan.split["excluded"]:
        meta = store.read_meta(e["runId"], WINDOWS)
        if meta is not None:
            rows.append((e["runId"], "excluded", int(meta["windows"])))
            metas[e["runId"]] = meta
    nodes = spec.node_ids
    missing = np.array([[metas[r]["missing"].get(n, 1.0) for n in nodes] for r, _, _ in rows]).reshape(len(rows), len(nodes))
    outliers = np.array(
        [[metas[r]["counts"][n]["hampel_outlier"] / max(1, metas[r]["counts"][n]["input"]) for n in nodes] for r, _, _ in rows]
    ).reshape(len(rows), len(nodes))
    return dataset_overview_markdown(rows, nodes, missing, outliers, title=f"{spec.id}: {len(rows)} runs")


def lineage_rows(store: DatasetStore, plan: DatasetPlan) -> list[dict[str, str]]:
    """Per run of the plan (and runs excluded for lineage): its lineage status and why."""
    lin = plan.lineage
    if store.spec.extras is None or lin is None:
        return []
    rows = [{"run": r, "lineage": "verified", "why": "context confirmed; recipe version and content hash match"}
            for r in lin.verified]
    rows += [{"run": r, "lineage": "unknown", "why": "run context not confirmed, so its recipe cannot be checked"}
             for r in lin.unknown]
    rows += [{"run": e["runId"], "lineage": "excluded", "why": e["reason"]} for e in lin.excluded]
    return sorted(rows, key=lambda r: r["run"])


def lineage_summary(store: DatasetStore, plan: DatasetPlan) -> str:
    """Why lineageVerified is what it is, in one line."""
    spec = store.spec
    if spec.extras is None:
        return "0: a v1 spec (no extras) does not assess lineage"
    lin = plan.lineage
    if lin is None or not (lin.verified or lin.unknown or lin.excluded):
        return "0: no runs"
    if lin.lineage_verified:
        return f"1: all {len(lin.verified)} runs verified against recipe version {spec.extras.recipe_version}"
    parts = []
    if lin.unknown:
        parts.append(f"{len(lin.unknown)} run(s) with unconfirmed context ({', '.join(lin.unknown[:5])}{' ...' if len(lin.unknown) > 5 else ''})")
    if lin.excluded:
        parts.append(f"{len(lin.excluded)} run(s) excluded for a recipe mismatch")
    if not lin.verified:
        parts.append("no verified run")
    return "0: " + "; ".join(parts)


def model_units(store: DatasetStore, plan: DatasetPlan) -> dict[str, str]:
    """The unit of each node in the arrays: a v2 variable's model unit, else the TSDB's unit."""
    catalog: dict[str, str] = next((meta.get("units") or {} for meta in plan.runs.values()), {})
    out = dict(catalog)
    if store.spec.extras is not None:
        for var in store.spec.extras.variables:
            out[var.node_id] = var.model_unit or var.unit or catalog.get(var.node_id, "")
    return out
