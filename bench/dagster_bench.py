"""The Dagster build against the library-only build of the same workload.

Dagster: ``aml_pipeline.runner.build.materialize_dataset`` (what ``aml-pipeline build`` runs)
with its default executor, recording into a persistent SQLite instance: a temporary
``DAGSTER_HOME`` with a ``dagster.yaml`` (:func:`persistent_instance`), created and opened
before the clock, as a deployment's instance exists before a build. One fresh instance per
repetition, so every repetition does the same work. Library:
``aml_pipeline_tests.library_build.build_dataset``. The two alternate (``bench.timing.side_by_side``)
into fresh directories; both must publish the same sha256 (a v1 snapshot is byte-identical
however it is built).

Where the time goes: with pyinstrument installed, one more Dagster build (not counted in the
ratio) is profiled, and its samples are attributed (:func:`attribute_profile`) to our library
stages, our plots (each run's and the dataset's overview), our Dagster wiring (asset bodies,
metadata) and Dagster itself (everything else the run does, including its SQLite writes).
Another build (:func:`event_costs`) times what the instance's event log takes to store each
event, per kind of event.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

from bench.build_bench import e2e_build
from bench.common import fresh_dir, remove_tree, settle
from bench.timing import Sample, side_by_side, summarize

INSTANCE_YAML = """\
# A deployment-like instance for the benchmark: default (SQLite) storage under this directory.
telemetry:
  enabled: false
concurrency:
  pools:
    default_limit: 1
"""


# The deployment's instance storage (deploy/dagster.yaml): runs, event log and schedules in one
# PostgreSQL database, through psycopg2 as there.
PG_STORAGE_YAML = """\
storage:
  postgres:
    postgres_url: "{url}"
"""


@contextlib.contextmanager
def persistent_instance(home: Path, pg_url: str | None = None) -> Iterator[Any]:
    """A persistent instance in ``home`` (created, schema initialised), disposed on exit: SQLite
    files in ``home``, or with ``pg_url`` (:func:`fresh_pg_database`) PostgreSQL storage."""
    import dagster as dg

    fresh_dir(home)
    (home / "dagster.yaml").write_text(INSTANCE_YAML + (PG_STORAGE_YAML.format(url=pg_url) if pg_url else ""))
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        instance.get_run_records(limit=1)  # opens the run and event-log storages (schema already migrated)
        yield instance
    finally:
        instance.dispose()


def fresh_pg_database(base_url: str, name: str) -> str:
    """An empty database ``name`` on the server of ``base_url`` (dropped first if it exists); its
    URL for Dagster's PostgreSQL storage."""
    from urllib.parse import urlsplit, urlunsplit

    import psycopg
    from psycopg import sql

    with psycopg.connect(base_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(scheme="postgresql+psycopg2", path=f"/{name}", query=""))


def fresh_instance_url(base_url: str, name: str, pooled_url: str | None = None) -> str:
    """:func:`fresh_pg_database` ``name`` on the server of ``base_url``; with ``pooled_url`` (a
    PgBouncer in front of that server), its URL through the pooler."""
    url = fresh_pg_database(base_url, name)
    if pooled_url is None:
        return url
    from aml_pipeline_tests.pgbouncer import with_port

    return with_port(url, urlsplit(pooled_url).port)


def instance_urls(pg_base_url: str | None, pg_pooled_url: str | None, name: str) -> dict[str, Callable[[], str | None]]:
    """The instances a Dagster figure is measured on, each with a maker of a fresh instance's
    PostgreSQL URL (:func:`fresh_instance_url`, database ``name``; None: SQLite files): ``sqlite``;
    ``pg`` with ``pg_base_url``; ``pg_pooled`` with ``pg_pooled_url`` (a PgBouncer in front of it) too."""
    urls: dict[str, Callable[[], str | None]] = {"sqlite": lambda: None}
    if pg_base_url:
        database = f"{name}_{os.getpid()}"
        urls["pg"] = lambda: fresh_instance_url(pg_base_url, database)
        if pg_pooled_url:
            urls["pg_pooled"] = lambda: fresh_instance_url(pg_base_url, database, pg_pooled_url)
    return urls


def materialize(spec_dict: dict[str, Any], tsdb_url: str, out: Path, instance: Any, **kwargs: Any) -> dict[str, Any]:
    from aml_pipeline.runner.build import materialize_dataset
    from aml_pipeline.spec import parse_spec

    return materialize_dataset(
        parse_spec(spec_dict), tsdb_url=tsdb_url, home=out, datasets_dir=out / "datasets",
        instance=instance, console_log_level="CRITICAL", **kwargs,
    )


