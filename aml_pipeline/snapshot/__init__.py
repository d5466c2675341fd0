"""Reading published snapshots: verified, memory-mapped, in batches, for training code anywhere.

    from aml_pipeline.snapshot import open_snapshot

    snap = open_snapshot("datasets/reactor_a/current")   # streams every byte through sha256 first
    snap.x, snap.u, snap.y                                # numpy.memmap, nothing loaded yet
    snap.split_range("train"), snap.runs("val")           # window ranges, one block per run
    for batch in snap.iter_batches("train", 256, shuffle=True, seed=0):
        ...                                               # {"x", "u", "y", "index"}: numpy arrays
    snap.to_engineering_units("y", prediction)            # back from the normalised model space

Depends on numpy and the standard library only, and imports nothing else of ``aml_pipeline``,
so it works on a training machine with neither Dagster nor the pipeline installed, and in the
shared environment (the ridge baseline loads it from its files). Optional parts import their
library when used: :mod:`aml_pipeline.snapshot.torch` (PyTorch ``Dataset``) and
:mod:`aml_pipeline.snapshot.export` (Parquet, via pyarrow). See docs/consumers.md.
"""

from .layout import DIGEST_FILE, MANIFEST_FILE, SPEC_FILE, SPLITS, SnapshotError, hashed_files
from .reader import Block, Norm, Snapshot, Variable, open_snapshot

__all__ = [
    "DIGEST_FILE",
    "MANIFEST_FILE",
    "SPEC_FILE",
    "SPLITS",
    "Block",
    "Norm",
    "Snapshot",
    "SnapshotError",
    "Variable",
    "hashed_files",
    "open_snapshot",
]
