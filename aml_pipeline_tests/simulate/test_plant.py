"""The simulated plant: reproducible, and it really has the artifacts the pipeline must handle."""

from __future__ import annotations


import numpy as np
import pytest

from aml_pipeline.ids import check_external_id
from aml_pipeline.simulate.plant import (
    SENTINEL,
    first_order,
    plant_spec_dict,
    plant_tables,
    simulate_plant,
    write_plant_files,
)
from aml_pipeline.spec import parse_spec


@pytest.fixture(scope="module")
def plant():
    return simulate_plant()


def series(plant, run_id, node_id):
    p = plant.points
    m = (p.run_id == run_id) & (p.node_id == node_id)
    return p.ts[m], p.value[m], p.state[m], np.flatnonzero(m)


def test_same_seed_same_plant_other_seed_other_plant(plant):
    again = simulate_plant()
    for name in ("run_id", "node_id", "ts", "state"):
        assert np.array_equal(getattr(plant.points, name), getattr(again.points, name))
    np.testing.assert_array_equal(plant.points.value, again.points.value)
    assert plant.runs == again.runs and plant.nodes == again.nodes
    assert plant.dropouts == again.dropouts

    other = simulate_plant(seed=1)
    assert other.nodes == plant.nodes  # same plant structure...
    assert len(other.points) != len(plant.points) or not np.array_equal(other.points.ts, plant.points.ts)
    a = plant.points.value[np.isfinite(plant.points.value)][:1000]
    b = other.points.value[np.isfinite(other.points.value)][:1000]
    assert not np.allclose(a, b)  # ...different runs


def test_runs(plant):
    assert len(plant.runs) == 12
    unfinished = [r for r in plant.runs if r.ended_at is None]
    assert unfinished == [plant.runs[-1]]
    starts = [r.started_at for r in plant.runs]
    assert starts == sorted(starts) and len(set(starts)) == 12
    for a, b in zip(plant.runs, plant.runs[1:]):
        assert a.ended_at is not None and a.ended_at < b.started_at
    assert all(r.evidence_source == "simulation" for r in plant.runs)
    assert all(r.recipe_version == 3 and len(r.recipe_content_hash) == 64 for r in plant.runs)
    assert sum(not r.context_confirmed for r in plant.runs) == 1
    for r in plant.runs:
        check_external_id(r.run_id, what="run_id")
        ts = plant.points.ts[plant.points.run_id == r.run_id]
        assert ts.min() >= r.started_at
        assert ts.max() <= (r.ended_at if r.ended_at is not None else r.started_at + 20 * 60_000)
    # the unfinished run has data for part of its nominal length only
    last = plant.points.ts[plant.points.run_id == plant.runs[-1].run_id]
    assert last.max() - plant.runs[-1].started_at < 15 * 60_000


def test_nodes_roles_units_ranges(plant):
    ids = [n.node_id for n in plant.nodes]
    assert ids == ["FIC200_SP", "FIC201_SP", "TI101", "QI301", "TI900", "AI910"]
    assert plant.control_ids == ["FIC200_SP", "FIC201_SP"]
    assert plant.target_ids == ["TI101", "QI301"]
    assert plant.feature_ids == ["TI900", "AI910"]
    for n in plant.nodes:
        check_external_id(n.node_id, what="node_id")
        assert n.unit and n.range_lo < n.range_hi
    # every recorded good, non-sentinel value lies inside its node's range
    p = plant.points
    for n in plant.nodes:
        m = (p.node_id == n.node_id) & np.isfinite(p.value) & (p.value != SENTINEL)
        assert p.value[m].min() >= n.range_lo and p.value[m].max() <= n.range_hi


