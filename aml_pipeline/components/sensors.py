"""New-run sensor: finished runs in a spec's scope become run partitions and are materialised.

Every tick reads the build plan (:class:`aml_pipeline.pipeline.plan.BuildPlan`): new runs, runs
with late points (their TSDB version changed) and runs whose spec stages changed are requested, from their first stale stage on, in contiguous partition ranges of
at most ``AML_BACKFILL_RUNS_PER_CHUNK`` runs per Dagster run (the range tags single-run backfills
use), never one Dagster run per partition. A run whose build failed is requested again on a
later tick, ``MAX_ATTEMPTS`` requests in all, then reported in the tick's log and skip reason until
its data or its spec changes.
"""

import json

import dagster as dg

from aml_pipeline import config
from aml_pipeline.components.partitions import (
    RANGE_END_TAG,
    RANGE_START_TAG,
    range_tags,
    run_partitions,
)
from aml_pipeline.components.resources import StoreResource, TsdbResource
from aml_pipeline.pipeline.plan import BuildPlan, run_batches
from aml_pipeline.pipeline.registry import RUN_ASSETS, WINDOWS, StageVersions
from aml_pipeline.pipeline.stages.base import inputs_key
from aml_pipeline.spec import DatasetSpec

MAX_ATTEMPTS = 3
SENSOR_TAG = "aml/sensor"
_ACTIVE = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def new_run_sensor(spec: DatasetSpec, versions: StageVersions) -> dg.SensorDefinition:
    runs_def = run_partitions(spec.id)
    name = f"{spec.id}__new_runs"

    @dg.sensor(
        name=name,
        description=(
            f"Adds finished runs of line {spec.line_id} / product {spec.product_id} / recipe "
            f"{spec.recipe_id} as partitions of {spec.id} and materialises the run stages of new and "
            "changed runs, in chunks of runs per Dagster run; requests a run whose build failed at most "
            f"{MAX_ATTEMPTS} times in all. "
            "Runs still in progress are added once they finish."
        ),
        asset_selection=[dg.AssetKey([spec.id, n]) for n in RUN_ASSETS],
        minimum_interval_seconds=60,
    )
    def sensor(context: dg.SensorEvaluationContext, tsdb: TsdbResource, store: StoreResource):
        with tsdb.open() as db:
            plan = BuildPlan.read(db, store.dataset_store(spec, versions), require_runs=False)
            todo = plan.stale
        runs = plan.runs
        known = context.instance.get_dynamic_partitions(runs_def.name)
        known_set = set(known)
        new = [r.run_id for r in runs if r.run_id not in known_set]
        order = known + new  # partition order once the new ones are added
        attempts: dict[str, int] = json.loads(context.cursor) if context.cursor else {}

        busy = _in_flight(context, name, order)
        attempts = {r: n for r, n in attempts.items() if r in todo}  # built since: forget
        given_up = sorted(r for r in todo if r not in busy and attempts.get(r, 0) >= MAX_ATTEMPTS)
        wanted = {r: s for r, s in todo.items() if r not in busy and r not in given_up}
        if given_up:
            context.log.warning(
                f"{len(given_up)} run(s) failed to build {MAX_ATTEMPTS} times and are not requested again "
                f"until their data or the spec changes: {', '.join(given_up[:20])}"
                + (" ..." if len(given_up) > 20 else "")
            )
        if not wanted:
            reason = f"all {len(runs)} finished runs in scope are built"
            if busy:
                reason = f"{len(busy & set(todo))} run(s) are being built; the rest of {len(runs)} are built"
            if given_up:
                reason += f"; {len(given_up)} gave up after {MAX_ATTEMPTS} failed attempts: {', '.join(given_up[:5])}"
            return dg.SkipReason(reason)

        requests = []
        for stages, chunk in run_batches(order, wanted, config.backfill_runs_per_chunk()):
            names = [s.asset for s in stages]
            attempt = 1 + max(attempts.get(r, 0) for r in chunk)
            # Same inputs, same key: a repeated tick launches nothing twice; new data, new key.
            digest = inputs_key(versions[WINDOWS], names, [(r, plan.tsdb_versions.get(r)) for r in chunk])[:12]
            requests.append(
                dg.RunRequest(
                    run_key=f"{chunk[0]}..{chunk[-1]}@{digest}#{attempt}",
                    asset_selection=[dg.AssetKey([spec.id, n]) for n in names],
                    tags={**range_tags(chunk), SENSOR_TAG: name},
                )
            )
            for r in chunk:
                attempts[r] = attempts.get(r, 0) + 1
        context.log.info(f"requesting {len(wanted)} run(s) in {len(requests)} Dagster run(s)")
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[runs_def.build_add_request(new)] if new else [],
            cursor=json.dumps(attempts, sort_keys=True),
        )

    return sensor


def _in_flight(context: dg.SensorEvaluationContext, sensor_name: str, order: list[str]) -> set[str]:
    """Run partitions covered by this sensor's queued or running Dagster runs."""
    position = {r: i for i, r in enumerate(order)}
    busy: set[str] = set()
    active = context.instance.get_run_records(
        filters=dg.RunsFilter(statuses=_ACTIVE, tags={SENSOR_TAG: sensor_name})
    )
    for run in (record.dagster_run for record in active):
        lo, hi = position.get(run.tags.get(RANGE_START_TAG)), position.get(run.tags.get(RANGE_END_TAG))
        if lo is not None and hi is not None:
            busy.update(order[lo : hi + 1])
    return busy
