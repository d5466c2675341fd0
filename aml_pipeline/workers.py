"""The Celery app of the step workers::

    celery -A aml_pipeline.workers worker -Q dagster -n NAME@%h --concurrency N

Each task is one Dagster step: the worker loads the code location (``aml_pipeline.definitions``,
with the same ``AML_*`` environment as the code server) and the instance (``DAGSTER_HOME``), runs
the step and writes its events to the instance database. Settings are those of the executor
(``aml_pipeline.celery_config``), so both ends agree on broker, queue and acknowledgement; the
broker's URL is read from the environment, never written to a file (``dagster-celery worker
start`` would write it into a generated config module).
"""

from dagster_celery.executor import CeleryExecutor
from dagster_celery.make_app import make_app
from dagster_celery.tasks import create_task

from aml_pipeline.celery_config import backend_url, broker_url, celery_settings
from aml_pipeline.errors import AmlError

try:
    _executor = CeleryExecutor.for_cli(broker=broker_url(), backend=backend_url(), config_source=celery_settings())
except AmlError as e:
    # A worker started without its settings: one line naming the variable, no traceback.
    raise SystemExit(e.one_line()) from None
app = make_app(_executor.app_args())
execute_plan = create_task(app)
