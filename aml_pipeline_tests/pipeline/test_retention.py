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

import pytest

from aml_pipeline.config import REPO_ROOT
from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline.fsutil import dir_lock
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.publish import Catalog, current_snapshot
from aml_pipeline.pipeline.retention import collect_garbage
from aml_pipeline.pipeline.registry import GRID, RAW, WINDOWS
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.pipeline.support import stage_runs
from aml_pipeline_tests.faults import armed, count_phases, kill_stopped, last_point, traced, wait_stopped


def _publish_versions(make_spec, plant_url, roots, n: int, first: int = 0, layout: str = "windows"):
    """n snapshots of one spec (edited notes), the last one current."""
    specs = []
    with open_tsdb(plant_url) as db:
        for i in range(first, first + n):
            spec = make_spec(note=f"edit {i}", layout=layout)
            build_dataset(spec, db, **roots)
            specs.append(spec)
    return specs


def _assert_consistent(roots, spec_id: str) -> None:
    catalog = Catalog(roots["datasets_root"])
    current = current_snapshot(roots["datasets_root"], spec_id)
    assert current is not None and verify_snapshot(current).ok
    for entry in catalog.entries(spec_id):
        assert Path(entry.path).is_dir() and verify_snapshot(entry.path, entry.sha256).ok, entry.path


@pytest.mark.parametrize("layout", ["windows", "series"])
def test_gc_keeps_current_and_the_newest_and_removes_the_rest(make_spec, plant_url, roots, layout):
    specs = _publish_versions(make_spec, plant_url, roots, 5, layout=layout)
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
    run = stage_runs(store, WINDOWS)[0]
    (store.run_dir(run) / ".grid.values.0123456789ab.tmp").write_bytes(b"half written")
    edited = make_spec(stride=3)  # windows built for stride 1 are obsolete; raw and grid are not
    report = collect_garbage(roots["datasets_root"], roots["store_root"], {spec.id: edited}, keep=3)
    assert sorted({s.split("/")[-1] for s in report.removed_stages}) == ["windows"]
    assert stage_runs(store, WINDOWS) == [] and stage_runs(store, RAW) and stage_runs(store, GRID)
    assert not list(store.run_dir(run).glob(".*.tmp"))
    # The next build refetches and recleans nothing: the kept stages are what it needs.
    with open_tsdb(plant_url) as db:
        build_dataset(edited, db, **roots)
    raw_meta = store.read_meta(run, RAW)
    assert raw_meta is not None and store.read_meta(run, WINDOWS) is not None


def _built_run(make_spec, plant_url, roots, stage):
    """A spec built once: the spec, its store, the first run with ``stage`` and that run's folder."""
    spec = make_spec()
    with open_tsdb(plant_url) as db:
        build_dataset(spec, db, **roots)
    store = DatasetStore(roots["store_root"], spec)
    run = stage_runs(store, stage)[0]
    return spec, store, run, store.run_dir(run)


def test_gc_removes_a_file_a_current_stage_no_longer_writes(make_spec, plant_url, roots):
    """A store built before the raw stage stopped storing the TSDB's ingest order holds
    ``raw.seq.npy`` beside a current raw stage: gc removes it (``--dry-run`` names it first), and
    the stage's own files stay."""
    spec, store, run, run_dir = _built_run(make_spec, plant_url, roots, RAW)
    (run_dir / "raw.seq.npy").write_bytes(b"\x93NUMPY" + bytes(120))
    before = sorted(p.name for p in run_dir.iterdir())
    dry = collect_garbage(roots["datasets_root"], roots["store_root"], {spec.id: spec}, keep=3, dry_run=True)
    assert dry.removed_other == [str(run_dir / "raw.seq.npy")] and sorted(p.name for p in run_dir.iterdir()) == before
    report = collect_garbage(roots["datasets_root"], roots["store_root"], {spec.id: spec}, keep=3)
    assert report.removed_other == [str(run_dir / "raw.seq.npy")] and not report.removed_stages
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(set(before) - {"raw.seq.npy"})
    assert all(store.read_meta(run, stage) is not None for stage in (RAW, GRID, WINDOWS))


