"""Run partitions: one dynamic partition per production run, per dataset spec; ranges of them."""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

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
    """A range of run partitions in one Dagster run (one step over the range, the runs streamed one
    after the other): what ``dg launch --partition-range`` needs, and a backfill from the UI pays
    Dagster's start-up once per contiguous range instead of once per chunk. Chunks of
    ``AML_BACKFILL_RUNS_PER_CHUNK`` runs, each recorded when it ends, are what the new-run sensor
    and ``aml-pipeline build`` request (:func:`range_tags`)."""
    return dg.BackfillPolicy.single_run()