def run(spec_dict: dict[str, Any], tsdb_url: str, out: Path, *, repeat: int, profile: bool,
        pg_base_url: str | None = None, pg_pooled_url: str | None = None, floor_runs: int = 0) -> dict[str, Any]:
    """Dagster (SQLite instance) against the library; with ``pg_base_url``, also Dagster on a
    PostgreSQL instance (a fresh database per repetition on that server); with ``pg_pooled_url``
    (a PgBouncer in front of that server), also Dagster on that instance through the pooler.

    With ``floor_runs``, each Dagster side is followed in the alternation by Dagster's floor on
    the same kind of instance (:func:`_floor_recorder` of ``floor_runs`` run partitions, sides ``floor``, ``floor_pg``, ``floor_pg_pooled``), so that the build and its
    floor run seconds apart under the same load."""
    logging.getLogger("dagster").setLevel(logging.WARNING)
    stack = contextlib.ExitStack()
    hashes: set[str] = set()
    state: dict[str, Any] = {}
    floor = _floor_recorder(floor_runs) if floor_runs else None

    def prepare(side: str, i: int) -> None:
        stack.close()
        if side.startswith("floor"):
            pg_url = (fresh_instance_url(pg_base_url, "aml_bench_floor", pg_pooled_url if side == "floor_pg_pooled" else None)
                      if side != "floor" else None)
            state["instance"] = stack.enter_context(persistent_instance(out / "floor-instance", pg_url))
            return
        if side == "dagster":
            state["instance"] = stack.enter_context(persistent_instance(out / "instance"))
        elif side in ("dagster_pg", "dagster_pg_pooled"):
            pg_url = fresh_instance_url(pg_base_url, f"aml_bench_instance_{os.getpid()}",
                                        pg_pooled_url if side == "dagster_pg_pooled" else None)
            state["instance"] = stack.enter_context(persistent_instance(out / "instance", pg_url))
        settle(out / "build")
        (out / "build").mkdir(parents=True)

    def dagster() -> dict[str, Any]:
        s = materialize(spec_dict, tsdb_url, out / "build", state["instance"])
        hashes.add(s["sha256"])
        return s

    def library() -> dict[str, Any]:
        lib = e2e_build(spec_dict, tsdb_url, out / "build")
        hashes.add(lib["sha256"])
        return lib["summary"]

    def floor_side() -> None:
        floor(state["instance"])

    sides: dict[str, Callable[[], Any]] = {"dagster": dagster}
    if floor:
        sides["floor"] = floor_side
    if pg_base_url:
        sides["dagster_pg"] = dagster
        if floor:
            sides["floor_pg"] = floor_side
    if pg_pooled_url:
        sides["dagster_pg_pooled"] = dagster
        if floor:
            sides["floor_pg_pooled"] = floor_side
    sides["library"] = library
    try:
        cmp = side_by_side(sides, repeat=repeat, prepare=prepare)
    finally:
        stack.close()
    summary = cmp.values["dagster"]
    if floor:
        remove_tree(out / "floor-instance")
    result: dict[str, Any] = {
        "instance": "persistent SQLite (DagsterInstance.from_config of a temporary DAGSTER_HOME), one per repetition",
        "executor": "materialize_dataset's default (one worker: the steps run in this process)",
        "timings": cmp.to_json(),
        "ratio": cmp.ratio("dagster", "library"),
        "difference": cmp.difference("dagster", "library"),
        "same_sha256": len(hashes) == 1,
        "checks": summary.get("checks"),
        "current": summary.get("current"),
    }
    if pg_base_url:
        result.update(
            instance_pg="PostgreSQL storage as in deploy/dagster.yaml, a fresh database per repetition",
            ratio_pg=cmp.ratio("dagster_pg", "library"),
            difference_pg=cmp.difference("dagster_pg", "library"),
        )
    if floor:
        result["comparison"] = cmp
    if pg_pooled_url:
        result.update(
            instance_pg_pooled="the same PostgreSQL storage through PgBouncer (session pooling, docs/deployment.md)",
            ratio_pg_pooled=cmp.ratio("dagster_pg_pooled", "library"),
            difference_pg_pooled=cmp.difference("dagster_pg_pooled", "library"),
        )
    if profile:
        result["profile"] = _profile(spec_dict, tsdb_url, out)
        result["events"] = event_costs(spec_dict, tsdb_url, out)
    remove_tree(out)
    return result


def run_orchestration(spec_dict: dict[str, Any], tsdb_url: str, runs: int, out: Path, *, repeat: int,
                      pg_base_url: str | None = None, pg_pooled_url: str | None = None) -> dict[str, Any]:
    """The orchestration cost: (Dagster build - library build) / runs, many small runs, on
    a persistent SQLite instance and (with ``pg_base_url``) on a PostgreSQL one, directly and
    (with ``pg_pooled_url``) through PgBouncer."""
    from aml_pipeline.config import backfill_runs_per_chunk

    r = run(spec_dict, tsdb_url, out, repeat=repeat, profile=False, pg_base_url=pg_base_url,
            pg_pooled_url=pg_pooled_url, floor_runs=runs)
    cmp = r.pop("comparison")

    def per_run(diff: dict[str, Any]) -> dict[str, Any]:
        return {k: (v * 1000 / runs if k in ("value", "min", "max") else v) for k, v in diff.items() if k != "paired"}

    out_ = {
        "runs": runs,
        "timings": r["timings"],
        "ms_per_run": per_run(r["difference"]),
        "ratio": r["ratio"],
        "same_sha256": r["same_sha256"],
        "current": r["current"],
    }
    if pg_base_url:
        out_.update(ms_per_run_pg=per_run(r["difference_pg"]), ratio_pg=r["ratio_pg"], instance_pg=r["instance_pg"])
    if pg_pooled_url:
        out_.update(ms_per_run_pg_pooled=per_run(r["difference_pg_pooled"]), ratio_pg_pooled=r["ratio_pg_pooled"],
                    instance_pg_pooled=r["instance_pg_pooled"])
    # Dagster's floor per instance, and what the product adds over it, paired by repetition:
    # (build - library - floor) / runs.
    instances = {"sqlite": ""} | ({"pg": "_pg"} if pg_base_url else {}) | ({"pg_pooled": "_pg_pooled"} if pg_pooled_url else {})
    lib = cmp.seconds["library"]
    out_["floor"] = {
        "runs": runs, "chunk_runs": backfill_runs_per_chunk(),
        "ms_per_run": {name: summarize([s * 1000 / runs for s in cmp.seconds[f"floor{sfx}"]]) for name, sfx in instances.items()},
    }
    for name, sfx in instances.items():
        paired = [(d - l - f) * 1000 / runs for d, l, f in zip(cmp.seconds[f"dagster{sfx}"], lib, cmp.seconds[f"floor{sfx}"])]
        s_ = summarize(paired)
        out_[f"product_over_floor_ms_per_run{sfx}"] = {"value": s_["median"], "min": s_["min"], "max": s_["max"],
                                                       "repeat": s_["repeat"]}
    return out_


