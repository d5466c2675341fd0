"""Reading the series layout: windows cut from the stored rows when they are read.

A series snapshot stores every grid row its windows read once (``x_rows``, ``u_rows``,
``y_rows``) and a window index of segments (:data:`~.layout.SEGMENT_FIELDS`). Window ``i`` of
segment ``k`` (``j = i - window[k]``) reads:

* history ``x[i]`` = ``x_rows[xRow[k] + j * min(stride, H)`` ... ``+ H]``,
* future ``u[i]``/``y[i]`` = ``u_rows``/``y_rows[futureRow[k] + j * min(stride, F)`` ... ``+ F]``,
* ``timestamps[i, s]`` = ``startMs[k] + (j * stride + s - H) * beatMs`` (v2), ``mask[i]`` = 1.

:class:`WindowArray` presents x, u, y (and v2 timestamps, mask) with the windows layout's shape,
indexed by int, slice, index or boolean array (and a tuple starting with one of those), and
:meth:`WindowArray.read` fills a buffer with a range of windows from rows read with ``pread``:
both cut every window at once with numpy (a strided view of the rows, indexed by the windows'
first rows), never a Python loop per window.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import numpy as np

from .layout import SEGMENT_FIELDS, SnapshotError

# Segments validated per slice at open (bounded memory whatever the index's size).
_VALIDATE_SEGMENTS = 1 << 18
# An index of at most this many segments is also held as Python lists (a few MB at most).
_LIST_SEGMENTS = 1 << 15


class SeriesIndex:
    """The window index of a series snapshot: where every window's rows are, by its segment."""

    def __init__(self, segments: np.ndarray, *, windows: int, history: int, horizon: int, stride: int,
                 beat_ms: int) -> None:
        if segments.ndim != 2 or segments.shape[0] != len(SEGMENT_FIELDS):
            raise ValueError(f"segments must be [{len(SEGMENT_FIELDS)}, K], got shape {segments.shape}")
        self.segments = segments
        # Plain ndarray views of the fields (a memmap's own indexing costs microseconds a call).
        self.run, self.window, self.start, self.start_ms, self.x_row, self.future_row = segments.view(np.ndarray)
        self.n_windows, self.H, self.F = int(windows), int(history), int(horizon)
        self.stride, self.beat_ms = int(stride), int(beat_ms)
        # Rows between consecutive windows of a segment, among the stored history / future rows.
        self.x_step, self.future_step = min(self.stride, self.H), min(self.stride, self.F)
        # A small index is also kept as Python lists: finding the segments of a block of windows
        # (once per array and block read) is then a bisect, not a numpy call.
        self._lists = None
        self._last_pieces: tuple[tuple[str, int, int], list[tuple[int, int, int]]] | None = None
        if self.segments.shape[1] <= _LIST_SEGMENTS:
            self._lists = (self.window.tolist(), self.x_row.tolist(), self.future_row.tolist())

    def __len__(self) -> int:
        return int(self.segments.shape[1])

    def locate(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(segment, position in it)`` of every window (int64 arrays, shaped like ``windows``)."""
        k = np.searchsorted(self.window, windows, side="right") - 1
        return k, windows - self.window[k]

    def rows(self, group: str, windows: np.ndarray) -> np.ndarray:
        """First stored row of each window's ``x`` (history) or ``u``/``y`` (future) rows."""
        k, j = self.locate(windows)
        if group == "x":
            return self.x_row[k] + j * self.x_step
        return self.future_row[k] + j * self.future_step

    def origin_ms(self, windows: np.ndarray) -> np.ndarray:
        """Epoch ms of each window's row t (its first future row), int64."""
        k, j = self.locate(windows)
        return self.start_ms[k] + j * (self.stride * self.beat_ms)

    def pieces(self, group: str, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Windows ``start:stop`` as ``(first window, last window + 1, first stored row)`` per
        segment they fall in: inside a piece, window ``i`` reads from row ``first row +
        (i - first window) * min(stride, steps)``."""
        key = (group, start, stop)
        last = self._last_pieces  # read once: another thread may replace it
        if last is not None and last[0] == key:  # y after u: the same rows
            return last[1]
        if self._lists is not None:
            window, x_row, future_row = self._lists
            k0, k1 = bisect_right(window, start) - 1, bisect_right(window, stop - 1) - 1
        else:
            window, x_row, future_row = self.window, self.x_row, self.future_row
            k0, k1 = (int(k) - 1 for k in np.searchsorted(window, (start, stop - 1), side="right"))
        first_row, step = (x_row, self.x_step) if group == "x" else (future_row, self.future_step)
        firsts = list(window[k0 : k1 + 1])
        bounds = firsts[1:] + [stop]
        rows = list(first_row[k0 : k1 + 1])
        out, a = [], start
        for b, row, w0 in zip(bounds, rows, firsts, strict=True):
            out.append((a, b, int(row + (a - w0) * step)))
            a = b
        self._last_pieces = (key, out)
        return out

    def runs_and_starts(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each window's run (position in the snapshot's run order) and start row t in that run."""
        k, j = self.locate(windows)
        return self.run[k], self.start[k] + j * self.stride

    def validate(self, root: Any, *, run_windows: Sequence[int], x_rows: int, future_rows: int) -> None:
        """Raise ``SNAPSHOT_INVALID`` unless the index describes exactly the snapshot's windows:
        segments tile windows ``0 .. N-1`` in order, each run's segments hold its windows
        (``run_windows``, in run order), starts ascend within a run, each run's times are one
        grid, and every window's rows lie inside the row files. Streams the index in slices."""
        K, N, R = len(self), self.n_windows, len(run_windows)
        if (K == 0) != (N == 0):
            raise SnapshotError(f"{root}: segments.i64 has {K} segments for {N} windows")
        totals = np.zeros(R, dtype=np.int64)
        carry: tuple[int, int, int] | None = None  # the previous segment's run, last start and grid origin
        for a in range(0, K, _VALIDATE_SEGMENTS):
            b = min(K, a + _VALIDATE_SEGMENTS)
            run, first, start, start_ms, x_row, f_row = (np.asarray(f[a:b]) for f in self.segments)
            nxt = np.asarray(self.window[b : b + 1]) if b < K else np.array([N], dtype=np.int64)
            count = np.diff(np.concatenate([first, nxt]))
            last = start + (count - 1) * self.stride
            problem = None
            if a == 0 and first[0] != 0:
                problem = "the first segment does not start at window 0"
            elif np.any(count < 1):
                problem = "segments' first windows do not ascend"
            elif np.any((run < 0) | (run >= R)):
                problem = f"a segment names a run outside 0 .. {R - 1}"
            elif np.any(start < self.H):
                problem = f"a window starts before row historySteps = {self.H}"
            elif np.any(x_row < 0) or np.any(x_row + (count - 1) * self.x_step + self.H > x_rows):
                problem = "a window's history rows lie outside x_rows"
            elif np.any(f_row < 0) or np.any(f_row + (count - 1) * self.future_step + self.F > future_rows):
                problem = "a window's future rows lie outside u_rows/y_rows"
            else:
                origin = start_ms - start * self.beat_ms  # the run's first grid time
                prev_run = np.concatenate([[carry[0] if carry else -1], run[:-1]])
                prev_last = np.concatenate([[carry[1] if carry else -1], last[:-1]])
                prev_origin = np.concatenate([[carry[2] if carry else 0], origin[:-1]])
                same = run == prev_run
                if np.any(run < prev_run):
                    problem = "segments are not in run order"
                elif np.any(same & (start <= prev_last)):
                    problem = "a run's window starts do not ascend"
                elif np.any(same & (origin != prev_origin)):
                    problem = "a run's window times are not on one grid of beatMs"
            if problem is not None:
                raise SnapshotError(f"{root}: arrays/segments.i64 is not a window index of this snapshot: {problem}")
            totals += np.bincount(run, weights=count, minlength=R).astype(np.int64)
            carry = (int(run[-1]), int(last[-1]), int(origin[-1]))
        want = np.asarray(list(run_windows), dtype=np.int64)
        if not np.array_equal(totals, want):
            bad = int(np.flatnonzero(totals != want)[0])
            raise SnapshotError(
                f"{root}: arrays/segments.i64 gives run {bad} of the snapshot {int(totals[bad])} windows, "
                f"split.blocks {int(want[bad])}"
            )


class WindowArray:
    """One array of a series snapshot's windows (``x``, ``u``, ``y``, ``timestamps`` or ``mask``),
    shaped and indexed like the windows layout's memory map of it, cut from rows on read.

    Indexing returns new numpy arrays. ``np.asarray(array)`` cuts every window (the whole array in
    memory); prefer slices, index arrays and :meth:`read`.
    """

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)

    # ---- what subclasses provide ----------------------------------------------------------------

    def _cut(self, windows: np.ndarray) -> np.ndarray:
        """Windows ``windows`` (int64, 1-D, in range) as a new ``[n, *shape[1:]]`` array."""
        raise NotImplementedError

    def read(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """Windows ``start:stop`` into ``out`` (C-contiguous, the right shape and dtype)."""
        out[...] = self._cut(np.arange(start, stop, dtype=np.int64))
        return out

    # ---- the ndarray-like surface -------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        """numpy's indexing of the windows layout's array, whatever the key: the windows the
        first index names are cut (each once, in order), and the whole key, its first index
        rewritten to address those windows, is applied to them, so advanced indices on later
        axes broadcast with the first as numpy broadcasts them."""
        key = key if isinstance(key, tuple) else (key,)
        if not key or key[0] is Ellipsis:  # the windows axis is not the first one named: all of it
            return self._cut(np.arange(len(self), dtype=np.int64))[key]
        first, rest = key[0], key[1:]
        windows, shape = self._windows(first)
        cut = self._cut(windows.reshape(-1))
        if shape is None:  # an integer: numpy's scalar index into the one window cut
            return cut[(0, *rest)]
        if isinstance(first, slice):
            at: Any = slice(None)
        else:  # an index array (booleans: the positions they select, as numpy reads them)
            at = np.arange(cut.shape[0], dtype=np.int64).reshape(shape)
        return cut[(at, *rest)]

    def _windows(self, key: Any) -> tuple[np.ndarray, tuple[int, ...] | None]:
        n = len(self)
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            i = int(key) + (n if key < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {int(key)} is out of bounds for axis 0 with size {n}")
            return np.array([i], dtype=np.int64), None
        if isinstance(key, slice):
            r = range(n)[key]
            return np.arange(r.start, r.stop, r.step, dtype=np.int64), (len(r),)
        if key is None:
            raise TypeError(f"{self.name}: np.newaxis on the windows axis is not supported; index the result instead")
        arr = np.asarray(key)
        if arr.dtype == np.bool_:
            if arr.shape != (n,):
                raise IndexError(f"boolean index of shape {arr.shape} does not match the {n} windows")
            found = np.flatnonzero(arr).astype(np.int64)
            return found, (found.size,)
        # numpy takes an empty list (read as float) but no other array of non-integers
        if arr.size == 0 and not isinstance(key, np.ndarray):
            return np.empty(0, dtype=np.int64), arr.shape
        if arr.dtype.kind not in "iu":
            raise IndexError(f"{self.name}: windows are indexed by integers, slices or booleans, got {arr.dtype}")
        w = arr.astype(np.int64)
        w = np.where(w < 0, w + n, w)
        if np.any((w < 0) | (w >= n)):
            bad = int(arr.reshape(-1)[np.flatnonzero(((w < 0) | (w >= n)).reshape(-1))[0]])
            raise IndexError(f"index {bad} is out of bounds for axis 0 with size {n}")
        return w, arr.shape

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._cut(np.arange(len(self), dtype=np.int64))
        return out if dtype is None else out.astype(dtype, copy=False)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"<WindowArray {self.name} {list(self.shape)} {self.dtype} (series layout, cut on read)>"


class RowWindows(WindowArray):
    """``x``, ``u`` or ``y``: ``steps`` consecutive stored rows per window."""

    def __init__(self, name: str, index: SeriesIndex, rows: np.ndarray, fd: Any, steps: int) -> None:
        super().__init__(name, (index.n_windows, steps, rows.shape[1]), rows.dtype)
        self.index, self.rows, self._file, self.steps = index, rows, fd, steps
        self.group = "x" if name == "x" else "future"
        self.step = index.x_step if self.group == "x" else index.future_step
        self._row_bytes = rows.shape[1] * rows.dtype.itemsize

    def _windows_at(self, rows: np.ndarray, first_row: int, count: int, step: int) -> np.ndarray:
        """The zero-copy ``[count, steps, cols]`` view of the windows whose rows start at
        ``first_row``, ``first_row + step``, ... of ``rows`` (a C-ordered row array)."""
        return np.ndarray((count, self.steps, self.shape[2]), dtype=self.dtype, buffer=rows,
                          offset=first_row * self._row_bytes,
                          strides=(step * self._row_bytes, self._row_bytes, self.itemsize))

    def _cut(self, windows: np.ndarray) -> np.ndarray:
        if windows.size == 0 or self.shape[2] == 0:
            return np.empty((windows.size, *self.shape[1:]), dtype=self.dtype)
        # Every block of `steps` consecutive rows, as a view; the windows' first rows index it.
        blocks = self._windows_at(self.rows, 0, self.rows.shape[0] - self.steps + 1, 1)
        return blocks[self.index.rows(self.group, windows)]

    def read(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """Windows ``start:stop``: the rows they read, ``pread`` from the verified file into a
        buffer of about their size (not through the map), then each segment's windows copied
        into ``out`` as one strided view of those rows (a gather when segments are many)."""
        if stop <= start or self.shape[2] == 0:
            return out
        pieces = self.index.pieces(self.group, start, stop)
        if len(pieces) == 1:
            a, b, lo = pieces[0]
            hi = lo + (b - a - 1) * self.step + self.steps
        else:
            lo = min(row for _, _, row in pieces)
            hi = max(row + (b - a - 1) * self.step for a, b, row in pieces) + self.steps
        rows = np.empty((hi - lo, self.shape[2]), dtype=self.dtype)
        _pread_into(self._file, memoryview(rows.reshape(-1).view(np.uint8)), lo * self._row_bytes, self.name)
        if len(pieces) > max(8, (stop - start) // 8):  # many short segments: one gather
            first = self.index.rows(self.group, np.arange(start, stop, dtype=np.int64)) - lo
            out[...] = self._windows_at(rows, 0, rows.shape[0] - self.steps + 1, 1)[first]
            return out
        for a, b, row in pieces:
            out[a - start : b - start] = self._windows_at(rows, row - lo, b - a, self.step)
        return out


class TimestampWindows(WindowArray):
    """v2 ``timestamps``: each window's grid times, derived from its segment's start time."""

    def __init__(self, index: SeriesIndex) -> None:
        super().__init__("timestamps", (index.n_windows, index.H + index.F), np.dtype("<f8"))
        self.index = index
        self._steps = np.arange(-index.H, index.F, dtype=np.int64) * index.beat_ms

    def _cut(self, windows: np.ndarray) -> np.ndarray:
        # int64 epoch ms, then float64: the windows layout's arithmetic, so the bytes are its.
        return (self.index.origin_ms(windows)[:, None] + self._steps).astype(np.float64)


class MaskWindows(WindowArray):
    """v2 ``mask``: 1 for every step (windows with a gap in what they use are not stored)."""

    def __init__(self, index: SeriesIndex) -> None:
        super().__init__("mask", (index.n_windows, index.H + index.F), np.dtype("<f4"))

    def _cut(self, windows: np.ndarray) -> np.ndarray:
        return np.ones((windows.size, *self.shape[1:]), dtype=self.dtype)


def _pread_into(f: Any, view: memoryview, offset: int, name: str) -> None:
    fd, done = f.fileno(), 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise SnapshotError(f"the rows of {name} ended early (truncated since it was opened?)")
        done += n
