"""Plots for the Dagster UI, as PNG data URIs in markdown metadata.

* **Per run** (:func:`run_figure_png`): a strip chart of a :class:`~aml_pipeline.core.traces.RunTraces`
  (the run summarised per node and pixel column while it streams, never its points): one band
  per node labelled ``node [unit]`` with its value scale, a shared time axis since the run's
  start, raw points, the cleaned grid, removed outliers and gaps in distinct colours, a legend.
  It is drawn for every run of every backfill, so it has a budget for a 16-node run: 20 ms, and
  30 KB of event log (which SQLite fills with each event twice: about 14 KB of markdown), both
  measured by ``bench/plots_bench.py``. So:

  - matplotlib draws what does not change between runs of a dataset (frame, band separators,
    legend, axis caption) once per list of labels, kept as palette indices;
  - per run, numpy paints the data layer into a copy of it (a trace is one value range per pixel
    column, so this is exact; matplotlib's artists for 16 bands cost about 100 ms), and Pillow's
    FreeType stamps the texts in matplotlib's font, hinted and not antialiased (matplotlib
    renders text at about 0.1 ms per glyph, and antialiased text doubles the PNG);
  - the 10-colour image is written as a 4-bit PNG with unfiltered rows (:func:`_png`).
* **Per dataset** (:func:`dataset_overview_png`): missing ratio and outlier ratio as runs x nodes
  heat maps above windows per run coloured by split, drawn by matplotlib; beyond 600 runs, runs
  are aggregated into bins (within a split, never across), so 10,000 runs stay legible.
"""

from __future__ import annotations

import base64
import datetime as _dt
import io
import math
import struct
import threading
import warnings
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from aml_pipeline.core.traces import RunTraces
from aml_pipeline.errors import BuildError
from aml_pipeline.pipeline.stages import GRID as GRID_STAGE
from aml_pipeline.pipeline.store import DatasetStore

# ---- colours ----------------------------------------------------------------------------------

SPLIT_COLOURS = {"train": "#1f77b4", "val": "#ff7f0e", "test": "#2ca02c", "excluded": "#9e9e9e"}

# The run figure's palette (a 4-bit PNG): what the data layer paints, then greys for text and lines.
WHITE, RAW, GRID, OUTLIER, GAP, PARTIAL_GAP, BLACK, GREY_DARK, GREY_MID, GREY_LIGHT = range(10)
PALETTE = np.array(
    [
        (255, 255, 255),  # background
        (178, 178, 178),  # raw points
        (31, 119, 180),  # cleaned grid
        (214, 39, 40),  # removed outliers
        (253, 200, 150),  # a column whose grid rows are all missing
        (254, 232, 212),  # a column with some missing grid rows
        (0, 0, 0),  # title, labels, ticks
        (80, 80, 80),  # band scales
        (110, 110, 110),
        (195, 195, 195),
    ],
    np.uint8,
)
# What matplotlib's antialiased drawing (frame, separators, legend) is reduced to: two greys
# smooth it well enough and cost a third of the PNG bytes of nine.
STATIC_COLOURS = (WHITE, RAW, GRID, OUTLIER, GAP, PARTIAL_GAP, BLACK, GREY_MID, GREY_LIGHT)

# ---- run figure layout (pixels) ---------------------------------------------------------------

DPI = 100
FONT_PT = 7
BAND_PX = 15  # height of one node's band (the PNG's size grows with it: see _png)
PAD_PX = 2  # inside a band, between the data's range and the band's edges
EDGE = 2  # rows at a band's top and bottom kept free for the separator lines
RIGHT_PX, TOP_PX, BOTTOM_PX = 16, 36, 18
SCALE_PX = 84  # room for a band's scale ("-12.3 … 56.8") left of the data
MAX_LABEL_CHARS = 28


def data_uri_markdown(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


# ---- per run ----------------------------------------------------------------------------------


def _fmt(v: float) -> str:
    """A scale value in 3 significant digits (what a band of 12 pixels resolves)."""
    return f"{v:.3g}" if math.isfinite(v) else "?"


def _time_ticks(span_ms: float) -> tuple[float, str, np.ndarray]:
    """Unit (ms per unit), its name and tick positions (in units) for a run of ``span_ms``."""
    for ms, name, limit in ((1_000, "s", 120_000), (60_000, "min", 7_200_000), (3_600_000, "h", 172_800_000)):
        if span_ms <= limit:
            break
    else:
        ms, name = 86_400_000, "d"
    extent = span_ms / ms
    raw_step = extent / 5
    mag = 10 ** math.floor(math.log10(raw_step)) if raw_step > 0 else 1
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw_step)
    return ms, name, np.arange(0, extent + 1e-9, step)


