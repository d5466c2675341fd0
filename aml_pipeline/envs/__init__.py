"""The shared Python environment: building it and using it under its lease (docs/design.md).

One implementation for the Dagster resource/job (``aml_pipeline.components.shared_env``) and the CLI
(``aml-pipeline env status|rebuild``)::

    settings = EnvSettings.from_environment(installer="copy")
    rebuild_shared_env(settings, holder="me")              # exclusive lease, ENV_BUSY if in use
    with use_shared_env(settings, holder="train") as env:  # read lease for the block
        subprocess.run(env.command("script.py"))
    shared_env_status(settings)                            # readers, holders, owner, interpreter

See :mod:`aml_pipeline.envs.venv` for the on-disk layout (atomic symlink swap) and installers.
"""

from aml_pipeline.envs.shared import EnvInUse, format_status, rebuild_shared_env, shared_env_status, use_shared_env
from aml_pipeline.envs.venv import (
    DEFAULT_CHECK_IMPORTS,
    DEFAULT_REQUIREMENTS,
    INSTALLERS,
    EnvBuild,
    EnvBuildError,
    EnvSettings,
    EnvState,
    Pin,
    build_env,
    check_layout,
    current_env,
    default_venv_path,
    describe_env,
    list_packages,
    read_requirements,
)

__all__ = [
    "DEFAULT_CHECK_IMPORTS",
    "DEFAULT_REQUIREMENTS",
    "INSTALLERS",
    "EnvBuild",
    "EnvBuildError",
    "EnvInUse",
    "EnvSettings",
    "EnvState",
    "Pin",
    "build_env",
    "check_layout",
    "current_env",
    "default_venv_path",
    "describe_env",
    "format_status",
    "list_packages",
    "read_requirements",
    "rebuild_shared_env",
    "shared_env_status",
    "use_shared_env",
]
