"""``export --layout windows``: a series snapshot rewritten is the windows build of the same spec."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import aml_pipeline.pipeline.layout_export as layout_export
from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.layout_export import export_windows_layout
from aml_pipeline.snapshot import open_snapshot
from aml_pipeline.tsdb_open import open_tsdb

CLI = [sys.executable, "-m", "aml_pipeline.cli"]


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


CASES = {
    "v1": {},
    "v1_no_controls": {"no_controls": True},
    "v2_stride_3": {"extras": True, "stride": 3},
}


@pytest.fixture(scope="module", params=list(CASES))
def built(request, plant, plant_url, tmp_path_factory):
    """The same spec and data built in both layouts."""
    from aml_pipeline.simulate.plant import plant_spec_dict
    from aml_pipeline.spec import parse_spec

    case = dict(CASES[request.param])
    data = plant_spec_dict(plant, "plant_ds", history_steps=20, horizon_steps=10, extras=case.pop("extras", False),
                           stride=case.pop("stride", 1))
    if case.pop("no_controls", False):
        data["nodes"] = [n for n in data["nodes"] if n["role"] != "control"]
    root = tmp_path_factory.mktemp(request.param)
    out = {}
    with open_tsdb(plant_url) as db:
        for layout in ("windows", "series"):
            spec = parse_spec({**data, "layout": layout})
            out[layout] = build_dataset(spec, db, store_root=root / layout / "store", datasets_root=root / layout / "ds")
    return request.param, out["windows"], out["series"]


def test_the_export_is_the_windows_build(built, tmp_path):
    name, windows, series = built
    summary = export_windows_layout(series.snapshot_dir, tmp_path / "out")
    assert summary["verified"] and summary["layout"] == "windows"
    got, want = files_of(tmp_path / "out"), files_of(windows.snapshot_dir)
    assert set(got) == set(want)
    if windows.manifest["version"] == 1:  # byte-reproducible, hash included
        assert summary["sha256"] == windows.sha256
        for f in want:
            if f != "sha256.json":  # the build's also records what each file was computed from
                assert got[f] == want[f], f
        assert json.loads(got["sha256.json"])["files"] == json.loads(want["sha256.json"])["files"]
    else:  # v2: the arrays byte for byte; the manifest differs only in the capture time
        for f in want:
            if f not in ("manifest.json", "sha256.json"):
                assert got[f] == want[f], f
        m_got, m_want = json.loads(got["manifest.json"]), json.loads(want["manifest.json"])
        assert m_got["provenance"].pop("capturedAt") == series.manifest["provenance"]["capturedAt"]
        m_want["provenance"].pop("capturedAt")
        assert m_got == m_want
    assert verify_snapshot(tmp_path / "out").ok
    assert open_snapshot(tmp_path / "out").layout == "windows"
    # A windows snapshot exports as itself.
    again = export_windows_layout(windows.snapshot_dir, tmp_path / "copy")
    assert again["sha256"] == windows.sha256


def test_the_cli(built, tmp_path):
    _, windows, series = built
    proc = subprocess.run([*CLI, "export", str(series.snapshot_dir), "--layout", "windows", "--out", str(tmp_path / "w")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["outDir"] == str(tmp_path / "w") and summary["layout"] == "windows"
    assert subprocess.run([*CLI, "verify", str(tmp_path / "w")], capture_output=True).returncode == 0

    def fails(*args: str) -> str:
        proc = subprocess.run([*CLI, "export", *args], capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stderr.strip().splitlines()[-1]

    assert fails(str(series.snapshot_dir), "--layout", "windows", "--out", str(tmp_path / "w")).startswith("EXPORT_EXISTS: ")
    assert fails(str(series.snapshot_dir), "--layout", "windows", "--split", "train", "--out", str(tmp_path / "s")).startswith("USAGE: ")
    assert "not allowed with argument" in fails(str(series.snapshot_dir), "--layout", "windows", "--format", "parquet",
                                                "--out", str(tmp_path / "f"))
    assert not (tmp_path / "s").exists() and not (tmp_path / "f").exists()


def test_a_tampered_series_snapshot_is_refused(plant, plant_url, make_spec, tmp_path):
    with open_tsdb(plant_url) as db:
        published = build_dataset(make_spec(layout="series"), db, store_root=tmp_path / "store", datasets_root=tmp_path / "ds")
    path = published.snapshot_dir / "arrays" / "u_rows.f32"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    with open(path, "r+b") as f:  # as root, through the read-only mode
        f.write(bytes(data))
    proc = subprocess.run([*CLI, "export", str(published.snapshot_dir), "--layout", "windows", "--out", str(tmp_path / "w")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("SNAPSHOT_TAMPERED: ") and "arrays/u_rows.f32" in line and not (tmp_path / "w").exists()


def test_nothing_half_written_is_left_when_an_export_fails(built, tmp_path, monkeypatch):
    _, _, series = built
    real, calls = layout_export._blocks, []

    def failing(snap, kind):
        calls.append(kind)
        if kind == "y":
            raise OSError(5, "Input/output error")  # not a full disk (that is DISK_FULL, below): raised as it is
        return real(snap, kind)

    monkeypatch.setattr(layout_export, "_blocks", failing)
    with pytest.raises(OSError, match="Input/output error"):
        export_windows_layout(series.snapshot_dir, tmp_path / "e" / "out")
    assert calls == ["x", "u", "y"] and list((tmp_path / "e").iterdir()) == []


def test_a_full_disk_at_the_digest_is_one_disk_full_line(built, tmp_path, monkeypatch, capsys):
    """The digest (sha256.json) is written after every other file is complete and hashed: the disk
    is filled then, so the digest is the write that meets it."""
    from aml_pipeline.cli import main
    from aml_pipeline.snapshot.layout import DIGEST_FILE
    from aml_pipeline_tests.small_fs import fill, small_filesystem

    _, _, series = built
    seen = []

    class FullAfterFinish(layout_export.StagedFiles):
        def finish(self, **kwargs):
            digest = super().finish(**kwargs)
            self.syncer.wait()  # every other file durable before the disk fills
            assert not (self.dir / DIGEST_FILE).exists()
            fill(root, leave_kb=0)
            seen.append(digest)
            return digest

    monkeypatch.setattr(layout_export, "StagedFiles", FullAfterFinish)
    with small_filesystem(tmp_path / "small", 8 * 1024) as root:
        code = main(["export", str(series.snapshot_dir), "--layout", "windows", "--out", str(root / "w")])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(seen) == 1
        assert code == 2 and err[-1] == f"DISK_FULL: {root / 'w'}: no space left on the device; free space or point it elsewhere"
        assert [p.name for p in root.iterdir()] == [".ballast"]  # no export, no hidden partial directory


def test_export_windows_layout_called_as_a_library_meets_a_full_disk_as_disk_full(built, tmp_path):
    """Not only the CLI: a caller of export_windows_layout gets the product's DISK_FULL error
    naming the output, not the OS's error, and nothing of the export is left."""
    from aml_pipeline.errors import DiskFullError
    from aml_pipeline_tests.small_fs import fill, small_filesystem

    _, _, series = built
    with small_filesystem(tmp_path / "small", 8 * 1024) as root:
        fill(root, leave_kb=0)
        with pytest.raises(DiskFullError) as err:
            layout_export.export_windows_layout(series.snapshot_dir, root / "w")
        assert err.value.one_line() == f"DISK_FULL: {root / 'w'}: no space left on the device; free space or point it elsewhere"
        assert [p.name for p in root.iterdir()] == [".ballast"]


