"""Tamper evidence and atomic publication of snapshots."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aml_pipeline.config import REPO_ROOT
from aml_pipeline.core.hashing import DIGEST_FILE, hashed_files, verify_snapshot
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.checks import check_disjoint_splits, check_finite_arrays, check_norm_from_train
from aml_pipeline.pipeline.publish import Catalog, current_snapshot
from aml_pipeline.pipeline.snapshot_writer import write_snapshot_files
from aml_pipeline.pipeline.stages.norm import fit_normalization
from aml_pipeline.pipeline.stages.split import DatasetPlan, load_plan
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.faults import count_phases, last_point, traced


@pytest.fixture(params=["windows", "series"])
def published(request, make_spec, plant_url, roots):
    with open_tsdb(plant_url) as db:
        return build_dataset(make_spec(extras=True, layout=request.param), db, **roots)


# What each layout must hash, beside spec.json and manifest.json.
HASHED_ARRAYS = {
    "windows": {"arrays/x.f32", "arrays/u.f32", "arrays/y.f32", "arrays/timestamps.f64", "arrays/mask.f32"},
    "series": {"arrays/x_rows.f32", "arrays/u_rows.f32", "arrays/y_rows.f32", "arrays/segments.i64"},
}


def flip_byte(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_hashed_file_is_covered(published):
    snap = published.snapshot_dir
    names = ["spec.json", *hashed_files(published.manifest)]
    layout = published.manifest.get("layout", "windows")
    assert set(names) == {"spec.json", "manifest.json", "arrays/sidecar.json", *HASHED_ARRAYS[layout]}
    assert {str(p.relative_to(snap)) for p in (snap / "arrays").iterdir()} == set(names) - {"spec.json", "manifest.json"}
    for name in names:
        path = snap / name
        original = path.read_bytes()
        flip_byte(path, len(original) // 2)
        result = verify_snapshot(snap)
        assert not result.ok and result.changed == [name], name
        path.write_bytes(original)
        assert verify_snapshot(snap).ok


def test_rewritten_digest_file_still_fails_against_the_catalog(published, roots):
    snap = published.snapshot_dir
    flip_byte(snap / ("arrays/y.f32" if "layout" not in published.manifest else "arrays/y_rows.f32"), 10)
    # An attacker who also rewrites sha256.json fools the directory alone, not the catalog.
    from aml_pipeline.core.hashing import digest_snapshot

    (snap / DIGEST_FILE).write_bytes(digest_snapshot(snap).to_json_bytes())
    assert verify_snapshot(snap).ok
    entry = Catalog(roots["datasets_root"]).find_by_path(snap)
    assert entry is not None
    assert not verify_snapshot(snap, entry.sha256).ok


def test_checks_catch_what_they_check(published, make_spec, roots, tmp_path):
    snap, m = published.snapshot_dir, published.manifest
    series = m.get("layout") == "series"
    spec = make_spec(extras=True, layout=m.get("layout", "windows"))
    store = DatasetStore(roots["store_root"], spec)

    assert check_norm_from_train(snap, m).passed
    # Statistics that saw the validation windows, applied to the same windows: the normalised
    # train windows are no longer mean 0 / std 1, and the check says which columns.
    plan = load_plan(store)
    leaky = DatasetPlan({**plan.split, "trainRunIds": plan.split["trainRunIds"] + plan.split["valRunIds"]},
                        plan.lineage, plan.runs, plan.fingerprint)
    leaked_norm = fit_normalization(store, leaky)
    staging = tmp_path / "leaked"
    files = write_snapshot_files(store, plan, leaked_norm, staging, availability_watermark=None, captured_at="t")
    outcome = check_norm_from_train(staging, files.manifest)
    assert not outcome.passed and "x:" in outcome.description

    assert check_disjoint_splits(m).passed
    twice = json.loads(json.dumps(m))
    twice["split"]["testRunIds"].append(twice["split"]["trainRunIds"][0])
    assert not check_disjoint_splits(twice).passed

    assert check_finite_arrays(snap, m).passed
    x = np.memmap(snap / ("arrays/x_rows.f32" if series else "arrays/x.f32"), dtype="<f4", mode="r+")
    x[123] = np.nan
    x.flush()
    del x
    outcome = check_finite_arrays(snap, m)
    assert not outcome.passed and ("xRows: 1" if series else "x: 1") in outcome.description
    if series:  # a window index that places a window's rows outside the files
        segments = np.memmap(snap / "arrays/segments.i64", dtype="<i8", mode="r+", shape=tuple(m["shapes"]["segments"]))
        segments[4, -1] += m["shapes"]["xRows"][0]
        segments.flush()
        del segments
        for check in (check_finite_arrays, check_norm_from_train):
            outcome = check(snap, m)
            assert not outcome.passed and "history rows lie outside x_rows" in outcome.description


BUILD_LOOP = """
import json, os, sys
from pathlib import Path
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.spec import parse_spec
from aml_pipeline.tsdb_open import open_tsdb
spec = json.loads(sys.argv[2])
trace = os.environ["AML_FAULT_TRACE"]
with open_tsdb(sys.argv[1]) as db:
    for i in range(10**6):
        # A new note every build: each one publishes a new snapshot.
        with open(trace, "a") as f:
            f.write(f"build.start {os.getpid()}\\n")
        edited = parse_spec({**spec, "note": f"{sys.argv[5]}-{i}"})
        build_dataset(edited, db, store_root=Path(sys.argv[3]), datasets_root=Path(sys.argv[4]))
        if i == 0:
            print("ready", flush=True)  # builds follow each other from here on
