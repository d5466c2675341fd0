"""What the per-run plot costs: drawing time and event-log growth, for the benchmark's runs.

Workload: the standard plant shape (16 nodes: 4 controls, 4 targets, 8 features; 2 h at 1 Hz per
run, as ``bench.workload``), simulated in memory. Each run's traces are accumulated once, untimed,
the way the streaming stages feed them: every node's raw points in chunks, cleaned and aligned
with the core functions (:func:`plant_run_traces`).

* ``plot_ms_per_run``: ``run_traces_markdown`` (draw, encode, wrap as markdown) per run. The
  figure of a list of node labels is built on its first run and kept, with the texts it has
  drawn (see ``aml_pipeline.pipeline.run_figure``), as in a build, where one process draws a
  chunk of runs: so no run is drawn twice. Each repetition draws ``--runs`` runs of its own,
  once each, in a process whose figure was built on one more run (untimed, its cost is
  ``plot_setup_ms``); the figure is the median over repetitions of the mean per run (min and
  max beside it). ``plot_cpu_ms``: the same in this process's CPU time, which other processes
  on the host inflate less. Reference, same runs and repetitions: the same traces drawn the plain
  matplotlib way (a figure of the same size, a subplot per node with its artists and axes,
  ``savefig`` to PNG).
* ``plot_setup_ms``: building the figure for the benchmark's labels and drawing its first run
  (every text drawn, none kept yet), in a process that has drawn before; median over
  repetitions. A build pays it once per process and list of labels.
* ``event_log_kb_per_run``: the plot's share of the event log. Each repetition builds the same
  workload (``LOG_RUNS`` runs of the standard shape in a DuckDB file, ``bench.workload``) with
  the real build (``materialize_dataset``) into two fresh persistent SQLite instances, one with
  ``AML_RUN_PLOTS=on`` and one with ``off``, and measures each instance directory's size after
  the build (the instance closed); the figure is the difference per run. What is stored is the
  build's own: each run's figures with or without its plot, in the run's shard and the index
  shard of the SQLite event log (each holds the plot once). SQLite stores large rows in 4 KB
  overflow pages, so the figure depends on the rows' real sizes. ``event_log_pg``: the same on a
  PostgreSQL instance (``--pg``: the benchmark's server, ``bench.pg_bench.postgres_server``),
  the sizes of its tables (indexes and TOAST included) in a fresh database for each side; it
  stores each event once, compressed where its TOAST compression saves a quarter of the event.
  Its figure (``event_log_kb``) is the steady state: after the first build, the workload is
  rebuilt ``PG_REBUILDS`` times into the same database (every run partition again), each
  rebuild followed by a plain ``VACUUM`` (what autovacuum does: dead rows' space kept for
  reuse), and the figure is the mean growth per run of the rebuilds after the first, plots on
  less plots off. ``fresh_event_log_kb``: the first build's, as the SQLite figure; it also holds
  the asset's row (``asset_keys.last_materialization``), where Dagster keeps a copy of the
  asset's latest materialisation with its plot: one per asset, not per run, here shared by the
  workload's runs. ``fresh_event_log_kb_lz4``: the first build's again, in a database whose
  ``default_toast_compression`` is ``lz4`` (``ALTER DATABASE``), which compresses any event it
  can shorten where ``pglz`` stores an event uncompressed unless it saves a quarter.
  ``fresh_breakdown_kb``: where the first build's bytes are (:func:`_pg_breakdown`).
* ``deflate_options`` (:func:`deflate_options`): the drawn runs' image data deflated at other
  zlib levels, strategies and PNG row filters, CPU ms and KB a run, beside the plot's own
  setting: what a faster deflate would save and what it would add to the event log.
* ``drawing_split`` (:func:`drawing_split`, on its own: ``python -c "from bench.plots_bench import
  drawing_split; print(drawing_split())"``): the run figure's CPU a run part by part (data,
  texts, packing the rows, deflate), beside the matplotlib drawing of the data it replaced,
  the two alternating in one process.
* ``overview_cpu_ms`` (:func:`overview_cost`): CPU ms of one dataset overview, for a few
  shapes of dataset (nodes, runs, length of names).

* ``instance_growth_kb_per_hour_after_gc`` (:func:`instance_growth`): a small spec rebuilt
  ``builds_per_day`` times a simulated day for two simulated weeks into one persistent SQLite
  instance, its split seed switched between two values every other build (a spec edit), and gc
  (``prune_instance``) once a simulated day with a retention of ``retention_days`` simulated days. Each build is one simulated hour slot;
  the clock gc sees is set from the builds' own run creation times (a simulated day = that many
  builds). The figure: the instance directory's size at the end of week two over its size at the
  end of week one (flat is 1.0); the details add the growth in KB per simulated build hour and
  the tables and indexes that grew from week one to week two (:func:`sqlite_table_bytes`).

Budget (per run, 16 nodes): 20 ms and 80 KB on SQLite, 45 KB on PostgreSQL.

    .venv/bin/python -m bench.plots_bench [--repeat 5] [--runs 4] [--minutes 120] [--pg] [--json PATH]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import pg_bench  # noqa: E402
from bench.common import dir_bytes, fresh_dir, print_results  # noqa: E402
from bench.workload import HISTORY, HORIZON, N_CONTROLS, N_FEATURES, N_TARGETS, SPEC_ID, make_workload  # noqa: E402

BUDGET_MS, BUDGET_KB, BUDGET_KB_PG = 20.0, 80.0, 45.0
LOG_RUNS = 8  # runs built for the event-log figure
# Rebuilds of the workload into a PostgreSQL instance after its first build, VACUUM after each: the
# figure is the mean growth of the rebuilds after the first (a database grows by whole pages, unevenly).
PG_REBUILDS = 3


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _naive_png(traces, units: list[str], title: str) -> bytes:
    """The same traces drawn the plain matplotlib way (the reference): a fresh figure of the run
    figure's size, a subplot per node with its own axes, ``savefig``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from aml_pipeline.pipeline.run_figure import band_px

    n = len(traces.node_ids)
    fig = Figure(figsize=(13.0, (band_px(n) * n + 110) / 100), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, sharex=True)
    # Minutes since the run's start at the middle of each pixel column.
    x = (np.arange(traces.width, dtype=np.float64) + 0.5) * (traces.span_ms / traces.width) / 60_000
    for j, ax in enumerate(np.atleast_1d(axes)):
        ax.fill_between(x, traces.raw_min[j], traces.raw_max[j], color="0.7", linewidth=0)
        ax.fill_between(x, traces.grid_min[j], traces.grid_max[j], color="tab:blue", linewidth=1.5)
        gap = traces.grid_missing[j] > 0
        ax.fill_between(x, 0, 1, where=gap, transform=ax.get_xaxis_transform(), color="tab:orange", alpha=0.3)
        hit = traces.removed_count[j] > 0
        ax.plot(x[hit], traces.removed_max[j][hit], "o", color="tab:red", markersize=3)
        ax.set_ylabel(f"{traces.node_ids[j]} [{units[j]}]", rotation=0, ha="right", fontsize=10)
        ax.tick_params(labelsize=9)
    np.atleast_1d(axes)[-1].set_xlabel("time since run start [min]")
    fig.suptitle(title, fontsize=12)
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def _encoded_bytes(image, **save) -> int:
    out = io.BytesIO()
    image.save(out, **save)
    return len(out.getvalue())


