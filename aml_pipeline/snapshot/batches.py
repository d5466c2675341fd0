"""Batches of windows in bounded memory, shuffled reproducibly.

Reading is by contiguous blocks of windows (one ``pread`` per array and block, straight from
the verified file into a preallocated buffer), never window by window. Shuffling is two-level,
the way streaming loaders (tf.data, WebDataset) shuffle data too large to permute in memory:

1. the split's windows are cut into blocks of ``block_windows`` consecutive windows and the
   block order is permuted;
2. blocks are read, in that order, into a buffer of at most ``buffer_bytes`` (default 64 MiB),
   the windows in the buffer are permuted and served in batches; the fewer than
   ``batch_size`` windows left over stay in the buffer and are mixed with the next blocks.

So a batch draws from about ``buffer_windows / block_windows`` (by default ~256) places spread
over the split, every window of the split is served exactly once per epoch, and the sequence is
a function of ``(seed, epoch)`` (and of ``buffer_bytes`` and ``block_windows`` when given), the
same whichever ``fields`` are read. Memory: the buffer plus the batch being built (each yielded
array is a new array the caller owns, never a view into the buffer or the maps).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .reader import Snapshot

DEFAULT_BUFFER_BYTES = 64 << 20
# A block is the unit of contiguous reading and of shuffling: large enough for reads at disk
# speed, small enough that a buffer holds a few hundred of them.
DEFAULT_BLOCK_BYTES = 256 << 10


def whole_number(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int if it is an integer (a Python or numpy integer, a 0-d integer tensor)
    of at least ``minimum``: a float, a bool or text is refused naming ``name``, never rounded."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {number}")
    return number


def _check_positive(name: str, value: object) -> int:
    try:
        return whole_number(name, value, 1)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None


def field_names(fields: str | Sequence[str]) -> tuple[str, ...]:
    """The array names a reader is asked for: one name (``"x"``) or a sequence of them."""
    names = (fields,) if isinstance(fields, str) else tuple(fields)
    if not names:
        raise ValueError("fields must name at least one array")
    return names


def window_bytes(snapshot: Snapshot, fields: Sequence[str]) -> int:
    """Bytes of one window over ``fields``."""
    return sum(snapshot.array(f).dtype.itemsize * math.prod(snapshot.array(f).shape[1:]) for f in fields)


def iter_batches(
    snapshot: Snapshot,
    split: str = "train",
    batch_size: int = 256,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    *,
    epoch: int = 0,
    fields: Sequence[str] = ("x", "u", "y"),
    buffer_bytes: int | None = None,
    block_windows: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Yield ``{field: array [b, ...], "index": int64 [b]}`` for the windows of ``split``.

    ``index`` holds the windows' positions in the snapshot (e.g. ``snapshot.timestamps[index]``).
    Without ``shuffle`` windows come in snapshot order (runs in split order, time ascending).
    ``drop_last`` drops a final batch smaller than ``batch_size``. ``epoch`` varies the shuffle
    between epochs while keeping each reproducible. ``buffer_bytes`` bounds the shuffle buffer
    (at least ``batch_size`` + one block of windows is always held).
    """
    batch_size = _check_positive("batch_size", batch_size)
    seed, epoch = whole_number("seed", seed), whole_number("epoch", epoch)
    fields = field_names(fields)
    for f in fields:
        snapshot.array(f)  # KeyError naming what exists
    windows = snapshot.split_range(split)
    if shuffle:
        return _shuffled(snapshot, windows, batch_size, seed, epoch, drop_last, fields, buffer_bytes, block_windows)
    return _in_order(snapshot, windows, batch_size, drop_last, fields)


def _in_order(snapshot: Snapshot, windows: range, batch_size: int, drop_last: bool,
              fields: tuple[str, ...]) -> Iterator[dict[str, np.ndarray]]:
    for start in range(windows.start, windows.stop, batch_size):
        stop = min(start + batch_size, windows.stop)
        if drop_last and stop - start < batch_size:
            return
        batch = {f: snapshot.read_windows(f, start, stop) for f in fields}
        batch["index"] = np.arange(start, stop, dtype=np.int64)
        yield batch


def _shuffled(snapshot: Snapshot, windows: range, batch_size: int, seed: int, epoch: int, drop_last: bool,
              fields: tuple[str, ...], buffer_bytes: int | None,
              block_windows: int | None) -> Iterator[dict[str, np.ndarray]]:
    n = len(windows)
    if n == 0:
        return
    # Blocks and buffer are sized by a window of every array the snapshot has, whichever fields
    # are read: the order is then the same for any fields (x and y read in two passes with one
    # seed stay paired), and the buffer stays within its bytes for any of them.
    per_window = max(1, window_bytes(snapshot, snapshot.array_names))
    if block_windows is None:
        block_windows = max(1, DEFAULT_BLOCK_BYTES // per_window)
    block_windows = min(_check_positive("block_windows", block_windows), n)
    budget = DEFAULT_BUFFER_BYTES if buffer_bytes is None else _check_positive("buffer_bytes", buffer_bytes)
    # Leftovers (< batch_size) plus one more block must always fit, or the buffer could stall.
    capacity = min(n, max(budget // per_window, batch_size + block_windows))

    rng = np.random.default_rng([seed, epoch])
    starts = np.arange(windows.start, windows.stop, block_windows, dtype=np.int64)[rng.permutation(-(-n // block_windows))]
    buf = {f: np.empty((capacity, *snapshot.array(f).shape[1:]), dtype=snapshot.array(f).dtype) for f in fields}
    index = np.empty(capacity, dtype=np.int64)
    filled, next_block = 0, 0
    while filled or next_block < len(starts):
        while next_block < len(starts):
            start = int(starts[next_block])
            stop = min(start + block_windows, windows.stop)
            if filled + (stop - start) > capacity:
                break
            for f in fields:
                snapshot.read_windows(f, start, stop, out=buf[f][filled : filled + stop - start])
            index[filled : filled + stop - start] = np.arange(start, stop)
            filled += stop - start
            next_block += 1
        order = rng.permutation(filled)
        last_fill = next_block == len(starts)
        served = filled if last_fill else filled - filled % batch_size
        for i in range(0, served, batch_size):
            take = order[i : min(i + batch_size, served)]
            if drop_last and take.shape[0] < batch_size:
                break
            batch = {f: buf[f][take] for f in fields}  # fancy indexing: a copy
            batch["index"] = index[take]
            yield batch
        rest = order[served:]
        for f in fields:
            buf[f][: rest.shape[0]] = buf[f][rest]
        index[: rest.shape[0]] = index[rest]
        filled = rest.shape[0]
