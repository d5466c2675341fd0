"""The run figure's data and texts laid into palette indices with numpy give, byte for byte, the
PNG matplotlib drew them into before (:mod:`agg_run_figure`, the old code kept as the reference):
every layer on the same pixels, in the same order, for traces with gaps, partly missing columns,
outliers anywhere (beyond the scale, on every column parity, non-finite), flat nodes, empty
columns and nodes and runs, columns wider than a pixel, folded traces, one to many nodes, and
runs drawn one after the other through one figure (its kept texts and glyphs reused).

The reference is the old code twice: as it was, and drawing every text with matplotlib where it
goes (no kept text). The numpy figure matches the second always, and the first wherever a band is
taller than MIN_BAND_PX. At MIN_BAND_PX (17 nodes and more) a band's two scale values are closer
than the pixels kept around them, and the old code's kept pixels of one carried the other's ink
(a row of another band's value, or white over this one's): the numpy figure lays only a text's
ink, as matplotlib drawing it there does."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from aml_pipeline.core.traces import TraceAccumulator
from aml_pipeline.pipeline import run_figure as rf
from aml_pipeline_tests.pipeline.agg_run_figure import AggRunFigure
from aml_pipeline_tests.pipeline.plot_traces import constant_nodes, synthetic_traces


def assert_same_png(numpy_png: bytes, agg_png: bytes, what: str) -> None:
    if numpy_png == agg_png:
        return
    ours, theirs = (np.asarray(Image.open(io.BytesIO(png))) for png in (numpy_png, agg_png))
    assert ours.shape == theirs.shape, what
    rows, cols = np.nonzero(ours != theirs)
    sample = [(int(r), int(c), int(ours[r, c]), int(theirs[r, c])) for r, c in zip(rows[:8], cols[:8])]
    pytest.fail(f"{what}: {rows.size} pixels differ (row, column, numpy's index, Agg's index): {sample}")


def draw_both(labels: tuple[str, ...], runs: list) -> None:
    """Each of ``runs`` (traces, title) through one numpy figure and the Agg figures, in order."""
    ours, kept, drawn = rf.RunFigure(labels), AggRunFigure(labels), AggRunFigure(labels, keep_texts=False)
    for k, (traces, title) in enumerate(runs):
        png = ours.png(traces, title)
        assert_same_png(png, drawn.png(traces, title), f"run {k} ({title}), every text drawn")
        if ours.band > rf.MIN_BAND_PX:
            assert_same_png(png, kept.png(traces, title), f"run {k} ({title}), texts kept")


def random_run(rng: np.random.Generator, nodes: list[str], width: int, r: int):
    """A run of random length and beat: random walks with NaN stretches, raw points around them
    (some non-finite, some far out), removed outliers anywhere (some beyond the scale, some
    non-finite), a node without any point, every seventh run without any point at all."""
    span = int(rng.choice([1_000, 90_000, 3_600_000, 7_200_000, 5 * 86_400_000, 40 * 86_400_000]))
    t0 = 1_735_718_400_000 + r * 7_000_000
    acc = TraceAccumulator(t0, t0 + span - 1, nodes, width=width)
    if r % 7 == 3:
        return acc.result()
    n = len(nodes)
    grid_ts = np.linspace(t0, t0 + span - 1, int(rng.choice([50, 700, 5000]))).astype(np.int64)
    grid = rng.normal(0, rng.choice([0.01, 1, 1000]), (grid_ts.size, n)).cumsum(axis=0) + rng.normal(0, 100, n)
    grid[:, 0] = 5.0  # a flat node
    for i in range(n):
        a = int(rng.integers(0, grid_ts.size))
        grid[a : a + int(rng.integers(0, grid_ts.size // 4 + 1)), i] = np.nan  # a gap
        grid[rng.random(grid_ts.size) < 0.05, i] = np.nan  # some missing rows
    grid[:, n - 1] = np.nan  # no grid value at all
    acc.add_grid(None, grid_ts, grid)
    for i in range(n - 1):
        ts = np.sort(rng.integers(t0, t0 + span, 3000))
        v = np.interp(ts, grid_ts, np.nan_to_num(grid[:, i])) + rng.normal(0, 0.5, ts.size)
        v[rng.random(ts.size) < 0.01] = rng.choice([1e6, -1e6, np.nan, np.inf])
        acc.add_raw(i, ts, v)
        out = np.sort(rng.integers(t0, t0 + span, int(rng.integers(0, 60))))
        acc.add_removed(i, out, rng.choice([-1e9, 1e9, np.inf, 0.0, 50.0], out.size) + rng.normal(0, 10, out.size))
    return acc.result()


def test_the_synthetic_runs_at_every_width_match_agg():
    """Gaps, a partly missing column, a raw point far off, an outlier above the scale; one trace
    column per pixel, two, a pixel and a half (uneven columns), and more columns than pixels."""
    labels = ("A [degC]", "B [kg/h]")
    draw_both(labels, [(synthetic_traces(width), f"run W{width}") for width in (rf.PLOT_PX, 400, 533, 97, 1000)])


def test_long_beats_flat_nodes_and_many_nodes_match_agg():
    acc = TraceAccumulator(0, 89_999, ["A"])
    grid_ts = np.arange(0, 90_000, 300, dtype=np.int64)
    v = np.sin(grid_ts / 5000.0)
    v[100:130] = np.nan
    acc.add_grid(None, grid_ts, v[:, None])
    draw_both(("A",), [(acc.result(), "run long beat")])
    for n in (1, 5, 30):
        draw_both(tuple(f"N{i:02d} [bar]" for i in range(n)), [(constant_nodes(n), "run flat")])


@pytest.mark.parametrize(("n", "width"), [(2, rf.PLOT_PX), (4, 333), (16, rf.PLOT_PX), (17, 1600), (40, 250)])
def test_random_runs_through_one_figure_match_agg(n, width):
    rng = np.random.default_rng(n * 1000 + width)
    nodes = [f"N{i}" for i in range(n)]
    runs = [(random_run(rng, nodes, width, r), f"run R{r}-{rng.integers(1000)}") for r in range(12)]
    draw_both(tuple(f"{node} [u]" for node in nodes), runs)


def test_outliers_in_every_column_and_row_match_agg():
    """One outlier square per column at each of its rows in turn: every centre, even or odd
    column edges and widths, every row of the band, the band's edges."""
    labels = ("A [degC]", "B")
    runs = []
    for width in (rf.PLOT_PX, 267):
        for shift in range(0, 30, 7):
            acc = TraceAccumulator(0, width * 1000 - 1, ["A", "B"], width=width)
            ts = np.arange(width, dtype=np.int64) * 1000 + 500
            acc.add_grid(None, ts, np.column_stack([np.zeros(width), np.ones(width)]))
            acc.add_removed(0, ts, ((np.arange(width) + shift) % 40 - 5) * 0.05)
            acc.add_removed(1, ts[::3], np.linspace(-2, 3, ts[::3].size))
            runs.append((acc.result(), f"run O{width}-{shift}"))
    draw_both(labels, runs)


def test_fill_rects_sets_exactly_the_rectangles_clipped_to_the_image():
    index = np.zeros((6, 8), np.uint8)
    rf.fill_rects(index, np.array([1, -3, 6, 2, 5]), np.array([3, 1, 12, 2, 4]), np.array([0, 4, -1, 1, 2]),
                  np.array([2, 9, 2, 5, 3]), 7)
    expected = np.zeros((6, 8), np.uint8)
    expected[0:2, 1:3] = 7
    expected[4:6, 0:1] = 7
    expected[0:2, 6:8] = 7  # (2, 2) and (5, 4) are empty
    assert (index == expected).all()
