"""Named crash points, so a test can kill a process exactly where a fault matters and prove it.

``crash_point("publish.renamed")`` is one line at a step of publication, gc or ingest. Unset, it
costs one environment lookup. Two variables arm it:

``AML_CRASH_AT=<point>``
    The process appends ``<point> <pid>`` to the file ``AML_CRASH_MARKER`` names (if set) and stops
    itself with SIGSTOP at that point: a test sees it stopped (every thread in state ``T``) with
    the marker naming the point, then SIGKILLs it. The kill therefore lands at that step and
    nowhere else, and the test can say so. ``<point>:<n>`` stops at the ``n``-th time the point
    is reached (1-based), for a point inside a loop.

``AML_FAULT_TRACE=<file>``
    Every point reached is appended to ``<file>`` (``<point> <pid>``, one line each, unbuffered):
    after a kill at a random moment, the last line says which phase the process was in.

The points (:data:`POINTS`) name what has just become true: ``publish.staging_written`` means every
file of the snapshot is written into its staging directory, not yet known to be durable.
"""

from __future__ import annotations

import os
import signal
import threading

CRASH_AT_ENV = "AML_CRASH_AT"
MARKER_ENV = "AML_CRASH_MARKER"
TRACE_ENV = "AML_FAULT_TRACE"

POINTS = (
    # Publishing a snapshot (pipeline/snapshot_writer.py, pipeline/stages/manifest.py, pipeline/publish.py).
    "publish.array_written",  # one array file of the snapshot complete in staging (per file)
    "publish.staging_written",  # every file written into the staging directory
    "publish.fsynced",  # files, digest and directories durable; not yet renamed
    "publish.renamed",  # the snapshot directory renamed into place; `current` not yet swapped
    "publish.current_swapped",  # `current` points at it; the catalog does not record it yet
    "publish.catalog_recorded",  # the catalog records it; the build has not returned yet
    # An export (snapshot/export.py, pipeline/layout_export.py).
    "export.staged",  # every file of the export written beside --out under a hidden name; not yet renamed
    # gc of a snapshot (pipeline/retention.py).
    "gc.catalog_row_removed",  # its catalog row deleted (committed); the directory still there
    "gc.moved_to_trash",  # the directory renamed to a hidden .trash-* name
    "gc.deleted",  # the trash removed
    # Reading the TSDB (tsdb/port.py).
    "fetch.page",  # a page of a node's points read and checked (per page)
    # An ingest transaction (tsdb/ingest.py, tsdb/writer.py, tsdb/duckdb.py, tsdb/postgres.py).
    "ingest.files_read",  # the input files read and validated, the TSDB open for writing
    "ingest.mid_transaction",  # the points inserted, run versions not yet updated, not committed
    "ingest.commit",  # everything written in the transaction; COMMIT not yet sent
)

_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Reached the step ``name`` (one of :data:`POINTS`): trace it, and stop here if armed."""
    trace = os.environ.get(TRACE_ENV)
    armed = os.environ.get(CRASH_AT_ENV)
    if trace is None and armed is None:
        return
    if trace:
        _append(trace, name)
    if not armed:
        return
    point, _, nth = armed.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != (int(nth) if nth else 1):
        return
    marker = os.environ.get(MARKER_ENV)
    if marker:
        _append(marker, name)
    # Sent to this thread: it handles the stop itself before it runs another instruction here
    # (sent to the process, another thread may take it while this one goes on for a moment).
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _append(path: str, name: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{name} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
