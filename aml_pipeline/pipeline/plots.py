"""Plots for the Dagster UI, as PNG data URIs in markdown metadata.

* **Per run** (:func:`run_figure_png`): a strip chart of a :class:`~aml_pipeline.core.traces.RunTraces`
  (the run summarised per node and pixel column while it streams, never its points): one band
  per node labelled ``node [unit]`` with its value scale, a shared time axis since the run's
  start, raw points, the cleaned grid, removed outliers and gaps in distinct colours, a legend.
  It is drawn for every run of every build, so :mod:`aml_pipeline.pipeline.run_figure` keeps one
  matplotlib figure per list of node labels and redraws only what changes.
* **Per dataset** (:func:`dataset_overview_png`): missing ratio and outlier ratio as runs x nodes
  heat maps above windows per run coloured by split, drawn by matplotlib; beyond 600 runs, runs
  are aggregated into bins (within a split, never across), so 10,000 runs stay legible.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence

import numpy as np

from aml_pipeline.core.traces import RunTraces
from aml_pipeline.errors import BuildError
from aml_pipeline.pipeline.run_figure import run_png
from aml_pipeline.pipeline.registry import GRID as GRID_STAGE
from aml_pipeline.pipeline.store import DatasetStore

# ---- colours and layout -----------------------------------------------------------------------

SPLIT_COLOURS = {"train": "#1f77b4", "val": "#ff7f0e", "test": "#2ca02c", "excluded": "#9e9e9e"}
DPI = 100
FONT_PT = 7
MAX_LABEL_CHARS = 28
# the overview's layout, pixels at DPI
OVERVIEW_WIDTH_PX = 840
MARGIN_PX = 6  # around the figure's texts
TITLE_GAP_PX = 4  # between a title line and what is below it
PANEL_GAP_PX = 10  # between a panel's tick marks and the next panel's title
TICK_PX = TICK_PAD_PX = 5  # matplotlib's default tick length and label padding (3.5 pt)
TICK_WIDTH_PT = 0.8  # matplotlib's default tick width
COLOUR_BAR_PX, COLOUR_BAR_GAP_PX = 12, 8
LEGEND_GAP_PX = 16  # at least between the last panel's title and the legend beside it


def data_uri_markdown(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


# ---- per run ----------------------------------------------------------------------------------


def _label(node_id: str, unit: str) -> str:
    label = f"{node_id} [{unit}]" if unit else node_id
    return label if len(label) <= MAX_LABEL_CHARS else label[: MAX_LABEL_CHARS - 1] + "…"


def run_figure_png(traces: RunTraces, units: Sequence[str], title: str) -> bytes:
    """The run's strip chart as PNG bytes (:mod:`aml_pipeline.pipeline.run_figure`): a band per
    node labelled ``node [unit]`` with its scale, time since the run's start below, ``title``
    and the run's UTC start and end on top."""
    if len(units) != len(traces.node_ids):
        raise ValueError(f"run_figure_png: {len(units)} units for {len(traces.node_ids)} nodes")
    return run_png(traces, [_label(n, u) for n, u in zip(traces.node_ids, units)], title)


def stored_run_figure_png(store: DatasetStore, run_id: str) -> bytes:
    """The run's strip chart, as its ``plot`` metadata shows it, drawn from what the last build of
    its cleaned grid stored (the traces are stored whether or not the build drew the plot)."""
    meta = store.read_meta(run_id, GRID_STAGE)
    path = store.file_path(run_id, GRID_STAGE, "traces.npz")
    if meta is None or not path.is_file():
        raise BuildError(
            f"run {run_id!r} of spec {store.spec_id!r}: no cleaned grid stored in {store.run_dir(run_id)}; "
            "build the spec first", code="NOT_BUILT",
        )
    traces = RunTraces.load(path)
    units = meta.get("units", {})
    return run_figure_png(traces, [units.get(n, "") for n in traces.node_ids], f"run {run_id}")


def run_traces_markdown(traces: RunTraces, units: Sequence[str], run_id: str) -> str:
    """Markdown for a run's ``plot`` metadata: the strip chart and one line of reading help."""
    png = run_figure_png(traces, units, f"run {run_id}")
    outliers = int(traces.removed_count.sum())
    return (
        f"{data_uri_markdown(png, f'run {run_id}')}\n\n"
        f"One band per node on a round scale around its cleaned values (raw values beyond it are "
        f"drawn at the band's edge); {outliers} outlier{'s' if outliers != 1 else ''} removed."
    )


# ---- per dataset ------------------------------------------------------------------------------