def _nearest_palette(rgb: np.ndarray, allowed: Sequence[int]) -> np.ndarray:
    """Per pixel (``[..., 3]`` uint8), the index of the nearest of the ``allowed`` palette colours."""
    allowed = np.asarray(allowed)
    # One 24-bit key per pixel: a 1-D unique is about 10x faster than unique rows (measured: it
    # was 0.2 s of every process's first figure).
    packed = rgb.reshape(-1, 3).astype(np.uint32)
    keys, inverse = np.unique((packed[:, 0] << 16) | (packed[:, 1] << 8) | packed[:, 2], return_inverse=True)
    colours = np.stack([keys >> 16, (keys >> 8) & 0xFF, keys & 0xFF], axis=1).astype(np.int32)
    d = ((colours[:, None, :] - PALETTE[allowed][None, :, :].astype(np.int32)) ** 2).sum(axis=2)
    return allowed[np.argmin(d, axis=1)].astype(np.uint8)[inverse.reshape(-1)].reshape(rgb.shape[:-1])


@dataclass
class _RunLayout:
    """The static part of the run figure for one list of node labels, drawn by matplotlib once
    and kept as palette indices; every run with the same labels reuses it."""

    background: np.ndarray  # [h, w] palette indices
    x0: int  # data area: columns x0 .. x0 + width - 1, rows y0 .. y0 + n * BAND_PX - 1
    y0: int
    width: int
    n: int


_LOCK = threading.Lock()  # the layout cache and matplotlib are shared by threads


@lru_cache(maxsize=8)
def _run_layout(labels: tuple[str, ...], width: int) -> _RunLayout:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = len(labels)
    # left margin: the longest label, then the scale
    left = 10 + int(max((_font("bold").getlength(label) for label in labels), default=0)) + SCALE_PX
    w_px = left + width + RIGHT_PX
    h_px = TOP_PX + n * BAND_PX + BOTTOM_PX
    fig = Figure(figsize=(w_px / DPI, h_px / DPI), dpi=DPI, facecolor="white")
    canvas = FigureCanvasAgg(fig)
    # Axes in pixel units, y down from the top of the first band: band i is [i*B, (i+1)*B].
    ax = fig.add_axes((left / w_px, BOTTOM_PX / h_px, width / w_px, n * BAND_PX / h_px))
    ax.set_xlim(0, width)
    ax.set_ylim(n * BAND_PX, 0)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_color("#505050")
        spine.set_linewidth(0.8)
    ax.patch.set_alpha(0.0)
    for i in range(1, n):
        ax.axhline(i * BAND_PX, color="#a0a0a0", linewidth=0.6)
    ax.text(-5, n * BAND_PX + 5, "time since run start", ha="right", va="top", fontsize=FONT_PT, color="#505050")
    colour = lambda i: PALETTE[i] / 255  # noqa: E731
    fig.legend(
        handles=[
            Line2D([], [], color=colour(RAW), linewidth=3, label="raw points off the cleaned line"),
            Line2D([], [], color=colour(GRID), linewidth=1.2, label="cleaned grid"),
            Line2D([], [], color=colour(OUTLIER), marker="|", linestyle="none", markersize=5, markeredgewidth=1.2, label="removed outlier"),
            Patch(color=colour(GAP), label="gap (missing grid rows)"),
        ],
        loc="upper left",
        bbox_to_anchor=(4 / w_px, 1 - 18 / h_px),
        ncol=4,
        fontsize=FONT_PT,
        frameon=False,
        handlelength=1.6,
        columnspacing=1.2,
        borderaxespad=0.0,
        borderpad=0.0,
    )
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    background = _nearest_palette(rgba[:, :, :3], STATIC_COLOURS)
    for i, label in enumerate(labels):
        _stamp(background, label, 6, TOP_PX + (i + 0.5) * BAND_PX, "lm", BLACK, weight="bold")
    return _RunLayout(background, left, TOP_PX, width, n)


