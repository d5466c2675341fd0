"""Plots: every image decodes as a PNG of the expected size and shows what it claims where it
claims it (gaps, raw points beyond the scale, removed outliers), for 1 to 30 nodes and 1 to
10,000 runs."""

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
from aml_pipeline.pipeline import run_figure as rf
from aml_pipeline_tests.pipeline.plot_traces import constant_nodes, synthetic_traces
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
    return rf.PALETTE[index]


def has(pixels: np.ndarray, index: int) -> bool:
    return bool((pixels.reshape(-1, 3) == colour(index)).all(axis=1).any())


def palette_only(rgb: np.ndarray) -> bool:
    """Every pixel is one of the run figure's colours (nothing antialiased, nothing stray)."""
    keys = (rgb[..., 0].astype(np.int64) << 16) | (rgb[..., 1].astype(np.int64) << 8) | rgb[..., 2]
    palette = (rf.PALETTE[:, 0].astype(np.int64) << 16) | (rf.PALETTE[:, 1].astype(np.int64) << 8) | rf.PALETTE[:, 2]
    return bool(np.isin(np.unique(keys), palette).all())


# ---- per run --------------------------------------------------------------------------------


def band(rgb: np.ndarray, figure: rf.RunFigure, node: int) -> np.ndarray:
    """A node's band in the data area, without the separator row above it."""
    top = rf.TOP_PX + node * figure.band
    return rgb[top + 1 : top + figure.band, figure.left : figure.left + rf.PLOT_PX]


def data_rows(figure: rf.RunFigure) -> slice:
    """Within ``band(...)``: the rows values are drawn in (EDGE_PX kept clear at each edge)."""
    return slice(rf.EDGE_PX, figure.band - 1 - rf.EDGE_PX)


def test_run_figure_shows_gaps_raw_points_and_outliers_where_they_are():
    traces = synthetic_traces()
    rgb = decode(plots.run_figure_png(traces, ["degC", "kg/h"], "run R1"))
    figure = rf.run_figure(("A [degC]", "B [kg/h]"))
    assert rgb.shape == (rf.TOP_PX + 2 * figure.band + rf.BOTTOM_PX, figure.w_px, 3)
    assert rgb.shape[1] >= 1000 and figure.band >= 100  # two nodes: tall bands
    assert palette_only(rgb)
    a, b = band(rgb, figure, 0), band(rgb, figure, 1)
    # the gap: whole columns shaded, no grid line; the partly missing column shaded lighter, its
    # line kept; elsewhere neither
    for col in (100, 125, 149):
        assert has(a[:, col], rf.GAP) and not has(a[:, col], rf.GRID), col
    assert not has(a[:, 99], rf.GAP) and not has(a[:, 150], rf.GAP)
    assert has(a[:, 300], rf.PARTIAL_GAP) and has(a[:, 300], rf.GRID) and not has(a[:, 300], rf.GAP)
    for col in (50, 200, 299, 301, 400, 550):
        assert has(a[:, col], rf.GRID) and not has(a[:, col], rf.GAP) and not has(a[:, col], rf.PARTIAL_GAP), col
    assert not has(b, rf.GAP) and not has(b, rf.PARTIAL_GAP)
    # the sentinel is far below A's scale: raw grey from the line down to the band's last data row
    rows = data_rows(figure)
    assert (a[rows][-1, 460] == colour(rf.RAW)).all() and not has(a[:, 455], rf.RAW)
    # the outlier above B's scale: red at the top of B's band, in its column, nowhere else
    assert has(b[rows][:3, 449:452], rf.OUTLIER)
    assert not has(a, rf.OUTLIER)
    assert not has(b[:, :440], rf.OUTLIER) and not has(b[:, 460:], rf.OUTLIER)
    # the ramp rises left to right: B's line is low at the start and high at the end
    grid_rows = lambda col: np.flatnonzero((b[:, col] == colour(rf.GRID)).all(axis=1))  # noqa: E731
    assert grid_rows(5).min() > grid_rows(rf.PLOT_PX - 10).max()


def test_run_figure_draws_traces_of_another_width_over_the_whole_data_area():
    """Traces stored with fewer columns (an older build) are stretched, not drawn narrower."""
    rgb = decode(plots.run_figure_png(synthetic_traces(width=400), ["degC", "kg/h"], "run R1"))
    figure = rf.run_figure(("A [degC]", "B [kg/h]"))
    a = band(rgb, figure, 0)
    assert rgb.shape[1] == figure.w_px
    # 100..149 s are columns 50..74 of 400, pixels 100..149 of 800
    assert has(a[:, 100], rf.GAP) and has(a[:, 149], rf.GAP) and not has(a[:, 150], rf.GAP)
    assert has(a[:, rf.PLOT_PX - 1], rf.GRID) and has(a[:, 0], rf.GRID)


