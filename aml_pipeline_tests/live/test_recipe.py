"""Live inputs: for a causal snapshot, the input at every window's origin, from the points before
the origin only, is that window's ``x`` (and ``u`` from the realised controls) bit for bit; for
another snapshot the rows that may differ are named; bad live input is one clear error."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from aml_pipeline.live import LiveInputError, LiveRecipe, live_inputs
from aml_pipeline.live.points import when
from aml_pipeline.pipeline.registry import GRID
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.live.support import before
from aml_pipeline_tests.pg_schemas import drop_schema, with_schema

CAUSAL_CASES = [
    pytest.param(dict(extras=True), id="v2"),
    pytest.param(dict(extras=False), id="v1"),
    pytest.param(dict(extras=True, aggregate="mean"), id="v2-mean"),
    pytest.param(dict(extras=False, aggregate="mean", point_nodes=("TI101", "FIC201_SP")), id="v1-mean-some-nodes-point"),
    pytest.param(dict(extras=True, layout="series"), id="v2-series"),
    pytest.param(dict(extras=False, layout="series", aggregate="mean"), id="v1-series-mean"),
]


@pytest.mark.parametrize("case", CAUSAL_CASES)
def test_every_causal_window_is_the_live_input_at_its_origin(case, built, plant, run_points) -> None:
    """From only the points before each window's origin (every point of the run so far, as arrays):
    x equals the window's bit for bit, and u from the realised controls equals its u."""
    b = built(causal=True, **case)
    assert b.snap.manifest["causal"] is True
    recipe = LiveRecipe(b.snap)
    runs = {r.run_id: r for r in plant.runs}
    horizon_ms = b.spec.horizon_steps * b.spec.beat_ms
    checked = 0
    for i, run_id, origin in b.windows():
        pts = run_points[run_id]
        realised = before(pts, origin + horizon_ms, since=origin)
        got = recipe.inputs(origin, before(pts, origin), controls=realised, run_start_ms=runs[run_id].started_at)
        assert got.x.dtype == np.float32 and got.x.shape == b.snap.x.shape[1:]
        assert got.x.tobytes() == np.asarray(b.snap.x[i]).tobytes(), (run_id, origin)
        assert got.u.tobytes() == np.asarray(b.snap.u[i]).tobytes(), (run_id, origin)
        assert not got.may_differ.any() and got.causal and not got.why
        checked += 1
    assert checked == len(b.snap) and all(b.snap.counts[p] for p in ("train", "val", "test"))


def test_every_causal_window_read_from_the_tsdb_only_as_far_back_as_needed(built, plant_url) -> None:
    """Read from the embedded TSDB: the run found by the origin, each node read from shortly before
    the history (further back only where its cleaning needs more points), realised controls after
    the origin. Every window's x and u, bit for bit."""
    b = built(causal=True, extras=True)
    recipe = LiveRecipe(b.snap)
    with open_tsdb(plant_url) as db:
        for i, run_id, origin in b.windows():
            got = recipe.inputs(origin, tsdb=db, controls="realised")
            assert got.run_id == run_id
            assert got.x.tobytes() == np.asarray(b.snap.x[i]).tobytes(), (run_id, origin)
            assert got.u.tobytes() == np.asarray(b.snap.u[i]).tobytes(), (run_id, origin)


def test_every_causal_window_read_from_postgresql(built, plant, postgres_url) -> None:
    b = built(causal=True, extras=False)
    recipe = LiveRecipe(b.snap)
    schema = f"t_{uuid.uuid4().hex[:16]}"
    url = with_schema(postgres_url, schema)
    try:
        with open_tsdb(url, read_only=False) as db:
            db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
        with open_tsdb(url) as db:
            for i, run_id, origin in b.windows():
                got = recipe.inputs(origin, tsdb=db, run_id=run_id, controls="realised")
                assert got.x.tobytes() == np.asarray(b.snap.x[i]).tobytes(), (run_id, origin)
                assert got.u.tobytes() == np.asarray(b.snap.u[i]).tobytes(), (run_id, origin)
    finally:
        drop_schema(postgres_url, schema)


