"""Where things live, from the environment (AML_HOME, AML_TSDB_URL, AML_SPECS, AML_ENV_LOCATION).

The Dagster resources read the same variables through ``dg.EnvVar``; this module gives the CLI
and the defaults one place to agree on them.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def aml_home() -> Path:
    configured = os.environ.get("AML_HOME")
    return usable_home(Path(configured or Path.cwd() / ".aml").resolve(), "AML_HOME" if configured else "the default home")


def usable_home(home: Path, what: str) -> Path:
    """``home``, unless it or the nearest of its parents that exists is not a directory: then a
    CONFIG_INVALID error naming ``what`` (the variable or the flag), before anything is written."""
    for path in (home, *home.parents):
        if path.exists():
            if not path.is_dir():
                from aml_pipeline.errors import AmlError

                raise AmlError(f"{what} {home}: {path} is a file, not a directory", code="CONFIG_INVALID")
            break
    return home


def repository_checkout() -> Path | None:
    """The repository checkout this code runs from (an editable install, with the repository's
    scripts beside the package), or None for an installed copy of the package."""
    return REPO_ROOT if (REPO_ROOT / "scripts" / "ui.sh").is_file() else None


def repository_instance(home: Path) -> Path | None:
    """The Dagster instance of the repository checkout a command runs in, if it builds into that
    checkout's own ``.aml`` (the default ``AML_HOME`` there): the working directory, when it holds
    the repository's ``dagster.yaml`` and ``scripts/ui.sh``, which opens the UI on it. A build run
    from the repository thus records where the UI looks, with no variable to set."""
    cwd = Path.cwd().resolve()
    if (cwd / "dagster.yaml").is_file() and (cwd / "scripts" / "ui.sh").is_file() and home.resolve() == cwd / ".aml":
        return cwd
    return None


def default_tsdb_url(home: Path | None = None) -> str:
    return f"duckdb:///{(home or aml_home()) / 'tsdb.duckdb'}"


def tsdb_url(home: Path | None = None) -> str:
    """``AML_TSDB_URL``, else the embedded file in ``home`` (default ``AML_HOME``): whatever moves
    the home moves the default TSDB with it."""
    return os.environ.get("AML_TSDB_URL") or default_tsdb_url(home)


def specs_dir(home: Path | None = None) -> Path:
    """``AML_SPECS``, else :func:`default_specs_dir`."""
    configured = os.environ.get("AML_SPECS")
    return Path(configured).resolve() if configured else default_specs_dir(home)


def default_specs_dir(home: Path | None = None) -> Path:
    """The specs folder when ``AML_SPECS`` is unset: the repository's ``specs/`` when this code
    runs from its checkout; for an installed package (no repository around it) ``specs/`` in
    ``home`` (default ``AML_HOME``), where the demo puts the spec it builds."""
    checkout = repository_checkout()
    return checkout / "specs" if checkout is not None else (home or aml_home()) / "specs"


def env_location() -> str:
    return os.environ.get("AML_ENV_LOCATION") or str(aml_home() / "env")


DEFAULT_MEMORY_MB = 1024


def memory_budget_mb() -> int:
    """The memory budget of one build process (``AML_MEMORY_MB``, default 1024): runs are
    processed in chunks sized from it, and the embedded TSDB's cache takes a share of it."""
    # At most a pebibyte: a budget past what a machine has is a typo, and past what the embedded
    # TSDB's memory setting parses it failed as a TSDB that cannot be opened.
    return whole_number_env("AML_MEMORY_MB", DEFAULT_MEMORY_MB, minimum=64, maximum=2**30,
                            unit="an integer number of megabytes")


def whole_number_env(name: str, default: int, *, minimum: int, unit: str, maximum: int | None = None) -> int:
    """The integer in environment variable ``name`` (``default`` when unset or empty); anything
    else than a whole number >= ``minimum`` (and <= ``maximum``, when given) is a CONFIG_INVALID
    error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum or (maximum is not None and value > maximum):
        from aml_pipeline.errors import AmlError, quote

        bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise AmlError(f"{name}={quote(raw)} must be {unit} {bounds}", code="CONFIG_INVALID")
    return value


def store_dir(home: Path | None = None) -> Path:
    """Per-run intermediate artifacts of the Dagster assets."""
    return (home or aml_home()) / "store"


def datasets_dir(home: Path | None = None) -> Path:
    """Published snapshots and their catalog."""
    return (home or aml_home()) / "datasets"


# Runs per Dagster run when a backfill covers many run partitions (see docs/deployment.md).
DEFAULT_BACKFILL_RUNS_PER_CHUNK = 50


def backfill_runs_per_chunk() -> int:
    """How many run partitions one Dagster run of a backfill covers (``AML_BACKFILL_RUNS_PER_CHUNK``,
    default 50). A crash loses at most one chunk; each chunk pays one run's start-up."""
    return whole_number_env(
        "AML_BACKFILL_RUNS_PER_CHUNK", DEFAULT_BACKFILL_RUNS_PER_CHUNK, minimum=1, unit="a whole number of runs"
    )


DEFAULT_INSTANCE_RETENTION_DAYS = 30


def instance_retention_days() -> int:
    """How many days gc keeps every run of this project in the Dagster instance
    (``AML_INSTANCE_RETENTION_DAYS``, default 30); older runs whose every materialisation and
    observation a newer one of the same asset partition superseded are deleted."""
    return whole_number_env(
        # At most a century: the cutoff date must stay a date (a few million days overflow it).
        "AML_INSTANCE_RETENTION_DAYS", DEFAULT_INSTANCE_RETENTION_DAYS, minimum=1, maximum=36_500,
        unit="a whole number of days",
    )


def run_plots() -> bool:
    """Whether each run's figures in the instance include its plot (``AML_RUN_PLOTS``: ``on``, the
    default, or ``off``). The plot is most of what a run's figures take in the event log, and part
    of a run's orchestration time (``bench/plots_bench.py`` measures both); at tens of thousands
    of runs a deployment may rather keep the event log small (the dataset's overview plot is
    drawn either way)."""
    value = os.environ.get("AML_RUN_PLOTS", "").strip().lower() or "on"
    if value not in ("on", "off"):
        from aml_pipeline.errors import AmlError

        raise AmlError(f"AML_RUN_PLOTS={value!r} must be on or off", code="CONFIG_INVALID")
    return value == "on"


EXECUTORS = ("multiprocess", "celery")


def executor_name() -> str:
    """Where Dagster runs the steps (``AML_EXECUTOR``): ``multiprocess`` (default: Dagster's own
    executor, one process per step on the run's host) or ``celery`` (Celery workers on any host;
    see docs/deployment.md)."""
    name = os.environ.get("AML_EXECUTOR", "").strip().lower() or "multiprocess"
    if name not in EXECUTORS:
        from aml_pipeline.errors import AmlError

        raise AmlError(f"AML_EXECUTOR={name!r} must be one of {', '.join(EXECUTORS)}", code="CONFIG_INVALID")
    return name