@lru_cache(maxsize=2)
def _font(weight: str = "normal"):
    """matplotlib's default font (DejaVu Sans) at FONT_PT, for Pillow."""
    from matplotlib import font_manager
    from PIL import ImageFont

    path = font_manager.findfont(font_manager.FontProperties(family="DejaVu Sans", weight=weight))
    return ImageFont.truetype(path, size=round(FONT_PT * DPI / 72))


@lru_cache(maxsize=4096)
def _text_mask(text: str, anchor: str, weight: str = "normal") -> tuple[np.ndarray, int, int]:
    """The pixels of ``text`` (hinted, not antialiased: half the PNG bytes of antialiased text)
    and their offset from the anchor point, rendered by Pillow's FreeType."""
    mask, (dx, dy) = _font(weight).getmask2(text, mode="1", anchor=anchor)
    w, h = mask.size
    return np.frombuffer(bytes(mask), np.uint8).reshape(h, w) > 0, dx, dy


def _stamp(index: np.ndarray, text: str, x: float, y: float, anchor: str, ink: int = GREY_DARK, *,
           weight: str = "normal") -> None:
    """Write ``text`` in palette colour ``ink`` into a palette-index image at the anchor point
    (x, y); Pillow anchors: ``la`` left-top, ``lm``/``rm`` left/right-middle, ``ma`` middle-top."""
    mask, dx, dy = _text_mask(text, anchor, weight)
    h, w = mask.shape
    x0, y0 = int(round(x)) + dx, int(round(y)) + dy
    xa, ya = max(x0, 0), max(y0, 0)
    xb, yb = min(x0 + w, index.shape[1]), min(y0 + h, index.shape[0])
    if xa < xb and ya < yb:
        index[ya:yb, xa:xb][mask[ya - y0 : yb - y0, xa - x0 : xb - x0]] = ink


@contextmanager
def _quiet_nan() -> Iterator[None]:
    """Silences numpy's all-NaN slice warnings (an empty column is expected, not a problem)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _band_scale(traces: RunTraces) -> tuple[np.ndarray, np.ndarray]:
    """Per node: the values at the bottom and at the top of its band (the cleaned grid's range;
    the raw range where the grid has no value), padded by 8 %."""
    with _quiet_nan(), np.errstate(all="ignore"):
        lo = np.nanmin(traces.grid_min, axis=1).astype(np.float64)
        hi = np.nanmax(traces.grid_max, axis=1).astype(np.float64)
        none = ~np.isfinite(lo)
        if none.any():
            lo[none] = np.nanmin(traces.raw_min[none], axis=1)
            hi[none] = np.nanmax(traces.raw_max[none], axis=1)
    lo, hi = np.where(np.isfinite(lo), lo, 0.0), np.where(np.isfinite(hi), hi, 1.0)
    pad = np.where(hi > lo, (hi - lo) * 0.08, np.maximum(np.abs(lo) * 0.05, 0.5))
    return lo - pad, hi + pad


def _paint(traces: RunTraces, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The data layer as palette indices ``[n * BAND_PX, width]`` (0 where nothing is drawn),
    for every node at once."""
    n, w = len(traces.node_ids), traces.width
    img = np.zeros((n, BAND_PX, w), np.uint8)
    inside = slice(EDGE, BAND_PX - EDGE)
    miss, rows_ = traces.grid_missing, traces.grid_rows
    shade = np.where((miss > 0) & (miss == rows_), GAP, np.where(miss > 0, PARTIAL_GAP, WHITE)).astype(np.uint8)
    img[:, inside, :] = shade[:, None, :]

    scale = (BAND_PX - 2 * PAD_PX) / (hi - lo)  # px per unit, per node

    def rows(v: np.ndarray) -> np.ndarray:
        """Pixel row inside the band (0 = top) of values ``[n, w]``; NaN stays NaN."""
        with np.errstate(invalid="ignore"):
            return np.clip(PAD_PX + (hi[:, None] - v.astype(np.float64)) * scale[:, None], EDGE, BAND_PX - 1 - EDGE)

    band_rows = np.arange(BAND_PX, dtype=np.float64)[None, :, None]

    def fill(top: np.ndarray, bottom: np.ndarray, colour: int) -> None:
        with np.errstate(invalid="ignore"):
            t = np.clip(np.floor(np.fmin(top, bottom)), EDGE, BAND_PX - 1 - EDGE)
            b = np.clip(np.ceil(np.fmax(top, bottom)), EDGE, BAND_PX - 1 - EDGE)
        t[np.isnan(t)] = BAND_PX  # no value in the column: nothing drawn
        img[(band_rows >= t[:, None, :]) & (band_rows <= b[:, None, :])] = colour

    # raw: the column's min..max; the grid drawn over it leaves it visible where raw points lie
    # off the cleaned line (removed, bad or beyond the scale) or where the grid has a gap
    fill(rows(traces.raw_max), rows(traces.raw_min), RAW)
    # grid: min..max, joined to the previous column so a steep step stays one stroke; a column
    # without a grid value stays open (a gap)
    g_top, g_bot = rows(traces.grid_max), rows(traces.grid_min)
    p_top, p_bot = np.roll(g_top, 1, axis=1), np.roll(g_bot, 1, axis=1)
    p_top[:, 0] = np.nan
    p_bot[:, 0] = np.nan
    joined = np.isfinite(g_top) & np.isfinite(p_top)
    fill(np.where(joined, np.fmin(g_top, p_bot), g_top), np.where(joined, np.fmax(g_bot, p_top), g_bot), GRID)
    # removed outliers: a 3-pixel red tick at the column's smallest and largest removed value
    node, col = np.nonzero(traces.removed_count > 0)
    if node.size:
        ys = np.rint(np.concatenate([rows(traces.removed_min)[node, col], rows(traces.removed_max)[node, col]])).astype(int)
        xs, ns = np.concatenate([col, col]), np.concatenate([node, node])
        for d in (-1, 0, 1):
            img[ns, np.clip(ys + d, EDGE, BAND_PX - 1 - EDGE), xs] = OUTLIER
    return img.reshape(n * BAND_PX, w)


