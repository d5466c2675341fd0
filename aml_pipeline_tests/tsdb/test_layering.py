"""The tsdb package never imports the mapped sources: they are built on it (its read base), and a
URL that may name either is opened above both (:mod:`aml_pipeline.tsdb_open`)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import aml_pipeline.tsdb

TSDB_DIR = Path(aml_pipeline.tsdb.__file__).parent
# Modules above tsdb/ that import sources/: importing one from tsdb/ is the same arrow.
ABOVE = ("aml_pipeline.sources", "aml_pipeline.tsdb_open")


def package_of(path: Path) -> str:
    return "aml_pipeline.tsdb" + "".join(f".{p}" for p in path.relative_to(TSDB_DIR).parent.parts)


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module ``path`` (a module of ``package``) imports, anywhere in it (functions too),
    with its line: import statements (relative ones resolved) and ``import_module`` /
    ``__import__`` of a literal name."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def is_above(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in ABOVE)


def test_no_module_under_tsdb_imports_sources() -> None:
    files = sorted(TSDB_DIR.rglob("*.py"))
    assert TSDB_DIR / "reading.py" in files and TSDB_DIR / "__init__.py" in files
    upward = [f"{f.relative_to(TSDB_DIR.parent)}:{line}: imports {m}"
              for f in files for line, m in imported_modules(f, package_of(f)) if is_above(m)]
    assert not upward, "\n".join(upward)


def test_the_check_sees_every_way_of_importing(tmp_path: Path) -> None:
    """The scan above finds an import however it is written (so that its silence means something)."""
    probe = tmp_path / "probe.py"  # as if it were a module of aml_pipeline.tsdb
    probe.write_text(
        "import importlib\n"
        "from aml_pipeline.sources import open_source\n"
        "def f():\n"
        "    from ..sources.mapped import MappedTsdb\n"
        "    import aml_pipeline.tsdb_open\n"
        "    return importlib.import_module('aml_pipeline.sources.lake')\n"
    )
    got = [m for _, m in imported_modules(probe, "aml_pipeline.tsdb") if is_above(m)]
    assert "aml_pipeline.sources" in got and "aml_pipeline.sources.mapped" in got
    assert "aml_pipeline.tsdb_open" in got and "aml_pipeline.sources.lake" in got


def test_importing_every_tsdb_module_leaves_sources_unloaded() -> None:
    """Indirect arrows too (tsdb -> something -> sources), in a fresh interpreter."""
    names = sorted(m.name for m in pkgutil.walk_packages(aml_pipeline.tsdb.__path__, prefix="aml_pipeline.tsdb."))
    assert "aml_pipeline.tsdb.reading" in names
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.startswith({ABOVE!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
