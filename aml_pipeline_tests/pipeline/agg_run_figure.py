"""The run figure as matplotlib drew its data before they were drawn with numpy: the reference
``test_run_figure_numpy.py`` holds :class:`aml_pipeline.pipeline.run_figure.RunFigure` to, pixel for
pixel. Kept as it was: the data are matplotlib artists (filled paths on pixel edges, not snapped,
not antialiased; the outliers a square marker) blitted onto a copy of the background, the texts
restored from kept Agg regions (or, with ``keep_texts=False``, every text drawn where it goes), and
the canvas turned into palette indices by its green."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from aml_pipeline.core.traces import RunTraces
from aml_pipeline.pipeline.run_figure import (
    BOTTOM_PX, COLOURS, DPI, EDGE_PX, GLYPH_PAD_PX, GREEN_TO_INDEX, LABEL_PT, MARGIN_PX,
    MAX_TEXT_TILES, MIN_LABEL_PX, PLOT_PX, RIGHT_PX, SCALE_EDGE_PX, SCALE_GAP_PX, SCALE_PT, TICK_PT,
    TILE_PAD_PX, TITLE_PT, TITLE_TOP_PX, TOP_PX, _bridge, _no_antialiasing, _shifted, _utc, band_px,
    band_scale, duration, fmt, palette_png, spans, time_ticks,
)


def _rects_path(x0: np.ndarray, x1: np.ndarray, y0: np.ndarray, y1: np.ndarray):
    """Rectangles ``[x0, x1] x [y0, y1]`` as one matplotlib path to fill."""
    from matplotlib.path import Path

    verts = np.empty((np.size(x0), 4, 2))
    verts[:, 0, 0] = verts[:, 3, 0] = x0
    verts[:, 1, 0] = verts[:, 2, 0] = x1
    verts[:, 0, 1] = verts[:, 1, 1] = y0
    verts[:, 2, 1] = verts[:, 3, 1] = y1
    codes = np.tile(np.array([Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO], Path.code_type), np.size(x0))
    return Path(verts.reshape(-1, 2), codes)


def _steps_path(edges: np.ndarray, top: np.ndarray, bottom: np.ndarray):
    """One polygon per row of ``top``/``bottom`` (``[bands, columns]``, pixel edges) covering, in
    column j (``edges[j]`` to ``edges[j + 1]``), ``top[:, j]`` to ``bottom[:, j]`` (nothing where
    they are equal); runs of columns with the same rows become one step."""
    from matplotlib.path import Path

    n, w = top.shape
    change = np.ones((n, w), bool)
    change[:, 1:] = (top[:, 1:] != top[:, :-1]) | (bottom[:, 1:] != bottom[:, :-1])
    band, start = np.nonzero(change)  # the steps, band by band, left to right
    stop = np.append(start[1:], w)
    stop[np.append(band[1:] != band[:-1], True)] = w
    counts = np.bincount(band, minlength=n)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    rank = np.arange(band.size) - offsets[band]  # of the step within its band
    base, count = 4 * offsets[band], counts[band]
    # per band: its top edge left to right, then its bottom edge right to left
    verts = np.empty((4 * band.size, 2))
    x0, x1, t, b = edges[start], edges[stop], top[band, start], bottom[band, start]
    at = base + 2 * rank
    verts[at], verts[at + 1] = np.stack([x0, t], 1), np.stack([x1, t], 1)
    at = base + 2 * count + 2 * (count - 1 - rank)
    verts[at], verts[at + 1] = np.stack([x1, b], 1), np.stack([x0, b], 1)
    codes = np.full(len(verts), Path.LINETO, Path.code_type)
    codes[4 * offsets[:-1]] = Path.MOVETO
    return Path(verts, codes)



class AggRunFigure:
    """The run figure for one list of node labels (see the module docstring): build it once,
    then :meth:`png` per run. Not thread-safe: :func:`run_png` serialises the calls."""

    def __init__(self, labels: Sequence[str], keep_texts: bool = True) -> None:
        self.keep_texts = keep_texts  # False: every text drawn by matplotlib where it goes, none copied
        from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
        from matplotlib.figure import Figure
        from matplotlib.font_manager import FontProperties
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch, PathPatch
        from matplotlib.path import Path

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
            # from its top; integers are pixel edges.
            ax = self.ax = fig.add_axes((0, 0, 1, 1))
            ax.set_xlim(-left, W - left)
            ax.set_ylim(H - TOP_PX, -TOP_PX)
            ax.set_axis_off()

            def fill(path: Path, colour: str, animated: bool = False) -> PathPatch:
                # on pixel edges already: not snapped (which would move them by half a pixel)
                return ax.add_patch(PathPatch(path, facecolor=colour, edgecolor="none", linewidth=0, snap=False,
                                              animated=animated))

            # the separator above band i is its row 0; the frame is around columns 0 .. PLOT_PX - 1
            # and rows 0 .. n * band - 1
            rows = np.arange(1, n) * band
            fill(_rects_path(np.full(n - 1, MARGIN_PX - left), np.full(n - 1, PLOT_PX), rows, rows + 1), c["separator"])
            frame = np.array([[-1, 0, -1, n * band + 1], [PLOT_PX, PLOT_PX + 1, -1, n * band + 1],
                              [-1, PLOT_PX + 1, -1, 0], [-1, PLOT_PX + 1, n * band, n * band + 1]], np.float64)
            fill(_rects_path(*frame.T), c["axis"])
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
            # What changes per run: animated artists, left out of the background and blitted.
            empty = Path(np.zeros((1, 2)))
            self.partial_gaps, self.gaps = fill(empty, c["partial_gap"], True), fill(empty, c["gap"], True)
            self.time_grid, self.raw = fill(empty, c["time_grid"], True), fill(empty, c["raw"], True)
            self.grid, self.tick_marks = fill(empty, c["grid"], True), fill(empty, c["axis"], True)
            (self.outliers,) = ax.plot([], [], color=c["outlier"], marker="s", markersize=3, markeredgewidth=0,
                                       linestyle="none", animated=True)
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
        self.background = self.canvas.copy_from_bbox(fig.bbox)
        self.tiles: dict[tuple[str, str], tuple[object, tuple[int, int, int, int], int, int, float]] = {}
        self.glyph_tiles: dict[tuple[str, str], tuple[np.ndarray, int, int, float]] = {}
        self.pixels = np.asarray(self.renderer.buffer_rgba())  # the canvas, rows from the top
        _, height, descent = measure.get_text_width_height_descent("Hl0", FontProperties(size=TITLE_PT, weight="bold"), False)
        self.title_baseline = TITLE_TOP_PX + math.ceil(height - descent)

    def _text(self, kind: str, text: str, x: float, y: float) -> float:
        """Draw ``text`` in the style of ``self.texts[kind]``, anchored at figure pixel (x, y)
        (y down from the top), and return its width. Copied from the pixels of an earlier
        drawing of the same text where there is one, else drawn and kept. Texts go on the white
        margins, at least 2 * TILE_PAD_PX + 1 from other ink, so the pixels kept around a text
        (its box and TILE_PAD_PX) carry no other ink."""
        x, y = round(x), round(y)
        tile = self.tiles.get((kind, text)) if self.keep_texts else None
        if tile is not None:
            region, extents, dx, dy, width = tile
            self.renderer.restore_region(region, bbox=extents, xy=(x + dx, y + dy))
            return width
        artist = self.texts[kind]
        artist.set_text(text)
        artist.set_position((x - self.left, y - TOP_PX))
        self.ax.draw_artist(artist)
        box = artist.get_window_extent(self.renderer)
        region = self.canvas.copy_from_bbox(box.padded(TILE_PAD_PX))
        extents = tuple(int(v) for v in region.get_extents())  # x1, y1 (from the top), x2, y2
        if len(self.tiles) >= MAX_TEXT_TILES:
            self.tiles.clear()
        self.tiles[kind, text] = (region, extents, extents[0] - x, extents[1] - y, box.width)
        return box.width

    def _glyph(self, kind: str, char: str) -> tuple[np.ndarray, int, int, float]:
        """``char`` in the style of ``self.texts[kind]``: its pixels, their offset from the pen
        (on the baseline) and the pen's advance. Drawn once, alone, on the white right end of
        the title line, copied from there and wiped, then kept."""
        glyph = self.glyph_tiles.get((kind, char))
        if glyph is not None:
            return glyph
        artist, prop = self.texts[kind], self.texts[kind].get_fontproperties()
        x, y = self.w_px - RIGHT_PX - 4 * TITLE_PT, self.title_baseline
        artist.set_text(char)
        artist.set_position((x - self.left, y - TOP_PX))
        self.ax.draw_artist(artist)
        # the layout box, padded: hinted ink may stand a pixel outside it (white, the padding
        # costs nothing when laid over by the minimum)
        box = artist.get_window_extent(self.renderer).padded(GLYPH_PAD_PX)  # y up from the bottom
        x0, x1 = math.floor(box.x0), math.ceil(box.x1)
        r0, r1 = self.h_px - math.ceil(box.y1), self.h_px - math.floor(box.y0)
        pixels = self.pixels[r0:r1, x0:x1].copy()
        self.pixels[r0:r1, x0:x1] = 255
        width = self.renderer.get_text_width_height_descent
        advance = width(char * 2, prop, False)[0] - width(char, prop, False)[0]
        if len(self.glyph_tiles) >= MAX_TEXT_TILES:
            self.glyph_tiles.clear()
        glyph = self.glyph_tiles[kind, char] = (pixels, x0 - x, r0 - y, advance)
        return glyph

    def _glyphs(self, kind: str, text: str, x: float, space: float) -> float:
        """Draw ``text`` from kept glyphs (:meth:`_glyph`; all of them kept before, so none is
        drawn on the line), left-aligned at ``x`` on the title line's baseline, a space
        ``space`` wide, and return its width. Dark text on the white margin: each glyph's pixels
        are laid over what is there by their minimum, so glyphs whose boxes overlap keep each
        other's ink. A run's name and start time are new text for every run; laying them out and
        rendering them whole is most of what the texts would cost."""
        baseline = self.title_baseline
        pen = x
        for c in text:
            if c == " ":
                pen += space
                continue
            pixels, dx, dy, advance = self._glyph(kind, c)
            left, top = round(pen) + dx, baseline + dy
            target = self.pixels[top : top + pixels.shape[0], left : left + pixels.shape[1]]
            np.minimum(target, pixels[: target.shape[0], : target.shape[1]], out=target)
            pen += advance
        return pen - x

    def png(self, traces: RunTraces, title: str) -> bytes:
        """The chart of ``traces`` (its nodes in this figure's label order) as PNG bytes."""
        if len(traces.node_ids) != self.n:
            raise ValueError(f"run figure: {len(traces.node_ids)} nodes in the traces for {self.n} labels")
        if traces.width > PLOT_PX:
            traces = traces.folded(PLOT_PX)
        self._draw_data(traces)
        self._draw_texts(traces, title)
        # Every pixel is a palette colour: its green value names it (see GREEN_TO_INDEX).
        return palette_png(np.take(GREEN_TO_INDEX, self.pixels[:, :, 1]))

    def _draw_data(self, traces: RunTraces) -> None:
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
        g_top, g_bottom = _bridge(has_rows, rows(traces.grid_max), rows(traces.grid_min))
        g_top, g_bottom = np.round(g_top) - 1, np.round(g_bottom) + 1
        no_grid = np.isnan(g_top)
        with np.errstate(invalid="ignore"):
            g_top, g_bottom = (
                np.fmin(g_top, np.fmin(_shifted(g_bottom, 1), _shifted(g_bottom, -1)) - 1),
                np.fmax(g_bottom, np.fmax(_shifted(g_top, 1), _shifted(g_top, -1)) + 1),
            )
        g_top = np.where(no_grid, first, np.maximum(g_top, first))
        g_bottom = np.where(no_grid, first, np.minimum(g_bottom, last))
        self.grid.set_path(_steps_path(edges, g_top, g_bottom))
        # raw points: 1 px per value, drawn where the line does not cover them
        r_top, r_bottom = np.floor(rows(traces.raw_max)), np.floor(rows(traces.raw_min)) + 1
        has_raw = ~np.isnan(r_top)
        above = has_raw & (r_top < np.where(no_grid, last, g_top))
        below = has_raw & ~no_grid & (r_bottom > g_bottom)
        band_a, col_a = np.nonzero(above)
        band_b, col_b = np.nonzero(below)
        self.raw.set_path(_rects_path(
            np.concatenate([edges[col_a], edges[col_b]]), np.concatenate([edges[col_a + 1], edges[col_b + 1]]),
            np.concatenate([r_top[band_a, col_a], np.maximum(r_top, g_bottom)[band_b, col_b]]),
            np.concatenate([np.where(no_grid, r_bottom, np.minimum(r_bottom, g_top))[band_a, col_a], r_bottom[band_b, col_b]]),
        ))
        # removed outliers: a square at the column's smallest and largest removed value
        node, col = np.nonzero(traces.removed_count > 0)
        centres = (edges[col] + edges[col + 1]) / 2
        self.outliers.set_data(
            np.concatenate([centres, centres]),
            np.floor(np.concatenate([rows(traces.removed_min)[node, col], rows(traces.removed_max)[node, col]])) + 0.5,
        )
        # gaps: the band's height in the columns with missing grid rows
        miss = traces.grid_missing > 0
        full = miss & (traces.grid_missing == traces.grid_rows)
        # bridged as the line is (a flag is a value where set, NaN where not), so that a column
        # halfway between a gap and the line goes with the same neighbour for both: never a hole
        full, miss = (~np.isnan(flags) for flags in _bridge(has_rows, *(np.where(f, 1.0, np.nan) for f in (full, miss))))
        for layer, flags in ((self.gaps, full), (self.partial_gaps, miss & ~full)):
            r, a, b = spans(flags)
            layer.set_path(_rects_path(edges[a], edges[b], r * band + 1.0, (r + 1) * band + 0.0))
        # time: ticks below the data, light lines across it
        ms, self.unit, self.ticks = time_ticks(traces.span_ms)
        tx = self.tick_x = np.minimum(np.floor(self.ticks * ms / traces.span_ms * PLOT_PX), PLOT_PX - 1)
        inside = tx[(tx > 0) & (tx < PLOT_PX - 1)]  # not on the frame
        self.time_grid.set_path(_rects_path(inside, inside + 1, np.zeros_like(inside), np.full_like(inside, n * band)))
        self.tick_marks.set_path(_rects_path(tx, tx + 1, np.full_like(tx, n * band + 1), np.full_like(tx, n * band + 6)))

        self.renderer.restore_region(self.background)
        for artist in (self.time_grid, self.partial_gaps, self.gaps, self.raw, self.outliers, self.grid, self.tick_marks):
            self.ax.draw_artist(artist)

    def _draw_texts(self, traces: RunTraces, title: str) -> None:
        lo, hi, step = self.scale
        bottom = TOP_PX + self.n * self.band
        tick_step = float(self.ticks[1] - self.ticks[0]) if len(self.ticks) > 1 else 1.0
        for t, x in zip(self.ticks, self.tick_x):
            self._text("tick", fmt(float(t), tick_step), self.left + x + 0.5, bottom + 8)
        self._text("xlabel", f"time since run start [{self.unit}]", self.left + PLOT_PX / 2, self.h_px - 4)
        x = self.left - SCALE_GAP_PX
        for i in range(self.n):
            top = TOP_PX + i * self.band
            self._text("scale_hi", fmt(float(hi[i]), float(step[i])), x, top + SCALE_EDGE_PX)
            self._text("scale_lo", fmt(float(lo[i]), float(step[i])), x, top + self.band - SCALE_EDGE_PX)
        # the title line: the run's name, then its start and length
        start = _utc(traces.t0_ms)
        line = f"started {start:%Y-%m-%d %H:%M:%S} UTC, {duration(traces.span_ms)} long"
        for kind, text in (("title", title), ("time", line)):
            for c in set(text) - {" "}:
                self._glyph(kind, c)
        x = MARGIN_PX + self._glyphs("title", title, MARGIN_PX, self.space["bold"]) + 3 * self.space["bold"]
        self._glyphs("time", line, x, self.space["normal"])
