"""Windowing: the snapshot writer's own path against PyTorch Forecasting, on the same runs.

"Ours" is what the snapshot writer runs to produce the windows (:func:`production_windows`:
``pipeline.snapshot_writer.window_blocks`` over each run's stored model-unit grid, read block by
block from the store, normalising grid rows with ``core.normalize.apply_norm`` and cutting x, u
and y with ``core.windows.window_block``, in float32 blocks as written; its reads of the store
are part of our timed side, as they are of the writer's).

PyTorch Forecasting gets the same runs' grids, normalised as the snapshot's x is (float32,
identity normalisers, so its values are ours bit for bit), cut into segments of fully observed
rows (it cannot take NaN; one group per segment, ``time_idx`` = run * 10^6 + grid row): with
encoder = H and prediction = F fixed, its samples are exactly the windows inside a segment.
Timed per repetition: constructing the ``TimeSeriesDataSet`` and iterating its ``DataLoader``
(batch 256, no workers) to materialise every window. Building its input DataFrame, and reading
our grids from the store, happen once before the clock for both sides.

Cross-checks:

* ours, run over every run in snapshot order, gives byte for byte the snapshot's
  ``arrays/x.f32``, ``u.f32`` and ``y.f32`` (sha256 compared), so the timed code is the
  writer's;
* ours equals a loop per window (``aml_pipeline_tests.reference.windows_reference`` for the
  starts, explicit slices of the normalised grid for the values), on every run in quick mode
  and two runs otherwise;
* with PyTorch Forecasting: its set of windows is ours, except windows it cannot express (a
  NaN only in a pure feature's future, which our window does not use: each one is checked to
  be exactly that); every one of its x windows equals ours value for value; its decoder values
  of the controls and its targets are the grid rows ``t..t+F-1`` of its input.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.timing import side_by_side

BATCH = 256
RUN_BASE = 1_000_000


@dataclass
class StoredRun:
    """A run of the dataset: what the writer's windowing takes (``handle``), and its grid and
    window starts read once, before any clock, for the references."""

    run_id: str
    grid: np.ndarray  # [T, nodes] model units, float64
    starts: np.ndarray  # int64 window starts
    handle: Any


def _load_runs(store: Any) -> tuple[Any, list[StoredRun]]:
    """The stored statistics and the runs the writer reads, in snapshot order."""
    from aml_pipeline.pipeline.stages.norm import load_norm
    from aml_pipeline.pipeline.stages.split import load_plan
    from aml_pipeline.pipeline.stages.windows import RunWindows

    plan = load_plan(store)
    norm = load_norm(store, plan)
    runs = []
    for _, run_id in plan.ordered_runs():
        h = RunWindows(store, run_id, plan.runs[run_id])
        runs.append(StoredRun(run_id, h.grid_rows(0, h.rows), h.starts().between(0, h.rows + 1), h))
    return norm, runs


def production_windows(runs: list[StoredRun], spec: Any, norm: Any,
                       kinds: tuple[str, ...] = ("x", "u", "y")) -> Iterator[tuple[str, str, np.ndarray]]:
    """``(kind, run id, block)`` as the writer produces them: one pass per kind over the runs,
    blocks as float32 little-endian C-order arrays."""
    from aml_pipeline.pipeline.snapshot_writer import window_blocks
    from aml_pipeline.pipeline.stages.windows import Columns

    cols = Columns.of(spec)
    for kind in kinds:
        for run in runs:
            for block in window_blocks(kind, run.handle, spec, cols, norm):
                yield kind, run.run_id, np.ascontiguousarray(block, dtype="<f4")


def _load(store_root: Path, spec_dict: dict[str, Any]) -> tuple[Any, Any, list[StoredRun]]:
    from aml_pipeline.pipeline.store import DatasetStore
    from aml_pipeline.spec import parse_spec

    spec = parse_spec(spec_dict)
    norm, runs = _load_runs(DatasetStore(store_root, spec))
    return spec, norm, runs


def _cols(spec: Any) -> tuple[list[int], list[int], list[int]]:
    idx = {n: j for j, n in enumerate(spec.node_ids)}
    ctrl = [idx[n] for n in spec.control_ids]
    tgt = [idx[n] for n in spec.target_ids]
    feat = [j for j in range(len(spec.node_ids)) if j not in set(ctrl) | set(tgt)]
    return ctrl, tgt, feat


def run(store_root: Path, snapshot_dir: Path, spec_dict: dict[str, Any], *, quick: bool, repeat: int,
        pf_runs: int) -> dict[str, Any]:
    spec, norm, runs = _load(store_root, spec_dict)
    H, F = spec.history_steps, spec.horizon_steps
    out: dict[str, Any] = {"runs": len(runs), "H": H, "F": F, "stride": spec.stride}

    out["snapshot"] = _check_snapshot(runs, spec, norm, snapshot_dir)
    out["reference"] = _check_reference(runs if quick else runs[:2], spec, norm)

    # the same runs on both sides: the first pf_runs of the snapshot (train runs, oldest first)
    sub = runs[:pf_runs]
    ours_windows = int(sum(r.starts.shape[0] for r in sub))

    def ours() -> int:
        n = 0
        for _, _, block in production_windows(sub, spec, norm):
            n += block.shape[0]
        return n

    pf = _pf_setup(sub, spec, norm)
    sides = {"ours": ours}
    if pf.get("available"):
        sides["pytorch_forecasting"] = pf.pop("measure")
    cmp = side_by_side(sides, repeat=repeat)
    out["timings"] = cmp.to_json()
    out["ours"] = {"runs": len(sub), "windows": ours_windows,
                   "windows_per_s": ours_windows / cmp.timing("ours")["median"]}
    if pf.get("available"):
        pf_windows = cmp.values["pytorch_forecasting"]
        pf.update(pf.pop("verify")(sub))
        pf["windows"] = pf_windows
        pf["windows_per_s"] = pf_windows / cmp.timing("pytorch_forecasting")["median"]
        out["speedup_vs_pf"] = cmp.rate_ratio("ours", "pytorch_forecasting", ours_windows, pf_windows)
    else:
        out["speedup_vs_pf"] = None
    out["pf"] = pf
    return out


def _check_snapshot(runs: list[Any], spec: Any, norm: Any, snapshot_dir: Path) -> dict[str, Any]:
    """sha256 of ours over every run in snapshot order == sha256 of the snapshot's array files."""
    ours = {k: hashlib.sha256() for k in ("x", "u", "y")}
    for kind, _, block in production_windows(runs, spec, norm):
        ours[kind].update(memoryview(block.reshape(-1).view(np.uint8)))
    equal = {}
    for kind, h in ours.items():
        f = hashlib.sha256()
        with open(snapshot_dir / "arrays" / f"{kind}.f32", "rb") as fh:
            while chunk := fh.read(8 << 20):
                f.update(chunk)
        equal[kind] = h.hexdigest() == f.hexdigest()
    return {"equal": all(equal.values()), "by_array": equal, "snapshot": str(snapshot_dir)}


