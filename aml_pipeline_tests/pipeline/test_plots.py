"""Plots: every image decodes as a PNG of the expected size and shows what it claims where it
claims it (gaps, raw points beyond the scale, removed outliers), at 1, 300 and 10,000 runs."""

from __future__ import annotations

import base64
import io
import re

import matplotlib.image as mpimg
import numpy as np
import pytest
from PIL import Image

from aml_pipeline.core.traces import TraceAccumulator
from aml_pipeline.pipeline import plots
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
from aml_pipeline.spec import parse_spec


def decode(png: bytes) -> np.ndarray:
    """RGB pixels of a PNG, decoded by Pillow; matplotlib must read it too."""
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    im = Image.open(io.BytesIO(png))
    im.load()  # decodes every row: a truncated or corrupt stream raises here
    rgb = np.asarray(im.convert("RGB"))
    assert mpimg.imread(io.BytesIO(png), format="png").shape[:2] == rgb.shape[:2]
    return rgb


def png_of(markdown: str) -> bytes:
    [data] = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    return base64.b64decode(data)


def colour(index: int) -> np.ndarray:
    return plots.PALETTE[index]


def has(pixels: np.ndarray, index: int) -> bool:
    return bool((pixels.reshape(-1, 3) == colour(index)).all(axis=1).any())


# ---- per run --------------------------------------------------------------------------------


def synthetic_traces():
    """Two nodes over ten minutes at 1 s, 600 columns: one column per second.

    A: a sine with a gap (grid rows 100..149 missing) and one raw sentinel far below its range
    at 460.5 s (where the sine is near its top). B: a ramp 0..10 with one removed outlier at
    450 s, value 20 (above its range).
    """
    t0, t1 = 0, 599_999
    acc = TraceAccumulator(t0, t1, ["A", "B"], width=600)
    grid_ts = np.arange(0, 600_000, 1000, dtype=np.int64)
    a = np.sin(grid_ts / 60_000)
    a[100:150] = np.nan
    b = np.linspace(0, 10, grid_ts.size)
    acc.add_grid(None, grid_ts, np.column_stack([a, b]))
    raw_ts = grid_ts + 200
    acc.add_raw(0, np.r_[raw_ts, 460_500], np.r_[np.sin(raw_ts / 60_000), -9999.0])
    acc.add_raw(1, raw_ts, np.linspace(0, 10, raw_ts.size))
    acc.add_removed(1, np.array([450_000]), np.array([20.0]))
    return acc.result()


def band(rgb: np.ndarray, layout, node: int) -> np.ndarray:
    """The inner rows (between the separators) of a node's band in the data area."""
    top = layout.y0 + node * plots.BAND_PX
    return rgb[top + plots.EDGE : top + plots.BAND_PX - plots.EDGE, layout.x0 : layout.x0 + layout.width]


def test_run_figure_shows_gaps_raw_points_and_outliers_where_they_are():
    traces = synthetic_traces()
    rgb = decode(plots.run_figure_png(traces, ["degC", "kg/h"], "run R1"))
    layout = plots._run_layout(("A [degC]", "B [kg/h]"), 600)
    assert rgb.shape == layout.background.shape + (3,)
    a, b = band(rgb, layout, 0), band(rgb, layout, 1)
    # the gap: whole columns shaded, no grid line; outside it the grid line is there
    for col in (110, 125, 140):
        assert has(a[:, col], plots.GAP) and not has(a[:, col], plots.GRID)
    assert all(has(a[:, col], plots.GRID) for col in (50, 200, 400, 550))
    # the sentinel is far below A's scale: drawn at the band's bottom edge, in raw grey
    assert (a[-1, 460] == colour(plots.RAW)).all() and not has(a[-3:, 455], plots.RAW)
    # the outlier above B's scale: a red cross at the top edge of B's band, nowhere in A's
    assert has(b[:3, 449:452], plots.OUTLIER)
    assert not has(a, plots.OUTLIER)
    assert not has(b[:, :440], plots.OUTLIER) and not has(b[:, 460:], plots.OUTLIER)
    # the ramp rises left to right: B's line is low at the start and high at the end
    rows = np.flatnonzero((b[:, 5] == colour(plots.GRID)).all(axis=1))
    rows_end = np.flatnonzero((b[:, 590] == colour(plots.GRID)).all(axis=1))
    assert rows.min() > rows_end.max()


def test_run_figure_needs_a_unit_per_node():
    with pytest.raises(ValueError, match="2 nodes"):
        plots.run_figure_png(synthetic_traces(), ["degC"], "run R1")