def test_gc_removes_the_model_unit_grid_of_a_store_built_before(make_spec, plant_url, roots):
    """A store built before the windows stage stopped storing the model-unit grid (it is read from
    the grid stage) holds ``windows.model.npy`` beside a current windows stage: the build neither
    writes nor reads it, and gc removes it."""
    spec, store, run, run_dir = _built_run(make_spec, plant_url, roots, WINDOWS)
    assert sorted(p.name for p in run_dir.glob("windows.*")) == ["windows.json", "windows.starts.npy"]
    (run_dir / "windows.model.npy").write_bytes(b"\x93NUMPY" + bytes(120))
    report = collect_garbage(roots["datasets_root"], roots["store_root"], {spec.id: spec}, keep=3)
    assert report.removed_other == [str(run_dir / "windows.model.npy")] and not report.removed_stages
    assert store.read_meta(run, WINDOWS) is not None


def test_gc_leaves_a_spec_alone_while_a_build_holds_it(make_spec, plant_url, roots):
    specs = _publish_versions(make_spec, plant_url, roots, 3)
    spec_id = specs[-1].id
    with dir_lock(roots["datasets_root"] / spec_id, shared=True), dir_lock(roots["store_root"] / spec_id, shared=True):
        report = collect_garbage(roots["datasets_root"], roots["store_root"], {spec_id: specs[-1]}, keep=0, wait_s=0.2)
    assert not report.removed_snapshots and len(report.skipped) == 2
    assert len(Catalog(roots["datasets_root"]).entries(spec_id)) == 3


def _gc_command(roots, tmp_path: Path, spec, keep: int) -> tuple[list[str], dict[str, str]]:
    """``aml-pipeline gc`` over ``roots`` with ``spec`` as the only spec file."""
    specs_dir = tmp_path / "specs"
    specs_dir.mkdir(exist_ok=True)
    (specs_dir / "s.yaml").write_text(json.dumps(spec.to_json_dict()))
    cmd = [sys.executable, "-m", "aml_pipeline.cli", "gc", "--keep", str(keep), "--home",
           str(roots["store_root"].parent), "--root", str(roots["datasets_root"])]
    return cmd, {**os.environ, "AML_SPECS": str(specs_dir)}


def _snapshot_dirs(roots, spec_id: str) -> list[str]:
    return sorted(p.name for p in (roots["datasets_root"] / spec_id).iterdir() if p.is_dir() and not p.is_symlink())


def test_gc_in_a_copied_datasets_root_touches_only_the_copy(make_spec, plant_url, roots, tmp_path):
    """A copied (or moved) datasets root keeps its catalog, whose paths name the original: gc of
    the copy must remove the copy's old snapshot, keep the copy's newest, and leave the original
    root alone."""
    import shutil

    specs = _publish_versions(make_spec, plant_url, roots, 3)
    spec_id = specs[-1].id
    original = roots["datasets_root"]
    before = {p.name: verify_snapshot(original / spec_id / p.name).ok for p in (original / spec_id).iterdir()
              if p.is_dir() and not p.is_symlink()}
    copy = tmp_path / "copied" / "datasets"
    shutil.copytree(original, copy, symlinks=True)
    entries = sorted(Catalog(copy).entries(spec_id), key=lambda e: e.created_at)
    assert all(Path(e.path).parent == original / spec_id for e in entries)  # the catalog names the original
    oldest, newest_other, current = (Path(e.path).name for e in entries)

    cmd, env = _gc_command({**roots, "datasets_root": copy}, tmp_path, specs[-1], keep=1)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"removed snapshot {copy / spec_id / oldest}" in done.stdout
    assert str(original) not in done.stdout

    # The original root: every snapshot and catalog row still there, each intact.
    assert _snapshot_dirs(roots, spec_id) == sorted(before) and all(before.values())
    assert len(Catalog(original).entries(spec_id)) == 3
    _assert_consistent(roots, spec_id)
    # The copy: its current and its newest other snapshot kept, the oldest gone with its row.
    assert _snapshot_dirs({"datasets_root": copy}, spec_id) == sorted([newest_other, current])
    assert sorted(Path(e.path).name for e in Catalog(copy).entries(spec_id)) == sorted([newest_other, current])
    assert verify_snapshot(copy / spec_id / newest_other).ok and verify_snapshot(copy / spec_id / current).ok


