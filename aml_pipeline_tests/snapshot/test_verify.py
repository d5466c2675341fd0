"""open_snapshot's verification: the pipeline's hash byte for byte, streamed, refusing any change."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from aml_pipeline.core.hashing import digest_snapshot as core_digest
from aml_pipeline.core.hashing import hashed_files as core_hashed_files
from aml_pipeline.core.hashing import verify_snapshot as core_verify
from aml_pipeline.snapshot import SnapshotError, hashed_files, open_snapshot
from aml_pipeline_tests.snapshot.support import flip_byte, rehash, rewrite_manifest, write_snapshot

CLI = [sys.executable, "-m", "aml_pipeline.cli"]


def cli_verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "verify", str(path)], capture_output=True, text=True)


def copy_root(published, tmp_path: Path) -> Path:
    """A copy of the whole datasets root (catalog included), as when moved to another machine;
    returns the copied snapshot directory."""
    src = published.snapshot_dir.parent.parent
    shutil.copytree(src, tmp_path / "copied" / "datasets", symlinks=True)
    return tmp_path / "copied" / "datasets" / published.snapshot_dir.parent.name / published.snapshot_dir.name


@pytest.mark.parametrize("which", ["v1", "v2", "series_v1", "series_v2"])
def test_hash_equals_the_pipeline_and_the_cli(which, request):
    published = request.getfixturevalue(which)
    snap = open_snapshot(published.snapshot_dir)
    assert snap.verified and snap.sha256 == published.sha256 == core_digest(published.snapshot_dir).sha256
    assert json.loads((published.snapshot_dir / "sha256.json").read_text())["sha256"] == snap.sha256
    assert hashed_files(snap.manifest) == core_hashed_files(snap.manifest)
    cli = cli_verify(published.snapshot_dir)
    assert cli.returncode == 0 and cli.stdout.split()[:2] == ["OK", snap.sha256]
    assert snap.version == (2 if which.endswith("v2") else 1)
    assert (snap.timestamps is not None) == which.endswith("v2")
    assert snap.layout == ("series" if which.startswith("series") else "windows")


@pytest.mark.parametrize(
    "name", ["spec.json", "manifest.json", "arrays/x.f32", "arrays/u.f32", "arrays/y.f32",
             "arrays/timestamps.f64", "arrays/mask.f32", "arrays/sidecar.json"],
)
def test_a_changed_byte_in_any_hashed_file_is_refused_naming_it(fresh_v2, name):
    root = fresh_v2.snapshot_dir
    flip_byte(root / name)
    with pytest.raises(SnapshotError) as err:
        open_snapshot(root)
    assert err.value.code == "SNAPSHOT_TAMPERED" and err.value.changed == [name]
    assert "hash mismatch" in str(err.value) and name in str(err.value) and fresh_v2.sha256 in str(err.value)
    # The same verdict as the pipeline's verify and the CLI's.
    core = core_verify(root)
    assert not core.ok and core.changed == [name]
    cli = cli_verify(root)
    assert cli.returncode == 1 and cli.stderr.startswith("SNAPSHOT_TAMPERED: ") and name in cli.stderr
    if name.startswith("arrays/") and name.endswith(("f32", "f64")):
        # Without verification it opens (for forensics), and says it is not verified.
        snap = open_snapshot(root, verify=False)
        assert not snap.verified and snap.sha256 == fresh_v2.sha256  # the recorded hash


def test_a_rewritten_digest_file_fails_against_the_catalog(fresh_v2, tmp_path):
    for root in (fresh_v2.snapshot_dir, copy_root(fresh_v2, tmp_path)):  # in place, and a copied datasets root
        y = root / "arrays" / "y.f32"
        with open(y, "r+b") as f:
            f.write(b"\0" * 64)
        rehash(root)  # the tamperer re-hashes: consistent with itself ...
        assert open_snapshot(root, use_catalog=False).verified
        with pytest.raises(SnapshotError, match="recorded in the catalog") as err:  # ... not with the catalog
            open_snapshot(root)
        assert err.value.code == "SNAPSHOT_TAMPERED" and fresh_v2.sha256 in str(err.value)
        assert not core_verify(root, fresh_v2.sha256).ok
        cli = cli_verify(root)
        assert cli.returncode == 1 and "SNAPSHOT_TAMPERED" in cli.stderr


def test_expected_sha256_from_elsewhere_is_checked_too(tmp_path):
    root = write_snapshot(tmp_path / "s")
    good = open_snapshot(root).sha256
    assert open_snapshot(root, expected_sha256=good).verified
    with pytest.raises(SnapshotError, match="recorded in expected_sha256"):
        open_snapshot(root, expected_sha256="0" * 64)


def test_missing_files_are_refused(fresh_v2, tmp_path):
    root = fresh_v2.snapshot_dir
    os.chmod(root / "arrays", 0o755)
    (root / "arrays" / "u.f32").unlink()
    with pytest.raises(SnapshotError, match=r"arrays/u\.f32 is missing") as err:
        open_snapshot(root)
    assert err.value.changed == ["arrays/u.f32"] and not core_verify(root).ok
    assert cli_verify(root).returncode == 1

    bare = write_snapshot(tmp_path / "bare")  # outside any datasets root: sha256.json is all there is
    (bare / "sha256.json").unlink()
    with pytest.raises(SnapshotError, match="sha256.json is missing; refusing an unverifiable snapshot"):
        open_snapshot(bare)


@pytest.mark.parametrize("name", ["spec.json", "arrays/x.f32"])
def test_a_directory_where_a_hashed_file_belongs_is_named(fresh_v2, name):
    root = fresh_v2.snapshot_dir
    os.chmod(root, 0o755)
    os.chmod(root / "arrays", 0o755)
    (root / name).unlink()
    (root / name).mkdir()
    result = core_verify(root)
    assert not result.ok and result.changed == [name], result
    proc = cli_verify(root)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].endswith(f"changed: {name}"), proc.stderr
    if name != "spec.json":  # the reader names it too (spec.json is read before any file is opened)
        with pytest.raises(SnapshotError, match=f"{name} is a directory, not the file it should be") as err:
            open_snapshot(root)
        assert err.value.code == "SNAPSHOT_TAMPERED" and err.value.changed == [name]


@pytest.mark.parametrize(("name", "text", "named"), [
    ("sha256.json", "[]", "sha256.json"),
    ("sha256.json", '{"sha256": 5}', "sha256.json"),
    ("sha256.json", '{"sha256": "%s", "files": 3}', "unknown: no per-file digests in sha256.json"),
    ("manifest.json", "[1, 2]", "manifest.json"),
    ("manifest.json", '{"version": 2, "artifacts": ["a"]}', "manifest.json"),
])
def test_digest_and_manifest_files_of_another_shape_are_tampering_not_a_crash(fresh_v2, name, text, named):
    root = fresh_v2.snapshot_dir
    os.chmod(root, 0o755)
    os.chmod(root / name, 0o644)
    (root / name).write_text(text % ("0" * 64) if "%s" in text else text)
    with pytest.raises(SnapshotError) as err:
        open_snapshot(root, use_catalog=False)
    assert err.value.code == "SNAPSHOT_TAMPERED", err.value
    result = core_verify(root)
    assert not result.ok and named in result.changed[0], result
    proc = cli_verify(root)
    assert proc.returncode == 1 and "SNAPSHOT_TAMPERED" in proc.stderr and "UNEXPECTED" not in proc.stderr, proc.stderr


def test_the_rewritten_digest_file_and_the_missing_per_file_digests_are_said_as_such(fresh_v2, tmp_path):
    root = copy_root(fresh_v2, tmp_path)
    with open(root / "arrays" / "y.f32", "r+b") as f:
        f.write(b"\0" * 64)
    rehash(root)  # consistent with itself, not with the catalog
    proc = cli_verify(root)
    assert proc.returncode == 1 and "changed: unknown: sha256.json was rewritten to match the files" in proc.stderr, proc.stderr
    recorded = json.loads((root / "sha256.json").read_text())
    (root / "sha256.json").write_text(json.dumps({"sha256": "0" * 64}))  # no per-file digests: nothing to name
    assert core_verify(root).changed == ["unknown: no per-file digests in sha256.json"]
    assert recorded["files"]


def test_expected_sha256_in_capitals_is_the_same_hash_and_other_text_is_refused(tmp_path):
    root = write_snapshot(tmp_path / "s")
    good = open_snapshot(root).sha256
    assert open_snapshot(root, expected_sha256=good.upper()).verified
    for bad in (good.encode(), good[:-1], "z" * 64):
        with pytest.raises(ValueError, match="expected_sha256 must be a sha256 as 64 hex digits"):
            open_snapshot(root, expected_sha256=bad)


def test_a_folder_that_is_no_snapshot_is_named_so_not_called_tampered(fresh_v2, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SnapshotError, match="is not a snapshot: it has none of spec.json") as err:
        open_snapshot(empty)
    assert err.value.code == "NOT_A_SNAPSHOT"
    spec_folder = fresh_v2.snapshot_dir.parent  # datasets/<spec>: holds `current`, is no snapshot
    with pytest.raises(SnapshotError, match="its current snapshot is") as err:
        open_snapshot(spec_folder)
    assert err.value.code == "NOT_A_SNAPSHOT"
    with pytest.raises(SnapshotError, match="it is a datasets root") as err:
        open_snapshot(spec_folder.parent)
    assert err.value.code == "NOT_A_SNAPSHOT"


def test_without_the_digest_file_the_catalog_still_vouches(fresh_v2):
    root = fresh_v2.snapshot_dir
    os.chmod(root, 0o755)
    (root / "sha256.json").unlink()
    assert open_snapshot(root).sha256 == fresh_v2.sha256
    assert core_verify(root, fresh_v2.sha256).ok and cli_verify(root).returncode == 0


def test_artifacts_outside_the_snapshot_are_refused(tmp_path):
    root = write_snapshot(tmp_path / "s")
    (tmp_path / "outside.json").write_text("{}")
    rewrite_manifest(root, lambda m: m["artifacts"].__setitem__("evil", "../outside.json"))
    with pytest.raises(SnapshotError, match="outside the snapshot"):
        open_snapshot(root)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["shapes"]["x"].__setitem__(0, 11), "manifest shape"),
        (lambda m: m["split"].__setitem__("train", 7), "manifest shape"),
        (lambda m: m["split"]["blocks"][0].__setitem__("uniqueSteps", 5), "do not tile the train windows"),
        (lambda m: m["norm"]["y"].__setitem__("std", [1.0, 0.0]), "norm.y"),
        (lambda m: m["norm"]["x"].__setitem__("mean", [0.0]), "norm.x"),
        (lambda m: m.pop("allNodes"), "lacks what a reader needs"),
    ],
)
def test_a_verified_manifest_that_does_not_describe_the_files_is_invalid(tmp_path, change, message):
    root = write_snapshot(tmp_path / "s")
    rewrite_manifest(root, change)
    with pytest.raises(SnapshotError, match=message) as err:
        open_snapshot(root)
    assert err.value.code == "SNAPSHOT_INVALID"


def test_a_truncated_array_is_named(tmp_path):
    root = write_snapshot(tmp_path / "s")
    x = root / "arrays" / "x.f32"
    x.write_bytes(x.read_bytes()[:-4])
    rehash(root)
    with pytest.raises(SnapshotError, match=r"arrays/x\.f32 has \d+ bytes, manifest shape"):
        open_snapshot(root)


def test_arrays_are_read_only_maps_of_the_verified_files(v2):
    snap = open_snapshot(v2.snapshot_dir)
    for key in ("x", "u", "y", "timestamps", "mask"):
        a = snap.array(key)
        assert isinstance(a, np.memmap) and a.mode == "r" and not a.flags.writeable
        dtype = "<f8" if key == "timestamps" else "<f4"
        np.testing.assert_array_equal(a, np.fromfile(v2.snapshot_dir / snap.files[key], dtype=dtype).reshape(a.shape))
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 0
    assert snap.x.shape == tuple(v2.manifest["shapes"]["x"]) and len(snap) == snap.x.shape[0]
    assert [snap.split_range(p) for p in ("train", "val", "test")] == [
        range(0, v2.manifest["split"]["train"]),
        range(v2.manifest["split"]["train"], v2.manifest["split"]["train"] + v2.manifest["split"]["val"]),
        range(len(snap) - v2.manifest["split"]["test"], len(snap)),
    ]
    runs = [b.run_id for b in snap.blocks]
    assert runs == [r for p in ("train", "val", "test") for r in v2.manifest["split"][f"{p}RunIds"]]
    assert sum(len(b) for b in snap.runs("val")) == v2.manifest["split"]["val"]


def test_the_maps_serve_the_bytes_that_were_hashed_even_if_a_file_is_swapped(fresh_v2):
    root = fresh_v2.snapshot_dir
    snap = open_snapshot(root)
    before = np.array(snap.y)
    # Replace y.f32 by another file (rename over it, as root): the open snapshot keeps the
    # verified inode; a reopen (e.g. a DataLoader worker) refuses the new file.
    os.chmod(root / "arrays", 0o755)
    other = root / "arrays" / "y.new"
    other.write_bytes(np.zeros_like(before).tobytes())
    os.replace(other, root / "arrays" / "y.f32")
    np.testing.assert_array_equal(snap.y, before)
    np.testing.assert_array_equal(snap.read_windows("y", 0, 3), before[:3])
    with pytest.raises(SnapshotError, match=r"arrays/y\.f32 is not the file that was verified"):
        snap.reopen()
    with pytest.raises(SnapshotError, match="hash mismatch"):
        open_snapshot(root)


def test_pickling_carries_no_array_data(v2):
    snap = open_snapshot(v2.snapshot_dir)
    data = pickle.dumps(snap)
    assert len(data) < 4096 < snap.x.nbytes
    again = pickle.loads(data)
    assert again.sha256 == snap.sha256 and again.verified
    np.testing.assert_array_equal(again.x, snap.x)


def test_units_norm_and_the_inverse_transform(v2):
    snap = open_snapshot(v2.snapshot_dir)
    variables = {v["nodeId"]: v for v in v2.manifest["variables"]}
    for node, var in snap.variables.items():
        assert (var.unit, var.model_unit, var.scale, var.offset) == (
            variables[node]["unit"], variables[node]["modelUnit"], variables[node]["scale"], variables[node]["offset"])
    kelvin = [n for n in snap.targets if snap.variables[n].model_unit == "K"]
    assert kelvin, "the plant's v2 spec maps degC to K"
    stored = np.asarray(snap.y[:5], dtype=np.float64)
    mean, std = (np.asarray(v2.manifest["norm"]["y"][k]) for k in ("mean", "std"))
    model = snap.to_model_units("y", snap.y[:5])
    np.testing.assert_allclose(model, stored * std + mean)
    eng = snap.to_engineering_units("y", snap.y[:5])
    for j, node in enumerate(snap.targets):
        v = variables[node]
        np.testing.assert_allclose(eng[..., j], (model[..., j] - v["offset"]) / v["scale"])
    j = snap.targets.index(kelvin[0])
    np.testing.assert_allclose(eng[..., j], model[..., j] - 273.15)
    assert snap.units("y") == [variables[n]["modelUnit"] for n in snap.targets]
    assert snap.units("y", engineering=True) == [variables[n]["unit"] for n in snap.targets]
    np.testing.assert_allclose(snap.norm["y"].normalize(model), stored, atol=1e-6)


def test_verification_streams_in_bounded_memory(tmp_path):
    """A child process whose data segment (heap and anonymous mappings: what loading arrays
    uses; file maps are not counted) may grow by only 64 MB opens and verifies a snapshot with a
    256 MB array; loading that array whole in the same process fails."""
    root = write_snapshot(tmp_path / "big", n=(50_000, 10_000, 10_000), H=64, F=4, nodes=tuple(f"N{i}" for i in range(16)),
                          controls=("N0",), targets=("N1",), sparse_x=True)
    assert (root / "arrays" / "x.f32").stat().st_size > 256 << 20
    child = textwrap.dedent(f"""
        import resource, sys
        import numpy as np
        from aml_pipeline.snapshot import open_snapshot
        def vm_data():
            for line in open("/proc/self/status"):
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
        limit = vm_data() + (64 << 20)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        snap = open_snapshot({str(root)!r})
        assert snap.verified and float(snap.x[-1].sum()) == 0.0
        try:
            np.array(snap.x)
        except MemoryError:
            print("OK", snap.sha256)
            sys.exit(0)
        sys.exit("loading x whole did not hit the limit: the test would not catch a loading reader")
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["OK", core_digest(root).sha256]


def test_the_package_imports_numpy_and_the_standard_library_only():
    code = textwrap.dedent("""
        import sys
        before = set(sys.modules)
        import aml_pipeline.snapshot
        new = {m.split(".")[0] for m in set(sys.modules) - before}
        print(sorted(new - set(sys.stdlib_module_names)))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "['aml_pipeline', 'numpy']"