def test_run_figure_folds_traces_wider_than_the_data_area_and_loses_nothing():
    """Traces stored with more columns (1,000, as older builds stored them) are folded onto the
    data area: the same chart as traces accumulated at its width, where the width divides."""
    wide = synthetic_traces(width=2 * rf.PLOT_PX)
    assert plots.run_figure_png(wide, ["degC", "kg/h"], "run R1") == plots.run_figure_png(
        synthetic_traces(), ["degC", "kg/h"], "run R1")
    rgb = decode(plots.run_figure_png(synthetic_traces(width=1000), ["degC", "kg/h"], "run R1"))
    figure = rf.run_figure(("A [degC]", "B [kg/h]"))
    a, b = band(rgb, figure, 0), band(rgb, figure, 1)
    # (a point near a column's edge may sit a column over: 1,000 is not a multiple of 800)
    assert has(a[:, 101], rf.GAP) and has(a[:, 147], rf.GAP) and not has(a[:, 151], rf.GAP)
    assert has(b[data_rows(figure)][:3, 449:452], rf.OUTLIER)
    assert has(a[:, rf.PLOT_PX - 1], rf.GRID) and has(a[:, 0], rf.GRID)


def test_a_beat_longer_than_a_column_still_draws_one_line_and_whole_gaps():
    """A 90 s run on a 300 ms grid: most columns hold no grid row; the line runs through them and
    the gap is shaded without holes, up to the middle between its rows and their neighbours."""
    acc = TraceAccumulator(0, 89_999, ["A"])
    grid_ts = np.arange(0, 90_000, 300, dtype=np.int64)
    v = np.sin(grid_ts / 5000.0)
    v[100:130] = np.nan  # 30 000 .. 38 700 ms
    acc.add_grid(None, grid_ts, v[:, None])
    traces = acc.result()
    assert (traces.grid_rows == 0).mean() > 0.5
    rgb = decode(plots.run_figure_png(traces, [""], "run R1"))
    a = band(rgb, rf.run_figure(("A",)), 0)
    line = (a == colour(rf.GRID)).all(axis=2).any(axis=0)
    gap = (a == colour(rf.GAP)).all(axis=2).any(axis=0)
    assert np.flatnonzero(gap).tolist() == list(range(np.flatnonzero(gap)[0], np.flatnonzero(gap)[-1] + 1))
    # from the middle of rows 99 and 100 (29,850 ms) to that of rows 129 and 130 (38,850 ms)
    first, last_gap = np.flatnonzero(gap)[0], np.flatnonzero(gap)[-1]
    assert abs(first - 29_850 * rf.PLOT_PX / 90_000) <= 2.5 and abs(last_gap - 38_850 * rf.PLOT_PX / 90_000) <= 2.5
    last = 89_700 * rf.PLOT_PX // 90_000  # the last grid row's column: nothing drawn after it
    assert (line | gap)[: last + 1].all() and not (line | gap)[last + 1 :].any() and not (line & gap).any()


def test_run_figure_redraws_a_run_byte_for_byte_whatever_it_drew_before():
    """The figure and its kept texts are reused from run to run: nothing of one run stays in the
    next, and a text copied from an earlier drawing is pixel for pixel the drawn one."""
    rf.run_figure.cache_clear()
    first = synthetic_traces()
    acc = TraceAccumulator(0, 7_200_000, ["A", "B"])
    acc.add_grid(None, np.arange(0, 7_200_000, 1000), np.column_stack([np.full(7200, -3.0), np.linspace(1e6, 2e6, 7200)]))
    other = acc.result()
    fresh = plots.run_figure_png(first, ["degC", "kg/h"], "run R1")
    plots.run_figure_png(other, ["degC", "kg/h"], "run R2")
    assert plots.run_figure_png(first, ["degC", "kg/h"], "run R1") == fresh
    rf.run_figure.cache_clear()
    assert plots.run_figure_png(first, ["degC", "kg/h"], "run R1") == fresh


def test_run_figure_needs_a_unit_per_node():
    with pytest.raises(ValueError, match="2 nodes"):
        plots.run_figure_png(synthetic_traces(), ["degC"], "run R1")


