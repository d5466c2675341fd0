"""Dataset assets, one group per spec: keys ``[<spec id>, <name>]``.

Run-partitioned: ``raw_node_series`` -> ``cleaned_grid`` -> ``run_windows``; then, over all run
partitions: ``dataset_split`` -> ``normalization_stats`` -> ``dataset_manifest``. Assets are thin:
they call ``aml_pipeline.pipeline`` and turn its summaries into metadata. They manage their own
I/O through the store resource; nothing is passed through an IO manager, so downstream steps
stream runs from disk.
"""


import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import dagster as dg

from aml_pipeline.core.clean import CLEAN_CAUSES
from aml_pipeline import progress
from aml_pipeline.errors import AmlError
from aml_pipeline.pipeline.build import publish_dataset, run_scope
from aml_pipeline.pipeline.dataset import (
    fit_normalization,
    load_norm,
    load_plan,
    plan_dataset,
    save_norm,
    save_plan,
)
from aml_pipeline.pipeline.plots import run_plot_markdown, windows_per_run_markdown
from aml_pipeline.pipeline.runs import (
    ALGORITHM_VERSION,
    check_nodes_known,
    clean_run,
    fetch_run,
    stage_fingerprint,
    window_run,
)
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.defs.partitions import run_backfill_policy, run_partitions
from aml_pipeline.defs.resources import StoreResource, TsdbResource

TSDB_POINTS = dg.AssetKey(["tsdb", "points"])
# A node missing more than this share of a run's grid is worth a look (check warns).
MISSING_WARN_RATIO = 0.2

RUN_ASSETS = ("raw_node_series", "cleaned_grid", "run_windows")
DATASET_ASSETS = ("dataset_split", "normalization_stats", "dataset_manifest")
MANIFEST_CHECKS = ("hash_verifies", "no_run_in_two_splits", "norm_stats_from_train_only", "no_nan_or_inf")


def _table(rows: Sequence[Mapping[str, Any]]) -> dg.MetadataValue:
    if not rows:
        return dg.MetadataValue.md("_(none)_")
    columns = []
    for name, value in rows[0].items():
        kind = "float" if isinstance(value, float) else "int" if isinstance(value, int) else "string"
        columns.append(dg.TableColumn(name, kind))
    return dg.MetadataValue.table(
        records=[dg.TableRecord(dict(r)) for r in rows], schema=dg.TableSchema(columns=columns)
    )


def _each_run(
    context: dg.AssetExecutionContext,
    work: Callable[[str], dict[str, Any]],
    *,
    check_results: Callable[[dict[str, dict[str, Any]]], list[dg.AssetCheckResult]] | None = None,
) -> Iterator[Any]:
    """Run ``work`` for every run partition of the step (one, or many in a single-run backfill).

    A run that fails does not lose the others: the successful ones are recorded as
    materialisations of their partitions before the step fails, naming the failed runs.
    """
    keys = list(context.partition_keys)
    done: dict[str, dict[str, Any]] = {}
    failed: list[tuple[str, BaseException]] = []
    stage = context.asset_key.path[-1]
    for i, run_id in enumerate(keys, 1):
        try:
            done[run_id] = work(run_id)
            context.log.info(f"run {run_id} ({i}/{len(keys)}): {done[run_id].get('summary', 'done')}")
        except Exception as e:  # noqa: BLE001 - one run's failure must not lose the others
            failed.append((run_id, e))
            detail = e.one_line() if isinstance(e, AmlError) else "".join(traceback.format_exception(e))
            context.log.error(f"run {run_id} ({i}/{len(keys)}) failed: {detail}")
        progress.report(stage, i, len(keys), run_id)
    checks = check_results(done) if check_results and not failed else []
    versions = {run_id: m.get("data_version") for run_id, m in done.items()}
    metadata = {
        run_id: {k: v for k, v in m.items() if k not in ("summary", "data_version")} for run_id, m in done.items()
    }
    if failed:
        for run_id, meta in metadata.items():
            yield dg.AssetMaterialization(asset_key=context.asset_key, partition=run_id, metadata=meta)
        run_id, err = failed[0]
        what = err.one_line() if isinstance(err, AmlError) else f"{type(err).__name__}: {err}"
        raise dg.Failure(
            description=f"{len(failed)} of {len(keys)} runs failed; first: run {run_id}: {what}",
            metadata={"failed_runs": ", ".join(r for r, _ in failed), "succeeded": len(done)},
        ) from err
    if len(keys) == 1:
        version = versions[keys[0]]
        yield dg.MaterializeResult(
            metadata=metadata[keys[0]],
            check_results=checks,
            # A data version per partition is only expressible for a one-partition step; a
            # range step's partitions get Dagster's logical version (code + upstream).
            data_version=dg.DataVersion(version) if version else None,
        )
        return
    for run_id, meta in metadata.items():
        context.add_asset_metadata(meta, partition_key=run_id)
    yield dg.MaterializeResult(metadata={"runs": len(keys)}, check_results=checks)


