"""PNG plots for the Dagster UI, embedded in markdown metadata as data URIs."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# Enough to see spikes and gaps; more only costs rendering time.
MAX_POINTS_PER_TRACE = 2000


def _thin(n: int) -> slice:
    return slice(None, None, max(1, -(-n // MAX_POINTS_PER_TRACE)))


def _markdown_png(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    plt.close(fig)
    return f"![{alt}](data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()})"


def run_plot_markdown(
    run_id: str,
    node_ids: Sequence[str],
    raw: Mapping[str, np.ndarray],
    grid: Mapping[str, np.ndarray],
) -> str:
    """Per node: raw points (grey), cleaned grid (blue), removed Hampel outliers (red x)."""
    n = len(node_ids)
    fig, axes = plt.subplots(n, 1, figsize=(9, 1.1 * n + 0.6), sharex=True, squeeze=False)
    t0 = grid["grid_ts"][0] if grid["grid_ts"].size else 0
    off, ooff = raw["offsets"], grid["outlier_offsets"]
    gts = (grid["grid_ts"] - t0) / 60_000.0
    for j, (ax, node) in enumerate(zip(axes[:, 0], node_ids, strict=True)):
        rs = slice(int(off[j]), int(off[j + 1]))
        rts, rv = raw["ts"][rs], raw["value"][rs]
        th = _thin(rts.size)
        ax.plot((rts[th] - t0) / 60_000.0, rv[th], ".", ms=1.5, color="0.6", rasterized=True)
        g = grid["values"][:, j]
        ax.plot(gts[_thin(gts.size)], g[_thin(g.size)], "-", lw=0.8, color="tab:blue")
        os_ = slice(int(ooff[j]), int(ooff[j + 1]))
        ax.plot((grid["outlier_ts"][os_] - t0) / 60_000.0, grid["outlier_value"][os_], "x", ms=4, color="tab:red")
        finite = g[np.isfinite(g)]
        if finite.size:
            lo, hi = float(finite.min()), float(finite.max())
            pad = (hi - lo) * 0.5 or 1.0
            ax.set_ylim(lo - pad, hi + pad)
        ax.set_ylabel(node, rotation=0, ha="right", fontsize=7)
        ax.tick_params(labelsize=6)
    axes[-1, 0].set_xlabel("minutes since run start", fontsize=7)
    fig.suptitle(f"run {run_id}: raw (grey), cleaned grid (blue), removed outliers (red)", fontsize=8)
    fig.tight_layout()
    return _markdown_png(fig, f"run {run_id}")


def bar_plot_markdown(labels: Sequence[str], values: Sequence[float], colors: Sequence[str], title: str) -> str:
    fig, ax = plt.subplots(figsize=(max(4, 0.25 * len(labels) + 2), 2.6))
    ax.bar(range(len(labels)), values, color=colors)
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    ax.set_title(title, fontsize=8)
    ax.tick_params(labelsize=6)
    fig.tight_layout()
    return _markdown_png(fig, title)
