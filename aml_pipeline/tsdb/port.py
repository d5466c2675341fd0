"""The time-series database port: what the dataset build needs from a TSDB, as columns.

Adapters implement :class:`TsdbPort` on :class:`~aml_pipeline.tsdb.reading.ReadBase`, which
writes the reading algorithm once (pages, cursor, prefetch); each adapter writes its primitives
(``duckdb.py``, ``postgres.py``, and the mapped sources of :mod:`aml_pipeline.sources`). Points never
travel as one Python object each: pages are numpy columns. Pagination is keyset on ``(ts, seq)``,
so points sharing a timestamp across a page boundary are neither lost nor repeated.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from aml_pipeline.errors import PaginationError, TruncationError, cut
from aml_pipeline.faults import crash_point

EvidenceSource = Literal["simulation", "real", "unassessed"]
EVIDENCE_SOURCES: tuple[str, ...] = ("simulation", "real", "unassessed")

DEFAULT_PAGE_LIMIT = 200_000
# How long opening a TSDB waits for another process (e.g. an embedded file's writer), in seconds.
DEFAULT_LOCK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Run:
    run_id: str
    line_id: str
    product_id: str
    recipe_id: str
    recipe_version: int | None
    recipe_content_hash: str | None
    started_at: int  # epoch ms
    ended_at: int | None  # None while the run is in progress
    evidence_source: str = "unassessed"
    context_confirmed: bool = False

    @property
    def finished(self) -> bool:
        return self.ended_at is not None


@dataclass(frozen=True)
class Node:
    node_id: str
    unit: str = ""
    range_lo: float | None = None
    range_hi: float | None = None


@dataclass(frozen=True)
class RunScope:
    """Which runs a dataset draws from. ``from_ms``/``to_ms`` keep runs overlapping the window."""

    line_id: str | None = None
    product_id: str | None = None
    recipe_id: str | None = None
    from_ms: int | None = None
    to_ms: int | None = None

    def admits(self, run: Run) -> bool:
        if self.line_id is not None and run.line_id != self.line_id:
            return False
        if self.product_id is not None and run.product_id != self.product_id:
            return False
        if self.recipe_id is not None and run.recipe_id != self.recipe_id:
            return False
        if self.to_ms is not None and run.started_at > self.to_ms:
            return False
        if self.from_ms is not None and run.ended_at is not None and run.ended_at < self.from_ms:
            return False
        return True

    def sql_conditions(self, *, finished_only: bool) -> list[tuple[str, str | int | None]]:
        """What :meth:`admits` asks, over the adapters' ``runs`` table (columns ``line_id``,
        ``product_id``, ``recipe_id``, ``started_at``, ``ended_at``): ``(condition, value)`` pairs,
        each condition with one ``?`` for its value, or none where the value is None. Times are
        clamped to int64."""
        from aml_pipeline.tsdb.columns import clamp_i64  # columns imports this module

        conds: list[tuple[str, str | int | None]] = [
            (f"{column} = ?", value)
            for column, value in (("line_id", self.line_id), ("product_id", self.product_id), ("recipe_id", self.recipe_id))
            if value is not None
        ]
        if self.to_ms is not None:
            conds.append(("started_at <= ?", clamp_i64(self.to_ms)))
        if self.from_ms is not None:
            conds.append(("(ended_at IS NULL OR ended_at >= ?)", clamp_i64(self.from_ms)))
        if finished_only:
            conds.append(("ended_at IS NOT NULL", None))
        return conds

    def __str__(self) -> str:
        """The scope in words, for messages: ``(line L1, product P100, recipe R7, any time)``."""
        import datetime as _dt

        def when(ms: int) -> str:
            return _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

        parts = [f"{name} {cut(value)}" for name, value in
                 (("line", self.line_id), ("product", self.product_id), ("recipe", self.recipe_id)) if value is not None]
        if self.from_ms is None and self.to_ms is None:
            parts.append("any time")
        elif self.to_ms is None:
            parts.append(f"overlapping {when(self.from_ms)} or later")
        elif self.from_ms is None:
            parts.append(f"starting by {when(self.to_ms)}")
        else:
            parts.append(f"overlapping {when(self.from_ms)} … {when(self.to_ms)}")
        return f"({', '.join(parts)})"


@dataclass(frozen=True, order=True)
class Cursor:
    """Resume strictly after the point ``(ts, seq)``."""

    ts: int
    seq: int


@dataclass(frozen=True)
class Page:
    ts: np.ndarray  # int64 epoch ms, ascending with seq
    value: np.ndarray  # float64
    state: np.ndarray  # int32
    seq: np.ndarray  # int64 ingestion sequence
    next_cursor: Cursor | None
    done: bool

    def __len__(self) -> int:
        return int(self.ts.shape[0])


@dataclass(frozen=True)
class PointColumns:
    """Points as columns, the unit of ingest. ``seq`` is assigned by the adapter."""

    run_id: np.ndarray  # object (str)
    node_id: np.ndarray  # object (str)
    ts: np.ndarray  # int64
    value: np.ndarray  # float64
    state: np.ndarray  # int32

    def __len__(self) -> int:
        return int(self.ts.shape[0])


@runtime_checkable
class TsdbPort(Protocol):
    url: str

    def list_runs(self, scope: RunScope | None = None, finished_only: bool = True) -> list[Run]:
        """Runs in scope ordered by (started_at, run_id)."""

    def get_run(self, run_id: str) -> Run:
        """Raises UnknownRunError."""

    def list_nodes(self) -> list[Node]:
        """Node catalog ordered by node_id."""

    def availability_watermark(self) -> int | None:
        """Latest point timestamp (epoch ms) the database holds, None when empty."""

    def query_page(
        self,
        node_id: str,
        run_id: str,
        from_ms: int,
        to_ms: int,
        cursor: Cursor | None = None,
        limit: int = DEFAULT_PAGE_LIMIT,
    ) -> Page:
        """Points of one node in one run with ``from_ms <= ts <= to_ms`` and ``(ts, seq) > cursor``,
        ordered by ``(ts, seq)``, at most ``limit`` of them."""

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
        """A hint before a time slice of a run is read node by node: read the points of
        ``node_ids`` in ``run_id`` within ``[from_ms, to_ms]`` at once (at most ``max_points``,
        within the memory budget) and serve the next :meth:`query_page` calls for exactly those
        series from memory, the same pages as without the hint. ``ahead``: the slices
        ``(run_id, from_ms, to_ms)`` of the same nodes the caller prefetches next, in that order;
        an adapter may read them with this one and hold them (within the same memory bound), so
        that their own prefetch reads nothing. Returns whether the hint was taken. The default
        takes none (False): every page is read when it is asked for."""
        return False

    def run_versions(self, run_ids: Sequence[str]) -> dict[str, str]:
        """An opaque data version per run: it changes whenever the run's points change (appended,
        replaced) or its record changes, and only then. Cheap (no scan of the points). Ids the
        database does not hold are absent from the result."""

    def ingest(
        self,
        *,
        runs: Sequence[Run] = (),
        nodes: Sequence[Node] = (),
        points: PointColumns | None = None,
        replace_runs: bool = False,
    ) -> int:
        """Upsert runs and nodes, append points (seq in row order) in one transaction; points
        already stored (same run, node, ts, value, state) are skipped. ``replace_runs``: first
        delete the stored points of every run that has points here. Returns the number of points
        written. Nothing is written if anything fails."""

    def close(self) -> None: ...


class PortCalls:
    """The port's reading methods, each passed to ``self._call(name, *args, **kwargs)``: the base
    of the wrappers that do something around every call (hold a handle briefly, retry)."""

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def list_runs(self, *args: Any, **kwargs: Any) -> list[Run]:
        return self._call("list_runs", *args, **kwargs)

    def get_run(self, *args: Any, **kwargs: Any) -> Run:
        return self._call("get_run", *args, **kwargs)

    def list_nodes(self, *args: Any, **kwargs: Any) -> list[Node]:
        return self._call("list_nodes", *args, **kwargs)

    def availability_watermark(self) -> int | None:
        return self._call("availability_watermark")

    def query_page(self, *args: Any, **kwargs: Any) -> Page:
        return self._call("query_page", *args, **kwargs)

    def prefetch(self, *args: Any, **kwargs: Any) -> bool:
        return self._call("prefetch", *args, **kwargs)

    def run_versions(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        return self._call("run_versions", *args, **kwargs)


def ordered_by_ts_seq(ts: np.ndarray, seq: np.ndarray, new: np.ndarray | None = None) -> bool:
    """Whether the points ``(ts, seq)`` ascend strictly: one comparison over the points, the
    seqs compared only where timestamps repeat. ``new`` (one flag per point after the first):
    where another series begins, which need not follow the one before it."""
    if ts.shape[0] < 2:
        return True
    later = ts[1:] > ts[:-1]
    if new is not None:
        later |= new
    if bool(later.all()):
        return True
    tied = np.flatnonzero(~later)
    return bool(np.all((ts[tied + 1] == ts[tied]) & (seq[tied + 1] > seq[tied])))


def iter_node_pages(
    tsdb: TsdbPort,
    node_id: str,
    run_id: str,
    from_ms: int,
    to_ms: int,
    *,
    page_limit: int = DEFAULT_PAGE_LIMIT,
) -> Iterator[tuple[Page, int]]:
    """Every page of a node in a run, with the number of queries so far; memory is one page.

    Guards against the ways a backend can lose or repeat points: a cursor that does not advance,
    a page whose rows do not follow the cursor, a page longer than asked for, a page that says
    "not done" without a cursor.
    """
    if page_limit < 1:
        raise ValueError(f"page_limit must be >= 1, got {page_limit}")
    cursor: Cursor | None = None
    queries = 0
    where = f"node {node_id!r} in run {run_id!r}"
    while True:
        page = tsdb.query_page(node_id, run_id, from_ms, to_ms, cursor, page_limit)
        queries += 1
        n = len(page)
        if n > page_limit:
            raise TruncationError(
                f"{tsdb.url}: page for {where} has {n} rows, more than the limit {page_limit}"
            )
        if n:
            first = Cursor(int(page.ts[0]), int(page.seq[0]))
            if cursor is not None and not first > cursor:
                raise PaginationError(
                    f"{tsdb.url}: page for {where} starts at {first}, not after cursor {cursor}"
                )
            if not ordered_by_ts_seq(page.ts, page.seq):
                raise PaginationError(f"{tsdb.url}: page for {where} is not ordered by (ts, seq)")
        crash_point("fetch.page")
        yield page, queries
        if page.done:
            return
        if page.next_cursor is None:
            raise PaginationError(f"{tsdb.url}: page for {where} is not done but has no cursor")
        if cursor is not None and not page.next_cursor > cursor:
            raise PaginationError(
                f"{tsdb.url}: cursor for {where} did not advance (stuck at {cursor}); "
                "refusing to loop"
            )
        if n == 0:
            raise PaginationError(f"{tsdb.url}: empty page for {where} that is not done")
        cursor = page.next_cursor
