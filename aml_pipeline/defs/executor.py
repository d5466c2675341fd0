"""Where the steps run, chosen by ``AML_EXECUTOR`` when the code location loads.

Unset (or ``multiprocess``): Dagster's default executor, one process per step on the host of the
run. ``celery``: dagster-celery's executor; every step of every job (backfill chunks, the rebuild
job, sensor runs) goes to the Celery workers (``celery -A aml_pipeline.workers worker``), which
may run on other hosts sharing the TSDB, the instance database and the artifact store. Settings:
``aml_pipeline/celery_config.py``; the deployment: docs/deployment.md.
"""

import dagster as dg

from aml_pipeline import config


@dg.definitions
def executor() -> dg.Definitions:
    if config.executor_name() != "celery":
        return dg.Definitions()
    from dagster_celery import celery_executor

    from aml_pipeline.celery_config import executor_config

    return dg.Definitions(executor=celery_executor.configured(executor_config(), name="celery"))
