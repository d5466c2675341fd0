"""Plots for the Dagster UI, as PNG data URIs in markdown metadata.

The per-run plot is drawn straight into a numpy image (no matplotlib) because it is made for
every run in every backfill: a few milliseconds per node instead of a few hundred per figure.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

WIDTH, HEIGHT = 720, 56
RAW = np.array([170, 170, 170], np.uint8)
GRID = np.array([31, 119, 180], np.uint8)
OUTLIER = np.array([214, 39, 40], np.uint8)
BACKGROUND = 255


# Palette indices of the per-run strips (a 1-byte-per-pixel palette PNG is a third of the
# bytes to compress, and zlib level 1 suffices for large single-colour areas).
_BG, _RAW, _GRID, _OUTLIER = 0, 1, 2, 3
PALETTE = np.array([[BACKGROUND] * 3, RAW, GRID, OUTLIER], np.uint8)


def _png(header: bytes, pixels: bytes, extra: bytes = b"", level: int = 6) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + extra
        + chunk(b"IDAT", zlib.compress(pixels, level))
        + chunk(b"IEND", b"")
    )


def png_bytes(rgb: np.ndarray) -> bytes:
    """Encode an ``[h, w, 3]`` uint8 image as PNG (filter 0, zlib)."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()
    return _png(struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0), raw)


def palette_png_bytes(indices: np.ndarray, palette: np.ndarray) -> bytes:
    """Encode an ``[h, w]`` uint8 image of indices into ``palette`` (``[n, 3]`` uint8) as PNG."""
    h, w = indices.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), indices.astype(np.uint8, copy=False)], axis=1).tobytes()
    header = struct.pack(">IIBBBBB", w, h, 8, 3, 0, 0, 0)
    plte = np.ascontiguousarray(palette, dtype=np.uint8).tobytes()
    extra = struct.pack(">I", len(plte)) + b"PLTE" + plte + struct.pack(">I", zlib.crc32(b"PLTE" + plte))
    return _png(header, raw, extra, level=1)