def test_palette_colours_are_told_apart_by_their_green_alone():
    greens = np.sort(rf.PALETTE[:, 1].astype(int))
    assert np.diff(greens).min() >= rf.MIN_GREEN_GAP
    for i, c in enumerate(rf.PALETTE):
        for d in (-2, 0, 2):  # Agg's rounding of a colour moves it by a unit or so
            assert rf.GREEN_TO_INDEX[int(np.clip(int(c[1]) + d, 0, 255))] == i


@pytest.mark.parametrize(
    ("span_ms", "unit", "step"),
    [(1_000, "s", 0.2), (90_000, "s", 20.0), (7_200_001, "min", 20.0), (2 * 86_400_000, "h", 10.0),
     (40 * 86_400_000, "d", 5.0)],
)
def test_time_axis_unit_fits_the_run(span_ms, unit, step):
    ms, name, ticks = rf.time_ticks(span_ms)
    assert name == unit and ticks[0] == 0 and np.diff(ticks) == pytest.approx(step)
    assert span_ms / ms - step < ticks[-1] <= span_ms / ms and 4 <= len(ticks) <= rf.MAX_TICKS


def test_band_scale_is_round_and_holds_the_cleaned_range():
    acc = TraceAccumulator(0, 999, ["A", "B", "C", "D"], width=10)
    acc.add_grid(None, np.arange(0, 1000, 100), np.column_stack([
        np.linspace(15.2, 69.2, 10), np.full(10, 5.0), np.linspace(-0.0123, 0.0456, 10), np.full(10, np.nan)]))
    acc.add_raw(3, np.array([10, 20]), np.array([3.0, 4.0]))  # no grid value: the raw range
    lo, hi, step = rf.band_scale(acc.result())
    assert (lo <= [15.2, 5.0, -0.0123, 3.0]).all() and (hi >= [69.2, 5.0, 0.0456, 4.0]).all() and (hi > lo).all()
    assert [rf.fmt(v, s) for v, s in zip(lo, step)][:3] == ["10", "4.4", "-0.02"]
    assert [rf.fmt(v, s) for v, s in zip(hi, step)][:3] == ["70", "5.6", "0.05"]


@pytest.mark.parametrize("runs", [1, 300])
def test_run_figures_decode_as_pngs_for_every_run(runs):
    """Runs from one second to forty days, with empty nodes and empty runs, one figure each
    (the figure is reused across runs: every figure must still be complete and valid)."""
    rng = np.random.default_rng(runs)
    nodes = [f"N{i}" for i in range(4)]
    figure = rf.run_figure(("N0 [degC]", "N1 [%]", "N2 [kg/h]", "N3"))
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
        rgb = decode(plots.run_figure_png(acc.result(), ["degC", "%", "kg/h", ""], f"run R{r}"))
        assert rgb.shape == (rf.TOP_PX + 4 * figure.band + rf.BOTTOM_PX, figure.w_px, 3)


@pytest.mark.parametrize("n", [1, 30])
def test_one_and_many_nodes_each_get_a_band_with_their_own_gaps(n):
    traces = constant_nodes(n)
    rgb = decode(plots.run_figure_png(traces, ["bar"] * n, "run R1"))
    figure = rf.run_figure(tuple(f"N{i:02d} [bar]" for i in range(n)))
    assert figure.band == rf.band_px(n) and rf.MIN_BAND_PX <= figure.band <= rf.MAX_BAND_PX
    assert rgb.shape == (rf.TOP_PX + n * figure.band + rf.BOTTOM_PX, figure.w_px, 3) and rgb.shape[1] >= 1000
    for i in range(n):
        b = band(rgb, figure, i)
        gap = np.flatnonzero((b == colour(rf.GAP)).all(axis=2).any(axis=0))
        assert gap.tolist() == list(range(20 * i, 20 * i + 10)), i
        assert has(b[:, 20 * i + 10 :], rf.GRID) and not has(b[:, 20 * i : 20 * i + 10], rf.GRID)


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


def test_a_16_node_run_is_a_small_4_bit_palette_png_with_what_the_legend_names(plant16):
    """bench/plots_bench.py measures what the plot adds to the event log; here: the PNG stays a
    palette image of 4 bits a pixel (what keeps it small) and shows every kind of mark."""
    traces, units, run_id = plant16
    markdown = plots.run_traces_markdown(traces, units, run_id)
    png = png_of(markdown)
    assert png[24:26] == bytes([4, 3])  # IHDR: bit depth 4, colour type 3 (palette)
    assert len(markdown.encode()) <= 64_000
    rgb = decode(png)
    figure = rf.run_figure(tuple(plots._label(n, u) for n, u in zip(traces.node_ids, units)))
    assert figure.band >= rf.MIN_BAND_PX and rgb.shape == (rf.TOP_PX + 16 * figure.band + rf.BOTTOM_PX, figure.w_px, 3)
    # whole below the dialog's header on a 768 px high screen (test_webserver.py looks in a browser)
    assert rgb.shape[0] <= 640
    assert palette_only(rgb)
    for index in (rf.RAW, rf.GRID, rf.OUTLIER, rf.GAP, rf.PARTIAL_GAP):
        assert has(rgb[rf.TOP_PX :], index), index
    assert f"run {run_id}" in markdown


