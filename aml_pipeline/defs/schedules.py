"""Scheduled rebuild of a dataset from its current run partitions."""

import dagster as dg

from aml_pipeline.spec import DatasetSpec

DATASET_ASSET_NAMES = ("dataset_split", "normalization_stats", "dataset_manifest")
# Hourly, a little after the hour: new runs added by the sensor since the last rebuild are in.
DEFAULT_CRON = "15 * * * *"


def rebuild_job(spec: DatasetSpec):
    return dg.define_asset_job(
        name=f"{spec.id}__rebuild",
        selection=dg.AssetSelection.assets(*(dg.AssetKey([spec.id, n]) for n in DATASET_ASSET_NAMES)),
        description=f"Split, normalise and publish {spec.id} from the run partitions materialised so far.",
    )


def rebuild_schedule(spec: DatasetSpec, job) -> dg.ScheduleDefinition:
    return dg.ScheduleDefinition(
        name=f"{spec.id}__rebuild_schedule",
        job=job,
        cron_schedule=spec.schedule or DEFAULT_CRON,
        description=f"Rebuilds {spec.id} ({spec.schedule or 'default: hourly at :15'}; set `schedule` in the spec).",
    )
