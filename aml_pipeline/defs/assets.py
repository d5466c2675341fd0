"""Dataset assets, one group per spec: keys ``[<spec id>, <name>]``.

Run-partitioned: ``raw_node_series`` -> ``cleaned_grid`` -> ``run_windows``, one multi-asset step
per chunk of runs (the three stages of a run back to back, any subset of them). Then, over all run
partitions: ``dataset_split`` -> ``normalization_stats`` -> ``dataset_manifest``. Every asset's code
version is its stage's fingerprint (:mod:`aml_pipeline.pipeline.versions`), so editing a spec marks
exactly the stages it changes as stale. Assets are thin: they call ``aml_pipeline.pipeline`` and
turn its summaries into metadata, managing their own I/O through the store resource (nothing goes
through an IO manager), so downstream steps stream runs from disk.
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np

from aml_pipeline import config, progress
from aml_pipeline.core.clean import CLEAN_CAUSES
from aml_pipeline.defs.partitions import RUN_ASSETS, run_backfill_policy, run_partitions
from aml_pipeline.defs.resources import StoreResource, TsdbResource
from aml_pipeline.errors import AmlError
from aml_pipeline.pipeline.build import publish_dataset, run_scope
from aml_pipeline.pipeline.checks import snapshot_checks
from aml_pipeline.pipeline.dataset import (
    DatasetPlan,
    fit_or_reuse_normalization,
    load_norm,
    load_plan,
    plan_dataset,
    save_plan,
)
from aml_pipeline.pipeline.plots import dataset_overview_markdown, run_traces_markdown
from aml_pipeline.pipeline.publish import Catalog
from aml_pipeline.pipeline.runs import build_runs, check_nodes_known, run_fetcher
from aml_pipeline.pipeline.versions import stage_versions
from aml_pipeline.spec import DatasetSpec

TSDB_POINTS = dg.AssetKey(["tsdb", "points"])
# A node missing more than this share of a run's grid is worth a look (check warns).
MISSING_WARN_RATIO = 0.2
# Progress lines per run-stages step, at most (plus one per failed run).
PROGRESS_LINES = 10

DATASET_ASSETS = ("dataset_split", "normalization_stats", "dataset_manifest")
MANIFEST_CHECKS = ("hash_verifies", "no_run_in_two_splits", "norm_stats_from_train_only", "no_nan_or_inf")
MANIFEST_CHECK_DESCRIPTIONS = (
    "every hashed byte of the published snapshot matches its sha256 (sha256.json and the catalog)",
    "no run appears in two splits; one block per run",
    "normalised train windows have mean 0 and std 1 (statistics fitted on train windows only)",
    "no NaN or inf in any array",
)
# Where a run's figures are (one observation per run, see RunStages).
FIGURES_WHERE = (
    "A run's figures are one observation of its partition, after the materialisation, on the last "
    "of its stages built in the same step: on run_windows when all three were built (the fetch "
    "figures as fetched_*). The partition's metadata table in the UI shows them."
)
STAGE_OF_ASSET = {
    "raw_node_series": "raw",
    "cleaned_grid": "grid",
    "run_windows": "windows",
    "dataset_split": "split",
    "normalization_stats": "norm",
    "dataset_manifest": "manifest",
}


def table(rows: Sequence[Mapping[str, Any]]) -> dg.MetadataValue:
    if not rows:
        return dg.MetadataValue.md("_(none)_")
    columns = []
    for name, value in rows[0].items():
        kind = "float" if isinstance(value, float) else "int" if isinstance(value, int) else "string"
        columns.append(dg.TableColumn(name, kind))
    return dg.MetadataValue.table(
        records=[dg.TableRecord(dict(r)) for r in rows], schema=dg.TableSchema(columns=columns)
    )


def progress_line_due(i: int, runs: int) -> bool:
    """Whether the step logs a progress line after its ``i``-th run (1-based) of ``runs``: every
    ``ceil(runs / PROGRESS_LINES)``-th run and the last, so at most :data:`PROGRESS_LINES` lines."""
    return i == runs or i % -(-runs // PROGRESS_LINES) == 0


def dataset_assets(spec: DatasetSpec) -> list[dg.AssetsDefinition]:
    """The assets of one dataset spec: the run stages (one multi-asset) and the dataset stages."""
    return [run_stage_assets(spec), *dataset_stage_assets(spec)]


# ---- run stages ----------------------------------------------------------------------------------


def run_stage_assets(spec: DatasetSpec) -> dg.AssetsDefinition:
    v = stage_versions(spec)
    key = lambda name: dg.AssetKey([spec.id, name])  # noqa: E731
    about = (
        f"line {spec.line_id}, product {spec.product_id}, recipe {spec.recipe_id}; "
        f"{len(spec.nodes)} nodes, beat {spec.beat_ms} ms, H={spec.history_steps}, F={spec.horizon_steps}"
    )
    common = dict(group_name=spec.id, kinds={"numpy"}, partitions_def=run_partitions(spec.id))
    plots = config.run_plots()
    specs = [
        dg.AssetSpec(
            key("raw_node_series"), code_version=v.raw,
            description=(
                f"Every point of each spec node in the run, read page by page from the TSDB ({about}). "
                f"Per run: points and pages per node. {FIGURES_WHERE}"
            ),
            **common,
        ),
        dg.AssetSpec(
            key("cleaned_grid"), deps=[key("raw_node_series")], code_version=v.grid,
            description=(
                "Points cleaned (non-finite, bad state, range, duplicates, Hampel) and aligned to the beat grid. "
                "Per run: counts per cause and node, missing ratios"
                + (" and the run's plot. " if plots else " (no plot: AML_RUN_PLOTS=off). ") + FIGURES_WHERE
            ),
            **common,
        ),
        dg.AssetSpec(
            key("run_windows"), deps=[key("cleaned_grid")], code_version=v.windows,
            description=(
                "The run's grid in model units and its valid window starts (no gap in what a window uses). "
                f"Per run: windows, and why there are none. {FIGURES_WHERE}"
            ),
            **common,
        ),
    ]
    check_specs = [
        dg.AssetCheckSpec("has_windows", asset=key("run_windows"), description="warns about runs with zero windows, with the reason"),
        dg.AssetCheckSpec(
            "missing_ratio_below_threshold", asset=key("run_windows"),
            description=f"warns when a node misses more than {MISSING_WARN_RATIO:.0%} of a run's grid",
        ),
    ]

    @dg.multi_asset(
        name=f"{spec.id}__run_stages",
        specs=specs,
        check_specs=check_specs,
        can_subset=True,
        backfill_policy=run_backfill_policy(),
        pool="aml_tsdb",
    )
    def run_stages(context: dg.AssetExecutionContext, tsdb: TsdbResource, store: StoreResource):
        selected = [n for n in RUN_ASSETS if key(n) in context.selected_asset_keys]
        with failing_as_one_line(), store.dataset_store(spec.id).in_use():
            yield from RunStages(spec, context, tsdb, store, selected, plots=plots).execute()

    return run_stages


class RunStages:
    """One step of the run assets: the selected stages for every run partition of the step.

    Each run goes through its stages back to back (fetch, clean and align, windows) with a TSDB
    handle opened per run, not per step. A run that fails does not lose the others: the stages that
    succeeded are recorded as materialisations of their partitions before the step fails, naming
    the failed runs.
    """

    def __init__(self, spec: DatasetSpec, context: dg.AssetExecutionContext, tsdb: TsdbResource,
                 store: StoreResource, selected: list[str], *, plots: bool) -> None:
        self.spec, self.context, self.tsdb, self.selected, self.plots = spec, context, tsdb, selected, plots
        self.ds = store.dataset_store(spec.id)
        self.key = lambda name: dg.AssetKey([spec.id, name])  # noqa: E731

    def execute(self) -> Iterator[Any]:
        run_ids = list(self.context.partition_keys)
        if "raw_node_series" not in self.selected:
            yield from self._execute(run_ids, None)
            return
        # The TSDB handle is held for at most about half a second at a time, between pages, so an
        # ingest into the embedded file can run while a long backfill builds.
        with self.tsdb.brief() as db:
            yield from self._execute(run_ids, db)

    def _execute(self, run_ids: list[str], db) -> Iterator[Any]:
        spec, context = self.spec, self.context
        fetch = None
        if db is not None:
            catalog = check_nodes_known(spec, db.list_nodes())
            in_scope = db.list_runs(run_scope(spec), finished_only=True)
            # A partition that is not a finished run in scope is looked up: an unfinished run fails naming why.
            fetch = run_fetcher(db, spec, self.ds, in_scope, catalog, page_limit=self.tsdb.page_limit,
                                tsdb_versions=db.run_versions(run_ids))

        stages = [STAGE_OF_ASSET[n] for n in self.selected]
        done: dict[str, dict[str, dict[str, Any]]] = {}  # run -> asset -> metadata
        versions_out: dict[str, dict[str, str]] = {}
        failed: list[tuple[str, BaseException]] = []
        with closing(build_runs(spec, self.ds, [(r, stages) for r in run_ids], fetch)) as results:
            for i, result in enumerate(results, 1):
                run_id = result.run_id
                done[run_id], versions_out[run_id] = {}, {}
                error = result.error
                try:
                    for name, summary, describe in (
                        ("raw_node_series", result.raw, self._raw_metadata),
                        ("cleaned_grid", result.grid, self._grid_metadata),
                        ("run_windows", result.windows, _windows_metadata),
                    ):
                        if summary is not None:
                            done[run_id][name] = describe(run_id, summary)
                            versions_out[run_id][name] = summary.data_version
                            progress.report(name, i, len(run_ids), run_id)
                except Exception as e:  # noqa: BLE001 - one run's failure must not lose the others
                    error = error or e
                if error is not None:
                    failed.append((run_id, error))
                    context.log.error(f"run {run_id} ({i}/{len(run_ids)}) failed: {_describe(error)}")
                # Progress at a bounded rate: each log line is an event in the run's log (and a
                # write to the instance), while every run's figures are in its partition's metadata.
                elif progress_line_due(i, len(run_ids)):
                    context.log.info(f"run {run_id} ({i}/{len(run_ids)}): {self._line(done[run_id])}")
        if failed:
            for run_id, built in done.items():
                for name in built:
                    yield dg.AssetMaterialization(asset_key=self.key(name), partition=run_id)
            yield from self._figures(done)
            run_id, err = failed[0]
            raise dg.Failure(
                description=f"{len(failed)} of {len(run_ids)} runs failed; first: run {run_id}: {_describe(err)}",
                metadata={"failed_runs": ", ".join(r for r, _ in failed), "succeeded": len(run_ids) - len(failed)},
            ) from err
        single = len(run_ids) == 1
        for name in self.selected:
            yield dg.MaterializeResult(
                asset_key=self.key(name),
                # A data version per partition is only expressible for a one-partition step; the
                # partitions of a chunk get Dagster's logical version (code + upstream).
                data_version=dg.DataVersion(versions_out[run_ids[0]][name]) if single else None,
                check_results=self._checks(done) if name == "run_windows" else None,
            )
        yield from self._figures(done)

    def _figures(self, done: dict[str, dict[str, dict[str, Any]]]) -> Iterator[dg.AssetObservation]:
        """Each run's figures, one observation on the last of its stages built, yielded after the
        materialisations: the UI's partition view merges observations newer than the partition's
        materialisation into its metadata table. Metadata on the materialisation
        (``add_asset_metadata(partition_key=...)``) would cost Dagster a lookup of every run
        partition of the spec per run, which grows with the spec's runs where the observation
        does not (measured at 20,000 run partitions: README, Benchmarks, ``run_figures``)."""
        for run_id, built in done.items():
            if built:
                yield dg.AssetObservation(asset_key=self.key(list(built)[-1]), partition=run_id,
                                          metadata=_run_figures(built))

    def _raw_metadata(self, run_id: str, raw) -> dict[str, Any]:
        spec = self.spec
        return {
            "points": raw.total_points,
            "pages": sum(raw.pages.values()),
            "per_node": table([{"node": n, "points": raw.points[n], "pages": raw.pages[n]} for n in spec.node_ids]),
            "path": dg.MetadataValue.path(str(self.ds.run_dir(run_id))),
        }

    def _grid_metadata(self, run_id: str, grid) -> dict[str, Any]:
        totals = grid.cleaning_totals
        units = (self.ds.read_meta(run_id, "grid") or {}).get("units", {})
        figures = {
            "grid_rows": grid.rows,
            "points_kept": totals["kept"],
            "points_removed": totals["input"] - totals["kept"],
            "cleaning": table(
                [{"node": n, "unit": units.get(n, ""), **{c: grid.counts[n][c] for c in ("input", *CLEAN_CAUSES, "kept")},
                  "missing_ratio": round(grid.missing[n], 4)} for n in self.spec.node_ids]
            ),
            "max_missing_ratio": max(grid.missing.values()),
        }
        if self.plots:
            figures["plot"] = dg.MetadataValue.md(
                run_traces_markdown(grid.traces, [units.get(n, "") for n in self.spec.node_ids], run_id)
            )
        return figures

    def _line(self, stages: dict[str, dict[str, Any]]) -> str:
        parts = []
        if "raw_node_series" in stages:
            parts.append(f"{stages['raw_node_series']['points']} points")
        if "cleaned_grid" in stages:
            g = stages["cleaned_grid"]
            parts.append(f"{g['grid_rows']} grid rows, {g['points_removed']} points removed")
        if "run_windows" in stages:
            w = stages["run_windows"]
            parts.append(f"{w['windows']} windows" + (f" ({w['reason']})" if w["reason"] else ""))
        return "; ".join(parts)

    def _checks(self, done: dict[str, dict[str, dict[str, Any]]]) -> list[dg.AssetCheckResult]:
        windows = {r: d["run_windows"] for r, d in done.items()}
        missing = {r: self.ds.read_meta(r, "windows")["missing"] for r in windows}
        empty = {r: m["reason"] for r, m in windows.items() if m["windows"] == 0}
        high = {r: max(m.items(), key=lambda kv: kv[1]) for r, m in missing.items()}
        high = {r: nv for r, nv in high.items() if nv[1] > MISSING_WARN_RATIO}
        return [
            dg.AssetCheckResult(
                asset_key=self.key("run_windows"),
                check_name="has_windows",
                passed=not empty,
                severity=dg.AssetCheckSeverity.WARN,
                description="; ".join(f"{r}: {why}" for r, why in empty.items()) or "every run has windows",
                metadata={"runs_without_windows": len(empty)},
            ),
            dg.AssetCheckResult(
                asset_key=self.key("run_windows"),
                check_name="missing_ratio_below_threshold",
                passed=not high,
                severity=dg.AssetCheckSeverity.WARN,
                description="; ".join(f"{r}: {n} {v:.0%} missing" for r, (n, v) in high.items())
                or f"no node misses more than {MISSING_WARN_RATIO:.0%} of a run's grid",
                metadata={"threshold": MISSING_WARN_RATIO, "runs_over": len(high)},
            ),
        ]


@contextmanager
def failing_as_one_line() -> Iterator[None]:
    """A user error (bad input, a full disk) fails the step with its one line as the description."""
    try:
        yield
    except AmlError as e:
        raise dg.Failure(description=e.one_line(), metadata={"code": e.code}) from e


def _run_figures(built: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One run's metadata from the stages built for it, as its last stage records it: the fetch
    figures renamed (``fetched_*``) when a later stage carries them."""
    raw = built.get("raw_node_series")
    if len(built) == 1:
        return dict(next(iter(built.values())))
    figures: dict[str, Any] = {}
    if raw is not None:
        figures.update(fetched_points=raw["points"], fetched_pages=raw["pages"], fetched_per_node=raw["per_node"])
    for name in ("cleaned_grid", "run_windows"):
        figures.update(built.get(name, {}))
    return figures


