"""gc: old snapshots and obsolete intermediates go, current and builds in flight stay."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline.fsutil import dir_lock
from aml_pipeline.pipeline.build import build_dataset
from aml_pipeline.pipeline.publish import Catalog, current_snapshot
from aml_pipeline.pipeline.retention import collect_garbage
from aml_pipeline.pipeline.stages import GRID, RAW, WINDOWS
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.tsdb import open_tsdb


def _publish_versions(make_spec, plant_url, roots, n: int):
    """n snapshots of one spec (edited notes), the last one current."""
    specs = []
    with open_tsdb(plant_url) as db:
        for i in range(n):
            spec = make_spec(note=f"edit {i}")
            build_dataset(spec, db, **roots)
            specs.append(spec)
    return specs


def _assert_consistent(roots, spec_id: str) -> None:
    catalog = Catalog(roots["datasets_root"])
    current = current_snapshot(roots["datasets_root"], spec_id)
    assert current is not None and verify_snapshot(current).ok
    for entry in catalog.entries(spec_id):
        assert Path(entry.path).is_dir() and verify_snapshot(entry.path, entry.sha256).ok, entry.path


def test_gc_keeps_current_and_the_newest_and_removes_the_rest(make_spec, plant_url, roots):
    specs = _publish_versions(make_spec, plant_url, roots, 5)
    spec_id = specs[-1].id
    entries = Catalog(roots["datasets_root"]).entries(spec_id)
    assert len(entries) == 5
    current = current_snapshot(roots["datasets_root"], spec_id)

    dry = collect_garbage(roots["datasets_root"], roots["store_root"], {spec_id: specs[-1]}, keep=1, dry_run=True)
    assert len(dry.removed_snapshots) == 3 and len(Catalog(roots["datasets_root"]).entries(spec_id)) == 5

    report = collect_garbage(roots["datasets_root"], roots["store_root"], {spec_id: specs[-1]}, keep=1)
    left = Catalog(roots["datasets_root"]).entries(spec_id)
    newest_other = sorted((e for e in entries if Path(e.path).resolve() != current), key=lambda e: e.created_at)[-1]
    assert {Path(e.path).resolve() for e in left} == {current, Path(newest_other.path).resolve()}
    assert sorted(report.removed_snapshots) == sorted(dry.removed_snapshots)
    assert all(not Path(p).exists() for p in report.removed_snapshots)
    dirs = [p for p in (roots["datasets_root"] / spec_id).iterdir() if p.is_dir() and not p.is_symlink()]
    assert len(dirs) == 2  # no trash, no staging left
    _assert_consistent(roots, spec_id)
    # Nothing else to do the second time.
    again = collect_garbage(roots["datasets_root"], roots["store_root"], {spec_id: specs[-1]}, keep=1)
    assert not again.removed_snapshots and not again.removed_other


def test_gc_removes_stages_of_another_spec_version_and_dead_temporaries(make_spec, plant_url, roots):
    spec = make_spec()
    with open_tsdb(plant_url) as db:
        build_dataset(spec, db, **roots)
    store = DatasetStore(roots["store_root"], spec)
    run = store.stage_runs(WINDOWS)[0]
    (store.run_dir(run) / ".grid.values.0123456789ab.tmp").write_bytes(b"half written")
    edited = make_spec(stride=3)  # windows built for stride 1 are obsolete; raw and grid are not
    report = collect_garbage(roots["datasets_root"], roots["store_root"], {spec.id: edited}, keep=3)
    assert sorted({s.split("/")[-1] for s in report.removed_stages}) == ["windows"]
    assert store.stage_runs(WINDOWS) == [] and store.stage_runs(RAW) and store.stage_runs(GRID)
    assert not list(store.run_dir(run).glob(".*.tmp"))
    # The next build refetches and recleans nothing: the kept stages are what it needs.
    with open_tsdb(plant_url) as db:
        build_dataset(edited, db, **roots)
    raw_meta = store.read_meta(run, RAW)
    assert raw_meta is not None and store.read_meta(run, WINDOWS) is not None


def test_gc_leaves_a_spec_alone_while_a_build_holds_it(make_spec, plant_url, roots):
    specs = _publish_versions(make_spec, plant_url, roots, 3)
    spec_id = specs[-1].id
    with dir_lock(roots["datasets_root"] / spec_id, shared=True), dir_lock(roots["store_root"] / spec_id, shared=True):
        report = collect_garbage(roots["datasets_root"], roots["store_root"], {spec_id: specs[-1]}, keep=0, wait_s=0.2)
    assert not report.removed_snapshots and len(report.skipped) == 2
    assert len(Catalog(roots["datasets_root"]).entries(spec_id)) == 3


def test_gc_killed_at_random_moments_leaves_catalog_and_disk_consistent(make_spec, plant_url, roots, tmp_path):
    specs = _publish_versions(make_spec, plant_url, roots, 8)
    spec_id = specs[-1].id
    specs_dir = tmp_path / "specs"
    specs_dir.mkdir()
    (specs_dir / "s.yaml").write_text(json.dumps(specs[-1].to_json_dict()))
    env = {**os.environ, "AML_SPECS": str(specs_dir)}
    home = roots["store_root"].parent
    rng = random.Random(4)
    for keep in (6, 4, 2, 0):
        proc = subprocess.Popen(
            [sys.executable, "-m", "aml_pipeline.cli", "gc", "--keep", str(keep), "--home", str(home),
             "--root", str(roots["datasets_root"])],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        time.sleep(rng.uniform(0.3, 1.2))  # the interpreter starts in ~0.3 s; gc takes a moment
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _assert_consistent(roots, spec_id)
    # A gc that runs to its end cleans up whatever the killed ones left.
    collect_garbage(roots["datasets_root"], roots["store_root"], {spec_id: specs[-1]}, keep=0)
    _assert_consistent(roots, spec_id)
    dirs = [p.name for p in (roots["datasets_root"] / spec_id).iterdir() if p.is_dir() and not p.is_symlink()]
    assert dirs == [current_snapshot(roots["datasets_root"], spec_id).name]
    assert len(Catalog(roots["datasets_root"]).entries(spec_id)) == 1
