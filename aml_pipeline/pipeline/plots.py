"""Plots for the Dagster UI, as PNG data URIs in markdown metadata.

The per-run plot is drawn straight into a numpy image (no matplotlib) because it is made for
every run in every backfill: a few milliseconds per run instead of a few hundred per figure.
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
_BG, _RAW, _GRID, _OUTLIER, _SEPARATOR = 0, 1, 2, 3, 4
PALETTE = np.array([[BACKGROUND] * 3, RAW, GRID, OUTLIER, [60, 60, 60]], np.uint8)


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


def _segment_ids(offsets: np.ndarray) -> np.ndarray:
    """For concatenated per-node arrays delimited by ``offsets``: each element's node index."""
    return np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))


def run_image(raw: Mapping[str, np.ndarray], grid: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All nodes of a run, one band each, as ``[n * (HEIGHT + 1), WIDTH]`` palette indices.

    Per band: raw points (grey), the cleaned grid as a per-column min..max envelope bridged to the
    neighbouring column (a steep step stays one stroke; NaN rows leave the column empty, a
    visible gap), removed outliers (red). Each node is scaled to its own cleaned range. Drawn for
    every node at once (no loop per node or point). Returns the image and the value ranges.
    """
    values = grid["values"]
    gts = grid["grid_ts"]
    n = values.shape[1]
    band = HEIGHT + 1  # one separator row below each band
    img = np.zeros((n, band, WIDTH), np.uint8)
    img[:, HEIGHT, :] = _SEPARATOR
    if gts.size == 0 or n == 0:
        return img.reshape(n * band, WIDTH), np.full(n, np.nan), np.full(n, np.nan)
    t0, span = int(gts[0]), max(int(gts[-1]) - int(gts[0]), 1)
    with np.errstate(all="ignore"):
        lo, hi = np.nanmin(values, axis=0), np.nanmax(values, axis=0)
    pad = np.where(hi > lo, (hi - lo) * 0.15, np.maximum(np.abs(lo) * 0.05, 1.0))
    lo_p, hi_p = lo - pad, hi + pad

    def pixels(ts: np.ndarray, v: np.ndarray, node: np.ndarray):
        with np.errstate(all="ignore"):
            x = (ts - t0) * (WIDTH - 1) // span
            y = np.rint((hi_p[node] - v) / (hi_p[node] - lo_p[node]) * (HEIGHT - 1))
        ok = np.isfinite(y) & (x >= 0) & (x < WIDTH)
        return node[ok], np.clip(y[ok], 0, HEIGHT - 1).astype(np.intp), x[ok].astype(np.intp)

    node, y, x = pixels(raw["ts"], raw["value"], _segment_ids(raw["offsets"]))
    img[node, y, x] = _RAW

    # Grid times ascend, so each pixel column is one contiguous group of grid rows.
    gx = (gts - t0) * (WIDTH - 1) // span
    first = np.flatnonzero(np.r_[True, gx[1:] != gx[:-1]])
    with np.errstate(all="ignore"):
        gy = np.rint((hi_p[None, :] - values) / (hi_p - lo_p)[None, :] * (HEIGHT - 1))
    finite = np.isfinite(gy)
    gy_top = np.where(finite, np.clip(gy, 0, HEIGHT - 1), HEIGHT)
    gy_bottom = np.where(finite, np.clip(gy, 0, HEIGHT - 1), -1)
    top = np.full((WIDTH, n), HEIGHT, np.float64)
    bottom = np.full((WIDTH, n), -1, np.float64)
    top[gx[first]] = np.minimum.reduceat(gy_top, first, axis=0)
    bottom[gx[first]] = np.maximum.reduceat(gy_bottom, first, axis=0)
    has = bottom >= 0
    bridge = has & np.roll(has, 1, axis=0)
    bridge[0] = False
    top = np.where(bridge, np.minimum(top, np.roll(bottom, 1, axis=0)), top)
    bottom = np.where(bridge, np.maximum(bottom, np.roll(top, 1, axis=0)), bottom)
    rows = np.arange(HEIGHT, dtype=np.float64)[None, :, None]
    line = (rows >= top.T[:, None, :]) & (rows <= bottom.T[:, None, :])
    img[:, :HEIGHT, :][line] = _GRID

    node, y, x = pixels(grid["outlier_ts"], grid["outlier_value"], _segment_ids(grid["outlier_offsets"]))
    for dx, dy in ((0, 0), (-1, -1), (1, 1), (-1, 1), (1, -1), (-2, -2), (2, 2), (-2, 2), (2, -2)):
        img[node, np.clip(y + dy, 0, HEIGHT - 1), np.clip(x + dx, 0, WIDTH - 1)] = _OUTLIER
    return img.reshape(n * band, WIDTH), lo, hi


def run_plot_markdown(
    run_id: str,
    node_ids: Sequence[str],
    raw: Mapping[str, np.ndarray],
    grid: Mapping[str, np.ndarray],
) -> str:
    """Markdown: one image with a band per node (in the listed order) and the nodes' ranges."""
    image, lo, hi = run_image(raw, grid)
    gts = grid["grid_ts"]
    minutes = (int(gts[-1]) - int(gts[0])) / 60_000 if gts.size else 0.0
    outliers = np.diff(grid["outlier_offsets"])
    legend = "; ".join(
        f"{i}. `{node}` " + (f"{lo[i - 1]:.4g} … {hi[i - 1]:.4g}" if np.isfinite(lo[i - 1]) else "no data")
        + (f", {outliers[i - 1]} outliers" if outliers[i - 1] else "")
        for i, node in enumerate(node_ids, 1)
    )
    return (
        f"**run {run_id}**: {minutes:.1f} min; per node, top to bottom: raw points grey, cleaned grid "
        f"blue (gaps open), removed Hampel outliers red\n\n{data_uri_markdown(palette_png_bytes(image, PALETTE), f'run {run_id}')}"
        f"\n\n{legend}"
    )


# Split colours of the windows-per-run chart (matplotlib's tab10 blue, orange, green).
SPLIT_COLOURS = {"train": (31, 119, 180), "val": (255, 127, 14), "test": (44, 160, 44)}
BAR_HEIGHT = 120


def bars_png(values: Sequence[float], colours: Sequence[tuple[int, int, int]]) -> bytes:
    """A bar chart as PNG bytes: one bar per value, left to right, scaled to the largest."""
    n = len(values)
    bar = max(2, min(24, 720 // max(n, 1)))
    width = max(n * bar, 1)
    palette = np.array([[255, 255, 255], *colours], np.uint8)
    img = np.zeros((BAR_HEIGHT, width), np.uint8)
    top = max(max(values, default=0), 1)
    heights = np.round(np.asarray(values, float) / top * (BAR_HEIGHT - 1)).astype(int)
    rows = np.arange(BAR_HEIGHT)[:, None]
    columns = np.repeat(np.arange(n), bar)
    filled = rows >= (BAR_HEIGHT - heights[columns])[None, :]
    body = np.tile(np.r_[np.ones(bar - 1, bool), False], n)  # a one-pixel gap between bars
    img[filled & body[None, :]] = (columns + 1)[None, :].repeat(BAR_HEIGHT, 0)[filled & body[None, :]]
    return palette_png_bytes(img, palette)


def windows_per_run_markdown(runs: Sequence[tuple[str, str, int]]) -> str:
    """Windows per run in snapshot order, coloured by split (``runs``: (run id, split, windows))."""
    png = bars_png([w for _, _, w in runs], [SPLIT_COLOURS[p] for _, p, _ in runs])
    counts = {p: sum(1 for _, q, _ in runs if q == p) for p in SPLIT_COLOURS}
    first, last = (runs[0][0], runs[-1][0]) if runs else ("-", "-")
    return (
        f"**windows per run**, {first} … {last} in snapshot order: train (blue, {counts['train']} runs), "
        f"val (orange, {counts['val']}), test (green, {counts['test']}); the largest bar is "
        f"{max((w for _, _, w in runs), default=0)} windows\n\n" + data_uri_markdown(png, "windows per run")
    )