def _windows_metadata(run_id: str, windows) -> dict[str, Any]:
    return {
        "windows": windows.windows,
        "grid_rows": windows.rows,
        "reason": windows.reason or "",
        "worst_missing_node": _worst(windows.missing),
    }


def _worst(missing: Mapping[str, float]) -> str:
    node, ratio = max(missing.items(), key=lambda kv: kv[1])
    return f"{node} ({ratio:.1%})"


def _describe(e: BaseException) -> str:
    return e.one_line() if isinstance(e, AmlError) else f"{type(e).__name__}: {e}"


# ---- dataset stages ------------------------------------------------------------------------------


OVERVIEW_FILE = "overview.json"


def overview_markdown(spec: DatasetSpec, plan: DatasetPlan, ds) -> str:
    """Runs (in snapshot order, then the excluded ones) x nodes: missing and outlier ratios, and
    windows per run by split, from the stored run summaries (no run is read). Drawn again only
    when the plan changed (a rebuild with nothing new reuses it)."""
    key = plan.key(spec)
    try:
        cached = ds.read_json(OVERVIEW_FILE)
        if cached.get("key") == key:
            return cached["markdown"]
    except (FileNotFoundError, ValueError, KeyError):
        pass
    markdown = _draw_overview(spec, plan, ds)
    ds.write_json(OVERVIEW_FILE, {"key": key, "markdown": markdown})
    return markdown