def test_a_copied_datasets_root_knows_its_current_snapshot(make_spec, plant_url, roots, tmp_path):
    """The copy's catalog names the original's paths; its current snapshot is still found (in the
    copy), so a build with nothing new there publishes nothing, and the checks read the copy."""
    import shutil

    from aml_pipeline.pipeline.checks import check_current

    (spec,) = _publish_versions(make_spec, plant_url, roots, 1)
    original = roots["datasets_root"]
    copy = tmp_path / "copied" / "datasets"
    shutil.copytree(original, copy, symlinks=True)
    shutil.rmtree(original)  # a moved root: nothing may be read from the old place
    entry = Catalog(copy).current(spec.id)
    assert entry is not None and Path(entry.path) == (copy / spec.id / "current").resolve()
    with open_tsdb(plant_url) as db:
        again = build_dataset(spec, db, **{**roots, "datasets_root": copy})
    assert not again.published and again.snapshot_dir == Path(entry.path)
    assert _snapshot_dirs({"datasets_root": copy}, spec.id) == [Path(entry.path).name]
    found, outcomes = check_current(copy, spec.id)
    assert found is not None and all(o.passed for o in outcomes), outcomes


@pytest.mark.parametrize("point", ["gc.catalog_row_removed", "gc.moved_to_trash", "gc.deleted"])
def test_gc_killed_at_each_step_leaves_catalog_and_disk_consistent(point, make_spec, plant_url, roots, tmp_path):
    specs = _publish_versions(make_spec, plant_url, roots, 3)
    spec_id = specs[-1].id
    current = current_snapshot(roots["datasets_root"], spec_id)
    cmd, env = _gc_command(roots, tmp_path, specs[-1], keep=0)
    env = armed(point, tmp_path, env)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kill_stopped(wait_stopped(proc, env, output=lambda: proc.stderr.read()), proc)

    _assert_consistent(roots, spec_id)
    assert current_snapshot(roots["datasets_root"], spec_id) == current
    left = {Path(e.path) for e in Catalog(roots["datasets_root"]).entries(spec_id)}
    dirs = _snapshot_dirs(roots, spec_id)
    trash = [d for d in dirs if d.startswith(".trash-")]
    # The first snapshot gc removes: its row is gone at every point; then its directory is
    # renamed to trash; then the trash is gone.
    victims = [d for d in dirs if not d.startswith(".") and roots["datasets_root"] / spec_id / d not in left]
    assert len(left) == 2
    if point == "gc.catalog_row_removed":
        assert len(victims) == 1 and not trash  # complete, uncatalogued: the next gc removes it
        assert verify_snapshot(roots["datasets_root"] / spec_id / victims[0]).ok
    elif point == "gc.moved_to_trash":
        assert not victims and len(trash) == 1
    else:
        assert not victims and not trash
    assert current in left

    # A gc that runs to its end removes whatever the killed one left.
    collect_garbage(roots["datasets_root"], roots["store_root"], {spec_id: specs[-1]}, keep=0)
    _assert_consistent(roots, spec_id)
    assert _snapshot_dirs(roots, spec_id) == [current.name]
    assert [Path(e.path) for e in Catalog(roots["datasets_root"]).entries(spec_id)] == [current]


