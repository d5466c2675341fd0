"""The per-run strip chart: one band per node, drawn from a run's traces into a palette image.

A :class:`~aml_pipeline.core.traces.RunTraces` summarises the run per node and pixel column
(min and max of the raw points, of the cleaned grid and of the removed outliers, and how many
grid rows are missing), so the chart draws one data column per pixel whatever the run's length:

* a band per node, labelled ``node [unit]``, its scale's top and bottom values beside the band's
  top and bottom edges (round values around the cleaned grid's range, so they read easily and
  repeat between runs);
* the cleaned grid as a 2 px line, the raw points in grey where the line does not cover them
  (points off the line, values beyond the band's scale at its edge), the removed outliers as red
  squares, and the columns with missing grid rows shaded (all missing, some missing);
* time since the run's start below, in the unit that fits the run's length; the run, its UTC
  start and its length on top; a legend.

The whole chart fits Dagster's metadata dialog (four fifths of the window, less its padding) on a
1366 x 768 screen for labels of up to about 16 characters and up to 17 nodes: a chart wider than
the dialog is cut at its right edge there, and a person sees no scroll bar to tell them; the
dialog's image starts about 110 px down the window, so the bands share what leaves the time axis
above the fold (more nodes, at their least band height, make it taller). Traces wider than the data
area (stored by an older build) are folded onto it (:meth:`RunTraces.folded`).

It is drawn for every run of every build (``bench/plots_bench.py`` measures its time and its
share of the event log), so one figure is kept per list of node labels and reused:

* matplotlib draws the node labels and the legend once, nothing antialiased, so every pixel is a
  palette colour: the figure keeps them as palette indices, with the frame and the band
  separators (the background);
* per run, the data are laid into a copy of it with numpy, a layer over the one before: time
  grid lines, partly missing columns, gaps, raw points, outliers, the cleaned grid, tick marks.
  Every mark is a rectangle on whole pixels (a column's raw points or its part of the cleaned
  line, a run of gap columns, an outlier's square, a time line), set on the pixels matplotlib
  filled for it when it drew the data (filled paths on pixel edges, not antialiased; its 3 pt
  square marker, which it snaps to OUTLIER_PX): the tests hold the figure to that drawing
  pixel for pixel;
* matplotlib lays out and renders text glyph by glyph, which costs more than the data: a text
  is drawn by matplotlib once, alone, kept as palette indices, and its ink laid where it is
  needed next; the title line, new for every run (the run's name, its start), is laid out from
  kept glyphs;
* the PNG is a 4-bit palette image (:func:`palette_png`): the long runs of equal pixels deflate
  well, and deflating them is most of what a run's chart costs.
"""

from __future__ import annotations

import datetime as _dt
import math
import struct
import threading
import warnings
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

import numpy as np

from aml_pipeline.core.traces import DEFAULT_WIDTH, RunTraces

# ---- colours: the PNG's palette -------------------------------------------------------------

COLOURS = {
    "background": "#ffffff",
    "raw": "#ababab",  # raw points as fetched, where the cleaned line does not cover them
    "grid": "#1f5fa8",  # the cleaned grid
    "outlier": "#e31a1c",  # points the Hampel filter removed
    "gap": "#fdb863",  # a column whose grid rows are all missing
    "partial_gap": "#fee6c6",  # a column with some missing grid rows
    "text": "#000000",
    "axis": "#555555",  # frame, tick marks, band scales
    "separator": "#d0d0d0",  # between bands
    "time_grid": "#eeeeee",  # lines across the bands at the time ticks
}
PALETTE = np.array([[int(h[i : i + 2], 16) for i in (1, 3, 5)] for h in COLOURS.values()], np.uint8)
WHITE, RAW, GRID, OUTLIER, GAP, PARTIAL_GAP, BLACK, AXIS, SEPARATOR, TIME_GRID = range(len(PALETTE))
# The palette index of a pixel from its green value alone: the colours' greens are at least
# MIN_GREEN_GAP apart (a test holds them to it), so Agg's rounding of a colour cannot blur two.
MIN_GREEN_GAP = 6
GREEN_TO_INDEX = np.argmin(np.abs(np.arange(256)[:, None] - PALETTE[None, :, 1].astype(int)), axis=1).astype(np.uint8)

