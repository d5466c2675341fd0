"""The shared Python environment in Dagster (docs/design.md, "The shared environment").

* ``SharedEnvResource`` (resource key ``shared_env``): where the environment and its lease
  live, what goes into it and how it is built. ``lease_location`` comes from
  ``AML_ENV_LOCATION`` through ``dg.EnvVar`` when set, else ``$AML_HOME/env``; the venv defaults
  to ``$AML_HOME/shared-env/venv`` (kept apart from the lease directory).
* asset ``shared_env`` and job ``rebuild_shared_env``: take the EXCLUSIVE lease and rebuild the
  environment (built next to the current one, swapped in with an atomic rename; see
  :mod:`aml_pipeline.envs.venv`). Reports interpreter, Python version and the installed
  packages. Fails with ``ENV_BUSY`` (naming the holders) while readers hold leases; with
  ``rebuild_wait_s`` it waits that long, and meanwhile no new read lease is granted, so readers
  coming and going cannot starve it. Runs in pool
  ``aml_shared_env`` (``dagster.yaml``: one step at a time), so two rebuilds queue in Dagster
  instead of racing for the lock.
* resource ``pipes_subprocess_client``: how consumers (``baseline_model``) run code in it.

``aml-pipeline env status|rebuild`` call the same functions (:mod:`aml_pipeline.envs`).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
from pydantic import Field

from aml_pipeline.envs import (
    DEFAULT_CHECK_IMPORTS,
    DEFAULT_REQUIREMENTS,
    EnvBuild,
    EnvInUse,
    EnvSettings,
    rebuild_shared_env,
    shared_env_status,
    use_shared_env,
)
from aml_pipeline.errors import AmlError
from aml_pipeline.lease import DEFAULT_LEASE_NAME, EnvBusy

SHARED_ENV_KEY = dg.AssetKey(["shared_env"])
SHARED_ENV_POOL = "aml_shared_env"
REBUILD_JOB = "rebuild_shared_env"


class SharedEnvResource(dg.ConfigurableResource):
    """The shared Python environment and its lease (many readers or one rebuild)."""

    lease_location: str | None = Field(
        default=None, description="Lease directory or postgresql:// URL (None: AML_ENV_LOCATION, else $AML_HOME/env)."
    )
    lease_name: str = Field(default=DEFAULT_LEASE_NAME, description="Tells environments sharing one location apart.")
    venv_path: str | None = Field(
        default=None,
        description="The environment's path, a symlink to its current build (None: $AML_HOME/shared-env/venv).",
    )
    requirements: str = Field(default=str(DEFAULT_REQUIREMENTS), description="Pinned requirements (name==version per line).")
    installer: str = Field(
        default="auto",
        description="auto (uv if on PATH, else pip) | uv | pip | copy (offline: the pinned packages are copied "
        "from the project environment after checking their versions against the pins).",
    )
    python: str | None = Field(default=None, description="Interpreter that creates the venv (None: the one running Dagster).")
    check_imports: list[str] = Field(
        default=list(DEFAULT_CHECK_IMPORTS), description="Modules that must import in a new build before it is swapped in."
    )
    rebuild_wait_s: float = Field(
        default=0.0,
        description="How long a rebuild waits for the exclusive lease (0: ENV_BUSY at once); while it waits, "
        "no new read lease is granted, so readers already holding finish and it gets the lock.",
    )
    read_wait_s: float = Field(
        default=0.0,
        description="How long a consumer waits for a read lease while a rebuild holds or waits for the lock (0: ENV_BUSY at once).",
    )

    def settings(self) -> EnvSettings:
        return EnvSettings.from_environment(
            venv_path=self.venv_path,
            lease_location=self.lease_location,
            lease_name=self.lease_name,
            requirements=self.requirements,
            installer=self.installer,
            python=self.python,
            check_imports=tuple(self.check_imports),
        )

    @contextmanager
    def read(self, holder: str) -> Iterator[EnvInUse]:
        """Hold a read lease for the block and yield the environment's interpreter."""
        with use_shared_env(self.settings(), holder=holder, wait_s=self.read_wait_s) as env:
            yield env

    def rebuild(self, holder: str, log: Any = None) -> EnvBuild:
        return rebuild_shared_env(self.settings(), holder=holder, wait_s=self.rebuild_wait_s, log=log)

    def status(self) -> dict[str, Any]:
        return shared_env_status(self.settings())


