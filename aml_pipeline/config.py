"""Where things live, from the environment (AML_HOME, AML_TSDB_URL, AML_SPECS, AML_ENV_LOCATION).

The Dagster resources read the same variables through ``dg.EnvVar``; this module gives the CLI
and the defaults one place to agree on them.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def aml_home() -> Path:
    return Path(os.environ.get("AML_HOME") or Path.cwd() / ".aml").resolve()


def default_tsdb_url(home: Path | None = None) -> str:
    return f"duckdb:///{(home or aml_home()) / 'tsdb.duckdb'}"


def tsdb_url() -> str:
    return os.environ.get("AML_TSDB_URL") or default_tsdb_url()


def specs_dir() -> Path:
    configured = os.environ.get("AML_SPECS")
    return Path(configured).resolve() if configured else REPO_ROOT / "specs"


def env_location() -> str:
    return os.environ.get("AML_ENV_LOCATION") or str(aml_home() / "env")


DEFAULT_MEMORY_MB = 1024


def memory_budget_mb() -> int:
    """The memory budget of one build process (``AML_MEMORY_MB``, default 1024): runs are
    processed in chunks sized from it, and the embedded TSDB's cache takes a share of it."""
    raw = os.environ.get("AML_MEMORY_MB", "").strip()
    if not raw:
        return DEFAULT_MEMORY_MB
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if mb < 64:
        from aml_pipeline.errors import AmlError

        raise AmlError(f"AML_MEMORY_MB={raw!r} must be an integer number of megabytes >= 64", code="CONFIG_INVALID")
    return mb


DEFAULT_BACKFILL_CHUNK_RUNS = 64


def backfill_chunk_runs() -> int:
    """Runs per Dagster run when run partitions are backfilled (``AML_BACKFILL_CHUNK_RUNS``,
    default 64): a crash loses at most one chunk, and each chunk's partitions are recorded as
    soon as it ends."""
    raw = os.environ.get("AML_BACKFILL_CHUNK_RUNS", "").strip()
    if not raw:
        return DEFAULT_BACKFILL_CHUNK_RUNS
    if not raw.isdigit() or int(raw) < 1:
        from aml_pipeline.errors import AmlError

        raise AmlError(f"AML_BACKFILL_CHUNK_RUNS={raw!r} must be a positive integer", code="CONFIG_INVALID")
    return int(raw)


def store_dir(home: Path | None = None) -> Path:
    """Per-run intermediate artifacts of the Dagster assets."""
    return (home or aml_home()) / "store"


def datasets_dir(home: Path | None = None) -> Path:
    """Published snapshots and their catalog."""
    return (home or aml_home()) / "datasets"