# ---- layout (pixels at DPI) -------------------------------------------------------------------

DPI = 100
PLOT_PX = DEFAULT_WIDTH  # the data area's width: one trace column per pixel
MIN_LABEL_PX = 120  # the label column's least width: with it the chart is at least about 1,000 px wide
LABEL_PT, SCALE_PT, TICK_PT, TITLE_PT = 10, 9, 9, 12
TOP_PX, BOTTOM_PX, RIGHT_PX, MARGIN_PX = 62, 46, 24, 10
TITLE_TOP_PX = 8  # the title line's capitals start this far down
BANDS_PX = 520  # the bands' total height, each band within MIN_BAND_PX .. MAX_BAND_PX
MIN_BAND_PX, MAX_BAND_PX = 30, 120  # at 30 px a band's two scale values stay apart
EDGE_PX = 2  # rows at a band's top and bottom kept clear of data (values beyond the scale stop there)
MAX_TICKS = 12
MAX_TEXT_TILES = 2000  # texts kept as pixels, per figure
TILE_PAD_PX = 1
SCALE_GAP_PX = 5  # between a scale value and the frame
SCALE_EDGE_PX = 4  # between a scale value and its band's top or bottom edge
GLYPH_PAD_PX = 2
# An outlier's square: what matplotlib's 3 pt square marker covers at DPI (it snaps it to whole pixels)
OUTLIER_PX = 4


