"""bench/dagster_bench.py: the kinds of events a Dagster build stores, as the part reports them."""

from __future__ import annotations

import dagster as dg

from bench.dagster_bench import event_label, persistent_instance


def test_event_labels_name_the_type_and_for_asset_events_the_asset(tmp_path):
    parts = dg.StaticPartitionsDefinition(["a", "b"])

    @dg.asset(key=["spec", "cleaned_grid"], partitions_def=parts)
    def grid(context):  # noqa: ANN001 - Dagster reads the annotation itself
        context.log.info("a progress line")
        return dg.MaterializeResult(metadata={"rows": 1})

    with persistent_instance(tmp_path / "home") as instance:
        result = dg.materialize([grid], instance=instance, partition_key="a")
        labels = [event_label(e) for e in instance.all_logs(result.run_id)]

    assert "ASSET_MATERIALIZATION:cleaned_grid" in labels
    assert "ASSET_MATERIALIZATION_PLANNED:cleaned_grid" in labels
    assert "log" in labels and "STEP_START" in labels
    assert all(":" not in label for label in labels if not label.startswith("ASSET_"))
    assert labels.count("ASSET_MATERIALIZATION:cleaned_grid") == 1
