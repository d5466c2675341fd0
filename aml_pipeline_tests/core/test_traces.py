"""Run traces: per-pixel summaries of a run built from chunks equal the one-shot build and a loop."""

from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.core.traces import RunTraces, TraceAccumulator

T0, T1 = 1_000_000, 1_000_000 + 3_600_000 - 1  # one hour, inclusive
NODES = ("A", "B", "C")
WIDTH = 97  # not a divisor of the span: columns of unequal point counts


def make_run(seed: int = 0):
    rng = np.random.default_rng(seed)
    raw = []
    for j in range(len(NODES)):
        n = int(rng.integers(500, 3000))
        ts = rng.integers(T0 - 5_000, T1 + 5_000, n)  # a few points outside the span: ignored
        v = rng.normal(10 * j, 1 + j, n)
        v[rng.random(n) < 0.02] = np.nan
        v[rng.random(n) < 0.01] = -9999.0
        v[rng.random(n) < 0.005] = np.inf
        raw.append((ts, v))
    grid_ts = np.arange(T0 + 500, T1 + 1, 1000, dtype=np.int64)
    grid = rng.normal(0, 1, (grid_ts.size, len(NODES))).cumsum(axis=0)
    grid[rng.random(grid.shape) < 0.05] = np.nan
    grid[1000:1400, 1] = np.nan  # a long gap
    removed = []
    for j in range(len(NODES)):
        k = int(rng.integers(0, 40))
        removed.append((np.sort(rng.integers(T0, T1 + 1, k)), rng.normal(50, 5, k)))
    return raw, grid_ts, grid, removed


def one_shot(run, width: int = WIDTH) -> RunTraces:
    raw, grid_ts, grid, removed = run
    acc = TraceAccumulator(T0, T1, NODES, width=width)
    for j, (ts, v) in enumerate(raw):
        acc.add_raw(j, ts, v)
    acc.add_grid(None, grid_ts, grid)
    for j, (ts, v) in enumerate(removed):
        acc.add_removed(j, ts, v)
    return acc.result()


def cut(n: int, rng: np.random.Generator) -> list[slice]:
    """Slices covering 0..n, cut at random places (empty pieces included)."""
    points = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 12))))
    edges = [0, *points.tolist(), n]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def reference(run) -> dict[str, np.ndarray]:
    """The summaries by an explicit loop over points (float64 before the float32 cast)."""
    raw, grid_ts, grid, removed = run
    shape = (len(NODES), WIDTH)
    out = {k: np.full(shape, np.nan) for k in ("raw_min", "raw_max", "grid_min", "grid_max", "removed_min", "removed_max")}
    counts = {k: np.zeros(shape, np.int64) for k in ("raw_count", "grid_rows", "grid_missing", "removed_count")}
    span = T1 - T0 + 1

    def put(kind, j, t, v, count_key):
        t = int(t)
        if not T0 <= t <= T1:
            return
        c = (t - T0) * WIDTH // span
        counts[count_key][j, c] += 1
        if kind == "grid" and not np.isfinite(v):
            counts["grid_missing"][j, c] += 1
        if np.isfinite(v):
            lo, hi = out[f"{kind}_min"], out[f"{kind}_max"]
            lo[j, c] = v if np.isnan(lo[j, c]) else min(lo[j, c], v)
            hi[j, c] = v if np.isnan(hi[j, c]) else max(hi[j, c], v)

    for j, (ts, v) in enumerate(raw):
        for t, x in zip(ts, v):
            put("raw", j, t, x, "raw_count")
    for i, t in enumerate(grid_ts):
        for j in range(len(NODES)):
            put("grid", j, t, grid[i, j], "grid_rows")
    for j, (ts, v) in enumerate(removed):
        for t, x in zip(ts, v):
            put("removed", j, t, x, "removed_count")
    return {**{k: v.astype(np.float32) for k, v in out.items()}, **counts}


def test_one_shot_equals_an_explicit_loop():
    run = make_run(1)
    traces = one_shot(run)
    ref = reference(run)
    for name, expected in ref.items():
        got = getattr(traces, name)
        assert got.shape == (len(NODES), WIDTH)
        assert np.array_equal(got, expected, equal_nan=True), name
    # the long gap is visible: whole columns of node B are missing there
    cols = (np.arange(1000, 1400) * 1000 + 500) * WIDTH // (T1 - T0 + 1)
    inner = np.unique(cols)[1:-1]
    assert (traces.grid_missing[1, inner] == traces.grid_rows[1, inner]).all()
    assert np.isnan(traces.grid_min[1, inner]).all()


