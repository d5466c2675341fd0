#!/usr/bin/env bash
# The benchmark: set up, install the benchmark-only packages (CPU torch, PyTorch Forecasting,
# numba, pyinstrument; see bench/README.md for why --no-deps), run bench/run.py with the given
# arguments.
#   scripts/bench.sh --json bench.json     # full run (20 to 30 min)
#   scripts/bench.sh --quick               # a few minutes (CI runs bench/run.py --quick without these packages)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
if ! .venv/bin/python -c "import pytorch_forecasting, numba, pyinstrument" 2>/dev/null; then
  .venv/bin/pip install --quiet torch==2.13.0
  .venv/bin/pip install --quiet -c requirements/constraints.txt lightning==2.6.6 scikit-learn==1.9.1 \
    scikit-base==1.0.2 scipy==1.17.1 pyinstrument==5.1.3 numba==0.68.1
  .venv/bin/pip install --quiet --no-deps pytorch-forecasting==1.8.0
fi
exec .venv/bin/python bench/run.py "$@"
