from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.core import hampel as hampel_mod
from aml_pipeline.core.hampel import hampel_outliers, sorting_network
from aml_pipeline_tests.reference import hampel_reference, hampel_reference_numpy

# --- sorting network ---------------------------------------------------------------------------


def _sorts_all_binary_inputs(n: int, network: tuple[tuple[int, int], ...]) -> bool:
    """0-1 principle: a comparator network sorts every input iff it sorts all 2**n 0-1 inputs.

    Bit-parallel: wire i holds bit i of every input vector v = 0..2**n-1, packed 8 vectors per
    byte; a comparator is AND (min) / OR (max) over whole wires at once.
    """
    if n <= 3:
        v = np.arange(1 << n)
        wires = [((v >> i) & 1).astype(bool) for i in range(n)]
    else:
        n_bytes = 1 << (n - 3)
        wires = []
        for i in range(n):
            if i < 3:
                byte_bits = [(v >> i) & 1 for v in range(8)]
                wires.append(np.full(n_bytes, np.packbits(byte_bits, bitorder="little")[0], dtype=np.uint8))
            else:
                run = 1 << (i - 3)
                pattern = np.repeat(np.array([0, 255], dtype=np.uint8), run)
                wires.append(np.tile(pattern, n_bytes // pattern.size))
    for a, b in network:
        assert a < b
        lo = wires[a] & wires[b]
        wires[b] = wires[a] | wires[b]
        wires[a] = lo
    return all(not np.any(wires[i] & ~wires[i + 1]) for i in range(n - 1))


@pytest.mark.parametrize("n", range(1, 26))
def test_sorting_network_sorts_every_binary_input(n: int) -> None:
    network = sorting_network(n)
    assert all(0 <= a < b < n for a, b in network)
    assert _sorts_all_binary_inputs(n, network)


def test_zero_one_check_rejects_a_broken_network() -> None:
    network = sorting_network(11)
    assert not _sorts_all_binary_inputs(11, network[:-1])
    assert not _sorts_all_binary_inputs(11, network[1:])


@pytest.mark.parametrize("n", [26, 31, 33, 40, 41])
def test_sorting_network_sorts_random_inputs_beyond_exhaustive_sizes(n: int) -> None:
    rng = np.random.default_rng(n)
    data = np.concatenate([rng.integers(0, 2, size=(4000, n)), rng.integers(-5, 5, size=(4000, n))]).astype(
        float
    )
    cols = [data[:, j].copy() for j in range(n)]
    for a, b in sorting_network(n):
        cols[a], cols[b] = np.minimum(cols[a], cols[b]), np.maximum(cols[a], cols[b])
    assert np.array_equal(np.column_stack(cols), np.sort(data, axis=1))


def test_sorting_network_small_sizes() -> None:
    assert sorting_network(0) == ()
    assert sorting_network(1) == ()
    assert sorting_network(2) == ((0, 1),)
    assert len(sorting_network(11)) <= 37  # merge-exchange; optimal is 35


# --- equality with the reference ----------------------------------------------------------------


def _series(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    x = rng.normal(size=n) * 3.0
    if kind == "quantised":
        return np.round(x)  # many ties: MAD 0 plateaus, equal medians
    if kind == "coarse":
        return np.round(x / 4.0) * 0.25 + 300.0  # few distinct values around a plant-like offset
    if kind == "spiky":
        spikes = rng.random(n) < 0.05
        x[spikes] += rng.choice([-40.0, 40.0], size=int(spikes.sum()))
        return x
    return x


@pytest.mark.parametrize("trailing", [False, True], ids=["centred", "trailing"])
@pytest.mark.parametrize("k", range(0, 9))
def test_flags_identical_to_reference(k: int, trailing: bool) -> None:
    rng = np.random.default_rng(1000 + k)
    for n in sorted({0, 1, 2, 3, k, 2 * k, 2 * k + 1, 2 * k + 2, 1000}):
        for kind in ("quantised", "coarse", "spiky", "normal"):
            x = _series(rng, n, kind)
            for sigma, min_dev in ((3.0, 0.0), (2.0, 0.0), (3.0, 1.0), (0.0, 0.0), (1.5, 0.25)):
                got = hampel_outliers(x, k, sigma, min_dev, trailing=trailing)
                want = hampel_reference(x, k, sigma, min_dev, trailing=trailing)
                assert got.dtype == bool and got.shape == (n,)
                assert np.array_equal(got, want), (k, n, kind, sigma, min_dev, np.flatnonzero(got != want))


@pytest.mark.parametrize("path", ["network", "sort"])
@pytest.mark.parametrize("k", [1, 3, 5, 12])
def test_trailing_flags_on_both_interior_paths_and_many_blocks(k: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hampel_mod, "_MIN_BLOCK", 7)
    monkeypatch.setattr(hampel_mod, "_MAX_BLOCK", 7)
    if path == "sort":
        monkeypatch.setattr(hampel_mod, "_NETWORK_MAX_WINDOW", 0)
    else:
        monkeypatch.setattr(hampel_mod, "_NETWORK_MAX_WINDOW", 10_000)
        monkeypatch.setattr(hampel_mod, "_NETWORK_MIN_POINTS_PER_W2", 0)
    rng = np.random.default_rng(50 + k)
    x = _series(rng, 300, "spiky")
    want = hampel_reference(x, k, 3.0, 0.0, trailing=True)
    assert want.any()
    assert np.array_equal(hampel_outliers(x, k, 3.0, trailing=True), want)


def test_a_trailing_flag_never_depends_on_a_later_point() -> None:
    """Each prefix of a series gets the flags the whole series gives its points; the centred
    window does not (its last k points are judged again once later points arrive)."""
    rng = np.random.default_rng(7)
    x = _series(rng, 400, "spiky")
    whole = hampel_outliers(x, 5, 3.0, trailing=True)
    for n in range(1, 400, 7):
        assert np.array_equal(hampel_outliers(x[:n], 5, 3.0, trailing=True), whole[:n])
    centred = hampel_outliers(x, 5, 3.0)
    assert any(not np.array_equal(hampel_outliers(x[:n], 5, 3.0), centred[:n]) for n in range(1, 400, 7))


def test_a_spike_is_flagged_by_the_trailing_window_and_a_step_is_followed_after_k_points() -> None:
    x = np.zeros(40)
    x[::2] = 0.1
    x[10] = 5.0  # a spike
    x[25:] += 3.0  # a step: the first points after it are judged against the old level
    flags = hampel_outliers(x, 3, 3.0, trailing=True)
    assert flags[10]
    assert flags[25] and not flags[25 + 3 + 1 :].any()


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_reference_matches_numpy_median_definition(k: int) -> None:
    # The pure-Python reference (fast enough to benchmark against) must itself agree with
    # np.median, including the even-length windows at the ends.
    rng = np.random.default_rng(k)
    for n in (1, 2, 3, 2 * k, 2 * k + 1, 60):
        x = np.round(rng.normal(size=n) * 2.0)
        assert np.array_equal(hampel_reference(x, k, 2.0, 0.0), hampel_reference_numpy(x, k, 2.0, 0.0))
        assert np.array_equal(hampel_reference(x, k, 3.0, 0.5), hampel_reference_numpy(x, k, 3.0, 0.5))


@pytest.mark.parametrize("k", [9, 12, 20, 21, 30])
def test_wide_windows_network_and_sort_paths_agree_with_reference(
    k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(k)
    x = np.round(rng.normal(size=400) * 2.0)
    x[rng.random(400) < 0.03] += 30.0
    want = hampel_reference(x, k, 2.5, 0.0)
    assert np.array_equal(hampel_outliers(x, k, 2.5), want)
    monkeypatch.setattr(hampel_mod, "_NETWORK_MAX_WINDOW", 0)  # force np.sort path
    assert np.array_equal(hampel_outliers(x, k, 2.5), want)
    monkeypatch.setattr(hampel_mod, "_NETWORK_MAX_WINDOW", 10_000)  # force network path
    monkeypatch.setattr(hampel_mod, "_NETWORK_MIN_POINTS_PER_W2", 0)
    assert np.array_equal(hampel_outliers(x, k, 2.5), want)


@pytest.mark.parametrize("path", ["network", "sort"])
def test_partial_and_many_blocks(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny blocks exercise block boundaries and the short final block in both interior paths.
    monkeypatch.setattr(hampel_mod, "_MIN_BLOCK", 7)
    monkeypatch.setattr(hampel_mod, "_MAX_BLOCK", 7)
    monkeypatch.setattr(hampel_mod, "_SORT_CHUNK_ELEMENTS", 50)
    if path == "network":
        monkeypatch.setattr(hampel_mod, "_NETWORK_MIN_POINTS_PER_W2", 0)
    else:
        monkeypatch.setattr(hampel_mod, "_NETWORK_MAX_WINDOW", 0)
    rng = np.random.default_rng(7)
    x = np.round(rng.normal(size=523) * 3.0)
    for k in (1, 3, 5, 8):
        assert np.array_equal(hampel_outliers(x, k, 3.0), hampel_reference(x, k, 3.0))
        assert np.array_equal(hampel_outliers(x, k, 3.0, 1.0), hampel_reference(x, k, 3.0, 1.0))


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_short_series_on_both_paths(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(70 + k)
    series = [np.round(rng.normal(size=n) * 2.0) for n in (2 * k + 1, 2 * k + 2, 2 * k + 5, 60, 300)]
    for x in series:
        assert np.array_equal(hampel_outliers(x, k, 2.0), hampel_reference(x, k, 2.0))
    monkeypatch.setattr(hampel_mod, "_NETWORK_MIN_POINTS_PER_W2", 0)
    for x in series:
        assert np.array_equal(hampel_outliers(x, k, 2.0), hampel_reference(x, k, 2.0))


def test_long_series_default_blocks_match_reference() -> None:
    rng = np.random.default_rng(99)
    x = np.cumsum(rng.normal(size=40_000)) + np.round(rng.normal(size=40_000))
    x[rng.integers(0, x.size, 200)] += 25.0
    assert np.array_equal(hampel_outliers(x, 5, 3.0), hampel_reference(x, 5, 3.0))


def test_large_k_relative_to_n_uses_the_whole_series() -> None:
    # k >= n: every window is the whole series.
    x = np.array([0.0, 1.0, 0.0, 100.0, 1.0, 0.0])
    got = hampel_outliers(x, 50, 3.0)
    assert np.array_equal(got, hampel_reference(x, 50, 3.0))
    assert got.tolist() == [False, False, False, True, False, False]


# --- behaviour ----------------------------------------------------------------------------------


def test_spike_is_flagged_and_neighbours_are_not() -> None:
    x = np.array([10.0, 10.1, 9.9, 10.0, 55.0, 10.2, 9.8, 10.0, 10.1, 9.9])
    assert np.flatnonzero(hampel_outliers(x, 3, 3.0)).tolist() == [4]


def test_k_zero_disables_the_filter() -> None:
    x = np.array([0.0, 0.0, 1e9, 0.0])
    assert not hampel_outliers(x, 0, 3.0).any()


def test_min_dev_floors_the_threshold_for_quantised_plateaus() -> None:
    # On a plateau MAD is 0, so without a floor a single quantisation step is an "outlier".
    x = np.array([20.0, 20.0, 20.0, 21.0, 20.0, 20.0, 20.0])
    assert np.flatnonzero(hampel_outliers(x, 3, 3.0)).tolist() == [3]
    assert not hampel_outliers(x, 3, 3.0, min_dev=1.0).any()  # |21 - 20| > 1 is false: strict
    assert np.flatnonzero(hampel_outliers(x, 3, 3.0, min_dev=0.999)).tolist() == [3]


def test_constant_series_has_no_outliers() -> None:
    assert not hampel_outliers(np.full(100, 273.15), 5, 3.0).any()


def test_sigma_zero_flags_every_point_off_its_median() -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0, 50.0, 6.0, 7.0])
    got = hampel_outliers(x, 1, 0.0)
    assert np.array_equal(got, hampel_reference(x, 1, 0.0))
    assert got[4]


def test_input_is_not_modified_and_strided_input_works() -> None:
    rng = np.random.default_rng(3)
    base = np.round(rng.normal(size=2001) * 2)
    keep = base.copy()
    x = base[::2]
    got = hampel_outliers(x, 4, 2.0)
    assert np.array_equal(base, keep)
    assert np.array_equal(got, hampel_reference(np.ascontiguousarray(x), 4, 2.0))
    ints = np.arange(30) % 7  # non-float input is converted
    assert np.array_equal(hampel_outliers(ints, 2, 1.0), hampel_reference(ints.astype(float), 2, 1.0))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((np.zeros((2, 3)), 1, 3.0), "1-D"),
        ((np.zeros(5), -1, 3.0), "k must be >= 0"),
        ((np.zeros(5), 1.5, 3.0), "k must be an integer"),
        ((np.zeros(5), True, 3.0), "k must be an integer"),
        ((np.zeros(5), 1, -1.0), "sigma"),
        ((np.zeros(5), 1, float("nan")), "sigma"),
        ((np.zeros(5), 1, 3.0, -0.1), "min_dev"),
        ((np.array([0.0, np.nan, 1.0]), 1, 3.0), r"x\[1\]"),
        ((np.array([0.0, np.inf, 1.0]), 1, 3.0), "finite"),
    ],
)
def test_bad_arguments_raise_value_error(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hampel_outliers(*args)


@pytest.mark.parametrize("trailing", [False, True], ids=["centred", "trailing"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_several_series_in_one_call_get_each_series_own_flags(k: int, trailing: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(20 + k)
    lengths = [0, 1, 2, k, 2 * k, 2 * k + 1, 3, 60, 0, 250, 7]
    series = [_series(rng, n, "spiky") + 100.0 * j for j, n in enumerate(lengths)]  # levels far apart
    starts = np.cumsum([0, *lengths[:-1]])
    x = np.concatenate(series)
    want = np.concatenate([hampel_reference(s, k, 3.0, 0.0, trailing=trailing) for s in series])
    assert want.any()
    for path in ("default", "sort", "network"):
        if path == "sort":
            monkeypatch.setattr(hampel_mod, "_NETWORK_MAX_WINDOW", 0)
        elif path == "network":
            monkeypatch.setattr(hampel_mod, "_NETWORK_MAX_WINDOW", 10_000)
            monkeypatch.setattr(hampel_mod, "_NETWORK_MIN_POINTS_PER_W2", 0)
        got = hampel_outliers(x, k, 3.0, trailing=trailing, starts=starts)
        assert np.array_equal(got, want), (path, np.flatnonzero(got != want))
    with pytest.raises(ValueError, match="starts"):
        hampel_outliers(x, k, 3.0, starts=np.array([1, 5]))
