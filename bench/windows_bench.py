"""Windowing: ours against PyTorch Forecasting's ``TimeSeriesDataSet`` on the same grids.

Both start from the runs' model-unit grids (``run_windows`` stage output, as float32, the dtype
PyTorch Forecasting works in) and materialise every (x, u, y) window: x = rows t-H..t-1 of all
nodes, u = rows t..t+F-1 of the controls, y = rows t..t+F-1 of the targets.

* Ours: ``window_starts`` (valid starts) + ``gather_windows`` per run.
* PyTorch Forecasting cannot take NaN, so it gets each run cut into segments of fully observed
  rows (one group per segment, ``time_idx`` = run * 10^6 + grid row); with encoder = H and
  prediction = F fixed, its samples are exactly the windows that lie inside a segment. Timed:
  constructing the ``TimeSeriesDataSet`` and iterating its DataLoader (batch 256) to
  materialise every window. Building the input DataFrame is timed separately, not counted.

Verification: PF's set of window starts must be a subset of ours, and every window we have
beyond it must be one that PF cannot express (a NaN only in a pure feature's future, which
the window does not use). A sample of PF's batches is compared value for value (exact float32
equality) with our x, u, y. Without PyTorch Forecasting (CI), our windows are compared with
``aml_pipeline_tests.reference.windows_reference`` (a loop per window) instead, on all runs
in quick mode and on a sample of runs otherwise.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np

BATCH = 256
RUN_BASE = 1_000_000
SAMPLE_EVERY = 7  # compare every 7th PF batch value for value


def _grids(store_root, spec_dict: dict[str, Any]) -> tuple[list[str], list[np.ndarray]]:
    from aml_pipeline.pipeline.store import DatasetStore

    store = DatasetStore(store_root, spec_dict["id"])
    runs = store.stage_runs("windows")
    return runs, [np.ascontiguousarray(store.read_arrays(r, "windows")["grid"], dtype=np.float32) for r in runs]


def _cols(spec_dict: dict[str, Any]) -> tuple[list[str], list[int], list[int], list[int]]:
    nodes = [n["nodeId"] for n in spec_dict["nodes"]]
    roles = [n["role"] for n in spec_dict["nodes"]]
    ctrl = [j for j, r in enumerate(roles) if r == "control"]
    tgt = [j for j, r in enumerate(roles) if r == "target"]
    feat = [j for j, r in enumerate(roles) if r == "feature"]
    return nodes, ctrl, tgt, feat


def ours(grids: list[np.ndarray], H: int, F: int, ctrl: list[int], tgt: list[int]) -> tuple[list[np.ndarray], int]:
    from aml_pipeline.core.windows import gather_windows, window_starts

    starts, n = [], 0
    for g in grids:
        s = window_starts(g, H, F, 1, ctrl, tgt)
        x, u, y = gather_windows(g, s, H, F, ctrl, tgt)
        n += x.shape[0]
        starts.append(s)
        del x, u, y
    return starts, n


def run(store_root, spec_dict: dict[str, Any], *, quick: bool, repeat: int, pf_runs: int) -> dict[str, Any]:
    H, F = spec_dict["historySteps"], spec_dict["horizonSteps"]
    nodes, ctrl, tgt, feat = _cols(spec_dict)
    run_ids, grids = _grids(store_root, spec_dict)
    out: dict[str, Any] = {"runs": len(grids), "H": H, "F": F}

    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        starts, n = ours(grids, H, F, ctrl, tgt)
        best = min(best, time.perf_counter() - t0)
    out["ours"] = {"windows": n, "seconds": best, "windows_per_s": n / best if best else None}

    out["reference"] = _check_reference(grids if quick else grids[:2], starts, H, F, ctrl, tgt)
    out["pf"] = _pf(grids[:pf_runs], starts[:pf_runs], H, F, nodes, ctrl, tgt, feat)
    if out["pf"].get("available"):
        sub = grids[:pf_runs]
        best_sub = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            _, n_sub = ours(sub, H, F, ctrl, tgt)
            best_sub = min(best_sub, time.perf_counter() - t0)
        out["ours_on_pf_runs"] = {"runs": len(sub), "windows": n_sub, "seconds": best_sub}
        pf_rate = out["pf"]["windows"] / out["pf"]["seconds"]
        ours_rate = n_sub / best_sub
        out["speedup_vs_pf"] = ours_rate / pf_rate
    else:
        out["speedup_vs_pf"] = None
    out["ok"] = out["reference"]["equal"] and (not out["pf"].get("available") or out["pf"]["equal"])
    return out


def _check_reference(grids, starts, H, F, ctrl, tgt) -> dict[str, Any]:
    from aml_pipeline.core.windows import gather_windows
    from aml_pipeline_tests.reference import windows_reference

    equal, windows = True, 0
    for g, s in zip(grids, starts, strict=False):
        ref_starts, xs, us, ys = windows_reference(g, H, F, 1, ctrl, tgt)
        x, u, y = gather_windows(g, s, H, F, ctrl, tgt)
        windows += len(ref_starts)
        same = list(map(int, s)) == ref_starts and (
            not ref_starts
            or (np.array_equal(x, np.stack(xs)) and np.array_equal(u, np.stack(us)) and np.array_equal(y, np.stack(ys)))
        )
        equal &= bool(same)
    return {"what": "aml_pipeline_tests.reference.windows_reference (loop per window)",
            "runs": len(grids), "windows": windows, "equal": equal}


def _pf(grids, starts, H, F, nodes, ctrl, tgt, feat) -> dict[str, Any]:
    """PyTorch Forecasting over ``grids`` (timed once: it takes seconds where ours takes ms)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pandas as pd
            import torch
            from pytorch_forecasting import TimeSeriesDataSet
            from pytorch_forecasting.data.encoders import MultiNormalizer, TorchNormalizer
    except Exception as e:  # noqa: BLE001 - optional, benchmark-only
        return {"available": False, "reason": f"pytorch-forecasting not importable: {type(e).__name__}: {e}"}
    torch.set_num_threads(1)
    names = [f"c{j}" for j in range(len(nodes))]

    t0 = time.perf_counter()
    frames = []
    for r, g in enumerate(grids):
        ok = np.isfinite(g).all(axis=1)
        rows = np.flatnonzero(ok)
        if rows.size == 0:
            continue
        seg = np.cumsum(np.concatenate([[True], np.diff(rows) != 1]))  # segment of consecutive rows
        df = pd.DataFrame(g[rows], columns=names)
        df["time_idx"] = r * RUN_BASE + rows
        df["segment"] = (r * RUN_BASE + seg).astype(str)
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    size = df.groupby("segment")["time_idx"].transform("size")
    df = df[size >= H + F].reset_index(drop=True)  # PF refuses groups shorter than one window
    frame_seconds = time.perf_counter() - t0

    target_names = [names[j] for j in tgt]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        ds = TimeSeriesDataSet(
            df, time_idx="time_idx", target=target_names, group_ids=["segment"],
            max_encoder_length=H, min_encoder_length=H, max_prediction_length=F, min_prediction_length=F,
            time_varying_known_reals=[names[j] for j in ctrl],
            time_varying_unknown_reals=target_names + [names[j] for j in feat],
            target_normalizer=MultiNormalizer([TorchNormalizer(method="identity", center=False) for _ in tgt]),
            scalers={names[j]: None for j in (*ctrl, *feat)},
            add_relative_time_idx=False, add_target_scales=False, add_encoder_length=False,
        )
        build_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        n, sample = 0, []
        for b, (x, y) in enumerate(ds.to_dataloader(train=False, batch_size=BATCH, num_workers=0)):
            n += x["encoder_cont"].shape[0]
            if b % SAMPLE_EVERY == 0:
                sample.append((x["encoder_cont"], x["decoder_cont"], y[0], x["decoder_time_idx"][:, 0]))
        iter_seconds = time.perf_counter() - t0

    # ---- set of windows: PF's starts from its index, ours from window_starts
    index = ds.decoded_index
    pf_first = index["time_idx_first_prediction"].to_numpy(np.int64)
    pf_set = set(pf_first.tolist())
    ours_set = {r * RUN_BASE + int(t) for r, s in enumerate(starts) for t in s}
    missing_in_ours = len(pf_set - ours_set)
    extra = sorted(ours_set - pf_set)
    extra_explained = True
    for key in extra:
        r, t = divmod(key, RUN_BASE)
        g = grids[r]
        past_ok = np.isfinite(g[t - H : t]).all()
        fut = g[t : t + F]
        used_ok = np.isfinite(fut[:, ctrl + tgt]).all()
        feature_nan = not np.isfinite(fut[:, feat]).all() if feat else False
        extra_explained &= bool(past_ok and used_ok and feature_nan)

    # ---- values of the sampled batches, exact
    reals = list(ds.reals)
    perm = [reals.index(nm) for nm in names]  # PF column order -> node order
    ctrl_pf = [reals.index(names[j]) for j in ctrl]
    mismatched, compared = 0, 0
    for enc, dec, ys, first in sample:
        enc, dec = enc.numpy(), dec.numpy()
        yv = np.stack([t.numpy() for t in ys], axis=-1)
        for i, key in enumerate(first.numpy().tolist()):
            r, t = divmod(int(key), RUN_BASE)
            g = grids[r]
            same = (
                np.array_equal(enc[i][:, perm], g[t - H : t])
                and np.array_equal(dec[i][:, ctrl_pf], g[t : t + F][:, ctrl])
                and np.array_equal(yv[i], g[t : t + F][:, tgt])
            )
            mismatched += not same
            compared += 1
    equal = missing_in_ours == 0 and extra_explained and mismatched == 0 and n == len(pf_set)
    return {
        "available": True,
        "runs": len(grids),
        "windows": n,
        "seconds": build_seconds + iter_seconds,
        "build_seconds": build_seconds,
        "iterate_seconds": iter_seconds,
        "frame_seconds_not_counted": frame_seconds,
        "windows_per_s": n / (build_seconds + iter_seconds),
        "ours_windows_on_these_runs": int(sum(len(s) for s in starts)),
        "pf_windows_missing_in_ours": missing_in_ours,
        "ours_only_windows": len(extra),
        "ours_only_explained_by_feature_future_nan": extra_explained,
        "compared_windows": compared,
        "value_mismatches": mismatched,
        "equal": equal,
    }