def _normalised(run: Any, norm: Any, ctrl: list[int], tgt: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from aml_pipeline.core.normalize import apply_norm

    return (apply_norm(run.grid, norm.x.mean, norm.x.std),
            apply_norm(run.grid[:, ctrl], norm.u.mean, norm.u.std),
            apply_norm(run.grid[:, tgt], norm.y.mean, norm.y.std))


def _check_reference(runs: list[Any], spec: Any, norm: Any) -> dict[str, Any]:
    from aml_pipeline_tests.reference import windows_reference

    H, F = spec.history_steps, spec.horizon_steps
    ctrl, tgt, _ = _cols(spec)
    equal, windows = True, 0
    for run in runs:
        ref_starts, _, _, _ = windows_reference(run.grid, H, F, spec.stride, ctrl, tgt)
        xs, us, ys = _normalised(run, norm, ctrl, tgt)
        got = {"x": [], "u": [], "y": []}
        for kind, _, block in production_windows([run], spec, norm):
            got[kind].append(block)
        same = list(map(int, run.starts)) == ref_starts
        for kind, grid, lo, hi in (("x", xs, -H, 0), ("u", us, 0, F), ("y", ys, 0, F)):
            ours = np.concatenate(got[kind]) if got[kind] else np.empty((0, hi - lo, grid.shape[1]), np.float32)
            ref = (np.stack([grid[t + lo : t + hi] for t in ref_starts]) if ref_starts
                   else np.empty((0, hi - lo, grid.shape[1]), np.float32))
            same &= ours.shape == ref.shape and bool(np.array_equal(ours, ref))
        equal &= bool(same)
        windows += len(ref_starts)
    return {"what": "aml_pipeline_tests.reference.windows_reference + explicit slices of the normalised grid",
            "runs": len(runs), "windows": windows, "equal": equal}


def _pf_setup(runs: list[Any], spec: Any, norm: Any) -> dict[str, Any]:
    """PyTorch Forecasting's input (built once) and the callables that time and verify it."""
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

    torch.set_num_threads(1)
    H, F = spec.history_steps, spec.horizon_steps
    ctrl, tgt, feat = _cols(spec)
    names = [f"c{j}" for j in range(len(spec.node_ids))]
    grids = [apply_norm(r.grid, norm.x.mean, norm.x.std) for r in runs]  # float32, as our x
    frames = []
    for r, g in enumerate(grids):
        rows = np.flatnonzero(np.isfinite(g).all(axis=1))
        if rows.size == 0:
            continue
        seg = np.cumsum(np.concatenate([[True], np.diff(rows) != 1]))  # segments of consecutive rows
        df = pd.DataFrame(g[rows], columns=names)
        df["time_idx"] = r * RUN_BASE + rows
        df["segment"] = (r * RUN_BASE + seg).astype(str)
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    size = df.groupby("segment")["time_idx"].transform("size")
    df = df[size >= H + F].reset_index(drop=True)  # PF refuses groups shorter than one window
    target_names = [names[j] for j in tgt]

    def dataset():
        return TimeSeriesDataSet(
            df, time_idx="time_idx", target=target_names, group_ids=["segment"],
            max_encoder_length=H, min_encoder_length=H, max_prediction_length=F, min_prediction_length=F,
            time_varying_known_reals=[names[j] for j in ctrl],
            time_varying_unknown_reals=target_names + [names[j] for j in feat],
            target_normalizer=MultiNormalizer([TorchNormalizer(method="identity", center=False) for _ in tgt]),
            scalers={names[j]: None for j in (*ctrl, *feat)},
            add_relative_time_idx=False, add_target_scales=False, add_encoder_length=False,
        )

    def measure() -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = dataset()
            n = 0
            for x, _ in ds.to_dataloader(train=False, batch_size=BATCH, num_workers=0):
                n += x["encoder_cont"].shape[0]
        return n

    def verify(sub_runs: list[Any]) -> dict[str, Any]:
        """Untimed: PF's windows against ours (see the module docstring)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = dataset()
            reals = list(ds.reals)
            perm = [reals.index(nm) for nm in names]  # PF column order -> node order
            ctrl_pf = [reals.index(names[j]) for j in ctrl]
            ours_x: dict[int, np.ndarray] = {}
            for r, run in enumerate(sub_runs):
                blocks = [b for _, _, b in production_windows([run], spec, norm, kinds=("x",))]
                ours_x[r] = np.concatenate(blocks) if blocks else np.empty((0, H, len(names)), np.float32)
            row_of = {r: {int(t): i for i, t in enumerate(run.starts)} for r, run in enumerate(sub_runs)}
            pf_keys, mismatched, compared = set(), 0, 0
            for x, y in ds.to_dataloader(train=False, batch_size=BATCH, num_workers=0):
                enc, dec = x["encoder_cont"].numpy(), x["decoder_cont"].numpy()
                yv = np.stack([t.numpy() for t in y[0]], axis=-1)
                for i, key in enumerate(x["decoder_time_idx"][:, 0].numpy().tolist()):
                    r, t = divmod(int(key), RUN_BASE)
                    pf_keys.add(int(key))
                    g = grids[r]
                    row = row_of[r].get(t)
                    same = (
                        row is not None
                        and np.array_equal(enc[i][:, perm], ours_x[r][row])
                        and np.array_equal(dec[i][:, ctrl_pf], g[t : t + F][:, ctrl])
                        and np.array_equal(yv[i], g[t : t + F][:, tgt])
                    )
                    mismatched += not same
                    compared += 1
        ours_keys = {r * RUN_BASE + int(t) for r, run in enumerate(sub_runs) for t in run.starts}
        extra = sorted(ours_keys - pf_keys)
        explained = True
        for key in extra:  # ours only: a NaN in a pure feature's future, nothing the window uses
            r, t = divmod(key, RUN_BASE)
            g = sub_runs[r].grid
            fut = g[t : t + F]
            explained &= bool(np.isfinite(g[t - H : t]).all() and np.isfinite(fut[:, ctrl + tgt]).all()
                              and feat and not np.isfinite(fut[:, feat]).all())
        missing = len(pf_keys - ours_keys)
        return {
            "ours_windows_on_these_runs": len(ours_keys),
            "pf_windows_missing_in_ours": missing,
            "ours_only_windows": len(extra),
            "ours_only_explained_by_feature_future_nan": explained,
            "compared_windows": compared,
            "value_mismatches": mismatched,
            "equal": missing == 0 and explained and mismatched == 0 and compared == len(pf_keys),
        }

    return {"available": True, "runs": len(runs), "input_rows": int(len(df)), "measure": measure, "verify": verify}
