"""Ridge baseline for one snapshot, run inside the shared environment through Dagster Pipes.

    <shared env>/bin/python -E -s ridge_baseline.py     (launched by dg.PipesSubprocessClient)

Imports only what the shared environment has (numpy, dagster_pipes) and the snapshot reader
``aml_pipeline/snapshot`` (numpy and the standard library only). The project is not installed in
the shared environment, so run as a script it loads that package from its files next to this
one (``RIDGE_BASELINE_FILES``, the baseline's code version, lists them). Steps:

1. open the snapshot with ``open_snapshot``: its sha256 is verified by streaming the files
   (``sha256.json``, the catalog's hash) and a mismatch is refused, naming the changed files;
   the arrays are then memory maps of the verified files;
2. features = history ``x`` [H x nodes] and future controls ``u`` [F x controls], flattened;
   targets = future ``y`` [F x targets], flattened (all normalised, as stored);
3. fit ridge regression (intercept unpenalised, features centred on train) on the train windows
   for a small grid of alphas (one eigendecomposition of the train design's centred Gram matrix,
   accumulated batch by batch), pick the alpha with the lowest val RMSE (mean over targets of
   RMSE / target std, so targets in different units weigh alike), and report val and test RMSE
   per target in model units (de-normalised with ``manifest.norm.y``) next to a persistence
   baseline: the target's last observed value in the history (``x`` at the last history step,
   de-normalised with ``manifest.norm.x``) held over the horizon. Every pass reads the windows in
   batches (``Snapshot.iter_batches``), so memory is a batch and the Gram matrix, for either
   snapshot layout;
4. save the model (``ridge_baseline.npz``) and metrics (``metrics.json``) to ``output_dir`` and
   report everything as the asset's materialisation metadata.

Pipes extras: ``snapshot_dir`` (required), ``expected_sha256``, ``output_dir``, ``alphas``,
``outcome_path`` (a JSON file the script writes ``{"ok", "code", "message"}`` to, so the asset
can fail with the script's reason).

Test hook: with ``AML_TRAINING_HOLD_FILE=<path>`` set, the script writes ``<path>.waiting`` and
waits (at most ``AML_TRAINING_HOLD_MAX_S``, default 120 s) until ``<path>`` exists, so a test can
observe the run while it holds its read lease.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _snapshot_package() -> Any:
    """``aml_pipeline.snapshot``: imported when this runs inside the project, else (a script in
    the shared environment, where ``aml_pipeline`` is not installed) loaded from its files
    beside this one, under its own name and without ``aml_pipeline/__init__``."""
    if __package__:
        import aml_pipeline.snapshot

        return aml_pipeline.snapshot
    name = "aml_pipeline.snapshot"
    if name not in sys.modules:
        pkg = Path(__file__).resolve().parent.parent / "snapshot"
        spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
        assert spec is not None and spec.loader is not None, pkg
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_reader = _snapshot_package()
Snapshot, SnapshotError, open_snapshot = _reader.Snapshot, _reader.SnapshotError, _reader.open_snapshot

VERSION = "ridge_baseline@1"
DEFAULT_ALPHAS = (1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4)
FALLBACK_ALPHA = 1.0  # when there are no val windows to choose with
HOLD_ENV = "AML_TRAINING_HOLD_FILE"
HOLD_MAX_ENV = "AML_TRAINING_HOLD_MAX_S"


# ---- the model --------------------------------------------------------------------------------

# Windows per batch read for fitting and scoring: a few MB of float64 features.
BATCH_WINDOWS = 2048


def design(snap: Snapshot, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """X = [x flattened, u flattened] (float64), Y = y flattened; one row per window of ``batch``."""
    n = batch["x"].shape[0]
    X = np.concatenate([batch["x"].reshape(n, -1), batch["u"].reshape(n, -1)], axis=1).astype(np.float64)
    Y = batch["y"].reshape(n, -1).astype(np.float64)
    return X, Y


def batches(snap: Snapshot, split: str) -> Any:
    """``(batch, X, Y)`` over the windows of ``split``, in stored order."""
    for batch in snap.iter_batches(split, BATCH_WINDOWS):
        yield (batch, *design(snap, batch))


class RidgePath:
    """Ridge solutions for any alpha from one eigendecomposition of the centred train Gram matrix
    ``Xc' Xc`` (its eigenvectors and eigenvalues are the SVD's ``V`` and ``s^2``).

    The Gram matrix and ``Xc' Yc`` are accumulated batch by batch, each batch centred on its own
    mean and merged with Chan et al.'s update, so memory is a batch plus ``features^2``.
    """

    def __init__(self, X: np.ndarray | None = None, Y: np.ndarray | None = None) -> None:
        self.n = 0
        self._solved: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        if X is not None and Y is not None:
            self.add(X, Y)

    def add(self, X: np.ndarray, Y: np.ndarray) -> None:
        n_b = X.shape[0]
        if n_b == 0:
            return
        mx, my = X.mean(axis=0), Y.mean(axis=0)
        Xc, Yc = X - mx, Y - my
        gxx, gxy = Xc.T @ Xc, Xc.T @ Yc
        if self.n == 0:
            self.n, self.x_mean, self.y_mean, self.gxx, self.gxy = n_b, mx, my, gxx, gxy
        else:
            n = self.n + n_b
            dx, dy = mx - self.x_mean, my - self.y_mean
            w = self.n * n_b / n
            self.gxx = self.gxx + gxx + w * np.outer(dx, dx)
            self.gxy = self.gxy + gxy + w * np.outer(dx, dy)
            self.x_mean = self.x_mean + dx * (n_b / n)
            self.y_mean = self.y_mean + dy * (n_b / n)
            self.n = n
        self._solved = None

    def _solve(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Eigenvalues (``s^2``) and eigenvectors (``V``) of the Gram matrix, and ``V' Xc' Yc``."""
        if self.n == 0:
            raise ValueError("no training rows")
        if self._solved is None:
            eig, V = np.linalg.eigh(self.gxx)
            self._solved = (np.maximum(eig, 0.0), V, V.T @ self.gxy)
        return self._solved

    def coef(self, alpha: float) -> np.ndarray:
        """[features, outputs] minimising |Xc W - Yc|^2 + alpha |W|^2."""
        eig, V, VtC = self._solve()
        denom = eig + alpha
        scale = np.divide(1.0, denom, out=np.zeros_like(denom), where=denom > 0)
        return V @ (scale[:, None] * VtC)

    def predict(self, X: np.ndarray, coef: np.ndarray) -> np.ndarray:
        return (X - self.x_mean) @ coef + self.y_mean