def png_floor(traces, units: list[str], title: str) -> dict[str, float]:
    """KB of the run's plot as the build stores it (PNG), and of its data area alone (the bands:
    every pixel outside them white), as PNG with the plot's settings and as lossless WebP at
    its smallest (``method=6``, slow): what any image of the bands at this size costs, before
    base64 and before the event log stores it."""
    from PIL import Image

    from aml_pipeline.pipeline import run_figure
    from aml_pipeline.pipeline.plots import _label, run_figure_png

    png = run_figure_png(traces, units, title)
    fig = run_figure.run_figure(tuple(_label(n, u) for n, u in zip(traces.node_ids, units)))
    image = Image.open(io.BytesIO(png))
    pixels = np.asarray(image)
    top, left = run_figure.TOP_PX, fig.left
    data = np.zeros_like(pixels)  # palette index 0 is the white background
    rows, cols = slice(top, top + fig.n * fig.band), slice(left, left + run_figure.PLOT_PX)
    data[rows, cols] = pixels[rows, cols]
    bands = Image.fromarray(data, "P")
    bands.putpalette(image.getpalette())
    return {
        "png_kb": len(png) / 1e3,
        "bands_png_kb": len(run_figure.palette_png(data)) / 1e3,
        "bands_webp_lossless_kb": _encoded_bytes(bands.convert("RGB"), format="WEBP", lossless=True, quality=100, method=6) / 1e3,
    }


OVERVIEW_SHAPES = {  # nodes, runs, long names (node and run ids of about 40 characters)
    "4_nodes_5_runs": (4, 5, False),
    "16_nodes_32_runs": (16, 32, False),
    "60_nodes_700_runs_long_names": (60, 700, True),
}


