"""Benchmark suite: speed and memory of the dataset build, against references measured in the
same run. See bench/README.md for what is measured and how.

    .venv/bin/python bench/run.py [--quick] [--json PATH] [--workdir DIR] [--keep]

Exit status: 0 if every correctness cross-check passed (identical Hampel flags, windows equal
to the reference and to PyTorch Forecasting's, staged = end-to-end = Dagster snapshot hash,
blocking checks passed, PostgreSQL rows complete), 1 otherwise. Speed goals are reported, never
enforced: the machine is shared and timings are noisy.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import build_bench, dagster_bench, hampel_bench, memory, pg_bench, windows_bench  # noqa: E402
from bench.workload import make_workload, make_workload_in_subprocess  # noqa: E402

# name: (json key, target, "<=" or ">=", unit)
GOALS = {
    "end-to-end build / I/O floor": ("e2e_over_floor", 2.0, "<=", "x"),
    "exact Hampel, one core": ("hampel_mpts_per_s", 10.0, ">=", "M points/s"),
    "Hampel flags identical to the reference": ("hampel_flags_identical", True, "==", ""),
    "windowing vs TimeSeriesDataSet": ("windows_speedup_vs_pf", 50.0, ">=", "x"),
    "peak RSS 128 runs / 8 runs": ("rss_ratio_128_over_8", 1.3, "<=", "x"),
    "Dagster backfill + manifest / library": ("dagster_over_library", 1.5, "<=", "x"),
    # Time ratio: the adapter reaches at least half of COPY's points/s iff this is <= 2.
    "PostgreSQL adapter fetch / raw COPY (time)": ("pg_fetch_over_copy", 2.0, "<=", "x"),
}

FULL = dict(runs=32, minutes=120.0, rss_runs=(8, 32, 128), repeat=3, pf_runs=8)
QUICK = dict(runs=4, minutes=10.0, rss_runs=(1, 2, 4), repeat=1, pf_runs=1)


def main(argv: list[str] | None = None) -> int:
    # Dagster announces its beta/preview parameters on every definition; not our business here.
    warnings.filterwarnings("ignore", message=r".*currently in (beta|preview)")
    ap = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workload, a few seconds (CI)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here (default bench-results.json in --workdir's parent)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a new one under $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--only", default="", help="comma list of parts to run: build,hampel,windows,dagster,rss,pg")
    a = ap.parse_args(argv)

    cfg = QUICK if a.quick else FULL
    parts = {p.strip() for p in a.only.split(",") if p.strip()} or {"build", "hampel", "windows", "dagster", "rss", "pg"}
    work = a.workdir or Path(tempfile.mkdtemp(prefix="aml-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    res: dict[str, Any] = {
        "mode": "quick" if a.quick else "full",
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else "bench.run.main",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": _machine(),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "cross_checks": {},
        "errors": {},
    }
    for key, *_ in GOALS.values():
        res.setdefault(key, None)
    res["pg_fetch_over_copy"] = None
    try:
        _log(f"workload: {cfg['runs']} runs x {cfg['minutes']:g} min in {work}")
        w = make_workload(work / "workload", runs=cfg["runs"], minutes=cfg["minutes"], reuse=a.keep)
        res["workload"] = {"runs": len(w.runs), "nodes": w.nodes, "points": w.points,
                           "run_minutes": cfg["minutes"], "H": w.spec["historySteps"], "F": w.spec["horizonSteps"],
                           "beat_ms": w.spec["beatMs"], "stride": w.spec["stride"],
                           "simulate_seconds": w.seconds_simulate, "ingest_seconds": w.seconds_ingest}
        staged_dir = work / "staged"
        if parts & {"build", "windows"}:
            _part(res, "build", lambda: _build(res, w, cfg, work, staged_dir))
        if "hampel" in parts:
            _part(res, "hampel", lambda: _hampel(res, w, cfg, a.quick))
        if "windows" in parts:
            _part(res, "windows", lambda: _windows(res, w, cfg, staged_dir, a.quick))
        shutil.rmtree(staged_dir, ignore_errors=True)
        if "dagster" in parts:
            _part(res, "dagster", lambda: _dagster(res, w, cfg, work))
        if "rss" in parts:
            _part(res, "rss", lambda: _rss(res, cfg, work))
        if "pg" in parts:
            _part(res, "pg", lambda: _pg(res, w, cfg))
    finally:
        res["seconds_total"] = time.perf_counter() - started
        res["goals"] = _goals(res)
        failed = [k for k, ok in res["cross_checks"].items() if not ok] + [f"error in {k}" for k in res["errors"]]
        res["ok"] = not failed
        res["failed"] = failed
        out = a.json or (work.parent / "bench-results.json" if a.workdir is None else work / "bench-results.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=_json_default) + "\n")
        print(render(res))
        print(f"\nJSON: {out}")
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if res["ok"] else 1


# ---- parts ---------------------------------------------------------------------------------------


def _build(res: dict[str, Any], w, cfg: dict[str, Any], work: Path, staged_dir: Path) -> None:
    repeat = cfg["repeat"]
    _log("library build, stage by stage")
    staged = None
    for i in range(max(1, repeat - 1)):
        s = build_bench.staged_build(w.spec, w.tsdb_url, staged_dir)
        if staged is None:
            staged = s
        else:  # per-stage best
            for k, v in s["seconds"].items():
                staged["seconds"][k] = min(staged["seconds"].get(k, v), v)
            staged["total_seconds"] = min(staged["total_seconds"], s["total_seconds"])
    assert staged is not None
    res["stages"] = build_bench.summarize_stages(staged)
    res["staged_build"] = {k: v for k, v in staged.items() if k != "seconds"}

    _log(f"end-to-end build vs I/O floor, alternating, best of {repeat}")
    sizes = None
    e2e_times, floor_times, floor_runs = [], [], []
    e2e = None
    for i in range(repeat):
        e2e = build_bench.e2e_build(w.spec, w.tsdb_url, work / "e2e")
        e2e_times.append(e2e["seconds"])
        sizes = e2e["array_bytes"]
        shutil.rmtree(work / "e2e", ignore_errors=True)
        f = build_bench.io_floor(w.spec, w.tsdb_url, sizes, work / "floor")
        floor_times.append(f["seconds"])
        floor_runs.append(f)
    assert e2e is not None
    best_floor = min(floor_runs, key=lambda f: f["seconds"])
    res["e2e"] = {"seconds": min(e2e_times), "all": e2e_times, "summary": e2e["summary"],
                  "output_bytes": sum(sizes.values()), "points_per_s": w.points / min(e2e_times)}
    res["floor"] = {**best_floor, "all": floor_times,
                    "read_points_per_s": best_floor["points"] / best_floor["read_seconds"],
                    "write_mb_per_s": best_floor["bytes_written"] / best_floor["write_seconds"] / 1e6}
    res["e2e_over_floor"] = min(e2e_times) / best_floor["seconds"]
    res["cross_checks"]["staged build hash == end-to-end build hash"] = staged["sha256"] == e2e["sha256"]
    res["cross_checks"]["blocking checks pass, snapshot current"] = bool(
        all(staged["checks"].values()) and staged["current"] and e2e["summary"]["current"])
    res["cross_checks"]["floor reads every point the build reads"] = best_floor["points"] == staged["points"]


def _hampel(res: dict[str, Any], w, cfg: dict[str, Any], quick: bool) -> None:
    _log("Hampel: ours, reference, sktime")
    h = hampel_bench.run(w.tsdb_url, w.spec, quick=quick, repeat=max(3, cfg["repeat"]))
    res["hampel"] = h
    res["hampel_mpts_per_s"] = h["mpts_per_s"]
    res["hampel_flags_identical"] = h["flags_identical"]
    res["cross_checks"]["Hampel flags identical to the reference"] = h["flags_identical"]


def _windows(res: dict[str, Any], w, cfg: dict[str, Any], staged_dir: Path, quick: bool) -> None:
    _log("windows: ours, reference, PyTorch Forecasting")
    out = windows_bench.run(staged_dir / "store", w.spec, quick=quick, repeat=max(3, cfg["repeat"]),
                            pf_runs=cfg["pf_runs"])
    res["windows"] = out
    res["windows_speedup_vs_pf"] = out["speedup_vs_pf"]
    res["cross_checks"]["windows equal to the reference"] = out["reference"]["equal"]
    if out["pf"].get("available"):
        res["cross_checks"]["windows equal to TimeSeriesDataSet's"] = out["pf"]["equal"]


def _dagster(res: dict[str, Any], w, cfg: dict[str, Any], work: Path) -> None:
    _log("Dagster single-run backfill + manifest vs library build")
    d = dagster_bench.run(w.spec, w.tsdb_url, work / "dagster", repeat=max(1, cfg["repeat"] - 1))
    res["dagster"] = d
    res["dagster_over_library"] = d["ratio"]
    res["cross_checks"]["Dagster and library publish the same sha256"] = d["same_sha256"]
    res["cross_checks"]["Dagster blocking checks pass"] = bool(d["current"]) and all((d["checks"] or {}).values())
    shutil.rmtree(work / "dagster", ignore_errors=True)


def _rss(res: dict[str, Any], cfg: dict[str, Any], work: Path) -> None:
    sizes = cfg["rss_runs"]
    _log(f"peak RSS: plant of {max(sizes)} runs generated in a subprocess")
    plant = make_workload_in_subprocess(work / "rss-plant", runs=max(sizes), minutes=cfg["minutes"])
    rows = []
    for n in sizes:
        _log(f"peak RSS: build of {n} runs in a fresh process")
        r = memory.build_in_child(plant.spec_for_runs(n), plant.tsdb_url, work / f"rss-{n}")
        r["requested_runs"] = n
        rows.append(r)
    res["rss"] = {"sizes": list(sizes), "builds": rows, "plant_points": plant.points}
    small, big = rows[0], rows[-1]
    res["rss_ratio_128_over_8"] = big["peak_rss_mb"] / small["peak_rss_mb"]
    res["rss"]["ratio_label"] = f"{sizes[-1]} / {sizes[0]} runs"
    res["cross_checks"]["memory builds: every snapshot current, runs as asked"] = all(
        r["current"] and r["runs"] == r["requested_runs"] for r in rows)
    shutil.rmtree(work / "rss-plant", ignore_errors=True)


def _pg(res: dict[str, Any], w, cfg: dict[str, Any]) -> None:
    _log("PostgreSQL: adapter fetch vs raw COPY")
    p = pg_bench.run(w.tsdb_url, w.spec, repeat=max(1, cfg["repeat"]))
    res["pg"] = p
    res["pg_fetch_over_copy"] = p.get("ratio")
    if p.get("available"):
        res["cross_checks"]["PostgreSQL fetch returns every row COPY returns"] = p["same_rows"]
    else:
        res["pg_fetch_over_copy_reason"] = p["reason"]


def _part(res: dict[str, Any], name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - one failing part must not hide the others' results
        res["errors"][name] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    res.setdefault("part_seconds", {})[name] = time.perf_counter() - t0


# ---- output --------------------------------------------------------------------------------------


def _goals(res: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, (key, target, op, unit) in GOALS.items():
        v = res.get(key)
        if v is None:
            met = None
        elif op == "<=":
            met = v <= target
        elif op == ">=":
            met = v >= target
        else:
            met = v == target
        out[name] = {"key": key, "value": v, "target": f"{op} {target}{(' ' + unit) if unit else ''}", "met": met}
    return out


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
        return f"{v:.{nd}f}"
    return str(v)


def render(res: dict[str, Any]) -> str:
    L: list[str] = []
    wl = res.get("workload", {})
    L.append(f"aml_pipeline benchmark ({res['mode']}) {res['date']}  {res['machine']['cpu']} x{res['machine']['cpus']}")
    if wl:
        L.append(f"workload: {wl['runs']} runs x {wl['nodes']} nodes, {wl['run_minutes']:g} min each, "
                 f"{wl['points']:,} points; beat {wl['beat_ms']} ms, H={wl['H']}, F={wl['F']}, stride {wl['stride']}")
    if "stages" in res:
        L.append("")
        L.append(f"{'stage':<12}{'seconds':>10}{'points/s':>14}{'share':>8}   (library build, per-stage best of runs)")
        for r in res["stages"]:
            extra = f"   {r['mb_per_s']:.0f} MB/s of arrays" if r.get("mb_per_s") else ""
            L.append(f"{r['stage']:<12}{r['seconds']:>10.3f}{_fmt(r['points_per_s']):>14}{_fmt((r['share'] or 0) * 100, 1) + '%':>8}{extra}")
        sb = res["staged_build"]
        L.append(f"{'total':<12}{sb['total_seconds']:>10.3f}{_fmt(sb['points'] / sb['total_seconds']):>14}"
                 f"   {sb['windows']:,} windows, {sb['output_bytes'] / 1e6:.0f} MB of arrays")
    if "floor" in res:
        f, e = res["floor"], res["e2e"]
        L.append("")
        L.append(f"I/O floor: read {f['points']:,} points from DuckDB into numpy {f['read_seconds']:.3f} s "
                 f"({_fmt(f['read_points_per_s'])} points/s) + write & fsync {f['bytes_written'] / 1e6:.0f} MB with tofile "
                 f"{f['write_seconds']:.3f} s ({f['write_mb_per_s']:.0f} MB/s) = {f['seconds']:.3f} s")
        L.append(f"end-to-end library build {e['seconds']:.3f} s ({_fmt(e['points_per_s'])} points/s)  "
                 f"-> e2e / floor = {_fmt(res['e2e_over_floor'])}   (best of {len(e['all'])}, alternating)")
    if "hampel" in res:
        h = res["hampel"]
        r = h["reference"]
        L.append("")
        L.append(f"Hampel k={h['k']}: {_fmt(h['mpts_per_s'])} M points/s on one core ({h['series']} series, "
                 f"{h['points']:,} points; cpu/wall {h['cpu_seconds'] / h['seconds']:.2f}); one long series "
                 f"{_fmt(h['mpts_per_s_long_series'])} M points/s")
        L.append(f"  reference (Python loop): {_fmt(r['mpts_per_s'], 3)} M points/s on {r['points']:,} points -> "
                 f"{_fmt(r['speedup'], 0)}x; flags identical: {_fmt(h['flags_identical'])} "
                 f"({r['flag_mismatches']} + {r['adversarial_mismatches']} adversarial mismatches, {r['flagged']} flagged)")
        s = h["sktime"]
        if s.get("available"):
            L.append(f"  sktime HampelFilter: {_fmt(s['mpts_per_s'] * 1e6, 0)} points/s on {s['points']:,} points -> "
                     f"{_fmt(s['speedup'], 0)}x; flags identical on all points: {_fmt(s['identical_all'])} "
                     f"({s['identical_fraction_all'] * 100:.2f}%), on the {s['comparable_points']:,} comparable points: "
                     f"{_fmt(s['identical_on_comparable'])} ({s['mismatches_on_comparable']} mismatches)")
        else:
            L.append(f"  sktime: {s['reason']}")
    if "windows" in res:
        wd = res["windows"]
        L.append("")
        L.append(f"windows: ours {wd['ours']['windows']:,} windows in {wd['ours']['seconds']:.3f} s "
                 f"({_fmt(wd['ours']['windows_per_s'])} windows/s); equal to the loop reference "
                 f"({wd['reference']['runs']} runs): {_fmt(wd['reference']['equal'])}")
        pf = wd["pf"]
        if pf.get("available"):
            L.append(f"  TimeSeriesDataSet on {pf['runs']} runs: {pf['windows']:,} windows, build {pf['build_seconds']:.2f} s "
                     f"+ iterate {pf['iterate_seconds']:.2f} s ({_fmt(pf['windows_per_s'])} windows/s); ours on the same runs "
                     f"{wd['ours_on_pf_runs']['seconds']:.4f} s -> speedup {_fmt(wd['speedup_vs_pf'], 0)}x")
            L.append(f"  equal: {_fmt(pf['equal'])} (PF starts all ours: {pf['pf_windows_missing_in_ours'] == 0}; "
                     f"{pf['ours_only_windows']} more of ours, all with NaN only in a feature's unused future: "
                     f"{_fmt(pf['ours_only_explained_by_feature_future_nan'])}; {pf['compared_windows']:,} windows compared "
                     f"value for value, {pf['value_mismatches']} mismatches)")
        else:
            L.append(f"  TimeSeriesDataSet: {pf['reason']}")
    if "dagster" in res:
        d = res["dagster"]
        L.append("")
        L.append(f"Dagster backfill + manifest {d['dagster_seconds']:.3f} s vs library {d['library_seconds']:.3f} s "
                 f"-> {_fmt(d['ratio'])}x; same sha256: {_fmt(d['same_sha256'])}")
    if "rss" in res:
        r = res["rss"]
        L.append("")
        L.append("peak RSS (fresh process per build): " + ", ".join(
            f"{b['requested_runs']} runs {b['peak_rss_mb']:.0f} MB ({b['seconds']:.1f} s)" for b in r["builds"])
            + f" -> {r['ratio_label']}: {_fmt(res['rss_ratio_128_over_8'])}")
    if "pg" in res:
        p = res["pg"]
        L.append("")
        if p.get("available"):
            L.append(f"PostgreSQL ({p['server']}): fetch {p['points']:,} points {p['fetch_seconds']:.3f} s "
                     f"({_fmt(p['fetch_points_per_s'])} points/s); COPY text {p['copy_text_seconds']:.3f} s, binary "
                     f"{p['copy_binary_seconds']:.3f} s -> fetch / COPY = {_fmt(p['ratio'])}")
        else:
            L.append(f"PostgreSQL: not measured ({p['reason']})")
    L.append("")
    note = "   (quick mode: the goals are for the full run)" if res["mode"] == "quick" else ""
    L.append(f"{'goal':<44}{'value':>12}  {'target':<20}met{note}")
    for name, g in res["goals"].items():
        met = "-" if g["met"] is None else ("yes" if g["met"] else "NO")
        L.append(f"{name:<44}{_fmt(g['value']):>12}  {g['target']:<20}{met}")
    L.append("")
    for name, ok in res["cross_checks"].items():
        L.append(f"[{'ok' if ok else 'FAIL'}] {name}")
    for name, err in res["errors"].items():
        L.append(f"[ERROR] {name}: {err}")
    L.append(f"total {res['seconds_total']:.1f} s; {'all cross-checks passed' if res['ok'] else 'FAILED: ' + '; '.join(res['failed'])}")
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
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
