"""Benchmark suite: speed and memory of the dataset build, against references measured in the
same run, side by side. See bench/README.md for what each key measures and how.

    .venv/bin/python bench/run.py [--quick] [--json PATH] [--workdir DIR] [--keep] [--only PARTS]

Every figure comes from ``bench.timing.side_by_side``: the sides alternate, the same number of
repetitions each, and the JSON reports the median with the min and max and the repetitions.
Exit status: 0 if every correctness cross-check passed and no part raised; 1 otherwise. Goals
are reported (``goals``), never enforced: the machine is shared and timings are noisy. A goal
whose feature does not exist yet, or whose reference cannot run here, is null with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import (  # noqa: E402
    build_bench,
    dagster_bench,
    hampel_bench,
    memory,
    pg_bench,
    series_bench,
    sources_bench,
    windows_bench,
)
from bench.common import fresh_dir, remove_tree  # noqa: E402
from bench.workload import make_workload, make_workload_in_subprocess  # noqa: E402


@dataclass(frozen=True)
class Goal:
    key: str
    op: str  # "<=", ">=" or "=="
    target: Any
    unit: str
    what: str
    part: str  # the part that measures it


GOALS = (
    Goal("e2e_over_floor", "<=", 1.5, "x", "end-to-end library build / I/O floor", "build"),
    Goal("hampel_mpts_per_s", ">=", 20.0, "M points/s", "exact Hampel k=5, one core", "hampel"),
    Goal("hampel_flags_identical", "==", True, "", "Hampel flags identical to numpy, numba, the oracle", "hampel"),
    Goal("hampel_over_numpy_vectorised", ">=", 10.0, "x", "Hampel: vectorised numpy time / ours", "hampel"),
    Goal("windows_speedup_vs_pf", ">=", 100.0, "x", "snapshot windows/s / PyTorch Forecasting's", "windows"),
    Goal("dagster_over_library", "<=", 1.5, "x", "Dagster build (persistent instance) / library", "dagster"),
    Goal("pg_fetch_over_copy", "<=", 1.5, "x", "PostgreSQL adapter fetch / raw COPY", "pg"),
    Goal("rss_long_run_ratio", "<=", 1.2, "x", "peak RSS, 16-day run / 2-day run", "rss"),
    Goal("rss_long_run_mb", "<=", 1000.0, "MB", "peak RSS, 16-day run", "rss"),
    Goal("long_run_points_per_s_ratio", ">=", 0.9, "x", "points/s, 16-day run / 2-day run", "rss"),
    Goal("noop_rebuild_over_full", "<=", 0.15, "x", "unchanged rebuild / full build", "incremental"),
    Goal("split_edit_rebuild_over_full", "<=", 0.75, "x", "rebuild after a split edit / full build", "incremental"),
    Goal("parallel_speedup_2_workers", ">=", 1.6, "x", "run stages, 1 worker / 2 workers", "parallel"),
    Goal("parallel_whole_build_speedup_2_workers", ">=", 1.0, "x",
         "whole `aml-pipeline build`, --workers 1 / --workers 2, fresh homes", "parallel"),
    Goal("orchestration_ms_per_run", "<=", 10.0, "ms", "(Dagster - library) / runs, many small runs", "orchestration"),
    Goal("orchestration_ms_per_run_pg", "<=", 10.0, "ms", "the same, PostgreSQL instance (deploy/dagster.yaml)",
         "orchestration"),
    Goal("orchestration_ms_per_run_pg_pooled", "<=", 10.0, "ms", "the same, through PgBouncer (docs/deployment.md)",
         "orchestration"),
    Goal("product_over_floor_ms_per_run", "<=", 15.0, "ms",
         "orchestration_ms_per_run - Dagster's floor for the same runs, SQLite instance", "orchestration"),
    Goal("product_over_floor_ms_per_run_pg", "<=", 15.0, "ms", "the same, PostgreSQL instance", "orchestration"),
    Goal("product_over_floor_ms_per_run_pg_pooled", "<=", 15.0, "ms", "the same, through PgBouncer", "orchestration"),
    Goal("plot_ms_per_run", "<=", 20.0, "ms", "per-run plot, draw + encode", "plots"),
    Goal("event_log_kb_per_run", "<=", 80.0, "KB", "event-log growth per run's plot, SQLite instance", "plots"),
    Goal("event_log_kb_per_run_pg", "<=", 45.0, "KB",
         "event-log growth per run's plot, PostgreSQL instance, rebuilds after a plain VACUUM", "plots"),
    Goal("instance_growth_kb_per_hour_after_gc", "<=", 1.1, "x",
         "instance size, end of simulated week two / week one, hourly rebuilds, gc daily", "plots"),
    Goal("open_verify_rss_mb", "<=", 150.0, "MB", "peak RSS, open + verify the snapshot", "snapshot"),
    Goal("verify_over_sha256sum", "<=", 1.2, "x", "snapshot verification / sha256sum", "snapshot"),
    Goal("iter_batches_gb_per_s", ">=", 1.0, "GB/s", "train windows in shuffled batches of 256", "snapshot"),
    Goal("series_bytes_over_grid", "<=", 2.0, "x", "series snapshot's array bytes / the float32 grid", "series"),
    Goal("series_build_speedup", ">=", 2.5, "x", "build_dataset, windows layout / series layout", "series"),
    Goal("series_e2e_over_floor", "<=", 3.0, "x", "series build / its I/O floor", "series"),
    Goal("series_iter_batches_gb_per_s", ">=", 1.0, "GB/s", "series: train windows in shuffled batches of 256", "series"),
    Goal("series_iter_batches_over_windows", ">=", 0.8, "x", "series / windows layout, shuffled batches", "series"),
    Goal("series_open_verify_rss_mb", "<=", 150.0, "MB", "series: peak RSS, open + verify", "series"),
    Goal("series_verify_over_sha256sum", "<=", 1.2, "x", "series: verification / sha256sum", "series"),
    Goal("series_plant_scale_peak_rss_mb", "<=", 1000.0, "MB",
         "series, 500 runs x 32 nodes x 30 min through `aml-pipeline build`: peak RSS", "series"),
    Goal("mapped_pg_fetch_over_copy", "<=", 1.5, "x", "mapped PostgreSQL table: run fetch / binary COPY", "sources"),
    Goal("lake_over_scan", "<=", 1.5, "x", "Parquet lake: the build's read / DuckDB's plain scan of its rows", "sources"),
    Goal("mapped_version_over_fetch", "<=", 0.25, "x", "mapped table: per-run version query / run fetch", "sources"),
    Goal("causal_windows_equal_live_share", "==", 1.0, "", "causal snapshot: windows whose live x from points before the origin is theirs", "live"),
    Goal("live_inputs_from_points_ms", "<=", 2.0, "ms", "live input at one origin from held points, H 60, 16 nodes (median)", "live"),
    Goal("live_inputs_from_tsdb_ms", "<=", 25.0, "ms", "live input read from the embedded file (p99 of the calls)", "live"),
    Goal("live_inputs_from_tsdb_pg_ms", "<=", 25.0, "ms", "live input read from PostgreSQL (p99 of the calls)", "live"),
    Goal("aggregate_mean_mpts_per_s", ">=", 0.8, "x", "grid stage points/s with aggregate: mean / without", "live"),
)
PARTS = ("build", "hampel", "windows", "snapshot", "series", "plots", "dagster", "incremental", "parallel",
         "orchestration", "run_figures", "rss", "pg", "sources", "live")

# The Dagster build of the 2,000 small runs is the longest side of the full run, so that figure
# gets one repetition there (raise orchestration_repeat where time allows).
FULL = dict(runs=32, minutes=120.0, repeat=5, build_repeat=3, pf_runs=8,
            rss_piece_minutes=1440.0, rss_pieces=(2, 16),
            orchestration_runs=2000, orchestration_minutes=3.0, orchestration_repeat=1,
            lookup_partitions=(300, 2_000, 20_000), lookup_repeat=20,
            run_figures_partitions=20_000, run_figures_runs=200, run_figures_repeat=2,
            series_plant=series_bench.PLANT_SCALE,
            growth=dict(builds_per_day=4, days_per_week=7, retention_days=1),
            url_image=dict(runs=8, minutes=120.0))
QUICK = dict(runs=4, minutes=10.0, repeat=2, build_repeat=1, pf_runs=2,
             rss_piece_minutes=20.0, rss_pieces=(1, 8),
             orchestration_runs=10, orchestration_minutes=3.0, orchestration_repeat=1,
             lookup_partitions=(10, 300), lookup_repeat=3,
             run_figures_partitions=100, run_figures_runs=10, run_figures_repeat=1,
             series_plant=dict(runs=10, nodes=8, minutes=5.0),
             growth=dict(builds_per_day=1, days_per_week=2, retention_days=1),
             url_image=dict(runs=2, minutes=10.0))


class Results:
    """The JSON being built: figures (goal keys), cross-checks, errors, per-part details."""

    def __init__(self, mode: str, cfg: dict[str, Any]) -> None:
        self.data: dict[str, Any] = {
            "mode": mode,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": _machine(),
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
            "figures": {},
            "not_measured": {},
            "cross_checks": {},
            "errors": {},
        }

    def figure(self, key: str, fig: Any) -> None:
        """A goal's figure: a number or bool, or ``{value, min, max, repeat, ...}``."""
        if isinstance(fig, dict):
            fig = {k: v for k, v in fig.items() if k != "paired"}
        self.data["figures"][key] = fig
        self.data["not_measured"].pop(key, None)

    def missing(self, key: str, why: str) -> None:
        if key not in self.data["figures"]:
            self.data["not_measured"][key] = f"not measured in this run: {why}"

    def check(self, name: str, ok: bool) -> None:
        self.data["cross_checks"][name] = bool(ok)

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value