"""

# The phase a build was in, from the last crash point it reached (see aml_pipeline.faults).
PHASE_AFTER = {
    None: "fetch, clean, plan",
    "publish.array_written": "writing staging",
    "publish.staging_written": "checks and fsync",
    "publish.fsynced": "renaming into place",
    "publish.renamed": "swapping current",
    "publish.current_swapped": "recording in the catalog",
    "publish.catalog_recorded": "returning",
}
# Phases in which a staging directory or a half-published snapshot exists.
PUBLISHING = {"writing staging", "checks and fsync", "renaming into place", "swapping current", "recording in the catalog"}


def test_killed_builds_never_leave_a_visible_partial_snapshot(make_spec, plant_url, tmp_path):
    """SIGKILL a loop of publishing builds at random moments until enough kills have hit
    publication: only complete snapshots are ever visible, and the kills per phase are counted."""
    spec = make_spec()
    store, datasets = tmp_path / "store", tmp_path / "datasets"
    with open_tsdb(plant_url) as db:  # the runs' stages exist: each build in the loop only publishes
        build_dataset(spec, db, store_root=store, datasets_root=datasets)
    env, trace = traced(tmp_path, "builds")
    rng = random.Random(1)
    phases: list[str] = []
    checked: set[Path] = set()
    recorded: set[tuple[str, str]] = set()
    for attempt in range(60):
        proc = subprocess.Popen(
            [sys.executable, "-c", BUILD_LOOP, plant_url, json.dumps(spec.to_json_dict()), str(store), str(datasets),
             str(attempt)],
            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,  # the child imports aml_pipeline_tests
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.3))  # a random moment, not a condition
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL  # it was alive when killed
        phases.append(PHASE_AFTER[last_point(trace, proc.pid, since="build.start")])
        # Published snapshots are immutable: what the killed build may have left is what appeared
        # since the last kill, besides `current` and the catalog's rows.
        current = current_snapshot(datasets, spec.id)
        assert current is not None and verify_snapshot(current).ok, f"current is broken (killed in: {phases[-1]})"
        for path in (datasets / spec.id).iterdir():
            if not path.name.startswith(".") and path.name != "current" and path not in checked:
                assert verify_snapshot(path).ok, f"{path} is visible but incomplete (killed in: {phases[-1]})"
                checked.add(path)
        for entry in Catalog(datasets).entries(spec.id):
            if (entry.path, entry.sha256) not in recorded:
                assert verify_snapshot(entry.path, entry.sha256).ok, entry.path
                recorded.add((entry.path, entry.sha256))
        if sum(p in PUBLISHING for p in phases) >= 6 and len(set(phases) & PUBLISHING) >= 3:
            break
    counts = count_phases(phases)
    print(f"kills per phase: {counts}")
    assert sum(p in PUBLISHING for p in phases) >= 6 and len(set(phases) & PUBLISHING) >= 3, counts
    # The next build cleans up staging directories of killed builds.
    with open_tsdb(plant_url) as db:
        out = build_dataset(make_spec(note="last"), db, store_root=store, datasets_root=datasets)
    assert [p.name for p in (datasets / spec.id).glob(".staging-*")] == []
    assert current_snapshot(datasets, spec.id) == out.snapshot_dir