# How a run's figures reach the instance: "none" (the floor), "metadata" (add_asset_metadata
# per run partition, onto the materialisation of its last stage, after Dagster's partition check),
# "observation" (one AssetObservation per run partition after the materialisations, all three
# stages' figures on the last), "stage_observations" (each stage's figures as an observation of its
# own asset's partition, three a run) or "stage_metadata" (what the build does: each stage's
# figures on its own asset's materialisation of the partition, without the partition check,
# dagster_internals.add_partition_metadata).
FIGURE_MODES = ("none", "metadata", "observation", "stage_observations", "stage_metadata")


def _run_figures_sample() -> list[dict[str, Any]]:
    """A run's figures per run stage as the build attaches them, without the plot (whose bytes are
    the same either way): counts, the per-node table, the run's path."""
    import dagster as dg

    nodes = [dg.TableRecord({"node": f"node_{i}", "points": 5_400, "pages": 1}) for i in range(6)]
    schema = dg.TableSchema(columns=[dg.TableColumn("node", "string"), dg.TableColumn("points", "int"),
                                     dg.TableColumn("pages", "int")])
    return [
        {"points": 32_400, "pages": 6, "per_node": dg.MetadataValue.table(nodes, schema=schema),
         "path": dg.MetadataValue.path("/data/aml/datasets/spec/runs/run")},
        {"grid_rows": 5_400, "points_kept": 32_310, "points_removed": 90, "max_missing_ratio": 0.004,
         "worst_missing_node": "node_3 (0.4%)"},
        {"windows": 170, "reason": "", "grid_rows": 5_400},
    ]


def _run_stages_job(spec_id: str, *, figures: str) -> tuple[Any, Any, Any]:
    """The build's asset shape with a body that does no work: the three run assets of one
    multi-asset step with its two checks and the ``aml_tsdb`` pool, over the spec's run
    partitions, run as the ``<spec>__runs`` job; each run's figures attached as ``figures`` says
    (:data:`FIGURE_MODES`). Returns the partitions, the job and the asset carrying the figures."""
    import dagster as dg

    from aml_pipeline.components.dagster_internals import add_partition_metadata
    from aml_pipeline.components.partitions import run_backfill_policy, run_partitions
    from aml_pipeline.pipeline.registry import RUN_ASSETS

    if figures not in FIGURE_MODES:
        raise ValueError(f"figures must be one of {FIGURE_MODES}, got {figures!r}")
    partitions = run_partitions(spec_id)
    specs = [dg.AssetSpec([spec_id, n], partitions_def=partitions) for n in RUN_ASSETS]
    carrier = specs[-1].key
    checks = [dg.AssetCheckSpec(name, asset=carrier) for name in ("has_windows", "missing_ratio_below_threshold")]
    per_stage = _run_figures_sample()
    sample = {k: v for figures in per_stage for k, v in figures.items()}

    @dg.multi_asset(name=f"{spec_id}__run_stages", specs=specs, check_specs=checks,
                    backfill_policy=run_backfill_policy(), pool="aml_tsdb")
    def run_stages(context):  # noqa: ANN001 - Dagster passes the asset context
        for run_id in context.partition_keys if figures == "metadata" else ():
            context.add_asset_metadata(sample, asset_key=carrier, partition_key=run_id)
        for run_id in context.partition_keys if figures == "stage_metadata" else ():
            for spec, stage_figures in zip(specs, per_stage, strict=True):
                add_partition_metadata(context, spec.key, run_id, stage_figures)
        for spec in specs:
            yield dg.MaterializeResult(asset_key=spec.key, check_results=[
                dg.AssetCheckResult(asset_key=spec.key, check_name=c.name, passed=True) for c in checks
            ] if spec.key == carrier else None)
        for run_id in context.partition_keys if figures == "observation" else ():
            yield dg.AssetObservation(asset_key=carrier, partition=run_id, metadata=sample)
        for run_id in context.partition_keys if figures == "stage_observations" else ():
            for spec, stage_figures in zip(specs, per_stage, strict=True):
                yield dg.AssetObservation(asset_key=spec.key, partition=run_id, metadata=stage_figures)

    job = dg.Definitions(assets=[run_stages], jobs=[dg.define_asset_job(f"{spec_id}__runs")]).resolve_job_def(
        f"{spec_id}__runs")
    return partitions, job, carrier