def overview_inputs(nodes: int, runs: int, long_names: bool, seed: int = 0):
    """A dataset overview's inputs: runs split 70/15/15 with one in 40 excluded, windows per
    run, missing and outlier ratios per run and node."""
    rng = np.random.default_rng(seed)
    n_train, n_val, n_excluded = int(runs * 0.7), int(runs * 0.15), runs // 40
    splits = ["train"] * n_train + ["val"] * n_val + ["test"] * (runs - n_train - n_val - n_excluded) + ["excluded"] * n_excluded
    run_prefix = "plant_site_7/line_2_run_" if long_names else "R"
    rows = [(f"{run_prefix}{i:05d}", s, 0 if s == "excluded" else int(rng.integers(1, 5000))) for i, s in enumerate(splits)]
    node_ids = [f"reactor_{i:02d}.temperature_outlet_sensor_b" if long_names else f"N{i:02d}" for i in range(nodes)]
    return rows, node_ids, rng.beta(0.5, 20, (runs, nodes)), rng.beta(0.5, 200, (runs, nodes))


def overview_cost(repeat: int = 5) -> dict[str, Any]:
    """CPU ms of one dataset overview (``dataset_overview_png``, title included) per shape of
    OVERVIEW_SHAPES: median, min and max over ``repeat`` drawings after one untimed."""
    from aml_pipeline.pipeline.plots import dataset_overview_png

    out = {}
    for name, shape in OVERVIEW_SHAPES.items():
        rows, node_ids, missing, outliers = overview_inputs(*shape)
        dataset_overview_png(rows, node_ids, missing, outliers, title=f"bench: {len(rows)} runs")
        cpu_ms = []
        for _ in range(repeat):
            c0 = time.process_time()
            dataset_overview_png(rows, node_ids, missing, outliers, title=f"bench: {len(rows)} runs")
            cpu_ms.append((time.process_time() - c0) * 1e3)
        out[name] = {**_spread(cpu_ms), "all": cpu_ms}
    return out


def drawing_split(repeat: int = 12, runs: int = 13) -> dict[str, Any]:
    """CPU ms a run of the run figure, part by part, beside the matplotlib drawing it replaced
    (``aml_pipeline_tests.pipeline.agg_run_figure``, kept as its tests' reference): ``runs`` runs
    of the standard shape drawn through one figure of each, untimed once (every text kept), then
    ``repeat`` blocks of all the runs a side, the sides alternating, which goes first swapped
    each block. Per side, the median [min, max] over runs of each part (``data``, ``texts``,
    ``index``: the old canvas turned into palette indices; ``rows``: packed at 4 bits;
    ``deflate``), and per block, ``png`` (``RunFigure.png`` whole, CPU ms a run) and the new over
    the old, paired by block."""
    from aml_pipeline.pipeline import run_figure as rf
    from aml_pipeline.pipeline.plots import _label
    from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
    from aml_pipeline.spec import parse_spec
    from aml_pipeline_tests.pipeline.agg_run_figure import AggRunFigure

    plant = simulate_plant(n_runs=runs, run_minutes=120.0, seed=1, n_controls=N_CONTROLS, n_targets=N_TARGETS,
                           n_features=N_FEATURES, unfinished_last_run=False)
    spec = parse_spec(plant_spec_dict(plant, SPEC_ID, history_steps=HISTORY, horizon_steps=HORIZON))
    unit_of = {n.node_id: n.unit for n in plant.nodes}
    labels = tuple(_label(n, unit_of[n]) for n in spec.node_ids)
    drawn = [(plant_run_traces(plant, spec, r), f"run {r.run_id}") for r in plant.runs]
    figures = {"numpy": rf.RunFigure(labels), "matplotlib": AggRunFigure(labels)}
    parts: dict[str, dict[str, list[float]]] = {side: {} for side in figures}
    whole: dict[str, list[float]] = {side: [] for side in figures}

    def timed(side: str, part: str, f, *args):
        c0 = time.process_time()
        out = f(*args)
        parts[side].setdefault(part, []).append((time.process_time() - c0) * 1e3)
        return out

    def deflate(rows: bytes) -> bytes:
        d = zlib.compressobj(6, zlib.DEFLATED, 15, 8, zlib.Z_FILTERED)
        return d.compress(rows) + d.flush()

    for side, figure in figures.items():
        for traces, title in drawn:
            figure.png(traces, title)
    for block in range(repeat):
        for side in (("numpy", "matplotlib") if block % 2 == 0 else ("matplotlib", "numpy")):
            figure = figures[side]
            c0 = time.process_time()
            for traces, title in drawn:
                figure.png(traces, title)
            whole[side].append((time.process_time() - c0) * 1e3 / len(drawn))
            for traces, title in drawn:
                if side == "numpy":
                    index = figure.background.copy()
                    timed(side, "data", figure._draw_data, index, traces)
                    timed(side, "texts", figure._draw_texts, index, traces, title)
                else:
                    timed(side, "data", figure._draw_data, traces)
                    timed(side, "texts", figure._draw_texts, traces, title)
                    index = timed(side, "index", np.take, rf.GREEN_TO_INDEX, figure.pixels[:, :, 1])
                rows = timed(side, "rows", lambda i: rf.png_rows(i).tobytes(), index)
                timed(side, "deflate", deflate, rows)
    ratio = [a / b for a, b in zip(whole["numpy"], whole["matplotlib"])]
    return {"runs": runs, "repeat": repeat, "ratio_png": _spread(ratio),
            **{side: {"png": _spread(whole[side]), **{k: _spread(v) for k, v in parts[side].items()}} for side in figures}}


