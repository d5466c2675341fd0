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

from aml_pipeline.core.hashing import DIGEST_FILE, hashed_files, verify_snapshot
from aml_pipeline.pipeline.build import build_dataset
from aml_pipeline.pipeline.checks import check_disjoint_splits, check_finite_arrays, check_norm_from_train
from aml_pipeline.pipeline.publish import Catalog, current_snapshot
from aml_pipeline.pipeline.snapshot_writer import write_snapshot_files
from aml_pipeline.pipeline.stages.norm import fit_normalization
from aml_pipeline.pipeline.stages.split import DatasetPlan, load_plan
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.tsdb import open_tsdb


@pytest.fixture
def published(make_spec, plant_url, roots):
    with open_tsdb(plant_url) as db:
        return build_dataset(make_spec(extras=True), db, **roots)


def flip_byte(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_hashed_file_is_covered(published):
    snap = published.snapshot_dir
    names = ["spec.json", *hashed_files(published.manifest)]
    assert set(names) >= {"spec.json", "manifest.json", "arrays/x.f32", "arrays/u.f32", "arrays/y.f32",
                          "arrays/timestamps.f64", "arrays/mask.f32", "arrays/sidecar.json"}
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
    flip_byte(snap / "arrays/y.f32", 10)
    # An attacker who also rewrites sha256.json fools the directory alone, not the catalog.
    from aml_pipeline.core.hashing import digest_snapshot

    (snap / DIGEST_FILE).write_bytes(digest_snapshot(snap).to_json_bytes())
    assert verify_snapshot(snap).ok
    entry = Catalog(roots["datasets_root"]).find_by_path(snap)
    assert entry is not None
    assert not verify_snapshot(snap, entry.sha256).ok


def test_checks_catch_what_they_check(published, make_spec, roots, tmp_path):
    snap, m = published.snapshot_dir, published.manifest
    spec = make_spec(extras=True)
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
    x = np.memmap(snap / "arrays/x.f32", dtype="<f4", mode="r+")
    x[123] = np.nan
    x.flush()
    del x
    outcome = check_finite_arrays(snap, m)
    assert not outcome.passed and "x: 1" in outcome.description


BUILD_LOOP = """
import sys
from pathlib import Path
from aml_pipeline.pipeline.build import build_dataset
from aml_pipeline.simulate.plant import plant_spec_dict
from aml_pipeline.spec import parse_spec
from aml_pipeline.tsdb import open_tsdb
import json
spec = parse_spec(json.loads(sys.argv[2]))
print("ready", flush=True)
while True:
    with open_tsdb(sys.argv[1]) as db:
        build_dataset(spec, db, store_root=Path(sys.argv[3]), datasets_root=Path(sys.argv[4]))
"""


def test_killed_builds_never_leave_a_visible_partial_snapshot(make_spec, plant_url, tmp_path):
    """SIGKILL a build loop at random moments: only complete snapshots are ever visible."""
    spec = make_spec(extras=True)  # v2: every build differs (capturedAt), so each one publishes
    store, datasets = tmp_path / "store", tmp_path / "datasets"
    rng = random.Random(1)
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", BUILD_LOOP, plant_url, json.dumps(spec.to_json_dict()), str(store), str(datasets)],
            stdout=subprocess.PIPE, text=True,
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.2, 2.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        root = datasets / spec.id
        visible = [p for p in root.iterdir() if not p.name.startswith(".")] if root.exists() else []
        for path in visible:
            if path.name == "current":
                assert verify_snapshot(path.resolve()).ok
            else:
                assert verify_snapshot(path).ok, f"{path} is visible but incomplete"
        for entry in Catalog(datasets).entries(spec.id):
            assert verify_snapshot(entry.path, entry.sha256).ok
    snapshots = [p for p in (datasets / spec.id).iterdir() if not p.name.startswith(".") and p.name != "current"]
    assert snapshots, "no build completed in the whole test; make the kill delays longer"
    # The next build cleans up staging directories of killed builds.
    with open_tsdb(plant_url) as db:
        out = build_dataset(spec, db, store_root=store, datasets_root=datasets)
    assert [p.name for p in (datasets / spec.id).glob(".staging-*")] == []
    assert current_snapshot(datasets, spec.id) == out.snapshot_dir