def main(argv: list[str] | None = None) -> int:
    # Dagster announces its beta/preview parameters on every definition; not our business here.
    warnings.filterwarnings("ignore", message=r".*currently in (beta|preview)")
    ap = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads, well under a minute (CI)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here (default bench-results.json in --workdir's parent)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a new one under $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory, and reuse its workloads next time")
    ap.add_argument("--only", default="", help=f"comma list of parts to run: {','.join(PARTS)}")
    ap.add_argument("--orchestration-runs", type=int, default=None, metavar="N",
                    help="runs of the orchestration part's workload (default 2,000; --quick 10, too few to tell "
                         "a per-run cost from each side's fixed start-up)")
    ap.add_argument("--repeat", type=int, default=None, metavar="N",
                    help="repetitions of the cheap comparisons (default 5; --quick 2)")
    ap.add_argument("--build-repeat", type=int, default=None, metavar="N",
                    help="repetitions of the whole-build comparisons (default 3; --quick 1): more place a "
                         "ratio more tightly on a noisy host")
    a = ap.parse_args(argv)

    cfg = dict(QUICK if a.quick else FULL)
    if a.orchestration_runs is not None:
        cfg["orchestration_runs"] = a.orchestration_runs
    for key, value in (("repeat", a.repeat), ("build_repeat", a.build_repeat)):
        if value is not None:
            if value < 1:
                ap.error(f"--{key.replace('_', '-')} {value}: give at least 1 repetition")
            cfg[key] = value
    parts = [p.strip() for p in a.only.split(",") if p.strip()] or list(PARTS)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    work = (a.workdir or Path(tempfile.mkdtemp(prefix="aml-bench-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    res = Results("quick" if a.quick else "full", cfg)
    ctx: dict[str, Any] = {}
    try:
        _log(f"workload: {cfg['runs']} runs x {cfg['minutes']:g} min in {work}")
        w = make_workload(work / "workload", runs=cfg["runs"], minutes=cfg["minutes"], reuse=a.keep)
        ctx["w"] = w
        res["workload"] = {"runs": len(w.runs), "nodes": w.nodes, "points": w.points,
                           "run_minutes": cfg["minutes"], "H": w.spec["historySteps"], "F": w.spec["horizonSteps"],
                           "beat_ms": w.spec["beatMs"], "stride": w.spec["stride"],
                           "simulate_seconds": w.seconds_simulate, "ingest_seconds": w.seconds_ingest}
        # windows and snapshot read the end-to-end build's output
        if {"windows", "snapshot"} & set(parts) and "build" not in parts:
            parts.insert(0, "build")
        for name in PARTS:
            if name in parts:
                _part(res, name, lambda name=name: PART_FUNCS[name](res, ctx, cfg, work, a))
            else:
                for g in GOALS:
                    if g.part == name:
                        res.missing(g.key, f"part {name!r} not selected (--only)")
    except Exception as e:  # noqa: BLE001 - the workload itself failed: reported like a part
        res.data["errors"]["workload"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        traceback.print_exc()
    finally:
        res["seconds_total"] = time.perf_counter() - started
        _finish(res)
        out = a.json or (work.parent / "bench-results.json" if a.workdir is None else work / "bench-results.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res.data, indent=1, default=_json_default) + "\n")
        print(render(res.data))
        print(f"\nJSON: {out}")
        if not a.keep:
            remove_tree(work)
    return 0 if res.data["ok"] else 1


# ---- parts ---------------------------------------------------------------------------------------


def _build(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    w = ctx["w"]
    try:
        staged = build_bench.run_staged(w.spec, w.tsdb_url, work / "staged", repeat=cfg["build_repeat"])
    except (ImportError, AttributeError) as e:
        # The staged copy calls pipeline internals that are being reworked; the end-to-end
        # figure below does not depend on them.
        res["stages"] = {"reason": f"not measured in this run: pipeline internals changed ({type(e).__name__}: {e})"}
        staged = None
    else:
        res["stages"] = staged
    remove_tree(work / "staged")
    _log(f"end-to-end build vs I/O floor, alternating, {cfg['repeat']} repetitions")
    b = build_bench.run(w.spec, w.tsdb_url, w.points, work, repeat=cfg["repeat"])
    res["build"] = b
    res.figure("e2e_over_floor", b["ratio"])
    ctx["e2e"] = b["e2e"]
    if staged is not None:
        res.check("staged build hash == end-to-end build hash", staged["sha256"] == [b["e2e"]["sha256"]])
        res.check("floor reads every point the build reads", b["floor"]["points"] == staged["points"])
    res.check("end-to-end snapshot current, blocking checks pass", bool(
        b["e2e"]["summary"]["current"] and all(b["e2e"]["summary"]["checks"].values())))


def _hampel(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    w = ctx["w"]
    _log(f"Hampel: ours, vectorised numpy, numba; {cfg['repeat']} repetitions")
    h = hampel_bench.run(w.tsdb_url, w.spec, repeat=cfg["repeat"])
    res["hampel"] = h
    res.figure("hampel_mpts_per_s", h["mpts_per_s"]["ours"])
    res.figure("hampel_flags_identical", h["flags_identical"])
    res.figure("hampel_over_numpy_vectorised", h["over_numpy_vectorised"])
    impls = " = ".join(["ours", *h["flag_mismatches"]])
    res.check(f"Hampel flags identical: {impls} (workload) = pure-Python oracle (adversarial)", h["flags_identical"])


def _windows(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    w, e2e = ctx["w"], ctx["e2e"]
    _log(f"windows: the snapshot writer's path vs PyTorch Forecasting; {cfg['repeat']} repetitions")
    out = windows_bench.run(Path(e2e["store"]), Path(e2e["snapshot_dir"]), w.spec, quick=a.quick,
                            repeat=cfg["repeat"], pf_runs=cfg["pf_runs"])
    res["windows"] = out
    res.check("windows: the timed path writes the snapshot's x, u, y byte for byte", out["snapshot"]["equal"])
    res.check("windows equal to the loop reference", out["reference"]["equal"])
    if out["pf"].get("available"):
        res.check("windows equal to PyTorch Forecasting's", out["pf"]["equal"])
        res.figure("windows_speedup_vs_pf", out["speedup_vs_pf"])
    else:
        res.missing("windows_speedup_vs_pf", out["pf"]["reason"])


def _snapshot(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    from bench import snapshot_bench

    keys = ("open_verify_rss_mb", "verify_over_sha256sum", "iter_batches_gb_per_s")
    _log(f"snapshot: {', '.join(keys)}")
    out = snapshot_bench.run(Path(ctx["e2e"]["snapshot_dir"]), repeat=cfg["repeat"])
    res["snapshot"] = out
    for k in keys:
        res.figure(k, out[k])


def _series(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    w = ctx["w"]
    _log(f"series layout vs windows layout: builds and the series floor alternating, {cfg['build_repeat']} repetitions; "
         f"stage table; consumers, {cfg['repeat']} repetitions")
    out = series_bench.run(w, work / "series", repeat=cfg["repeat"], build_repeat=cfg["build_repeat"])
    res["series"] = out
    res.figure("series_bytes_over_grid", out["bytes_over_grid"]["series"])
    res.figure("series_build_speedup", out["build_speedup"])
    res.figure("series_e2e_over_floor", out["e2e_over_floor"])
    ib = out["iter_batches_gb_per_s"]["series"]
    res.figure("series_iter_batches_gb_per_s", {"value": ib["median"], "min": ib["min"], "max": ib["max"], "repeat": ib["repeat"]})
    res.figure("series_iter_batches_over_windows", out["iter_batches_over_windows"])
    res.figure("series_open_verify_rss_mb", out["snapshot"]["open_verify_rss_mb"])
    res.figure("series_verify_over_sha256sum", out["snapshot"]["verify_over_sha256sum"])
    res.check("series layout: both builds current, blocking checks pass", out["checks_pass"])
    res.check("series layout: every window equals the windows layout's, byte for byte", out["same_windows"])
    res.check("series layout: an epoch serves the same windows in both layouts", out["iter_batches"]["same_windows_per_epoch"])
    remove_tree(work / "series")
    p = cfg["series_plant"]
    _log(f"series layout at plant scale: {p['runs']} runs x {p['nodes']} nodes x {p['minutes']:g} min, stride 1, "
         "through `aml-pipeline build`")
    plant = series_bench.plant_scale(work / "series_plant", **p, reuse=a.keep)
    out["plant_scale"] = plant
    res.figure("series_plant_scale_peak_rss_mb", plant["peak_rss_mb"])
    res.check("series layout at plant scale: current, blocking checks pass",
              bool(plant["current"] and all(plant["checks"].values())))


def _plots(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    from bench import plots_bench, url_image

    _log(f"plots: plot_ms_per_run, event_log_kb_per_run (SQLite and PostgreSQL instances), {cfg['repeat']} repetitions")
    try:
        with pg_bench.postgres_server() as (pg_base_url, _):
            out = plots_bench.run(repeat=cfg["repeat"], pg_base_url=pg_base_url)
    except pg_bench.NoServer as e:
        out = plots_bench.run(repeat=cfg["repeat"])
        out["event_log_pg"] = {"available": False, "reason": str(e)}
    res["plots"] = out
    spreads = [("plot_ms_per_run", out["plot_ms"]), ("event_log_kb_per_run", out["event_log_kb"])]
    if (out.get("event_log_pg") or {}).get("event_log_kb"):
        spreads.append(("event_log_kb_per_run_pg", out["event_log_pg"]["event_log_kb"]))
    for key, spread in spreads:
        res.figure(key, {"value": spread["median"], "min": spread["min"], "max": spread["max"], "repeat": len(spread["all"])})
    growth = plots_bench.instance_growth(work / "growth", **cfg["growth"])
    out["instance_growth"] = growth
    res.figure("instance_growth_kb_per_hour_after_gc", growth["ratio"])
    _log("plots: the plot as an image URL instead of base64 (event log; the UI in chromium)")
    out["url_image"] = url_image.run(workdir=fresh_dir(work / "url_image"), **cfg["url_image"])


def _dagster(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    w = ctx["w"]
    _log(f"Dagster (persistent instance) vs library build, alternating, {cfg['build_repeat']} repetitions")
    d = dagster_bench.run(w.spec, w.tsdb_url, work / "dagster", repeat=cfg["build_repeat"], profile=not a.quick)
    res["dagster"] = d
    res.figure("dagster_over_library", d["ratio"])
    res.check("Dagster and library publish the same sha256", d["same_sha256"])
    res.check("Dagster blocking checks pass", bool(d["current"]) and all((d["checks"] or {}).values()))


def _incremental(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    w = ctx["w"]
    _log(f"rebuilds through `aml-pipeline build`: full, unchanged, split edited; {cfg['build_repeat']} repetitions")
    r = dagster_bench.run_incremental(w.spec, w.tsdb_url, work / "incremental", repeat=cfg["build_repeat"])
    res["incremental"] = r
    res.figure("noop_rebuild_over_full", r["noop_over_full"])
    res.figure("split_edit_rebuild_over_full", r["split_edit_over_full"])
    res.check("unchanged rebuild publishes the same sha256", r["noop_same_sha256"])
    res.check("rebuild after a split edit = fresh build of the edited spec (sha256)", r["split_edit_same_as_fresh_build"])


def _parallel(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    w = ctx["w"]
    _log(f"Dagster build with 1 and 2 workers, {cfg['build_repeat']} repetitions")
    p = dagster_bench.run_parallel(w.spec, w.tsdb_url, work / "parallel", repeat=cfg["build_repeat"])
    _log(f"`aml-pipeline build` with --workers 1 and 2, whole build, fresh homes, {cfg['build_repeat']} repetitions")
    p["whole_build"] = dagster_bench.run_whole_build(w.spec, w.tsdb_url, work / "whole_build", repeat=cfg["build_repeat"])
    res["parallel"] = p
    res.figure("parallel_speedup_2_workers", p["speedup"])
    res.figure("parallel_whole_build_speedup_2_workers", p["whole_build"]["speedup"])
    res.check("1 and 2 workers publish the same sha256", p["same_sha256"] and p["whole_build"]["same_sha256"])


def _instance_servers(stack: contextlib.ExitStack) -> tuple[str | None, str | None, str | None, str | None]:
    """The PostgreSQL server and the PgBouncer in front of it that the Dagster instance figures use,
    entered on ``stack``: ``(base URL, where it comes from, pooler URL, why one is missing)``."""
    try:
        pg_base_url, server = stack.enter_context(pg_bench.postgres_server())
    except pg_bench.NoServer as e:
        return None, None, None, str(e)
    try:
        return pg_base_url, server, stack.enter_context(pg_bench.pooler(pg_base_url)), None
    except pg_bench.NoServer as e:
        return pg_base_url, server, None, str(e)


def _orchestration(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    n, minutes = cfg["orchestration_runs"], cfg["orchestration_minutes"]
    _log(f"orchestration: {n} runs x {minutes:g} min, Dagster (SQLite; PostgreSQL direct and through PgBouncer) vs library, "
         "each beside Dagster's floor (the same runs in the same asset shape, no work), "
         f"{cfg['orchestration_repeat']} repetition(s)")
    plant = make_workload_in_subprocess(work / "plant-small-runs", runs=n, minutes=minutes, reuse=a.keep)
    with contextlib.ExitStack() as stack:
        pg_base_url, server, pg_pooled_url, why = _instance_servers(stack)
        if pg_base_url is None:
            res.missing("orchestration_ms_per_run_pg", why)
            res.missing("product_over_floor_ms_per_run_pg", why)
        if pg_pooled_url is None:
            res.missing("orchestration_ms_per_run_pg_pooled", why)
            res.missing("product_over_floor_ms_per_run_pg_pooled", why)
        o = dagster_bench.run_orchestration(plant.spec, plant.tsdb_url, n, work / "orchestration",
                                            repeat=cfg["orchestration_repeat"], pg_base_url=pg_base_url,
                                            pg_pooled_url=pg_pooled_url)
    o["points"] = plant.points
    o["server_pg"] = server
    res["orchestration"] = o
    res.figure("orchestration_ms_per_run", o["ms_per_run"])
    if "ms_per_run_pg" in o:
        res.figure("orchestration_ms_per_run_pg", o["ms_per_run_pg"])
    if "ms_per_run_pg_pooled" in o:
        res.figure("orchestration_ms_per_run_pg_pooled", o["ms_per_run_pg_pooled"])
    for suffix in ("", "_pg", "_pg_pooled"):
        if f"product_over_floor_ms_per_run{suffix}" in o:
            res.figure(f"product_over_floor_ms_per_run{suffix}", o[f"product_over_floor_ms_per_run{suffix}"])
    res.check("orchestration workload: Dagster (every instance) and library publish the same sha256", o["same_sha256"])


def _run_figures(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    n, runs, repeat = cfg["run_figures_partitions"], cfg["run_figures_runs"], cfg["run_figures_repeat"]
    _log(f"run_figures: each run's figures on its materialisation (checked), as one observation, one per stage, or on each stage's materialisation unchecked (the build), {runs} of {n:,} run partitions "
         f"recorded, {repeat} repetition(s) per instance")
    with contextlib.ExitStack() as stack:
        pg_base_url, _, pg_pooled_url, why = _instance_servers(stack)
        if why:
            _log(f"run_figures: without {'PgBouncer' if pg_base_url else 'PostgreSQL'} ({why})")
        f = dagster_bench.figures_cost(work / "run_figures", partitions=n, runs=runs, repeat=repeat,
                                       pg_base_url=pg_base_url, pg_pooled_url=pg_pooled_url)
        _log(f"run_figures: Dagster's partition check of per-partition metadata at "
             f"{', '.join(map(str, cfg['lookup_partitions']))} run partitions, {cfg['lookup_repeat']} repetitions")
        f["partition_lookup"] = dagster_bench.partition_lookup(
            work / "run_figures", counts=tuple(cfg["lookup_partitions"]), repeat=cfg["lookup_repeat"],
            pg_base_url=pg_base_url, pg_pooled_url=pg_pooled_url)
        res["run_figures"] = f


def _rss(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    piece, (short, long) = cfg["rss_piece_minutes"], cfg["rss_pieces"]
    _log(f"peak RSS by run length: one run of {short} vs {long} x {piece:g} min, fresh process per build, "
         f"{cfg['build_repeat']} repetitions")
    r = memory.run(work / "rss", piece_minutes=piece, short_pieces=short, long_pieces=long,
                   repeat=cfg["build_repeat"], reuse=a.keep)
    res["rss"] = r
    res.figure("rss_long_run_ratio", r["rss_ratio"])
    res.figure("rss_long_run_mb", r["rss_long_mb"])
    res.figure("long_run_points_per_s_ratio", r["points_per_s_ratio"])
    res.check("run-length builds: snapshots current, same points every repetition",
              r["all_current"] and r["points_deterministic"])


def _pg(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    w = ctx["w"]
    _log(f"PostgreSQL: adapter fetch vs raw COPY, {cfg['repeat']} repetitions")
    p = pg_bench.run(w.tsdb_url, w.spec, repeat=cfg["repeat"])
    res["pg"] = p
    if p.get("available"):
        res.figure("pg_fetch_over_copy", p["ratio"])
        res.check("PostgreSQL fetch returns every row COPY returns", p["same_rows"])
    else:
        res.missing("pg_fetch_over_copy", p["reason"])


def _sources(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    w = ctx["w"]
    _log(f"mapped sources: PostgreSQL table vs binary COPY, Parquet lake vs embedded file and DuckDB's scan, "
         f"OPC UA history vs embedded file, {cfg['repeat']} repetitions")
    out = sources_bench.run(w.tsdb_url, w.spec, work / "sources", repeat=cfg["repeat"])
    res["sources"] = out
    lake = out["lake"]
    res.figure("lake_over_scan", lake["lake_over_scan"])
    res.figure("parquet_over_embedded_points_per_s", lake["ratio"])  # reported, no goal: DuckDB's own decoding bounds it
    op = out["opcua"]
    res.figure("opcua_fetch_points_per_s", op["points_per_s"]["opcua"])  # reported, no goal: the server bounds it
    res.figure("opcua_over_embedded_points_per_s", op["ratio"])
    res.check("OPC UA source returns the embedded file's points", op["same_points"])
    res.check("OPC UA reads leave no continuation point open", op["open_continuation_points"] == 0)
    res.check("Parquet lake through its mapping returns the embedded file's points", lake["same_points"])
    res.check("Parquet lake in time order through its mapping returns the embedded file's points",
              out["lake_in_time_order"]["same_points"])
    res.check("Parquet lake of a file a day through its mapping returns the embedded file's points",
              out["lake_a_file_a_day"]["same_points"])
    res.check("DuckDB's plain scan of the lake reads as many points as the mapping",
              all(out[k]["scan_same_count"] for k in ("lake", "lake_in_time_order", "lake_a_file_a_day")))
    pg = out["pg"]
    if pg.get("available"):
        res.figure("mapped_pg_fetch_over_copy", pg["ratio"])
        res.figure("mapped_version_over_fetch", pg["version_over_fetch"])
        res.check("mapped PostgreSQL fetch returns every row COPY returns", pg["same_rows"])
    else:
        res.missing("mapped_pg_fetch_over_copy", pg["reason"])
        res.missing("mapped_version_over_fetch", pg["reason"])


def _live(res: Results, ctx: dict[str, Any], cfg: dict[str, Any], work: Path, a: argparse.Namespace) -> None:
    from bench import live_bench

    _log("live inputs: causal and plain snapshots of the workload, every window's live x, latency from memory, "
         "the embedded file and PostgreSQL, the grid stage with beat means")
    out = live_bench.run(ctx["w"], work / "live", repeat=cfg["repeat"], quick=a.quick)
    res["live"] = out
    share = out["share"]
    res.figure("causal_windows_equal_live_share", share["causal"]["share"])
    res.check("causal snapshot: every live x compared equals its window", share["causal"]["share"] == 1.0)
    res.check("plain snapshot: every differing live x row is marked may_differ",
              share["plain"]["differing_all_marked_may_differ"])
    p = out["points"]
    res.figure("live_inputs_from_points_ms", {"value": p["ms"]["ours"]["median"], "min": p["ms"]["ours"]["min"],
                                              "max": p["ms"]["ours"]["max"], "repeat": p["timings"]["repeat"]})
    res.check("live input from held points equals its window", p["equal_to_window"])
    if p["pf"].get("available"):
        res.check("PyTorch Forecasting's encoder for the same history equals the live x", p["pf"]["encoder_equals_live_x"])
    t = out["tsdb"]
    res.figure("live_inputs_from_tsdb_ms", {"value": t["embedded"]["p99_ms"], "min": t["embedded"]["min_ms"],
                                            "max": t["embedded"]["max_ms"], "repeat": t["calls"]})
    if "p99_ms" in t.get("postgresql", {}):
        res.figure("live_inputs_from_tsdb_pg_ms", {"value": t["postgresql"]["p99_ms"], "min": t["postgresql"]["min_ms"],
                                                   "max": t["postgresql"]["max_ms"], "repeat": t["calls"]})
    else:
        res.missing("live_inputs_from_tsdb_pg_ms", t["postgresql"]["reason"])
    res.check("live inputs read from the TSDBs equal their windows", all(t["equal_to_windows"].values()))
    res.figure("aggregate_mean_mpts_per_s", out["aggregate"]["ratio"])


PART_FUNCS = {
    "build": _build, "hampel": _hampel, "windows": _windows, "snapshot": _snapshot, "series": _series, "plots": _plots,
    "dagster": _dagster, "incremental": _incremental, "parallel": _parallel, "orchestration": _orchestration,
    "run_figures": _run_figures, "rss": _rss, "pg": _pg, "sources": _sources, "live": _live,
}


def _part(res: Results, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - one failing part must not hide the others' results
        res.data["errors"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        for g in GOALS:
            if g.part == name:
                res.missing(g.key, f"part {name!r} raised {type(e).__name__} (see errors)")
        traceback.print_exc()
    res.data.setdefault("part_seconds", {})[name] = time.perf_counter() - t0


# ---- output --------------------------------------------------------------------------------------


def _value(fig: Any) -> Any:
    return fig.get("value", fig.get("median")) if isinstance(fig, dict) else fig


def _finish(res: Results) -> None:
    d = res.data
    goals = {}
    for g in GOALS:
        fig = d["figures"].get(g.key)
        if fig is None:
            d["not_measured"].setdefault(g.key, "not measured in this run: the run stopped before this part")
        v = _value(fig)
        d[g.key] = v
        if v is None:
            met = None
        elif g.op == "<=":
            met = v <= g.target
        elif g.op == ">=":
            met = v >= g.target
        else:
            met = v == g.target
        entry = {"what": g.what, "value": v, "target": f"{g.op} {g.target}{(' ' + g.unit) if g.unit else ''}",
                 "met": met}
        if isinstance(fig, dict):
            entry.update({k: fig[k] for k in ("min", "max", "repeat") if k in fig})
        if v is None:
            entry["reason"] = d["not_measured"][g.key]
        goals[g.key] = entry
    d["goals"] = goals
    failed = [k for k, ok in d["cross_checks"].items() if not ok] + [f"error in {k}" for k in d["errors"]]
    d["ok"] = not failed
    d["failed"] = failed


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if abs(v) >= 1e6:
            return f"{v / 1e6:.{nd}f} M"
        if abs(v) >= 1e4:
            return f"{v / 1e3:.1f} k"
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.{nd}f}"
    return str(v)


def _t(t: dict[str, Any]) -> str:
    """A timing summary as 'median s [min-max] xN'."""
    s = t["seconds"] if "seconds" in t else t
    return f"{s['median']:.3f} s [{s['min']:.3f}-{s['max']:.3f}] x{s['repeat']}"


def render(d: dict[str, Any]) -> str:
    L: list[str] = []
    wl = d.get("workload", {})
    L.append(f"aml_pipeline benchmark ({d['mode']}) {d['date']}  {d['machine']['cpu']} x{d['machine']['cpus']}")
    L.append("every figure: median [min-max] over N alternating repetitions, both sides in this run")
    if wl:
        L.append(f"workload: {wl['runs']} runs x {wl['nodes']} nodes, {wl['run_minutes']:g} min each, "
                 f"{wl['points']:,} points; beat {wl['beat_ms']} ms, H={wl['H']}, F={wl['F']}, stride {wl['stride']}")
    st = d.get("stages")
    if st and "stages" in st:
        L.append("")
        L.append(f"{'stage':<12}{'seconds':>10}{'points/s':>14}{'share':>8}   (library build, per-stage median of {st['total_seconds']['repeat']})")
        for r in st["stages"]:
            extra = f"   {r['mb_per_s']:.0f} MB/s of arrays" if r.get("mb_per_s") else ""
            if r.get("overlapped"):
                extra += "   (thread seconds: in threads beside each other; run_stages is their span)"
            L.append(f"{r['stage']:<12}{r['seconds']:>10.3f}{_fmt(r['points_per_s']):>14}{_fmt((r['share'] or 0) * 100, 1) + '%':>8}{extra}")
        L.append(f"{'total':<12}{st['total_seconds']['median']:>10.3f}   {st['windows']:,} windows, {st['output_bytes'] / 1e6:.0f} MB of arrays")
    elif st:
        L.append(f"\nstages: {st['reason']}")
    if "build" in d:
        b = d["build"]
        f, t = b["floor"], b["timings"]
        L.append("")
        L.append(f"I/O floor {_t(t['floor'])}: read {f['points']:,} points {f['read_seconds']['median']:.3f} s "
                 f"+ write & fsync {f['bytes_written'] / 1e6:.0f} MB {f['write_seconds']['median']:.3f} s")
        L.append(f"end-to-end library build {_t(t['build'])} ({_fmt(b['e2e']['points_per_s'])} points/s)")
    if "hampel" in d:
        h = d["hampel"]
        L.append("")
        L.append(f"Hampel k={h['k']} on {h['series']} series, {h['points']:,} points, one call per series:")
        for name, r in h["mpts_per_s"].items():
            L.append(f"  {name:<18}{_t(h['timings'][name])}  {r['value']:.2f} M points/s")
        L.append(f"  ours on one long series: {h['mpts_per_s_long_series']['value']:.2f} M points/s; cpu/wall {h['cpu_over_wall_ours']:.2f}")
        if not h["numba"]["available"]:
            L.append(f"  numba: {h['numba']['reason']}")
        L.append(f"  flag mismatches vs ours: {h['flag_mismatches']}; adversarial vs oracle: {h['adversarial_mismatches']}")
    if "windows" in d:
        wd = d["windows"]
        L.append("")
        L.append(f"windows on {wd['ours']['runs']} runs: ours {_t(wd['timings']['ours'])}, {wd['ours']['windows']:,} windows "
                 f"({_fmt(wd['ours']['windows_per_s'])}/s)")
        pf = wd["pf"]
        if pf.get("available"):
            L.append(f"  PyTorch Forecasting {_t(wd['timings']['pytorch_forecasting'])}, {pf['windows']:,} windows "
                     f"({_fmt(pf['windows_per_s'])}/s); {pf['ours_only_windows']} more of ours, all explained: "
                     f"{_fmt(pf['ours_only_explained_by_feature_future_nan'])}; {pf['compared_windows']:,} compared, "
                     f"{pf['value_mismatches']} mismatches")
        else:
            L.append(f"  PyTorch Forecasting: {pf['reason']}")
    if "series" in d:
        se = d["series"]
        t, by = se["timings"], se["bytes"]
        L.append("")
        L.append(f"series layout: {by['series'] / 1e6:.1f} MB of arrays = {se['bytes_over_grid']['series']:.2f}x the "
                 f"{by['grid'] / 1e6:.1f} MB float32 grid (windows layout {by['windows'] / 1e6:.0f} MB, "
                 f"{se['bytes_over_grid']['windows']:.1f}x)")
        L.append(f"  build: windows {_t(t['windows'])}, series {_t(t['series'])}, series floor {_t(t['floor'])} "
                 f"(read {se['floor']['read_seconds']['median']:.3f} s, write & fsync "
                 f"{se['floor']['write_seconds']['median']:.3f} s)")
        st = se["stages"]
        L.append("  series build stages: " + ", ".join(
            f"{r['stage']} {r['seconds']:.3f} s" + (f" ({_fmt(r['points_per_s'])} points/s)" if r["stage"] in ("fetch", "clean", "align", "run_stages") else "")
            for r in st["stages"]))
        ib = se["iter_batches_gb_per_s"]
        L.append(f"  shuffled batches: series {ib['series']['median']:.2f} GB/s [{ib['series']['min']:.2f}-{ib['series']['max']:.2f}], "
                 f"windows {ib['windows']['median']:.2f} GB/s [{ib['windows']['min']:.2f}-{ib['windows']['max']:.2f}]; "
                 f"open + verify {se['snapshot']['open_verify_rss_mb']:.1f} MB peak RSS, "
                 f"{se['snapshot']['verify_over_sha256sum']:.2f}x sha256sum")
        pl = se.get("plant_scale")
        if pl:
            L.append(f"  plant scale ({pl['runs']} runs x {pl['nodes']} nodes x {pl['run_minutes']:g} min, stride {pl['stride']}, "
                     f"{pl['points']:,} points, {sum(pl['windows'].values()):,} windows): `aml-pipeline build` "
                     f"{pl['build_seconds']:.1f} s, peak RSS {pl['peak_rss_mb']:.0f} MB, arrays {pl['array_bytes'] / 1e6:.0f} MB "
                     f"(the windows layout's would be {pl['windows_layout_array_bytes'] / 1e9:.1f} GB)")
    if "dagster" in d:
        dg_ = d["dagster"]
        L.append("")
        L.append(f"Dagster {_t(dg_['timings']['dagster'])} vs library {_t(dg_['timings']['library'])}")
        prof = dg_.get("profile")
        if prof and prof.get("available"):
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in prof["seconds_by_part"].items())
            L.append(f"  profiled Dagster build ({prof['seconds']:.2f} s): {parts}")
        ev = dg_.get("events")
        if ev:
            top = ", ".join(f"{k} {v['events']} x {v['ms_per_event']:.1f} ms" for k, v in list(ev["by_event"].items())[:6])
            L.append(f"  events stored by one more build ({ev['build_seconds']:.2f} s): {ev['events']} in "
                     f"{ev['store_seconds']:.2f} s ({ev['storage']}); {top}")
    for key, label in (("incremental", "rebuilds"), ("parallel", "workers"), ("orchestration", "orchestration")):
        if key in d:
            L.append("")
            L.append(f"{label}: " + "; ".join(f"{side} {_t(t)}" for side, t in d[key]["timings"].items()
                                              if isinstance(t, dict) and "seconds" in t))
            if key == "orchestration" and "floor" in d[key]:
                fl = d[key]["floor"]
                L.append(f"  Dagster's floor ({fl['runs']:,} runs recorded in the same asset shape, no work): " + "; ".join(
                    f"{instance} {t['median']:.1f} ms a run [{t['min']:.1f}-{t['max']:.1f}]"
                    for instance, t in fl["ms_per_run"].items()))
            if key == "parallel" and "library_speedup_2_processes" in d[key]:
                p = d[key]
                L.append(f"  2 workers / 1: x{_fmt(p['speedup']['value'])}; the same run stages without Dagster in a "
                         f"warm pool of 2 processes / 1: x{_fmt(p['library_speedup_2_processes']['value'])}")
            if key == "parallel" and "whole_build" in d[key]:
                wb = d[key]["whole_build"]
                L.append("  whole `aml-pipeline build`: " + "; ".join(
                    f"{side} {_t(t)}" for side, t in wb["timings"].items() if isinstance(t, dict) and "seconds" in t))
                L.append(f"  --workers 2 / 1: x{_fmt(wb['speedup']['value'])} (used {wb['workers_used']['used']} "
                         f"worker(s){': ' + wb['workers_used']['why'] if wb['workers_used'].get('why') else ''}); "
                         f"two chunk runs forced: x{_fmt(wb['speedup_forced']['value'])}")
    if "run_figures" in d:
        f = d["run_figures"]
        L.append("")
        L.append(f"per-run figures ({f['runs']} of {f['partitions']:,} run partitions recorded), ms a run: " + "; ".join(
            f"{instance}: " + ", ".join(f"{mode} {t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}]" for mode, t in by_mode.items())
            for instance, by_mode in f["ms_per_run"].items()))
        for instance, by_count in f.get("partition_lookup", {}).get("ms", {}).items():
            L.append(f"  the metadata way's partition check per run ({instance}): " + "; ".join(
                f"{int(n):,} partitions {t['median']:.1f} ms [{t['min']:.1f}-{t['max']:.1f}]" for n, t in by_count.items()))
    if "rss" in d:
        r = d["rss"]
        L.append("")
        L.append("run length: " + "; ".join(
            f"{n} {v['minutes'] / 1440:g} d ({v['points']:,} points): {_t(r['timings'][n])}, "
            f"peak RSS {r['timings'][n]['peak_rss_mb']['median']:.0f} MB" for n, v in r["runs"].items()))
    if "pg" in d:
        p = d["pg"]
        L.append("")
        if p.get("available"):
            t = p["timings"]
            L.append(f"PostgreSQL ({p['server']}): fetch {_t(t['fetch'])}, COPY text {_t(t['copy_text'])}, "
                     f"binary {_t(t['copy_binary'])}; {p['points']:,} points")
        else:
            L.append(f"PostgreSQL: {p['reason']}")
    if "plots" in d:
        pl = d["plots"]
        L.append("")
        L.append(f"run plot: PNG {pl['png_kb_per_run']['median']:.1f} KB a run, markdown {pl['markdown_kb_per_run']['median']:.1f} KB; "
                 f"its bands alone {pl['bands_png_kb_per_run']['median']:.1f} KB as PNG, "
                 f"{pl['bands_webp_lossless_kb_per_run']['median']:.1f} KB as lossless WebP at its smallest, which as SQLite "
                 f"event log would be {pl['event_log_kb_floor_bands_webp']['median']:.1f} KB")
        pg = pl.get("event_log_pg") or {}
        if "event_log_kb" in pg:
            e = pg["event_log_kb"]
            f = pg["fresh_event_log_kb"]
            L.append(f"  the plot's share of a PostgreSQL instance's event log: {e['median']:.1f} KB a run "
                     f"[{e['min']:.1f}-{e['max']:.1f}] x{len(e['all'])} rebuilt after VACUUM; the first build into a "
                     f"fresh database {f['median']:.1f} KB [{f['min']:.1f}-{f['max']:.1f}] "
                     f"(SQLite: {pl['event_log_kb']['median']:.1f} KB)")
        elif pg:
            L.append(f"  PostgreSQL instance: {pg['reason']}")
        if "url_image" in pl:
            u = pl["url_image"]
            kb = u["event_log_kb_per_run"]
            md = u["markdown_kb_per_run"]
            L.append(f"  the plot as an image URL (not built; {u['runs']} runs, SQLite): {kb['url']:.1f} KB a run of event "
                     f"log against {kb['data_uri']:.1f} KB as base64 (its markdown {md['url']:.2f} KB against "
                     f"{md['data_uri']:.1f}), the PNGs {u['image_kb_per_run']:.1f} KB a run elsewhere")
            if "ui" in u:
                ui = u["ui"]
                L.append(f"  the UI in chromium: image {'shown' if ui['rendered'] else 'NOT shown'} "
                         f"({'in the metadata table' if ui['inline'] else 'behind [Show Markdown]'}), "
                         f"{ui['visible_width']} of its {ui['png_size'][0]} px wide in view on a 1366 px screen; "
                         f"img-src in the webserver's CSP: {'yes' if ui['csp_has_img_src'] else 'none'}")
    if "sources" in d:
        so = d["sources"]
        lk = so["lake"]
        L.append("")
        L.append(f"mapped sources, {so['points']:,} points of {so['runs']} runs: Parquet lake ({lk['files']} files) "
                 f"{_t(lk['timings']['lake'])} {_fmt(lk['points_per_s']['lake'])} points/s; embedded file "
                 f"{_t(lk['timings']['embedded'])} {_fmt(lk['points_per_s']['embedded'])} points/s (rows sorted by tag)")
        L.append(f"  DuckDB's plain scan of the same rows (no order, no split by node): {_t(lk['timings']['scan'])} "
                 f"{_fmt(lk['points_per_s']['scan'])} points/s, {lk['scan_over_embedded']['value']:.2f} of the embedded file's")
        L.append(f"  the lake's read over that scan (lake_over_scan): {lk['lake_over_scan']['value']:.2f} "
                 f"[{lk['lake_over_scan']['min']:.2f}-{lk['lake_over_scan']['max']:.2f}]; over the embedded file's "
                 f"points/s: {lk['ratio']['value']:.2f} (reported, no goal)")
        op = so["opcua"]
        L.append(f"  OPC UA history (loopback, {op['values_per_request']:,} values a request): {_t(op['timings']['opcua'])} "
                 f"{_fmt(op['points_per_s']['opcua'])} points/s, {op['ratio']['value']:.3f} of the embedded file's "
                 f"[{op['ratio']['min']:.3f}-{op['ratio']['max']:.3f}]; {op['pages_per_node']:.2f} HistoryRead answers "
                 f"per node and run")
        lt = so["lake_in_time_order"]
        L.append(f"  the lake with rows in time order: {_t(lt['timings']['lake'])} {_fmt(lt['points_per_s']['lake'])} points/s; "
                 f"embedded {_t(lt['timings']['embedded'])}; ratio {lt['ratio']['value']:.2f} "
                 f"[{lt['ratio']['min']:.2f}-{lt['ratio']['max']:.2f}]")
        ld = so["lake_a_file_a_day"]
        L.append(f"  the lake with a file a day ({ld['files']} files): {_t(ld['timings']['lake'])} "
                 f"{_fmt(ld['points_per_s']['lake'])} points/s; embedded {_t(ld['timings']['embedded'])}; ratio "
                 f"{ld['ratio']['value']:.2f} [{ld['ratio']['min']:.2f}-{ld['ratio']['max']:.2f}]; DuckDB's plain scan "
                 f"{_t(ld['timings']['scan'])}")
        pg = so["pg"]
        if pg.get("available"):
            t = pg["timings"]
            other = next(k for k in t if k.startswith("fetch_"))
            L.append(f"  PostgreSQL table: fetch ({pg['transfer']}) {_t(t['fetch'])}, {other.split('_', 1)[1]} {_t(t[other])}, "
                     f"binary COPY {_t(t['copy_binary'])}, node by node {_t(t['pages'])}")
            L.append(f"  versions of every run, one call {_t(t['versions'])}, a call per run {_t(t['versions_one_by_one'])}")
        else:
            L.append(f"  PostgreSQL: {pg['reason']}")
    if "live" in d:
        lv = d["live"]
        L.append("")
        for name in ("causal", "plain"):
            sh = lv["share"][name]
            every = "every window" if sh["stride"] == 1 else f"every {sh['stride']}th window"
            L.append(f"live x equal to its window, {name} snapshot ({sh['of']:,} windows): {sh['equal']:,} of {sh['windows']:,} "
                     f"({every}): {_fmt(sh['share'], 4)}; {sh['differ']:,} differ "
                     f"(all rows marked may_differ: {_fmt(sh['differing_all_marked_may_differ'])}), "
                     f"{sh['refused_live_gap']:,} need a point after the origin")
        for how, wy in lv["why"].items():
            L.append(f"  one 1 Hz node ({how.replace('_', ' ')}), {wy['points']:,} points, 60 spikes, H {wy['H']}: windows whose "
                     f"history differs from the live one: plain {wy['plain']['differ']:,} of {wy['plain']['windows']:,} "
                     f"({_fmt(100 * wy['plain']['share_differ'], 1)}%, {wy['plain']['rows_differ']:,} rows), causal "
                     f"{wy['causal']['differ']:,} of {wy['causal']['windows']:,}")
        pm = lv["points"]["ms"]
        L.append(f"live input from held points: ours {pm['ours']['median']:.3f} ms [{pm['ours']['min']:.3f}-{pm['ours']['max']:.3f}]"
                 + (f"; PyTorch Forecasting from_dataset(predict=True) {pm['pytorch_forecasting']['median']:.3f} ms "
                    f"[{pm['pytorch_forecasting']['min']:.3f}-{pm['pytorch_forecasting']['max']:.3f}]"
                    if "pytorch_forecasting" in pm else f"; PyTorch Forecasting: {lv['points']['pf'].get('reason', '-')}"))
        for db in ("embedded", "postgresql"):
            t = lv["tsdb"].get(db, {})
            if "p99_ms" in t:
                L.append(f"  read from the {db} TSDB: median {t['median_ms']:.2f} ms, p99 {t['p99_ms']:.2f} ms over "
                         f"{lv['tsdb']['calls']} origins")
        ag = lv["aggregate"]
        L.append(f"grid stage over {ag['points']:,} points: point values {_fmt(ag['mpts_per_s']['point'])} M points/s, "
                 f"beat means {_fmt(ag['mpts_per_s']['mean'])} M points/s; ratio {ag['ratio']['value']:.2f} "
                 f"[{ag['ratio']['min']:.2f}-{ag['ratio']['max']:.2f}]")
    L.append("")
    note = "   (quick mode: the goals are for the full run)" if d["mode"] == "quick" else ""
    L.append(f"{'goal':<36}{'median':>10}  {'[min-max] xN':<22}{'target':<18}met{note}")
    for key, g in d["goals"].items():
        met = "-" if g["met"] is None else ("yes" if g["met"] else "NO")
        rng = f"[{_fmt(g['min'])}-{_fmt(g['max'])}] x{g['repeat']}" if "min" in g else ""
        L.append(f"{key:<36}{_fmt(g['value']):>10}  {rng:<22}{g['target']:<18}{met}")
    for key, g in d["goals"].items():
        if g.get("reason"):
            L.append(f"  {key}: {g['reason']}")
    L.append("")
    for name, ok in d["cross_checks"].items():
        L.append(f"[{'ok' if ok else 'FAIL'}] {name}")
    for name, err in d["errors"].items():
        L.append(f"[ERROR] {name}: {err['error']}")
    L.append(f"total {d['seconds_total']:.1f} s; {'all cross-checks passed' if d['ok'] else 'FAILED: ' + '; '.join(d['failed'])}")
    return "\n".join(L)


def _machine() -> dict[str, Any]:
    import numpy as np

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform(), "load_avg_at_start": os.getloadavg()}


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (Path, set)):
        return str(o) if isinstance(o, Path) else sorted(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
