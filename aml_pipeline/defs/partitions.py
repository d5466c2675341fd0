"""Run partitions: one dynamic partition per production run, per dataset spec."""

from __future__ import annotations

import dagster as dg

from aml_pipeline import config


def run_partitions(spec_id: str) -> dg.DynamicPartitionsDefinition:
    """Partitions named by run id; a sensor adds runs as they finish."""
    return dg.DynamicPartitionsDefinition(name=f"{spec_id}__runs")


def run_backfill_policy() -> dg.BackfillPolicy:
    """Backfills of the run assets in chunks of ``AML_BACKFILL_RUNS_PER_CHUNK`` runs per Dagster
    run: each chunk is recorded when it ends, so a crash loses at most one chunk, and chunks run
    side by side up to the run queue's limit."""
    return dg.BackfillPolicy.multi_run(config.backfill_runs_per_chunk())