DEFLATE_OPTIONS = [(level, strategy, row_filter) for row_filter in ("none", "up") for strategy in ("filtered", "default", "rle")
                   for level in (1, 3, 4, 5, 6)]


def deflate_options(pngs: list[bytes], repeat: int = 5) -> list[dict[str, Any]]:
    """What the run plot's deflate costs and gives at other settings, on the same pixels: per
    zlib level, strategy and PNG row filter (``none``, the plot's; ``up``, each row less the row
    above), CPU ms a run (median over ``repeat`` passes over every image) and KB a run of
    compressed image data. The plot's own setting is level 6, filtered, none."""
    from PIL import Image

    from aml_pipeline.pipeline.run_figure import png_rows

    strategies = {"filtered": zlib.Z_FILTERED, "default": zlib.Z_DEFAULT_STRATEGY, "rle": zlib.Z_RLE}
    rows = [png_rows(np.asarray(Image.open(io.BytesIO(png)))) for png in pngs]
    up = []
    for r in rows:
        u = r.copy()
        u[1:, 1:] -= r[:-1, 1:]  # uint8 arithmetic wraps, as PNG's filter does
        u[:, 0] = 2
        up.append(u)
    data = {"none": [r.tobytes() for r in rows], "up": [u.tobytes() for u in up]}
    out = []
    for level, strategy, row_filter in DEFLATE_OPTIONS:
        cpu_ms, size = [], 0
        for i in range(repeat):
            c0 = time.process_time()
            for raw in data[row_filter]:
                z = zlib.compressobj(level, zlib.DEFLATED, 15, 8, strategies[strategy])
                n = len(z.compress(raw)) + len(z.flush())
                size += n if i == 0 else 0
            cpu_ms.append((time.process_time() - c0) * 1e3 / len(pngs))
        out.append({"level": level, "strategy": strategy, "row_filter": row_filter,
                    "cpu_ms": _spread(cpu_ms), "kb": size / len(pngs) / 1e3})
    return out


def _pg_bytes(url: str) -> int:
    """Bytes of the tables of the database at ``url``, their indexes and TOAST included."""
    import psycopg

    with psycopg.connect(url) as conn:
        return int(conn.execute(
            "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relkind = 'r' AND n.nspname = 'public'").fetchone()[0])


def _pg_breakdown(url: str) -> dict[str, float]:
    """Where the bytes of the database at ``url`` are (KB, tables with their indexes and TOAST):
    ``event_logs``, ``asset_keys`` (each asset's row, with its latest materialisation) and the
    rest; and the cleaned grid's materialisation events, stored (after TOAST compression) and
    as written (KB an event)."""
    import psycopg

    with psycopg.connect(url) as conn:
        tables = dict(conn.execute(
            "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n ON "
            "n.oid = c.relnamespace WHERE c.relkind = 'r' AND n.nspname = 'public'").fetchall())
        stored, written = conn.execute(
            "SELECT avg(pg_column_size(event)), avg(octet_length(event)) FROM event_logs "
            "WHERE dagster_event_type = 'ASSET_MATERIALIZATION' AND asset_key LIKE '%\"cleaned_grid\"%'").fetchone()
    main = {k: tables.pop(k, 0) / 1e3 for k in ("event_logs", "asset_keys")}
    return {"event_logs_kb": main["event_logs"], "asset_keys_kb": main["asset_keys"],
            "other_tables_kb": sum(tables.values()) / 1e3,
            "cleaned_grid_event_kb_stored": float(stored or 0) / 1e3, "cleaned_grid_event_kb_written": float(written or 0) / 1e3}