def test_gc_killed_at_random_moments_while_removing(make_spec, plant_url, roots, tmp_path):
    """gc processes are stopped at a random one of their removal steps, let go on, and SIGKILLed a
    random moment later: the kills that land while gc still runs (its exit status says so) are
    spread over the removal, and catalog and disk stay consistent after each."""
    rng = random.Random(4)
    phases: list[str] = []
    finished = 0
    for round_ in range(20):
        specs = _publish_versions(make_spec, plant_url, roots, 3, first=3 * round_)
        spec_id = specs[-1].id
        cmd, env = _gc_command(roots, tmp_path, specs[-1], keep=0)
        point = f"{rng.choice(['gc.catalog_row_removed', 'gc.moved_to_trash'])}:{rng.randint(1, 3)}"
        env, trace = traced(tmp_path, f"gc-{round_}", armed(point, tmp_path, env))
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        pid = wait_stopped(proc, env, output=lambda: proc.stderr.read())
        os.kill(pid, signal.SIGCONT)
        time.sleep(rng.uniform(0.0, 0.01))  # a random moment, not a condition
        os.kill(pid, signal.SIGKILL)
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            phases.append(last_point(trace, pid))
        else:
            assert proc.returncode == 0, proc.stderr.read()
            finished += 1  # gc ended before the kill: not counted
        _assert_consistent(roots, spec_id)
        if len(phases) >= 6 and len(set(phases)) >= 2:
            break
    counts = count_phases(phases)
    print(f"kills per phase: {counts}; gc finished before the kill: {finished}")
    assert len(phases) >= 6 and len(set(phases)) >= 2, (counts, finished)
    collect_garbage(roots["datasets_root"], roots["store_root"], {spec_id: specs[-1]}, keep=0)
    _assert_consistent(roots, spec_id)
    assert _snapshot_dirs(roots, spec_id) == [current_snapshot(roots["datasets_root"], spec_id).name]
    assert len(Catalog(roots["datasets_root"]).entries(spec_id)) == 1


BUILD_LOOP = """
import json, sys
from pathlib import Path
from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.publish import current_snapshot
from aml_pipeline.spec import parse_spec
from aml_pipeline.tsdb_open import open_tsdb
spec, stop = json.loads(sys.argv[2]), Path(sys.argv[5])
with open_tsdb(sys.argv[1]) as db:
    i = 0
    while not stop.exists():
        out = build_dataset(parse_spec({**spec, "note": f"loop {i}"}), db, store_root=Path(sys.argv[3]),
                            datasets_root=Path(sys.argv[4]))
        # Until the next build publishes, this snapshot is current: gc must leave it whole.
        ok = out.published and current_snapshot(Path(sys.argv[4]), spec["id"]) == out.snapshot_dir
        print(json.dumps({"i": i, "ok": ok and verify_snapshot(out.snapshot_dir, out.sha256).ok}), flush=True)
        i += 1
"""


def test_gc_in_a_loop_against_a_real_build_loop(make_spec, plant_url, roots, tmp_path):
    """``gc --keep 0`` again and again while a build loop publishes a new snapshot each time,
    until gc has removed snapshots the loop published in several runs: no build fails or loses
    its snapshot, ``current`` always verifies."""
    spec = make_spec()
    with open_tsdb(plant_url) as db:
        build_dataset(spec, db, **roots)  # the runs' stages exist: the loop's builds only publish
    stop, log = tmp_path / "stop", tmp_path / "builds.jsonl"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", BUILD_LOOP, plant_url, json.dumps(spec.to_json_dict()), str(roots["store_root"]),
             str(roots["datasets_root"]), str(stop)],
            stdout=out, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,  # it imports aml_pipeline_tests
        )
    gcs = removed_during = 0
    deadline = time.monotonic() + 300
    try:
        while not log.read_text() and proc.poll() is None and time.monotonic() < deadline:  # published once
            time.sleep(0.01)
        while removed_during < 8 and proc.poll() is None and time.monotonic() < deadline:
            report = collect_garbage(roots["datasets_root"], roots["store_root"], {spec.id: spec}, keep=0, wait_s=30)
            gcs += 1
            if report.removed_snapshots and proc.poll() is None:
                removed_during += 1
            current = current_snapshot(roots["datasets_root"], spec.id)
            assert current is not None and verify_snapshot(current).ok
        stop.touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    # gc really ran between the loop's builds, removing what they had published.
    assert removed_during >= 8, (gcs, removed_during)
    results = [json.loads(line) for line in log.read_text().splitlines()]
    assert results and all(r["ok"] for r in results), results
    collect_garbage(roots["datasets_root"], roots["store_root"], {spec.id: spec}, keep=0)
    _assert_consistent(roots, spec.id)
    assert len(_snapshot_dirs(roots, spec.id)) == 1