@pytest.mark.parametrize("seed", range(6))
def test_chunks_cut_anywhere_give_the_one_shot_result(seed):
    run = make_run(seed)
    raw, grid_ts, grid, removed = run
    expected = one_shot(run)
    rng = np.random.default_rng(100 + seed)
    acc = TraceAccumulator(T0, T1, NODES, width=WIDTH)
    # chunks in a shuffled order, mixing kinds, per node and across nodes
    calls = []
    for j, (ts, v) in enumerate(raw):
        order = rng.permutation(ts.size)  # any order within and across chunks
        calls += [("raw", j, ts[order][s], v[order][s]) for s in cut(ts.size, rng)]
    for s in cut(grid_ts.size, rng):
        if rng.random() < 0.5:
            calls.append(("grid2d", None, grid_ts[s], grid[s]))
        else:
            calls += [("grid", j, grid_ts[s], grid[s, j]) for j in range(len(NODES))]
    all_ts = np.concatenate([ts for ts, _ in removed])
    all_v = np.concatenate([v for _, v in removed])
    all_node = np.repeat(np.arange(len(NODES)), [ts.size for ts, _ in removed])
    calls += [("removed", all_node[s], all_ts[s], all_v[s]) for s in cut(all_ts.size, rng)]
    for i in rng.permutation(len(calls)):
        kind, node, ts, v = calls[i]
        if kind == "raw":
            acc.add_raw(node, ts, v)
        elif kind == "grid":
            acc.add_grid(node, ts, v)
        elif kind == "grid2d":
            acc.add_grid(None, ts, v)
        else:
            acc.add_removed(node, ts, v)
    assert acc.result().equals(expected)


def test_save_and_load_round_trip_is_small(tmp_path):
    rng = np.random.default_rng(7)
    nodes = [f"N{i:02d}" for i in range(16)]
    t0, t1 = 0, 30 * 24 * 3_600_000  # a month
    acc = TraceAccumulator(t0, t1, nodes)
    for chunk in range(20):
        ts = rng.integers(t0, t1, 200_000)
        acc.add_raw(rng.integers(0, 16, ts.size), ts, rng.normal(0, 1, ts.size))
    grid_ts = np.arange(t0, t1, 60_000, dtype=np.int64)
    acc.add_grid(None, grid_ts, rng.normal(0, 1, (grid_ts.size, 16)))
    traces = acc.result()
    path = traces.save(tmp_path / "run" / "traces.npz")
    assert path.stat().st_size < 400_000
    assert RunTraces.load(path).equals(traces)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_saved_bytes_depend_on_the_content_only(tmp_path, monkeypatch):
    # The stage versions compare a stage's files byte for byte: saving the same traces at another
    # time (another zip member time, were it the clock's) must give the same bytes.
    import time

    acc = TraceAccumulator(0, 3_600_000, ["A", "B"])
    acc.add_raw(np.array([0, 1, 0]), np.array([10, 2_000_000, 3_000_000]), np.array([1.0, 2.0, 3.0]))
    traces = acc.result()
    first = traces.save(tmp_path / "a.npz").read_bytes()
    later = time.time() + 3 * 86_400
    monkeypatch.setattr(time, "time", lambda: later)
    assert traces.save(tmp_path / "b.npz").read_bytes() == first


def test_bad_arguments_are_named():
    acc = TraceAccumulator(0, 999, ["A"], width=10)
    with pytest.raises(ValueError, match="node index"):
        acc.add_raw(1, np.array([1]), np.array([1.0]))
    with pytest.raises(ValueError, match="equal length"):
        acc.add_raw(0, np.array([1, 2]), np.array([1.0]))
    with pytest.raises(ValueError, match="integer epoch ms"):
        acc.add_raw(0, np.array([1.5]), np.array([1.0]))
    with pytest.raises(ValueError, match="before t0_ms"):
        TraceAccumulator(10, 5, ["A"])
    with pytest.raises(ValueError, match="width"):
        TraceAccumulator(0, 5, ["A"], width=0)


def test_missing_ratio_per_node():
    acc = TraceAccumulator(0, 9, ["A", "B"], width=5)
    acc.add_grid(None, np.arange(10), np.column_stack([np.r_[np.nan, np.ones(9)], np.full(10, np.nan)]))
    assert acc.result().missing_ratio().tolist() == [0.1, 1.0]


