"""Code that runs *inside* the shared environment (docs/design.md).

The scripts here import only the standard library, numpy and dagster_pipes (what
``requirements/shared-env.txt`` pins) and the snapshot reader ``aml_pipeline/snapshot`` (numpy and
the standard library), never the rest of ``aml_pipeline``: they are launched as scripts by the
shared environment's interpreter (``-E -s``, so the project environment is not on their path) and
load the reader from its files. This ``__init__`` only lets the project locate them.
"""

from pathlib import Path

TRAINING_DIR = Path(__file__).resolve().parent
SNAPSHOT_DIR = TRAINING_DIR.parent / "snapshot"
RIDGE_BASELINE_SCRIPT = TRAINING_DIR / "ridge_baseline.py"
# Files whose content defines what the baseline computes (its code version): the script and
# every module of the reader it loads (a test checks this list against what it really loads).
RIDGE_BASELINE_FILES = (
    RIDGE_BASELINE_SCRIPT,
    *(SNAPSHOT_DIR / name for name in ("__init__.py", "batches.py", "layout.py", "reader.py", "series.py", "verify.py")),
)

__all__ = ["RIDGE_BASELINE_FILES", "RIDGE_BASELINE_SCRIPT", "SNAPSHOT_DIR", "TRAINING_DIR"]