@pytest.mark.parametrize("runs", [1, 300])
def test_run_figures_decode_as_pngs_for_every_run(runs):
    """Runs from one second to forty days, with empty nodes and empty runs, one figure each
    (the layout is reused across runs: every figure must still be complete and valid)."""
    rng = np.random.default_rng(runs)
    nodes = [f"N{i}" for i in range(4)]
    for r in range(runs):
        span = int(rng.choice([1_000, 90_000, 3_600_000, 5 * 86_400_000, 40 * 86_400_000]))
        t0 = 1_735_718_400_000 + r * 7_000_000
        acc = TraceAccumulator(t0, t0 + span, nodes)
        if r % 7 != 3:  # every seventh run has no points at all
            ts = np.sort(rng.integers(t0, t0 + span + 1, 2000))
            acc.add_raw(rng.integers(0, 3, ts.size), ts, rng.normal(50, 5, ts.size))  # node N3 stays empty
            grid_ts = np.linspace(t0, t0 + span, 500).astype(np.int64)
            grid = rng.normal(50, 5, (grid_ts.size, 4)).cumsum(axis=0)
            grid[:, 3] = np.nan
            acc.add_grid(None, grid_ts, grid)
            acc.add_removed(0, ts[:3], np.array([90.0, 10.0, 95.0]))
        png = plots.run_figure_png(acc.result(), ["degC", "%", "kg/h", ""], f"run R{r}")
        rgb = decode(png)
        layout = plots._run_layout(("N0 [degC]", "N1 [%]", "N2 [kg/h]", "N3"), acc.width)
        assert rgb.shape == (plots.TOP_PX + 4 * plots.BAND_PX + plots.BOTTOM_PX, layout.x0 + acc.width + plots.RIGHT_PX, 3)


@pytest.fixture(scope="module")
def plant16():
    """The benchmark's shape: 16 nodes (4 controls, 4 targets, 8 features), 2 h at 1 Hz; the
    run's traces fed in chunks as the streaming stages feed them (bench.plots_bench)."""
    from bench.plots_bench import plant_run_traces

    plant = simulate_plant(n_runs=1, run_minutes=120, n_controls=4, n_targets=4, n_features=8, seed=1,
                           unfinished_last_run=False)
    spec = parse_spec(plant_spec_dict(plant, "p16"))
    units = {n.node_id: n.unit for n in plant.nodes}
    run = plant.runs[0]
    return plant_run_traces(plant, spec, run), [units[n] for n in spec.node_ids], run.run_id


def test_a_16_node_run_fits_the_event_log_budget(plant16):
    """30 KB of event log per run (bench/plots_bench.py measures it): SQLite stores each event
    twice, so the markdown must stay near 14 KB."""
    traces, units, run_id = plant16
    markdown = plots.run_traces_markdown(traces, units, run_id)
    assert len(markdown.encode()) <= 14_500
    rgb = decode(png_of(markdown))
    assert rgb.shape[0] == plots.TOP_PX + 16 * plots.BAND_PX + plots.BOTTOM_PX
    # every colour the legend names is in the picture
    for index in (plots.RAW, plots.GRID, plots.OUTLIER, plots.GAP):
        assert has(rgb, index), index
    assert f"run {run_id}" in markdown


# ---- per dataset ----------------------------------------------------------------------------


def dataset(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n_train, n_val = int(n * 0.7), int(n * 0.15)
    n_excluded = n // 40
    n_test = n - n_train - n_val - n_excluded
    splits = ["train"] * n_train + ["val"] * n_val + ["test"] * n_test + ["excluded"] * n_excluded
    runs = [(f"R{i:05d}", s, 0 if s == "excluded" else int(rng.integers(1, 5000))) for i, s in enumerate(splits)]
    nodes = [f"N{i:02d}" for i in range(16)]
    return runs, nodes, rng.beta(0.5, 20, (n, 16)), rng.beta(0.5, 200, (n, 16))


@pytest.mark.parametrize("n", [1, 300, 10_000])
def test_dataset_overview_decodes_at_any_number_of_runs(n):
    runs, nodes, missing, outliers = dataset(n)
    rgb = decode(plots.dataset_overview_png(runs, nodes, missing, outliers, title="reactor_a"))
    assert rgb.shape[1] == int(8.4 * plots.DPI) and rgb.shape[0] > 400
    windows_only = decode(plots.dataset_overview_png(runs))  # windows per run alone
    assert windows_only.shape[0] < rgb.shape[0]
    # the split colours of the runs present are drawn
    for split in {s for _, s, w in runs if w > 0}:
        hexa = plots.SPLIT_COLOURS[split]
        rgb_split = np.array([int(hexa[i : i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(windows_only.reshape(-1, 3).astype(int) - rgb_split).sum(axis=1) <= 6).any(), split


def test_bins_never_mix_splits_and_cover_every_run():
    runs, _, _, _ = dataset(10_000)
    splits = [s for _, s, _ in runs]
    bins = plots._bins(splits, plots.OVERVIEW_COLUMNS)
    assert len(bins) <= plots.OVERVIEW_COLUMNS
    assert bins[0][1] == 0 and bins[-1][2] == len(splits)
    assert all(a[2] == b[1] for a, b in zip(bins, bins[1:]))  # contiguous, no overlap
    assert all(len({splits[i] for i in range(lo, hi)}) == 1 and splits[lo] == s for s, lo, hi in bins)
    assert plots._bins(splits[:300], plots.OVERVIEW_COLUMNS) == [(s, i, i + 1) for i, s in enumerate(splits[:300])]


def test_overview_names_a_bad_shape_or_split():
    runs, nodes, missing, _ = dataset(5)
    with pytest.raises(ValueError, match="missing ratio has shape"):
        plots.dataset_overview_png(runs, nodes, missing[:, :3])
    with pytest.raises(ValueError, match="unknown split 'holdout'"):
        plots.dataset_overview_png([("R1", "holdout", 3)])
