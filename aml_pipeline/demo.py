"""The demo: seed the simulated plant into the TSDB (the embedded file unless ``AML_TSDB_URL`` names
another), build the example spec through Dagster.

It says what it does on stderr: what it seeded (or re-seeded, when ``--runs`` asks for another
number of runs than the demo's own TSDB file holds), which runs the dataset takes and why the
others are left out, what the lineage flag will say, and what to do next.
"""

from __future__ import annotations

import importlib.resources
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aml_pipeline import config
from aml_pipeline.errors import AmlError
from aml_pipeline.spec import DatasetSpec, load_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.urls import redact_url

# The example spec over the simulated plant, shipped with the package (the repository's
# specs/reactor_a.yaml is a link to it).
DEMO_SPEC = Path(str(importlib.resources.files("aml_pipeline.simulate").joinpath("reactor_a.yaml")))

Say = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


@dataclass(frozen=True)
class Seeding:
    """What :func:`seed_demo` did: ``written`` points; ``replaced`` runs of an earlier demo."""

    runs: int
    written: int
    replaced: int = 0


def _demo_run_ids(n: int) -> set[str]:
    from aml_pipeline.simulate.plant import simulate_plant

    return {r.run_id for r in simulate_plant(n_runs=n, run_minutes=0.1, noise=False).runs}


def seed_demo(tsdb_url: str, *, runs: int, seed: int = 0, own_file: Path | None = None) -> Seeding:
    """Make the TSDB hold exactly the simulated plant of ``runs`` runs.

    Idempotent: a TSDB that already holds it is left alone. One that holds another demo seeding
    (the demo's runs for another ``--runs``) is re-seeded, but only if it is the demo's own
    embedded file ``own_file``: the plant is written into a new file beside it, which then
    replaces it in one rename. Anything else is an error (the demo never touches other data).
    """
    from aml_pipeline.simulate.plant import simulate_plant

    if runs < 1:
        raise AmlError(f"--runs {runs}: the demo needs at least one run", code="DEMO_RUNS_INVALID")
    plant = simulate_plant(n_runs=runs, seed=seed)
    wanted = {r.run_id for r in plant.runs}
    with open_tsdb(tsdb_url, read_only=False) as db:
        have = {r.run_id for r in db.list_runs(None, finished_only=False)}
        if have == wanted:
            return Seeding(runs, 0)
        if not have:
            return Seeding(runs, db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points))
    earlier_demo = have == _demo_run_ids(len(have))
    if own_file is None or not earlier_demo:
        what = f"{len(have)} runs of an earlier demo" if earlier_demo else f"{len(have)} runs that are not the demo's"
        raise AmlError(
            f"{redact_url(tsdb_url)} holds {what}; the demo re-seeds only its own embedded file "
            f"(AML_TSDB_URL unset): use a fresh AML_HOME, or remove that TSDB",
            code="DEMO_TSDB_IN_USE",
        )
    fresh = own_file.with_name(f".{own_file.name}.seeding-{os.getpid()}")
    for stale in (fresh, fresh.with_name(fresh.name + ".wal")):
        stale.unlink(missing_ok=True)
    try:
        with open_tsdb(f"duckdb://{fresh}", read_only=False) as db:
            written = db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
        os.replace(fresh, own_file)
    finally:
        fresh.unlink(missing_ok=True)
    own_file.with_name(own_file.name + ".wal").unlink(missing_ok=True)  # the replaced file's
    return Seeding(runs, written, replaced=len(have))


def explain_scope(spec: DatasetSpec, tsdb_url: str, say: Say) -> None:
    """Which runs of the TSDB the dataset takes and why the others are not in it."""
    from aml_pipeline.pipeline.plan import run_scope

    scope = run_scope(spec)
    with open_tsdb(tsdb_url) as db:
        runs = db.list_runs(None, finished_only=False)
    in_scope = [r for r in runs if scope.admits(r)]
    finished = [r for r in in_scope if r.finished]
    running = [r.run_id for r in in_scope if not r.finished]
    say(f"{len(runs)} runs in the TSDB; {len(finished)} finished runs in the scope of {spec.id} {scope} are built")
    if running:
        say(f"  {', '.join(running)} {'is' if len(running) == 1 else 'are'} still running (the simulated plant keeps its "
            "last run in progress): a run joins the dataset once it has ended")
    if len(in_scope) < len(runs):
        say(f"  {len(runs) - len(in_scope)} runs are outside the spec's line, product, recipe or time window")
    if spec.extras is not None:
        unknown = [r.run_id for r in finished if not r.context_confirmed]
        if unknown:
            say(f"  lineage: {', '.join(unknown)} {'has' if len(unknown) == 1 else 'have'} no confirmed context, so "
                "lineageVerified will be 0 (see docs/lineage.md)")


