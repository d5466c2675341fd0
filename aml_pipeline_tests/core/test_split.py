from __future__ import annotations

import hashlib
import math
import random

import pytest

from aml_pipeline.core.split import hashed_fraction, split_blocks, split_runs

CHRONO = dict(method="chronological", train=0.7, val=0.15, test=0.15, seed=0)


def _runs(n: int) -> list[tuple[str, int]]:
    # Deliberately shuffled, with run ids whose order differs from the start-time order.
    order = list(range(n))
    random.Random(n).shuffle(order)
    return [(f"run-{(n - i) * 37 % 1009:04d}-{i}", 1_000_000 + i * 3600_000) for i in order]


def test_hashed_fraction_is_the_first_8_sha256_bytes_over_2_64() -> None:
    digest = hashlib.sha256(b"42:batch-0007").digest()
    assert hashed_fraction(42, "batch-0007") == int.from_bytes(digest[:8], "big") / 2**64
    assert 0.0 <= hashed_fraction(0, "x") < 1.0
    assert hashed_fraction(0, "x") != hashed_fraction(1, "x")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 6, 7, 10, 13, 20, 21, 100])
def test_chronological_sizes_use_floor_and_the_rest_is_train(n: int) -> None:
    s = split_runs(_runs(n), **CHRONO)
    n_val, n_test = math.floor(n * 0.15), math.floor(n * 0.15)
    assert (len(s["train"]), len(s["val"]), len(s["test"])) == (n - n_val - n_test, n_val, n_test)


def test_chronological_known_sizes() -> None:
    sizes = {n: tuple(len(v) for v in split_runs(_runs(n), **CHRONO).values()) for n in (1, 6, 7, 14, 20)}
    assert sizes == {1: (1, 0, 0), 6: (6, 0, 0), 7: (5, 1, 1), 14: (10, 2, 2), 20: (14, 3, 3)}


def test_chronological_keeps_the_predecessors_float_floor() -> None:
    # 100 * 0.29 == 28.999999999999996 in binary floating point: 28 validation runs, not 29.
    s = split_runs(_runs(100), method="chronological", train=0.5, val=0.29, test=0.21, seed=0)
    assert len(s["val"]) == 28 and len(s["test"]) == 21 and len(s["train"]) == 51


def test_chronological_order_train_first_test_last() -> None:
    runs = [("c", 300), ("a", 100), ("e", 500), ("b", 200), ("d", 400), ("f", 600), ("g", 700)]
    s = split_runs(runs, **CHRONO)
    assert s == {"train": ["a", "b", "c", "d", "e"], "val": ["f"], "test": ["g"]}


def test_ties_in_start_time_are_broken_by_run_id() -> None:
    runs = [("r2", 100), ("r10", 100), ("r1", 100), ("r0", 50)]
    s = split_runs(runs, method="chronological", train=0.5, val=0.25, test=0.25, seed=0)
    assert s == {"train": ["r0", "r1"], "val": ["r10"], "test": ["r2"]}


def test_hashed_assignment_follows_the_thresholds() -> None:
    runs = _runs(300)
    s = split_runs(runs, method="hashed", train=0.6, val=0.25, test=0.15, seed=7)
    for rid, _ in runs:
        u = hashed_fraction(7, rid)
        expected = "train" if u < 0.6 else "val" if u < 0.6 + 0.25 else "test"
        assert rid in s[expected]
    assert sorted(s["train"] + s["val"] + s["test"]) == sorted(r for r, _ in runs)
    assert 120 < len(s["train"]) < 240  # roughly 60 %


def test_hashed_split_is_stable_when_runs_are_added() -> None:
    before = split_runs(_runs(40), method="hashed", train=0.7, val=0.15, test=0.15, seed=3)
    more = _runs(40) + [(f"new-{i}", 10**9 + i) for i in range(60)]
    after = split_runs(more, method="hashed", train=0.7, val=0.15, test=0.15, seed=3)
    for name in ("train", "val", "test"):
        assert set(before[name]) <= set(after[name])


def test_runs_within_a_split_are_in_time_order_for_both_methods() -> None:
    runs = _runs(60)
    started = dict(runs)
    for method in ("chronological", "hashed"):
        s = split_runs(runs, method=method, train=0.6, val=0.2, test=0.2, seed=1)
        for ids in s.values():
            assert ids == sorted(ids, key=lambda r: (started[r], r))


@pytest.mark.parametrize(
    ("runs", "kwargs", "message"),
    [
        ([("a", 1), ("a", 2)], CHRONO, "more than once"),
        ([("a", 1)], {**CHRONO, "method": "random"}, "method"),
        ([("a", 1)], {**CHRONO, "train": 0.8}, "sum to 1"),
        ([("a", 1)], {**CHRONO, "val": -0.1, "train": 0.95}, "val"),
        ([("a", 1)], {**CHRONO, "test": float("nan")}, "test"),
    ],
)
def test_split_rejects_bad_arguments(runs, kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_runs(runs, **kwargs)


def test_split_blocks_one_per_run_in_split_order() -> None:
    split = {"train": ["a", "b"], "val": ["c"], "test": ["d"]}
    blocks = split_blocks(split, {"a": 10, "b": 3, "c": 7, "d": 1, "unused": 9})
    assert blocks == [
        {
            "blockId": "a#0",
            "runId": "a",
            "split": "train",
            "purgeBeforeSteps": 0,
            "purgeAfterSteps": 0,
            "uniqueSteps": 10,
        },
        {
            "blockId": "b#0",
            "runId": "b",
            "split": "train",
            "purgeBeforeSteps": 0,
            "purgeAfterSteps": 0,
            "uniqueSteps": 3,
        },
        {
            "blockId": "c#0",
            "runId": "c",
            "split": "val",
            "purgeBeforeSteps": 0,
            "purgeAfterSteps": 0,
            "uniqueSteps": 7,
        },
        {
            "blockId": "d#0",
            "runId": "d",
            "split": "test",
            "purgeBeforeSteps": 0,
            "purgeAfterSteps": 0,
            "uniqueSteps": 1,
        },
    ]
    assert split_blocks({"train": [], "val": [], "test": []}, {}) == []
    with pytest.raises(ValueError, match="'c'"):
        split_blocks(split, {"a": 1, "b": 1, "d": 1})