def test_the_run_plot_png_has_unfiltered_rows_and_is_smaller_than_pillows_of_the_same_pixels(plant16):
    """palette_png writes every row with PNG filter type 0, which compresses the plot's palette
    image smaller than Pillow's per-row filters at the same level; odd widths keep their last
    pixel."""
    import struct
    import zlib

    traces, units, run_id = plant16
    png = plots.run_figure_png(traces, units, f"run {run_id}")
    width, height = struct.unpack(">II", png[16:24])
    idat, at = b"", 8
    while at < len(png):
        (size,), kind = struct.unpack(">I", png[at : at + 4]), png[at + 4 : at + 8]
        idat += png[at + 8 : at + 8 + size] if kind == b"IDAT" else b""
        at += 12 + size
    raw = zlib.decompress(idat)
    row_bytes = 1 + (width + 1) // 2
    assert len(raw) == height * row_bytes and set(raw[::row_bytes]) == {0}
    image = Image.open(io.BytesIO(png))
    pillow = io.BytesIO()
    image.save(pillow, format="PNG", compress_level=6)
    assert len(png) < len(pillow.getvalue())
    odd = np.arange(3 * 7, dtype=np.uint8).reshape(3, 7) % len(rf.PALETTE)
    assert (np.asarray(Image.open(io.BytesIO(rf.palette_png(odd)))) == odd).all()


def test_the_benchmarks_deflate_options_deflate_the_plots_own_rows(plant16):
    """bench/plots_bench.py's deflate_options compares zlib settings on the plot's own image
    data: at the plot's setting it gives exactly the size of the PNG's image data."""
    import struct
    import zlib

    from bench.plots_bench import deflate_options

    traces, units, run_id = plant16
    png = plots.run_figure_png(traces, units, f"run {run_id}")
    options = {(o["level"], o["strategy"], o["row_filter"]): o for o in deflate_options([png], repeat=1)}
    at = png.index(b"IDAT")
    (idat_bytes,) = struct.unpack(">I", png[at - 4 : at])
    assert options[6, "filtered", "none"]["kb"] == idat_bytes / 1e3
    assert options[6, "filtered", "up"]["kb"] != options[6, "filtered", "none"]["kb"]
    assert all(o["cpu_ms"]["median"] >= 0 for o in options.values())


def _title_ink(rgb: np.ndarray) -> np.ndarray:
    """The dark pixels of the title line (above the legend)."""
    return (rgb[: rf.TOP_PX - 30] < 100).all(axis=2)


