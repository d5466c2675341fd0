"""The Dagster build against the library-only build of the same workload.

Dagster: ``aml_pipeline.defs.inprocess.materialize_dataset`` on an ephemeral instance created
beforehand (untimed, as a deployment's instance exists before a backfill) - in one run, the
run partitions as a single-run backfill (``raw_node_series`` -> ``cleaned_grid`` ->
``run_windows`` over all runs in one step each), then ``dataset_split``,
``normalization_stats`` and ``dataset_manifest`` with its blocking checks. Library:
``aml_pipeline.pipeline.build.build_dataset``. The two alternate, ``repeat`` times each, into
fresh directories; the best of each is compared. A v1 snapshot is byte-identical however it is
built, so both must publish the same sha256.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from bench.build_bench import e2e_build
from bench.common import fresh_dir


def run(spec_dict: dict[str, Any], tsdb_url: str, out: Path, *, repeat: int) -> dict[str, Any]:
    import dagster as dg

    from aml_pipeline.defs.inprocess import materialize_dataset
    from aml_pipeline.spec import parse_spec

    logging.getLogger("dagster").setLevel(logging.WARNING)
    spec = parse_spec(spec_dict)
    dagster_times, library_times, hashes = [], [], set()
    summary: dict[str, Any] = {}
    for i in range(repeat):
        home = fresh_dir(out / f"dagster{i}")
        # The instance exists before a materialisation (a deployment's instance, or the CLI's,
        # opened once); creating an in-memory one (~0.5 s of schema migrations) is not timed.
        with dg.DagsterInstance.ephemeral() as instance:
            t0 = time.perf_counter()
            summary = materialize_dataset(
                spec, tsdb_url=tsdb_url, home=home, datasets_dir=home / "datasets",
                instance=instance, console_log_level="CRITICAL",
            )
            dagster_times.append(time.perf_counter() - t0)
        hashes.add(summary["sha256"])
        fresh_dir(home)  # free the disk before the next build
        lib = e2e_build(spec_dict, tsdb_url, out / f"library{i}")
        library_times.append(lib["seconds"])
        hashes.add(lib["sha256"])
        fresh_dir(out / f"library{i}")
    best_d, best_l = min(dagster_times), min(library_times)
    return {
        "dagster_seconds": best_d,
        "library_seconds": best_l,
        "dagster_all": dagster_times,
        "library_all": library_times,
        "ratio": best_d / best_l,
        "same_sha256": len(hashes) == 1,
        "checks": summary.get("checks"),
        "current": summary.get("current"),
    }