def dataset_assets(spec: DatasetSpec) -> list[dg.AssetsDefinition]:
    """The six assets of one dataset spec."""
    runs = run_partitions(spec.id)
    code_version = stage_fingerprint(spec)
    group = spec.id
    key = lambda name: dg.AssetKey([spec.id, name])  # noqa: E731
    run_asset = dict(
        partitions_def=runs,
        backfill_policy=run_backfill_policy(),
        code_version=code_version,
        group_name=group,
    )
    about = (
        f"line {spec.line_id}, product {spec.product_id}, recipe {spec.recipe_id}; "
        f"{len(spec.nodes)} nodes, beat {spec.beat_ms} ms, H={spec.history_steps}, F={spec.horizon_steps}"
    )

    @dg.asset(
        key=key("raw_node_series"),
        deps=[TSDB_POINTS],
        kinds={"numpy"},
        pool="aml_tsdb",
        description=f"Every point of each spec node in the run, read page by page from the TSDB ({about}).",
        **run_asset,
    )
    def raw_node_series(context: dg.AssetExecutionContext, tsdb: TsdbResource, store: StoreResource):
        ds = store.dataset_store(spec.id)
        single = len(context.partition_keys) == 1
        with tsdb.open() as db:
            catalog = check_nodes_known(spec, db.list_nodes())
            in_scope = {r.run_id: r for r in db.list_runs(run_scope(spec), finished_only=True)}

            def one(run_id: str) -> dict[str, Any]:
                # A partition outside the scope (or unfinished) is looked up, to fail naming why.
                run = in_scope.get(run_id) or db.get_run(run_id)
                summary = fetch_run(db, spec, run, ds, catalog, page_limit=tsdb.page_limit)
                # One log line per run, with every node's figures (a line per node is an event
                # per node and run in the event log; the table below has them too).
                per_node = ", ".join(
                    f"{n} {summary.points[n]}/{summary.pages[n]}p" for n in spec.node_ids
                )
                return {
                    "summary": f"{summary.total_points} points ({per_node})",
                    "points": summary.total_points,
                    "pages": sum(summary.pages.values()),
                    "per_node": _table(
                        [{"node": n, "points": summary.points[n], "pages": summary.pages[n]} for n in spec.node_ids]
                    ),
                    "path": dg.MetadataValue.path(str(ds.run_dir(run_id))),
                    # Only a one-partition step can record a partition's data version.
                    "data_version": summary.data_version if single else None,
                }

            yield from _each_run(context, one)

    @dg.asset(
        key=key("cleaned_grid"),
        deps=[raw_node_series],
        kinds={"numpy"},
        description="Points cleaned (non-finite, bad state, range, duplicates, Hampel) and aligned to the beat grid.",
        **run_asset,
    )
    def cleaned_grid(context: dg.AssetExecutionContext, store: StoreResource):
        ds = store.dataset_store(spec.id)
        def one(run_id: str) -> dict[str, Any]:
            g = clean_run(spec, run_id, ds)
            totals = g.cleaning_totals
            return {
                "summary": f"{g.rows} grid rows, {totals['kept']}/{totals['input']} points kept",
                "grid_rows": g.rows,
                "points_kept": totals["kept"],
                "points_removed": totals["input"] - totals["kept"],
                "cleaning": _table(
                    [{"node": n, **{c: g.counts[n][c] for c in ("input", *CLEAN_CAUSES, "kept")},
                      "missing_ratio": round(g.missing[n], 4)} for n in spec.node_ids]
                ),
                "max_missing_ratio": max(g.missing.values()),
                "plot": dg.MetadataValue.md(run_plot_markdown(run_id, spec.node_ids, g.raw_arrays, g.grid_arrays)),
            }

        yield from _each_run(context, one)

    def run_checks(done: dict[str, dict[str, Any]]) -> list[dg.AssetCheckResult]:
        empty = {r: m["reason"] for r, m in done.items() if m["windows"] == 0}
        high = {r: m["worst_missing"] for r, m in done.items() if m["worst_missing"][1] > MISSING_WARN_RATIO}
        return [
            dg.AssetCheckResult(
                check_name="has_windows",
                passed=not empty,
                severity=dg.AssetCheckSeverity.WARN,
                description="; ".join(f"{r}: {why}" for r, why in empty.items()) or "every run has windows",
                metadata={"runs_without_windows": len(empty)},
            ),
            dg.AssetCheckResult(
                check_name="missing_ratio_below_threshold",
                passed=not high,
                severity=dg.AssetCheckSeverity.WARN,
                description="; ".join(f"{r}: {n} {v:.0%} missing" for r, (n, v) in high.items())
                or f"no node misses more than {MISSING_WARN_RATIO:.0%} of a run's grid",
                metadata={"threshold": MISSING_WARN_RATIO, "runs_over": len(high)},
            ),
        ]

    @dg.asset(
        key=key("run_windows"),
        deps=[cleaned_grid],
        kinds={"numpy"},
        description="The run's grid in model units and its valid window starts (no gap in what a window uses).",
        check_specs=[
            dg.AssetCheckSpec("has_windows", asset=key("run_windows"), description="warns about runs with zero windows, with the reason"),
            dg.AssetCheckSpec(
                "missing_ratio_below_threshold", asset=key("run_windows"),
                description=f"warns when a node misses more than {MISSING_WARN_RATIO:.0%} of a run's grid",
            ),
        ],
        **run_asset,
    )
    def run_windows(context: dg.AssetExecutionContext, store: StoreResource):
        ds = store.dataset_store(spec.id)

        def one(run_id: str) -> dict[str, Any]:
            w = window_run(spec, run_id, ds)
            worst = max(w.missing.items(), key=lambda kv: kv[1])
            return {
                "summary": f"{w.windows} windows" + (f" ({w.reason})" if w.reason else ""),
                "windows": w.windows,
                "grid_rows": w.rows,
                "reason": w.reason or "",
                "worst_missing": worst,
            }

        def strip(done: dict[str, dict[str, Any]]) -> list[dg.AssetCheckResult]:
            results = run_checks(done)
            for m in done.values():
                n, v = m.pop("worst_missing")
                m["worst_missing_node"] = f"{n} ({v:.1%})"
            return results

        yield from _each_run(context, one, check_results=strip)

    dataset_asset = dict(code_version=code_version, group_name=group)

    @dg.asset(
        key=key("dataset_split"),
        deps=[run_windows],
        kinds={"json"},
        description="Runs split by run (never by window) into train/val/test; lineage (v2); exclusions with reasons.",
        **dataset_asset,
    )
    def dataset_split(context: dg.AssetExecutionContext, store: StoreResource) -> dg.MaterializeResult:
        ds = store.dataset_store(spec.id)
        run_ids = context.instance.get_dynamic_partitions(runs.name)
        plan = plan_dataset(spec, run_ids, ds)
        path = save_plan(spec, plan, ds)
        split = plan.split
        per_run = [(r, part, int(plan.runs[r]["windows"])) for part, r in plan.ordered_runs()]
        context.log.info(
            f"split: train {len(split['trainRunIds'])} runs / {split['train']} windows, val {len(split['valRunIds'])} / "
            f"{split['val']}, test {len(split['testRunIds'])} / {split['test']}, excluded {len(split['excluded'])}"
        )
        return dg.MaterializeResult(
            metadata={
                **{f"windows_{p}": split[p] for p in ("train", "val", "test")},
                **{f"runs_{p}": len(split[f"{p}RunIds"]) for p in ("train", "val", "test")},
                "runs_excluded": len(split["excluded"]),
                "excluded": _table(split["excluded"]),
                "windows_per_run": dg.MetadataValue.md(windows_per_run_markdown(per_run)),
                "runs": _table([{"run": r, "split": p, "windows": w} for r, p, w in per_run]),
                "lineage_verified": plan.lineage.lineage_verified if plan.lineage else 0,
                "path": dg.MetadataValue.path(str(path)),
            }
        )

    @dg.asset(
        key=key("normalization_stats"),
        deps=[dataset_split],
        kinds={"json"},
        description="mean/std per column of x, u and y over train windows only (float64; std 0 -> 1, flagged).",
        **dataset_asset,
    )
    def normalization_stats(context: dg.AssetExecutionContext, store: StoreResource) -> dg.MaterializeResult:
        ds = store.dataset_store(spec.id)
        plan = load_plan(spec, ds)
        norm = fit_normalization(spec, plan, ds)
        stats = norm.to_json(spec)
        path = save_norm(spec, norm, ds)
        rows = []
        for group, names in (("x", spec.node_ids), ("u", spec.control_ids), ("y", spec.target_ids)):
            for i, n in enumerate(names):
                rows.append({"array": group, "node": n, "mean": stats[group]["mean"][i],
                             "std": stats[group]["std"][i], "zero_std": str(n in stats[group]["zeroStd"])})
        return dg.MaterializeResult(
            metadata={
                "stats": _table(rows),
                "train_runs": len(plan.split["trainRunIds"]),
                "zero_std_columns": sum(len(stats[g]["zeroStd"]) for g in "xuy"),
                "path": dg.MetadataValue.path(str(path)),
            }
        )

    @dg.asset(
        key=key("dataset_manifest"),
        deps=[normalization_stats, dataset_split],
        kinds={"json", "numpy"},
        description="The published snapshot: arrays, manifest, report and hash. Becomes `current` only if the blocking checks pass.",
        check_specs=[
            dg.AssetCheckSpec(name, asset=key("dataset_manifest"), blocking=True, description=desc)
            for name, desc in zip(
                MANIFEST_CHECKS,
                (
                    "every hashed byte of the published snapshot matches its sha256",
                    "no run appears in two splits; one block per run",
                    "normalisation stats recomputed from the train windows match the manifest",
                    "no NaN or inf in any array",
                ),
                strict=True,
            )
        ],
        **dataset_asset,
    )
    def dataset_manifest(
        context: dg.AssetExecutionContext, tsdb: TsdbResource, store: StoreResource
    ) -> dg.MaterializeResult:
        ds = store.dataset_store(spec.id)
        plan = load_plan(spec, ds)
        norm = load_norm(spec, ds)
        with tsdb.open() as db:
            watermark = db.availability_watermark()
        published = publish_dataset(
            spec, plan, norm, ds, store.datasets_root, availability_watermark=watermark
        )
        summary = published.summary()
        m = published.manifest
        lag_rows = [
            {"control": r["control"], "target": r["target"], "lag_steps": r["lagSteps"] if r["lagSteps"] is not None else -1,
             "lag_ms": r["lagMs"] if r["lagMs"] is not None else -1, "corr": r["corr"] if r["corr"] is not None else float("nan")}
            for r in published.report["lagCrossCorrelation"]
        ]
        norm_rows = [
            {"array": g, "node": n, "mean": m["norm"][g]["mean"][i], "std": m["norm"][g]["std"][i]}
            for g, names in (("x", m["allNodes"]), ("u", m["controls"]), ("y", m["targets"]))
            for i, n in enumerate(names)
        ]
        context.log.info(f"published {published.snapshot_dir} sha256 {published.sha256} current={published.current}")
        return dg.MaterializeResult(
            metadata={
                "snapshot_dir": dg.MetadataValue.path(str(published.snapshot_dir)),
                "sha256": published.sha256,
                "manifest_version": m["version"],
                "current": published.current,
                "lineage_verified": m.get("lineageVerified", 0),
                **{f"windows_{p}": summary["windows"][p] for p in ("train", "val", "test")},
                **{f"runs_{p}": summary["runs"][p] for p in ("train", "val", "test", "excluded")},
                "norm": _table(norm_rows),
                "lag_cross_correlation": _table(lag_rows),
                "summary": dg.MetadataValue.json(summary),
            },
            check_results=[
                dg.AssetCheckResult(
                    check_name=c.name, passed=c.passed, description=c.description, metadata=c.metadata
                )
                for c in published.checks
            ],
        )

    return [raw_node_series, cleaned_grid, run_windows, dataset_split, normalization_stats, dataset_manifest]


__all__ = ["ALGORITHM_VERSION", "DATASET_ASSETS", "RUN_ASSETS", "TSDB_POINTS", "dataset_assets"]
