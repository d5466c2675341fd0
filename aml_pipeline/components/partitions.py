"""Run partitions: one dynamic partition per production run, per dataset spec; ranges of them."""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

from aml_pipeline import config

# Public run tags that make one run cover a range of partitions (a single-run backfill).
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"


def run_partitions(spec_id: str) -> dg.DynamicPartitionsDefinition:
    """Partitions named by run id; a sensor adds runs as they finish."""
    return dg.DynamicPartitionsDefinition(name=f"{spec_id}__runs")


def range_tags(run_ids: Sequence[str]) -> dict[str, str]:
    """Tags of a Dagster run over the contiguous partitions ``run_ids``."""
    return {RANGE_START_TAG: run_ids[0], RANGE_END_TAG: run_ids[-1]}


def run_backfill_policy() -> dg.BackfillPolicy:
    """Backfills of the run assets in chunks of ``AML_BACKFILL_RUNS_PER_CHUNK`` runs per Dagster
    run: each chunk is recorded when it ends, so a crash loses at most one chunk, and chunks run
    side by side up to the run queue's limit."""
    return dg.BackfillPolicy.multi_run(config.backfill_runs_per_chunk())