OVERVIEW_COLUMNS = 600  # at most this many run columns; more runs are binned
OVERVIEW_LABELS = 40  # at most this many run ids under the columns


def _bins(splits: Sequence[str], max_columns: int) -> list[tuple[str, int, int]]:
    """Consecutive runs grouped into (split, start, stop) bins: one run each while they fit in
    ``max_columns``, else bins of one size within each split (never across splits), at most
    ``max_columns`` in all."""
    if len(splits) <= max_columns:
        return [(s, i, i + 1) for i, s in enumerate(splits)]
    spans = _split_spans(splits)
    size = math.ceil(len(splits) / max(1, max_columns - len(spans)))
    return [(s, a, min(a + size, b)) for s, lo, b in spans for a in range(lo, b, size)]


def dataset_overview_png(
    runs: Sequence[tuple[str, str, int]],
    node_ids: Sequence[str] | None = None,
    missing: np.ndarray | None = None,
    outliers: np.ndarray | None = None,
    *,
    title: str = "",
) -> bytes:
    """Runs in snapshot order (``runs``: run id, split, windows; split one of train, val, test,
    excluded): heat maps of the missing ratio and the outlier ratio per run and node
    (``[runs, nodes]`` each, optional) above windows per run coloured by split. Beyond 600 runs,
    runs are binned within their split: a heat-map cell shows the bin's worst run, a bar the
    bin's mean windows per run.

    Laid out by hand rather than by matplotlib's constrained layout, which measures every text of
    every axis several times per drawing: each margin is as wide as the texts that go in it,
    measured once each (:class:`_Texts`); the panels keep their heights whatever the labels (the
    figure grows instead); every panel has the same left and right edges, so their x axes line
    up."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    n = len(runs)
    splits = [s for _, s, _ in runs]
    unknown = sorted(set(splits) - set(SPLIT_COLOURS))
    if unknown:
        raise ValueError(f"dataset_overview_png: unknown split {unknown[0]!r}; use {', '.join(SPLIT_COLOURS)}")
    nodes = list(node_ids or [])
    heat = [(m, name, cmap) for m, name, cmap in ((missing, "missing ratio", "Oranges"), (outliers, "outlier ratio", "Purples")) if m is not None]
    for m, name, _ in heat:
        if np.shape(m) != (n, len(nodes)):
            raise ValueError(f"dataset_overview_png: {name} has shape {np.shape(m)}, expected ({n}, {len(nodes)})")
    bins = _bins(splits, OVERVIEW_COLUMNS)
    binned = any(b - a > 1 for _, a, b in bins)
    edges = np.array([a for _, a, _ in bins] + [n], np.float64)
    windows = np.asarray([w for _, _, w in runs], np.float64)
    starts = np.array([a for _, a, _ in bins], np.intp)
    sizes = np.diff(edges)
    means = np.add.reduceat(windows, starts) / sizes if n else np.zeros(0)
    positions, labels, step = run_ticks([r for r, _, _ in runs], bins)
    cell = "worst run per bin" if binned else "per run"
    titles = [f"{name} per node ({cell})" for _, name, _ in heat] + ["windows per run" + (" (mean per bin)" if binned else "")]
    notes = [f"{len(bins)} bins of up to {int(sizes.max())} runs, each by its first run"] if binned else []
    notes += [f"every {step}th column labelled"] if step > 1 else []
    xlabel = "runs in snapshot order, by run id" + (f" ({'; '.join(notes)})" if notes else "")
    counts = {s: splits.count(s) for s in SPLIT_COLOURS}
    node_pt = FONT_PT - (1 if len(nodes) > 24 else 0)
    texts = _Texts()

    # The panels first, at their heights in pixels (their scales' ticks depend on them), in a
    # figure of a provisional height; placed once the margins are known.
    width = OVERVIEW_WIDTH_PX
    heights = [max(1.0, 0.14 * len(nodes)) * DPI] * len(heat) + [1.3 * DPI]
    fig = Figure(figsize=(width / DPI, sum(heights) / DPI + 1), dpi=DPI, facecolor="white")
    canvas = FigureCanvasAgg(fig)

    def place(a, x0: float, top: float, x1: float, h: float) -> None:
        fig_h = fig.bbox.height
        a.set_position([x0 / width, 1 - (top + h) / fig_h, (x1 - x0) / width, h / fig_h])

    axes = [fig.add_axes((0, 0, 1, 1)) for _ in heights]
    bars = [fig.add_axes((0, 0, 1, 1)) for _ in heat]
    for a, cax, h in zip(axes, bars, heights):
        place(a, 0, 0, width, h)
        place(cax, 0, 0, COLOUR_BAR_PX, h)
    for ax, cax, (m, name, cmap) in zip(axes, bars, heat):
        m = np.nan_to_num(np.asarray(m, np.float64), nan=0.0)
        worst = np.maximum.reduceat(m, starts, axis=0).T if n else np.zeros((len(nodes), 0))
        mesh = ax.pcolormesh(edges, np.arange(len(nodes) + 1), worst, cmap=cmap, vmin=0, vmax=max(float(worst.max(initial=0.0)), 1e-9))
        ax.set_ylim(len(nodes), 0)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(mesh, cax=cax).ax.tick_params(labelsize=FONT_PT - 1)
        cax.yaxis.offsetText.set_fontsize(FONT_PT - 1)  # a scale's factor ("1e-9"), above the bar
    ax = axes[-1]
    for split, lo, hi in _split_spans([s for s, _, _ in bins]):
        ax.stairs(means[lo:hi], edges[lo : hi + 1], fill=True, color=SPLIT_COLOURS[split], linewidth=0)
    ax.tick_params(labelsize=FONT_PT)
    ax.set_xticks([])
    ax.set_ylim(0, max(float(means.max(initial=0.0)) * 1.05, 1.0))
    for a in axes:
        a.set_xlim(0, max(n, 1))
        for _, lo, _ in _split_spans(splits)[1:]:
            a.axvline(lo, color="black", linewidth=0.7)
    legend = fig.legend(
        handles=[Patch(color=c, label=f"{s} ({counts[s]} run{'s' if counts[s] != 1 else ''})") for s, c in SPLIT_COLOURS.items() if counts[s]],
        fontsize=FONT_PT, loc="lower right", ncol=4, frameon=False, borderaxespad=0.0,
    )
    legend_box = legend.get_window_extent(texts.renderer)

    # Left to right: the node labels and the windows' scale, the panels, the colour bars and
    # their scales (the windows panel as wide as the heat maps beside them).
    tick = TICK_PX + TICK_PAD_PX
    scale_px = max((texts.width(v.get_text(), FONT_PT) for v in ax.yaxis.get_majorticklabels()), default=0)
    left = MARGIN_PX + max([scale_px] + [texts.width(s, node_pt) for s in nodes if heat]) + tick
    right = width - MARGIN_PX
    if bars:
        bar_scale_px = max(texts.width(v.get_text(), FONT_PT - 1) for cax in bars for v in cax.yaxis.get_majorticklabels())
        right -= bar_scale_px + tick + COLOUR_BAR_PX + COLOUR_BAR_GAP_PX

    # Top to bottom: the title; per panel its title line (the last one's with the legend at its
    # right, or on a line of its own above where both do not fit), the panel and its tick marks;
    # under the last the run ids and the axis label.
    y = MARGIN_PX + (texts.height(title, FONT_PT + 2) + TITLE_GAP_PX if title else 0)
    tops = []
    for i, (panel_title, h) in enumerate(zip(titles, heights)):
        line = texts.height(panel_title, FONT_PT + 1)
        if i == len(heights) - 1:
            beside = left + texts.width(panel_title, FONT_PT + 1) + LEGEND_GAP_PX + legend_box.width <= right
            legend_bottom = y + (max(line, legend_box.height) if beside else legend_box.height)
            line = max(line, legend_box.height) if beside else line + TITLE_GAP_PX + legend_box.height
        y += line + TITLE_GAP_PX
        tops.append(y)
        y += h + TICK_PX + PANEL_GAP_PX
    run_ids_px = max((texts.width(s, FONT_PT - 1) for s in labels), default=0)
    height = math.ceil(y - PANEL_GAP_PX + TICK_PAD_PX + run_ids_px + TICK_PAD_PX + texts.height(xlabel, FONT_PT) + MARGIN_PX)
    fig.set_size_inches(width / DPI, height / DPI)
    for a, top, h in zip(axes, tops, heights):
        place(a, left, top, right, h)
    for cax, top, h in zip(bars, tops, heights):
        place(cax, right + COLOUR_BAR_GAP_PX, top, right + COLOUR_BAR_GAP_PX + COLOUR_BAR_PX, h)
    # The node and run labels with their tick marks, drawn by hand: a matplotlib tick is five
    # artists with their properties looked up one by one, and there is one per node and run.
    panel_w = right - left
    for a, h in zip(axes, heights):
        along_x = blended_transform_factory(a.transData, a.transAxes)
        a.add_collection(LineCollection([[(x, 0), (x, -TICK_PX / h)] for x in positions], colors="black",
                                        linewidths=TICK_WIDTH_PT, transform=along_x, clip_on=False))
        if a is axes[-1]:
            for x, label in zip(positions, labels):
                a.text(x, -(TICK_PX + TICK_PAD_PX) / h, label, transform=along_x, fontsize=FONT_PT - 1, rotation=90,
                       ha="center", va="top", rotation_mode="default", clip_on=False)
        else:
            along_y = blended_transform_factory(a.transAxes, a.transData)
            rows = np.arange(len(nodes)) + 0.5
            a.add_collection(LineCollection([[(0, y), (-TICK_PX / panel_w, y)] for y in rows], colors="black",
                                            linewidths=TICK_WIDTH_PT, transform=along_y, clip_on=False))
            for y, node in zip(rows, nodes):
                a.text(-(TICK_PX + TICK_PAD_PX) / panel_w, y, node, transform=along_y, fontsize=node_pt, ha="right",
                       va="center_baseline", clip_on=False)
    legend.set_bbox_to_anchor((right / width, 1 - legend_bottom / height), transform=fig.transFigure)

    def text(x: float, y: float, s: str, pt: float, **kw) -> None:
        fig.text(x / width, 1 - y / height, s, fontsize=pt, **kw)

    if title:
        text(MARGIN_PX, MARGIN_PX, title, FONT_PT + 2, ha="left", va="top")
    for panel_title, top in zip(titles, tops):
        text(left, top - TITLE_GAP_PX, panel_title, FONT_PT + 1, ha="left", va="bottom")
    text((left + right) / 2, height - MARGIN_PX, xlabel, FONT_PT, ha="center", va="bottom")
    canvas.draw()
    return _rgba_png(np.asarray(canvas.buffer_rgba()))


class _Texts:
    """Sizes in pixels of one-line texts as matplotlib lays them out at DPI."""

    def __init__(self) -> None:
        from matplotlib.backends.backend_agg import RendererAgg

        self.renderer = RendererAgg(10, 10, DPI)

    def _size(self, text: str, pt: float) -> tuple[float, float]:
        from matplotlib.font_manager import FontProperties

        w, h, _ = self.renderer.get_text_width_height_descent(text, FontProperties(size=pt), False)
        return w, h

    def width(self, text: str, pt: float) -> float:
        return self._size(text, pt)[0]

    def height(self, text: str, pt: float) -> float:
        """A line's height: matplotlib's text box is at least as tall as "lp" (its ascent and descent)."""
        return max(self._size(text, pt)[1], self._size("lp", pt)[1])


def run_ticks(run_ids: Sequence[str], bins: Sequence[tuple[str, int, int]]) -> tuple[list[float], list[str], int]:
    """Where the overview labels its columns and with what: every ``step``-th column (at most
    OVERVIEW_LABELS) at its centre, by its run id (a bin by its first run, marked "…")."""
    step = max(1, math.ceil(len(bins) / OVERVIEW_LABELS))
    shown = bins[::step]
    return [(a + b) / 2 for _, a, b in shown], [run_ids[a] + ("…" if b - a > 1 else "") for _, a, b in shown], step


def _split_spans(splits: Sequence[str]) -> list[tuple[str, int, int]]:
    """Maximal runs of equal splits as (split, start, stop)."""
    spans: list[tuple[str, int, int]] = []
    for i, s in enumerate(splits):
        if spans and spans[-1][0] == s:
            spans[-1] = (s, spans[-1][1], i + 1)
        else:
            spans.append((s, i, i + 1))
    return spans


def _rgba_png(rgba: np.ndarray) -> bytes:
    """A matplotlib figure's pixels as a 256-colour PNG (Pillow's fast octree quantiser)."""
    from PIL import Image

    # Pillow drops the alpha channel in one pass in C, cheaper than numpy's copy of the strided RGB view
    im = Image.fromarray(rgba).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    # The octree merges white with its neighbours into an off-white: keep the background white.
    palette = np.array(im.getpalette(), np.uint8).reshape(-1, 3)
    palette[(palette >= 245).all(axis=1)] = 255
    im.putpalette(palette.reshape(-1).tolist())
    out = io.BytesIO()
    im.save(out, format="PNG", compress_level=6)
    return out.getvalue()


def dataset_overview_markdown(
    runs: Sequence[tuple[str, str, int]],
    node_ids: Sequence[str] | None = None,
    missing: np.ndarray | None = None,
    outliers: np.ndarray | None = None,
    *,
    title: str = "",
) -> str:
    """Markdown for a dataset's ``overview`` metadata (see :func:`dataset_overview_png`)."""
    png = dataset_overview_png(runs, node_ids, missing, outliers, title=title)
    return data_uri_markdown(png, "dataset overview")