def test_different_sampling_rates_and_jitter(plant):
    run = plant.runs[0].run_id
    medians = {}
    for n in plant.nodes:
        ts, _, _, _ = series(plant, run, n.node_id)
        ts = np.unique(ts)
        medians[n.node_id] = float(np.median(np.diff(ts)))
    assert abs(medians["FIC200_SP"] - 1000) < 50
    assert abs(medians["TI101"] - 1000) < 50
    assert abs(medians["QI301"] - 2000) < 100
    assert abs(medians["TI900"] - 2000) < 100
    assert abs(medians["AI910"] - 500) < 50
    assert plant.logging["FIC201_SP"] == "on_change"
    # jitter: timestamps are not on the nominal grid, deviations stay within +-200 ms
    ts, _, _, _ = series(plant, run, "TI101")
    ts = np.unique(ts)
    d = np.diff(ts)
    d = d[d < 1500]  # ignore dropouts
    assert d.std() > 20 and d.min() >= 1000 - 400 and d.max() <= 1000 + 400
    assert len(set((ts % 1000).tolist())) > 50


def test_on_change_control_is_logged_on_change_plus_heartbeat(plant):
    ts, v, _, _ = series(plant, plant.runs[0].run_id, "FIC201_SP")
    gaps = np.diff(ts)
    assert gaps.max() <= 10_000 + 400
    assert len(ts) < 0.2 * 20 * 60  # far fewer than at 1 Hz
    changes = np.flatnonzero(np.diff(v) != 0)
    assert len(changes) >= 1
    fic200 = series(plant, plant.runs[0].run_id, "FIC200_SP")[1]
    assert np.all(np.round(fic200 * 2) == fic200 * 2)  # quantised setpoints


def test_spikes_are_present_and_stand_out(plant):
    p, spike = plant.points, plant.labels["spike"]
    assert spike.sum() >= 20
    assert set(np.unique(p.node_id[spike])) <= set(plant.target_ids + plant.feature_ids)
    # each spike deviates strongly from its neighbours' median (what Hampel sees)
    for i in np.flatnonzero(spike)[:30]:
        ts, v, st, idx = series(plant, p.run_id[i], p.node_id[i])
        k = int(np.searchsorted(idx, i))
        window = np.delete(v[max(0, k - 5) : k + 6], min(k, 5))
        good = window[np.isfinite(window)]
        dev = abs(v[k] - np.median(good))
        mad = np.median(np.abs(good - np.median(good))) * 1.4826
        assert dev > 3 * max(mad, 1e-9)


def test_bad_states_and_non_finite_values(plant):
    p = plant.points
    bad = p.state != 0
    assert bad.sum() >= 20
    assert np.array_equal(bad, plant.labels["bad_state"])
    assert set(np.unique(p.state[bad])) == {1, 2}
    nan = ~np.isfinite(p.value)
    assert nan.sum() >= 1 and np.all(p.state[nan] == 2)
    oor = plant.labels["out_of_range"]
    assert oor.sum() >= 1 and np.all(p.value[oor] == SENTINEL) and np.all(p.state[oor] == 0)


def test_short_and_long_dropouts(plant):
    short = [d for d in plant.dropouts if d.gap_ms < 5000]
    long = [d for d in plant.dropouts if d.gap_ms > 5000]
    assert len(short) >= 5 and len(long) >= 5
    assert all(2500 <= d.gap_ms for d in short)
    assert max(d.gap_ms for d in long) > 20_000
    # the gaps are really in the data, and nothing else records a gap over 5 s on those nodes
    for d in plant.dropouts:
        ts = np.unique(series(plant, d.run_id, d.node_id)[0])
        k = int(np.searchsorted(ts, d.before_ts))
        assert ts[k] == d.before_ts and ts[k + 1] == d.after_ts
    measured = plant.target_ids + plant.feature_ids
    long_in_data = 0
    for r in plant.runs:
        for n in measured:
            ts = np.unique(series(plant, r.run_id, n)[0])
            long_in_data += int(np.sum(np.diff(ts) > 5000))
    assert long_in_data == len(long)


def test_duplicates_are_resent_right_after_the_original(plant):
    p, dup = plant.points, plant.labels["duplicate"]
    assert dup.sum() >= 5
    idx = np.flatnonzero(dup)
    assert np.all(p.ts[idx] == p.ts[idx - 1])
    assert np.all(p.node_id[idx] == p.node_id[idx - 1]) and np.all(p.run_id[idx] == p.run_id[idx - 1])
    assert not np.any(dup[idx - 1])
    same = p.value[idx] == p.value[idx - 1]
    assert same.any() and (~same).any()  # exact resends and corrected values
    # no other repeated (run, node, ts)
    key = np.char.add(np.char.add(p.run_id.astype(str), "|" + p.node_id.astype(str) + "|"), p.ts.astype(str))
    _, counts = np.unique(key, return_counts=True)
    assert (counts > 1).sum() == dup.sum()