def test_folding_onto_a_divisor_equals_accumulating_at_it():
    run = make_run(3)
    assert one_shot(run, 3 * WIDTH).folded(WIDTH).equals(one_shot(run))


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # a node with no removed point
def test_folding_onto_any_narrower_width_keeps_every_count_and_extreme():
    """Traces stored wider than the plot's data area (an older build) are folded: nothing they
    hold is lost, and each column's summaries come from the columns that fall in it."""
    run = make_run(4)
    wide, narrow = one_shot(run, 1000), 800
    folded = wide.folded(narrow)
    assert folded.width == narrow
    for a in RunTraces.ARRAYS:
        got, have = getattr(folded, a), getattr(wide, a)
        if a.endswith("_min"):
            assert np.array_equal(np.nanmin(got, axis=1), np.nanmin(have, axis=1), equal_nan=True), a
        elif a.endswith("_max"):
            assert np.array_equal(np.nanmax(got, axis=1), np.nanmax(have, axis=1), equal_nan=True), a
        else:
            assert np.array_equal(got.sum(axis=1), have.sum(axis=1)), a
    # column j of 1,000 lands in column j * 800 // 1,000: wide columns 5 and 6 make column 4 of 800
    assert np.array_equal(folded.raw_count[:, 4], wide.raw_count[:, 5] + wide.raw_count[:, 6])
    assert np.array_equal(folded.raw_max[:, 4], np.fmax(wide.raw_max[:, 5], wide.raw_max[:, 6]), equal_nan=True)
    assert wide.folded(1000) is wide
    with pytest.raises(ValueError, match="more than the traces' 1000"):
        wide.folded(1001)


def _series_points(rng: np.random.Generator, t0: int, t1: int, nodes: int):
    """Each node's points in time order (duplicates, runs of one column, ends of the span), some
    non-finite, some values signed zeros; back to back."""
    parts = []
    for j in range(nodes):
        n = int(rng.choice([0, 1, 7, 300]))
        ts = np.sort(rng.integers(t0, t1 + 1, n))
        if n > 2:
            ts[0], ts[-1] = t0, t1
        value = np.round(rng.normal(0, 1, n), 1)  # -0.0 and 0.0 both occur
        value[rng.random(n) < 0.1] = rng.choice([np.nan, np.inf, -np.inf])
        parts.append((ts.astype(np.int64), value))
    starts = np.cumsum([0] + [p[0].size for p in parts[:-1]])
    return starts, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@pytest.mark.parametrize("seed", range(4))
def test_series_and_grid_rows_equal_the_per_point_adds(seed):
    """add_series and add_grid_rows (every node at once, columns found once) give the bytes of
    add_raw / add_removed / add_grid fed the same points with a node index per point; a point
    outside the span or out of order falls back to them."""
    rng = np.random.default_rng(seed)
    t0, t1, nodes, width = 1_000, 61_000, 5, 37
    fast, slow = (TraceAccumulator(t0, t1, [f"n{j}" for j in range(nodes)], width=width) for _ in range(2))
    starts, ts, value = _series_points(rng, t0, t1, nodes)
    node = np.repeat(np.arange(nodes), np.diff(np.append(starts, ts.size)))
    fast.add_series("raw", starts, ts, value)
    slow.add_raw(node, ts, value)
    fast.add_series("removed", starts, ts[::-1][::-1], value)
    slow.add_removed(node, ts, value)
    outside = ts.copy()
    if outside.size:
        outside[-1] = t1 + 5  # falls back: ignored like add_raw ignores it
    fast.add_series("raw", starts, outside, value)
    slow.add_raw(node, outside, value)
    if ts.size > 2:
        shuffled = ts.copy()
        shuffled[[-1, -2]] = shuffled[[-2, -1]] if shuffled[-1] != shuffled[-2] else (t0, t1)
        fast.add_series("removed", starts, shuffled, value)
        slow.add_removed(node, shuffled, value)
    grid_ts = np.arange(t0 - 3_000, t1 + 3_000, 700, dtype=np.int64)
    grid = np.round(rng.normal(0, 1, (nodes, grid_ts.size)), 1)
    grid[rng.random(grid.shape) < 0.2] = np.nan
    grid[0, :3] = np.inf
    grid[1] = np.nan
    fast.add_grid_rows(grid_ts, grid)
    slow.add_grid(np.repeat(np.arange(nodes), grid_ts.size), np.tile(grid_ts, nodes), grid.reshape(-1))
    a, b = fast.result(), slow.result()
    for name in RunTraces.ARRAYS:
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
    assert b.raw_count.sum() and b.removed_count.sum() and b.grid_missing.sum()
