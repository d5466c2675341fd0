"""The ridge baseline's numbers on data whose answer is known."""

from __future__ import annotations

import json

import numpy as np

from aml_pipeline.snapshot import open_snapshot
from aml_pipeline.training.ridge_baseline import (
    RidgePath,
    persistence,
    save_model,
    summarize,
    train_and_evaluate,
)
from aml_pipeline_tests.snapshot.support import rehash, write_snapshot


def test_ridge_path_equals_the_normal_equations():
    rng = np.random.default_rng(1)
    X, Y = rng.normal(size=(50, 7)), rng.normal(size=(50, 3))
    path = RidgePath(X, Y)
    for alpha in (0.0, 0.5, 30.0):
        Xc, Yc = X - X.mean(0), Y - Y.mean(0)
        expected = np.linalg.solve(Xc.T @ Xc + alpha * np.eye(7), Xc.T @ Yc)
        np.testing.assert_allclose(path.coef(alpha), expected, rtol=1e-8, atol=1e-10)
    # The intercept is not shrunk: a huge alpha predicts the train mean.
    np.testing.assert_allclose(path.predict(X[:2], path.coef(1e12)), np.tile(Y.mean(0), (2, 1)), atol=1e-6)
    # Accumulated in batches of any size (offset data: the merge must not cancel), the same solution.
    X, Y = X + 1e3, Y - 5e2
    whole = RidgePath(X, Y)
    batched = RidgePath()
    for part in np.split(np.arange(50), [1, 17, 18, 40]):
        batched.add(X[part], Y[part])
    for alpha in (0.0, 0.5, 30.0):
        np.testing.assert_allclose(batched.coef(alpha), whole.coef(alpha), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(batched.predict(X, batched.coef(1.0)), whole.predict(X, whole.coef(1.0)), rtol=1e-10)


def _rewrite(root, x=None, u=None, y=None, norm=None):
    m = json.loads((root / "manifest.json").read_text())
    for k, a in (("x", x), ("u", u), ("y", y)):
        if a is not None:
            (root / "arrays" / f"{k}.f32").write_bytes(np.ascontiguousarray(a, dtype="<f4").tobytes())
    if norm is not None:
        m["norm"] = norm
    (root / "manifest.json").write_text(json.dumps(m))
    rehash(root)


def test_linear_truth_is_learned_and_reported_in_model_units(tmp_path):
    """y is an exact linear function of (x, u): ridge with a small alpha recovers it, while
    persistence is off by the known amount; RMSE comes out in model (de-normalised) units."""
    root = write_snapshot(tmp_path / "s", n=(300, 60, 60), H=4, F=3, seed=2)
    snap = open_snapshot(root)
    rng = np.random.default_rng(3)
    N = snap.x.shape[0]
    feats = np.concatenate([snap.x.reshape(N, -1), snap.u.reshape(N, -1)], 1).astype(np.float64)
    W = rng.normal(size=(feats.shape[1], 6)) * 0.3
    y = (feats @ W).reshape(N, 3, 2)
    norm = {"x": {"mean": [300.0, 50.0, 0.0, 0.0], "std": [10.0, 2.0, 1.0, 1.0]},
            "u": {"mean": [0.0], "std": [1.0]}, "y": {"mean": [300.0, 50.0], "std": [10.0, 2.0]}}
    _rewrite(root, y=y, norm=norm)
    snap = open_snapshot(root)
    result = train_and_evaluate(snap, alphas=(1e-6, 1.0, 1e4))
    assert result["alpha"] == 1e-6
    test_model = np.array(result["rmse"]["test"]["model"])
    assert np.all(test_model < 1e-3)
    # Persistence by hand: last history value of each target (T1 = node 0, Q1 = node 1), in model units.
    test_windows = snap.split_range("test")
    part = slice(test_windows.start, test_windows.stop)
    y_phys = snap.y[part].astype(np.float64) * [10.0, 2.0] + [300.0, 50.0]
    last = snap.x[part, -1, :2].astype(np.float64) * [10.0, 2.0] + [300.0, 50.0]
    expected = np.sqrt(((y_phys - last[:, None, :]) ** 2).mean(axis=(0, 1)))
    np.testing.assert_allclose(result["rmse"]["test"]["persistence"], expected, rtol=1e-9)
    np.testing.assert_allclose(persistence(snap, part)[:, 0, :], last)
    metrics, rows = summarize(snap, result)
    assert metrics["test_beats_persistence_all_targets"] is True
    assert [r["target"] for r in rows] == ["T1", "Q1"] and rows[0]["test_skill"] > 0.99


def test_alpha_is_chosen_on_val_and_val_can_be_empty(tmp_path):
    root = write_snapshot(tmp_path / "s", n=(40, 0, 10), seed=4)
    result = train_and_evaluate(open_snapshot(root))
    assert result["alpha"] == 1.0 and result["val_score_by_alpha"] == {} and "val" not in result["rmse"]
    metrics, rows = summarize(open_snapshot(root), result)
    assert rows[0]["val_rmse_model"] is None and "test_mean_skill" in metrics
    # Pure noise targets: heavy regularisation wins on val.
    noisy = write_snapshot(tmp_path / "n", n=(30, 200, 10), H=6, seed=5)
    assert train_and_evaluate(open_snapshot(noisy))["alpha"] >= 100


def test_model_and_metrics_are_saved(tmp_path):
    snap = open_snapshot(write_snapshot(tmp_path / "s", seed=6))
    result = train_and_evaluate(snap)
    metrics, _ = summarize(snap, result)
    model_path, version = save_model(tmp_path / "out", snap, result, metrics)
    with np.load(model_path) as z:
        assert z["coef"].shape == (4 * 4 + 3 * 1, 3 * 2) and float(z["alpha"]) == result["alpha"]
        layout = json.loads(bytes(z["layout"]).decode())
    assert layout["snapshotSha256"] == snap.sha256 and layout["targets"] == ["T1", "Q1"]
    doc = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert doc["snapshotSha256"] == snap.sha256 and len(version) == 24
    assert save_model(tmp_path / "out2", snap, result, metrics)[1] == version  # deterministic


def test_both_layouts_give_the_same_model(tmp_path, monkeypatch):
    """The same spec and data in the windows and the series layout: the same batches, hence
    the same model and metrics, bit for bit."""
    from aml_pipeline_tests.library_build import build_dataset
    from aml_pipeline.training import ridge_baseline
    from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
    from aml_pipeline.spec import parse_spec
    from aml_pipeline.tsdb_open import open_tsdb

    plant = simulate_plant(n_runs=6, run_minutes=8, seed=5)
    url = f"duckdb://{tmp_path / 'tsdb.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    results = {}
    monkeypatch.setattr(ridge_baseline, "BATCH_WINDOWS", 256)
    with open_tsdb(url) as db:
        for layout in ("windows", "series"):
            spec = parse_spec({**plant_spec_dict(plant, "ridge_ds", history_steps=12, horizon_steps=6, extras=True,
                                                 split={"method": "chronological", "train": 0.5, "val": 0.25,
                                                        "test": 0.25, "seed": 0}), "layout": layout})
            published = build_dataset(spec, db, store_root=tmp_path / layout / "store", datasets_root=tmp_path / layout / "ds")
            snap = open_snapshot(published.snapshot_dir)
            assert snap.layout == layout and len(snap) > 4 * 256  # several batches per pass
            results[layout] = train_and_evaluate(snap)
    a, b = results["windows"], results["series"]
    assert a["alpha"] == b["alpha"] and a["rmse"] == b["rmse"] and a["val_score_by_alpha"] == b["val_score_by_alpha"]
    assert np.array_equal(a["coef"], b["coef"])
