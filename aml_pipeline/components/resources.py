"""Resources: the TSDB, the artifact store and the shared environment, configured by environment.

Each resource is a small ConfigurableResource. Values come from ``AML_TSDB_URL``, ``AML_HOME`` and
``AML_ENV_LOCATION`` through ``dg.EnvVar`` when they are set, so the UI shows where a value comes
from; unset, the documented defaults under ``AML_HOME`` apply.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg

from aml_pipeline import config
from aml_pipeline.pipeline.registry import StageVersions
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import DatasetSpec
from aml_pipeline.tsdb import TsdbPort
from aml_pipeline.tsdb.port import DEFAULT_PAGE_LIMIT
from aml_pipeline.tsdb.retry import OnRetry, RetryingTsdb
from aml_pipeline.tsdb_open import open_tsdb, retrying_tsdb


class TsdbResource(dg.ConfigurableResource):
    """The plant's time-series database. The URL picks the adapter:
    ``duckdb:///path/file.duckdb`` (embedded) or ``postgresql://user@host/db``."""

    url: str
    page_limit: int = DEFAULT_PAGE_LIMIT

    @contextmanager
    def open(self, *, read_only: bool = True) -> Iterator[TsdbPort]:
        """One connection for the whole step (never one per page)."""
        tsdb = open_tsdb(self.url, read_only=read_only)
        try:
            yield tsdb
        finally:
            tsdb.close()


    @contextmanager
    def brief(self, hold_s: float = 0.5, on_retry: OnRetry | None = None) -> Iterator[RetryingTsdb]:
        """For long work: a handle held at most about ``hold_s`` at a time (reopened between pages),
        so an ingest into the embedded file can run while a long backfill builds; every call
        retried while the TSDB is briefly unavailable, each retry's warning line to ``on_retry``."""
        with retrying_tsdb(self.url, on_retry=on_retry, hold_s=hold_s) as db:
            yield db


class StoreResource(dg.ConfigurableResource):
    """Where artifacts live: per-run intermediates under ``<home>/store`` and published
    snapshots under ``datasets_dir`` (default ``<home>/datasets``)."""

    home: str
    datasets_dir: str | None = None

    def dataset_store(self, spec: DatasetSpec, versions: StageVersions | None = None) -> DatasetStore:
        return DatasetStore(config.store_dir(Path(self.home)), spec, versions)

    @property
    def home_path(self) -> Path:
        return Path(self.home)

    @property
    def datasets_root(self) -> Path:
        return Path(self.datasets_dir) if self.datasets_dir else config.datasets_dir(Path(self.home))


def _env_or(name: str, default: str) -> str | dg.EnvVar:
    """``dg.EnvVar(name)`` when the variable is set (the UI then shows where the value comes from),
    else ``default``."""
    return dg.EnvVar(name) if os.environ.get(name) else default


def plant_resources(*, tsdb_url_env: str = "AML_TSDB_URL", home_env: str = "AML_HOME",
                    env_location_env: str = "AML_ENV_LOCATION", datasets_dir: str | None = None) -> dict[str, Any]:
    """The resources every dataset of a code location shares, read from the environment variables
    named (``AML_*`` by default); unset, the documented defaults under ``./.aml`` apply."""
    from aml_pipeline.components.shared_env import SharedEnvResource
    from aml_pipeline.envs import default_venv_path

    home = Path(os.environ.get(home_env) or Path.cwd() / ".aml").resolve()
    return {
        "tsdb": TsdbResource(url=_env_or(tsdb_url_env, config.default_tsdb_url(home))),
        "store": StoreResource(home=_env_or(home_env, str(home)), datasets_dir=datasets_dir),
        "shared_env": SharedEnvResource(
            lease_location=_env_or(env_location_env, str(home / "env")), venv_path=str(default_venv_path(home)),
        ),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    }