def _draw_overview(spec: DatasetSpec, plan: DatasetPlan, ds) -> str:
    rows = [(r, part, int(plan.runs[r]["windows"])) for part, r in plan.ordered_runs()]
    metas = dict(plan.runs)
    for e in plan.split["excluded"]:
        meta = ds.read_meta(e["runId"], "windows")
        if meta is not None:
            rows.append((e["runId"], "excluded", int(meta["windows"])))
            metas[e["runId"]] = meta
    nodes = spec.node_ids
    missing = np.array([[metas[r]["missing"].get(n, 1.0) for n in nodes] for r, _, _ in rows]).reshape(len(rows), len(nodes))
    outliers = np.array(
        [[metas[r]["counts"][n]["hampel_outlier"] / max(1, metas[r]["counts"][n]["input"]) for n in nodes] for r, _, _ in rows]
    ).reshape(len(rows), len(nodes))
    return dataset_overview_markdown(rows, nodes, missing, outliers, title=f"{spec.id}: {len(rows)} runs")


def lineage_rows(spec: DatasetSpec, plan: DatasetPlan) -> list[dict[str, str]]:
    """Per run of the plan (and runs excluded for lineage): its lineage status and why."""
    if spec.extras is None:
        return []
    lin = plan.lineage
    if lin is None:
        return []
    rows = [{"run": r, "lineage": "verified", "why": "context confirmed; recipe version and content hash match"}
            for r in lin.verified]
    rows += [{"run": r, "lineage": "unknown", "why": "run context not confirmed, so its recipe cannot be checked"}
             for r in lin.unknown]
    rows += [{"run": e["runId"], "lineage": "excluded", "why": e["reason"]} for e in lin.excluded]
    return sorted(rows, key=lambda r: r["run"])


