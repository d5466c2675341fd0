"""PyTorch: a map-style ``Dataset`` over a snapshot's memory maps (torch is optional).

    from torch.utils.data import DataLoader
    from aml_pipeline.snapshot.torch import SnapshotDataset

    train = SnapshotDataset("datasets/reactor_a/current", split="train")   # verified once, here
    loader = DataLoader(train, batch_size=256, shuffle=True, num_workers=4)
    for batch in loader:   # {"x": [B, H, nodes], "u": [B, F, controls], "y": [B, F, targets], "index": [B]}
        ...

Safe with ``DataLoader`` workers under any start method: pickling the dataset carries the
snapshot's path and the identity (device, inode, size, mtime) of every file verified in the
parent, never array data; each process opens and maps the files itself on first use, and refuses
them unless they are still the files that were verified. Samples are new tensors (copies of
the stored float32 values), equal to the numpy arrays of :class:`Snapshot`.

Importing this module imports torch; ``aml_pipeline.snapshot`` itself never does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .batches import field_names, whole_number
from .reader import Snapshot, open_snapshot

Sample = dict[str, Any]


class SnapshotDataset(Dataset):
    """The windows of one split; item ``i`` is the split's ``i``-th window as a dict of tensors
    (``fields``, default ``x``, ``u``, ``y``) plus ``index``, its position in the snapshot."""

    def __init__(
        self,
        snapshot: Snapshot | str | os.PathLike[str],
        split: str = "train",
        fields: Sequence[str] = ("x", "u", "y"),
        *,
        verify: bool = True,
        expected_sha256: str | None = None,
        transform: Callable[[Sample], Any] | None = None,
    ) -> None:
        snap = snapshot if isinstance(snapshot, Snapshot) else open_snapshot(snapshot, verify, expected_sha256=expected_sha256)
        self.fields = field_names(fields)
        for f in self.fields:
            snap.array(f)  # KeyError naming what the snapshot has
        self.split = split
        self.windows = snap.split_range(split)
        self.sha256 = snap.sha256
        self.transform = transform
        self._state = snap.__getstate__()  # path + verified file identities: what a worker needs
        self._snap: Snapshot | None = snap
        self._pid = os.getpid()

    def snapshot(self) -> Snapshot:
        """This process's own snapshot (opened, without hashing again, on first use after a
        fork or in a spawned worker)."""
        if self._snap is None or self._pid != os.getpid():
            snap = Snapshot.__new__(Snapshot)
            snap.__setstate__(self._state)
            self._snap, self._pid = snap, os.getpid()
        return self._snap

    def __len__(self) -> int:
        return len(self.windows)

    def _window(self, i: Any) -> int:
        i = whole_number("SnapshotDataset index", i, -(1 << 63))  # never a float rounded down
        try:
            return self.windows[i]
        except IndexError:
            raise IndexError(f"index {i} out of range for the {len(self)} {self.split} windows") from None

    def __getitem__(self, i: int) -> Any:
        w = self._window(i)
        snap = self.snapshot()
        sample: Sample = {f: torch.from_numpy(np.array(snap.array(f)[w])) for f in self.fields}
        sample["index"] = w
        return self.transform(sample) if self.transform else sample

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A DataLoader batch in one read per array (windows sorted, so the map is read forwards)."""
        windows = np.fromiter((self._window(i) for i in indices), dtype=np.int64, count=len(indices))
        order = np.argsort(windows, kind="stable")
        snap = self.snapshot()
        gathered = {}
        for f in self.fields:
            block = np.empty((windows.shape[0], *snap.array(f).shape[1:]), dtype=snap.array(f).dtype)
            block[order] = snap.array(f)[windows[order]]
            gathered[f] = torch.from_numpy(block)
        samples = [{**{f: gathered[f][k] for f in self.fields}, "index": int(windows[k])} for k in range(windows.shape[0])]
        return [self.transform(s) for s in samples] if self.transform else samples

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_snap"] = None  # never the maps: each process maps its own files
        return state

    def __repr__(self) -> str:
        return f"<SnapshotDataset {self._state['root']} {self.split}: {len(self)} windows, fields {list(self.fields)}>"


__all__ = ["SnapshotDataset"]
