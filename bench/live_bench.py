"""Live inputs: a model's input at a forecast origin from live points (``aml_pipeline.live``).

Measured on the standard workload, built twice by the library build: as it is, and with
``causal: true`` (spec ids ``live_plain`` and ``live_causal``).

* ``causal_windows_equal_live_share``: for windows of each snapshot (every ``window_stride``-th in
  snapshot order), the live ``x`` from only the points before the window's origin (every point of
  the run so far, with the run's start) compared with the stored window, byte for byte. A live
  input the snapshot's rules cannot make without a later point (``LIVE_GAP``) counts as unequal.
  The causal share is the figure; the plain one is reported beside it.
* ``why``: the issue's own measurement, on one node: a 2 h run of a 1 Hz temperature with noise
  and 60 spikes (points on the second, and jittered by up to 150 ms), H 60, F 30, stride 1,
  default cleaning; the share of windows whose history, cleaned and aligned from the points
  before the origin, differs from the history cut from the whole run's grid, without and with
  ``causal``.
* ``live_inputs_from_points_ms``: ``LiveRecipe.inputs`` at one origin of the causal snapshot
  (H 60, 16 nodes) from each node's points of the last ``HELD_MS`` held in memory, beside PyTorch
  Forecasting's ``TimeSeriesDataSet.from_dataset(training, history, predict=True)`` for the same
  history (its already cleaned grid rows; the sample materialised through its DataLoader).
* ``live_inputs_from_tsdb_ms`` / ``live_inputs_from_tsdb_pg_ms``: the same, reading the points
  through the port from the embedded file and from PostgreSQL, one call per origin over origins
  spread across two runs, alternating the two databases; the figure is the p99 of the calls.
* ``aggregate_mean_mpts_per_s``: the grid stage (``clean_run`` over every run of the workload)
  with ``aggregate: mean`` on every node, its points per second over the same stage's without it.
"""

from __future__ import annotations

import copy
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.timing import side_by_side

# How far back a model server holds each node's points (a rolling buffer) in the latency figure.
HELD_MS = 300_000


@dataclass
class _Built:
    spec: Any
    snap: Any
    store: Any


def _build(spec_dict: dict[str, Any], url: str, root: Path) -> _Built:
    from aml_pipeline_tests.library_build import build_dataset
    from aml_pipeline.pipeline.store import DatasetStore
    from aml_pipeline.snapshot import open_snapshot
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb_open import open_tsdb

    spec = parse_spec(spec_dict)
    with open_tsdb(url) as db:
        published = build_dataset(spec, db, store_root=root / "store", datasets_root=root / "datasets")
    return _Built(spec, open_snapshot(published.snapshot_dir), DatasetStore(root / "store", spec))


def _windows(b: _Built):
    """(window index, run id, origin ms) of every window, in snapshot order."""
    from aml_pipeline.pipeline.registry import WINDOWS

    for block in b.snap.runs():
        meta = b.store.read_meta(block.run_id, WINDOWS)
        starts = b.store.read_flat(block.run_id, WINDOWS, "starts", 0, len(block))
        for i, start in zip(block.windows, starts.tolist(), strict=True):
            yield i, block.run_id, int(meta["firstMs"]) + start * b.spec.beat_ms


def _run_points(url: str, spec: Any, run_ids: set[str]) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """Every point of the spec's nodes in each run (per node, in (ts, seq) order) and each run's start."""
    from aml_pipeline.live.points import NodePoints
    from aml_pipeline.pipeline.stages.raw import run_bounds
    from aml_pipeline.tsdb_open import open_tsdb
    from aml_pipeline_tests.tsdb.series import fetch_node_series

    points: dict[str, dict[str, Any]] = {}
    starts: dict[str, int] = {}
    with open_tsdb(url) as db:
        for run in db.list_runs(None, finished_only=True):
            if run.run_id not in run_ids:
                continue
            lo, hi = run_bounds(spec, run)
            starts[run.run_id] = lo
            points[run.run_id] = {}
            for node in spec.node_ids:
                s = fetch_node_series(db, node, run.run_id, lo, hi)
                points[run.run_id][node] = NodePoints(s.ts, s.value, s.state)
    return points, starts


def _before(points: dict[str, Any], t: int, since: int | None = None) -> dict[str, tuple]:
    out = {}
    for node, p in points.items():
        part = p.between(since, t - 1)
        out[node] = (part.ts, part.value, part.state)
    return out


