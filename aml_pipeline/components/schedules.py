"""Jobs and schedules of a dataset: build the run stages, rebuild the dataset, re-verify it."""

import dagster as dg

from aml_pipeline.pipeline.registry import DATASET_ASSETS, MANIFEST, RUN_ASSETS
from aml_pipeline.spec import DatasetSpec

# Hourly, a little after the hour: new runs added by the sensor since the last rebuild are in.
DEFAULT_CRON = "15 * * * *"
VERIFY_CRON = "30 4 * * *"


def runs_job_name(spec_id: str) -> str:
    return f"{spec_id}__runs"


def build_job_name(spec_id: str) -> str:
    return f"{spec_id}__build"


def rebuild_job_name(spec_id: str) -> str:
    return f"{spec_id}__rebuild"


def verify_job_name(spec_id: str) -> str:
    return f"{spec_id}__verify"


def runs_job(spec: DatasetSpec):
    """The run stages over a range of run partitions (what the sensor and `aml-pipeline build` launch)."""
    return dg.define_asset_job(
        name=runs_job_name(spec.id),
        selection=dg.AssetSelection.assets(*(dg.AssetKey([spec.id, n]) for n in RUN_ASSETS)),
        description=f"Fetch, clean and window runs of {spec.id} (a run partition or a range of them).",
    )


def build_job(spec: DatasetSpec):
    """Run stages over a range of runs, then the dataset: one Dagster run (what `aml-pipeline build`
    launches when one chunk covers the runs that need work)."""
    return dg.define_asset_job(
        name=build_job_name(spec.id),
        selection=dg.AssetSelection.assets(*(dg.AssetKey([spec.id, n]) for n in (*RUN_ASSETS, *DATASET_ASSETS))),
        description=f"Build {spec.id}: the run stages of a range of runs, then split, normalisation and snapshot.",
    )


def rebuild_job(spec: DatasetSpec):
    return dg.define_asset_job(
        name=rebuild_job_name(spec.id),
        selection=dg.AssetSelection.assets(*(dg.AssetKey([spec.id, n]) for n in DATASET_ASSETS)),
        description=(
            f"Split, normalise and publish {spec.id} from the run partitions materialised so far; "
            "publishes nothing when nothing changed."
        ),
    )


def verify_job(spec: DatasetSpec):
    return dg.define_asset_job(
        name=verify_job_name(spec.id),
        selection=dg.AssetSelection.checks_for_assets(dg.AssetKey([spec.id, MANIFEST.asset])),
        description=(
            f"Re-run the four blocking checks of {spec.id}'s dataset_manifest on its current snapshot "
            "(hash against the catalog, splits, train-only statistics, no NaN): tampering after "
            "publication shows as a failed check."
        ),
    )


def rebuild_schedule(spec: DatasetSpec, job) -> dg.ScheduleDefinition:
    return dg.ScheduleDefinition(
        name=f"{spec.id}__rebuild_schedule",
        job=job,
        cron_schedule=spec.schedule or DEFAULT_CRON,
        description=f"Rebuilds {spec.id} ({spec.schedule or 'default: hourly at :15'}; set `schedule` in the spec).",
    )


def verify_schedule(spec: DatasetSpec, job) -> dg.ScheduleDefinition:
    return dg.ScheduleDefinition(
        name=f"{spec.id}__verify_schedule",
        job=job,
        cron_schedule=VERIFY_CRON,
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description=f"Re-verifies {spec.id}'s current snapshot daily at 04:30 (off until turned on).",
    )