@pytest.mark.parametrize("aggregate", [None, "mean"])
def test_without_causal_the_rows_that_differ_are_named_and_why(aggregate, built, plant, run_points) -> None:
    """A snapshot built without causal: the live input differs from some windows (the centred Hampel
    window and linear interpolation used points after the origin); every differing row is marked
    in may_differ with the reason, and a row that needs a point after the origin is an error that
    says so, never a NaN."""
    b = built(extras=True, **({"aggregate": aggregate} if aggregate else {}))
    assert "causal" not in b.snap.manifest and "nodeRanges" not in b.snap.manifest
    recipe = LiveRecipe(b.snap, node_ranges={n.node_id: (n.range_lo, n.range_hi) for n in plant.nodes})
    runs = {r.run_id: r for r in plant.runs}
    equal = differ = refused = 0
    for i, run_id, origin in b.windows():
        try:
            got = recipe.inputs(origin, before(run_points[run_id], origin), run_start_ms=runs[run_id].started_at)
        except LiveInputError as e:
            assert e.code == "LIVE_GAP" and "built without causal: true" in e.message and "at 20" in e.message
            refused += 1
            continue
        assert not got.causal and np.isfinite(got.x).all()
        rows = got.x != np.asarray(b.snap.x[i])
        if rows.any():
            differ += 1
            assert not (rows & ~got.may_differ).any(), (run_id, origin)
            assert all("built without causal: true" in got.why[n] for n in np.array(got.nodes)[rows.any(axis=0)])
        else:
            equal += 1
    assert equal and differ and refused


def _first_windows(b, n: int = 40):
    return [w for _, w in zip(range(n), b.windows())]


def test_points_from_just_before_the_history_suffice_when_the_cleaning_has_its_context(built, plant, run_points) -> None:
    """Without the run's start, the points must reach back to the Hampel window's context of the
    history's first row: with it, every window is equal; without it, a clear error says how far."""
    b = built(causal=True, extras=True)
    recipe = LiveRecipe(b.snap)
    refused = 0
    for i, run_id, origin in b.windows():
        pts = run_points[run_id]
        lo = min(recipe.read_range(origin, n)[0] for n in recipe.nodes)
        try:
            got = recipe.inputs(origin, before(pts, origin, since=lo - 60_000))
        except LiveInputError as e:  # only at a run's start, where 60 s before the history is before the run
            assert e.code == "LIVE_TOO_FEW_POINTS"
            assert origin - runs_start(plant, run_id) < 60_000 + recipe.history_steps * recipe.beat_ms + 30_000
            continue
        assert got.x.tobytes() == np.asarray(b.snap.x[i]).tobytes()
        with pytest.raises(LiveInputError) as e:
            recipe.inputs(origin, before(pts, origin, since=lo))
        assert e.value.code == "LIVE_TOO_FEW_POINTS"
        assert "surviving points before" in e.value.message and "node " in e.value.message
        refused += 1
    assert refused > len(b.snap) // 2


def runs_start(plant, run_id: str) -> int:
    return next(r.started_at for r in plant.runs if r.run_id == run_id)


def test_a_table_a_dataframe_and_point_columns_give_the_same_input(built, plant, run_points) -> None:
    import pandas as pd
    import pyarrow as pa

    from aml_pipeline.tsdb.port import PointColumns

    b = built(causal=True, extras=True)
    recipe = LiveRecipe(b.snap)
    p = plant.points
    for i, run_id, origin in _first_windows(b, 5):
        start = runs_start(plant, run_id)
        want = recipe.inputs(origin, before(run_points[run_id], origin), run_start_ms=start).x
        rows = (p.run_id == run_id) & (p.ts < origin)
        cols = PointColumns(p.run_id[rows], p.node_id[rows], p.ts[rows], p.value[rows], p.state[rows])
        frame = pd.DataFrame({"node_id": cols.node_id, "ts": pd.to_datetime(cols.ts, unit="ms"), "value": cols.value,
                              "state": cols.state})
        table = pa.table({"node_id": cols.node_id.astype(str), "ts": cols.ts, "value": cols.value, "state": cols.state})
        mapping = {n: {"ts": cols.ts[cols.node_id == n], "value": cols.value[cols.node_id == n],
                       "state": cols.state[cols.node_id == n]} for n in recipe.nodes}
        for form in (cols, frame, table, mapping):
            assert recipe.inputs(origin, form, run_start_ms=start).x.tobytes() == want.tobytes(), type(form)
        assert live_inputs(b.snap, origin, frame, run_start_ms=start).x.tobytes() == want.tobytes()