def test_what_a_killed_export_left_is_removed_by_the_next_export_to_the_same_folder(built, tmp_path):
    from aml_pipeline_tests.faults import armed, kill_stopped, wait_stopped

    _, windows, series = built
    out = tmp_path / "w"
    env = armed("export.staged", tmp_path)
    proc = subprocess.Popen([*CLI, "export", str(series.snapshot_dir), "--layout", "windows", "--out", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    kill_stopped(wait_stopped(proc, env), proc)  # every file written beside --out, not yet renamed
    [left] = [p for p in tmp_path.iterdir() if p.name.startswith(".w.partial-")]
    assert not out.exists()
    staged = json.loads((left / "sha256.json").read_text())["sha256"]

    proc = subprocess.run([*CLI, "export", str(series.snapshot_dir), "--layout", "windows", "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not left.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".w.")) == []
    # The same bytes the killed export had staged (v1: the windows build's own hash).
    assert json.loads(proc.stdout.strip().splitlines()[-1])["sha256"] == staged
    assert staged == windows.sha256 or built[0].startswith("v2")
    assert verify_snapshot(out).ok


def test_a_snapshot_opened_without_verifying_is_not_rewritten(built, tmp_path):
    from aml_pipeline.snapshot import SnapshotError

    _, _, series = built
    with pytest.raises(SnapshotError, match="written only from a verified snapshot"):
        export_windows_layout(open_snapshot(series.snapshot_dir, verify=False), tmp_path / "w")
    proc = subprocess.run([*CLI, "export", str(series.snapshot_dir), "--layout", "windows", "--no-verify",
                           "--out", str(tmp_path / "w")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("USAGE: --no-verify: not with --layout")
    assert list(tmp_path.iterdir()) == []