def data_uri_markdown(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def series_strip(
    raw_ts: np.ndarray,
    raw_value: np.ndarray,
    grid_ts: np.ndarray,
    grid_value: np.ndarray,
    outlier_ts: np.ndarray,
    outlier_value: np.ndarray,
    t_range: tuple[int, int],
) -> np.ndarray:
    """One node: raw points (grey), cleaned grid (blue, gaps left open), removed outliers (red)."""
    return PALETTE[strip_indices(raw_ts, raw_value, grid_ts, grid_value, outlier_ts, outlier_value, t_range)]


def strip_indices(
    raw_ts: np.ndarray,
    raw_value: np.ndarray,
    grid_ts: np.ndarray,
    grid_value: np.ndarray,
    outlier_ts: np.ndarray,
    outlier_value: np.ndarray,
    t_range: tuple[int, int],
) -> np.ndarray:
    """:func:`series_strip` as ``[HEIGHT, WIDTH]`` indices into :data:`PALETTE`."""
    img = np.zeros((HEIGHT, WIDTH), np.uint8)
    finite = grid_value[np.isfinite(grid_value)]
    if finite.size == 0:
        finite = raw_value[np.isfinite(raw_value)]
    if finite.size == 0:
        return img
    lo, hi = float(finite.min()), float(finite.max())
    pad = (hi - lo) * 0.15 or max(abs(lo) * 0.05, 1.0)
    lo, hi = lo - pad, hi + pad
    t0, t1 = t_range
    span = max(t1 - t0, 1)

    def px(ts: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ok = np.isfinite(v)
        x = ((ts[ok] - t0) * (WIDTH - 1) // span).astype(np.int64)
        y = ((hi - v[ok]) / (hi - lo) * (HEIGHT - 1)).round().astype(np.int64)
        keep = (x >= 0) & (x < WIDTH)
        return x[keep], np.clip(y[keep], 0, HEIGHT - 1)

    x, y = px(raw_ts, raw_value)
    img[y, x] = _RAW
    # The grid line as a per-column min..max envelope, bridged to the neighbouring column so a
    # steep step is drawn as a continuous stroke; NaN rows leave the column empty (a visible gap).
    x, y = px(grid_ts, grid_value)
    if x.size:
        top = np.full(WIDTH, HEIGHT, np.int64)
        bottom = np.full(WIDTH, -1, np.int64)
        if x.size < 2 or bool(np.all(x[1:] >= x[:-1])):
            # Grid times ascend, so each column's points are one contiguous run: reduce per run.
            first = np.flatnonzero(np.concatenate([[True], x[1:] != x[:-1]]))
            cols = x[first]
            top[cols] = np.minimum.reduceat(y, first)
            bottom[cols] = np.maximum.reduceat(y, first)
        else:
            np.minimum.at(top, x, y)
            np.maximum.at(bottom, x, y)
        has = bottom >= 0
        prev_top, prev_bottom = np.roll(top, 1), np.roll(bottom, 1)
        bridge = has & np.roll(has, 1)
        bridge[0] = False
        top = np.where(bridge, np.minimum(top, prev_bottom), top)
        bottom = np.where(bridge, np.maximum(bottom, prev_top), bottom)
        rows = np.arange(HEIGHT)[:, None]
        img[(rows >= top[None, :]) & (rows <= bottom[None, :])] = _GRID
    x, y = px(outlier_ts, outlier_value)
    for dx, dy in ((0, 0), (-1, -1), (1, 1), (-1, 1), (1, -1), (-2, -2), (2, 2), (-2, 2), (2, -2)):
        img[np.clip(y + dy, 0, HEIGHT - 1), np.clip(x + dx, 0, WIDTH - 1)] = _OUTLIER
    return img


def run_plot_markdown(
    run_id: str,
    node_ids: Sequence[str],
    raw: Mapping[str, np.ndarray],
    grid: Mapping[str, np.ndarray],
) -> str:
    """Markdown with one strip per node: raw points, cleaned grid and removed outliers."""
    gts = grid["grid_ts"]
    t_range = (int(gts[0]), int(gts[-1])) if gts.size else (0, 1)
    off, ooff = raw["offsets"], grid["outlier_offsets"]
    minutes = (t_range[1] - t_range[0]) / 60_000
    lines = [
        f"**run {run_id}**: {minutes:.1f} min; raw points grey, cleaned grid blue (gaps open), "
        "removed Hampel outliers red",
        "",
    ]
    for j, node in enumerate(node_ids):
        rs, os_ = slice(int(off[j]), int(off[j + 1])), slice(int(ooff[j]), int(ooff[j + 1]))
        values = grid["values"][:, j]
        finite = values[np.isfinite(values)]
        rng = f"{finite.min():.4g} … {finite.max():.4g}" if finite.size else "no data"
        strip = strip_indices(
            raw["ts"][rs], raw["value"][rs], gts, values, grid["outlier_ts"][os_], grid["outlier_value"][os_], t_range
        )
        lines.append(f"`{node}` {rng}; {os_.stop - os_.start} outliers removed  ")
        lines.append(data_uri_markdown(palette_png_bytes(strip, PALETTE), node))
        lines.append("")
    return "\n".join(lines)


def bar_plot_markdown(labels: Sequence[str], values: Sequence[float], colors: Sequence[str], title: str) -> str:
    """A bar chart (matplotlib; drawn once per dataset, not per run).

    Uses matplotlib's object API with the Agg canvas directly: no pyplot (a slow import, global
    figure state) and no change of the process's backend.
    """
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4, 0.25 * len(labels) + 2), 2.6))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.bar(range(len(labels)), values, color=colors)
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    ax.set_title(title, fontsize=8)
    ax.tick_params(labelsize=6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    return data_uri_markdown(buf.getvalue(), title)
