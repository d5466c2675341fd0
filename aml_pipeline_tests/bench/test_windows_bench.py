"""The windows benchmark times the snapshot writer's own path: its output is the snapshot's."""

from __future__ import annotations

from pathlib import Path

from bench import build_bench, windows_bench
from bench.workload import make_workload


def test_timed_path_reproduces_the_snapshot_and_the_loop_reference(tmp_path):
    w = make_workload(tmp_path / "w", runs=3, minutes=10.0)
    built = build_bench.e2e_build(w.spec, w.tsdb_url, tmp_path / "e2e")
    out = windows_bench.run(tmp_path / "e2e" / "store", Path(built["snapshot_dir"]), w.spec, quick=True, repeat=2,
                            pf_runs=2)
    assert out["snapshot"]["equal"] is True and out["snapshot"]["by_array"] == {"x": True, "u": True, "y": True}
    assert out["reference"]["equal"] is True and out["reference"]["runs"] == 3
    assert out["reference"]["windows"] == sum(built["summary"]["windows"].values())
    assert out["timings"]["ours"]["seconds"]["repeat"] == 2


def test_a_changed_snapshot_byte_is_noticed(tmp_path):
    w = make_workload(tmp_path / "w", runs=2, minutes=10.0)
    built = build_bench.e2e_build(w.spec, w.tsdb_url, tmp_path / "e2e")
    snap = Path(built["snapshot_dir"])
    y = snap / "arrays" / "y.f32"
    y.chmod(0o644)
    data = bytearray(y.read_bytes())
    data[-1] ^= 0x01
    y.write_bytes(bytes(data))
    spec, norm, runs = windows_bench._load(tmp_path / "e2e" / "store", w.spec)
    check = windows_bench._check_snapshot(runs, spec, norm, snap)
    assert check["equal"] is False and check["by_array"] == {"x": True, "u": True, "y": False}