def _record_in_chunks(job: Any, instance: Any, keys: list[str], chunk_runs: int, what: str) -> None:
    """``job`` over ``keys`` in chunks of ``chunk_runs`` run partitions, one Dagster run each, with
    the build's run tags (its event settings are the caller's)."""
    from aml_pipeline.runner.instance import build_tags
    from aml_pipeline.components.partitions import range_tags

    run_config = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
    for start in range(0, len(keys), chunk_runs):
        chunk = keys[start:start + chunk_runs]
        result = job.execute_in_process(instance=instance, run_config=run_config,
                                        tags={**build_tags(), **range_tags(chunk)})
        if not result.success:
            raise RuntimeError(f"{what}: the chunk run {result.run_id} failed")


def _floor_recorder(runs: int) -> Callable[[Any], None]:
    """Records ``runs`` run partitions in the build's asset shape with no work into the instance it
    is given, with the build's event settings; fails unless every partition is recorded: Dagster's
    own cost of recording them, the orchestration part's floor.

    The shape is the build's: the three run assets of one multi-asset step with its two checks and
    the ``aml_tsdb`` pool, run partitions of one spec (added first, as the build syncs them), one
    Dagster run per chunk of ``AML_BACKFILL_RUNS_PER_CHUNK`` runs over a partition range, with the
    build's run tags and event settings. The body only yields the three results and the two
    check results, no per-run figures. What the build's ``ms_per_run`` adds on top of this floor
    is the product's own orchestration cost (the per-run figures and the plots)."""
    from aml_pipeline.components.dagster_internals import build_event_settings, materialized_partitions
    from aml_pipeline.config import backfill_runs_per_chunk

    partitions, job, carrier = _run_stages_job("floor", figures="none")
    keys = [f"run-{i:06d}" for i in range(runs)]

    def record(instance: Any) -> None:
        with build_event_settings():
            instance.add_dynamic_partitions(partitions.name, keys)
            _record_in_chunks(job, instance, keys, backfill_runs_per_chunk(), "orchestration floor")
        recorded = materialized_partitions(instance, carrier)
        if len(recorded) != runs:
            raise RuntimeError(f"orchestration floor: {len(recorded)} of {runs} partitions recorded")
    return record


def figures_cost(out: Path, *, partitions: int, runs: int, repeat: int, pg_base_url: str | None = None,
                 pg_pooled_url: str | None = None) -> dict[str, Any]:
    """What attaching each run's figures costs, four ways, over Dagster's floor: milliseconds a run
    recorded, per instance (SQLite; PostgreSQL directly and through PgBouncer when given).

    The floor's asset shape (:func:`_run_stages_job`) on a spec with ``partitions`` run
    partitions, of which ``runs`` (in the middle) are recorded in chunks of
    ``AML_BACKFILL_RUNS_PER_CHUNK``, with the build's tags and event settings. Sides, alternating,
    a fresh instance each: ``none``; ``metadata`` (onto the materialisation, after Dagster's
    partition check, :func:`partition_lookup`); ``observation`` (one more event a run, no check);
    ``stage_observations`` (an event per stage a run, each stage's figures on its own asset);
    ``stage_metadata`` (the build's way: each stage's figures on its own asset's materialisation,
    no check, no event of their own). Each side must leave the last recorded run's figures where it puts them."""
    keys = [f"run-{i:06d}" for i in range(partitions)]
    middle = (partitions - runs) // 2
    recorded = keys[middle:middle + runs]
    jobs = {mode: _run_stages_job("figures", figures=mode) for mode in FIGURE_MODES}
    result: dict[str, Any] = {"partitions": partitions, "runs": runs, "repeat": repeat, "ms_per_run": {}, "timings": {}}
    for name, instance_url in instance_urls(pg_base_url, pg_pooled_url, "aml_bench_figures").items():
        cmp = _figure_modes_side_by_side(jobs, keys, recorded, out / "figures-instance", instance_url, repeat)
        result["timings"][name] = cmp.to_json()
        result["ms_per_run"][name] = {mode: summarize([s * 1000 / runs for s in cmp.seconds[mode]])
                                      for mode in FIGURE_MODES}
    remove_tree(out / "figures-instance")
    return result


def _figure_modes_side_by_side(jobs: dict[str, Any], keys: list[str], recorded: list[str], home: Path,
                               instance_url: Callable[[], str | None], repeat: int) -> Any:
    """:func:`figures_cost` on one instance (``instance_url``: as :func:`instance_urls` makes them)."""
    import dagster as dg

    from aml_pipeline.config import backfill_runs_per_chunk
    from aml_pipeline.components.dagster_internals import build_event_settings

    chunk_runs = backfill_runs_per_chunk()
    stack = contextlib.ExitStack()
    state: dict[str, Any] = {}

    def prepare(side: str, i: int) -> None:
        stack.close()
        state["instance"] = stack.enter_context(persistent_instance(home, instance_url()))
        state["instance"].add_dynamic_partitions(jobs[side][0].name, keys)

    def side(mode: str):
        _, job, carrier = jobs[mode]
        where = dg.AssetRecordsFilter(asset_key=carrier, asset_partitions=[recorded[-1]])

        def record() -> None:
            instance = state["instance"]
            _record_in_chunks(job, instance, recorded, chunk_runs, f"figures ({mode})")
            fetch = (instance.fetch_materializations if mode in ("none", "metadata", "stage_metadata")
                     else instance.fetch_observations)
            events = fetch(where, limit=1).records
            carried = events[0].asset_event.metadata if events else {}
            if (mode == "none") == ("windows" in carried):
                raise RuntimeError(f"figures ({mode}): run {recorded[-1]}'s figures are not where this side puts them")
        return record

    try:
        with build_event_settings():
            return side_by_side({mode: side(mode) for mode in FIGURE_MODES}, repeat=repeat, prepare=prepare)
    finally:
        stack.close()


