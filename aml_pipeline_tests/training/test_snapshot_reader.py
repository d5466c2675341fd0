"""The self-contained snapshot reader: same hash as core/hashing.py, refuses any changed byte."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from aml_pipeline.core.hashing import digest_snapshot as core_digest
from aml_pipeline.core.hashing import verify_snapshot as core_verify
from aml_pipeline.training import RIDGE_BASELINE_FILES
from aml_pipeline.training.snapshot_reader import SnapshotError, digest_snapshot, load_snapshot, verify_snapshot

ALLOWED_IMPORTS = {
    "__future__", "hashlib", "hmac", "json", "os", "sys", "time", "platform", "io", "dataclasses", "pathlib",
    "typing", "numpy", "dagster_pipes", "snapshot_reader",
}


def write_snapshot(root: Path, *, n=(6, 2, 2), H=4, F=3, nodes=("T1", "Q1", "C1", "F1"), controls=("C1",),
                   targets=("T1", "Q1"), version=2, seed=0) -> Path:
    """A small snapshot in the published layout, hashed by aml_pipeline.core.hashing."""
    rng = np.random.default_rng(seed)
    N = sum(n)
    root.mkdir(parents=True)
    (root / "arrays").mkdir()
    arrays = {
        "x": rng.normal(size=(N, H, len(nodes))), "u": rng.normal(size=(N, F, len(controls))),
        "y": rng.normal(size=(N, F, len(targets))),
    }
    for k, a in arrays.items():
        (root / "arrays" / f"{k}.f32").write_bytes(np.ascontiguousarray(a, dtype="<f4").tobytes())
    spec = {"id": "synthetic", "note": "test"}
    (root / "spec.json").write_text(json.dumps(spec))
    manifest = {
        "version": version, "spec": spec, "allNodes": list(nodes), "controls": list(controls), "targets": list(targets),
        "historySteps": H, "horizonSteps": F,
        "shapes": {"x": [N, H, len(nodes)], "u": [N, F, len(controls)], "y": [N, F, len(targets)]},
        "split": {"train": n[0], "val": n[1], "test": n[2], "trainRunIds": ["a"], "valRunIds": ["b"], "testRunIds": ["c"]},
        "norm": {g: {"mean": [0.0] * len(c), "std": [1.0] * len(c)} for g, c in (("x", nodes), ("u", controls), ("y", targets))},
    }
    if version == 2:
        manifest["artifacts"] = {"x": "arrays/x.f32", "u": "arrays/u.f32", "y": "arrays/y.f32", "sidecar": "arrays/sidecar.json"}
        (root / "arrays" / "sidecar.json").write_text(json.dumps({"units": []}))
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    d = core_digest(root)
    (root / "sha256.json").write_bytes(d.to_json_bytes())
    return root


@pytest.mark.parametrize("version", [1, 2])
def test_digest_equals_the_pipeline_hash(tmp_path, version):
    root = write_snapshot(tmp_path / "s", version=version)
    mine, theirs = digest_snapshot(root), core_digest(root)
    assert mine.sha256 == theirs.sha256 and mine.files == theirs.files
    if version == 2:
        assert "arrays/sidecar.json" in mine.files
    snap = load_snapshot(root)
    assert snap.sha256 == theirs.sha256 and snap.x.shape == (10, 4, 4) and snap.x.dtype == np.dtype("<f4")
    assert snap.part("train") == slice(0, 6) and snap.part("val") == slice(6, 8) and snap.part("test") == slice(8, 10)


@pytest.mark.parametrize("name", ["spec.json", "manifest.json", "arrays/x.f32", "arrays/u.f32", "arrays/y.f32", "arrays/sidecar.json"])
def test_any_changed_byte_is_refused_naming_the_file(tmp_path, name):
    root = write_snapshot(tmp_path / "s")
    path = root / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert not core_verify(root).ok
    with pytest.raises(SnapshotError) as err:
        load_snapshot(root)
    assert err.value.code == "SNAPSHOT_TAMPERED" and name in err.value.changed
    assert "hash mismatch" in str(err.value) and name in str(err.value)


def test_catalog_hash_catches_a_consistently_rewritten_digest_file(tmp_path):
    root = write_snapshot(tmp_path / "s")
    original = digest_snapshot(root).sha256
    y = root / "arrays" / "y.f32"
    y.write_bytes(b"\0" * len(y.read_bytes()))
    (root / "sha256.json").write_bytes(core_digest(root).to_json_bytes())  # the tamperer re-hashes
    verify_snapshot(root)  # consistent with itself ...
    with pytest.raises(SnapshotError, match="recorded in the catalog"):
        load_snapshot(root, expected_sha256=original)  # ... but not with the catalog


def test_missing_files_and_digest_are_refused(tmp_path):
    root = write_snapshot(tmp_path / "s")
    (root / "arrays" / "u.f32").unlink()
    with pytest.raises(SnapshotError, match="arrays/u.f32 is missing"):
        load_snapshot(root)
    root2 = write_snapshot(tmp_path / "t")
    (root2 / "sha256.json").unlink()
    with pytest.raises(SnapshotError, match="sha256.json is missing"):
        load_snapshot(root2)


def test_artifacts_outside_the_snapshot_are_refused(tmp_path):
    root = write_snapshot(tmp_path / "s")
    (tmp_path / "outside.json").write_text("{}")
    m = json.loads((root / "manifest.json").read_text())
    m["artifacts"]["evil"] = "../outside.json"
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SnapshotError, match="outside the snapshot"):
        load_snapshot(root)


def test_shape_mismatch_is_refused_even_when_hashed(tmp_path):
    root = write_snapshot(tmp_path / "s")
    m = json.loads((root / "manifest.json").read_text())
    m["shapes"]["x"][0] = 11
    (root / "manifest.json").write_text(json.dumps(m))
    (root / "sha256.json").write_bytes(core_digest(root).to_json_bytes())
    with pytest.raises(SnapshotError, match="bytes, manifest shape"):
        load_snapshot(root)


def test_training_code_imports_only_what_the_shared_environment_has():
    for path in RIDGE_BASELINE_FILES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]] if node.level == 0 else ["snapshot_reader"]
            else:
                continue
            assert set(names) <= ALLOWED_IMPORTS, f"{path.name} imports {names}"


def test_reader_works_on_a_copied_snapshot(tmp_path):
    root = write_snapshot(tmp_path / "s")
    copy = tmp_path / "elsewhere" / "s"
    shutil.copytree(root, copy)
    assert load_snapshot(copy).sha256 == load_snapshot(root).sha256
