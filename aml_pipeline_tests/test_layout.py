"""Where code lives: helpers shared by tests, the benchmark and the deployment tests are support
modules of ``aml_pipeline_tests``, never test modules or conftest files; conftest files hold fixtures.

- no module imports a ``test_*`` module or a ``conftest`` (pytest loads those itself);
- ``bench/`` imports from ``aml_pipeline_tests`` only its support modules, and the package
  imports neither the tests nor the benchmark;
- a conftest file defines no public function or class but fixtures and pytest hooks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from aml_pipeline import config

ROOT = config.REPO_ROOT
FOLDERS = ("aml_pipeline", "aml_pipeline_tests", "bench", "deploy", "scripts")


def python_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(source: str) -> Iterator[tuple[int, str]]:
    """(line, dotted module name) of every import in ``source``, at any depth; ``from a import b``
    gives both ``a`` and ``a.b`` (``b`` may be a module)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if node.module else base + alias.name


def is_test_or_conftest(module: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in module.split(".") if part)


def layout_violations(path: str, source: str) -> list[str]:
    """What ``source`` (the file at ``path``, relative to the repository) imports that it must not."""
    out: dict[int, str] = {}  # one finding per import statement
    for line, module in imported_modules(source):
        where = f"{path}:{line}: {module}"
        if is_test_or_conftest(module):
            out.setdefault(line, f"{where} is a test module or a conftest; move what it shares to a support module")
        if path.startswith("aml_pipeline/") and module.split(".")[0] in ("aml_pipeline_tests", "bench"):
            out.setdefault(line, f"{where}: the package imports neither the tests nor the benchmark")
    return list(out.values())


def conftest_helpers(source: str) -> list[str]:
    """Public top-level functions and classes of a conftest that are neither fixtures nor hooks."""
    out = []
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith(("_", "pytest_")):
            continue
        decorators = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
        if not any(d.startswith(("pytest.fixture", "fixture")) for d in decorators):
            out.append(node.name)
    return out


def test_the_checks_see_what_they_forbid() -> None:
    bad = (
        "from aml_pipeline_tests.tsdb.conftest import with_schema\n"
        "from aml_pipeline_tests.components import test_webserver\n"
        "def f():\n    import aml_pipeline_tests.pipeline.test_cross_adapter as t\n"
    )
    assert len(layout_violations("bench/x.py", bad)) == 3
    assert layout_violations("aml_pipeline/x.py", "from bench.timing import side_by_side\n")
    assert not layout_violations("bench/x.py", "from aml_pipeline_tests.tsdb.series import fetch_node_series\n")
    assert conftest_helpers(
        "import pytest\n@pytest.fixture\ndef a(): ...\n@pytest.fixture(scope='session')\ndef b(): ...\n"
        "def _private(): ...\ndef pytest_configure(config): ...\ndef helper(): ...\nclass Made: ...\n"
    ) == ["helper", "Made"]


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    files = python_files()
    assert any(p.parent.name == "bench" for p in files) and any(p.name == "conftest.py" for p in files)
    problems = [v for p in files for v in layout_violations(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_conftest_files_hold_fixtures_only() -> None:
    conftests = [p for p in python_files() if p.name == "conftest.py"]
    assert conftests
    problems = [f"{p.relative_to(ROOT)}: {name} is not a fixture; move it to a support module"
                for p in conftests for name in conftest_helpers(p.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)