def partition_lookup(out: Path, *, counts: tuple[int, ...], repeat: int,
                     pg_base_url: str | None = None, pg_pooled_url: str | None = None) -> dict[str, Any]:
    """Milliseconds of the partition check Dagster makes for per-partition metadata on a
    materialisation (``add_asset_metadata(..., partition_key=run)`` resolves the step's range
    against all of the spec's run partitions), on a spec with ``counts`` run partitions: what the
    ``metadata`` way of :func:`figures_cost` would add to every run as a plant's history grows, and
    why the build observes each run's figures instead. Per instance (SQLite; PostgreSQL directly and through
    PgBouncer when given), a fresh instance per count, the check as Dagster calls it, ``repeat``
    times over a chunk of (at most) the default chunk size in the middle."""
    import time

    import dagster as dg

    from aml_pipeline.config import DEFAULT_BACKFILL_RUNS_PER_CHUNK
    from aml_pipeline.components.partitions import run_partitions

    partitions = run_partitions("lookup")
    chunk_runs = DEFAULT_BACKFILL_RUNS_PER_CHUNK
    result: dict[str, Any] = {"counts": list(counts), "chunk_runs": chunk_runs, "repeat": repeat, "ms": {}}
    for name, instance_url in instance_urls(pg_base_url, pg_pooled_url, "aml_bench_lookup").items():
        result["ms"][name] = {}
        for count in counts:
            with persistent_instance(out / "lookup-instance", instance_url()) as instance:
                keys = [f"run-{i:06d}" for i in range(count)]
                instance.add_dynamic_partitions(partitions.name, keys)
                chunk = keys[count // 2:count // 2 + chunk_runs]
                chunk_range = dg.PartitionKeyRange(chunk[0], chunk[-1])
                seconds = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    with dg.partition_loading_context(dynamic_partitions_store=instance):
                        targeted = partitions.get_partition_keys_in_range(partition_key_range=chunk_range)
                    seconds.append(time.perf_counter() - t0)
                if list(targeted) != chunk:
                    raise RuntimeError(f"partition lookup: {len(targeted)} keys in the range, expected {len(chunk)}")
            result["ms"][name][str(count)] = summarize([x * 1000 for x in seconds])
    remove_tree(out / "lookup-instance")
    return result


def run_whole_build(spec_dict: dict[str, Any], tsdb_url: str, out: Path, *, repeat: int) -> dict[str, Any]:
    """``aml-pipeline build --json`` as a user waits for it, from the process's start to its JSON
    line, with ``--workers 1`` and ``--workers 2``, alternating: a fresh ``AML_HOME`` each time, and
    a fresh ``DAGSTER_HOME`` with the repository's ``dagster.yaml`` (the instance ``scripts/ui.sh``
    gives a user). Beside them, ``--workers 2`` with ``AML_PARALLEL_MIN_CELLS=0``: two chunk runs
    whatever the work, what starting them costs and saves on this workload."""
    import json
    import subprocess
    import sys
    import time

    spec_path = out / "spec.json"
    out.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec_dict))
    cli = Path(sys.executable).parent / "aml-pipeline"
    repo_yaml = (Path(__file__).resolve().parent.parent / "dagster.yaml").read_text()
    hashes: set[str] = set()

    def prepare(side: str, i: int) -> None:
        settle(out / "run")
        (out / "run" / "dagster").mkdir(parents=True)
        (out / "run" / "dagster" / "dagster.yaml").write_text(repo_yaml.replace(".aml/dagster", str(out / "run" / "dagster")))

    def build(workers: int, **env: str):
        def call() -> Sample:
            run = out / "run"
            t0 = time.perf_counter()
            done = subprocess.run(
                [str(cli), "build", str(spec_path), "--tsdb", tsdb_url, "--workers", str(workers), "--json"],
                env={**os.environ, "AML_HOME": str(run / "aml"), "DAGSTER_HOME": str(run / "dagster"),
                     "DAGSTER_DISABLE_TELEMETRY": "1", **env},
                capture_output=True, text=True, timeout=3600,
            )
            seconds = time.perf_counter() - t0
            if done.returncode != 0:
                raise RuntimeError(f"aml-pipeline build --workers {workers}: {done.stderr.strip()[-2000:]}")
            summary = json.loads(done.stdout.strip().splitlines()[-1])
            hashes.add(summary["sha256"])
            return Sample(seconds, summary, {"workers_used": summary["workers"]["used"]})

        return call

    cmp = side_by_side({"1_worker": build(1), "2_workers": build(2), "2_workers_forced": build(2, AML_PARALLEL_MIN_CELLS="0")},
                       repeat=repeat, prepare=prepare)
    remove_tree(out)
    return {"timings": cmp.to_json(), "speedup": cmp.ratio("1_worker", "2_workers"),
            "speedup_forced": cmp.ratio("1_worker", "2_workers_forced"), "same_sha256": len(hashes) == 1,
            "workers_used": cmp.values["2_workers"]["workers"],
            "what": "whole build, process start to the JSON line, fresh AML_HOME and DAGSTER_HOME (the repository's "
                    "dagster.yaml); 2_workers as a user gets it (fewer where more cannot help), 2_workers_forced "
                    "with AML_PARALLEL_MIN_CELLS=0 (two chunk runs at once)"}


