"""The Parquet export: each run's model-unit grid rebuilt from the snapshot alone."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import aml_pipeline.snapshot.export as export_mod
from aml_pipeline.snapshot import SnapshotError, open_snapshot
from aml_pipeline.snapshot.export import cover, export_parquet
from aml_pipeline_tests.snapshot.support import publish
from aml_pipeline_tests.snapshot.support import flip_byte

CLI = [sys.executable, "-m", "aml_pipeline.cli"]


@pytest.fixture(scope="module")
def sparse(plant, plant_url, tmp_path_factory):
    """Stride 35 > H + F = 30: grid rows between consecutive windows belong to no window."""
    return publish(plant, plant_url, tmp_path_factory.mktemp("sparse"), stride=35)


def check_against_every_window(snap, df: pd.DataFrame) -> None:
    """Brute force over every window of every run: the export has exactly the rows the windows
    cover; history values of all nodes equal the stored ones exactly (each grid row is stored
    once normalised, so every window holding it holds the same float32); future values of
    controls and targets equal them to float32 precision; NaN exactly where no window holds a value."""
    H, nodes = snap.history_steps, snap.nodes
    assert list(df.columns) == ["run_id", "timestamp", "time_idx", *nodes, "split"]
    assert len(df.groupby("run_id", observed=True)) == len(snap.blocks)
    for block in snap.blocks:
        run = df[df.run_id == block.run_id]
        assert (run.split == block.split).all()
        ts = run.timestamp.dt.tz_convert(None).to_numpy().astype("datetime64[ms]").astype(np.int64)
        assert np.all(np.diff(ts) > 0)
        assert np.array_equal(run.time_idx.to_numpy(), (ts - ts[0]) // snap.beat_ms)
        values = run[nodes].to_numpy()
        w = slice(block.start, block.stop)
        ts_hist = np.asarray(snap.timestamps[w, :H], dtype=np.int64).ravel()
        ts_fut = np.asarray(snap.timestamps[w, H:], dtype=np.int64).ravel()
        assert np.array_equal(ts, np.union1d(ts_hist, ts_fut))
        hist = snap.to_model_units("x", snap.x[w]).reshape(-1, len(nodes))
        np.testing.assert_array_equal(values[np.searchsorted(ts, ts_hist)], hist)
        for group, cols in (("u", snap.controls), ("y", snap.targets)):
            if not cols:
                continue
            fut = snap.to_model_units(group, snap.array(group)[w]).reshape(-1, len(cols))
            idx = [nodes.index(c) for c in cols]
            got = values[np.searchsorted(ts, ts_fut)][:, idx]
            np.testing.assert_allclose(got, fut, rtol=0, atol=float(snap.norm[group].std.max()) * 1e-6)
        only_future = ~np.isin(ts, ts_hist)
        for j, node in enumerate(nodes):
            expect_nan = only_future & (node not in snap.controls) & (node not in snap.targets)
            assert np.array_equal(np.isnan(values[:, j]), expect_nan), node


@pytest.mark.parametrize("which", ["v2", "sparse", "series_v2"])
def test_the_grid_is_what_the_windows_hold(which, request, tmp_path):
    published = request.getfixturevalue(which)
    snap = open_snapshot(published.snapshot_dir)
    out = tmp_path / "export"
    summary = export_parquet(snap, out)
    df = pd.read_parquet(out)
    check_against_every_window(snap, df)
    assert len(df) == summary["rows"] and summary["sha256"] == published.sha256 and summary["verified"]
    assert str(df.timestamp.dtype) == "datetime64[ms, UTC]"
    assert df.loc[:, snap.nodes].dtypes.eq(np.float64).all()
    features = [n for n in snap.nodes if n not in snap.controls + snap.targets]
    assert df[features].isna().any().all()  # each run's last F rows, at least
    if which == "sparse":  # gaps: rows of no window are absent, not NaN rows
        gaps = df.groupby("run_id", observed=True).time_idx.diff().dropna()
        assert (gaps > 1).any()
    doc = json.loads((out / "_export.json").read_text())
    assert [f["runId"] for f in doc["files"]] == [b.run_id for b in snap.blocks]
    assert sorted(p.name for p in out.iterdir()) == ["_export.json", *(f["file"] for f in doc["files"])]


def test_units_travel_in_the_parquet_schema(v2, tmp_path):
    snap = open_snapshot(v2.snapshot_dir)
    export_parquet(snap, tmp_path / "e")
    schema = pq.read_schema(tmp_path / "e" / "part-00000.parquet")
    for node in snap.nodes:
        meta = {k.decode(): v.decode() for k, v in schema.field(node).metadata.items()}
        v = snap.variables[node]
        assert meta["unit"] == v.model_unit and meta["engineeringUnit"] == v.unit and float(meta["offset"]) == v.offset
    assert "K" in {snap.variables[n].model_unit for n in snap.nodes}
    about = json.loads(schema.metadata[b"aml_pipeline.snapshot"])
    assert about["sha256"] == v2.sha256 and about["beatMs"] == snap.beat_ms


def test_the_pandas_example_in_the_docs(v2, tmp_path):
    out = tmp_path / "export"
    export_parquet(v2.snapshot_dir, out)
    df = pd.read_parquet(out)
    train = pd.read_parquet(out, filters=[("split", "==", "train")])
    assert set(train.split) == {"train"} and len(train) < len(df)
    assert set(train.run_id) == set(v2.manifest["split"]["trainRunIds"])
    # The form PyTorch Forecasting takes: after dropna, an integer time_idx per run, no NaN.
    pf = df.dropna()
    assert not pf.isna().any().any() and pf.groupby("run_id", observed=True).time_idx.is_monotonic_increasing.all()
    # The form Darts and GluonTS take: a regular index per run at the beat.
    run = df[df.run_id == df.run_id.iloc[0]].set_index("timestamp").asfreq(f"{v2.manifest['beatMs']}ms")
    assert run.index.freq is not None and len(run) >= (df.run_id == df.run_id.iloc[0]).sum()


def test_splits_can_be_chosen(v2, tmp_path):
    summary = export_parquet(v2.snapshot_dir, tmp_path / "e", splits=["val", "test"])
    df = pd.read_parquet(tmp_path / "e")
    assert set(df.split) == {"val", "test"} and summary["splits"] == ["val", "test"]


def test_an_export_into_the_snapshot_itself_is_refused(v2):
    inside = v2.snapshot_dir / "out"
    with pytest.raises(ValueError, match=f"is inside the snapshot {v2.snapshot_dir.resolve()}"):
        export_parquet(v2.snapshot_dir, inside)
    assert not inside.exists() and not list(v2.snapshot_dir.glob(".out.partial-*"))


def test_a_v1_snapshot_has_no_timestamps_to_place_rows(v1, tmp_path):
    with pytest.raises(SnapshotError, match="v1 snapshot has no window timestamps") as err:
        export_parquet(v1.snapshot_dir, tmp_path / "e")
    assert err.value.code == "SNAPSHOT_NO_TIMESTAMPS" and not (tmp_path / "e").exists()


def test_nothing_half_written_is_left_when_an_export_fails(v2, tmp_path, monkeypatch):
    real, calls = export_mod.run_grid, []

    def failing(snap, block):
        calls.append(block.run_id)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")  # not a full disk (that is DISK_FULL, below): raised as it is
        return real(snap, block)

    monkeypatch.setattr(export_mod, "run_grid", failing)
    with pytest.raises(OSError, match="Input/output error"):
        export_parquet(v2.snapshot_dir, tmp_path / "e")
    assert list(tmp_path.iterdir()) == []  # neither the directory nor its hidden partial twin


def test_an_existing_directory_is_not_overwritten(v2, tmp_path):
    (tmp_path / "e").mkdir()
    export_parquet(v2.snapshot_dir, tmp_path / "e")  # an empty directory is fine
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_parquet(v2.snapshot_dir, tmp_path / "e")


def test_cli_export(v2, v1, fresh_v2, tmp_path):
    ok = subprocess.run([*CLI, "export", str(v2.snapshot_dir), "--format", "parquet", "--out", str(tmp_path / "e")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert summary["sha256"] == v2.sha256 and summary["verified"] and summary["files"] == len(v2.manifest["split"]["blocks"])
    assert len(pd.read_parquet(tmp_path / "e")) == summary["rows"]

    def fails(*args: str) -> str:
        proc = subprocess.run([*CLI, "export", *args], capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        [line] = [ln for ln in proc.stderr.splitlines() if ":" in ln and not ln.startswith("export")]
        return line

    assert fails(str(v2.snapshot_dir), "--out", str(tmp_path / "e")).startswith("EXPORT_EXISTS: ")
    assert fails(str(v1.snapshot_dir), "--out", str(tmp_path / "v1")).startswith("SNAPSHOT_NO_TIMESTAMPS: ")
    flip_byte(fresh_v2.snapshot_dir / "arrays" / "x.f32")
    line = fails(str(fresh_v2.snapshot_dir), "--out", str(tmp_path / "t"))
    assert line.startswith("SNAPSHOT_TAMPERED: ") and "arrays/x.f32" in line
    assert not (tmp_path / "v1").exists() and not (tmp_path / "t").exists()


def test_cover_is_minimal_and_loses_nothing():
    rng = np.random.default_rng(0)
    for _ in range(200):
        starts = np.sort(rng.choice(300, size=rng.integers(1, 60), replace=False))
        length = int(rng.integers(1, 40))
        picks = cover(starts, length)
        rows = np.unique((starts[:, None] + np.arange(length)).ravel())
        covered = np.unique((starts[picks][:, None] + np.arange(length)).ravel())
        assert np.array_equal(rows, covered)
        # Minimal: no pick can be dropped.
        for k in range(picks.size):
            rest = np.delete(picks, k)
            assert np.unique((starts[rest][:, None] + np.arange(length)).ravel()).size < rows.size
    assert cover(np.arange(1000), 60).size == 18  # stride 1: 1059 rows, ceil(1059 / 60) windows read


@pytest.mark.parametrize("layout", ["windows", "series"])
def test_a_dataset_without_controls(plant, plant_url, tmp_path, layout):
    from aml_pipeline.simulate.plant import plant_spec_dict

    base = plant_spec_dict(plant, "snap_ds", extras=True)
    controls = {n["nodeId"] for n in base["nodes"] if n["role"] == "control"}
    extras = {**base["extras"], "variables": [v for v in base["extras"]["variables"] if v["nodeId"] not in controls]}
    published = publish(plant, plant_url, tmp_path / "b", nodes=[n for n in base["nodes"] if n["nodeId"] not in controls],
                        extras=extras, layout=layout)
    snap = open_snapshot(published.snapshot_dir)
    assert snap.controls == [] and snap.u.shape[2] == 0
    export_parquet(snap, tmp_path / "e")
    check_against_every_window(snap, pd.read_parquet(tmp_path / "e"))



def test_cli_export_where_it_cannot_write(v2, tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = subprocess.run([*CLI, "export", str(v2.snapshot_dir), "--out", str(tmp_path / "a_file" / "sub" / "e")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    # The line names --out and the file in the way of the folder it goes in.
    assert last.startswith("EXPORT_FAILED: --out ") and f"{tmp_path / 'a_file'} is a file, not a directory" in last


def test_a_full_disk_at_the_export_summary_is_one_disk_full_line(v2, tmp_path, monkeypatch, capsys):
    """``_export.json`` is written after every Parquet file: the disk is filled once the last
    one is written (the progress report), so the summary is the write that meets it."""
    from aml_pipeline.cli import main
    from aml_pipeline_tests.small_fs import fill, small_filesystem

    real, seen = export_mod.export_parquet, []

    def full_after_the_last_part(snap, out, *, splits, progress):
        def report(done: int, total: int) -> None:
            progress(done, total)
            if done == total:
                assert not any(p.name == export_mod.EXPORT_FILE for p in root.rglob("*"))
                fill(root, leave_kb=0)
                seen.append(done)

        return real(snap, out, splits=splits, progress=report)

    monkeypatch.setattr(export_mod, "export_parquet", full_after_the_last_part)
    with small_filesystem(tmp_path / "small", 8 * 1024) as root:
        code = main(["export", str(v2.snapshot_dir), "--out", str(root / "e")])
        err = capsys.readouterr().err.strip().splitlines()
        assert seen == [len(v2.manifest["split"]["blocks"])]  # the disk filled after the last part file
        assert code == 2 and err[-1] == f"DISK_FULL: {root / 'e'}: no space left on the device; free space or point it elsewhere"
        assert [p.name for p in root.iterdir()] == [".ballast"]  # no export, no hidden partial directory


def test_export_parquet_called_as_a_library_meets_a_full_disk_as_disk_full(v2, tmp_path):
    """Not only the CLI: a caller of export_parquet gets the product's DISK_FULL error naming the
    output, not the OS's error, and nothing of the export is left."""
    from aml_pipeline.errors import DiskFullError
    from aml_pipeline_tests.small_fs import fill, small_filesystem

    with small_filesystem(tmp_path / "small", 8 * 1024) as root:
        fill(root, leave_kb=0)
        with pytest.raises(DiskFullError) as err:
            export_mod.export_parquet(v2.snapshot_dir, root / "e")
        assert err.value.one_line() == f"DISK_FULL: {root / 'e'}: no space left on the device; free space or point it elsewhere"
        assert [p.name for p in root.iterdir()] == [".ballast"]


