"""Run partitions: one dynamic partition per production run, per dataset spec."""

from __future__ import annotations

import dagster as dg


def run_partitions(spec_id: str) -> dg.DynamicPartitionsDefinition:
    """Partitions named by run id; a sensor adds runs as they finish."""
    return dg.DynamicPartitionsDefinition(name=f"{spec_id}__runs")
