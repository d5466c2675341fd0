"""Progress of long work, for whoever listens in this process (the CLI's progress bars).

Assets report per-run progress here as well as to the Dagster run log; with no listener (the
webserver, the daemon) reporting costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

Listener = Callable[[str, int, int, str], None]  # (stage, done, total, item)

_listeners: list[Listener] = []


def report(stage: str, done: int, total: int, item: str = "") -> None:
    for listener in list(_listeners):
        listener(stage, done, total, item)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


@contextmanager
def progress_bars(stream=None) -> Iterator[None]:
    """One tqdm bar per stage on stderr, closed when the stage completes."""
    import sys

    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def on_progress(stage: str, done: int, total: int, item: str) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(
                total=total, desc=stage, unit="run", file=stream or sys.stderr, leave=True,
                disable=None,  # no bars when stderr is not a terminal (scripts, CI, logs)
            )
        bar.total = total
        bar.update(done - bar.n)
        if item:
            bar.set_postfix_str(item, refresh=False)
        if done >= total:
            bar.close()

    try:
        with listening(on_progress):
            yield
    finally:
        for bar in bars.values():
            bar.close()