def _png(index: np.ndarray) -> bytes:
    """A palette-index image (values < 16) as a 4-bit indexed PNG, every row unfiltered.

    Written here rather than with Pillow, which filters every row adaptively: for a palette
    image that gives 15 % more bytes in 4 times the time (measured on the benchmark's runs).
    """
    h, w = index.shape
    even = np.pad(index, ((0, 0), (0, w % 2)))
    packed = (even[:, 0::2] << 4) | even[:, 1::2]
    rows = np.concatenate([np.zeros((h, 1), np.uint8), packed.astype(np.uint8)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 4, 3, 0, 0, 0))
        + chunk(b"PLTE", PALETTE.tobytes())
        # Level 7: on a 16-node run, 10.3 KB in 2.2 ms, where level 8 with the "filtered" strategy
        # gives 9.9 KB in 6.1 ms and level 6 10.6 KB, too much for the event log's 30 KB per run.
        # A build draws one figure per run, so the time counts in the orchestration budget.
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 7))
        + chunk(b"IEND", b"")
    )


def _label(node_id: str, unit: str) -> str:
    label = f"{node_id} [{unit}]" if unit else node_id
    return label if len(label) <= MAX_LABEL_CHARS else label[: MAX_LABEL_CHARS - 1] + "…"


def _utc(ms: int) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.timezone.utc)


def run_figure_png(traces: RunTraces, units: Sequence[str], title: str) -> bytes:
    """The run's strip chart as PNG bytes: a band per node labelled ``node [unit]`` with its value
    scale (bottom … top), time since the run's start below, ``title`` and the UTC span on top."""
    if len(units) != len(traces.node_ids):
        raise ValueError(f"run_figure_png: {len(units)} units for {len(traces.node_ids)} nodes")
    labels = tuple(_label(n, u) for n, u in zip(traces.node_ids, units))
    with _LOCK:
        layout = _run_layout(labels, traces.width)
    lo, hi = _band_scale(traces)
    ms, unit, ticks = _time_ticks(traces.span_ms)
    ticks_x = ticks * ms / traces.span_ms * traces.width

    index = layout.background.copy()
    data = _paint(traces, lo, hi)
    region = index[layout.y0 : layout.y0 + data.shape[0], layout.x0 : layout.x0 + data.shape[1]]
    np.copyto(region, data, where=data != WHITE)

    start, end = _utc(traces.t0_ms), _utc(traces.t1_ms)
    span = f"{start:%Y-%m-%d %H:%M:%S} → {end:%H:%M:%S}" if start.date() == end.date() else f"{start:%Y-%m-%d %H:%M} → {end:%Y-%m-%d %H:%M}"
    _stamp(index, f"{title}   {span} UTC ({traces.span_ms / ms:.3g} {unit})", 6, 3, "la", BLACK)
    for i, (a, b) in enumerate(zip(lo, hi)):
        _stamp(index, f"{_fmt(a)} … {_fmt(b)}", layout.x0 - 5, layout.y0 + (i + 0.5) * BAND_PX, "rm")
    bottom = layout.y0 + layout.n * BAND_PX
    tick_cols = layout.x0 + np.clip(np.rint(ticks_x).astype(int), 0, traces.width - 1)
    index[bottom + 1 : bottom + 4, tick_cols] = BLACK
    for i, (t, x) in enumerate(zip(ticks, ticks_x)):
        _stamp(index, f"{t:g}" + (f" {unit}" if i == len(ticks) - 1 else ""), layout.x0 + x, bottom + 5, "ma", BLACK)
    return _png(index)


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
        f"One band per node, scaled to its cleaned range (raw values beyond it are drawn at the "
        f"band's edge); {outliers} outlier{'s' if outliers != 1 else ''} removed."
    )


