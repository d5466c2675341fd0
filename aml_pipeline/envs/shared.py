"""The shared environment under its lease: the one implementation behind the Dagster resource,
the ``rebuild_shared_env`` job and ``aml-pipeline env status|rebuild``.

* :func:`rebuild_shared_env` - take the exclusive lease (``ENV_BUSY`` at once, or after
  ``wait_s``, while readers hold leases) and build + swap in a fresh environment; while it
  waits, new read leases are refused, so a stream of readers cannot starve it;
* :func:`use_shared_env` - hold a read lease and get the current environment's interpreter
  (``ENV_BUSY`` while a rebuild holds or waits for the exclusive lock; ``ENV_MISSING`` if
  nothing is built);
* :func:`shared_env_status` / :func:`format_status` - who holds the lease, which rebuild waits
  for it, and what the environment is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aml_pipeline.envs.venv import EnvBuild, EnvSettings, Log, build_env, check_layout, current_env, describe_env
from aml_pipeline.errors import AmlError
from aml_pipeline.lease import LeaseHandle
from aml_pipeline.lease.base import iso_utc


def rebuild_shared_env(
    settings: EnvSettings, *, holder: str, wait_s: float = 0.0, log: Log | None = None
) -> EnvBuild:
    """Rebuild the shared environment while holding its exclusive lease.

    Raises :class:`aml_pipeline.lease.EnvBusy` (``ENV_BUSY``, naming the holders) if the lease
    cannot be taken within ``wait_s`` seconds (0: refuse at once). While it waits, new read
    leases are refused (readers already holding finish), so it gets the lock once they are done.
    """
    check_layout(settings)
    lease = settings.open_lease()
    with lease.exclusive(holder, wait_s=wait_s) as handle:
        if log:
            log(f"holding the exclusive lease on {lease.location} [{lease.name}] as {holder!r}")
        return build_env(settings, handle, log=log)


@dataclass(frozen=True)
class EnvInUse:
    """The environment a read-lease holder may run code in, for as long as it holds the lease."""

    python: Path  # the build's own interpreter path (stable while the lease is held)
    build_dir: Path
    python_version: str | None
    packages: list[dict[str, str]]
    lease: LeaseHandle

    def command(self, script: str | os.PathLike[str], *args: str) -> list[str]:
        """Run ``script`` with this interpreter, isolated from the caller's environment
        (``-E``: no PYTHONPATH/PYTHONHOME; ``-s``: no user site-packages)."""
        return [str(self.python), "-E", "-s", os.fspath(script), *args]


@contextmanager
def use_shared_env(settings: EnvSettings, *, holder: str, wait_s: float = 0.0) -> Iterator[EnvInUse]:
    """Hold a read lease on the shared environment for the ``with`` block."""
    lease = settings.open_lease()
    with lease.read(holder, wait_s=wait_s) as handle:
        state = current_env(settings.venv_path)
        if not state.exists or state.marker is None:
            raise AmlError(
                f"the shared environment {settings.venv_path} is not built; run the rebuild_shared_env "
                "job or `aml-pipeline env rebuild`",
                code="ENV_MISSING",
            )
        yield EnvInUse(
            python=state.python,  # type: ignore[arg-type]
            build_dir=state.build_dir,  # type: ignore[arg-type]
            python_version=state.marker.get("python_version"),
            packages=list(state.marker.get("packages") or []),
            lease=handle,
        )


def shared_env_status(settings: EnvSettings, *, probe: bool = True) -> dict[str, Any]:
    """Lease status (readers, holders, exclusive owner, waiting rebuild) and the environment."""
    lease = settings.open_lease()
    status = lease.status()
    return {
        "lease": status.to_dict(),
        "idle": status.idle,
        "env": describe_env(settings.venv_path, probe=probe),
        "requirements": str(settings.requirements),
    }


def format_status(status: dict[str, Any]) -> str:
    """``env status`` as text."""
    lease, env = status["lease"], status["env"]

    def who(h: dict[str, Any]) -> str:
        bits = [f"pid {h['pid']}" if h.get("pid") is not None else "", f"host {h['host']}" if h.get("host") else "",
                f"since {h.get('since_iso') or iso_utc(h.get('since'))}" if h.get("since") is not None else "",
                f"until {h.get('deadline_iso') or iso_utc(h.get('deadline'))}" if h.get("deadline") is not None else ""]
        return f"{h['holder']} ({', '.join(b for b in bits if b)})"

    lines = [f"lease      {lease['location']} [{lease['name']}] ({lease['backend']})"]
    lines.append(f"exclusive  {who(lease['exclusive']) if lease['exclusive'] else 'none'}")
    waiting = lease.get("waiting")
    lines.append(f"waiting    {who(waiting) + ': no new read lease meanwhile' if waiting else 'none'}")
    lines.append(f"readers    {lease['readers']}")
    for r in lease["reader_leases"]:
        lines.append(f"  - {who(r)}")
    if env["exists"]:
        lines.append(f"env        {env['path']} -> {env['build_dir']}")
        version = env.get("python_version") or "?"
        health = "" if env.get("python_ok", True) else f"  NOT RUNNABLE: {env.get('python_error')}"
        lines.append(f"python     {env['python']} ({env.get('implementation', 'Python')} {version}){health}")
        if env.get("complete"):
            pkgs = env.get("packages") or []
            lines.append(f"built      {env.get('created_at')} by {env.get('installer')}, {len(pkgs)} packages")
            for p in pkgs:
                lines.append(f"  {p['name']:<28} {p['version']}")
        else:
            lines.append("built      not by aml-pipeline (no aml-env.json); `env rebuild` replaces it")
    else:
        lines.append(f"env        {env['path']}: not built (run `aml-pipeline env rebuild`)")
    return "\n".join(lines)


__all__ = ["EnvInUse", "format_status", "rebuild_shared_env", "shared_env_status", "use_shared_env"]
