"""Helpers shared by the shared-environment, baseline and training tests.

No network: every environment is built with the ``copy`` installer (the pinned numpy and
dagster-pipes are copied from the project environment into a real, isolated venv, after their
versions are checked against ``requirements/shared-env.txt``). ``--system-site-packages`` would
not do: a venv made from ``.venv/bin/python`` inherits the *base* interpreter's site-packages,
where neither package is installed.

Expensive things (the demo dataset, one built environment) are made once per session and
shared through module-level caches, since test modules in different folders cannot share a
session fixture without a common conftest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from aml_pipeline.envs import EnvSettings, rebuild_shared_env

REPO_ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "aml_pipeline.cli"]

_CACHE: dict[str, Any] = {}


def env_settings(base: Path, **kw: Any) -> EnvSettings:
    """Settings for an environment under ``base`` (lease dir and venv kept apart), offline."""
    kw.setdefault("installer", "copy")
    return EnvSettings(venv_path=base / "shared-env" / "venv", lease_location=str(base / "lease"), **kw)


def shared_env_resource(settings: EnvSettings, **kw: Any):
    from aml_pipeline.components.shared_env import SharedEnvResource

    return SharedEnvResource(
        lease_location=settings.lease_location,
        venv_path=str(settings.venv_path),
        requirements=str(settings.requirements),
        installer=settings.installer,
        check_imports=list(settings.check_imports),
        **kw,
    )


@dataclass
class DemoData:
    home: Path
    datasets_root: Path
    tsdb_url: str
    summary: dict[str, Any]

    @property
    def snapshot(self) -> Path:
        return Path(self.summary["snapshotDir"])


def demo_dataset(tmp_path_factory) -> DemoData:
    """The simulated plant (12 runs) built into reactor_a's snapshot through Dagster, once."""
    if "demo" not in _CACHE:
        from aml_pipeline.runner.build import materialize_dataset
        from aml_pipeline.demo import DEMO_SPEC, seed_demo
        from aml_pipeline.spec import load_spec

        home = tmp_path_factory.mktemp("demo-home")
        url = f"duckdb:///{home / 'tsdb.duckdb'}"
        seed_demo(url, runs=12)
        summary = materialize_dataset(load_spec(DEMO_SPEC), tsdb_url=url, home=home)
        _CACHE["demo"] = DemoData(home, home / "datasets", url, summary)
    return _CACHE["demo"]


def built_env(tmp_path_factory) -> EnvSettings:
    """One environment built (copy installer) for the session; tests only read-lease it."""
    if "env" not in _CACHE:
        settings = env_settings(tmp_path_factory.mktemp("shared-env"))
        rebuild_shared_env(settings, holder="test session setup")
        _CACHE["env"] = settings
    return _CACHE["env"]


# A process that holds one lease until told to release it (or is killed).
_HOLDER = r"""
import json, os, sys
from aml_pipeline.lease import open_lease
a = json.loads(sys.argv[1])
handle = open_lease(a["location"], name=a["name"]).acquire(a["mode"], a["holder"])
print("ACQUIRED", os.getpid(), flush=True)
sys.stdin.readline()
handle.release()
print("RELEASED", flush=True)
"""


class LeaseHolder:
    """Another process holding a lease (``mode`` read or exclusive) on ``settings``' location."""

    def __init__(self, settings: EnvSettings, holder: str, mode: str = "read") -> None:
        args = {"location": settings.lease_location, "name": settings.lease_name, "mode": mode, "holder": holder}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        )
        line = self.proc.stdout.readline().split()  # type: ignore[union-attr]
        assert line and line[0] == "ACQUIRED", f"holder did not start: {line}"
        self.pid = int(line[1])

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("release\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> LeaseHolder:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.release()
        finally:
            self.close()


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``aml-pipeline ARGS`` in its own process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO_ROOT)


def step_failures(result: dg.ExecuteInProcessResult) -> list[str]:
    """Text of each step failure: the error message plus a dg.Failure's description."""
    out = []
    for event in result.all_events:
        if event.is_step_failure:
            data = event.step_failure_data
            parts = [data.error.message if data.error else ""]
            if data.user_failure_data is not None and data.user_failure_data.description:
                parts.append(data.user_failure_data.description)
            out.append(" | ".join(parts))
    return out


def materialization(result: dg.ExecuteInProcessResult, key: dg.AssetKey) -> dict[str, Any]:
    """Metadata of ``key``'s materialisation, as plain values (tables as lists of dicts)."""
    for event in result.get_asset_materialization_events():
        mat = event.materialization
        if mat.asset_key == key:
            out = {}
            for k, v in mat.metadata.items():
                value = v.value
                if hasattr(value, "records"):
                    value = [dict(r.data) for r in value.records]
                out[k] = value
            return out
    raise AssertionError(f"{key.to_user_string()} was not materialised")


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)