def _share(b: _Built, points: dict, starts: dict, stride: int, node_ranges: dict) -> dict[str, Any]:
    from aml_pipeline.live import LiveInputError, LiveRecipe

    recipe = LiveRecipe(b.snap, node_ranges=node_ranges)
    equal = differ = refused = flagged = 0
    for n, (i, run_id, origin) in enumerate(_windows(b)):
        if n % stride:
            continue
        try:
            got = recipe.inputs(origin, _before(points[run_id], origin), run_start_ms=starts[run_id])
        except LiveInputError:
            refused += 1
            continue
        rows = got.x != np.asarray(b.snap.x[i])
        if rows.any():
            differ += 1
            flagged += not (rows & ~got.may_differ).any()
        else:
            equal += 1
    total = equal + differ + refused
    return {"windows": total, "of": len(b.snap), "stride": stride, "equal": equal, "differ": differ,
            "refused_live_gap": refused, "differing_all_marked_may_differ": flagged == differ,
            "share": equal / total if total else None}


def _why(quick: bool) -> dict[str, Any]:
    """The issue's single-node measurement (see the module docstring), with the points on the
    second and with them jittered by up to 150 ms."""
    return {"on_grid": _one_node(quick, jitter_ms=0), "jittered": _one_node(quick, jitter_ms=150)}


def _one_node(quick: bool, *, jitter_ms: int) -> dict[str, Any]:
    from aml_pipeline.core.grid import grid_span
    from aml_pipeline_tests.core.whole_series import grid_column, node_params

    rng = np.random.default_rng(48)
    n, H, F, beat = (1800 if quick else 7200), 60, 30, 1000
    start = 1_735_718_400_000
    ts = start + np.arange(n, dtype=np.int64) * beat + rng.integers(-jitter_ms, jitter_ms + 1, n)
    t_s = (ts - start) / 1000.0
    value = 60.0 + 2.0 * np.sin(2 * np.pi * t_s / 1800.0) + rng.normal(0.0, 0.1, n)
    spikes = rng.choice(n, 60, replace=False)
    value[spikes] += rng.choice([-1.0, 1.0], 60) * rng.uniform(3.0, 6.0, 60)
    state = np.zeros(n, dtype=np.int32)
    first, rows = grid_span(int(ts[0]), int(ts[-1]), beat)
    out: dict[str, Any] = {"points": n, "spikes": 60, "H": H, "F": F, "jitter_ms": jitter_ms}
    for name, causal in (("plain", False), ("causal", True)):
        params = node_params(hampel_k=5, hampel_sigma=3.0, interp="linear", max_interp_ms=5000, causal=causal)
        whole, _ = grid_column(ts, value, state, first, beat, rows, params)
        windows = differ = rows_differ = 0
        for t in range(H, rows - F + 1):
            if not np.isfinite(whole[t - H : t + F]).all():
                continue
            origin = first + t * beat
            # The points of the last H beats and two minutes before them: more than the cleaning reaches.
            sel = (ts < origin) & (ts >= origin - (H * beat + 120_000))
            live, _ = grid_column(ts[sel], value[sel], state[sel], origin - H * beat, beat, H, params)
            bad = ~(live == whole[t - H : t])  # NaN (not computable before the origin) counts as different
            windows += 1
            differ += bool(bad.any())
            rows_differ += int(bad.sum())
        out[name] = {"windows": windows, "differ": differ, "rows_differ": rows_differ,
                     "share_differ": differ / windows if windows else None}
    return out