def _build_event_log_bytes(workload, plots: bool, directory: Path, pg_base_url: str | None = None,
                           rebuilds: int = 0, toast_compression: str | None = None,
                           breakdown: list[dict[str, float]] | None = None) -> list[int]:
    """Bytes of a fresh persistent instance after the real build of ``workload`` with the run
    plots on or off (``AML_RUN_PLOTS``): SQLite (the instance directory, the instance closed), or
    with ``pg_base_url`` PostgreSQL storage in a fresh database (its tables with their indexes
    and TOAST, the deployment's instance, ``deploy/dagster.yaml``). With ``rebuilds``, the
    workload is then rebuilt that many times (every run partition again, ``full``) into the same
    instance, each rebuild followed by a plain ``VACUUM`` of the database (what autovacuum does:
    the space of dead rows is kept for reuse, the files do not shrink); the bytes after each are
    listed after the first build's. ``toast_compression`` sets the database's
    ``default_toast_compression`` before the build (``lz4``; the server's default is ``pglz``).
    ``breakdown`` (PostgreSQL) gets :func:`_pg_breakdown` after the first build appended."""
    import os
    from unittest import mock

    from aml_pipeline.runner.build import materialize_dataset
    from aml_pipeline.spec import parse_spec
    from bench.dagster_bench import fresh_pg_database, persistent_instance

    fresh_dir(directory)
    home = directory / "instance"
    pg_url = fresh_pg_database(pg_base_url, "aml_bench_plots") if pg_base_url else None
    db_url = None
    if pg_url is not None:
        from urllib.parse import urlsplit, urlunsplit

        db_url = urlunsplit(urlsplit(pg_base_url)._replace(path="/aml_bench_plots"))
        if toast_compression is not None:
            import psycopg

            with psycopg.connect(pg_base_url, autocommit=True) as conn:
                conn.execute(f"ALTER DATABASE aml_bench_plots SET default_toast_compression = '{toast_compression}'")
    sizes: list[int] = []
    with mock.patch.dict(os.environ, {"AML_RUN_PLOTS": "on" if plots else "off"}), \
            persistent_instance(home, pg_url) as instance:
        for build in range(1 + rebuilds):
            summary = materialize_dataset(parse_spec(workload.spec), tsdb_url=workload.tsdb_url,
                                          home=directory / "aml", instance=instance, console_log_level="CRITICAL",
                                          full=build > 0)
            built = summary["materialized"]["run_windows"]
            if built != len(workload.runs):
                raise RuntimeError(f"event log: build {build + 1} recorded {built} of {len(workload.runs)} runs")
            if db_url is not None:
                if build > 0:
                    import psycopg

                    with psycopg.connect(db_url, autocommit=True) as conn:
                        conn.execute("VACUUM")
                sizes.append(_pg_bytes(db_url))
                if build == 0 and breakdown is not None:
                    breakdown.append(_pg_breakdown(db_url))
    return sizes if db_url is not None else [dir_bytes(home)]


