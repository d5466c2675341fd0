"""Run partitions: one dynamic partition per production run, per dataset spec; ranges of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import dagster as dg

from aml_pipeline import config
from aml_pipeline.pipeline.incremental import contiguous_ranges, stages_from
from aml_pipeline.pipeline.versions import RUN_STAGES

# Public run tags that make one run cover a range of partitions (a single-run backfill).
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
RUN_ASSETS = ("raw_node_series", "cleaned_grid", "run_windows")
ASSET_OF_STAGE = dict(zip(RUN_STAGES, RUN_ASSETS, strict=True))


def run_partitions(spec_id: str) -> dg.DynamicPartitionsDefinition:
    """Partitions named by run id; a sensor adds runs as they finish."""
    return dg.DynamicPartitionsDefinition(name=f"{spec_id}__runs")


def range_tags(run_ids: Sequence[str]) -> dict[str, str]:
    """Tags of a Dagster run over the contiguous partitions ``run_ids``."""
    return {RANGE_START_TAG: run_ids[0], RANGE_END_TAG: run_ids[-1]}


def plan_run_batches(
    partition_keys: Sequence[str], first_stale: Mapping[str, str], chunk_runs: int
) -> list[tuple[list[str], list[str]]]:
    """``(asset names, run ids)`` per Dagster run: runs grouped by their first stale stage, in
    contiguous partition ranges of at most ``chunk_runs``."""
    batches = []
    for stage in RUN_STAGES:
        runs = [r for r, s in first_stale.items() if s == stage]
        names = [ASSET_OF_STAGE[s] for s in stages_from(stage)]
        batches += [(names, chunk) for chunk in contiguous_ranges(partition_keys, runs, chunk_runs)]
    return batches


def run_backfill_policy() -> dg.BackfillPolicy:
    """Backfills of the run assets in chunks of ``AML_BACKFILL_RUNS_PER_CHUNK`` runs per Dagster
    run: each chunk is recorded when it ends, so a crash loses at most one chunk, and chunks run
    side by side up to the run queue's limit."""
    return dg.BackfillPolicy.multi_run(config.backfill_runs_per_chunk())
