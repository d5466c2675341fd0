"""Train/val/test split by run, never by window (docs/spec.md, split).

Overlapping windows of one run are near-duplicates; splitting them across train and test would
leak. Both methods therefore assign whole runs. ``chronological`` keeps the latest runs for test
(what a model will meet in production); ``hashed`` gives each run a fixed pseudo-random place that
does not move when new runs arrive, so earlier runs never migrate between splits.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Mapping, Sequence

from aml_pipeline.snapshot.layout import SPLITS
SPLIT_METHODS: tuple[str, ...] = ("chronological", "hashed")


def hashed_fraction(seed: int, run_id: str) -> float:
    """First 8 bytes of ``sha256(f"{seed}:{run_id}")`` as a big-endian unsigned int, divided by 2**64."""
    digest = hashlib.sha256(f"{seed}:{run_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_runs(
    runs: Sequence[tuple[str, int]],
    *,
    method: str,
    train: float,
    val: float,
    test: float,
    seed: int,
) -> dict[str, list[str]]:
    """Assign ``(run_id, started_at)`` runs (only runs that have windows) to train/val/test.

    Within each split, runs are ordered by ``(started_at, run_id)``.
    """
    if method not in SPLIT_METHODS:
        raise ValueError(f"split method must be one of {SPLIT_METHODS}, got {method!r}")
    fractions = {"train": train, "val": val, "test": test}
    for name, f in fractions.items():
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not (0.0 <= float(f) <= 1.0):
            raise ValueError(f"split fraction {name} must be a number in [0, 1], got {f!r}")
    total = float(train) + float(val) + float(test)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"split fractions train + val + test must sum to 1, got {total}")
    ordered = sorted(((int(started), str(rid)) for rid, started in runs))
    seen: set[str] = set()
    for _, rid in ordered:
        if rid in seen:
            raise ValueError(f"run {rid!r} is listed more than once")
        seen.add(rid)

    out: dict[str, list[str]] = {name: [] for name in SPLITS}
    if method == "chronological":
        n = len(ordered)
        # Plain float multiply then floor, as the predecessor did, so the same inputs give the
        # same split sizes (e.g. 100 * 0.29 = 28.999999999999996 -> 28 validation runs).
        n_val = math.floor(n * float(val))
        n_test = math.floor(n * float(test))
        n_train = n - n_val - n_test
        ids = [rid for _, rid in ordered]
        out["train"] = ids[:n_train]
        out["val"] = ids[n_train : n_train + n_val]
        out["test"] = ids[n_train + n_val :]
    else:
        for _, rid in ordered:
            u = hashed_fraction(seed, rid)
            if u < float(train):
                out["train"].append(rid)
            elif u < float(train) + float(val):
                out["val"].append(rid)
            else:
                out["test"].append(rid)
    return out


def split_blocks(split: Mapping[str, Sequence[str]], windows_per_run: Mapping[str, int]) -> list[dict]:
    """One block per run, train then val then test: the manifest's ``split.blocks``.

    A block is the unit a consumer may not cut: today one run, with no purge inside it.
    """
    blocks: list[dict] = []
    for name in SPLITS:
        for rid in split.get(name, ()):
            if rid not in windows_per_run:
                raise ValueError(f"split_blocks: run {rid!r} (split {name}) has no window count")
            blocks.append(
                {
                    "blockId": f"{rid}#0",
                    "runId": rid,
                    "split": name,
                    "purgeBeforeSteps": 0,
                    "purgeAfterSteps": 0,
                    "uniqueSteps": int(windows_per_run[rid]),
                }
            )
    return blocks