def test_file_order_is_by_run_then_time(plant):
    p = plant.points
    run_index = {r.run_id: i for i, r in enumerate(plant.runs)}
    ri = np.array([run_index[r] for r in p.run_id])
    assert np.all(np.diff(ri) >= 0)
    same_run = np.diff(ri) == 0
    assert np.all(np.diff(p.ts)[same_run] >= 0)


def test_spec_dict_matches_the_plant_and_validates(plant):
    spec = parse_spec(plant_spec_dict(plant), source="plant")
    assert spec.id == "reactor_a" and spec.line_id == "L1" and spec.recipe_id == "R7"
    assert spec.node_ids == ["TI101", "QI301", "FIC200_SP", "FIC201_SP", "TI900", "AI910"]
    assert spec.control_ids == ["FIC200_SP", "FIC201_SP"] and spec.target_ids == ["TI101", "QI301"]
    nodes = {n.node_id: n for n in spec.nodes}
    assert nodes["FIC200_SP"].interp == "hold" and nodes["FIC200_SP"].hampel_k == 0
    assert nodes["FIC200_SP"].range == (0.0, 50.0)
    assert nodes["FIC201_SP"].max_interp_ms > 10_000  # logged on change with a 10 s heartbeat
    assert spec.manifest_version == 1
    v2 = parse_spec(plant_spec_dict(plant, "reactor_b", extras=True, history_steps=30, horizon_steps=10))
    assert v2.manifest_version == 2 and v2.history_steps == 30
    assert v2.extras.recipe_version == 3 and v2.extras.recipe_content_hash == plant.runs[0].recipe_content_hash
    transforms = v2.unit_transforms()
    assert transforms["TI101"].offset == 273.15 and transforms["QI301"].offset == 0.0


def test_write_plant_files(tmp_path, plant):
    for fmt in ("csv", "parquet"):
        paths = write_plant_files(plant, tmp_path / fmt, fmt=fmt)
        assert set(paths) == {"points", "runs", "nodes"}
        assert all(p.is_file() and p.suffix == f".{fmt}" for p in paths.values())
    assert plant_tables(plant)["points"].num_rows == len(plant.points)
    with pytest.raises(ValueError):
        write_plant_files(plant, tmp_path, fmt="xlsx")


def test_ideal_plant_has_no_artifacts():
    p = simulate_plant(
        n_runs=2, run_minutes=5, noise=False, jitter_ms=(0, 0), spike_rate=0, bad_state_rate=0,
        out_of_range_rate=0, duplicate_rate=0, short_dropouts_per_hour=0, long_dropouts_per_hour=0,
        unfinished_last_run=False, unconfirmed_runs=(),
    )
    assert not any(v.any() for v in p.labels.values()) and p.dropouts == []
    assert np.all(p.points.state == 0) and np.all(np.isfinite(p.points.value))
    np.testing.assert_array_equal(p.points.value, p.true_value)
    assert all(r.ended_at is not None and r.context_confirmed for r in p.runs)


