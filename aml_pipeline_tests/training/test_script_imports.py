"""The baseline script runs in the shared environment: it imports only what that environment
has, and its code version (RIDGE_BASELINE_FILES) covers every file it loads."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap

from aml_pipeline.training import RIDGE_BASELINE_FILES, RIDGE_BASELINE_SCRIPT, TRAINING_DIR

SHARED_ENV_PACKAGES = {"numpy", "dagster_pipes"}


def test_training_code_imports_only_what_the_shared_environment_has():
    for path in RIDGE_BASELINE_FILES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # a sibling module of the same package: itself in RIDGE_BASELINE_FILES
                    sibling = path.parent / f"{node.module}.py"
                    assert node.module is None or sibling in RIDGE_BASELINE_FILES, f"{path.name} imports .{node.module}"
                    continue
                names = [(node.module or "").split(".")[0]]
            else:
                continue
            for name in names:
                if name == "aml_pipeline":  # only the reader, and only when run inside the project
                    assert path == RIDGE_BASELINE_SCRIPT, f"{path.name} imports aml_pipeline"
                    continue
                assert name in sys.stdlib_module_names or name in SHARED_ENV_PACKAGES, f"{path.name} imports {name}"


def test_the_script_loads_exactly_the_files_of_its_code_version():
    """Run as the shared environment runs it (a script, -E -s), the baseline loads the reader
    from its files, without the aml_pipeline package, and nothing outside RIDGE_BASELINE_FILES."""
    probe = textwrap.dedent(f"""
        import json, runpy, sys
        runpy.run_path({str(RIDGE_BASELINE_SCRIPT)!r}, run_name="probe")
        files = sorted({{getattr(m, "__file__", None) or "" for m in list(sys.modules.values())}})
        print(json.dumps({{"files": [f for f in files if f.startswith({str(TRAINING_DIR.parent) + "/"!r})],
                           "modules": sorted(m for m in sys.modules if m.startswith("aml_pipeline"))}}))
    """)
    proc = subprocess.run([sys.executable, "-E", "-s", "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(loaded["files"]) == sorted(str(p) for p in RIDGE_BASELINE_FILES if p != RIDGE_BASELINE_SCRIPT)
    assert "aml_pipeline" not in loaded["modules"]  # the project package itself is not needed
