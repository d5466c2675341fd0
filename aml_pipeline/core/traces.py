"""What a run's plot needs, summarised per node and pixel column, built from streamed chunks.

A run can be a month at 1 kHz, so its plot is never drawn from the run's points: each stage
feeds the chunks it streams anyway into a :class:`TraceAccumulator`, which keeps, per node and
pixel column of the run's time span, the min, max and count of

* the raw points as fetched (``raw``; min/max over finite values, count over every point),
* the cleaned grid (``grid``; min/max over finite values, plus how many grid rows fell in the
  column and how many of them are missing, so a gap stays visible at any zoom),
* the points removed as Hampel outliers (``removed``).

Memory is O(nodes x width) whatever the run's length. Min, max and counts do not depend on the
order or the cutting of the input, so any number of chunks, cut anywhere, give exactly the same
:class:`RunTraces` as one call with everything (the tests hold it to that).

Pixel column of a timestamp ``ts`` in the run's inclusive span ``[t0_ms, t1_ms]``:
``(ts - t0_ms) * width // (t1_ms - t0_ms + 1)``; points outside the span are ignored.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aml_pipeline.core.args import as_int, positive_int

DEFAULT_WIDTH = 800  # pixel columns: the run plot draws one per pixel of its data area
KINDS = ("raw", "grid", "removed")
FORMAT = "aml-run-traces/1"


@dataclass(frozen=True, eq=False)
class RunTraces:
    """Per node (rows, in ``node_ids`` order) and pixel column: the summaries a plot draws.

    ``*_min``/``*_max`` are float32 and NaN where the column has no finite value; counts are
    int64. ``grid_rows`` counts grid rows in the column, ``grid_missing`` those that are NaN.
    """

    t0_ms: int
    t1_ms: int
    node_ids: tuple[str, ...]
    raw_min: np.ndarray
    raw_max: np.ndarray
    raw_count: np.ndarray
    grid_min: np.ndarray
    grid_max: np.ndarray
    grid_rows: np.ndarray
    grid_missing: np.ndarray
    removed_min: np.ndarray
    removed_max: np.ndarray
    removed_count: np.ndarray

    ARRAYS = (
        "raw_min", "raw_max", "raw_count", "grid_min", "grid_max", "grid_rows", "grid_missing",
        "removed_min", "removed_max", "removed_count",
    )

    @property
    def width(self) -> int:
        return int(self.raw_count.shape[1])

    @property
    def span_ms(self) -> int:
        return self.t1_ms - self.t0_ms + 1

    def missing_ratio(self) -> np.ndarray:
        """Per node: the share of grid rows that are missing (NaN if the run has no grid row)."""
        rows = self.grid_rows.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(rows > 0, self.grid_missing.sum(axis=1) / np.maximum(rows, 1), np.nan)

    def folded(self, width: int) -> RunTraces:
        """The same summaries over ``width`` columns (at most :attr:`width`): column ``j`` joins
        column ``j * width // self.width``, mins by their min, maxes by their max, counts
        summed, so nothing drawn is lost. Exactly what accumulating at ``width`` gives when it
        divides :attr:`width`; otherwise a point near a column edge may sit one column over."""
        width = positive_int("width", width)
        if width > self.width:
            raise ValueError(f"folded: {width} columns is more than the traces' {self.width}")
        if width == self.width:
            return self
        starts = np.searchsorted(np.arange(self.width) * width // self.width, np.arange(width))
        out = {}
        for a in self.ARRAYS:
            v = getattr(self, a)
            fold = np.fmin if a.endswith("_min") else np.fmax if a.endswith("_max") else np.add
            out[a] = fold.reduceat(v, starts, axis=1)
        return RunTraces(self.t0_ms, self.t1_ms, self.node_ids, **out)

    def equals(self, other: RunTraces) -> bool:
        """Exactly the same summaries (NaN equal to NaN)."""
        return (
            (self.t0_ms, self.t1_ms, self.node_ids) == (other.t0_ms, other.t1_ms, other.node_ids)
            and all(
                np.array_equal(getattr(self, a), getattr(other, a), equal_nan=getattr(self, a).dtype.kind == "f")
                for a in self.ARRAYS
            )
        )

    # ---- one file -------------------------------------------------------------------------

    def save(self, path: str | Path, *, atomic: bool = True) -> Path:
        """Write to ``path`` (an ``.npz``: the counts compressed, the float32 extremes, which
        hardly compress, stored as they are) by rename; without ``atomic``, straight into
        ``path`` (a temporary file of the caller's own, renamed by it)."""
        path = Path(path)
        buf = io.BytesIO()
        header = {"format": FORMAT, "t0Ms": self.t0_ms, "t1Ms": self.t1_ms, "nodeIds": list(self.node_ids)}
        members = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
                   **{a: getattr(self, a) for a in self.ARRAYS}}
        with zipfile.ZipFile(buf, "w") as zf:
            for name, array in members.items():
                member = io.BytesIO()
                np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)
                packed = array.dtype.kind != "f"
                # A fixed member time (ZipInfo's 1980-01-01, as numpy's savez): the file's bytes
                # depend on its content only, which the stage versions' byte checks rely on.
                info = zipfile.ZipInfo(f"{name}.npy")
                info.compress_type = zipfile.ZIP_DEFLATED if packed else zipfile.ZIP_STORED
                zf.writestr(info, member.getbuffer(), compresslevel=1 if packed else None)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not atomic:
            with open(path, "wb") as f:
                f.write(buf.getbuffer())
            return path
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(buf.getbuffer())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | Path) -> RunTraces:
        path = Path(path)
        with np.load(path, allow_pickle=False) as data:
            try:
                header = json.loads(bytes(data["header"]))
                arrays = {a: data[a] for a in cls.ARRAYS}
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}: not a run traces file ({e})") from None
        if header.get("format") != FORMAT:
            raise ValueError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
        traces = cls(int(header["t0Ms"]), int(header["t1Ms"]), tuple(header["nodeIds"]), **arrays)
        _check_shapes(traces, str(path))
        return traces


