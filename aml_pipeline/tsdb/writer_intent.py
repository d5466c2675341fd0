"""A writer's place in the queue for an embedded TSDB file, so that an ingest gets the file between
two chunks of a build instead of losing the race to the build's next open.

DuckDB locks the database file itself (many read-only processes or one writer) but keeps no
queue: a writer that retries its open while readers open and close the file chunk after chunk
may never find it free. The intent file ``<file>.lock`` next to the database adds the queue with
``flock(2)``:

* a writer holds it exclusively from before it waits for the database file until it closes;
* a reader takes it shared for a moment before each open (the gate), so while a writer waits or
  writes, new reader opens wait (bounded by their lock timeout) and the readers that hold the
  file finish their chunk and let it go.

flock locks belong to the open file and vanish with the process: a killed writer or reader
leaves nothing to clean up. Within one process, writer handles on the same file share one
exclusive lock (reference-counted), because flock locks taken through different descriptors
conflict even inside one process.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

from aml_pipeline.errors import TsdbBusyError, TsdbReaderBusyError

_POLL_S = 0.02

_guard = threading.Lock()
_held: dict[str, list[int]] = {}  # lock path -> [fd, number of writer handles in this process]
_acquiring: dict[str, threading.Lock] = {}


def _forget_in_child() -> None:
    """After fork(): the child shares the parent's locked descriptors (flock follows the open
    file, not the process), so it closes its copies at once; the parent's writer keeps its turn
    and releases it alone. The child starts with no writer handles."""
    global _guard
    _guard = threading.Lock()
    for fd, _ in _held.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()
    _acquiring.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def intent_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + ".lock")


def writer_handles_here(db_path: Path) -> int:
    """How many writer handles of this process hold the intent for ``db_path``."""
    with _guard:
        entry = _held.get(str(intent_path(db_path)))
        return entry[1] if entry is not None else 0


def hold_writer_intent(db_path: Path, deadline: float, timeout_s: float) -> None:
    """Join (or take) this process's exclusive intent on ``db_path``; TsdbBusyError at the deadline."""
    key = str(intent_path(db_path))
    with _guard:
        acquiring = _acquiring.setdefault(key, threading.Lock())
    # One thread of this process waits for the file lock; the others then share what it got.
    if not acquiring.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise _writer_busy(db_path, timeout_s)
    try:
        with _guard:
            if key in _held:
                _held[key][1] += 1
                return
        fd = _lock(Path(key), fcntl.LOCK_EX, deadline, create=True)
        if fd is None:
            raise _writer_busy(db_path, timeout_s)
        with _guard:
            _held[key] = [fd, 1]
    finally:
        acquiring.release()


def _writer_busy(db_path: Path, timeout_s: float) -> TsdbBusyError:
    return TsdbBusyError(
        f"{db_path} is in use by another process (another ingest is writing or waiting to write "
        f"it); try again when it finishes (waited {timeout_s:g} s for its turn to write)"
    )


def drop_writer_intent(db_path: Path, *, remove: bool = False) -> None:
    """Leave the queue; the last writer handle of this process releases the lock. ``remove``
    also deletes the intent file (for a database file that was just removed), while still
    holding the lock, so a process waiting on the old file notices and starts over."""
    key = str(intent_path(db_path))
    with _guard:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[key]
        if remove:
            try:
                os.unlink(key)
            except FileNotFoundError:
                pass
        os.close(entry[0])


def pass_reader_gate(db_path: Path, deadline: float, timeout_s: float) -> None:
    """Wait (until ``deadline``) while a writer holds the intent, then go on at once."""
    path = intent_path(db_path)
    fd = _lock(path, fcntl.LOCK_SH, deadline, create=False)
    if fd is None:
        raise TsdbReaderBusyError(
            f"{db_path} is in use by another process (an ingest is writing it); try again when "
            f"it finishes (waited {timeout_s:g} s to open it read-only)"
        )
    if fd >= 0:
        os.close(fd)  # closing the descriptor releases the shared lock


def _lock(path: Path, mode: int, deadline: float, *, create: bool) -> int | None:
    """A descriptor of ``path`` locked with ``mode``, -1 if there is no intent file to honour
    (a reader on a file that nobody may write), None at the deadline."""
    while True:
        try:
            fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o666)
        except FileNotFoundError:
            if create:
                raise
            return -1
        except PermissionError:
            if create:
                raise
            return -1
        try:
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    os.close(fd)
                    return None
                time.sleep(min(_POLL_S, remaining))
            # The holder may have removed the file (a failed first ingest): lock the new one.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)
            if not create:
                return -1
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
