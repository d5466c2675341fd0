"""Whether epoch-millisecond times can be a plant's: after 1990, at most a year from now, sampled
more often than monthly. A wrong time unit (seconds read as milliseconds, nanoseconds as
microseconds) fails these checks, and the reason names the unit the values look like.

Shared by the mapped sources (a description's ``time_type``) and the file ingest (``ts``,
``started_at``, ``ended_at`` in epoch ms), so both say the same thing about the same times.
"""

from __future__ import annotations

import datetime as dt

import numpy as np

# Plant data is not older than this (epoch ms of 1990-01-01), nor newer than a year from now.
PLAUSIBLE_FROM_MS = 631_152_000_000
_YEAR_MS = 365 * 86_400_000
# A median sample period longer than this is not a sensor's for the declared unit.
PLAUSIBLE_PERIOD_MS = 30 * 86_400_000
# Milliseconds per raw unit of each epoch time type, and its name.
_MS_PER_UNIT = {"epoch_s": 1000.0, "epoch_s_float": 1000.0, "epoch_ms": 1.0, "epoch_us": 1e-3, "epoch_ns": 1e-6}
_UNIT_WORD = {"epoch_s": "seconds", "epoch_s_float": "seconds", "epoch_ms": "milliseconds", "epoch_us": "microseconds",
              "epoch_ns": "nanoseconds"}


def plausible_until_ms(now_ms: int | None = None) -> int:
    """The latest plausible time: a year from now."""
    if now_ms is None:
        now_ms = int(dt.datetime.now(dt.timezone.utc).timestamp() * 1000)
    return now_ms + _YEAR_MS


def ms_text(ms: float) -> str:
    """An epoch-ms time as ISO 8601 text, whatever its year (no Python datetime)."""
    ms = min(max(float(ms), -9.2e18), 9.2e18)
    return str(np.datetime64(int(ms), "ms")) + "Z"


def times_out_of_range(ms: np.ndarray, kind: str | None, *, now_ms: int | None = None) -> str | None:
    """Why the times ``ms`` (epoch ms, as read with time type ``kind``) cannot be a plant's by their
    range alone (before 1990, or more than a year from now), naming the epoch unit that would put
    them in range; None when they are in range. The first check of :func:`implausible_times`."""
    ms = np.asarray(ms)
    if ms.shape[0] == 0:
        return None
    lo, hi = float(ms.min()), float(ms.max())
    until = plausible_until_ms(now_ms)
    if PLAUSIBLE_FROM_MS <= lo and hi <= until:
        return None
    assumed = f"read as {kind} ({_UNIT_WORD[kind]})" if kind in _MS_PER_UNIT else "read"
    bad = lo if lo < PLAUSIBLE_FROM_MS else hi
    why = (f"{assumed} gives {ms_text(bad)}, not between {ms_text(PLAUSIBLE_FROM_MS)[:10]} and "
           f"{ms_text(until)[:10]} (a year from now)")
    return why + _better_unit(kind, np.array([lo, hi], dtype=np.float64), until)


def implausible_times(ms: np.ndarray, kind: str | None, *, now_ms: int | None = None) -> str | None:
    """Why the times ``ms`` (epoch ms, as read with time type ``kind``; None: the source's own
    time) cannot be a plant's, or None: a time before 1990 or more than a year from now, or a
    median sample period longer than :data:`PLAUSIBLE_PERIOD_MS`. For an epoch time type the
    reason names the unit the values look like, if one puts them in range."""
    ms = np.asarray(ms)
    if ms.shape[0] == 0:
        return None
    out_of_range = times_out_of_range(ms, kind, now_ms=now_ms)
    if out_of_range is not None:
        return out_of_range
    until = plausible_until_ms(now_ms)
    assumed = f"read as {kind} ({_UNIT_WORD[kind]})" if kind in _MS_PER_UNIT else "read"
    if ms.shape[0] >= 3:
        d = np.diff(ms.astype(np.float64))
        d = d[d > 0]
        if d.shape[0] and float(np.median(d)) > PLAUSIBLE_PERIOD_MS:
            period = float(np.median(d))
            why = f"{assumed} gives a median sample period of {period / 86_400_000:,.0f} days"
            return why + _better_unit(kind, np.array([ms.min(), ms.max()], dtype=np.float64), until, period)
    return None


def _fitting_unit(kind: str | None, ms: np.ndarray, until: int, period: float | None = None) -> tuple[str, float] | None:
    """The epoch unit other than ``kind``'s that puts ``ms`` (read as ``kind``) in range, with the
    last of them in that unit's milliseconds; None if none does."""
    if kind not in _MS_PER_UNIT:
        return None
    for other in ("epoch_s", "epoch_ms", "epoch_us", "epoch_ns"):
        if _MS_PER_UNIT[other] == _MS_PER_UNIT[kind]:
            continue
        scale = _MS_PER_UNIT[other] / _MS_PER_UNIT[kind]
        as_other = ms * scale
        fits = bool(np.all(as_other >= PLAUSIBLE_FROM_MS) and np.all(as_other <= until))
        if fits and (period is None or period * scale <= PLAUSIBLE_PERIOD_MS):
            if kind == "epoch_s_float" and other == "epoch_s":
                continue
            return other, float(as_other[-1])
    return None


def _better_unit(kind: str | None, ms: np.ndarray, until: int, period: float | None = None) -> str:
    """``; the values look like epoch_X (...)``: the epoch unit that puts them in range."""
    if kind not in _MS_PER_UNIT:
        return "; check the time column and its type"
    fit = _fitting_unit(kind, ms, until, period)
    if fit is None:
        return "; no epoch unit puts them between 1990 and a year from now: check the time column"
    other, last = fit
    return f"; the values look like {other} ({_UNIT_WORD[other]}: {ms_text(last)}): set time_type: {other}"


FILE_TIMES = "epoch milliseconds or ISO-8601 (docs/ingest.md)"


def epoch_ms_column_problem(ms: np.ndarray, *, now_ms: int | None = None,
                            written_as: str = FILE_TIMES) -> tuple[int, str] | None:
    """For a column of epoch milliseconds from a file (an ingest's ``ts``, ``started_at``,
    ``ended_at``) or a caller: the index of its first time outside the plausible range and why,
    naming the epoch unit the column looks like when one puts it in range; None when every time
    is in range. Its unit is fixed, so the advice is to write the times as ``written_as``."""
    ms = np.asarray(ms, dtype=np.int64)
    if ms.shape[0] == 0:
        return None
    until = plausible_until_ms(now_ms)
    bad = (ms < PLAUSIBLE_FROM_MS) | (ms > until)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    why = (f"{ms_text(ms[i])} ({int(ms[i])} ms) is not between {ms_text(PLAUSIBLE_FROM_MS)[:10]} and "
           f"{ms_text(until)[:10]} (a year from now)")
    fit = _fitting_unit("epoch_ms", np.array([ms.min(), ms.max()], dtype=np.float64), until)
    if fit is not None:
        other, last = fit
        why += f"; the column looks like epoch {_UNIT_WORD[other]} (its last time would be {ms_text(last)})"
    return i, f"{why}; write {written_as}"