def lineage_summary(spec: DatasetSpec, plan: DatasetPlan) -> str:
    """Why lineageVerified is what it is, in one line."""
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


def dataset_stage_assets(spec: DatasetSpec) -> list[dg.AssetsDefinition]:
    v = stage_versions(spec)
    runs_def = run_partitions(spec.id)
    key = lambda name: dg.AssetKey([spec.id, name])  # noqa: E731

    @dg.asset(
        key=key("dataset_split"),
        deps=[key("run_windows")],
        kinds={"json"},
        code_version=v.split,
        group_name=spec.id,
        description="Runs split by run (never by window) into train/val/test; lineage (v2); exclusions with reasons.",
    )
    def dataset_split(context: dg.AssetExecutionContext, store: StoreResource) -> dg.MaterializeResult:
        ds = store.dataset_store(spec.id)
        run_ids = context.instance.get_dynamic_partitions(runs_def.name)
        with failing_as_one_line(), ds.in_use():
            plan = plan_dataset(spec, run_ids, ds)
            path = save_plan(spec, plan, ds)
        split = plan.split
        overview = overview_markdown(spec, plan, ds)
        context.log.info(
            f"split: train {len(split['trainRunIds'])} runs / {split['train']} windows, val {len(split['valRunIds'])} / "
            f"{split['val']}, test {len(split['testRunIds'])} / {split['test']}, excluded {len(split['excluded'])}"
        )
        return dg.MaterializeResult(
            metadata={
                **{f"windows_{p}": split[p] for p in ("train", "val", "test")},
                **{f"runs_{p}": len(split[f"{p}RunIds"]) for p in ("train", "val", "test")},
                "runs_excluded": len(split["excluded"]),
                "excluded": table(split["excluded"]),
                "overview": dg.MetadataValue.md(overview),
                "lineage_verified": plan.lineage.lineage_verified if plan.lineage else 0,
                "lineage": lineage_summary(spec, plan),
                "lineage_per_run": table(lineage_rows(spec, plan)),
                "path": dg.MetadataValue.path(str(path)),
            }
        )

    @dg.asset(
        key=key("normalization_stats"),
        deps=[dataset_split],
        kinds={"json"},
        code_version=v.norm,
        group_name=spec.id,
        description="mean/std per column of x, u and y over train windows only, in model units (float64; std 0 -> 1, flagged).",
    )
    def normalization_stats(context: dg.AssetExecutionContext, store: StoreResource) -> dg.MaterializeResult:
        ds = store.dataset_store(spec.id)
        with failing_as_one_line(), ds.in_use():
            plan = load_plan(spec, ds)
            norm, reused = fit_or_reuse_normalization(spec, plan, ds)
        stats = norm.to_json(spec)
        units = model_units(spec, plan)
        rows = []
        for group, names in (("x", spec.node_ids), ("u", spec.control_ids), ("y", spec.target_ids)):
            for i, n in enumerate(names):
                rows.append({"array": group, "node": n, "model_unit": units.get(n, ""), "mean": stats[group]["mean"][i],
                             "std": stats[group]["std"][i], "zero_std": str(n in stats[group]["zeroStd"])})
        context.log.info("statistics unchanged since the last fit (same runs and data): reused" if reused
                         else f"fitted on {len(plan.split['trainRunIds'])} train runs")
        return dg.MaterializeResult(
            metadata={
                "stats": table(rows),
                "reused": reused,
                "train_runs": len(plan.split["trainRunIds"]),
                "zero_std_columns": sum(len(stats[g]["zeroStd"]) for g in "xuy"),
                "path": dg.MetadataValue.path(str(ds.dir / "norm.json")),
            }
        )

    manifest_key = key("dataset_manifest")

    @dg.multi_asset(
        name=f"{spec.id}__dataset_manifest",
        specs=[
            dg.AssetSpec(
                manifest_key,
                # The TSDB's availability watermark is part of a v2 snapshot's provenance. (It is not
                # upstream of the run stages: any ingest moves it, and would mark every run stale;
                # a run's own TSDB version decides whether that run is rebuilt.)
                deps=[normalization_stats, dataset_split, TSDB_POINTS],
                kinds={"json", "numpy"},
                code_version=v.manifest,
                group_name=spec.id,
                description=(
                    "The published snapshot: arrays, manifest, report and hash. Becomes `current` only if the "
                    "blocking checks pass; a rebuild with nothing new publishes nothing."
                ),
            )
        ],
        check_specs=[
            dg.AssetCheckSpec(name, asset=manifest_key, blocking=True, description=desc)
            for name, desc in zip(MANIFEST_CHECKS, MANIFEST_CHECK_DESCRIPTIONS, strict=True)
        ],
        can_subset=True,
    )
    def dataset_manifest(context: dg.AssetExecutionContext, tsdb: TsdbResource, store: StoreResource):
        selected_checks = {c.name for c in context.selected_asset_check_keys}
        if manifest_key not in context.selected_asset_keys:
            # Only the checks (the verify job): re-check the published snapshot from its bytes.
            yield from verify_current(spec, store, selected_checks, context)
            return
        ds = store.dataset_store(spec.id)
        with tsdb.open() as db:
            watermark = db.availability_watermark()
        with failing_as_one_line(), ds.in_use():
            plan = load_plan(spec, ds)
            norm = load_norm(spec, ds, plan)
            published = publish_dataset(spec, plan, norm, ds, store.datasets_root, availability_watermark=watermark)
        summary = published.summary()
        m = published.manifest
        units = model_units(spec, plan)
        lag_rows = [
            {"control": r["control"], "target": r["target"], "lag_steps": r["lagSteps"] if r["lagSteps"] is not None else -1,
             "lag_ms": r["lagMs"] if r["lagMs"] is not None else -1, "corr": r["corr"] if r["corr"] is not None else float("nan")}
            for r in (published.report.get("lagCrossCorrelation") or [])
        ]
        norm_rows = [
            {"array": g, "node": n, "model_unit": units.get(n, ""), "mean": m["norm"][g]["mean"][i], "std": m["norm"][g]["std"][i]}
            for g, names in (("x", m["allNodes"]), ("u", m["controls"]), ("y", m["targets"]))
            for i, n in enumerate(names)
        ]
        if published.published:
            context.log.info(f"published {published.snapshot_dir} sha256 {published.sha256} current={published.current}"
                             + (f"; shared with the previous snapshot: {', '.join(published.linked)}" if published.linked else ""))
        else:
            context.log.info(f"nothing new since snapshot {published.snapshot_dir} (same spec stages, runs and data): not published")
        yield dg.MaterializeResult(
            asset_key=manifest_key,
            metadata={
                "snapshot_dir": dg.MetadataValue.path(str(published.snapshot_dir)),
                "sha256": published.sha256,
                "published": published.published,
                "manifest_version": m["version"],
                "current": published.current,
                "lineage_verified": m.get("lineageVerified", 0),
                "lineage": lineage_summary(spec, plan),
                "lineage_per_run": table(lineage_rows(spec, plan)),
                **{f"windows_{p}": summary["windows"][p] for p in ("train", "val", "test")},
                **{f"runs_{p}": summary["runs"][p] for p in ("train", "val", "test", "excluded")},
                "norm": table(norm_rows),
                "lag_cross_correlation": table(lag_rows),
                "shared_with_previous": ", ".join(published.linked) or "-",
                "summary": dg.MetadataValue.json(summary),
            },
            check_results=[
                dg.AssetCheckResult(check_name=c.name, passed=c.passed, description=c.description, metadata=c.metadata)
                for c in published.checks
                if c.name in selected_checks
            ],
        )

    return [dataset_split, normalization_stats, dataset_manifest]