def test_targets_follow_first_order_plus_dead_time_dynamics():
    p = simulate_plant(
        n_runs=1, run_minutes=60, noise=False, jitter_ms=(0, 0), spike_rate=0, bad_state_rate=0,
        out_of_range_rate=0, duplicate_rate=0, short_dropouts_per_hour=0, long_dropouts_per_hour=0,
        unfinished_last_run=False, n_controls=1, n_features=0, on_change_controls=0, seed=3,
    )
    run = p.runs[0].run_id
    ts_u, u, _, _ = series(p, run, "FIC200_SP")
    ts_y, y, _, _ = series(p, run, "TI101")
    # starts at steady state: TI101 = 55 + 1.2 degC per kg/h away from 25 kg/h
    assert y[0] == pytest.approx(55 + 1.2 * (u[0] - 25), abs=1e-9)
    # an isolated step: nothing before the 8 s dead time, then 63 % of 1.2 * step after tau = 45 s
    change = np.flatnonzero(np.diff(u) != 0) + 1
    step_times = ts_u[change]
    isolated = [
        k for k, t in enumerate(step_times)
        if (k == 0 or t - step_times[k - 1] > 300_000)
        and (k + 1 == len(step_times) or step_times[k + 1] - t > 120_000)
    ]
    assert isolated, "no isolated setpoint step in this run"
    k = isolated[0]
    t_step, du = step_times[k], u[change[k]] - u[change[k] - 1]
    y_before = np.interp(t_step - 1, ts_y, y)
    dead = y[(ts_y >= t_step) & (ts_y <= t_step + 6_900)]  # the step was logged up to 1 s late
    np.testing.assert_allclose(dead, y_before, atol=1e-3 * abs(1.2 * du))
    y_tau = np.interp(t_step + 8_000 + 45_000, ts_y, y)
    assert (y_tau - y_before) / (1.2 * du) == pytest.approx(1 - np.exp(-1), abs=0.02)


def test_first_order_filter_matches_the_recursion():
    rng = np.random.default_rng(0)
    v = rng.normal(size=3000)
    for a in (0.2, 0.9, 0.999, 0.999999):
        y = np.empty_like(v)
        y[0] = 1.5
        for k in range(1, len(v)):
            y[k] = a * y[k - 1] + (1 - a) * v[k - 1]
        np.testing.assert_allclose(first_order(v, a, 1.5), y, rtol=1e-9, atol=1e-9)


def test_linear_model_on_history_and_future_controls_beats_persistence(plant):
    """The plant is learnable: ridge on [history, future controls] beats y(t+h) = y(t-1)."""
    p = plant.points
    ok = (p.state == 0) & np.isfinite(p.value) & ~plant.labels["spike"] & ~plant.labels["duplicate"]
    ok &= p.value != SENTINEL
    nodes = plant.target_ids + plant.control_ids + plant.feature_ids
    nt, nc = len(plant.target_ids), len(plant.control_ids)
    H, F = 30, 15
    X, Y, P, R = [], [], [], []
    for k, r in enumerate(plant.runs):
        if r.ended_at is None:
            continue
        grid = np.arange(r.started_at, r.ended_at, 1000)
        cols = []
        for n in nodes:
            m = ok & (p.run_id == r.run_id) & (p.node_id == n)
            if plant.roles[n] == "control":
                idx = np.clip(np.searchsorted(p.ts[m], grid, "right") - 1, 0, None)
                cols.append(p.value[m][idx])
            else:
                cols.append(np.interp(grid, p.ts[m], p.value[m]))
        g = np.stack(cols, 1)
        for t in range(H, len(grid) - F, 5):
            X.append(np.concatenate([g[t - H : t].ravel(), g[t : t + F, nt : nt + nc].ravel()]))
            Y.append(g[t : t + F, :nt].ravel())
            P.append(np.tile(g[t - 1, :nt], F))
            R.append(k)
    X, Y, P, R = map(np.asarray, (X, Y, P, R))
    train, test = R < 8, R >= 8
    mu, sd = X[train].mean(0), X[train].std(0) + 1e-9
    Z = (X - mu) / sd
    ym = Y[train].mean(0)
    A = Z[train]
    W = np.linalg.solve(A.T @ A + 10.0 * np.eye(A.shape[1]), A.T @ (Y[train] - ym))
    ridge = float(((Z[test] @ W + ym - Y[test]) ** 2).mean())
    persistence = float(((P[test] - Y[test]) ** 2).mean())
    assert ridge < 0.5 * persistence


def test_benchmark_scale_plant_has_every_node_and_run():
    big = simulate_plant(n_runs=32, run_minutes=120, n_controls=4, n_targets=6, n_features=6)
    assert len(big.nodes) == 16 and len(big.runs) == 32
    assert len(big.points) > 32 * 16 * 7200 * 0.5
    assert len({n.node_id for n in big.nodes}) == 16