def run_parallel(spec_dict: dict[str, Any], tsdb_url: str, out: Path, *, repeat: int) -> dict[str, Any]:
    """The same Dagster build with 1 and with 2 workers, alternating; same sha256. Two workers
    are used whatever the work (``AML_PARALLEL_MIN_CELLS=0``): this times the parallel chunk
    runs themselves.

    Alternating with them, the reference: the same run stages without Dagster, the library's
    ``build_runs`` over every run in one process, and over each half of the runs in two
    processes at once (a process pool started and warmed before the clock, so it pays no
    process start or import at all): what this machine gives the same work in two processes.
    """
    import json
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from aml_pipeline.runner.parallel import start_step_server
    from aml_pipeline.pipeline.registry import WINDOWS
    from aml_pipeline.pipeline.store import DatasetStore
    from aml_pipeline.spec import parse_spec

    stack = contextlib.ExitStack()
    state: dict[str, Any] = {}
    hashes: set[str] = set()

    def prepare(side: str, i: int) -> None:
        stack.close()
        if not side.startswith("library"):
            state["instance"] = stack.enter_context(persistent_instance(out / "instance"))
        settle(out / "build")
        (out / "build").mkdir(parents=True)

    def build(workers: int):
        def call() -> Sample:
            cpu0 = _cpu_seconds()
            s = materialize(spec_dict, tsdb_url, out / "build", state["instance"], workers=workers)
            hashes.add(s["sha256"])
            metrics = {"total_seconds": s["seconds"]["total"]}
            if workers == 1:
                # Cores this process kept busy (its threads: the fetch overlaps cleaning), the
                # ceiling of any speedup on this machine being cores / this.
                metrics["cores_busy"] = (_cpu_seconds() - cpu0) / s["seconds"]["total"]
            return Sample(s["seconds"]["runStages"], s, metrics)

        return call

    spec_json = json.dumps(spec_dict)
    run_ids = _finished_runs(spec_dict, tsdb_url)
    half = -(-len(run_ids) // 2)  # as the build cuts them: contiguous chunks of at most half

    def library(parts: list[list[str]]):
        def call() -> None:
            store = out / "build" / "store"
            for future in [pool.submit(library_run_stages, spec_json, tsdb_url, str(store), part) for part in parts]:
                future.result()
            # The reference did the build's work: every run windowed.
            windowed = DatasetStore(store, parse_spec(spec_dict))
            missing = [r for r in run_ids if windowed.read_meta(r, WINDOWS) is None]
            if missing:
                raise RuntimeError(f"library run stages left {len(missing)} runs without windows: {missing[:3]}")

        return call

    # The forkserver of this process, as the 2-worker builds start it (with the step modules
    # preloaded): a pool started first would start it without them, and the builds' steps would
    # then fork from that one.
    start_step_server()
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"))
    forced = contextlib.ExitStack()
    forced.enter_context(mock.patch.dict(os.environ, {"AML_PARALLEL_MIN_CELLS": "0"}))
    try:
        # Both processes start, import the project and open the TSDB before the clock.
        for future in [pool.submit(library_run_stages, spec_json, tsdb_url, None, []) for _ in range(2)]:
            future.result()
        cmp = side_by_side({
            "1_worker": build(1), "2_workers": build(2),
            "library_1_process": library([run_ids]), "library_2_processes": library([run_ids[:half], run_ids[half:]]),
        }, repeat=repeat, prepare=prepare)
    finally:
        forced.close()
        stack.close()
        pool.shutdown(wait=True, cancel_futures=True)
    remove_tree(out)
    return {"timings": cmp.to_json(), "speedup": cmp.ratio("1_worker", "2_workers"), "same_sha256": len(hashes) == 1,
            "speedup_whole_build": cmp.ratio("1_worker", "2_workers", "total_seconds"),
            "cores_busy_1_worker": cmp.metric("1_worker", "cores_busy"),
            "library_speedup_2_processes": cmp.ratio("library_1_process", "library_2_processes"),
            "cores": os.cpu_count(),
            "what": "run stages: from the start of materialize_dataset's Dagster runs to the end of the last "
                    "run-stage step (1 worker: one __build run; 2 workers: two __runs chunk runs at once, each "
                    "step in a process started by Dagster's multiprocess executor); speedup_whole_build adds "
                    "the dataset stages, which run once either way; library_speedup_2_processes: the same "
                    "runs through the library's build_runs (fetch, clean and align, windows; no Dagster, no "
                    "metadata) in one process / each half in two processes of a warm process pool"}


def _finished_runs(spec_dict: dict[str, Any], tsdb_url: str) -> list[str]:
    from aml_pipeline.pipeline.plan import run_scope
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb_open import open_tsdb

    spec = parse_spec(spec_dict)
    with open_tsdb(tsdb_url) as db:
        return [r.run_id for r in db.list_runs(run_scope(spec), finished_only=True)]


def library_run_stages(spec_json: str, tsdb_url: str, store_root: str | None, run_ids: list[str]) -> None:
    """Every run stage of ``run_ids`` through the library's ``build_runs`` into ``store_root``,
    as the Dagster run step does them (in a process of :func:`run_parallel`'s pool)."""
    import json

    from aml_pipeline.pipeline.plan import BuildPlan
    from aml_pipeline.pipeline.runs import build_runs
    from aml_pipeline.pipeline.registry import RUN_STAGES
    from aml_pipeline.pipeline.store import DatasetStore
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb_open import open_tsdb
    from aml_pipeline.tsdb.port import DEFAULT_PAGE_LIMIT

    spec = parse_spec(json.loads(spec_json))
    with open_tsdb(tsdb_url) as db:
        if store_root is None:
            return
        store = DatasetStore(Path(store_root), spec)
        fetch = BuildPlan.read(db, store, run_ids=run_ids).fetcher(db, page_limit=DEFAULT_PAGE_LIMIT)
        for result in build_runs(store, [(r, RUN_STAGES) for r in run_ids], fetch):
            if result.error is not None:
                raise result.error


def _cpu_seconds() -> float:
    """User + system CPU time of this process so far, all threads."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def run_incremental(spec_dict: dict[str, Any], tsdb_url: str, out: Path, *, repeat: int) -> dict[str, Any]:
    """Rebuilds, through the ``aml-pipeline build`` command (in this process) on a
    persistent instance: a full build into fresh directories and a fresh instance, then the same
    build again with nothing changed, then a build after editing only the spec's ``split``.
    The three run in that order in every repetition (each depends on the one before)."""
    import json
    import os

    edited = json.loads(json.dumps(spec_dict))
    edited["split"] = {**edited["split"], "train": 0.6, "val": 0.25, "test": 0.15}
    out.mkdir(parents=True, exist_ok=True)
    spec_path, edited_path = out / "spec.yaml", out / "spec-split-edited.yaml"
    spec_path.write_text(json.dumps(spec_dict))  # JSON is YAML
    edited_path.write_text(json.dumps(edited))
    home, datasets, dagster_home = out / "home", out / "datasets", out / "instance"

    def prepare(side: str, i: int) -> None:
        if side == "full":
            with persistent_instance(dagster_home):
                pass  # created and migrated before the clock
            settle(home, datasets)
        else:
            settle()

    def build(path: Path):
        return lambda: cli_build(path, tsdb_url, home, datasets, dagster_home)

    old = os.environ.get("DAGSTER_HOME")
    try:
        cmp = side_by_side({"full": build(spec_path), "noop": build(spec_path), "split_edit": build(edited_path)},
                           repeat=repeat, prepare=prepare, rotate=False)
    finally:
        if old is None:
            os.environ.pop("DAGSTER_HOME", None)
        else:
            os.environ["DAGSTER_HOME"] = old
    # the edited spec built from nothing by the library must give the same snapshot
    fresh = e2e_build(edited, tsdb_url, out / "fresh")
    result = {
        "timings": cmp.to_json(),
        "noop_over_full": cmp.ratio("noop", "full"),
        "split_edit_over_full": cmp.ratio("split_edit", "full"),
        "noop_same_sha256": cmp.values["noop"]["sha256"] == cmp.values["full"]["sha256"],
        "split_edit_same_as_fresh_build": cmp.values["split_edit"]["sha256"] == fresh["sha256"],
        "summaries": {k: {kk: v.get(kk) for kk in ("sha256", "current", "materialized", "published")}
                      for k, v in cmp.values.items()},
    }
    remove_tree(out)
    return result


def cli_build(spec_path: Path, tsdb_url: str, home: Path, datasets: Path, dagster_home: Path) -> dict[str, Any]:
    """``aml-pipeline build SPEC --json`` in this process, recording in ``dagster_home``'s instance."""
    import io
    import json
    import os

    from aml_pipeline.cli import main

    os.environ["DAGSTER_HOME"] = str(dagster_home)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["build", str(spec_path), "--tsdb", tsdb_url, "--home", str(home), "--out", str(datasets), "--json"])
    if rc != 0:
        raise RuntimeError(f"aml-pipeline build {spec_path} exited {rc}: {stderr.getvalue().strip()[-2000:]}")
    return json.loads(stdout.getvalue().strip().splitlines()[-1])


