"""A TSDB session for long work done in chunks: it holds a handle only while a chunk needs it.

A read-only handle on the embedded DuckDB file keeps the file's shared lock until it is
closed, and an ingest cannot start before every reader has let go. A build that kept one handle
for a whole backfill step would lock ingests out for as long as the step runs. A session opens
its handle lazily and the caller releases it between chunks (a page, a node, a time slice of a
run), so a waiting ingest gets the file between two chunks (the readers' next open waits for it,
see :mod:`aml_pipeline.tsdb.writer_intent`) and the next chunk sees the new data.

Opening is cheap for the embedded file (an ATTACH to this process's DuckDB instance;
``bench/tsdb_bench.py`` measures it). For PostgreSQL, MVCC readers never block an ingest: a
session keeps its one connection for its whole life and ``release`` keeps it too.

    with TsdbSession(url) as session:
        db = session.acquire()              # opened on first use
        runs = db.list_runs(scope)
        session.release()                   # let a waiting ingest in
        for run in runs:
            db = session.acquire()          # held for this chunk only
            ...
            session.release()

:class:`BriefHandle` does this for a build: it holds the handle at most about half a second at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from aml_pipeline.errors import TsdbError
from aml_pipeline.tsdb.port import DEFAULT_LOCK_TIMEOUT_S, PortCalls, TsdbPort

# Opens a handle: ``opener(url, read_only=..., lock_timeout_s=...)``.
Opener = Callable[..., TsdbPort]


class TsdbSession:
    """Opens a TSDB handle on first use and lets the caller release it between chunks.

    ``opener`` opens each handle, with ``read_only`` and ``lock_timeout_s``: by default
    :func:`~aml_pipeline.tsdb.open_adapter` (the embedded file, PostgreSQL);
    :func:`aml_pipeline.tsdb_open.open_tsdb` opens a source description too. Not for concurrent
    use by several threads: give each thread its own session.
    """

    def __init__(
        self,
        url: str,
        *,
        read_only: bool = True,
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
        opener: Opener | None = None,
    ) -> None:
        self.url = url
        self.read_only = read_only
        self.lock_timeout_s = lock_timeout_s
        self._opener = opener
        # Only the embedded file locks out writers while a handle is open.
        self.releases_between_chunks = url.startswith("duckdb://")
        self.opens = 0  # handles opened so far (for tests and benchmarks)
        self._handle: TsdbPort | None = None
        self._closed = False
        self._lock = threading.Lock()

    def acquire(self) -> TsdbPort:
        """The session's handle, opened now if it is not open."""
        with self._lock:
            if self._closed:
                from aml_pipeline.urls import redact_url

                raise TsdbError(f"{redact_url(self.url)}: this TSDB session is closed")
            if self._handle is None:
                opener = self._opener
                if opener is None:
                    from aml_pipeline.tsdb import open_adapter as opener
                self._handle = opener(self.url, read_only=self.read_only, lock_timeout_s=self.lock_timeout_s)
                self.opens += 1
            return self._handle

    def release(self) -> None:
        """End of a chunk: close the handle if it holds a file lock (else keep it for the next)."""
        if self.releases_between_chunks:
            self._close_handle()

    @property
    def holding(self) -> bool:
        """Whether a handle is open right now."""
        return self._handle is not None

    def close(self) -> None:
        self._close_handle()
        self._closed = True

    def _close_handle(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()

    def __enter__(self) -> TsdbSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        from aml_pipeline.urls import redact_url

        return f"TsdbSession({redact_url(self.url)!r}, opens={self.opens}, holding={self.holding})"


class BriefHandle(PortCalls):
    """The TSDB port over a session, holding a handle at most about ``hold_s`` at a time.

    Every call goes to the session's handle, opened on demand; once the handle has been held for
    ``hold_s``, it is released after the call (between two pages, never inside one), so a waiting
    ingest gets the embedded file within about ``hold_s`` plus one page, however long the build,
    while short runs do not pay an open per page or per run.
    """

    def __init__(self, session: TsdbSession, hold_s: float = 0.5) -> None:
        self.session, self.hold_s = session, float(hold_s)
        self.url = session.url
        self._since: float | None = None
        self._last_prefetch: float | None = None

    def _call(self, name: str, *args, **kwargs):
        handle = self.session.acquire()
        if self._since is None or not self.session.holding:
            self._since = time.monotonic()
        try:
            return getattr(handle, name)(*args, **kwargs)
        finally:
            if time.monotonic() - self._since >= self.hold_s:
                self.session.release()
                self._since = None

    def prefetch(self, *args, ahead: Sequence[tuple[str, int, int]] = (), **kwargs) -> bool:
        """The handle's :meth:`~aml_pipeline.tsdb.port.TsdbPort.prefetch`. Served pages stay with
        the handle: a hold that ends before they are read drops them, and the rest of the slice
        is read page by page from the reopened handle. So does what is read ahead: ``ahead`` is
        cut to the slices the prefetches so far, at their pace, would ask for before the hold ends."""
        now = time.monotonic()
        # A hold that is already over ends here, before the slice is read: were each prefetch to
        # restart the hold, a build of short runs would keep the file from a waiting ingest until
        # its last run.
        if self._since is not None and now - self._since >= self.hold_s:
            self.release()
        handle = self.session.acquire()
        if self._since is None or not self.session.holding:
            self._since = now
        if ahead and self._last_prefetch is not None and now > self._last_prefetch:
            left = self.hold_s - (now - self._since)
            ahead = ahead[: max(0, int(left / (now - self._last_prefetch)))]
        self._last_prefetch = now
        return handle.prefetch(*args, ahead=ahead, **kwargs)

    def release(self) -> None:
        """Let go of the handle now (e.g. at the end of a step)."""
        self.session.release()
        self._since = None