def denorm(values: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return values.astype(np.float64) * std + mean


def _target_columns(snap: Snapshot) -> list[int]:
    nodes = list(snap.manifest["allNodes"])
    missing = [t for t in snap.targets if t not in nodes]
    if missing:
        raise SnapshotError(f"{snap.root}: targets {missing} are not in allNodes; no persistence baseline")
    return [nodes.index(t) for t in snap.targets]


def persistence_of(snap: Snapshot, x: np.ndarray) -> np.ndarray:
    """Last observed value of each target in the history ``x`` [n, H, nodes], held over the
    horizon (model units): [n, F, targets]."""
    cols = _target_columns(snap)
    norm = snap.norm["x"]
    last = denorm(x[:, -1, :][:, cols], norm.mean[cols], norm.std[cols])  # [n, targets]
    return np.repeat(last[:, None, :], snap.y.shape[1], axis=1)


def persistence(snap: Snapshot, part: slice) -> np.ndarray:
    """:func:`persistence_of` for the windows ``part`` (their history's last step only is read)."""
    return persistence_of(snap, snap.x[part, -1:, :])


class _SquaredErrors:
    """Sum of squared errors per target, in model units, accumulated batch by batch."""

    def __init__(self, targets: int) -> None:
        self.sse, self.count = np.zeros(targets), 0

    def add(self, pred: np.ndarray, truth: np.ndarray) -> None:
        self.sse += ((pred - truth) ** 2).sum(axis=(0, 1))
        self.count += pred.shape[0] * pred.shape[1]

    def rmse(self) -> np.ndarray:
        return np.sqrt(self.sse / self.count)


def train_and_evaluate(snap: Snapshot, alphas: tuple[float, ...] = DEFAULT_ALPHAS) -> dict[str, Any]:
    """Fit on train, choose alpha on val, evaluate on val and test (model units); one pass over
    the train windows to fit, one over val for every alpha, one per split to report."""
    counts = snap.counts
    if counts["train"] == 0:
        raise SnapshotError(f"{snap.root}: no train windows to fit on")
    F, T = snap.y.shape[1], snap.y.shape[2]
    y_mean, y_std = snap.norm["y"].mean, snap.norm["y"].std
    path = RidgePath()
    features = 0
    for _, X, Y in batches(snap, "train"):
        path.add(X, Y)
        features = X.shape[1]

    def score(part: str, coefs: dict[float, np.ndarray]) -> tuple[dict[float, np.ndarray], np.ndarray]:
        """RMSE per target of each coefficient set, and of persistence, over ``part``."""
        model = {a: _SquaredErrors(T) for a in coefs}
        still = _SquaredErrors(T)
        for batch, X, _ in batches(snap, part):
            truth = denorm(batch["y"], y_mean, y_std)
            for a, coef in coefs.items():
                model[a].add(denorm(path.predict(X, coef).reshape(-1, F, T), y_mean, y_std), truth)
            still.add(persistence_of(snap, batch["x"]), truth)
        return {a: e.rmse() for a, e in model.items()}, still.rmse()

    scores: dict[float, float] = {}
    if counts["val"] > 0:
        by_alpha, _ = score("val", {float(a): path.coef(a) for a in alphas})
        scores = {a: float(np.mean(r / y_std)) for a, r in by_alpha.items()}
        alpha = min(scores, key=lambda a: (scores[a], -a))  # ties: the stronger regularisation
    else:
        alpha = FALLBACK_ALPHA
    coef = path.coef(alpha)
    rmse: dict[str, dict[str, list[float]]] = {}
    for name in ("train", "val", "test"):
        if counts[name] == 0:
            continue
        model, still = score(name, {alpha: coef})
        rmse[name] = {"model": model[alpha].tolist(), "persistence": still.tolist()}
    return {
        "alpha": alpha,
        "val_score_by_alpha": scores,
        "targets": snap.targets,
        "counts": counts,
        "features": int(features),
        "rmse": rmse,
        "coef": coef,
        "x_mean": path.x_mean,
        "y_mean": path.y_mean,
    }


# ---- reporting --------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def kind(v: Any) -> str:
        return "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "float" if isinstance(v, float) else "string"

    schema = [{"name": k, "type": kind(v)} for k, v in rows[0].items()] if rows else []
    return {"type": "table", "raw_value": {"records": rows, "schema": schema}}


def summarize(snap: Snapshot, result: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Flat metrics (for metadata and metrics.json) and the per-target table rows."""
    units = {node: v.model_unit for node, v in snap.variables.items()}
    rmse = result["rmse"]
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {}
    for i, t in enumerate(result["targets"]):
        row: dict[str, Any] = {"target": t, "unit": units.get(t, "")}
        for part in ("val", "test"):
            for who in ("model", "persistence"):
                value = rmse[part][who][i] if part in rmse else None
                row[f"{part}_rmse_{who}"] = value
                if value is not None:
                    metrics[f"{part}_rmse_{who}/{t}"] = value
        if "test" in rmse:
            row["test_skill"] = 1.0 - rmse["test"]["model"][i] / rmse["test"]["persistence"][i] if rmse["test"]["persistence"][i] > 0 else 0.0
        rows.append(row)
    if "test" in rmse:
        m, p = rmse["test"]["model"], rmse["test"]["persistence"]
        metrics["test_beats_persistence_all_targets"] = bool(all(a < b for a, b in zip(m, p)))
        metrics["test_mean_skill"] = float(np.mean([1.0 - a / b if b > 0 else 0.0 for a, b in zip(m, p)]))
    return metrics, rows


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_model(out_dir: Path, snap: Snapshot, result: dict[str, Any], metrics: dict[str, Any]) -> tuple[Path, str]:
    """``ridge_baseline.npz`` + ``metrics.json`` in ``out_dir``; returns (model path, version)."""
    import io

    out_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(
        buf,
        coef=result["coef"],
        x_mean=result["x_mean"],
        y_mean=result["y_mean"],
        alpha=np.float64(result["alpha"]),
        layout=np.frombuffer(json.dumps({
            "version": VERSION, "snapshotSha256": snap.sha256, "allNodes": snap.manifest["allNodes"],
            "controls": snap.manifest["controls"], "targets": snap.targets,
            "historySteps": snap.manifest["historySteps"], "horizonSteps": snap.manifest["horizonSteps"],
            "features": "concat(x[H, allNodes].ravel(), u[F, controls].ravel()), normalised",
            "outputs": "y[F, targets].ravel(), normalised (model units: * norm.y.std + norm.y.mean)",
        }).encode(), dtype=np.uint8),
    )
    model_path = out_dir / "ridge_baseline.npz"
    _write_atomic(model_path, buf.getvalue())
    doc = {"version": VERSION, "snapshotSha256": snap.sha256, "alpha": result["alpha"],
           "valScoreByAlpha": {str(k): v for k, v in result["val_score_by_alpha"].items()},
           "targets": result["targets"], "rmse": result["rmse"], **metrics}
    _write_atomic(out_dir / "metrics.json", (json.dumps(doc, indent=2) + "\n").encode())
    version = hashlib.sha256(snap.sha256.encode() + np.ascontiguousarray(result["coef"]).tobytes()).hexdigest()[:24]
    return model_path, version


def _hold(log: Any) -> None:
    path = os.environ.get(HOLD_ENV)
    if not path:
        return
    limit = float(os.environ.get(HOLD_MAX_ENV) or 120)
    Path(path + ".waiting").write_text(str(os.getpid()))
    log.info(f"{HOLD_ENV}: waiting up to {limit:g}s for {path}")
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _write_outcome(path: str | None, **outcome: Any) -> None:
    if path:
        _write_atomic(Path(path), json.dumps(outcome).encode())


def run(pipes: Any) -> None:
    extras = pipes.extras
    outcome_path = extras.get("outcome_path")
    snapshot_dir = extras["snapshot_dir"]
    _hold(pipes.log)
    started = time.monotonic()
    try:
        snap = open_snapshot(snapshot_dir, expected_sha256=extras.get("expected_sha256"))
    except SnapshotError as e:
        pipes.log.error(f"{e.code}: {e}")
        _write_outcome(outcome_path, ok=False, code=e.code, message=str(e), changed=e.changed)
        raise
    pipes.log.info(f"snapshot {snap.root} verified: sha256 {snap.sha256}; windows {snap.counts}")
    alphas = tuple(float(a) for a in (extras.get("alphas") or DEFAULT_ALPHAS))
    try:
        result = train_and_evaluate(snap, alphas)
    except Exception as e:
        code = e.code if isinstance(e, SnapshotError) else "TRAINING_FAILED"
        _write_outcome(outcome_path, ok=False, code=code, message=f"{type(e).__name__}: {e}")
        raise
    metrics, rows = summarize(snap, result)
    for row in rows:
        pipes.log.info(
            f"{row['target']} [{row['unit']}]: val RMSE model {row['val_rmse_model']} vs persistence "
            f"{row['val_rmse_persistence']}; test RMSE model {row['test_rmse_model']} vs persistence {row['test_rmse_persistence']}"
        )
    metadata: dict[str, Any] = {
        "rmse": _table(rows),
        "alpha": float(result["alpha"]),
        "alpha_grid": {"type": "json", "raw_value": {str(k): v for k, v in result["val_score_by_alpha"].items()}},
        "features": result["features"],
        **{f"windows_{k}": v for k, v in result["counts"].items()},
        **metrics,
        "snapshot_dir": {"type": "path", "raw_value": str(snap.root)},
        "snapshot_sha256": snap.sha256,
        "hash_verified": bool(snap.verified),
        "python": f"{sys.executable} ({platform.python_implementation()} {platform.python_version()})",
        "numpy_version": np.__version__,
        "trainer": VERSION,
        "train_seconds": round(time.monotonic() - started, 3),
    }
    version = None
    if extras.get("output_dir"):
        model_path, version = save_model(Path(extras["output_dir"]), snap, result, metrics)
        metadata["model_path"] = {"type": "path", "raw_value": str(model_path)}
    pipes.report_asset_materialization(metadata=metadata, data_version=version)
    _write_outcome(outcome_path, ok=True, code="OK", message=f"alpha {result['alpha']}")


def main() -> int:
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        run(pipes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