def _profile(spec_dict: dict[str, Any], tsdb_url: str, out: Path) -> dict[str, Any]:
    try:
        from pyinstrument import Profiler
    except ImportError as e:
        return {"available": False, "reason": f"pyinstrument not importable ({e}); scripts/bench.sh installs it"}
    with persistent_instance(out / "instance-profile") as instance:
        settle(out / "build")
        (out / "build").mkdir(parents=True)
        profiler = Profiler(interval=0.0005)
        profiler.start()
        try:
            materialize(spec_dict, tsdb_url, out / "build", instance)
        finally:
            profiler.stop()
        events = event_counts(instance)
    session = profiler.last_session
    parts = attribute_profile(session.root_frame())
    n_events = sum(events.values())
    return {"available": True, "seconds": session.duration, "events": events, **parts,
            "dagster_ms_per_event": 1000 * parts["seconds_by_part"].get("dagster", 0.0) / n_events if n_events else None}


def event_label(entry: Any) -> str:
    """An event-log entry's Dagster event type (or "log"), with the asset's last key part for an
    asset event: ``ASSET_MATERIALIZATION:cleaned_grid``."""
    event = entry.dagster_event
    if event is None:
        return "log"
    key = event.asset_key
    return event.event_type_value + (f":{key.path[-1]}" if key is not None else "")


