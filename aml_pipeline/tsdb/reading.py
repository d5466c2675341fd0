"""The port's reading algorithm, written once: every adapter writes only its primitives.

A template method, as xarray's backends are. :class:`ReadBase` owns pages (the ``(ts, seq)``
cursor, a read resumed strictly after it so that points sharing a timestamp across a page
boundary are neither lost nor repeated, an exact ``done``, ``TSDB_PAGINATION`` for a read that
does not move past the cursor, ``TSDB_TRUNCATED`` for one that returns more than asked), the run
prefetch (bounded by the memory budget, served from memory exactly as the reads would serve it)
and the handle's lock and closing. An adapter writes :meth:`~ReadBase._locate`,
:meth:`~ReadBase._read`, optionally :meth:`~ReadBase._read_run`, :meth:`~ReadBase._release` and
the port's catalog methods (``list_runs``, ``get_run``, ``list_nodes``,
``availability_watermark``, ``run_versions``, ``ingest``); ``docs/architecture.md`` ("Reading a
TSDB") says how. Its ``__init__`` calls ``super().__init__()`` first: the base's re-entrant lock
(``self._lock``) serialises every call of a handle, so primitives may share one connection.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aml_pipeline.config import memory_budget_mb
from aml_pipeline.errors import PaginationError, TruncationError, TsdbError
from aml_pipeline.tsdb.columns import clamp_i64, empty_page
from aml_pipeline.tsdb.port import DEFAULT_PAGE_LIMIT, Cursor, Page, TsdbPort

# A prefetched slice holds at most 1/PREFETCH_MEMORY_SHARE of the memory budget (AML_MEMORY_MB).
PREFETCH_MEMORY_SHARE = 8


@dataclass(frozen=True, slots=True)
class Rows:
    """Points of one series in ``(ts, seq)`` order, as columns."""

    ts: np.ndarray  # int64 epoch ms
    value: np.ndarray  # float64
    state: np.ndarray  # int32
    seq: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.ts.shape[0])

    def slice(self, start: int, stop: int) -> Rows:
        return Rows(self.ts[start:stop], self.value[start:stop], self.state[start:stop], self.seq[start:stop])

    def head(self, n: int) -> Rows:
        return self if len(self) <= n else self.slice(0, n)


class ReadBase(TsdbPort):
    """The port's pages and prefetch over an adapter's primitives (see the module docstring)."""

    url: str
    # What one prefetched point costs in memory while the slice is read and kept.
    _PREFETCH_BYTES_PER_POINT = 28  # ts, value, seq (8 bytes each) and state (4)

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._prefetched: dict[tuple[str, str, int, int], Rows] = {}
        # Slices read ahead by a prefetch, until their own prefetch: (run, from, to, nodes) ->
        # (points, rows per node).
        self._ahead: dict[tuple[str, int, int, tuple[str, ...]], tuple[int, dict[str, Rows]]] = {}
        self._closed = False

    # ---- primitives ----------------------------------------------------------------------------
    def _locate(self, node_id: str, run_id: str, from_ms: int, to_ms: int) -> tuple[Any, int, int]:
        """``(series, lo, hi)``: the adapter's handle on one node's points in one run, and the
        bounds of ``from_ms .. to_ms`` within it (int64)."""
        raise NotImplementedError

    def _read(self, series: Any, lo: int, hi: int, after: Cursor | None, want: int) -> Rows:
        """The first ``want`` points of ``series`` with ``lo <= ts <= hi`` (and after ``after``,
        whose ``ts`` is ``lo``), in ``(ts, seq)`` order."""
        raise NotImplementedError

    def _read_run(
        self, run_id: str, node_ids: Sequence[str], from_ms: int, to_ms: int, most: int
    ) -> dict[str, Rows] | None:
        """Every point of each of ``node_ids`` (the ones the database knows) in ``run_id`` within
        ``[from_ms, to_ms]``, in one read; None if there are more than ``most`` in all or the
        adapter has no such read."""
        return None

    def _read_slices(
        self, slices: Sequence[tuple[str, int, int]], node_ids: Sequence[str], most: int, total: int
    ) -> list[dict[str, Rows] | None]:
        """Per slice ``(run_id, from_ms, to_ms)``, what :meth:`_read_run` gives for it (None: not
        read), the first slice always tried, those after it read with it where the adapter can:
        each at most ``most`` points, all together at most ``total``. The default reads the
        first alone."""
        run_id, from_ms, to_ms = slices[0]
        return [self._read_run(run_id, node_ids, from_ms, to_ms, most), *([None] * (len(slices) - 1))]

    def _release(self) -> None:
        """Close connections and files."""

    # ---- the port ------------------------------------------------------------------------------
    def query_page(
        self,
        node_id: str,
        run_id: str,
        from_ms: int,
        to_ms: int,
        cursor: Cursor | None = None,
        limit: int = DEFAULT_PAGE_LIMIT,
    ) -> Page:
        """Keyset page on ``(ts, seq)``; ``done`` is exact (``limit + 1`` points are asked for)."""
        limit = int(limit)
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        with self._lock:
            self._require_open()
            key = (node_id, run_id, from_ms, to_ms)
            if key in self._prefetched:
                return self._prefetched_page(key, cursor, limit)
            series, lo, hi = self._locate(node_id, run_id, from_ms, to_ms)
            return self._page(series, lo, hi, cursor, limit, f"node {node_id!r} in run {run_id!r}")

    def _page(self, series: Any, lo: int, hi: int, cursor: Cursor | None, limit: int, where: str) -> Page:
        """One page of ``series`` within ``[lo, hi]`` after ``cursor`` (``where``: for messages)."""
        after = None
        if cursor is not None:
            c_ts = clamp_i64(cursor.ts)
            if c_ts >= lo:  # (ts, seq) > cursor implies ts >= cursor.ts
                after, lo = Cursor(c_ts, clamp_i64(cursor.seq)), c_ts
        if lo > hi:
            return empty_page(cursor)
        want = limit + 1
        rows = self._read(series, lo, hi, after, want)
        n = len(rows)
        if n > want:
            raise TruncationError(f"{self.url}: a read of {where} returned {n} points, more than the {want} asked for")
        if n and after is not None and not Cursor(int(rows.ts[0]), int(rows.seq[0])) > after:
            raise PaginationError(
                f"{self.url}: the cursor for {where} did not advance (a read after {after} began at "
                f"{Cursor(int(rows.ts[0]), int(rows.seq[0]))}); refusing to loop"
            )
        done = n <= limit
        return self._as_page(rows.head(limit), cursor, done)

    @staticmethod
    def _as_page(rows: Rows, cursor: Cursor | None, done: bool) -> Page:
        next_cursor = Cursor(int(rows.ts[-1]), int(rows.seq[-1])) if len(rows) else cursor
        return Page(rows.ts, rows.value, rows.state, rows.seq, next_cursor, done)

    def prefetch(
        self,
        run_id: str,
        node_ids: Sequence[str],
        from_ms: int,
        to_ms: int,
        *,
        max_points: int | None = None,
        ahead: Sequence[tuple[str, int, int]] = (),
    ) -> bool:
        """Read the points of ``node_ids`` in ``run_id`` within ``[from_ms, to_ms]`` in one read
        (:meth:`_read_run`) and serve the next :meth:`query_page` calls for exactly those series
        from memory: the same rows, order, limits and cursors as the reads give. A series is
        dropped once its last page has been served; a new prefetch replaces the old one.

        ``ahead`` (the slices prefetched next) is read in the same read where the adapter can
        (:meth:`_read_slices`) and held: a later prefetch of one of them, for the same nodes, is
        served from what is held, and drops the slices held before it; any other prefetch drops
        them all, and closing the handle does too.

        Bounded: a slice of more than ``max_points`` (at most :meth:`prefetch_limit` points,
        1/:data:`PREFETCH_MEMORY_SHARE` of ``AML_MEMORY_MB``) is not kept, and the pages are read
        as without the hint; what is held and served at once is at most :meth:`prefetch_limit`
        points. A node the database does not know is left to :meth:`query_page`, which reports
        it. Returns whether the slice is served from memory.
        """
        with self._lock:
            self._require_open()
            self._prefetched.clear()
            if from_ms > to_ms:  # nothing to read (what is held stays)
                return False
            limit = self.prefetch_limit()
            most = limit if max_points is None else min(int(max_points), limit)
            nodes = tuple(dict.fromkeys(node_ids))
            key = (run_id, from_ms, to_ms, nodes)
            held = None
            if key in self._ahead:
                for k in list(self._ahead):  # the slices before it are not asked for any more
                    points, rows = self._ahead.pop(k)
                    if k == key:
                        held = rows if points <= most else None
                        break
            if held is None:
                self._ahead.clear()
                slices = [(run_id, from_ms, to_ms)]
                for r, a, b in ahead:
                    if (r, a, b) not in slices:
                        slices.append((r, a, b))
                read = self._read_slices(slices, list(nodes), most, limit)
                held = read[0]
                for (r, a, b), rows in zip(slices[1:], read[1:]):
                    if rows is not None:
                        self._ahead[(r, a, b, nodes)] = (sum(len(x) for x in rows.values()), rows)
            if held is None:
                return False
            for node_id, rows in held.items():
                self._prefetched[(node_id, run_id, from_ms, to_ms)] = rows
        return True

    @classmethod
    def prefetch_limit(cls) -> int:
        """The most points one :meth:`prefetch` keeps, from the memory budget."""
        return memory_budget_mb() * 2**20 // PREFETCH_MEMORY_SHARE // cls._PREFETCH_BYTES_PER_POINT

    def _prefetched_page(self, key: tuple[str, str, int, int], cursor: Cursor | None, limit: int) -> Page:
        rows = self._prefetched[key]
        pos = 0
        if cursor is not None:  # the first point with (ts, seq) > cursor
            c_ts, c_seq = clamp_i64(cursor.ts), clamp_i64(cursor.seq)
            lo, hi = int(np.searchsorted(rows.ts, c_ts, "left")), int(np.searchsorted(rows.ts, c_ts, "right"))
            pos = lo + int(np.searchsorted(rows.seq[lo:hi], c_seq, "right"))
        done = len(rows) - pos <= limit
        if done:
            del self._prefetched[key]
        return self._as_page(rows.slice(pos, min(pos + limit, len(rows))), cursor, done)

    # ---- lifecycle -----------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._closed:
            raise TsdbError(f"{self.url}: this TSDB handle is closed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._prefetched.clear()
            self._ahead.clear()
            self._release()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