def _check_shapes(traces: RunTraces, where: str) -> None:
    shape = (len(traces.node_ids), traces.width)
    for a in RunTraces.ARRAYS:
        if getattr(traces, a).shape != shape:
            raise ValueError(f"{where}: array {a} has shape {getattr(traces, a).shape}, expected {shape}")


class TraceAccumulator:
    """Builds a :class:`RunTraces` from chunks of one run, in any number and order of calls.

    ``node_index`` is the node's position in ``node_ids``: an int, or an int array with one
    entry per point (several nodes in one call, e.g. a stage's concatenated series).
    """

    def __init__(self, t0_ms: int, t1_ms: int, node_ids: Sequence[str], *, width: int = DEFAULT_WIDTH) -> None:
        self.t0_ms, self.t1_ms = as_int("t0_ms", t0_ms), as_int("t1_ms", t1_ms)
        if self.t1_ms < self.t0_ms:
            raise ValueError(f"TraceAccumulator: t1_ms ({self.t1_ms}) is before t0_ms ({self.t0_ms})")
        self.node_ids = tuple(str(n) for n in node_ids)
        self.width = positive_int("width", width)
        self._span = self.t1_ms - self.t0_ms + 1
        cells = len(self.node_ids) * self.width
        self._min = {k: np.full(cells, np.inf) for k in KINDS}
        self._max = {k: np.full(cells, -np.inf) for k in KINDS}
        self._count = {k: np.zeros(cells, np.int64) for k in KINDS}
        self._missing = np.zeros(cells, np.int64)

    def add_raw(self, node_index: int | np.ndarray, ts: np.ndarray, value: np.ndarray) -> None:
        """Raw points as fetched (non-finite values are counted, not drawn)."""
        self._add("raw", node_index, ts, value)

    def add_grid(self, node_index: int | np.ndarray | None, grid_ts: np.ndarray, values: np.ndarray) -> None:
        """Grid values (NaN = missing). ``values`` 1-D for one node, or 2-D ``[rows, nodes]`` with
        ``node_index`` listing the columns' nodes (``None``: every node, in order)."""
        values = np.asarray(values, dtype=np.float64)
        grid_ts = np.asarray(grid_ts)
        if values.ndim == 2:
            nodes = np.arange(len(self.node_ids)) if node_index is None else np.asarray(node_index, np.int64)
            if nodes.shape != (values.shape[1],):
                raise ValueError(f"add_grid: {values.shape[1]} value columns for {nodes.size} node indices")
            if grid_ts.shape != (values.shape[0],):
                raise ValueError(f"add_grid: {grid_ts.shape[0]} grid times for {values.shape[0]} rows")
            self._add(
                "grid",
                np.broadcast_to(nodes[None, :], values.shape).reshape(-1),
                np.broadcast_to(grid_ts[:, None], values.shape).reshape(-1),
                values.reshape(-1),
            )
            return
        if node_index is None:
            raise ValueError("add_grid: node_index is required for 1-D values")
        self._add("grid", node_index, grid_ts, values)

    def add_removed(self, node_index: int | np.ndarray, ts: np.ndarray, value: np.ndarray) -> None:
        """Points the Hampel filter removed."""
        self._add("removed", node_index, ts, value)

    def add_series(self, kind: str, starts: np.ndarray, ts: np.ndarray, value: np.ndarray) -> None:
        """Several nodes' points at once, as :meth:`add_raw` (``kind`` ``"raw"``) or
        :meth:`add_removed` (``"removed"``) with node ``j``'s points at ``starts[j] ..
        starts[j+1]-1``, each node's in time order (the nodes in ``node_ids`` order, all of them).

        When every point lies in the run's span, each node's pixel columns are found by searching
        the columns' first times among its points (no division per point), and the extremes are
        reduced over the finite values exactly as :meth:`_add` reduces them; otherwise it is
        :meth:`_add` itself."""
        if kind not in ("raw", "removed"):
            raise ValueError(f"add_series: kind must be 'raw' or 'removed', got {kind!r}")
        ts = np.asarray(ts)
        value = np.asarray(value, dtype=np.float64)
        bounds = np.append(np.asarray(starts, dtype=np.int64), ts.size)
        nodes = len(self.node_ids)
        if bounds.size != nodes + 1 or bounds[0] != 0 or np.any(np.diff(bounds) < 0):
            raise ValueError(f"add_{kind}: starts must ascend from 0, one per node ({nodes} nodes)")
        if ts.ndim != 1 or ts.shape != value.shape or (ts.size and not np.issubdtype(ts.dtype, np.integer)):
            raise ValueError(f"add_{kind}: ts (integer epoch ms) and values must be 1-D of equal length")
        back = np.flatnonzero(ts[1:] < ts[:-1])
        if back.size:  # a node's first point may precede the last one's
            at = np.minimum(np.searchsorted(bounds, back + 1), bounds.size - 1)
            back = back[bounds[at] != back + 1]
        lo, hi = bounds[:-1], bounds[1:] - 1
        filled = hi >= lo
        if back.size or np.any(ts[lo[filled]] < self.t0_ms) or np.any(ts[hi[filled]] > self.t1_ms):
            self._add(kind, np.repeat(np.arange(nodes, dtype=np.int64), np.diff(bounds)), ts, value)
            return
        # Column c holds the times t with (t - t0) * width // span == c: from t0 + ceil(c * span / width) on.
        c = np.arange(self.width + 1, dtype=np.int64)
        edges = self.t0_ms + (c * self._span + self.width - 1) // self.width
        pos = np.stack([np.searchsorted(ts[a:b], edges) + a for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())])
        self._count[kind] += np.diff(pos, axis=1).ravel()
        finite = np.isfinite(value)
        if not finite.all():
            pos -= np.searchsorted(np.flatnonzero(~finite), pos)  # positions among the finite values
            value = value[finite]
        per_cell = np.diff(pos, axis=1).ravel()
        cells_hit = np.flatnonzero(per_cell)
        if not cells_hit.size:
            return
        first = pos[:, :-1].ravel()[cells_hit]
        mins, maxs = self._min[kind], self._max[kind]
        mins[cells_hit] = np.minimum(mins[cells_hit], np.minimum.reduceat(value, first))
        maxs[cells_hit] = np.maximum(maxs[cells_hit], np.maximum.reduceat(value, first))

    def add_grid_rows(self, grid_ts: np.ndarray, values: np.ndarray) -> None:
        """Every node's grid at once, node-major (``values[j]`` is node ``j``'s column, the grid
        stage's order) at the ascending times ``grid_ts``: as :meth:`add_grid` of each node, with
        each row's pixel column computed once for all nodes."""
        values = np.asarray(values, dtype=np.float64)
        grid_ts = np.asarray(grid_ts)
        nodes = len(self.node_ids)
        if values.ndim != 2 or values.shape != (nodes, grid_ts.size):
            raise ValueError(f"add_grid_rows: values must be [{nodes} nodes, {grid_ts.size} rows], got {values.shape}")
        if grid_ts.size and not np.issubdtype(grid_ts.dtype, np.integer):
            raise ValueError(f"add_grid_rows: grid_ts must be integer epoch ms, got {grid_ts.dtype}")
        if np.any(grid_ts[1:] <= grid_ts[:-1]):
            raise ValueError("add_grid_rows: grid_ts must be strictly increasing")
        i0, i1 = np.searchsorted(grid_ts, [self.t0_ms, self.t1_ms + 1]).tolist()
        values, col = values[:, i0:i1], grid_ts[i0:i1].astype(np.int64) - self.t0_ms
        col *= self.width
        col //= self._span
        rows = col.size
        if not rows:
            return
        per_col = np.bincount(col, minlength=self.width)
        count = self._count["grid"].reshape(nodes, self.width)
        count += per_col
        missing = np.flatnonzero(~np.isfinite(values))
        per_cell = np.broadcast_to(per_col, (nodes, self.width)).ravel()
        flat = values.ravel()
        if missing.size:
            nan_cells = np.bincount(missing // rows * self.width + col[missing % rows], minlength=nodes * self.width)
            self._missing += nan_cells
            per_cell = per_cell - nan_cells
            flat = np.delete(flat, missing)
        cells_hit = np.flatnonzero(per_cell)
        if not cells_hit.size:
            return
        first = np.concatenate([[0], np.cumsum(per_cell[cells_hit])[:-1]])
        mins, maxs = self._min["grid"], self._max["grid"]
        mins[cells_hit] = np.minimum(mins[cells_hit], np.minimum.reduceat(flat, first))
        maxs[cells_hit] = np.maximum(maxs[cells_hit], np.maximum.reduceat(flat, first))

    def _add(self, kind: str, node_index: int | np.ndarray, ts: np.ndarray, value: np.ndarray) -> None:
        ts = np.asarray(ts)
        value = np.asarray(value, dtype=np.float64)
        if ts.ndim != 1 or ts.shape != value.shape:
            raise ValueError(f"add_{kind}: ts and values must be 1-D of equal length, got {ts.shape} and {value.shape}")
        if ts.size and not np.issubdtype(ts.dtype, np.integer):
            raise ValueError(f"add_{kind}: ts must be integer epoch ms, got {ts.dtype}")
        node = np.asarray(node_index)
        if node.ndim == 0:
            node = np.full(ts.shape, as_int("node_index", node_index), np.int64)
        elif node.shape != ts.shape:
            raise ValueError(f"add_{kind}: {node.size} node indices for {ts.size} points")
        if node.size and (node.min() < 0 or node.max() >= len(self.node_ids)):
            raise ValueError(f"add_{kind}: node index outside 0..{len(self.node_ids) - 1}")
        inside = (ts >= self.t0_ms) & (ts <= self.t1_ms)
        if not inside.all():
            ts, value, node = ts[inside], value[inside], node[inside]
        cell = ts.astype(np.int64, copy=False) - self.t0_ms  # the pixel column, computed in place
        cell *= self.width
        cell //= self._span
        cell += node.astype(np.int64, copy=False) * self.width
        cells = self._count[kind].shape[0]
        self._count[kind] += np.bincount(cell, minlength=cells)
        finite = np.isfinite(value)
        if kind == "grid":
            self._missing += np.bincount(cell[~finite], minlength=cells)
        if not finite.all():
            cell, value = cell[finite], value[finite]
        if cell.size and np.all(cell[1:] >= cell[:-1]):
            # One node's points in time order, or several nodes' series back to back: the cells
            # ascend, so each cell's points are one run, reduced in one call.
            first = np.flatnonzero(np.concatenate([[True], cell[1:] != cell[:-1]]))
            cells_hit = cell[first]
            mins, maxs = self._min[kind], self._max[kind]
            mins[cells_hit] = np.minimum(mins[cells_hit], np.minimum.reduceat(value, first))
            maxs[cells_hit] = np.maximum(maxs[cells_hit], np.maximum.reduceat(value, first))
            return
        np.minimum.at(self._min[kind], cell, value)
        np.maximum.at(self._max[kind], cell, value)

    def result(self) -> RunTraces:
        shape = (len(self.node_ids), self.width)

        def extreme(a: np.ndarray) -> np.ndarray:
            with np.errstate(over="ignore"):
                out = a.astype(np.float32)
            out[~np.isfinite(a)] = np.nan  # the +-inf start values: nothing in this column
            return out.reshape(shape)

        out = {}
        for k in KINDS:
            out[f"{k}_min"] = extreme(self._min[k])
            out[f"{k}_max"] = extreme(self._max[k])
        traces = RunTraces(
            self.t0_ms,
            self.t1_ms,
            self.node_ids,
            raw_min=out["raw_min"],
            raw_max=out["raw_max"],
            raw_count=self._count["raw"].reshape(shape).copy(),
            grid_min=out["grid_min"],
            grid_max=out["grid_max"],
            grid_rows=self._count["grid"].reshape(shape).copy(),
            grid_missing=self._missing.reshape(shape).copy(),
            removed_min=out["removed_min"],
            removed_max=out["removed_max"],
            removed_count=self._count["removed"].reshape(shape).copy(),
        )
        return traces
