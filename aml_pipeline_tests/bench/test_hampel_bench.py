"""The benchmark's vectorised numpy Hampel reference gives the oracle's flags exactly."""

from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.core.hampel import hampel_outliers
from aml_pipeline_tests.reference import hampel_reference
from bench.hampel_bench import adversarial_series, hampel_numpy


@pytest.mark.parametrize("k", [1, 2, 5, 8])
@pytest.mark.parametrize("min_dev", [0.0, 0.25])
def test_numpy_reference_matches_the_oracle(k, min_dev):
    rng = np.random.default_rng(k)
    cases = adversarial_series() + [rng.normal(size=n) for n in (1, 2, 3, 2 * k, 2 * k + 1, 2 * k + 2, 500)]
    for x in cases:
        expected = hampel_reference(x, k, 3.0, min_dev)
        np.testing.assert_array_equal(hampel_numpy(x, k, 3.0, min_dev), expected)
        np.testing.assert_array_equal(hampel_outliers(x, k, 3.0, min_dev), expected)


def test_numpy_reference_chunks_long_series(monkeypatch):
    import bench.hampel_bench as hb

    x = np.random.default_rng(3).normal(size=5_000)
    x[::97] += 12
    whole = hb.hampel_numpy(x, 5, 3.0)
    monkeypatch.setattr(hb, "_ROWS_PER_CHUNK", 333)  # chunk boundaries anywhere
    np.testing.assert_array_equal(hb.hampel_numpy(x, 5, 3.0), whole)
    assert whole.sum() >= 50  # the spikes are found


def test_k_zero_and_empty():
    assert not hampel_numpy(np.arange(5.0), 0, 3.0).any()
    assert hampel_numpy(np.empty(0), 5, 3.0).shape == (0,)
