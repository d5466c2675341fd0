"""iter_batches: every window once per epoch, reproducible shuffles, bounded memory, copies."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from aml_pipeline.snapshot import open_snapshot
from aml_pipeline.snapshot.batches import window_bytes
from aml_pipeline_tests.snapshot.support import write_snapshot


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    """Several runs per split, window counts that divide nothing evenly."""
    root = write_snapshot(tmp_path_factory.mktemp("batches") / "s", n=(1013, 257, 130), H=5, F=3,
                          runs={"train": [400, 313, 300], "val": [257], "test": [100, 30]}, seed=3)
    return open_snapshot(root)


def collect(snap, split, **kw):
    batches = list(snap.iter_batches(split, **kw))
    return batches, np.concatenate([b["index"] for b in batches]) if batches else np.empty(0, dtype=np.int64)


@pytest.mark.parametrize("split", ["train", "val", "test", "all"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size", [1, 64, 256, 5000])
def test_every_window_exactly_once_with_its_values(snap, split, shuffle, batch_size):
    windows = snap.split_range(split)
    batches, index = collect(snap, split, batch_size=batch_size, shuffle=shuffle, seed=7)
    assert np.array_equal(np.sort(index), np.arange(windows.start, windows.stop))
    if not shuffle:
        assert np.array_equal(index, np.arange(windows.start, windows.stop))
    for b in batches:
        for key in ("x", "u", "y"):
            np.testing.assert_array_equal(b[key], snap.array(key)[b["index"]])
            assert b[key].dtype == np.float32
    sizes = [len(b["index"]) for b in batches]
    assert all(s == batch_size for s in sizes[:-1]) and 0 < sizes[-1] <= batch_size


@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_last(snap, shuffle):
    n = len(snap.split_range("train"))
    batches, index = collect(snap, "train", batch_size=100, shuffle=shuffle, drop_last=True)
    assert [len(b["index"]) for b in batches] == [100] * (n // 100)
    assert len(np.unique(index)) == n // 100 * 100
    assert collect(snap, "test", batch_size=1000, shuffle=shuffle, drop_last=True)[0] == []


def test_shuffles_are_reproducible_and_vary_with_seed_and_epoch(snap):
    def order(**kw):
        return collect(snap, "train", batch_size=64, shuffle=True, **kw)[1]

    a = order(seed=1)
    assert np.array_equal(a, order(seed=1)) and np.array_equal(a, order(seed=1, epoch=0))
    for other in (order(seed=2), order(seed=1, epoch=1)):
        assert not np.array_equal(a, other) and np.array_equal(np.sort(a), np.sort(other))


def test_a_bounded_buffer_still_mixes_the_whole_split(snap):
    """With a buffer of ~200 windows (blocks of 8), batches draw from across the split: the first
    batch comes from many blocks, and windows travel far from their stored positions."""
    per_window = window_bytes(snap, ("x", "u", "y"))
    batches, index = collect(snap, "train", batch_size=32, shuffle=True, seed=3,
                             buffer_bytes=200 * per_window, block_windows=8)
    assert np.array_equal(np.sort(index), np.arange(len(snap.split_range("train"))))
    first_blocks = set((batches[0]["index"] // 8).tolist())
    assert len(first_blocks) >= 10
    assert np.corrcoef(index, np.arange(index.size))[0, 1] < 0.5  # far from stored order


def test_batches_are_new_arrays_not_views_of_the_maps(snap):
    for shuffle in (False, True):
        b = next(iter(snap.iter_batches("train", 16, shuffle=shuffle)))
        for key in ("x", "u", "y"):
            assert not np.shares_memory(b[key], snap.array(key)) and b[key].flags.writeable
        kept = b["x"].copy()
        b["x"][:] = 0  # the caller owns it ...
        again = next(iter(snap.iter_batches("train", 16, shuffle=shuffle)))
        np.testing.assert_array_equal(again["x"], kept)  # ... and nothing it does reaches the snapshot


def test_memory_is_bounded_by_the_buffer_not_the_split(tmp_path):
    """tracemalloc sees numpy's allocations: iterating a 36 MB split with a 2 MiB buffer
    allocates at most the buffer plus a batch or two, whatever the split's size."""
    snap = open_snapshot(write_snapshot(tmp_path / "s", n=(12_000, 10, 10), H=60, F=10,
                                        nodes=tuple(f"N{i}" for i in range(12)), controls=("N0",), targets=("N1",)))
    per_window = window_bytes(snap, ("x", "u", "y"))
    split_bytes = len(snap.split_range("train")) * per_window
    budget = 2 << 20
    batch = 64
    tracemalloc.start()
    try:
        seen = 0
        for b in snap.iter_batches("train", batch, shuffle=True, seed=0, buffer_bytes=budget):
            seen += len(b["index"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == 12_000 and split_bytes > 30 << 20
    assert peak < budget + 4 * batch * per_window + (256 << 10), (peak, budget)


def test_fields_and_arguments(snap, v2):
    v2snap = open_snapshot(v2.snapshot_dir)
    b = next(iter(v2snap.iter_batches("val", 8, fields=("timestamps", "mask", "y"))))
    assert set(b) == {"timestamps", "mask", "y", "index"}
    np.testing.assert_array_equal(b["timestamps"], v2snap.timestamps[b["index"]])
    with pytest.raises(KeyError, match="no array 'timestamps'"):
        next(iter(snap.iter_batches("train", 8, fields=("timestamps",))))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        snap.iter_batches("train", 0)
    with pytest.raises(ValueError, match="split must be one of"):
        snap.iter_batches("training", 8)
    for name, value in (("seed", 1.5), ("seed", "7"), ("seed", None), ("epoch", 0.5), ("seed", True)):
        with pytest.raises(TypeError, match=f"{name} must be an integer"):
            snap.iter_batches("train", 8, shuffle=True, **{name: value})
    with pytest.raises(ValueError, match="epoch must be an integer >= 0, got -1"):
        snap.iter_batches("train", 8, shuffle=True, epoch=-1)
    one = next(iter(snap.iter_batches("train", 8, fields="y")))  # one name, not its letters
    assert set(one) == {"y", "index"}
    with pytest.raises(ValueError, match="split must be one of"):
        snap.runs("Train")
    with pytest.raises(TypeError, match="start must be an integer"):
        snap.read_windows("x", 1.5, 3)
    with pytest.raises(ValueError, match="writable C-contiguous"):
        snap.read_windows("x", 0, 2, out=[[0.0]])
    with pytest.raises(ValueError, match=r"y values must have \d+ columns"):
        snap.to_model_units("y", np.zeros((2, 30, len(snap.targets) + 1), np.float32))


def test_the_shuffled_order_is_the_same_whichever_fields_are_read(snap):
    """x and y read in two passes with one seed stay paired (the order once depended on the
    bytes of the fields read)."""
    def order(fields):
        return np.concatenate([b["index"] for b in snap.iter_batches("train", 32, shuffle=True, seed=7, fields=fields)])

    everything = order(("x", "u", "y"))
    assert np.array_equal(order(("x",)), everything) and np.array_equal(order(("y",)), everything)
    assert not np.array_equal(everything, np.sort(everything))


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_snapshot_without_controls_has_empty_u(tmp_path, shuffle):
    snap = open_snapshot(write_snapshot(tmp_path / "s", controls=()))
    assert snap.u.shape == (10, 3, 0)
    batches, index = collect(snap, "train", batch_size=4, shuffle=shuffle)
    assert np.array_equal(np.sort(index), np.arange(6))
    assert all(b["u"].shape == (len(b["index"]), 3, 0) for b in batches)
    np.testing.assert_array_equal(np.concatenate([b["y"] for b in batches]), snap.y[index])