def busy_failure(e: EnvBusy, what: str) -> dg.Failure:
    """ENV_BUSY as a step failure whose description names the holders."""
    status = e.status
    metadata: dict[str, Any] = {"lease_location": e.location or "", "code": e.code}
    if status is not None:
        metadata["readers"] = status.readers
        metadata["holders"] = ", ".join(status.holders) or "-"
        metadata["exclusive"] = status.exclusive.describe() if status.exclusive else "-"
        metadata["waiting_rebuild"] = status.waiting.describe() if status.waiting else "-"
    return dg.Failure(description=f"{what}: {e.one_line()}", metadata=metadata)


def _packages_table(packages: list[dict[str, str]]) -> dg.MetadataValue:
    return dg.MetadataValue.table(
        records=[dg.TableRecord({"package": p["name"], "version": p["version"]}) for p in packages],
        schema=dg.TableSchema(columns=[dg.TableColumn("package", "string"), dg.TableColumn("version", "string")]),
    )


@dg.asset(
    key=SHARED_ENV_KEY,
    pool=SHARED_ENV_POOL,
    group_name="shared_env",
    kinds={"python"},
    description=(
        "The shared Python environment that training/evaluation code runs in (pinned requirements). "
        "Materialising it rebuilds it under the EXCLUSIVE lease: refused with ENV_BUSY while any "
        "reader holds a lease; the new venv is built next to the old one and swapped in atomically."
    ),
)
def shared_env_asset(context: dg.AssetExecutionContext, shared_env: SharedEnvResource) -> dg.MaterializeResult:
    holder = f"{REBUILD_JOB} (run {context.run.run_id[:8]})"
    try:
        build = shared_env.rebuild(holder, log=context.log.info)
    except EnvBusy as e:
        raise busy_failure(e, "cannot rebuild the shared environment") from e
    except AmlError as e:  # a failed build (the previous environment stays current), bad config
        raise dg.Failure(description=f"cannot rebuild the shared environment: {e.one_line()}") from e
    return dg.MaterializeResult(
        metadata={
            "python": dg.MetadataValue.path(str(build.python)),
            "python_version": f"{build.implementation} {build.python_version}",
            "packages": _packages_table(build.packages),
            "package_count": len(build.packages),
            "requirements": dg.MetadataValue.md("\n".join(f"- `{r}`" for r in build.requirements) or "_(none)_"),
            "requirements_file": dg.MetadataValue.path(str(build.requirements_file)),
            "installer": build.installer,
            "venv_path": dg.MetadataValue.path(str(build.venv_path)),
            "build_dir": dg.MetadataValue.path(str(build.build_dir)),
            "replaced": build.replaced or "-",
            "removed_builds": len(build.removed),
            "duration_s": round(build.duration_s, 2),
            "lease_holder": holder,
        },
        data_version=dg.DataVersion(build.packages_fingerprint),
    )


rebuild_shared_env_job = dg.define_asset_job(
    REBUILD_JOB,
    selection=dg.AssetSelection.assets(SHARED_ENV_KEY),
    description="Rebuild the shared Python environment under its exclusive lease (ENV_BUSY while in use).",
)


__all__ = [
    "REBUILD_JOB",
    "SHARED_ENV_KEY",
    "SHARED_ENV_POOL",
    "SharedEnvResource",
    "busy_failure",
    "rebuild_shared_env_job",
    "shared_env_asset",
]
