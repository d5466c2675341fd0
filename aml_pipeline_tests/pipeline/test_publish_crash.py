"""A build SIGKILLed at each named step of publication (``aml_pipeline.faults``): the process is
proven stopped at that step when killed; afterwards the previous snapshot and ``current`` are
intact, every catalog row and every visible directory is a complete snapshot, and the next build
repairs what is left and publishes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aml_pipeline.config import REPO_ROOT
from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.publish import Catalog, current_snapshot
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.faults import armed, kill_stopped, wait_stopped

BUILD = """
import json, sys
from pathlib import Path
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.spec import parse_spec
from aml_pipeline.tsdb_open import open_tsdb
spec = parse_spec(json.loads(sys.argv[2]))
with open_tsdb(sys.argv[1]) as db:
    out = build_dataset(spec, db, store_root=Path(sys.argv[3]), datasets_root=Path(sys.argv[4]))
print(out.snapshot_dir)
"""

# Where the killed build's snapshot is after the kill: only in staging (hidden), renamed into
# place but not current, or current.
STAGED = ("publish.array_written", "publish.staging_written", "publish.fsynced")
PLACED = ("publish.renamed",)
CURRENT = ("publish.current_swapped", "publish.catalog_recorded")


def visible(spec_dir: Path) -> list[Path]:
    return sorted(p for p in spec_dir.iterdir() if not p.name.startswith(".") and p.name != "current")


def assert_consistent(datasets: Path, spec_id: str) -> None:
    """Every catalog row names a complete snapshot; so does every visible directory and ``current``."""
    current = current_snapshot(datasets, spec_id)
    assert current is not None and verify_snapshot(current).ok, current
    for entry in Catalog(datasets).entries(spec_id):
        assert verify_snapshot(entry.path, entry.sha256).ok, entry.path
    for path in visible(datasets / spec_id):
        assert verify_snapshot(path).ok, f"{path} is visible but not a complete snapshot"


@pytest.mark.parametrize("point,layout", [*((p, "windows") for p in STAGED + PLACED + CURRENT),
                                          *((p, "series") for p in ("publish.array_written", "publish.renamed"))])
def test_a_build_killed_at_each_step_of_publication(point, layout, make_spec, plant_url, roots, tmp_path):
    datasets, spec = roots["datasets_root"], make_spec(note="before", layout=layout)
    with open_tsdb(plant_url) as db:
        before = build_dataset(spec, db, **roots)
    # The edited note changes the manifest, so this build publishes a new snapshot.
    edited = make_spec(note="after", layout=layout)
    env = armed(point, tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", BUILD, plant_url, json.dumps(edited.to_json_dict()), str(roots["store_root"]), str(datasets)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,  # it imports aml_pipeline_tests
    )
    pid = wait_stopped(proc, env, output=lambda: proc.stderr.read())
    assert pid == proc.pid
    staging = sorted(p.name for p in (datasets / spec.id).glob(f".staging-{pid}-*"))
    kill_stopped(pid, proc)

    spec_dir = datasets / spec.id
    assert verify_snapshot(before.snapshot_dir, before.sha256).ok  # the previous snapshot is untouched
    assert_consistent(datasets, spec.id)
    new = [p for p in visible(spec_dir) if p != before.snapshot_dir]
    current = current_snapshot(datasets, spec.id)
    entries = {e.sha256: e for e in Catalog(datasets).entries(spec.id)}
    if point in STAGED:
        assert staging, "the build was killed while its snapshot was being staged, yet no staging directory exists"
        assert new == [] and current == before.snapshot_dir and list(entries) == [before.sha256]
    else:
        assert staging == [] and len(new) == 1  # renamed into place, complete
        assert current == (before.snapshot_dir if point in PLACED else new[0])
        recorded = point == "publish.catalog_recorded"
        assert (len(entries) == 2) == recorded
        # Only the catalog's own record says which snapshot is current: a swapped link without
        # it is not yet the catalog's current entry, so a reader of the catalog sees the old one.
        catalog_current = Catalog(datasets).current(spec.id)
        assert (catalog_current is not None and Path(catalog_current.path) == new[0]) == recorded

    # The next build removes the dead build's staging directory and publishes the edit.
    with open_tsdb(plant_url) as db:
        after = build_dataset(edited, db, **roots)
    assert list(spec_dir.glob(".staging-*")) == []
    assert current_snapshot(datasets, spec.id) == after.snapshot_dir and after.current
    catalog_current = Catalog(datasets).current(spec.id)
    assert catalog_current is not None and catalog_current.sha256 == after.sha256
    assert {e.sha256 for e in Catalog(datasets).entries(spec.id)} == {before.sha256, after.sha256}
    assert sorted(visible(spec_dir)) == sorted([before.snapshot_dir, after.snapshot_dir])
    if point not in STAGED:
        assert after.snapshot_dir == new[0]  # the complete snapshot the dead build left is the one kept
    assert_consistent(datasets, spec.id)