def test_an_export_removes_what_a_dead_export_left_and_keeps_a_running_one(v2, tmp_path):
    import os
    import socket

    from aml_pipeline.snapshot.export import staging_beside

    out = tmp_path / "e"
    host = socket.gethostname().replace("-", "_")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f".e.partial-{host}-{int(dead.stdout)}-0123abcd"
    running = tmp_path / f".e.partial-{host}-{os.getpid()}-4567ef01"
    other_host = tmp_path / f".e.partial-elsewhere-{int(dead.stdout)}-89abcdef"
    for d in (gone, running, other_host):
        (d / "arrays").mkdir(parents=True)
        (d / "arrays" / "part-00000.parquet").write_bytes(b"x")
    assert staging_beside(out).name.startswith(f".e.partial-{host}-{os.getpid()}-")
    assert not gone.exists() and running.exists() and other_host.exists()
    export_parquet(v2.snapshot_dir, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, other_host.name, "e"])


def test_cli_export_refuses_an_out_it_cannot_become(v2, tmp_path):
    def fails(*args: str, cwd=None) -> str:
        proc = subprocess.run([*CLI, "export", str(v2.snapshot_dir), *args], capture_output=True, text=True, cwd=cwd)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stderr.strip().splitlines()[-1]

    assert fails("--out", "").startswith("USAGE: --out: an empty path")
    (tmp_path / "here").mkdir()
    assert fails("--out", ".", cwd=tmp_path / "here").startswith("EXPORT_FAILED: --out .: the current directory")
    inside = v2.snapshot_dir / "arrays" / "sub"
    assert fails("--out", str(inside)).startswith(f"EXPORT_FAILED: --out {inside}: inside the snapshot {v2.snapshot_dir}")
    assert not inside.exists() and list((tmp_path / "here").iterdir()) == []


def test_a_split_named_twice_is_exported_once(v2, tmp_path):
    proc = subprocess.run([*CLI, "export", str(v2.snapshot_dir), "--split", "train", "--split", "train",
                           "--out", str(tmp_path / "e")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["splits"] == ["train"]
    assert summary["files"] == sum(1 for b in v2.manifest["split"]["blocks"] if b["split"] == "train")
