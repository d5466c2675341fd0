"""Code that runs *inside* the shared environment (DESIGN.md section 6).

The modules here import only the standard library, numpy and dagster_pipes (what
``requirements/shared-env.txt`` pins) and each other as siblings, never ``aml_pipeline``: they
are launched as scripts by the shared environment's interpreter (``-E -s``, so the project
environment is not on their path). This ``__init__`` only lets the project locate them.
"""

from pathlib import Path

TRAINING_DIR = Path(__file__).resolve().parent
RIDGE_BASELINE_SCRIPT = TRAINING_DIR / "ridge_baseline.py"
# Files whose content defines what the baseline computes (its code version).
RIDGE_BASELINE_FILES = (RIDGE_BASELINE_SCRIPT, TRAINING_DIR / "snapshot_reader.py")

__all__ = ["RIDGE_BASELINE_FILES", "RIDGE_BASELINE_SCRIPT", "TRAINING_DIR"]
