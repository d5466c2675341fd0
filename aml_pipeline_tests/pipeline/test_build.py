"""End-to-end library build on a real DuckDB file: every artifact checked from its bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from aml_pipeline.core.hashing import digest_snapshot, hashed_files
from aml_pipeline.core.normalize import apply_norm
from aml_pipeline.errors import BuildError, UnitContractError, UnknownNodeError
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.publish import Catalog, current_snapshot
from aml_pipeline.pipeline.registry import GRID, WINDOWS
from aml_pipeline.pipeline.stages.windows import RunWindows, unit_columns
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.spec import parse_spec
from aml_pipeline.tsdb_open import open_tsdb


def build(spec, url, roots):
    with open_tsdb(url) as db:
        return build_dataset(spec, db, **roots)


def read_array(snapshot: Path, name: str, shape) -> np.ndarray:
    dtype = "<f8" if name.endswith(".f64") else "<f4"
    return np.fromfile(snapshot / name, dtype=dtype).reshape(shape)


def test_v1_snapshot_contents(make_spec, plant, plant_url, roots):
    spec = make_spec()
    out = build(spec, plant_url, roots)
    snap = out.snapshot_dir
    m = json.loads((snap / "manifest.json").read_bytes())

    assert m["version"] == 1 and m["lineageVerified"] == 0
    assert m["allNodes"] == spec.node_ids and m["controls"] == spec.control_ids and m["targets"] == spec.target_ids
    assert (m["historySteps"], m["horizonSteps"], m["beatMs"]) == (20, 10, 1000)
    assert json.loads((snap / "spec.json").read_bytes()) == m["spec"] == spec.to_json_dict()
    assert not (snap / "arrays" / "timestamps.f64").exists()
    n = m["split"]["train"] + m["split"]["val"] + m["split"]["test"]
    assert m["shapes"] == {"x": [n, 20, 6], "u": [n, 10, 2], "y": [n, 10, 2]}
    for key in ("x", "u", "y"):
        assert (snap / f"arrays/{key}.f32").stat().st_size == 4 * int(np.prod(m["shapes"][key]))

    # Split by run: finished runs only, every run in exactly one split, blocks one per run.
    finished = [r.run_id for r in plant.runs if r.ended_at is not None]
    s = m["split"]
    in_splits = s["trainRunIds"] + s["valRunIds"] + s["testRunIds"]
    assert sorted(in_splits + [e["runId"] for e in s["excluded"]]) == sorted(finished)
    assert len(set(in_splits)) == len(in_splits)
    started = {r.run_id: r.started_at for r in plant.runs}
    assert [started[r] for r in in_splits] == sorted(started[r] for r in in_splits)  # chronological
    assert [b["runId"] for b in s["blocks"]] == in_splits
    assert all(b["blockId"] == f"{b['runId']}#0" and b["purgeBeforeSteps"] == 0 for b in s["blocks"])
    assert sum(b["uniqueSteps"] for b in s["blocks"]) == n

    # Arrays are the stored model-unit grids, windowed and normalised with train stats.
    store = DatasetStore(roots["store_root"], spec)
    x = read_array(snap, "arrays/x.f32", m["shapes"]["x"])
    y = read_array(snap, "arrays/y.f32", m["shapes"]["y"])
    u = read_array(snap, "arrays/u.f32", m["shapes"]["u"])
    row = 0
    ctrl = [spec.node_ids.index(c) for c in spec.control_ids]
    tgt = [spec.node_ids.index(t) for t in spec.target_ids]
    for run_id in in_splits:
        # The model-unit grid: the cleaned grid (stored node-major), each unit transform applied.
        a = {"starts": np.load(store.array_path(run_id, WINDOWS, "starts")),
             "grid": np.load(store.array_path(run_id, GRID, "values")).T.copy()}
        for j, scale, offset in unit_columns(spec):
            a["grid"][:, j] = a["grid"][:, j] * scale + offset
        for t in a["starts"][[0, -1]]:
            i = row if t == a["starts"][0] else row + len(a["starts"]) - 1
            want_x = apply_norm(a["grid"][t - 20 : t], np.array(m["norm"]["x"]["mean"]), np.array(m["norm"]["x"]["std"]))
            want_u = apply_norm(a["grid"][t : t + 10][:, ctrl], np.array(m["norm"]["u"]["mean"]), np.array(m["norm"]["u"]["std"]))
            want_y = apply_norm(a["grid"][t : t + 10][:, tgt], np.array(m["norm"]["y"]["mean"]), np.array(m["norm"]["y"]["std"]))
            np.testing.assert_array_equal(x[i], want_x)
            np.testing.assert_array_equal(u[i], want_u)
            np.testing.assert_array_equal(y[i], want_y)
        row += len(a["starts"])
    assert row == n

    # Train windows are normalised to mean 0 / std 1 (the stats came from train only).
    n_train = s["train"]
    assert np.abs(x[:n_train].reshape(-1, 6).mean(0)).max() < 1e-3
    np.testing.assert_allclose(x[:n_train].reshape(-1, 6).std(0), 1.0, rtol=1e-3)
    assert np.abs(y[n_train:].reshape(-1, 2).mean(0)).max() > 1e-3  # val/test are not forced to 0

    # Hash: recomputed from the files matches the digest file and the catalog.
    digest = digest_snapshot(snap)
    assert digest.sha256 == out.sha256 == json.loads((snap / "sha256.json").read_bytes())["sha256"]
    assert current_snapshot(roots["datasets_root"], spec.id) == snap
    [entry] = Catalog(roots["datasets_root"]).entries(spec.id)
    assert entry.sha256 == out.sha256 and entry.current

    report = json.loads((snap / "report.json").read_bytes())
    totals = report["cleaning"]["totals"]
    assert totals["input"] == totals["kept"] + sum(totals[c] for c in ("non_finite", "bad_state", "out_of_range", "duplicate_ts", "hampel_outlier"))
    assert totals["hampel_outlier"] > 0 and totals["bad_state"] > 0 and totals["duplicate_ts"] > 0
    assert {(r["control"], r["target"]) for r in report["lagCrossCorrelation"]} == {
        (c, t) for c in spec.control_ids for t in spec.target_ids
    }


def test_v2_snapshot_adds_artifacts_units_and_lineage(make_spec, plant, plant_url, roots):
    spec = make_spec(extras=True)
    out = build(spec, plant_url, roots)
    snap, m = out.snapshot_dir, out.manifest
    assert m["version"] == 2
    assert set(m["artifacts"]) == {"x", "u", "y", "timestamps", "mask", "sidecar"}
    assert hashed_files(m)[-3:] == ["arrays/timestamps.f64", "arrays/mask.f32", "arrays/sidecar.json"]
    n = m["shapes"]["x"][0]
    ts = read_array(snap, "arrays/timestamps.f64", (n, 30))
    mask = read_array(snap, "arrays/mask.f32", (n, 30))
    assert (mask == 1).all()
    assert (np.diff(ts, axis=1) == 1000).all()  # consecutive grid rows, beat 1 s
    # Windows ascend in time within each run.
    first = ts[:, 0]
    for b_start, b in zip(np.cumsum([0] + [b["uniqueSteps"] for b in m["split"]["blocks"]])[:-1], m["split"]["blocks"]):
        seg = first[b_start : b_start + b["uniqueSteps"]]
        assert (np.diff(seg) > 0).all()

    # Unit contract: TI101 in K = degC + 273.15, so its normalisation mean is in K.
    ti = spec.node_ids.index("TI101")
    assert 273.15 < m["norm"]["x"]["mean"][ti] < 273.15 + 150

    # Lineage: the plant's unconfirmed run is "unknown", so the dataset is not lineage-verified.
    unconfirmed = [r.run_id for r in plant.runs if not r.context_confirmed and r.ended_at is not None]
    lin = m["provenance"]["runLineage"]
    assert lin["unknown"] == unconfirmed and lin["excluded"] == []
    assert m["lineageVerified"] == 0 == m["provenance"]["lineageVerified"]
    assert sorted(m["provenance"]["runIds"]) == sorted(m["split"]["trainRunIds"] + m["split"]["valRunIds"] + m["split"]["testRunIds"])
    sidecar = json.loads((snap / "arrays/sidecar.json").read_bytes())
    assert sidecar["splitRunIds"]["train"] == m["split"]["trainRunIds"]
    assert [u["id"] for u in sidecar["units"]] == sidecar["variableOrder"]


def test_lineage_mismatch_excludes_runs_with_reason(make_spec, plant, plant_url, roots):
    spec = make_spec(extras=True)
    extras = spec.extras.model_dump(by_alias=True)
    extras["recipeVersion"] = 99
    out = build(parse_spec({**spec.to_json_dict(), "extras": extras}), plant_url, roots)
    m = out.manifest
    finished = [r for r in plant.runs if r.ended_at is not None]
    confirmed = [r.run_id for r in finished if r.context_confirmed]
    unknown = [r.run_id for r in finished if not r.context_confirmed]
    excluded = {e["runId"]: e["reason"] for e in m["split"]["excluded"]}
    assert sorted(excluded) == sorted(confirmed)
    assert all("recipe version 3 != spec's 99" in why for why in excluded.values())
    # Only the run without a confirmed context remains (it cannot be shown to contradict).
    assert m["split"]["trainRunIds"] + m["split"]["valRunIds"] + m["split"]["testRunIds"] == unknown
    assert m["provenance"]["runLineage"]["unknown"] == unknown
    assert m["lineageVerified"] == 0


def test_lineage_verified_when_every_run_matches(make_spec, plant, plant_url, roots):
    confirmed_before = make_spec(extras=True, fromMs=plant.runs[3].started_at)
    out = build(confirmed_before, plant_url, roots)
    lin = out.manifest["provenance"]["runLineage"]
    # The window starts after the unconfirmed run, so every remaining run is verified.
    assert lin["unknown"] == [] and lin["excluded"] == [] and lin["verified"]
    assert out.manifest["lineageVerified"] == 1


def test_same_data_and_spec_give_byte_identical_snapshots(make_spec, plant_url, tmp_path):
    spec = make_spec()
    a = build(spec, plant_url, {"store_root": tmp_path / "s1", "datasets_root": tmp_path / "d1"})
    b = build(spec, plant_url, {"store_root": tmp_path / "s2", "datasets_root": tmp_path / "d2"})
    for name in hashed_files(a.manifest):
        assert (a.snapshot_dir / name).read_bytes() == (b.snapshot_dir / name).read_bytes(), name
    assert a.sha256 == b.sha256  # v1 carries no build time: the whole snapshot is reproducible


def test_no_controls_gives_u_with_zero_columns(make_spec, plant, plant_url, roots):
    spec = make_spec()
    nodes = [n.model_dump(by_alias=True) for n in spec.nodes if n.role != "control"]
    out = build(parse_spec({**spec.to_json_dict(), "nodes": nodes}), plant_url, roots)
    assert out.manifest["shapes"]["u"][2] == 0
    assert (out.snapshot_dir / "arrays/u.f32").stat().st_size == 0
    assert out.manifest["norm"]["u"] == {"mean": [], "std": [], "zeroStd": []}


def test_zero_std_column_is_flagged_not_divided_by_zero(tmp_path, roots):
    import numpy as np

    from aml_pipeline.tsdb.port import Node, PointColumns, Run

    # Two runs, 1 Hz: a constant feature, a ramp target, a stepping control.
    runs, cols = [], {k: [] for k in ("run_id", "node_id", "ts", "value", "state")}
    for r in range(2):
        t0 = 1_000_000 * (r + 1)
        runs.append(Run(f"R{r}", "L", "P", "C", 1, "h", t0, t0 + 99_000, "simulation", True))
        ts = t0 + 1000 * np.arange(100)
        for node, values in (("K1", np.full(100, 5.0)), ("T1", np.arange(100.0) * (r + 1)), ("U1", (np.arange(100) // 10) * 1.0)):
            cols["run_id"] += [f"R{r}"] * 100
            cols["node_id"] += [node] * 100
            cols["ts"].append(ts)
            cols["value"].append(values)
            cols["state"].append(np.zeros(100, np.int32))
    points = PointColumns(
        np.array(cols["run_id"], object), np.array(cols["node_id"], object), np.concatenate(cols["ts"]),
        np.concatenate(cols["value"]), np.concatenate(cols["state"]),
    )
    url = f"duckdb://{tmp_path / 'const.duckdb'}"
    with open_tsdb(url, read_only=False) as db:
        db.ingest(runs=runs, nodes=[Node("K1"), Node("T1"), Node("U1")], points=points)
    spec = parse_spec({
        "id": "const_ds", "lineId": "L", "productId": "P", "recipeId": "C", "historySteps": 5, "horizonSteps": 3,
        "nodes": [{"nodeId": "T1", "role": "target"}, {"nodeId": "U1", "role": "control", "interp": "hold", "hampelK": 0},
                  {"nodeId": "K1", "role": "feature"}],
        "split": {"train": 0.5, "val": 0.5, "test": 0.0},
    })
    out = build(spec, url, roots)
    norm = out.manifest["norm"]
    assert norm["x"]["zeroStd"] == ["K1"] and norm["x"]["std"][2] == 1.0 and norm["x"]["mean"][2] == 5.0
    x = np.fromfile(out.snapshot_dir / "arrays/x.f32", "<f4").reshape(out.manifest["shapes"]["x"])
    assert np.isfinite(x).all() and (x[:, :, 2] == 0).all()
    assert out.manifest["split"]["trainRunIds"] == ["R0"] and out.manifest["split"]["valRunIds"] == ["R1"]
    # Exact values: the train run's target ramp 0..99 over windows starting at 5..97.
    t_mean = norm["y"]["mean"][0]
    assert t_mean == pytest.approx(np.mean([np.arange(t, t + 3) for t in range(5, 98)]))


def test_no_windows_fails_and_publishes_nothing(make_spec, plant_url, roots):
    spec = make_spec(historySteps=100_000)
    with pytest.raises(BuildError) as e:
        build(spec, plant_url, roots)
    assert e.value.code == "NO_WINDOWS"
    assert "fewer than historySteps + horizonSteps" in str(e.value)
    assert not any((roots["datasets_root"] / spec.id).glob("*")) if (roots["datasets_root"] / spec.id).exists() else True


def test_unknown_node_fails_naming_it(make_spec, plant_url, roots):
    spec = make_spec()
    nodes = [n.model_dump(by_alias=True) for n in spec.nodes] + [{"nodeId": "NOPE42", "role": "feature"}]
    with pytest.raises(UnknownNodeError, match="NOPE42"):
        build(parse_spec({**spec.to_json_dict(), "nodes": nodes}), plant_url, roots)
    assert not roots["datasets_root"].exists()


def test_invalid_unit_contract_fails_closed(make_spec):
    spec = make_spec(extras=True)
    extras = spec.extras.model_dump(by_alias=True)
    extras["variables"][0]["scale"] = 0
    with pytest.raises(UnitContractError, match="scale"):
        parse_spec({**spec.to_json_dict(), "extras": extras})
    del extras["variables"][0]["scale"]
    with pytest.raises(UnitContractError):
        parse_spec({**spec.to_json_dict(), "extras": extras})


def test_hashed_split_keeps_assignments_when_runs_are_added(make_spec, plant, plant_url, tmp_path):
    split = {"method": "hashed", "train": 0.5, "val": 0.25, "test": 0.25, "seed": 3}
    cut = plant.runs[5].started_at
    early = make_spec(split=split, toMs=cut - 1)
    full = make_spec(split=split)
    a = build(early, plant_url, {"store_root": tmp_path / "s1", "datasets_root": tmp_path / "d1"}).manifest["split"]
    b = build(full, plant_url, {"store_root": tmp_path / "s2", "datasets_root": tmp_path / "d2"}).manifest["split"]
    for part in ("train", "val", "test"):
        assert set(a[f"{part}RunIds"]) <= set(b[f"{part}RunIds"])


def test_windows_read_no_rows_of_a_grid_rebuilt_after_them(make_spec, plant_url, roots):
    """The windows stage stores its starts alone and reads the rows they index from the grid
    stage: a grid rebuilt from other points after the windows (the run's windows not rebuilt
    yet) is refused, not read as the rows the starts were found on."""
    spec = make_spec()
    build(spec, plant_url, roots)
    store = DatasetStore(roots["store_root"], spec)
    run_id = sorted(p.name for p in (store.dir / "runs").iterdir())[0]
    meta = store.read_meta(run_id, WINDOWS)
    assert RunWindows(store, run_id, meta).grid_rows(0, 3).shape == (3, len(spec.nodes))
    grid_json = store.meta_path(run_id, GRID)
    grid_json.write_text(json.dumps({**store.read_meta(run_id, GRID), "dataVersion": "another"}))
    with pytest.raises(BuildError, match="another version of its cleaned grid"):
        RunWindows(store, run_id, meta)
