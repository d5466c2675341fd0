"""fetch_node_series against misbehaving fake backends: it must fail loudly, never loop or cut."""

from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.errors import PaginationError, TruncationError
from aml_pipeline.tsdb.port import Cursor, Page, TsdbPort
from aml_pipeline_tests.tsdb.series import fetch_node_series


def page(ts, seq=None, *, done: bool, cursor: Cursor | None | str = "last") -> Page:
    ts = np.asarray(ts, dtype=np.int64)
    seq = np.arange(len(ts), dtype=np.int64) if seq is None else np.asarray(seq, dtype=np.int64)
    if cursor == "last":
        cursor = Cursor(int(ts[-1]), int(seq[-1])) if len(ts) else None
    return Page(ts, ts.astype(np.float64), np.zeros(len(ts), np.int32), seq, cursor, done)


class Keyset(TsdbPort):
    """A correct keyset backend over (ts, seq) rows; subclasses break it in one way. (The port's
    ``prefetch`` is its documented default: no hint taken.)"""

    url = "fake://keyset"

    def __init__(self, ts, seq=None) -> None:
        self.ts = np.asarray(ts, dtype=np.int64)
        self.seq = np.arange(len(self.ts), dtype=np.int64) if seq is None else np.asarray(seq)
        self.calls = 0

    def rows_after(self, cursor, lo, hi):
        keep = (self.ts >= lo) & (self.ts <= hi)
        if cursor is not None:
            keep &= (self.ts > cursor.ts) | ((self.ts == cursor.ts) & (self.seq > cursor.seq))
        idx = np.flatnonzero(keep)
        return idx[np.lexsort((self.seq[idx], self.ts[idx]))]

    def query_page(self, node_id, run_id, from_ms, to_ms, cursor=None, limit=10):
        self.calls += 1
        if self.calls > 1000:
            raise AssertionError("fetch_node_series loops")
        idx = self.rows_after(cursor, from_ms, to_ms)
        done = len(idx) <= limit
        idx = idx[:limit]
        return page(self.ts[idx], self.seq[idx], done=done)

    # the rest of the port is not used by fetch_node_series
    def list_runs(self, scope=None, finished_only=True):
        return []

    def get_run(self, run_id):
        raise KeyError(run_id)

    def list_nodes(self):
        return []

    def availability_watermark(self):
        return None

    def run_versions(self, run_ids):
        return {}

    def ingest(self, *, runs=(), nodes=(), points=None, replace_runs=False):
        return 0

    def close(self):
        pass


def test_fake_is_a_port_and_a_correct_backend_reads_everything():
    db = Keyset([1, 1, 1, 2, 2, 3, 3, 3, 3])
    assert isinstance(db, TsdbPort)
    s = fetch_node_series(db, "N", "R", 0, 10, page_limit=2)
    assert s.ts.tolist() == [1, 1, 1, 2, 2, 3, 3, 3, 3]
    assert s.seq.tolist() == list(range(9))
    assert s.pages == 5
    assert s.node_id == "N" and s.run_id == "R" and len(s) == 9


def test_cursor_that_does_not_advance_is_an_error_not_a_loop():
    class Stuck(Keyset):
        def query_page(self, node_id, run_id, from_ms, to_ms, cursor=None, limit=10):
            self.calls += 1
            return page([5, 6], [0, 1], done=False, cursor=Cursor(6, 1) if cursor is None else cursor)

    db = Stuck([])
    with pytest.raises(PaginationError):
        fetch_node_series(db, "N", "R", 0, 10, page_limit=2)
    assert db.calls <= 3


def test_backend_that_ignores_the_cursor_is_caught():
    """A backend without paging that returns the first rows again (the predecessor's bug)."""

    class NoPaging(Keyset):
        def query_page(self, node_id, run_id, from_ms, to_ms, cursor=None, limit=10):
            return super().query_page(node_id, run_id, from_ms, to_ms, None, limit)

    with pytest.raises(PaginationError, match="not after cursor|did not advance"):
        fetch_node_series(NoPaging(range(10)), "N", "R", 0, 100, page_limit=3)


def test_bare_timestamp_cursor_losing_ties_is_caught():
    """A backend that resumes at ts >= cursor.ts (a bare-timestamp cursor) repeats the points
    sharing the boundary timestamp: the page does not start after the cursor. (One that resumes
    at ts > cursor.ts loses them undetectably; the conformance tests catch that per adapter.)"""

    class Repeats(Keyset):
        def rows_after(self, cursor, lo, hi):
            if cursor is None:
                return super().rows_after(None, lo, hi)
            return super().rows_after(Cursor(cursor.ts, -1), lo, hi)  # ts >= cursor.ts

    with pytest.raises(PaginationError):
        fetch_node_series(Repeats([1, 1, 1, 2]), "N", "R", 0, 10, page_limit=2)


def test_page_larger_than_the_limit_is_truncation():
    class Oversized(Keyset):
        def query_page(self, node_id, run_id, from_ms, to_ms, cursor=None, limit=10):
            return super().query_page(node_id, run_id, from_ms, to_ms, cursor, limit + 1)

    with pytest.raises(TruncationError, match="more than the limit 4"):
        fetch_node_series(Oversized(range(20)), "N", "R", 0, 100, page_limit=4)


def test_max_points_exceeded_is_truncation_never_a_silent_cut():
    db = Keyset(range(100))
    with pytest.raises(TruncationError, match="more than 50 points"):
        fetch_node_series(db, "N", "R", 0, 1000, page_limit=30, max_points=50)
    assert len(fetch_node_series(Keyset(range(50)), "N", "R", 0, 1000, page_limit=30, max_points=50)) == 50


def test_not_done_without_cursor_is_an_error():
    class NoCursor(Keyset):
        def query_page(self, node_id, run_id, from_ms, to_ms, cursor=None, limit=10):
            return page([1, 2], done=False, cursor=None)

    with pytest.raises(PaginationError, match="no cursor"):
        fetch_node_series(NoCursor([]), "N", "R", 0, 10, page_limit=5)


def test_empty_page_that_is_not_done_is_an_error():
    class EmptyNotDone(Keyset):
        def query_page(self, node_id, run_id, from_ms, to_ms, cursor=None, limit=10):
            self.calls += 1
            c = Cursor(self.calls, 0)
            return Page(np.empty(0, np.int64), np.empty(0), np.empty(0, np.int32), np.empty(0, np.int64), c, False)

    with pytest.raises(PaginationError, match="empty page"):
        fetch_node_series(EmptyNotDone([]), "N", "R", 0, 10)


def test_unordered_page_is_an_error():
    class Unordered(Keyset):
        def query_page(self, node_id, run_id, from_ms, to_ms, cursor=None, limit=10):
            return page([3, 1, 2], [0, 1, 2], done=True)

    with pytest.raises(PaginationError, match="not ordered"):
        fetch_node_series(Unordered([]), "N", "R", 0, 10)


def test_page_limit_must_be_positive():
    with pytest.raises(ValueError):
        fetch_node_series(Keyset([1]), "N", "R", 0, 10, page_limit=0)
