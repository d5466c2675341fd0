"""The blocking checks on a series snapshot: its values through its window index, in bounded memory."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np

from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline.pipeline import checks
from aml_pipeline.pipeline.checks import check_finite_arrays, check_norm_from_train
from aml_pipeline_tests.snapshot.support import rehash, write_series_snapshot


def test_the_checks_read_a_series_snapshot_in_bounded_memory(tmp_path):
    """tracemalloc sees numpy's allocations: both checks read stored rows several times their
    bound (windows that would take forty times more, cut), allocating a fraction of them."""
    root = write_series_snapshot(tmp_path / "s", runs=(1_200_000, 100_000, 100_000), H=60, F=10,
                                 nodes=tuple(f"N{i}" for i in range(12)), controls=("N0",), targets=("N1",))
    manifest = json.loads((root / "manifest.json").read_text())
    rows = (root / "arrays" / "x_rows.f32").stat().st_size
    assert rows > 64 << 20
    for check in (check_finite_arrays, check_norm_from_train):
        tracemalloc.start()
        try:
            outcome = check(root, manifest)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 24 << 20, (check.__name__, peak)
        if check is check_finite_arrays:
            assert outcome.passed, outcome.description


def test_the_norm_check_weights_each_row_by_the_train_windows_that_read_it(tmp_path):
    """Rows normalised with the statistics of the train windows (each row counted once per
    window reading it) pass; normalised with the statistics of the rows themselves, they fail."""
    H, F = 6, 3
    root = write_series_snapshot(tmp_path / "s", runs=(400, 50, 50), H=H, F=F, nodes=("T1", "C1"), controls=("C1",),
                                 targets=("T1",))
    m = json.loads((root / "manifest.json").read_text())
    rng = np.random.default_rng(1)
    stats = {}
    for name, steps in (("x", H), ("u", F), ("y", F)):
        key = f"{name}Rows"
        raw = rng.gamma(2.0, size=tuple(m["shapes"][key]))
        # The train run's rows come first; rows near its ends are read by fewer windows.
        train = raw[: 400 + steps - 1]
        weights = np.convolve(np.ones(400), np.ones(steps))  # train windows reading each row
        mean = (weights[:, None] * train).sum(0) / weights.sum()
        std = np.sqrt((weights[:, None] * (train - mean) ** 2).sum(0) / weights.sum())
        stats[name] = (raw, (mean, std), (train.mean(0), train.std(0)))
    for which, passes in ((1, True), (2, False)):
        for name, got in stats.items():
            mean, std = got[which]
            ((got[0] - mean) / std).astype("<f4").tofile(root / "arrays" / f"{name}_rows.f32")
        rehash(root)
        outcome = check_norm_from_train(root, m)
        assert outcome.passed is passes, outcome.description
        assert passes or "x: T1, C1; u: C1; y: T1" in outcome.description, outcome.description


def test_the_checks_read_the_window_index_once(tmp_path, monkeypatch):
    """Both checks that need the window index share one read of it; an unreadable index fails both."""
    root = write_series_snapshot(tmp_path / "s", runs=(400, 50, 50), H=6, F=3, nodes=("T1", "C1"), controls=("C1",),
                                 targets=("T1",))
    reads = []
    real = checks._series_index
    monkeypatch.setattr(checks, "_series_index", lambda *a: reads.append(1) or real(*a))
    outcomes = {o.name: o for o in checks.snapshot_checks(root, verify_snapshot(root).actual)}
    assert len(reads) == 1 and outcomes["no_nan_or_inf"].passed
    segments = root / "arrays" / "segments.i64"
    segments.write_bytes(segments.read_bytes()[:-8])
    outcomes = {o.name: o for o in checks.snapshot_checks(root, verify_snapshot(root).actual)}
    assert len(reads) == 2
    assert "window index" in outcomes["no_nan_or_inf"].description and not outcomes["no_nan_or_inf"].passed
    assert "window index" in outcomes["norm_stats_from_train_only"].description
    assert not outcomes["norm_stats_from_train_only"].passed