def test_planned_controls_as_values_and_predictions_back_in_source_units(built, plant, run_points) -> None:
    """u from the planned values on the future grid times (source units) equals the window's u when
    they are the realised grid values; a prediction shaped like y goes back to source units."""
    from aml_pipeline.pipeline.stages.grid import read_grid_rows

    b = built(causal=True, extras=True)
    assert any(v.offset for v in b.snap.variables.values())  # degC -> K: a real unit transform
    recipe = LiveRecipe(b.snap)
    nodes, beat, F = list(recipe.nodes), recipe.beat_ms, recipe.horizon_steps
    for i, run_id, origin in _first_windows(b, 30):
        meta = b.store.read_meta(run_id, GRID)
        row = (origin - meta["firstMs"]) // beat
        grid = read_grid_rows(b.store, run_id, len(nodes), meta["rows"], row, row + F)  # source units
        planned = grid[:, [nodes.index(c) for c in recipe.controls]]
        got = recipe.inputs(origin, before(run_points[run_id], origin), controls=planned,
                            run_start_ms=runs_start(plant, run_id))
        assert got.u.tobytes() == np.asarray(b.snap.u[i]).tobytes()
        back = recipe.to_source_units(np.asarray(b.snap.y[i]))
        want = grid[:, [nodes.index(t) for t in recipe.targets]]
        np.testing.assert_allclose(back, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(LiveInputError, match=r"\[F, controls\] = \[10, 2\]"):
        recipe.inputs(origin, before(run_points[run_id], origin), controls=planned[:5], run_start_ms=runs_start(plant, run_id))
    planned[3, 1] = np.nan
    with pytest.raises(LiveInputError, match=f"node {recipe.controls[1]} at .*the planned control is nan") as e:
        recipe.inputs(origin, before(run_points[run_id], origin), controls=planned, run_start_ms=runs_start(plant, run_id))
    assert e.value.code == "LIVE_GAP"


def test_bad_live_input_is_one_clear_error_naming_the_node_and_the_time(built, plant, run_points) -> None:
    b = built(causal=True, extras=True)
    recipe = LiveRecipe(b.snap)
    i, run_id, origin = next(w for w in b.windows() if w[2] - runs_start(plant, w[1]) > 90_000)
    start = runs_start(plant, run_id)
    pts = before(run_points[run_id], origin)
    assert recipe.inputs(origin, pts, run_start_ms=start).x.tobytes() == np.asarray(b.snap.x[i]).tobytes()

    def error(points, at=origin, **kw) -> LiveInputError:
        with pytest.raises(LiveInputError) as e:
            recipe.inputs(at, points, run_start_ms=start, **kw)
        assert "\n" not in e.value.one_line()
        return e.value

    e = error({n: p for n, p in pts.items() if n != "AI910"})
    assert e.code == "LIVE_NODE_MISSING" and "node AI910" in e.message
    # A hole of 20 s in TI101 five rows before the origin: a gap longer than maxInterpMs.
    hole = dict(pts)
    ts, value, state = hole["TI101"]
    keep = (ts < origin - 25_000) | (ts >= origin - 5_000)
    hole["TI101"] = (ts[keep], value[keep], state[keep])
    e = error(hole)
    assert e.code == "LIVE_GAP" and e.message.startswith("node TI101 at 20") and "more than maxInterpMs 5000 ms" in e.message
    at = int(e.message.split("(", 1)[1].split(")", 1)[0])  # the row's epoch ms: inside the hole
    assert origin - 25_000 < at < origin - 5_000
    e = error(pts, at=origin + 500)
    assert e.code == "LIVE_ORIGIN_INVALID" and "not a grid time" in e.message
    e = error(pts, at=start + 3_000)
    assert e.code == "LIVE_TOO_FEW_POINTS" and "historySteps" in e.message
    e = error({"TI101": [1, 2, 3]})
    assert e.code == "LIVE_INPUT_INVALID" and "node TI101" in e.message
    e = error({n: (p[0].astype(float), p[1]) for n, p in pts.items()})
    assert e.code == "LIVE_INPUT_INVALID" and "integer epoch milliseconds" in e.message
    e = error(pts, controls="realised")
    assert e.code == "LIVE_INPUT_INVALID" and "tsdb" in e.message
    # Points in seconds: named as such, not "no points before the origin" for points of 1970.
    e = error({n: (p[0] // 1000, p[1], p[2]) for n, p in pts.items()})
    assert e.code == "LIVE_INPUT_INVALID" and "ts at row 0" in e.message and "looks like epoch seconds" in e.message, e.message
    e = error({**pts, "TI101": (pts["TI101"][0], ["bad"] * pts["TI101"][0].size, pts["TI101"][2])})
    assert e.code == "LIVE_INPUT_INVALID" and "TI101" in e.message and "value must be numbers" in e.message, e.message
    # Planned controls without a point after the origin: the plan is named, not a gap in the history.
    for planned in ({}, before(run_points[run_id], origin)):
        e = error(pts, controls=planned)
        assert e.code == "LIVE_INPUT_INVALID" and "missing from the history" not in e.message, e.message
        assert e.message.startswith(f"the planned controls hold no point after the origin {when(origin)}, and without one "
                                    "node "), e.message
        assert e.message.split(" node ", 1)[1].split(" ", 1)[0] in recipe.controls and "has no value at 20" in e.message
    # Planned points that stop a beat after the origin: the gap is in the plan, and named so.
    plan = {n: p for n, p in before(run_points[run_id], origin + recipe.beat_ms + 1, since=origin).items()
            if n in recipe.controls}
    plan = {n: p for n, p in plan.items() if p[0].size}
    assert plan  # at least one control has a point after the origin
    e = error(pts, controls={**{n: before(run_points[run_id], origin, since=origin)[n] for n in recipe.controls}, **plan})
    assert e.code == "LIVE_GAP" and "missing from the planned controls" in e.message, e.message


def test_a_node_s_catalog_range_comes_from_the_snapshot_the_tsdb_or_the_caller(built, plant, plant_url, run_points) -> None:
    """A causal snapshot records the ranges its cleaning used; another one does not, so the live
    path asks the TSDB's node catalog or the caller, and without either names the node."""
    b = built(extras=False)
    ranges = {n.node_id: (n.range_lo, n.range_hi) for n in plant.nodes}
    compared = 0
    with open_tsdb(plant_url) as db:
        for i, run_id, origin in b.windows():
            if compared == 5:
                break
            pts = before(run_points[run_id], origin)
            start = runs_start(plant, run_id)
            with pytest.raises(LiveInputError) as e:
                LiveRecipe(b.snap).inputs(origin, pts, run_start_ms=start)
            assert e.value.code == "LIVE_RANGE_UNKNOWN" and "node TI101" in e.value.message
            try:
                given = LiveRecipe(b.snap, node_ranges=ranges).inputs(origin, pts, run_start_ms=start)
            except LiveInputError as gap:  # without causal, some origins need points after them
                assert gap.code == "LIVE_GAP"
                continue
            read = LiveRecipe(b.snap).inputs(origin, tsdb=db, run_id=run_id)
            assert given.x.tobytes() == read.x.tobytes()
            compared += 1
    assert compared
    assert b.snap.manifest.get("nodeRanges") is None
    assert built(causal=True, extras=False).snap.manifest["nodeRanges"]["TI101"] == list(ranges["TI101"])


def test_the_worked_example_serves_the_ridge_baseline_as_it_predicts_the_windows(built, plant_url) -> None:
    """docs/consumers.md's worked example, run as written: at a window's origin with its realised
    controls, the served forecast is the baseline's prediction for that window, in source units."""
    import re
    from pathlib import Path

    from aml_pipeline.pipeline.registry import GRID
    from aml_pipeline.pipeline.stages.grid import read_grid_rows
    from aml_pipeline.training import ridge_baseline

    doc = (Path(__file__).resolve().parents[2] / "docs" / "consumers.md").read_text(encoding="utf-8")
    section = doc.split("### A worked example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the documentation's own example, under test
    b = built(causal=True, extras=True)
    forecast = scope["serve"](str(b.snap.root), plant_url)
    fit = ridge_baseline.train_and_evaluate(b.snap)
    nodes, beat, F = b.snap.nodes, b.spec.beat_ms, b.spec.horizon_steps
    for i, run_id, origin in list(b.windows())[::97]:
        meta = b.store.read_meta(run_id, GRID)
        row = (origin - meta["firstMs"]) // beat
        realised = read_grid_rows(b.store, run_id, len(nodes), meta["rows"], row, row + F)[:, [nodes.index(c) for c in b.snap.controls]]
        X, _ = ridge_baseline.design(b.snap, {k: np.asarray(b.snap.array(k)[i : i + 1]) for k in ("x", "u", "y")})
        want = ((X[0] - fit["x_mean"]) @ fit["coef"] + fit["y_mean"]).reshape(F, len(b.snap.targets))
        np.testing.assert_allclose(forecast(origin, realised), b.snap.to_engineering_units("y", want), rtol=1e-12)
