"""The PyTorch Dataset: the numpy values, through DataLoader workers that map their own files."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from aml_pipeline.snapshot import SnapshotError, open_snapshot
from aml_pipeline.snapshot.torch import SnapshotDataset


@pytest.mark.parametrize("context,which", [("fork", "v2"), ("spawn", "v2"), ("spawn", "series_v2")])
def test_dataloader_workers_serve_the_numpy_values(context, which, request):
    published = request.getfixturevalue(which)
    snap = open_snapshot(published.snapshot_dir)
    ds = SnapshotDataset(published.snapshot_dir, split="train", fields=("x", "u", "y", "timestamps"))
    loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, multiprocessing_context=context,
                        generator=torch.Generator().manual_seed(0))
    seen = []
    for batch in loader:
        idx = batch["index"].numpy()
        for key in ("x", "u", "y", "timestamps"):
            assert batch[key].dtype == (torch.float64 if key == "timestamps" else torch.float32)
            np.testing.assert_array_equal(batch[key].numpy(), snap.array(key)[idx])
        seen.append(idx)
    train = snap.split_range("train")
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(train.start, train.stop))


@pytest.mark.parametrize("which", ["v2", "series_v2"])
def test_items_match_the_snapshot_and_a_pickled_dataset_carries_no_arrays(which, request):
    snap = open_snapshot(request.getfixturevalue(which).snapshot_dir)
    ds = SnapshotDataset(snap, split="val")
    val = snap.split_range("val")
    assert len(ds) == len(val) > 0
    first, last = ds[0], ds[-1]
    assert first["index"] == val.start and last["index"] == val.stop - 1
    np.testing.assert_array_equal(first["x"].numpy(), snap.x[val.start])
    np.testing.assert_array_equal(last["y"].numpy(), snap.y[val.stop - 1])
    many = ds.__getitems__([3, 0, 3, len(ds) - 1])
    assert [s["index"] for s in many] == [val.start + 3, val.start, val.start + 3, val.stop - 1]
    for s in many:
        np.testing.assert_array_equal(s["u"].numpy(), snap.u[s["index"]])
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]
    assert ds[torch.tensor(2)]["index"] == ds[np.int64(2)]["index"] == val.start + 2
    for bad in (1.5, np.float64(2.9), torch.tensor(2.5), True, "5", None):  # never rounded to a window
        with pytest.raises(TypeError, match="SnapshotDataset index must be an integer"):
            ds[bad]
    with pytest.raises(TypeError, match="SnapshotDataset index must be an integer"):
        ds.__getitems__([0, 1.7])
    assert SnapshotDataset(snap, split="val", fields="y")[0].keys() == {"y", "index"}
    with pytest.raises(ValueError, match="fields must name at least one array"):
        SnapshotDataset(snap, split="val", fields=())
    data = pickle.dumps(ds)
    assert len(data) < 4096 < snap.x.nbytes
    if snap.layout == "series":  # the same items as the windows layout's dataset of the same data
        windows = SnapshotDataset(request.getfixturevalue("v2").snapshot_dir, split="val", fields=ds.fields + ("timestamps",))
        for i in (0, 7, len(ds) - 1):
            for key in ("x", "u", "y"):
                assert torch.equal(ds[i][key], windows[i][key])
    copy = pickle.loads(data)
    assert copy._snap is None  # maps are opened by whoever uses it
    np.testing.assert_array_equal(copy[5]["x"].numpy(), ds[5]["x"].numpy())
    assert copy.snapshot() is not ds.snapshot()


def test_a_worker_refuses_files_that_are_not_the_ones_verified(fresh_v2):
    root = fresh_v2.snapshot_dir
    ds = SnapshotDataset(root, split="train")  # verified here, in the parent
    os.chmod(root / "arrays", 0o755)
    x = root / "arrays" / "x.f32"
    replacement = root / "arrays" / "x.new"
    replacement.write_bytes(x.read_bytes())  # same bytes, another file: not what was verified
    os.replace(replacement, x)
    with pytest.raises(SnapshotError, match=r"arrays/x\.f32 is not the file that was verified"):
        pickle.loads(pickle.dumps(ds))[0]
    loader = DataLoader(ds, batch_size=8, num_workers=1)
    with pytest.raises(Exception, match="is not the file that was verified"):
        next(iter(loader))


def test_a_tampered_snapshot_is_refused_before_any_training(fresh_v2):
    with open(fresh_v2.snapshot_dir / "arrays" / "y.f32", "r+b") as f:
        f.write(b"\xff\xff")
    with pytest.raises(SnapshotError, match=r"hash mismatch.*arrays/y\.f32"):
        SnapshotDataset(fresh_v2.snapshot_dir)


def test_importing_the_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, aml_pipeline.snapshot; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