def _pf_reference(b: _Built, i: int, origin: int, ours_x: np.ndarray) -> dict[str, Any]:
    """PyTorch Forecasting's input for the same history: ``from_dataset(training, df, predict=True)``
    on the grid rows of the window (normalised as our x, identity normalisers), materialised."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pandas as pd
            import torch
            from pytorch_forecasting import TimeSeriesDataSet
            from pytorch_forecasting.data.encoders import MultiNormalizer, TorchNormalizer
    except Exception as e:  # noqa: BLE001 - optional, benchmark-only
        return {"available": False,
                "reason": f"pytorch-forecasting not importable ({type(e).__name__}: {e}); scripts/bench.sh installs it"}
    from aml_pipeline.core.normalize import apply_norm
    from aml_pipeline.pipeline.registry import WINDOWS
    from aml_pipeline.pipeline.stages.windows import RunWindows

    torch.set_num_threads(1)
    spec, snap = b.spec, b.snap
    H, F = spec.history_steps, spec.horizon_steps
    names = [f"c{j}" for j in range(len(spec.node_ids))]
    ctrl = [spec.node_ids.index(c) for c in spec.control_ids]
    tgt = [spec.node_ids.index(t) for t in spec.target_ids]
    feat = [j for j in range(len(names)) if j not in ctrl + tgt]
    mean, std = snap.norm["x"].mean, snap.norm["x"].std

    def grid_of(run_id: str) -> tuple[np.ndarray, int]:
        meta = b.store.read_meta(run_id, WINDOWS)
        run = RunWindows(b.store, run_id, meta)
        return apply_norm(run.grid_rows(0, run.rows), mean, std), int(meta["firstMs"])

    window_run = next(blk.run_id for blk in snap.runs() if i in blk.windows)
    g, first = grid_of(window_run)
    t = (origin - first) // spec.beat_ms
    # The window's rows; a pure feature's future may be missing (the window does not use it, PF
    # takes no NaN), so it holds its last value there. They are PF's training set too (its
    # normalisers are the identity, so nothing is fitted that the history would not match).
    hist = pd.DataFrame(g[t - H : t + F], columns=names).ffill()
    hist["time_idx"] = np.arange(t - H, t + F)
    hist["group"] = "run"
    train = hist
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = TimeSeriesDataSet(
            train, time_idx="time_idx", target=[names[j] for j in tgt], group_ids=["group"],
            max_encoder_length=H, min_encoder_length=H, max_prediction_length=F, min_prediction_length=F,
            time_varying_known_reals=[names[j] for j in ctrl],
            time_varying_unknown_reals=[names[j] for j in tgt + feat],
            target_normalizer=MultiNormalizer([TorchNormalizer(method="identity", center=False) for _ in tgt]),
            scalers={names[j]: None for j in ctrl + feat},
            add_relative_time_idx=False, add_target_scales=False, add_encoder_length=False,
        )

    def measure():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = TimeSeriesDataSet.from_dataset(training, hist, predict=True, stop_randomization=True)
            x, _ = next(iter(ds.to_dataloader(train=False, batch_size=1, num_workers=0)))
        return x, list(ds.reals)

    x, reals = measure()
    perm = [reals.index(nm) for nm in names]
    encoder = x["encoder_cont"][0].numpy()[:, perm]
    return {"available": True, "measure": lambda: measure()[0],
            "encoder_equals_live_x": bool(np.array_equal(encoder, ours_x))}


def _tsdb_calls(b: _Built, url: str, pg_url: str | None, repeat: int) -> dict[str, Any]:
    from aml_pipeline.live import LiveRecipe
    from aml_pipeline.tsdb_open import open_tsdb

    # The workload's first two runs (the PostgreSQL copy holds those): train runs, in start order.
    runs = [blk.run_id for blk in b.snap.runs("train")][:2]
    origins = [(i, r, o) for i, r, o in _windows(b) if r in runs]
    picked = [origins[k * len(origins) // repeat] for k in range(repeat)]
    recipe = LiveRecipe(b.snap)
    dbs = {"embedded": open_tsdb(url)}
    if pg_url is not None:
        dbs["postgresql"] = open_tsdb(pg_url)
    try:
        calls = {name: iter(picked) for name in dbs}
        equal = {name: True for name in dbs}

        def side(name: str):
            def call() -> None:
                i, run_id, origin = next(calls[name])
                got = recipe.inputs(origin, tsdb=dbs[name], run_id=run_id)
                equal[name] &= got.x.tobytes() == np.asarray(b.snap.x[i]).tobytes()
            return call

        for name, db in dbs.items():  # once each, untimed: connections and the adapters' caches warm
            recipe.inputs(picked[0][2], tsdb=db, run_id=picked[0][1])
        cmp = side_by_side({name: side(name) for name in dbs}, repeat=repeat)
    finally:
        for db in dbs.values():
            db.close()
    out = {"calls": repeat, "runs": runs, "timings": cmp.to_json(), "equal_to_windows": equal}
    for name in dbs:
        ms = sorted(1000.0 * s for s in cmp.seconds[name])
        out[name] = {"median_ms": statistics.median(ms), "p99_ms": float(np.percentile(ms, 99)),
                     "min_ms": ms[0], "max_ms": ms[-1]}
    return out


def _pg_copy(w: Any, spec: Any) -> tuple[str | None, str | None, Any]:
    """The workload's first two runs in a fresh PostgreSQL schema: (URL, why not, cleanup)."""
    import contextlib
    import os

    from bench import pg_bench
    from bench.common import workload_points
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb.postgres import PostgresTsdb

    stack = contextlib.ExitStack()
    try:
        base_url, _ = stack.enter_context(pg_bench.postgres_server())
    except pg_bench.NoServer as e:
        stack.close()
        return None, str(e), None
    schema = f"aml_live_{os.getpid()}"
    url = pg_bench._with_schema(base_url, schema)
    two = w.spec_for_runs(2)
    db_runs, nodes, points = workload_points(w.tsdb_url, parse_spec({**two, "id": spec.id}))
    with PostgresTsdb(url) as db:
        db.ingest(runs=db_runs, nodes=nodes, points=points)

    def cleanup() -> None:
        import psycopg

        with contextlib.suppress(Exception), psycopg.connect(pg_bench._with_schema(base_url, None), autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        stack.close()

    return url, None, cleanup


def _aggregate(b: _Built, repeat: int) -> dict[str, Any]:
    from aml_pipeline.pipeline.registry import RAW
    from aml_pipeline.pipeline.stages.grid import clean_run
    from aml_pipeline.pipeline.store import DatasetStore
    from aml_pipeline.spec import parse_spec

    plain = b.spec
    mean = parse_spec({**plain.to_json_dict(), "aggregate": "mean"})
    stores = {"point": DatasetStore(b.store.root, plain), "mean": DatasetStore(b.store.root, mean)}
    run_ids = [r for _, r in _plan_runs(b)]
    points = sum(sum(b.store.read_meta(r, RAW)["points"].values()) for r in run_ids)

    def side(name: str):
        return lambda: [clean_run(stores[name], r) for r in run_ids]

    cmp = side_by_side({"point": side("point"), "mean": side("mean")}, repeat=repeat)
    rates = {k: points / cmp.timing(k)["median"] / 1e6 for k in stores}
    return {"runs": len(run_ids), "points": points, "timings": cmp.to_json(),
            "mpts_per_s": rates, "ratio": cmp.rate_ratio("mean", "point", points, points)}


def _plan_runs(b: _Built):
    from aml_pipeline.pipeline.stages.split import load_plan

    return load_plan(b.store).ordered_runs()


def run(w: Any, work: Path, *, repeat: int, quick: bool) -> dict[str, Any]:
    """Every figure of the module docstring; ``repeat`` for the stage timing, more calls for the
    per-call latencies."""
    import logging

    logging.getLogger("aml_pipeline").setLevel(logging.ERROR)  # the build's sampling notes, once per spec
    plain = _build({**copy.deepcopy(w.spec), "id": "live_plain"}, w.tsdb_url, work / "plain")
    causal = _build({**copy.deepcopy(w.spec), "id": "live_causal", "causal": True}, w.tsdb_url, work / "causal")
    run_ids = {blk.run_id for blk in causal.snap.runs()} | {blk.run_id for blk in plain.snap.runs()}
    points, starts = _run_points(w.tsdb_url, causal.spec, run_ids)
    from aml_pipeline.tsdb_open import open_tsdb

    with open_tsdb(w.tsdb_url) as db:
        ranges = {n.node_id: (n.range_lo, n.range_hi) for n in db.list_nodes()}
    stride = 1 if quick else 8
    out: dict[str, Any] = {
        "share": {"causal": _share(causal, points, starts, stride, ranges), "plain": _share(plain, points, starts, stride, ranges)},
        "why": _why(quick),
    }

    # One origin in the middle of the first test run (or the last run), the points of HELD_MS before it held.
    from aml_pipeline.live import LiveRecipe

    recipe = LiveRecipe(causal.snap)
    blocks = causal.snap.runs("test") or causal.snap.runs()
    block = blocks[0]
    i, run_id, origin = [x for x in _windows(causal) if x[0] in block.windows][len(block) // 2]
    held = _before(points[run_id], origin, since=origin - HELD_MS)
    ours = recipe.inputs(origin, held)
    sides = {"ours": lambda: recipe.inputs(origin, held)}
    pf = _pf_reference(causal, i, origin, ours.x)
    if pf.get("available"):
        sides["pytorch_forecasting"] = pf.pop("measure")
    calls = 20 if quick else 200
    cmp = side_by_side(sides, repeat=calls)
    out["points"] = {
        "origin": origin, "run": run_id, "history_steps": recipe.history_steps, "nodes": len(recipe.nodes),
        "held_points": sum(len(v[0]) for v in held.values()), "equal_to_window": ours.x.tobytes() == np.asarray(causal.snap.x[i]).tobytes(),
        "timings": cmp.to_json(), "pf": pf,
        "ms": {name: {k: 1000.0 * v for k, v in cmp.timing(name).items() if k in ("median", "min", "max")} for name in sides},
    }

    pg_url, why_not, cleanup = _pg_copy(w, causal.spec)
    try:
        out["tsdb"] = _tsdb_calls(causal, w.tsdb_url, pg_url, calls)
    finally:
        if cleanup is not None:
            cleanup()
    if pg_url is None:
        out["tsdb"]["postgresql"] = {"available": False, "reason": why_not}

    out["aggregate"] = _aggregate(plain, repeat)
    return out