def verify_current(
    spec: DatasetSpec, store: StoreResource, checks: set[str], context: dg.AssetExecutionContext
) -> Iterator[dg.AssetCheckResult]:
    """The blocking checks on the spec's current snapshot, from its bytes and the catalog's hash."""
    entry = Catalog(store.datasets_root).current(spec.id)
    if entry is None:
        for name in sorted(checks):
            yield dg.AssetCheckResult(
                asset_key=dg.AssetKey([spec.id, "dataset_manifest"]), check_name=name, passed=False,
                description=f"NO_SNAPSHOT: spec {spec.id!r} has no current snapshot under {store.datasets_root}",
            )
        return
    context.log.info(f"re-checking {entry.path} (sha256 {entry.sha256} in the catalog)")
    for outcome in snapshot_checks(Path(entry.path), entry.sha256):
        if outcome.name in checks:
            yield dg.AssetCheckResult(
                asset_key=dg.AssetKey([spec.id, "dataset_manifest"]), check_name=outcome.name,
                passed=outcome.passed, description=f"{entry.path}: {outcome.description}", metadata=outcome.metadata,
            )


def model_units(spec: DatasetSpec, plan: DatasetPlan) -> dict[str, str]:
    """The unit of each node in the arrays: a v2 variable's model unit, else the TSDB's unit."""
    catalog: dict[str, str] = {}
    for meta in plan.runs.values():
        catalog = meta.get("units") or {}
        break
    out = dict(catalog)
    if spec.extras is not None:
        for var in spec.extras.variables:
            out[var.node_id] = var.model_unit or var.unit or catalog.get(var.node_id, "")
    return out

__all__ = ["DATASET_ASSETS", "MANIFEST_CHECKS", "RUN_ASSETS", "TSDB_POINTS", "dataset_assets"]