def instance_growth(directory: Path, *, builds_per_day: int = 4, days_per_week: int = 7,
                    retention_days: int = 1) -> dict[str, Any]:
    """``instance_growth_kb_per_hour_after_gc`` (module docstring): two simulated weeks of
    rebuilds of a small spec into one SQLite instance, gc once a simulated day."""
    from datetime import timedelta

    from aml_pipeline.components.maintenance import prune_instance
    from aml_pipeline.runner.build import materialize_dataset
    from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb_open import open_tsdb
    from bench.dagster_bench import persistent_instance

    fresh_dir(directory)
    plant = simulate_plant(n_runs=3, run_minutes=4, seed=7)
    tsdb_url = f"duckdb://{directory / 'tsdb.duckdb'}"
    with open_tsdb(tsdb_url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    base = plant_spec_dict(plant, "growth", history_steps=20, horizon_steps=10)
    home = directory / "instance"
    sizes: list[int] = []
    tables: list[dict[str, int]] = []
    created: list[Any] = []  # each build's first run's creation time: the simulated clock
    deleted = 0
    t0 = time.perf_counter()
    with persistent_instance(home) as instance:
        for day in range(2 * days_per_week):
            for b in range(builds_per_day):
                i = day * builds_per_day + b
                spec = parse_spec({**base, "split": {**base["split"], "method": "hashed", "seed": (i // 2) % 2}})
                before = {r.run_id for r in instance.get_runs()}
                materialize_dataset(spec, tsdb_url=tsdb_url, home=directory / "aml", instance=instance,
                                    console_log_level="CRITICAL")
                new = [r for r in instance.get_run_records() if r.dagster_run.run_id not in before]
                created.append(min(r.create_timestamp for r in new))
            # gc at the end of the simulated day: runs of builds older than the retention go
            oldest_kept = (day + 1 - retention_days) * builds_per_day
            if oldest_kept > 0:
                now = created[oldest_kept] + timedelta(days=retention_days)
                deleted += len(prune_instance(instance, ["growth"], retention_days=retention_days, now=now).deleted_runs)
            if (day + 1) % days_per_week == 0:
                sizes.append(dir_bytes(home))
                tables.append(sqlite_table_bytes(home))
    week_one, week_two = sizes
    grew = {name: (tables[1].get(name, 0) - tables[0].get(name, 0)) / 1e3 for name in tables[1]}
    hours = days_per_week * builds_per_day
    return {
        "ratio": week_two / week_one,
        "week_one_kb": week_one / 1e3,
        "week_two_kb": week_two / 1e3,
        "kb_per_build_hour_week_two": (week_two - week_one) / 1e3 / hours,
        "grew_kb_by_table": dict(sorted(((k, v) for k, v in grew.items() if v > 0), key=lambda kv: -kv[1])),
        "builds": len(created),
        "deleted_runs": deleted,
        "builds_per_day": builds_per_day,
        "days_per_week": days_per_week,
        "retention_days": retention_days,
        "seconds": time.perf_counter() - t0,
    }


def sqlite_table_bytes(home: Path) -> dict[str, int]:
    """Bytes of each table and index (``file:name``) and of the free pages (``file:<free>``) of the
    SQLite instance in ``home``, from SQLite's ``dbstat``; the runs' own event-log files summed as
    ``run shards``."""
    import sqlite3

    out: dict[str, int] = {}
    for db in sorted(home.rglob("*.db")):
        name = db.relative_to(home).as_posix()
        if db.parent.name == "runs" and db.name != "index.db":
            out["run shards"] = out.get("run shards", 0) + db.stat().st_size
            continue
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            for table, size in con.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name"):
                out[f"{name}:{table}"] = size
            page = con.execute("PRAGMA page_size").fetchone()[0]
            out[f"{name}:<free>"] = con.execute("PRAGMA freelist_count").fetchone()[0] * page
        finally:
            con.close()
    return out


def plant_run_traces(plant, spec, run, *, chunk: int = 20_000):
    """A run's traces, fed as the streaming stages feed them: each node's raw points in chunks,
    then its cleaned and aligned values and the points the Hampel filter removed."""
    from aml_pipeline.core.traces import TraceAccumulator
    from aml_pipeline.pipeline.stages.grid import node_grid_params
    from aml_pipeline_tests.core.whole_series import align, clean_series, grid_times

    points = plant.points
    nodes = {n.node_id: n for n in plant.nodes}
    mine = points.run_id == run.run_id
    acc = TraceAccumulator(run.started_at, run.ended_at, spec.node_ids)
    grid_ts = grid_times(run.started_at, run.ended_at, spec.beat_ms)
    for j, node in enumerate(spec.nodes):
        at = np.flatnonzero(mine & (points.node_id == node.node_id))
        at = at[np.argsort(points.ts[at], kind="stable")]  # (ts, seq): ingestion order breaks ties
        ts, value, state = points.ts[at], points.value[at], points.state[at]
        for i in range(0, ts.size, chunk):
            acc.add_raw(j, ts[i : i + chunk], value[i : i + chunk])
        params = node_grid_params(spec, node, (nodes[node.node_id].range_lo, nodes[node.node_id].range_hi))
        cleaned = clean_series(ts, value, state, params)
        acc.add_grid(j, grid_ts, align(cleaned.ts, cleaned.value, grid_ts, interp=params.interp,
                                       max_interp_ms=params.max_interp_ms))
        acc.add_removed(j, cleaned.outlier_ts, cleaned.outlier_value)
    return acc.result()


def run(repeat: int = 5, *, runs: int = 4, minutes: float = 120.0, workdir: Path | None = None,
        pg_base_url: str | None = None) -> dict[str, Any]:
    """Measure; returns ``plot_ms_per_run`` and ``event_log_kb_per_run`` (medians) with details;
    with ``pg_base_url`` (a server's URL), the event log's figure on a PostgreSQL instance too."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*currently in (beta|preview)")
    logging.getLogger("dagster").setLevel(logging.WARNING)
    from aml_pipeline.pipeline import run_figure
    from aml_pipeline.pipeline.plots import run_traces_markdown
    from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
    from aml_pipeline.spec import parse_spec

    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="aml-plots-bench-")) if own else Path(workdir)
    try:
        # one run to build the figure on, then runs of their own for each repetition
        plant = simulate_plant(n_runs=1 + runs * repeat, run_minutes=minutes, seed=1, n_controls=N_CONTROLS,
                               n_targets=N_TARGETS, n_features=N_FEATURES, unfinished_last_run=False)
        spec = parse_spec(plant_spec_dict(plant, SPEC_ID, history_steps=HISTORY, horizon_steps=HORIZON))
        unit_of = {n.node_id: n.unit for n in plant.nodes}
        units = [unit_of[n] for n in spec.node_ids]
        traces = [(r.run_id, plant_run_traces(plant, spec, r)) for r in plant.runs]
        first, rest = traces[0], traces[1:]

        run_traces_markdown(first[1], [f"{u}." for u in units], "warm-up")  # imports, fonts: other labels
        setup_ms = []
        for _ in range(repeat):
            run_figure.run_figure.cache_clear()
            t0 = time.perf_counter()
            run_traces_markdown(first[1], units, first[0])
            setup_ms.append((time.perf_counter() - t0) * 1e3)
        _naive_png(first[1], units, "warm-up")

        log_workload = make_workload(work / "log-plant", runs=LOG_RUNS, minutes=minutes)
        log_runs = len(log_workload.runs)
        ours_ms, ours_cpu_ms, naive_ms, kb_with, kb_without = [], [], [], [], []
        pg_kb_with: list[float] = []
        pg_kb_without: list[float] = []
        pg_steady_with: list[float] = []
        pg_steady_without: list[float] = []
        pg_sizes_with: list[list[float]] = []
        pg_sizes_without: list[list[float]] = []
        pg_lz4_with: list[float] = []
        pg_breakdown: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        pg_lz4_without: list[float] = []
        markdowns: list[str] = []
        for i in range(repeat):
            mine = rest[i * runs : (i + 1) * runs]
            t0, c0 = time.perf_counter(), time.process_time()
            drawn = [run_traces_markdown(tr, units, run_id) for run_id, tr in mine]
            ours_ms.append((time.perf_counter() - t0) * 1e3 / len(mine))
            ours_cpu_ms.append((time.process_time() - c0) * 1e3 / len(mine))
            markdowns += drawn
            t0 = time.perf_counter()
            for run_id, tr in mine:
                _naive_png(tr, units, f"run {run_id}")
            naive_ms.append((time.perf_counter() - t0) * 1e3 / len(mine))
            kb_with.append(_build_event_log_bytes(log_workload, True, work / f"build-with-{i}")[0] / 1e3 / log_runs)
            kb_without.append(_build_event_log_bytes(log_workload, False, work / f"build-without-{i}")[0] / 1e3 / log_runs)
            if pg_base_url:
                for plots, fresh, steady, sizes in ((True, pg_kb_with, pg_steady_with, pg_sizes_with),
                                                    (False, pg_kb_without, pg_steady_without, pg_sizes_without)):
                    b = _build_event_log_bytes(log_workload, plots, work / f"pg-{plots}-{i}", pg_base_url,
                                               rebuilds=PG_REBUILDS, breakdown=pg_breakdown[plots])
                    fresh.append(b[0] / 1e3 / log_runs)
                    steady.append((b[-1] - b[1]) / (PG_REBUILDS - 1) / 1e3 / log_runs)
                    sizes.append([v / 1e3 for v in b])
                    b = _build_event_log_bytes(log_workload, plots, work / f"pg-lz4-{plots}-{i}", pg_base_url,
                                               toast_compression="lz4")
                    (pg_lz4_with if plots else pg_lz4_without).append(b[0] / 1e3 / log_runs)
        floors = [png_floor(tr, units, f"run {run_id}") for run_id, tr in rest[: runs * repeat]]
        deflate = deflate_options([base64.b64decode(m.split("base64,", 1)[1].split(")", 1)[0]) for m in markdowns])
        plot_kb = [a - b for a, b in zip(kb_with, kb_without)]
        markdown_kb = [len(m.encode()) / 1e3 for m in markdowns]
        ms = _spread(ours_ms)
        kb = _spread(plot_kb)
        pg_plot_kb = [a - b for a, b in zip(pg_kb_with, pg_kb_without)]
        pg_steady_kb = [a - b for a, b in zip(pg_steady_with, pg_steady_without)]
        pg_lz4_kb = [a - b for a, b in zip(pg_lz4_with, pg_lz4_without)]
        pg = ({"event_log_kb": {**_spread(pg_steady_kb), "all": pg_steady_kb},
               "event_log_kb_per_run_with_plot": _spread(pg_steady_with),
               "event_log_kb_per_run_without_plot": _spread(pg_steady_without),
               "fresh_event_log_kb": {**_spread(pg_plot_kb), "all": pg_plot_kb},
               "fresh_event_log_kb_per_run_with_plot": _spread(pg_kb_with),
               "fresh_event_log_kb_per_run_without_plot": _spread(pg_kb_without),
               "fresh_event_log_kb_lz4": {**_spread(pg_lz4_kb), "all": pg_lz4_kb},
               "fresh_event_log_kb_per_run_with_plot_lz4": _spread(pg_lz4_with),
               "fresh_breakdown_kb": {"with_plot": {k: statistics.median(d[k] for d in pg_breakdown[True])
                                                    for k in pg_breakdown[True][0]},
                                      "without_plot": {k: statistics.median(d[k] for d in pg_breakdown[False])
                                                       for k in pg_breakdown[False][0]}},
               "rebuilds": PG_REBUILDS,
               "database_kb_after_each_build": {"with_plot": pg_sizes_with, "without_plot": pg_sizes_without}}
              if pg_plot_kb else None)
        return {
            "event_log_pg": pg,
            "plot_ms_per_run": ms["median"],
            "event_log_kb_per_run": kb["median"],
            "plot_ms": {**ms, "all": ours_ms},
            "plot_cpu_ms": {**_spread(ours_cpu_ms), "all": ours_cpu_ms},
            "plot_ms_naive_matplotlib": {**_spread(naive_ms), "all": naive_ms},
            "plot_over_naive_matplotlib": ms["median"] / statistics.median(naive_ms),
            "plot_setup_ms": {**_spread(setup_ms), "all": setup_ms},
            "event_log_kb": {**kb, "all": plot_kb},
            "event_log_kb_per_run_with_plot": _spread(kb_with),
            "event_log_kb_per_run_without_plot": _spread(kb_without),
            "markdown_kb_per_run": _spread(markdown_kb),
            # base64 (4/3), then one copy in the run's shard and one in the index shard
            "png_kb_per_run": _spread([f["png_kb"] for f in floors]),
            "bands_png_kb_per_run": _spread([f["bands_png_kb"] for f in floors]),
            "bands_webp_lossless_kb_per_run": _spread([f["bands_webp_lossless_kb"] for f in floors]),
            "event_log_kb_floor_bands_webp": _spread([2 * 4 / 3 * f["bands_webp_lossless_kb"] for f in floors]),
            "deflate_options": deflate,
            "overview_cpu_ms": overview_cost(repeat),
            "budget": {"plot_ms_per_run": BUDGET_MS, "event_log_kb_per_run": BUDGET_KB,
                       "event_log_kb_per_run_pg": BUDGET_KB_PG},
            "met": {"plot_ms_per_run": ms["median"] <= BUDGET_MS, "event_log_kb_per_run": kb["median"] <= BUDGET_KB,
                    **({"event_log_kb_per_run_pg": pg["event_log_kb"]["median"] <= BUDGET_KB_PG} if pg else {})},
            "workload": {"runs_per_repeat": runs, "nodes": len(spec.node_ids), "run_minutes": minutes,
                         "points": len(plant.points), "repeat": repeat, "event_log_runs": log_runs},
        }
    finally:
        if own:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plots_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=120.0)
    ap.add_argument("--pg", action="store_true", help="also measure the event log on a PostgreSQL instance")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        pg_base_url = stack.enter_context(pg_bench.postgres_server())[0] if a.pg else None
        res = run(a.repeat, runs=a.runs, minutes=a.minutes, pg_base_url=pg_base_url)
    print_results(res, a.json)
    ms, kb = res["plot_ms"], res["event_log_kb"]
    print(
        f"\nplot_ms_per_run      {ms['median']:.1f} ms (min {ms['min']:.1f}, max {ms['max']:.1f}; budget {BUDGET_MS:g}; "
        f"CPU {res['plot_cpu_ms']['median']:.1f} ms; "
        f"plain matplotlib {res['plot_ms_naive_matplotlib']['median']:.0f} ms; "
        f"figure setup {res['plot_setup_ms']['median']:.0f} ms once per process)\n"
        f"event_log_kb_per_run {kb['median']:.1f} KB (min {kb['min']:.1f}, max {kb['max']:.1f}; budget {BUDGET_KB:g}; "
        f"markdown {res['markdown_kb_per_run']['median']:.1f} KB)\n"
        f"the plot's PNG {res['png_kb_per_run']['median']:.1f} KB; its bands alone {res['bands_png_kb_per_run']['median']:.1f} KB "
        f"as PNG, {res['bands_webp_lossless_kb_per_run']['median']:.1f} KB as lossless WebP at its smallest: "
        f"{res['event_log_kb_floor_bands_webp']['median']:.1f} KB of SQLite event log (base64, stored twice)"
    )
    if res["event_log_pg"]:
        pg = res["event_log_pg"]["event_log_kb"]
        fresh = res["event_log_pg"]["fresh_event_log_kb"]
        print(f"event_log_kb_per_run on a PostgreSQL instance {pg['median']:.1f} KB (min {pg['min']:.1f}, max {pg['max']:.1f}; "
              f"a rebuild after VACUUM); the first build into a fresh database {fresh['median']:.1f} KB "
              f"(min {fresh['min']:.1f}, max {fresh['max']:.1f}), with lz4 TOAST compression "
              f"{res['event_log_pg']['fresh_event_log_kb_lz4']['median']:.1f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
