"""Ctrl-C during a Dagster run in this process, never lost.

Dagster's in-process execution captures SIGINT outside the moments it can interrupt a step (while
it writes events, between steps, as the run ends), and forgets a captured one when the run
ends: the build then went on, published and exited 0 as if no Ctrl-C had been pressed.
:func:`interrupts_not_lost` notices a SIGINT whatever Python handler took it (the interpreter's
wake-up file descriptor gets the signal's number from the C-level handler, before any Python
handler runs) and raises :class:`KeyboardInterrupt` when the block ends, so the build stops
before its next run, and the command line says it was interrupted.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_not_lost() -> Iterator[None]:
    """Run the block; if a SIGINT arrived during it and the block still returned, raise
    :class:`KeyboardInterrupt` after it. Only in the main thread (where signals are handled); a
    no-op elsewhere, and when another wake-up descriptor is already set (that owner's, kept)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous not in (None, -1):  # someone else's: put it back, and notice nothing
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        yield
        return
    signals = b""
    try:
        yield
    finally:
        signal.set_wakeup_fd(-1)
        try:
            while chunk := os.read(read_end, 512):
                signals += chunk
        except BlockingIOError:
            pass
        os.close(read_end)
        os.close(write_end)
    if signal.SIGINT in signals:
        raise KeyboardInterrupt
