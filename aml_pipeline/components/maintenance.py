"""Maintenance: the ``aml_gc`` job keeps disk bounded (old snapshots, obsolete intermediates)."""

import dagster as dg

from aml_pipeline import config as settings
from aml_pipeline.components.resources import StoreResource
from aml_pipeline.pipeline.retention import DEFAULT_KEEP, collect_garbage
from aml_pipeline.spec import DatasetSpec

# The dataset specs of the code location loaded in this process, wherever they were written (a
# specs folder, a defs.yaml, a project's own Python): building a dataset's definitions registers
# its spec here, so gc cleans the intermediates of every one. Dagster loads the code location in
# each process that runs the gc job, before the job runs.
_CODE_LOCATION_SPECS: dict[str, DatasetSpec] = {}


def register_spec(spec: DatasetSpec) -> None:
    """Make ``spec`` known to gc (called for every dataset's definitions)."""
    _CODE_LOCATION_SPECS[spec.id] = spec


def code_location_specs() -> dict[str, DatasetSpec]:
    """The specs gc keeps the intermediates of, by id."""
    return dict(_CODE_LOCATION_SPECS)


class GcConfig(dg.Config):
    keep: int = DEFAULT_KEEP
    """Non-current snapshots to keep per spec (the newest ones)."""
    dry_run: bool = False


@dg.op(
    out=dg.Out(dg.Nothing),
    description="Remove non-current snapshots beyond the newest `keep` and intermediates no current stage version needs.",
)
def collect_garbage_op(context: dg.OpExecutionContext, config: GcConfig, store: StoreResource):
    report = collect_garbage(
        store.datasets_root, settings.store_dir(store.home_path), code_location_specs(),
        keep=config.keep, dry_run=config.dry_run,
    )
    context.log.info(
        f"{'would remove' if report.dry_run else 'removed'} {len(report.removed_snapshots)} snapshot(s), "
        f"{len(report.removed_stages)} stage(s), {len(report.removed_other)} leftover(s); "
        f"{report.freed_bytes / 1e6:.1f} MB" + (f"; skipped: {'; '.join(report.skipped)}" if report.skipped else "")
    )
    yield dg.Output(
        None,
        metadata={
            "removed_snapshots": len(report.removed_snapshots),
            "removed_stages": len(report.removed_stages),
            "freed_mb": round(report.freed_bytes / 1e6, 1),
            "skipped": "; ".join(report.skipped) or "-",
            "report": dg.MetadataValue.json(report.to_json()),
        },
    )


@dg.job(name="aml_gc", description="Retention: old snapshots and obsolete per-run intermediates (see `aml-pipeline gc`).")
def gc_job() -> None:
    collect_garbage_op()


gc_schedule = dg.ScheduleDefinition(
    name="aml_gc_schedule",
    job=gc_job,
    cron_schedule="0 3 * * *",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Runs aml_gc daily at 03:00 (off until turned on).",
)
