"""A full disk is an ordinary error: one line, nothing partial, the previous snapshot intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline.runner.build import materialize_dataset
from aml_pipeline.errors import DiskFullError
from aml_pipeline.faults import TRACE_ENV
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.publish import Catalog, current_snapshot
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.faults import traced
from aml_pipeline_tests.small_fs import fill, small_filesystem
from aml_pipeline_tests.thin_fs import thin_ext4

# Room left under the instance: its first runs are recorded, a later one fills the disk.
INSTANCE_ROOM_KB = 600


def _visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _assert_publish_failed_and_kept(error: DiskFullError, root, spec_id: str, before: list[str], first) -> None:
    """One DISK_FULL line naming the spec's folder; no staging left, the previous snapshot current,
    intact and alone in the catalog."""
    line = error.one_line()
    assert line.startswith(f"DISK_FULL: {root / spec_id}: no space left on the device") and "\n" not in line
    assert _visible(root / spec_id) == before  # no staging directory left behind
    assert current_snapshot(root, spec_id) == first.snapshot_dir and verify_snapshot(first.snapshot_dir).ok
    assert [e.sha256 for e in Catalog(root).entries(spec_id)] == [first.sha256]


@pytest.fixture
def layout() -> str:
    return "windows"


@pytest.fixture
def snapshot_kb(make_spec, plant_url, tmp_path, layout) -> int:
    with open_tsdb(plant_url) as db:
        p = build_dataset(make_spec(extras=True, layout=layout), db, store_root=tmp_path / "probe-store",
                          datasets_root=tmp_path / "probe")
    return sum(f.stat().st_size for f in p.snapshot_dir.rglob("*") if f.is_file()) // 1024


@pytest.mark.parametrize("layout", ["windows", "series"])
def test_a_full_snapshot_root_fails_in_one_line_and_keeps_the_previous_snapshot(make_spec, plant_url, tmp_path, snapshot_kb,
                                                                                  layout):
    spec = make_spec(extras=True, layout=layout)
    with small_filesystem(tmp_path / "small", int(snapshot_kb * 1.6)) as root:
        with open_tsdb(plant_url) as db:
            first = build_dataset(spec, db, store_root=tmp_path / "store", datasets_root=root)
            before = _visible(root / spec.id)
            # A split edit rewrites every array: there is room for one snapshot, not two.
            edited = make_spec(extras=True, layout=layout,
                               split={"method": "hashed", "train": 0.6, "val": 0.2, "test": 0.2, "seed": 1})
            with pytest.raises(DiskFullError) as err:
                build_dataset(edited, db, store_root=tmp_path / "store", datasets_root=root)
        line = err.value.one_line()
        assert line.startswith("DISK_FULL: ") and str(root / spec.id) in line and "MB" in line and "\n" not in line
        assert _visible(root / spec.id) == before  # no staging directory left behind
        assert current_snapshot(root, spec.id) == first.snapshot_dir and verify_snapshot(first.snapshot_dir).ok
        assert [e.sha256 for e in Catalog(root).entries(spec.id)] == [first.sha256]


def test_a_full_disk_in_the_cli_and_in_dagster(make_spec, plant, plant_url, tmp_path, snapshot_kb):
    spec = make_spec(extras=True)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_json_dict()))
    with small_filesystem(tmp_path / "small", max(64, snapshot_kb // 3)) as root:
        cli = subprocess.run(
            [sys.executable, "-m", "aml_pipeline.cli", "build", str(spec_file), "--tsdb", plant_url,
             "--out", str(root), "--home", str(tmp_path / "home"), "--ephemeral"],
            capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"},
        )
        assert cli.returncode == 2
        assert cli.stderr.strip().startswith("DISK_FULL: ") and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
        assert "Traceback" not in cli.stderr and str(root) in cli.stderr
        assert not [n for n in _visible(root / spec.id) if not n.startswith(".lock")]

        # In Dagster the step fails with that line as its failure description.
        with dg.DagsterInstance.ephemeral() as instance:
            with pytest.raises(DiskFullError):
                materialize_dataset(spec, tsdb_url=plant_url, home=tmp_path / "home", datasets_dir=root, instance=instance)
            failures = [
                r.event_log_entry.dagster_event.step_failure_data
                for run in instance.get_runs()
                for r in instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records
            ]
            assert failures and failures[-1].user_failure_data.description.startswith("DISK_FULL: ")
            assert "\n" not in failures[-1].user_failure_data.description


def test_a_full_artifact_store_fails_in_one_line(make_spec, plant_url, tmp_path):
    spec = make_spec()
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_json_dict()))
    with small_filesystem(tmp_path / "home", 256) as home:
        cli = subprocess.run(
            [sys.executable, "-m", "aml_pipeline.cli", "build", str(spec_file), "--tsdb", plant_url,
             "--out", str(tmp_path / "datasets"), "--home", str(home), "--ephemeral"],
            capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"},
        )
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.strip().startswith("DISK_FULL: ") and str(home) in cli.stderr
    assert "Traceback" not in cli.stderr and len(cli.stderr.strip().splitlines()) == 1


def test_a_full_disk_under_the_instance_fails_in_one_line_and_loses_nothing(make_spec, plant, plant_url, tmp_path):
    """``DAGSTER_HOME`` (an SQLite instance) on a disk that fills mid-build: one line naming the
    instance; once there is room, the same build redoes only the runs the instance has not recorded."""
    spec = make_spec()
    windows = dg.AssetKey([spec.id, "run_windows"])
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_json_dict()))
    with dg.DagsterInstance.ephemeral() as reference:
        expected = materialize_dataset(spec, tsdb_url=plant_url, home=tmp_path / "reference", instance=reference,
                                       console_log_level="CRITICAL")["sha256"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "AML_"))}
    build = [sys.executable, "-m", "aml_pipeline.cli", "build", str(spec_file), "--tsdb", plant_url,
             "--home", str(tmp_path / "aml"), "--json"]
    with small_filesystem(tmp_path / "dagster_home", 4096) as home:
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        with dg.DagsterInstance.from_config(str(home)) as instance:
            instance.get_runs(limit=1)  # the storages exist before the disk fills
        ballast = fill(home, leave_kb=INSTANCE_ROOM_KB)
        env.update(DAGSTER_HOME=str(home), AML_BACKFILL_RUNS_PER_CHUNK="1")
        full = subprocess.run(build, capture_output=True, text=True, env=env)
        assert full.returncode == 2, full.stderr
        last = full.stderr.strip().splitlines()[-1]
        assert last.startswith(f"INSTANCE_UNAVAILABLE: the Dagster instance in {home} failed: "), full.stderr
        assert "Traceback" not in full.stderr, full.stderr
        ballast.unlink()  # (opening SQLite storage writes too)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            before = instance.get_materialized_partitions(windows)
        again = subprocess.run(build, capture_output=True, text=True, env=env)
        assert again.returncode == 0, again.stderr
        summary = json.loads(again.stdout.strip().splitlines()[-1])
        assert summary["sha256"] == expected
        finished = [r.run_id for r in plant.runs if r.ended_at is not None]
        assert 0 < len(before) < len(finished), before  # the disk filled mid-build
        assert summary["materialized"]["run_windows"] == len(finished) - len(before), (summary, before)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            assert sorted(instance.get_materialized_partitions(windows)) == sorted(finished)


def test_a_disk_that_fills_at_fsync_fails_in_one_line_and_keeps_the_previous_snapshot(
    make_spec, plant_url, tmp_path, monkeypatch
):
    """ext4 on a thin loop device (``thin_fs.py``): every write of the new snapshot is accepted,
    and the disk reports ENOSPC when the files are made durable. The trace of crash points proves
    it: the staging directory was completely written, never fsynced."""
    spec = make_spec(extras=True)
    with thin_ext4(64) as fs, open_tsdb(plant_url) as db:
        root = fs.root / "datasets"
        first = build_dataset(spec, db, store_root=tmp_path / "store", datasets_root=root)
        before = _visible(root / spec.id)
        edited = make_spec(extras=True, split={"method": "hashed", "train": 0.6, "val": 0.2, "test": 0.2, "seed": 1})
        env, trace = traced(tmp_path, "publish")
        monkeypatch.setenv(TRACE_ENV, env[TRACE_ENV])
        fs.exhaust()
        with pytest.raises(DiskFullError) as err:
            build_dataset(edited, db, store_root=tmp_path / "store", datasets_root=root)
        monkeypatch.delenv(TRACE_ENV)
        reached = {line.split()[0] for line in trace.read_text().splitlines()}
        assert "publish.staging_written" in reached and "publish.fsynced" not in reached, reached
        _assert_publish_failed_and_kept(err.value, root, spec.id, before, first)
        fs.relieve()
        again = build_dataset(edited, db, store_root=tmp_path / "store", datasets_root=root)
        assert current_snapshot(root, spec.id) == again.snapshot_dir and verify_snapshot(again.snapshot_dir).ok
        assert verify_snapshot(first.snapshot_dir, first.sha256).ok


def test_a_small_file_that_meets_a_full_disk_is_disk_full_and_leaves_nothing(tmp_path):
    """A stage's summary is smaller than a file buffer: the disk fills when the buffer is flushed
    as the file closes, not at the write call, and that is DISK_FULL too, with no temporary left."""
    from aml_pipeline.pipeline.store import atomic_write_bytes

    with small_filesystem(tmp_path / "small", 256) as root:
        (root / "runs").mkdir()
        fill(root, leave_kb=0)
        target = root / "runs" / "raw.json"
        with pytest.raises(DiskFullError) as err:
            atomic_write_bytes(target, b"{}" * 2048)
        assert err.value.one_line().startswith("DISK_FULL: ") and str(target) in err.value.one_line()
        assert _visible(root / "runs") == []


def test_a_full_disk_at_the_digest_file_is_disk_full_and_keeps_the_previous_snapshot(make_spec, plant_url, tmp_path,
                                                                                       monkeypatch):
    """The digest (sha256.json) is the one file written after the snapshot's files are complete:
    the disk is filled just before it, so it is the write that meets the full disk."""
    import errno

    import aml_pipeline.pipeline.stages.manifest as manifest_stage
    from aml_pipeline.core.hashing import DIGEST_FILE

    spec = make_spec(extras=True)
    real, seen, sizes = manifest_stage.publish_staged, [], []

    def full_before_digest(staging, digest):
        assert not (staging / DIGEST_FILE).exists()
        sizes.append(len(digest.to_json_bytes()))
        fill(root, leave_kb=0)
        try:
            return real(staging, digest)
        except (OSError, DiskFullError) as e:
            cause = e if isinstance(e, OSError) else e.__context__  # the OS's error the line stands for
            seen.append((cause.errno, (staging / DIGEST_FILE).exists()))
            raise

    with small_filesystem(tmp_path / "small", 16 * 1024) as root, open_tsdb(plant_url) as db:
        first = build_dataset(spec, db, store_root=tmp_path / "store", datasets_root=root)
        before = _visible(root / spec.id)
        edited = make_spec(extras=True, split={"method": "hashed", "train": 0.6, "val": 0.2, "test": 0.2, "seed": 1})
        monkeypatch.setattr(manifest_stage, "publish_staged", full_before_digest)
        env, trace = traced(tmp_path, "publish")
        monkeypatch.setenv(TRACE_ENV, env[TRACE_ENV])
        with pytest.raises(DiskFullError) as err:
            build_dataset(edited, db, store_root=tmp_path / "store", datasets_root=root)
        monkeypatch.delenv(TRACE_ENV)
        # It failed writing the digest: inside publication, the file begun, nothing fsynced yet.
        assert seen == [(errno.ENOSPC, True)]
        reached = {line.split()[0] for line in trace.read_text().splitlines()}
        assert "publish.staging_written" in reached and "publish.fsynced" not in reached, reached
        _assert_publish_failed_and_kept(err.value, root, spec.id, before, first)
        # The line states what the failed write needed: the digest's size, not the whole snapshot's.
        assert 1000 <= sizes[0] < 50_000, sizes
        assert f"; this step needed about {sizes[0] / 1e3:.1f} kB more;" in err.value.one_line(), err.value.one_line()