def test_the_title_line_composed_from_glyphs_reads_as_matplotlib_draws_it(plant16):
    """The run's name and start time are laid out glyph by glyph from kept pixels: the same ink
    as matplotlib drawing the line whole (kerning may move a glyph by a pixel), glyphs whose
    boxes overlap ("ff", "fj") keep each other's ink, and the spot where new glyphs are first
    drawn is left white."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    traces, units, _ = plant16
    labels = tuple(plots._label(n, u) for n, u in zip(traces.node_ids, units))
    figure = rf.run_figure(labels)
    title = "run Off-fjord_17"
    ours = _title_ink(decode(figure.png(traces, title)))
    start = rf._utc(traces.t0_ms)
    line = f"started {start:%Y-%m-%d %H:%M:%S} UTC, {rf.duration(traces.span_ms)} long"
    with rf._no_antialiasing():
        fig = Figure(figsize=(figure.w_px / rf.DPI, figure.h_px / rf.DPI), dpi=rf.DPI, facecolor="white")
        canvas = FigureCanvasAgg(fig)
        width = canvas.get_renderer().get_text_width_height_descent
        bold = fig.text(0, 0, title, fontsize=rf.TITLE_PT, weight="bold", transform=None, va="baseline")
        x = rf.MARGIN_PX + width(title, bold.get_fontproperties(), False)[0] + 3 * figure.space["bold"]
        fig.text(x, 0, line, fontsize=rf.TITLE_PT, transform=None, va="baseline")
        for t, at in zip(fig.texts, (rf.MARGIN_PX, x)):
            t.set_position((at, figure.h_px - figure.title_baseline))
        canvas.draw()
        whole = _title_ink(np.asarray(canvas.buffer_rgba())[:, :, :3])
    assert ours.sum() == pytest.approx(whole.sum(), rel=0.02)
    rows, cols = np.nonzero(ours)
    rows_w, cols_w = np.nonzero(whole)
    assert abs(rows.min() - rows_w.min()) <= 1 and abs(rows.max() - rows_w.max()) <= 1
    assert abs(cols.min() - cols_w.min()) <= 1 and abs(cols.max() - cols_w.max()) <= 4
    # column by column (glyphs may sit a pixel apart), the ink matches
    assert np.abs(ours.sum(axis=0) - whole.sum(axis=0)).sum() <= 0.25 * whole.sum()
    assert not ours[:, figure.w_px - rf.RIGHT_PX - 5 * rf.TITLE_PT :].any()


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


@pytest.mark.parametrize("shape", [(4, 5, False), (16, 32, True)])
def test_overview_panels_share_their_x_axis_and_nothing_touches_the_edges(shape):
    """Laid out by hand: the panels' frames start and end in the same columns whatever the
    labels' lengths (a column dark over every panel's height is a frame edge or a split's line
    through all of them), and the labels, titles and scales stay inside the picture (its
    outermost pixels are white)."""
    from bench.plots_bench import overview_inputs

    nodes, runs, long_names = shape
    rows, node_ids, missing, outliers = overview_inputs(nodes, runs, long_names)
    rgb = decode(plots.dataset_overview_png(rows, node_ids, missing, outliers, title="reactor_a")).astype(int)
    assert rgb.shape[1] == plots.OVERVIEW_WIDTH_PX
    assert (rgb[:2] == 255).all() and (rgb[-2:] == 255).all() and (rgb[:, :2] == 255).all() and (rgb[:, -2:] == 255).all()
    panels_px = 2 * max(1.0, 0.14 * nodes) * plots.DPI + 1.3 * plots.DPI  # two heat maps, the windows
    through_all = np.flatnonzero(((rgb.sum(axis=2) < 100).sum(axis=0) >= panels_px))
    assert len(through_all) >= 2
    left, right = through_all[0], through_all[-1]
    assert (rgb[:, :left] < 100).all(axis=2).any()  # the node labels, left of the frames
    assert right > plots.OVERVIEW_WIDTH_PX * 0.8


def test_bins_never_mix_splits_and_cover_every_run():
    runs, _, _, _ = dataset(10_000)
    splits = [s for _, s, _ in runs]
    bins = plots._bins(splits, plots.OVERVIEW_COLUMNS)
    assert len(bins) <= plots.OVERVIEW_COLUMNS
    assert bins[0][1] == 0 and bins[-1][2] == len(splits)
    assert all(a[2] == b[1] for a, b in zip(bins, bins[1:]))  # contiguous, no overlap
    assert all(len({splits[i] for i in range(lo, hi)}) == 1 and splits[lo] == s for s, lo, hi in bins)
    assert plots._bins(splits[:300], plots.OVERVIEW_COLUMNS) == [(s, i, i + 1) for i, s in enumerate(splits[:300])]


def test_overview_columns_are_labelled_by_run_id():
    runs, _, _, _ = dataset(30)
    ids = [r for r, _, _ in runs]
    positions, labels, step = plots.run_ticks(ids, plots._bins([s for _, s, _ in runs], plots.OVERVIEW_COLUMNS))
    assert (labels, positions, step) == (ids, [i + 0.5 for i in range(30)], 1)  # every run, under its column
    runs, _, _, _ = dataset(10_000)
    ids = [r for r, _, _ in runs]
    bins = plots._bins([s for _, s, _ in runs], plots.OVERVIEW_COLUMNS)
    positions, labels, step = plots.run_ticks(ids, bins)
    assert len(labels) <= plots.OVERVIEW_LABELS and step > 1
    assert labels[0] == ids[0] + "…" and all(label.removesuffix("…") in ids for label in labels)
    assert positions == [(a + b) / 2 for _, a, b in bins[::step]]


def test_overview_names_a_bad_shape_or_split():
    runs, nodes, missing, _ = dataset(5)
    with pytest.raises(ValueError, match="missing ratio has shape"):
        plots.dataset_overview_png(runs, nodes, missing[:, :3])
    with pytest.raises(ValueError, match="unknown split 'holdout'"):
        plots.dataset_overview_png([("R1", "holdout", 3)])
