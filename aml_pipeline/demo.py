"""The demo: seed the simulated plant into the embedded TSDB, build the example spec through Dagster."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from aml_pipeline import config
from aml_pipeline.spec import load_spec
from aml_pipeline.errors import AmlError
from aml_pipeline.tsdb import open_tsdb, printable_url

DEMO_SPEC = config.REPO_ROOT / "specs" / "reactor_a.yaml"


def seed_plant(tsdb_url: str, *, runs: int, seed: int = 0) -> int:
    """Ingest the simulated plant unless its runs are already there (seeding is idempotent)."""
    from aml_pipeline.simulate.plant import simulate_plant

    plant = simulate_plant(n_runs=runs, seed=seed)
    with open_tsdb(tsdb_url, read_only=False) as db:
        have = {r.run_id for r in db.list_runs(None, finished_only=False)}
        wanted = {r.run_id for r in plant.runs}
        if wanted <= have:
            return 0
        if have & wanted:
            # A partly seeded file (interrupted demo): appending would duplicate points.
            raise AmlError(
                f"{db.url} holds some but not all demo runs; remove it and run the demo again",
                code="DEMO_PARTLY_SEEDED",
            )
        return db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)


def run_demo(
    *, home: Path, spec_path: Path | None, runs: int, instance=None, console_log_level: str = "INFO"
) -> dict[str, Any]:
    from aml_pipeline.defs.inprocess import materialize_dataset

    home.mkdir(parents=True, exist_ok=True)
    url = os.environ.get("AML_TSDB_URL") or config.default_tsdb_url(home)
    print(f"seeding the simulated plant ({runs} runs) into {printable_url(url)}", file=sys.stderr)
    written = seed_plant(url, runs=runs)
    print(f"  {written} points ingested" if written else "  already seeded", file=sys.stderr)
    spec = load_spec(spec_path or DEMO_SPEC)
    return materialize_dataset(
        spec,
        tsdb_url=url,
        home=home,
        instance=instance,
        console_log_level=console_log_level,
    )
