"""Celery settings, one place for both ends: the Dagster executor that sends steps and the workers
(``aml_pipeline.workers``) that run them must agree on broker, queue and acknowledgement.

Broker and result backend come from the environment (``AML_CELERY_BROKER_URL``, optional
``AML_CELERY_BACKEND_URL``, default the broker), so a password in a URL stays in the environment
of the processes that connect and never reaches a file, a definition or the run storage: the
executor receives ``{"env": ...}`` references that Dagster resolves when a run starts.

A step is acknowledged when it ends, not when a worker takes it (``task_acks_late``), so a step
whose worker dies is delivered again to another worker: a step process killed under a living
worker is requeued at once (``task_reject_on_worker_lost``); a whole worker host that dies holds
its step until the broker notices. RabbitMQ redelivers when the connection drops; Redis after
``AML_CELERY_VISIBILITY_TIMEOUT_S`` (default 3600 s), which must exceed the longest step, or a
step still running is delivered a second time. Steps are idempotent (every stage write is an
atomic rename), so a second delivery costs time, never correctness.
"""

from __future__ import annotations

import os
from typing import Any

from aml_pipeline.config import whole_number_env
from aml_pipeline.errors import AmlError

BROKER_ENV = "AML_CELERY_BROKER_URL"
BACKEND_ENV = "AML_CELERY_BACKEND_URL"
VISIBILITY_TIMEOUT_ENV = "AML_CELERY_VISIBILITY_TIMEOUT_S"
DEFAULT_VISIBILITY_TIMEOUT_S = 3600
# dagster-celery's queue; workers listen on it (``-Q dagster``).
QUEUE = "dagster"


def broker_url() -> str:
    url = os.environ.get(BROKER_ENV, "").strip()
    if not url:
        raise AmlError(
            f"{BROKER_ENV} is not set; the Celery executor needs the broker's URL "
            "(redis://host:6379/0 or amqp://user@host:5672//)",
            code="CONFIG_INVALID",
        )
    return url


def backend_url() -> str:
    return os.environ.get(BACKEND_ENV, "").strip() or broker_url()


def visibility_timeout_s() -> int:
    return whole_number_env(
        VISIBILITY_TIMEOUT_ENV, DEFAULT_VISIBILITY_TIMEOUT_S, minimum=1, unit="a whole number of seconds"
    )


def celery_settings() -> dict[str, Any]:
    """Celery's own settings (``config_source``), the same on the executor's side and the workers'."""
    from dagster_celery.defaults import broker_transport_options

    return {
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # One step at a time per worker process: a worker never holds steps it cannot start yet.
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": {**broker_transport_options, "visibility_timeout": visibility_timeout_s()},
        "broker_connection_retry_on_startup": True,
    }


def executor_config() -> dict[str, Any]:
    """Config of dagster-celery's executor: the URLs as environment references, resolved when a
    run starts (checked here so a missing broker fails when the definitions load, naming it)."""
    broker_url()
    return {
        "broker": {"env": BROKER_ENV},
        "backend": {"env": BACKEND_ENV if os.environ.get(BACKEND_ENV, "").strip() else BROKER_ENV},
        "config_source": celery_settings(),
    }
