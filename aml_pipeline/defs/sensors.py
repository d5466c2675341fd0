"""New-run sensor: finished runs in a spec's scope become run partitions and are materialised."""

import dagster as dg

from aml_pipeline.defs.partitions import run_partitions
from aml_pipeline.defs.resources import TsdbResource
from aml_pipeline.pipeline.build import run_scope
from aml_pipeline.pipeline.runs import stage_fingerprint
from aml_pipeline.spec import DatasetSpec

RUN_ASSET_NAMES = ("raw_node_series", "cleaned_grid", "run_windows")


def new_run_sensor(spec: DatasetSpec) -> dg.SensorDefinition:
    runs_def = run_partitions(spec.id)
    code_version = stage_fingerprint(spec)

    @dg.sensor(
        name=f"{spec.id}__new_runs",
        description=(
            f"Adds finished runs of line {spec.line_id} / product {spec.product_id} / recipe "
            f"{spec.recipe_id} as partitions of {spec.id} and materialises their run assets. "
            "Runs still in progress are added once they finish."
        ),
        asset_selection=[dg.AssetKey([spec.id, n]) for n in RUN_ASSET_NAMES],
        minimum_interval_seconds=60,
    )
    def sensor(context: dg.SensorEvaluationContext, tsdb: TsdbResource):
        with tsdb.open() as db:
            finished = [r.run_id for r in db.list_runs(run_scope(spec), finished_only=True)]
        known = set(context.instance.get_dynamic_partitions(runs_def.name))
        done = context.instance.get_materialized_partitions(dg.AssetKey([spec.id, "run_windows"]))
        todo = [r for r in finished if r not in done]
        if not todo:
            return dg.SkipReason(f"all {len(finished)} finished runs in scope are materialised")
        new = [r for r in todo if r not in known]
        # Run keys make a repeated tick (e.g. after a crash between adding partitions and
        # launching) harmless: Dagster never launches the same key twice for this sensor. The
        # code version is part of the key, so a changed spec rebuilds runs once more.
        return dg.SensorResult(
            run_requests=[dg.RunRequest(partition_key=r, run_key=f"{r}@{code_version}") for r in todo],
            dynamic_partitions_requests=[runs_def.build_add_request(new)] if new else [],
        )

    return sensor
