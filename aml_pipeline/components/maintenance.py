"""Maintenance: the ``aml_gc`` job keeps disk bounded (old snapshots, obsolete intermediates)."""

import dagster as dg

from aml_pipeline import config as settings
from aml_pipeline.components.resources import StoreResource
from aml_pipeline.pipeline.retention import DEFAULT_KEEP, collect_garbage
from aml_pipeline.spec import discover_specs


class GcConfig(dg.Config):
    keep: int = DEFAULT_KEEP
    """Non-current snapshots to keep per spec (the newest ones)."""
    dry_run: bool = False


@dg.op(
    out=dg.Out(dg.Nothing),
    description="Remove non-current snapshots beyond the newest `keep` and intermediates no current stage version needs.",
)
def collect_garbage_op(context: dg.OpExecutionContext, config: GcConfig, store: StoreResource):
    specs, errors = discover_specs(settings.specs_dir())
    for path, message in errors:
        context.log.warning(f"spec {path} skipped: {message}")
    report = collect_garbage(
        store.datasets_root, settings.store_dir(store.home_path), {s.id: s for _, s in specs},
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