def band_px(n_nodes: int) -> int:
    """Height of one node's band: the bands share BANDS_PX, within MIN/MAX_BAND_PX each."""
    return int(min(MAX_BAND_PX, max(MIN_BAND_PX, BANDS_PX // max(n_nodes, 1))))


def _nice_step(raw_step: np.ndarray, mantissas: Sequence[float] = (1.0, 2.0, 5.0, 10.0)) -> np.ndarray:
    """Per element, the smallest of ``mantissas`` times a power of ten that is >= ``raw_step`` (> 0)."""
    mag = 10.0 ** np.floor(np.log10(raw_step))
    steps = np.asarray(mantissas)[None, :] * mag[:, None]
    return steps[np.arange(raw_step.size), np.argmax(steps >= raw_step[:, None] * (1 - 1e-9), axis=1)]


def _decimals(step: float) -> int:
    """Decimals that write every multiple of ``step`` (1, 2, 2.5 or 5 times a power of ten)."""
    e = math.floor(math.log10(step) + 1e-9)
    return max(0, -e + (1 if abs(step / 10.0**e - 2.5) < 1e-6 else 0))


def fmt(v: float, step: float) -> str:
    """A scale or tick value, a multiple of ``step``: fixed point where that is short, else
    three significant digits."""
    if not math.isfinite(v):
        return "?"
    if abs(v) < step * 1e-6:
        v = 0.0
    if v == 0 or 1e-3 <= abs(v) < 1e6:
        return f"{v:.{_decimals(step)}f}"
    return f"{v:.3g}"


def time_ticks(span_ms: float) -> tuple[float, str, np.ndarray]:
    """Unit (ms per unit), its name and tick positions (in units) for a run of ``span_ms``."""
    for ms, name, limit in ((1_000, "s", 180_000), (60_000, "min", 10_800_000), (3_600_000, "h", 259_200_000)):
        if span_ms <= limit:
            break
    else:
        ms, name = 86_400_000, "d"
    step = float(_nice_step(np.array([span_ms / ms / 8]), (1.0, 2.0, 2.5, 5.0, 10.0))[0])
    return ms, name, np.arange(0, span_ms / ms + 1e-9, step)[:MAX_TICKS]


def _utc(ms: int) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.timezone.utc)


def duration(ms: float) -> str:
    """A run's length in the largest unit of which it is at least two."""
    unit_ms, name = next((u, n) for u, n in ((86_400_000, "d"), (3_600_000, "h"), (60_000, "min"), (1_000, "s"))
                         if ms >= 2 * u or u == 1_000)
    return f"{ms / unit_ms:.3g} {name}"


@contextmanager
def _quiet_nan() -> Iterator[None]:
    """Silences numpy's all-NaN slice warnings (an empty column is expected, not a problem)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def band_scale(traces: RunTraces) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node: the values at the bottom and the top of its band, and their step: the cleaned
    grid's range (the raw range where the grid has no value) widened to multiples of a round
    step."""
    with _quiet_nan(), np.errstate(all="ignore"):
        lo = np.nanmin(traces.grid_min, axis=1).astype(np.float64)
        hi = np.nanmax(traces.grid_max, axis=1).astype(np.float64)
        none = ~np.isfinite(lo)
        if none.any():
            lo[none] = np.nanmin(traces.raw_min[none], axis=1)
            hi[none] = np.nanmax(traces.raw_max[none], axis=1)
    lo, hi = np.where(np.isfinite(lo), lo, 0.0), np.where(np.isfinite(hi), hi, 1.0)
    flat = hi - lo <= np.maximum(np.abs(lo), 1.0) * 1e-9
    half = np.maximum(np.abs(lo) * 0.05, 0.5)
    lo, hi = np.where(flat, lo - half, lo), np.where(flat, hi + half, hi)
    step = _nice_step((hi - lo) / 6)
    return np.floor(lo / step + 1e-9) * step, np.ceil(hi / step - 1e-9) * step, step


def spans(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of True along each row of ``flags [rows, cols]``: (row, start, stop)."""
    padded = np.zeros((flags.shape[0], flags.shape[1] + 2), np.int8)
    padded[:, 1:-1] = flags
    step = np.diff(padded, axis=1)
    row, start = np.nonzero(step == 1)
    _, stop = np.nonzero(step == -1)
    return row, start, stop


def _shifted(a: np.ndarray, by: int) -> np.ndarray:
    """``a [rows, cols]`` moved ``by`` (+-1) columns to the right, NaN where nothing moved in."""
    out = np.full_like(a, np.nan)
    if by > 0:
        out[:, by:] = a[:, :-by]
    else:
        out[:, :by] = a[:, -by:]
    return out


def _bridge(has: np.ndarray, *values: np.ndarray) -> list[np.ndarray]:
    """``values [rows, cols]`` with each column where ``has`` is False, between two where it is
    True, interpolated linearly between those two, or where one of them is NaN the nearer one's
    value; other such columns NaN."""
    n, w = has.shape
    col = np.arange(w)
    before = np.maximum.accumulate(np.where(has, col, -1), axis=1)
    after = np.minimum.accumulate(np.where(has, col, w)[:, ::-1], axis=1)[:, ::-1]
    row, c = np.nonzero(~has & (before >= 0) & (after < w))
    p, q = before[row, c], after[row, c]
    f = (c - p) / (q - p)
    out = []
    for v in values:
        v = np.where(has, v, np.nan)
        between = v[row, p] + (v[row, q] - v[row, p]) * f
        v[row, c] = np.where(np.isnan(between), np.where(f <= 0.5, v[row, p], v[row, q]), between)
        out.append(v)
    return out


def _ragged_arange(start: np.ndarray, count: np.ndarray, step: int = 1) -> np.ndarray:
    """For every k in turn, ``count[k]`` values from ``start[k]`` on, ``step`` apart: the running
    sum of ``step``s, with a jump from each k's last value to the next k's first."""
    start, count = start[count > 0], count[count > 0]
    out = np.full(int(count.sum()), step, np.int64)
    if out.size:
        out[0] = start[0]
        out[(np.cumsum(count) - count)[1:]] = start[1:] - start[:-1] - (count[:-1] - 1) * step
    return np.cumsum(out, out=out)


def fill_rects(index: np.ndarray, x0: np.ndarray, x1: np.ndarray, y0: np.ndarray, y1: np.ndarray,
               colour: int) -> None:
    """Set the pixels of rectangles to ``colour`` in ``index [rows, columns]``: rectangle k is
    columns ``x0[k]`` to ``x1[k] - 1`` and rows ``y0[k]`` to ``y1[k] - 1`` (integers: pixel
    edges; nothing where ``x1 <= x0`` or ``y1 <= y0``), clipped to the image. The rectangles'
    pixel columns, then those columns' pixels, are enumerated at once: the work is their area."""
    rows, columns = index.shape
    x0, x1 = (np.minimum(np.maximum(np.asarray(v, np.int64), 0), columns) for v in (x0, x1))
    y0, y1 = (np.minimum(np.maximum(np.asarray(v, np.int64), 0), rows) for v in (y0, y1))
    width, height = np.maximum(x1 - x0, 0), np.maximum(y1 - y0, 0)
    width[height == 0] = 0
    column = _ragged_arange(x0, width)
    index.reshape(-1)[_ragged_arange(np.repeat(y0, width) * columns + column, np.repeat(height, width), columns)] = colour


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_rows(index: np.ndarray) -> np.ndarray:
    """``index [rows, columns]`` as a PNG's image data before deflate: each row its filter type (0,
    none), then its pixels at 4 bits each."""
    rows, columns = index.shape
    packed = np.zeros((rows, 1 + (columns + 1) // 2), np.uint8)
    packed[:, 1 : 1 + columns // 2] = (index[:, 0 : columns - 1 : 2] << 4) | index[:, 1:columns:2]
    if columns % 2:
        packed[:, -1] = index[:, -1] << 4
    return packed


def palette_png(index: np.ndarray) -> bytes:
    """``index [rows, columns]`` (indices into PALETTE) as a PNG of 4 bits a pixel.

    Every row unfiltered (PNG filter type 0, what the PNG specification recommends for palette
    images): the white margins and the bands' background stay runs of zero bytes, and a row
    repeats most of the row above, which deflate finds as matches. Pillow, which picks a filter
    per row, gives no choice of filter, and its filtered rows of a palette image compress worse.
    Deflate at level 6 with the filtered strategy: higher levels cost several times the time for
    a few per cent; lower ones save time but grow the PNG, which the event log stores on every
    run (``bench/plots_bench.py`` measures the levels and the row filters, ``deflate_options``,
    against the event log's budget)."""
    rows, columns = index.shape
    deflate = zlib.compressobj(6, zlib.DEFLATED, 15, 8, zlib.Z_FILTERED)
    data = deflate.compress(png_rows(index).tobytes()) + deflate.flush()
    header = struct.pack(">IIBBBBB", columns, rows, 4, 3, 0, 0, 0)  # bit depth 4, palette, no interlace
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"PLTE", PALETTE.tobytes())
            + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b""))


def _lay_ink(index: np.ndarray, pixels: np.ndarray, top: int, left: int) -> None:
    """Lay the ink of ``pixels`` (palette indices: a text on white) into ``index`` with its
    top left pixel at row ``top``, column ``left``, clipped to the image: what is under the
    white stays, so texts whose boxes overlap keep each other's ink."""
    r0, c0 = max(top, 0), max(left, 0)
    target = index[r0 : top + pixels.shape[0], c0 : left + pixels.shape[1]]
    ink = pixels[r0 - top : r0 - top + target.shape[0], c0 - left : c0 - left + target.shape[1]]
    np.copyto(target, ink, where=ink != WHITE)


def _no_antialiasing():
    import matplotlib

    return matplotlib.rc_context({"text.antialiased": False, "lines.antialiased": False, "patch.antialiased": False})


class RunFigure:
    """The run figure for one list of node labels (see the module docstring): build it once,
    then :meth:`png` per run. Not thread-safe: :func:`run_png` serialises the calls."""

    def __init__(self, labels: Sequence[str]) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
        from matplotlib.figure import Figure
        from matplotlib.font_manager import FontProperties
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        self.n = n = len(labels)
        self.band = band = band_px(n)
        measure = RendererAgg(10, 10, DPI)

        def width(text: str, pt: float, weight: str = "normal") -> float:
            return measure.get_text_width_height_descent(text, FontProperties(size=pt, weight=weight), False)[0]

        label_w = max(MIN_LABEL_PX, math.ceil(max(width(label, LABEL_PT, "bold") for label in labels)))
        number_w = math.ceil(width("-8.88e+08", SCALE_PT))  # the widest value fmt writes
        self.left = left = MARGIN_PX + label_w + MARGIN_PX + number_w + SCALE_GAP_PX
        self.space = {w: width("a a", TITLE_PT, w) - width("aa", TITLE_PT, w) for w in ("normal", "bold")}
        self.w_px, self.h_px = W, H = left + PLOT_PX + RIGHT_PX, TOP_PX + n * band + BOTTOM_PX
        c = COLOURS
        with _no_antialiasing():
            fig = Figure(figsize=(W / DPI, H / DPI), dpi=DPI, facecolor="white")
            self.canvas = FigureCanvasAgg(fig)
            # One axes over the whole figure in pixel units: x from the data's left edge, y down
            # from its top; integers are pixel edges. It places the texts.
            ax = self.ax = fig.add_axes((0, 0, 1, 1))
            ax.set_xlim(-left, W - left)
            ax.set_ylim(H - TOP_PX, -TOP_PX)
            ax.set_axis_off()
            for i, label in enumerate(labels):
                y = (i + 0.5) * band
                ax.text(MARGIN_PX - left, y, label, fontsize=LABEL_PT, weight="bold", ha="left", va="center_baseline")
            plain = dict(antialiased=False)
            fig.legend(
                handles=[
                    Line2D([], [], color=c["raw"], linewidth=4, solid_capstyle="butt", label="raw points", **plain),
                    Line2D([], [], color=c["grid"], linewidth=1.5, label="cleaned grid", **plain),
                    Line2D([], [], color=c["outlier"], marker="s", markersize=4, linestyle="none",
                           label="removed outlier", **plain),
                    Patch(facecolor=c["gap"], label="gap (no grid value)", **plain),
                    Patch(facecolor=c["partial_gap"], label="some grid rows missing", **plain),
                ],
                loc="center left", bbox_to_anchor=(MARGIN_PX / W, 1 - 42 / H), ncol=5, fontsize=LABEL_PT, frameon=False,
                handlelength=1.6, handleheight=0.9, columnspacing=1.8, borderaxespad=0.0, borderpad=0.0,
            )
            # The texts that change per run: animated artists, left out of the background and
            # drawn alone when a text is new (see _text and _glyph).
            self.texts = {
                "tick": ax.text(0, 0, "", fontsize=TICK_PT, ha="center", va="top", animated=True),
                "scale_lo": ax.text(0, 0, "", fontsize=SCALE_PT, color=c["axis"], ha="right", va="bottom",
                                    animated=True),
                "scale_hi": ax.text(0, 0, "", fontsize=SCALE_PT, color=c["axis"], ha="right", va="top",
                                    animated=True),
                "xlabel": ax.text(0, 0, "", fontsize=LABEL_PT, ha="center", va="bottom", animated=True),
                # the title line, a character at a time (see _glyphs)
                "title": ax.text(0, 0, "", fontsize=TITLE_PT, weight="bold", ha="left", va="baseline", animated=True),
                "time": ax.text(0, 0, "", fontsize=TITLE_PT, ha="left", va="baseline", animated=True),
            }
            self.canvas.draw()
        self.renderer = self.canvas.get_renderer()
        self.pixels = np.asarray(self.renderer.buffer_rgba())  # the canvas, rows from the top
        self.blank = self.pixels.copy()  # the canvas as drawn once: where a new text is drawn alone
        # The background as palette indices (every pixel a palette colour: its green names it,
        # see GREEN_TO_INDEX), then the frame and the separators: the separator above band i is
        # its row 0; the frame is around columns 0 .. PLOT_PX - 1 and rows 0 .. n * band - 1.
        self.background = np.take(GREEN_TO_INDEX, self.blank[:, :, 1])
        rows = np.arange(1, n) * band
        self._fill(self.background, np.full(n - 1, MARGIN_PX - left), np.full(n - 1, PLOT_PX), rows, rows + 1,
                   SEPARATOR)
        frame = np.array([[-1, 0, -1, n * band + 1], [PLOT_PX, PLOT_PX + 1, -1, n * band + 1],
                          [-1, PLOT_PX + 1, -1, 0], [-1, PLOT_PX + 1, n * band, n * band + 1]])
        self._fill(self.background, *frame.T, AXIS)
        self.tiles: dict[tuple[str, str], tuple[np.ndarray, int, int, float]] = {}
        self.glyph_tiles: dict[tuple[str, str], tuple[np.ndarray, int, int, float]] = {}
        _, height, descent = measure.get_text_width_height_descent("Hl0", FontProperties(size=TITLE_PT, weight="bold"), False)
        self.title_baseline = TITLE_TOP_PX + math.ceil(height - descent)

    def _fill(self, index: np.ndarray, x0, x1, y0, y1, colour: int) -> None:
        """:func:`fill_rects` in the data's pixel units (x from the data area's left edge, y
        down from its top; integers are pixel edges)."""
        fill_rects(index, np.asarray(x0) + self.left, np.asarray(x1) + self.left, np.asarray(y0) + TOP_PX,
                   np.asarray(y1) + TOP_PX, colour)

    def _draw_alone(self, artist, text: str, x: float, y: float):
        """Draw ``artist`` with ``text`` anchored at figure pixel (x, y) (y down from the top) on
        the canvas, and return its layout box (y up from the bottom)."""
        artist.set_text(text)
        artist.set_position((x - self.left, y - TOP_PX))
        self.ax.draw_artist(artist)
        return artist.get_window_extent(self.renderer)

    def _cut(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """The canvas's pixels in rows r0 .. r1 - 1 and columns c0 .. c1 - 1 (clipped to it) as
        palette indices, then the canvas as drawn once again there, in whole rows and
        GLYPH_PAD_PX more above and below (ink standing outside the box goes too): it is blank
        for the next text drawn alone."""
        index = np.take(GREEN_TO_INDEX, self.pixels[max(r0, 0) : r1, max(c0, 0) : c1, 1])
        wipe = slice(max(r0 - GLYPH_PAD_PX, 0), r1 + GLYPH_PAD_PX)
        self.pixels[wipe] = self.blank[wipe]
        return index

    def _text(self, index: np.ndarray, kind: str, text: str, x: float, y: float) -> float:
        """Lay ``text`` in the style of ``self.texts[kind]`` into ``index``, anchored at figure
        pixel (x, y) (y down from the top), and return its width. Its ink is laid from the pixels
        of an earlier drawing of the same text where there is one, else it is drawn alone and
        kept (its box and TILE_PAD_PX around it). Texts go on the background's white margins,
        so what is kept is the text's ink on white; a text laid over another's box (the two
        scale values of a band at MIN_BAND_PX) keeps the other's ink."""
        x, y = round(x), round(y)
        tile = self.tiles.get((kind, text))
        if tile is None:
            box = self._draw_alone(self.texts[kind], text, x, y)
            kept = box.padded(TILE_PAD_PX)  # its bounds truncated to integers, as Agg's copy_from_bbox takes them
            c0, c1, r0, r1 = int(kept.x0), int(kept.x1), self.h_px - int(kept.y1), self.h_px - int(kept.y0)
            if len(self.tiles) >= MAX_TEXT_TILES:
                self.tiles.clear()
            tile = self.tiles[kind, text] = (self._cut(r0, r1, c0, c1), max(c0, 0) - x, max(r0, 0) - y, box.width)
        pixels, dx, dy, width = tile
        _lay_ink(index, pixels, y + dy, x + dx)
        return width

    def _glyph(self, kind: str, char: str) -> tuple[np.ndarray, int, int, float]:
        """``char`` in the style of ``self.texts[kind]``: its pixels (palette indices), their
        offset from the pen (on the baseline) and the pen's advance. Drawn once, alone, on the
        white right end of the title line, then kept."""
        glyph = self.glyph_tiles.get((kind, char))
        if glyph is not None:
            return glyph
        x, y = self.w_px - RIGHT_PX - 4 * TITLE_PT, self.title_baseline
        # the layout box, padded: hinted ink may stand a pixel outside it (white, the padding
        # costs nothing: only ink is laid)
        box = self._draw_alone(self.texts[kind], char, x, y).padded(GLYPH_PAD_PX)  # y up from the bottom
        x0, x1 = math.floor(box.x0), math.ceil(box.x1)
        r0, r1 = self.h_px - math.ceil(box.y1), self.h_px - math.floor(box.y0)
        prop = self.texts[kind].get_fontproperties()
        width = self.renderer.get_text_width_height_descent
        advance = width(char * 2, prop, False)[0] - width(char, prop, False)[0]
        if len(self.glyph_tiles) >= MAX_TEXT_TILES:
            self.glyph_tiles.clear()
        glyph = self.glyph_tiles[kind, char] = (self._cut(r0, r1, x0, x1), x0 - x, r0 - y, advance)
        return glyph

    def _glyphs(self, index: np.ndarray, kind: str, text: str, x: float, space: float) -> float:
        """Lay ``text`` into ``index`` from kept glyphs (:meth:`_glyph`; all of them kept
        before, so none is drawn on the line), left-aligned at ``x`` on the title line's
        baseline, a space ``space`` wide, and return its width. Only a glyph's ink is laid (the
        title's colour, on the white margin), so glyphs whose boxes overlap keep each other's
        ink. A run's name and start time are new text for every run; laying them out and
        rendering them whole is most of what the texts would cost."""
        baseline = self.title_baseline
        pen = x
        for c in text:
            if c == " ":
                pen += space
                continue
            pixels, dx, dy, advance = self._glyph(kind, c)
            _lay_ink(index, pixels, baseline + dy, round(pen) + dx)
            pen += advance
        return pen - x

    def png(self, traces: RunTraces, title: str) -> bytes:
        """The chart of ``traces`` (its nodes in this figure's label order) as PNG bytes."""
        if len(traces.node_ids) != self.n:
            raise ValueError(f"run figure: {len(traces.node_ids)} nodes in the traces for {self.n} labels")
        if traces.width > PLOT_PX:
            traces = traces.folded(PLOT_PX)
        index = self.background.copy()
        self._draw_data(index, traces)
        self._draw_texts(index, traces, title)
        return palette_png(index)

    def _draw_data(self, index: np.ndarray, traces: RunTraces) -> None:
        """The data layers, each over the one before: time grid lines, partly missing columns,
        gaps, raw points, outliers, the cleaned grid, tick marks."""
        n, band, w = self.n, self.band, traces.width
        lo, hi, _ = self.scale = band_scale(traces)
        top = np.arange(n, dtype=np.float64)[:, None] * band
        first, last = top + 1 + EDGE_PX, top + band - EDGE_PX  # a band's data rows, as pixel edges
        scale = (last - first - 1) / (hi - lo)[:, None]  # px per unit, per node
        edges = np.round(np.arange(w + 1) * (PLOT_PX / w))  # pixel edges of the trace columns

        def rows(v: np.ndarray) -> np.ndarray:
            """Pixel rows (continuous, from the top) of values ``[n, w]``; NaN stays NaN."""
            with np.errstate(invalid="ignore"):
                return np.clip(first + 0.5 + (hi[:, None] - v.astype(np.float64)) * scale, first + 0.5, last - 0.5)

        # cleaned grid: 2 px thick, each column reaching its neighbours (a steep step stays one stroke)
        # (a column without grid rows, where the beat is longer than a column, takes its rows
        # and its gap from the columns around it)
        has_rows = traces.grid_rows > 0
        # gaps: the band's height in the columns with missing grid rows (all of them, or some),
        # bridged as the line is (a flag is a value where set, NaN where not), so that a column
        # halfway between a gap and the line goes with the same neighbour for both: never a hole
        miss = traces.grid_missing > 0
        full = miss & (traces.grid_missing == traces.grid_rows)
        g_top, g_bottom, full, miss = _bridge(has_rows, rows(traces.grid_max), rows(traces.grid_min),
                                              *(np.where(f, 1.0, np.nan) for f in (full, miss)))
        full, miss = ~np.isnan(full), ~np.isnan(miss)
        g_top, g_bottom = np.round(g_top) - 1, np.round(g_bottom) + 1
        no_grid = np.isnan(g_top)
        with np.errstate(invalid="ignore"):
            g_top, g_bottom = (
                np.fmin(g_top, np.fmin(_shifted(g_bottom, 1), _shifted(g_bottom, -1)) - 1),
                np.fmax(g_bottom, np.fmax(_shifted(g_top, 1), _shifted(g_top, -1)) + 1),
            )
        g_top = np.where(no_grid, first, np.maximum(g_top, first))
        g_bottom = np.where(no_grid, first, np.minimum(g_bottom, last))
        # raw points: 1 px per value, drawn where the line does not cover them
        r_top, r_bottom = np.floor(rows(traces.raw_max)), np.floor(rows(traces.raw_min)) + 1
        has_raw = ~np.isnan(r_top)
        above = has_raw & (r_top < np.where(no_grid, last, g_top))
        below = has_raw & ~no_grid & (r_bottom > g_bottom)
        band_a, col_a = np.nonzero(above)
        band_b, col_b = np.nonzero(below)
        # time: ticks below the data, light lines across it
        ms, self.unit, self.ticks = time_ticks(traces.span_ms)
        tx = self.tick_x = np.minimum(np.floor(self.ticks * ms / traces.span_ms * PLOT_PX), PLOT_PX - 1)
        inside = tx[(tx > 0) & (tx < PLOT_PX - 1)]  # not on the frame

        self._fill(index, inside, inside + 1, np.zeros_like(inside), np.full_like(inside, n * band), TIME_GRID)
        for colour, flags in ((PARTIAL_GAP, miss & ~full), (GAP, full)):
            r, a, b = spans(flags)
            self._fill(index, edges[a], edges[b], r * band + 1, (r + 1) * band, colour)
        self._fill(
            index, np.concatenate([edges[col_a], edges[col_b]]), np.concatenate([edges[col_a + 1], edges[col_b + 1]]),
            np.concatenate([r_top[band_a, col_a], np.maximum(r_top, g_bottom)[band_b, col_b]]),
            np.concatenate([np.where(no_grid, r_bottom, np.minimum(r_bottom, g_top))[band_a, col_a], r_bottom[band_b, col_b]]),
            RAW,
        )
        # removed outliers: a square at the column's smallest and largest removed value, on the
        # pixels matplotlib's 3 pt square marker covers at DPI: OUTLIER_PX wide, centred on the
        # pixel edge nearest the column's centre (halves up), its rows likewise
        node, col = np.nonzero(traces.removed_count > 0)
        cx = np.tile(np.floor((edges[col] + edges[col + 1]) / 2 + 0.5), 2)
        cy = np.floor(np.concatenate([rows(traces.removed_min)[node, col], rows(traces.removed_max)[node, col]])) + 1
        cx, cy = cx[~np.isnan(cy)], cy[~np.isnan(cy)]
        half = OUTLIER_PX // 2
        self._fill(index, cx - half, cx + OUTLIER_PX - half, cy - half, cy + OUTLIER_PX - half, OUTLIER)
        # the cleaned grid: in column j, rows g_top to g_bottom (none where they are equal)
        j = np.tile(np.arange(w), n)
        self._fill(index, edges[j], edges[j + 1], g_top.ravel(), g_bottom.ravel(), GRID)
        self._fill(index, tx, tx + 1, np.full_like(tx, n * band + 1), np.full_like(tx, n * band + 6), AXIS)

    def _draw_texts(self, index: np.ndarray, traces: RunTraces, title: str) -> None:
        lo, hi, step = self.scale
        bottom = TOP_PX + self.n * self.band
        tick_step = float(self.ticks[1] - self.ticks[0]) if len(self.ticks) > 1 else 1.0
        for t, x in zip(self.ticks, self.tick_x):
            self._text(index, "tick", fmt(float(t), tick_step), self.left + x + 0.5, bottom + 8)
        self._text(index, "xlabel", f"time since run start [{self.unit}]", self.left + PLOT_PX / 2, self.h_px - 4)
        x = self.left - SCALE_GAP_PX
        for i in range(self.n):
            top = TOP_PX + i * self.band
            self._text(index, "scale_hi", fmt(float(hi[i]), float(step[i])), x, top + SCALE_EDGE_PX)
            self._text(index, "scale_lo", fmt(float(lo[i]), float(step[i])), x, top + self.band - SCALE_EDGE_PX)
        # the title line: the run's name, then its start and length
        start = _utc(traces.t0_ms)
        line = f"started {start:%Y-%m-%d %H:%M:%S} UTC, {duration(traces.span_ms)} long"
        x = MARGIN_PX + self._glyphs(index, "title", title, MARGIN_PX, self.space["bold"]) + 3 * self.space["bold"]
        self._glyphs(index, "time", line, x, self.space["normal"])


_LOCK = threading.Lock()  # the figures are shared by threads


@lru_cache(maxsize=4)
def run_figure(labels: tuple[str, ...]) -> RunFigure:
    """The figure for ``labels``, built on first use (kept for the next runs with the same labels)."""
    return RunFigure(labels)


def run_png(traces: RunTraces, labels: Sequence[str], title: str) -> bytes:
    """The chart of ``traces`` with a band per node labelled by ``labels`` (in node order)."""
    with _LOCK:
        return run_figure(tuple(labels)).png(traces, title)