def event_costs(spec_dict: dict[str, Any], tsdb_url: str, out: Path) -> dict[str, Any]:
    """One more Dagster build (not counted in the ratio) into a fresh persistent instance, with
    the time the instance's event log takes to store each event (``store_event``, in the thread
    that writes it: the build waits for it) summed per :func:`event_label`: what each kind of
    event costs the build, and how many of them it writes."""
    with persistent_instance(out / "instance-events") as instance:
        storage = instance.event_log_storage
        store_event = storage.store_event
        seconds: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)

        def timed(event: Any) -> None:
            t = time.perf_counter()
            try:
                store_event(event)
            finally:
                label = event_label(event)
                seconds[label] += time.perf_counter() - t
                counts[label] += 1

        settle(out / "build")
        (out / "build").mkdir(parents=True)
        started = time.perf_counter()
        with mock.patch.object(storage, "store_event", timed):
            materialize(spec_dict, tsdb_url, out / "build", instance)
        total = time.perf_counter() - started
    by_label = {k: {"events": counts[k], "ms": 1000 * seconds[k], "ms_per_event": 1000 * seconds[k] / counts[k]}
                for k in sorted(seconds, key=lambda k: -seconds[k])}
    return {"build_seconds": total, "events": sum(counts.values()), "store_seconds": sum(seconds.values()),
            "storage": type(storage).__name__, "by_event": by_label}


def event_counts(instance: Any) -> dict[str, int]:
    """Event-log entries of every run in ``instance``, by Dagster event type (or "log")."""
    counts: dict[str, int] = defaultdict(int)
    for run in (record.dagster_run for record in instance.get_run_records()):
        for entry in instance.all_logs(run.run_id):
            counts[entry.dagster_event.event_type_value if entry.dagster_event else "log"] += 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


# Where a sample's time goes, by the file of the frame (or of its nearest classified caller).
_LIBRARY = ("/aml_pipeline/pipeline/", "/aml_pipeline/core/", "/aml_pipeline/tsdb/")
_PLOTS = ("/aml_pipeline/pipeline/plots.py", "/aml_pipeline/pipeline/run_figure.py")  # the drawing
_WIRING = ("/aml_pipeline/components/", "/aml_pipeline/runner/")
_DAGSTER = ("/dagster/", "/dagster_shared/", "/dagster_pipes/")


def _classify(path: str) -> str | None:
    if any(p in path for p in _PLOTS):
        return "plots"
    if any(p in path for p in _LIBRARY):
        return "library"
    if any(p in path for p in _WIRING):
        return "wiring"
    if any(p in path for p in _DAGSTER):
        return "dagster"
    return None


def attribute_profile(root: Any, top: int = 15) -> dict[str, Any]:
    """Seconds per bucket (library stages, plots, our Dagster wiring, Dagster, other) and the
    functions with the most self time inside Dagster.

    Library and plot frames own everything they call (numpy, DuckDB, file I/O), except that
    drawing called from a library stage (a run's plot with its figures) is the plots'; a frame of
    another file (sqlite3, SQLAlchemy, the standard library) belongs to its nearest classified
    caller, so SQLite writes that Dagster makes count as Dagster's.
    """
    seconds: dict[str, float] = defaultdict(float)
    dagster_self: dict[str, float] = defaultdict(float)
    stack = [(root, "other", False)]
    while stack:
        frame, inherited, sticky = stack.pop()
        if frame.is_synthetic:
            continue  # "[self]" and "[await]" leaves: already in their parent's total_self_time
        path = frame.file_path or ""
        found = _classify(path)
        if found == "plots" or not sticky:  # the drawing is the plots' wherever it is called from
            label = found or inherited
        else:
            label = inherited
        own = frame.total_self_time
        seconds[label] += own
        if label == "dagster":
            where = f"{frame.function} ({Path(path).name}:{frame.line_no})"
            dagster_self[where] += own
        next_sticky = sticky or label in ("library", "plots")
        stack.extend((child, label, next_sticky) for child in frame.children)
    total = sum(seconds.values())
    return {
        "seconds_by_part": dict(sorted(seconds.items(), key=lambda kv: -kv[1])),
        "share_by_part": {k: v / total for k, v in seconds.items()} if total else {},
        "dagster_top_self_time": [
            {"where": w, "seconds": s} for w, s in sorted(dagster_self.items(), key=lambda kv: -kv[1])[:top]
        ],
    }

