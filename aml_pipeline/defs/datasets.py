"""One asset group per spec file in the specs folder (``AML_SPECS``, default ``specs/``).

A spec that fails validation is logged with its one-line reason and skipped; the other
datasets load normally.
"""

from __future__ import annotations

import dagster as dg

from aml_pipeline import config
from aml_pipeline.defs.assets import dataset_assets
from aml_pipeline.defs.baseline import baseline_assets
from aml_pipeline.defs.schedules import build_job, rebuild_job, rebuild_schedule, runs_job, verify_job, verify_schedule
from aml_pipeline.defs.sensors import new_run_sensor
from aml_pipeline.spec import DatasetSpec, discover_specs

log = dg.get_dagster_logger("aml_pipeline")


def dataset_definitions(spec: DatasetSpec) -> dg.Definitions:
    """Everything one dataset spec contributes: assets and checks, the baseline model trained in
    the shared environment, the new-run sensor, the run, rebuild and verify jobs and the
    schedules of the last two."""
    rebuild, verify = rebuild_job(spec), verify_job(spec)
    return dg.Definitions(
        assets=[*dataset_assets(spec), *baseline_assets(spec)],
        sensors=[new_run_sensor(spec)],
        jobs=[runs_job(spec), build_job(spec), rebuild, verify],
        schedules=[rebuild_schedule(spec, rebuild), verify_schedule(spec, verify)],
    )


@dg.definitions
def datasets() -> dg.Definitions:
    specs, errors = discover_specs(config.specs_dir())
    for path, message in errors:
        log.error(f"spec {path} skipped: {message}")
    return dg.Definitions.merge(*(dataset_definitions(spec) for _, spec in specs)) if specs else dg.Definitions()