def _when(version: str) -> str:
    """A watermark data version (epoch ms) as UTC time."""
    import datetime as _dt

    if not version.isdigit():
        return version
    return f"{_dt.datetime.fromtimestamp(int(version) / 1000, tz=_dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC ({version})"


def demo_spec(home: Path) -> Path:
    """The spec the demo builds: the repository's ``specs/reactor_a.yaml`` when run from its
    checkout; for an installed package, a copy of the packaged example in ``<home>/specs`` (made
    once: an edited copy is what the next demo builds), so a user has a spec file to open, edit
    and point a Dagster project at. Either is in :func:`config.default_specs_dir`, the folder
    ``gc`` reads when ``AML_SPECS`` is unset."""
    target = config.default_specs_dir(home) / DEMO_SPEC.name
    if config.repository_checkout() is None and not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.copyfile(DEMO_SPEC, partial)
        os.replace(partial, target)
    return target


def next_steps(summary: dict[str, Any], spec_path: Path, home: Path) -> str:
    """What to do next, with the commands the user has: the repository's scripts from its
    checkout, ``aml-pipeline`` and ``dg dev`` in a Dagster project for an installed package."""
    spec_id, snapshot = summary["specId"], summary["snapshotDir"]
    root = "" if home == config.aml_home() else f" --root {home / 'datasets'}"
    if config.repository_checkout() is not None:
        return "\n".join([
            "next:",
            f"  scripts/ui.sh    the Dagster UI on http://127.0.0.1:3000: asset group {spec_id}, "
            "its run partitions, plots, checks and lineage",
            f"  .venv/bin/aml-pipeline verify {snapshot}",
            f"  .venv/bin/aml-pipeline baseline {spec_path}{root}    (ridge baseline vs persistence on this snapshot)",
            "  docs/snapshot.md    what the snapshot's files hold",
        ])
    return "\n".join([
        "next:",
        f"  aml-pipeline verify {snapshot}",
        f"  aml-pipeline baseline {spec_path}{root}    (ridge baseline vs persistence on this snapshot)",
        f"  dg dev    the Dagster UI, from your Dagster project with an AmlSpecFolder whose path is {spec_path.parent} "
        f"and AML_HOME={home} (docs/dagster.md, \"Trial data\"): asset group {spec_id}, its runs, plots and checks",
    ])


def run_demo(
    *,
    home: Path,
    spec_path: Path | None,
    runs: int,
    instance=None,
    console_log_level: str = "INFO",
    say: Say = _stderr,
) -> dict[str, Any]:
    from aml_pipeline.runner.build import materialize_dataset

    home.mkdir(parents=True, exist_ok=True)
    configured = os.environ.get("AML_TSDB_URL")
    url = configured or config.default_tsdb_url(home)
    own_file = None if configured else home / "tsdb.duckdb"
    say(f"seeding the simulated plant ({runs} runs) into {redact_url(url)}")
    seeding = seed_demo(url, runs=runs, own_file=own_file)
    if seeding.replaced:
        say(f"  it held the {seeding.replaced} runs of an earlier demo: re-seeded with {runs} runs "
            f"({seeding.written} points)")
    else:
        say(f"  {seeding.written} points ingested" if seeding.written else f"  already seeded with these {runs} runs")
    if instance is not None:
        from aml_pipeline.components.sources import observe_tsdb

        version = observe_tsdb(instance, url, console_log_level=console_log_level)
        say(f"observed tsdb/points in the Dagster instance: watermark {_when(version)}")
    spec = load_spec(spec_path or demo_spec(home))
    explain_scope(spec, url, say)
    summary = materialize_dataset(spec, tsdb_url=url, home=home, instance=instance, console_log_level=console_log_level)
    explain_empty_splits(spec, summary, say)
    return summary


def explain_empty_splits(spec: DatasetSpec, summary: dict[str, Any], say: Say) -> None:
    """Why a split got no runs (the split rule), and how many demo runs would give it one."""
    from aml_pipeline.pipeline.stages.split import empty_splits, runs_for_every_split

    why = empty_splits(spec, summary["runs"])
    if why is not None:
        say(f"  {why}")
        if spec.split.method == "chronological":
            need = runs_for_every_split(spec)
            say(f"  --runs {need + 1} seeds {need} finished runs (the simulated plant keeps its last run in progress)")
