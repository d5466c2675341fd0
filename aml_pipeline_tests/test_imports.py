"""Every module of the package imports on its own, in a fresh interpreter.

An import circle shows only when a module is the first one imported (a caller that happens to
import another module first hides it), so each module gets its own interpreter.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import pytest

import aml_pipeline


def package_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(aml_pipeline.__path__, prefix="aml_pipeline."))


def test_the_package_has_its_modules() -> None:
    names = package_modules()
    assert "aml_pipeline.pipeline.store" in names and "aml_pipeline.pipeline.registry" in names


@pytest.mark.parametrize("chunk", range(4))
def test_every_module_imports_on_its_own(chunk: int) -> None:
    # One interpreter per module; a quarter of the modules per test keeps failures readable.
    names = package_modules()[chunk::4]
    # The Celery worker module builds its app at import and requires the broker's URL (it does
    # not connect on import).
    env = {**os.environ, "AML_CELERY_BROKER_URL": "redis://127.0.0.1:1/0"}
    failures = []
    for name in names:
        result = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, env=env)
        if result.returncode != 0:
            failures.append(f"{name}: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.returncode}")
    assert not failures, "\n".join(failures)
