"""The series layout: the windows layout's windows, bit for bit, cut from rows stored once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pandas as pd
import pytest

from aml_pipeline.snapshot import SnapshotError, hashed_files, open_snapshot
from aml_pipeline.snapshot.batches import window_bytes
from aml_pipeline.snapshot.export import export_parquet
from aml_pipeline.snapshot.layout import SEGMENT_FIELDS, SERIES_ARRAYS
from aml_pipeline.simulate.plant import plant_spec_dict
from aml_pipeline_tests.snapshot.support import publish
from aml_pipeline_tests.snapshot.support import flip_byte, rehash, write_series_snapshot

CLI = [sys.executable, "-m", "aml_pipeline.cli"]


def _no_controls(plant) -> dict:
    base = plant_spec_dict(plant, "snap_ds")
    return {"nodes": [n for n in base["nodes"] if n["role"] != "control"], "extras": False}


# Each case is built twice from the same data and spec, once per layout. The plant's runs have
# long dropouts (gaps the grid does not bridge), so windows are dropped inside runs, and a gap in
# a feature drops only the windows whose history holds it.
CASES = {
    "v2": lambda plant: {},
    "v1": lambda plant: {"extras": False},
    "stride_3": lambda plant: {"stride": 3},
    "stride_over_h_plus_f": lambda plant: {"stride": 35, "extras": False},
    "no_controls": _no_controls,
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, plant, plant_url, tmp_path_factory):
    kw = CASES[request.param](plant)
    root = tmp_path_factory.mktemp(request.param)
    windows = publish(plant, plant_url, root / "windows", **kw)
    series = publish(plant, plant_url, root / "series", layout="series", **kw)
    return request.param, open_snapshot(windows.snapshot_dir), open_snapshot(series.snapshot_dir)


def test_every_window_is_the_windows_layouts_bytes(pair):
    name, w, s = pair
    assert (w.layout, s.layout) == ("windows", "series")
    assert s.array_names == w.array_names and s.counts == w.counts and s.blocks == w.blocks
    assert (s.timestamps is None) == (name in ("v1", "stride_over_h_plus_f", "no_controls"))
    for key in w.array_names:
        a, b = w.array(key), s.array(key)
        assert b.shape == a.shape and b.dtype == a.dtype, key
        assert np.asarray(b).tobytes() == np.asarray(a).tobytes(), key
        # read_windows, in blocks that straddle runs and segments
        for start in range(0, len(w), 97):
            stop = min(len(w), start + 97)
            assert s.read_windows(key, start, stop).tobytes() == w.read_windows(key, start, stop).tobytes(), key
    if name == "no_controls":
        assert s.u.shape[2] == 0 and s.controls == []
    stored = sum((s.root / f).stat().st_size for f, _ in SERIES_ARRAYS.values())
    window_bytes_ = sum(w.array(k).nbytes for k in ("x", "u", "y"))
    assert len(s.index) > len(s.blocks)  # gaps: more segments than runs, windows dropped inside runs
    if name == "stride_over_h_plus_f":  # windows share no row: the same rows, once each, and the index
        assert s.manifest["shapes"]["xRows"][0] == len(s) * s.history_steps
        assert stored == window_bytes_ + len(s.index) * len(SEGMENT_FIELDS) * 8
    else:  # overlapping windows: each row stored once instead of once per window that reads it
        assert stored < window_bytes_ / (5 if s.manifest["series"]["stride"] == 1 else 2)


def test_indexing_is_the_memory_maps(pair):
    _, w, s = pair
    n = len(w)
    rng = np.random.default_rng(0)
    keys = [0, -1, n - 1, np.int64(n // 2), slice(None), slice(3, 40), slice(None, None, 7), slice(None, 10, -3),
            slice(5, 5), rng.integers(0, n, 50), rng.integers(-n, n, (4, 6)), [2, 2, 1], np.array([], dtype=np.int64),
            rng.random(n) < 0.1, (slice(2, 30), -1), (rng.integers(0, n, 9), slice(1, 4)), (7, slice(None), 0),
            (Ellipsis, 0), (slice(None, 20), Ellipsis, -1),
            # index arrays on later axes broadcast with the first, as numpy's do
            ([0, 1], [0, 1]), ([0, 1], slice(None), [0, 1]), ([0, 1], [[0], [1]]), (rng.integers(0, n, 3), 0, [0, 1, 0]),
            (3, [1, 0]), (slice(4, 9), [0, 2]), (np.array([5]), None), [], (0, 10**6)]
    for name in w.array_names:
        a, b = w.array(name), s.array(name)
        for key in keys:
            if isinstance(key, tuple) and a.ndim == 2 and len(key) > 2:
                continue
            try:
                expected = np.asarray(a[key])
            except IndexError:  # e.g. column 0 of u without controls: an error in both layouts
                with pytest.raises(IndexError):
                    b[key]
                continue
            got = b[key]
            assert isinstance(got, np.ndarray) and got.dtype == expected.dtype, (name, key)
            assert got.shape == expected.shape and np.array_equal(got, expected), (name, key)
        for bad in (n, -n - 1, [0, n], np.array([], dtype=np.float64), 1.5, "0"):
            with pytest.raises(IndexError):
                b[bad]
        with pytest.raises(IndexError):
            b[np.ones(n + 1, dtype=bool)]
        assert len(b) == n and b.ndim == a.ndim and b.nbytes == a.nbytes


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_come_in_the_same_order_with_the_same_values(pair, shuffle):
    _, w, s = pair
    fields = w.array_names
    for split in ("train", "val", "all"):
        kw = dict(batch_size=64, shuffle=shuffle, seed=3, epoch=1, fields=fields, buffer_bytes=1 << 20)
        for a, b in zip(w.iter_batches(split, **kw), s.iter_batches(split, **kw), strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert a[key].tobytes() == b[key].tobytes(), key


def test_the_parquet_export_is_the_same(pair, tmp_path):
    name, w, s = pair
    if w.timestamps is None:
        for snap in (w, s):
            with pytest.raises(SnapshotError, match="no window timestamps"):
                export_parquet(snap, tmp_path / snap.layout)
        return
    export_parquet(w, tmp_path / "w")
    export_parquet(s, tmp_path / "s")
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "w"), pd.read_parquet(tmp_path / "s"))
    doc_w, doc_s = (json.loads((tmp_path / d / "_export.json").read_text()) for d in ("w", "s"))
    assert doc_w["files"] == doc_s["files"]


def test_a_series_snapshot_hashes_its_own_files(series_v2, series_v1):
    for published in (series_v1, series_v2):
        root = published.snapshot_dir
        names = hashed_files(published.manifest)
        extra = ["arrays/sidecar.json"] if published.manifest["version"] == 2 else []
        assert names == ["manifest.json", *(f for f, _ in SERIES_ARRAYS.values()), *extra]
        assert sorted(p.name for p in (root / "arrays").iterdir()) == sorted(os.path.basename(n) for n in names[1:])
        assert json.loads((root / "spec.json").read_text())["layout"] == "series"
        cli = subprocess.run([*CLI, "verify", str(root)], capture_output=True, text=True)
        assert cli.returncode == 0 and cli.stdout.split()[1] == published.sha256


@pytest.mark.parametrize("name", ["spec.json", "manifest.json", *(f for f, _ in SERIES_ARRAYS.values()), "arrays/sidecar.json"])
def test_a_changed_byte_in_any_series_file_is_refused_naming_it(fresh_series_v2, name):
    root = fresh_series_v2.snapshot_dir
    flip_byte(root / name)
    with pytest.raises(SnapshotError) as err:
        open_snapshot(root)
    assert err.value.code == "SNAPSHOT_TAMPERED" and err.value.changed == [name]
    cli = subprocess.run([*CLI, "verify", str(root)], capture_output=True, text=True)
    assert cli.returncode == 1 and name in cli.stderr


def _rewrite_segments(root, change) -> None:
    """Apply ``change(segments [6, K])`` to the index and re-hash: a snapshot that verifies."""
    path = root / SERIES_ARRAYS["segments"][0]
    m = json.loads((root / "manifest.json").read_text())
    seg = np.fromfile(path, dtype="<i8").reshape(m["shapes"]["segments"])
    change(seg)
    os.chmod(root / "arrays", 0o755)
    os.chmod(path, 0o644)
    seg.astype("<i8").tofile(path)
    os.chmod(root, 0o755)
    rehash(root)


@pytest.mark.parametrize("field,change,message", [
    ("xRow", lambda v: v + 10**9, "history rows lie outside x_rows"),
    ("futureRow", lambda v: v - 10**9, "future rows lie outside"),
    ("window", lambda v: v + 1, "does not start at window 0"),
    ("run", lambda v: v[::-1].copy(), "not in run order"),
    ("start", lambda v: v * 0, "starts before row historySteps"),
    ("startMs", lambda v: v + np.arange(v.size), "one grid of beatMs"),
])
def test_an_index_that_does_not_describe_the_windows_is_invalid(fresh_series_v2, field, change, message):
    root = fresh_series_v2.snapshot_dir
    i = SEGMENT_FIELDS.index(field)

    def edit(seg):
        seg[i] = change(seg[i])

    _rewrite_segments(root, edit)
    with pytest.raises(SnapshotError, match=message) as err:
        open_snapshot(root, use_catalog=False)
    assert err.value.code == "SNAPSHOT_INVALID"


def test_reading_is_bounded_by_a_batch_not_by_the_windows(tmp_path):
    """tracemalloc sees numpy's allocations: iterating every window of a series snapshot whose
    windows, cut, would be hundreds of times the buffer, in order and shuffled, allocates about
    the buffer and a few batches."""
    snap = open_snapshot(write_series_snapshot(tmp_path / "s", runs=(60_000, 30_000, 30_000), H=60, F=10,
                                               nodes=tuple(f"N{i}" for i in range(12)), controls=("N0",), targets=("N1",)))
    per_window = window_bytes(snap, ("x", "u", "y"))
    assert len(snap) * per_window > 300 << 20
    for shuffle in (False, True):
        tracemalloc.start()
        try:
            seen = sum(len(b["index"]) for b in snap.iter_batches("all", 64, shuffle=shuffle, buffer_bytes=1 << 20))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert seen == len(snap)
        assert peak < (1 << 20) + 4 * 64 * per_window + (512 << 10), (shuffle, peak)
    # The cut windows are the stored rows: window i of a run of one segment starts at its row i.
    rows = np.fromfile(snap.root / "arrays/x_rows.f32", dtype="<f4").reshape(-1, 12)
    np.testing.assert_array_equal(snap.x[60_000 + 5], rows[60_000 + 59 + 5 : 60_000 + 59 + 5 + 60])