# ---- per dataset ------------------------------------------------------------------------------

OVERVIEW_COLUMNS = 600  # at most this many run columns; more runs are binned


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
    bin's mean windows per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

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

    heights = [max(1.0, 0.14 * len(nodes))] * len(heat) + [1.3]
    fig = Figure(figsize=(8.4, 0.5 + sum(heights) + 0.45 * len(heights)), dpi=DPI, facecolor="white", layout="constrained")
    canvas = FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(len(heights), 1, sharex=True, height_ratios=heights))
    cell = "worst run per bin" if binned else "per run"
    for ax, (m, name, cmap) in zip(axes, heat):
        m = np.nan_to_num(np.asarray(m, np.float64), nan=0.0)
        worst = np.maximum.reduceat(m, starts, axis=0).T if n else np.zeros((len(nodes), 0))
        mesh = ax.pcolormesh(edges, np.arange(len(nodes) + 1), worst, cmap=cmap, vmin=0, vmax=max(float(worst.max(initial=0.0)), 1e-9))
        ax.set_yticks(np.arange(len(nodes)) + 0.5, nodes, fontsize=FONT_PT - (1 if len(nodes) > 24 else 0))
        ax.set_ylim(len(nodes), 0)
        ax.set_title(f"{name} per node ({cell})", fontsize=FONT_PT + 1, loc="left")
        fig.colorbar(mesh, ax=ax, pad=0.01, fraction=0.025).ax.tick_params(labelsize=FONT_PT - 1)
    ax = axes[-1]
    for split, lo, hi in _split_spans([s for s, _, _ in bins]):
        ax.stairs(means[lo:hi], edges[lo : hi + 1], fill=True, color=SPLIT_COLOURS[split], linewidth=0)
    if heat:  # an invisible colour bar keeps the x axes of all panels aligned
        fig.colorbar(mesh, ax=ax, pad=0.01, fraction=0.025).ax.set_visible(False)
    ax.set_title("windows per run" + (" (mean per bin)" if binned else ""), fontsize=FONT_PT + 1, loc="left")
    ax.tick_params(labelsize=FONT_PT)
    ax.set_xlim(0, max(n, 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(float(means.max(initial=0.0)) * 1.05, 1.0))
    ax.set_xlabel("runs in snapshot order" + (f" ({len(bins)} bins of up to {int(sizes.max())} runs)" if binned else ""), fontsize=FONT_PT)
    counts = {s: splits.count(s) for s in SPLIT_COLOURS}
    ax.legend(
        handles=[Patch(color=c, label=f"{s} ({counts[s]} run{'s' if counts[s] != 1 else ''})") for s, c in SPLIT_COLOURS.items() if counts[s]],
        fontsize=FONT_PT, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, frameon=False, borderaxespad=0.2,
    )
    for a in axes:
        for _, lo, _ in _split_spans(splits)[1:]:
            a.axvline(lo, color="black", linewidth=0.7)
    if title:
        fig.suptitle(title, fontsize=FONT_PT + 2, x=0.01, ha="left")
    canvas.draw()
    return _rgba_png(np.asarray(canvas.buffer_rgba()))


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

    im = Image.fromarray(np.ascontiguousarray(rgba[:, :, :3])).quantize(
        colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE
    )
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
