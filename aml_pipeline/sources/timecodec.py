"""Times as a source stores them, to and from the port's epoch milliseconds.

A backend reads a time column in its *raw* form, one numpy column:

* ``timestamptz`` and ``timestamp``: int64 microseconds since 1970-01-01 (for ``timestamp``
  without zone: the wall-clock reading as if it were UTC; :class:`TimeCodec` then applies the
  declared zone);
* ``epoch_s`` / ``epoch_ms`` / ``epoch_us`` / ``epoch_ns``: int64 in that unit;
* ``epoch_s_float``: float64 seconds.

Conversion to milliseconds floors (a reading at 12.7 ms is at 12 ms), except float seconds, which
are rounded to the nearest millisecond (``1.001`` s is not quite 1001 ms in binary floating point).
Both are monotone, so ordering by the raw column orders by the millisecond too, and the points of
one millisecond are contiguous: the adapter's cursor relies on it.

:meth:`TimeCodec.bounds` turns ``[lo_ms, hi_ms]`` into the raw interval ``[lo, hi]`` (both
inclusive) holding exactly the raw values that convert into it, so the range a backend filters
on is the range the port asked for.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import numpy as np

TIME_TYPES = ("timestamptz", "timestamp", "epoch_s", "epoch_ms", "epoch_us", "epoch_ns", "epoch_s_float")
_EPOCH_UNITS = {"epoch_s": 1_000_000, "epoch_ms": 1_000, "epoch_us": 1, "epoch_ns": None}  # us per unit
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
# Python datetimes (what a driver binds) span years 1 to 9999.
_US_MIN = int((dt.datetime(1, 1, 2, tzinfo=dt.timezone.utc) - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)) / dt.timedelta(microseconds=1))
_US_MAX = int((dt.datetime(9999, 12, 30, tzinfo=dt.timezone.utc) - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)) / dt.timedelta(microseconds=1))
_EPOCH = dt.datetime(1970, 1, 1)


def _clamp(v: int, lo: int = _I64_MIN, hi: int = _I64_MAX) -> int:
    return lo if v < lo else hi if v > hi else int(v)


class TimesBeyondInt64(ValueError):
    """Times that in milliseconds do not fit 64 bits (seconds that are not seconds): ``ms`` is
    one of them, as a float, for the message that names the unit they look like."""

    def __init__(self, ms: float) -> None:
        super().__init__(f"a time of {ms:.4g} ms does not fit 64 bits")
        self.ms = ms


@dataclass(frozen=True)
class TimeCodec:
    """How one time column stores time: ``kind`` (one of :data:`TIME_TYPES`) and, for
    ``timestamp`` without zone, the IANA ``zone`` its wall-clock readings are in."""

    kind: str
    zone: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in TIME_TYPES:
            raise ValueError(f"time type {self.kind!r} is not one of {', '.join(TIME_TYPES)}")
        if self.kind == "timestamp" and not self.zone:
            raise ValueError("a timestamp without time zone needs the zone its readings are in")

    @property
    def is_timestamp(self) -> bool:
        return self.kind in ("timestamptz", "timestamp")

    @property
    def is_float(self) -> bool:
        return self.kind == "epoch_s_float"

    @property
    def _local(self) -> bool:
        return self.kind == "timestamp" and self.zone not in ("UTC", "Etc/UTC")

    def describe(self) -> str:
        """The type in words, for ``source check``."""
        if self.kind == "timestamptz":
            return "timestamp with time zone"
        if self.kind == "timestamp":
            return f"timestamp without time zone, read as {self.zone} wall-clock time"
        if self.kind == "epoch_s_float":
            return "epoch seconds (floating point, rounded to the millisecond)"
        return f"epoch {self.kind.split('_')[1]} (integer)"

    # ---- raw -> ms -------------------------------------------------------------------------
    def to_ms(self, raw: np.ndarray) -> np.ndarray:
        """Raw column -> int64 epoch milliseconds (vectorised)."""
        if self.is_float:
            ms = np.rint(np.asarray(raw, dtype=np.float64) * 1000.0)
            if ms.shape[0] and not bool(np.all(np.abs(ms) < 9.2e18)):
                raise TimesBeyondInt64(float(ms[np.argmax(np.abs(np.nan_to_num(ms, nan=np.inf)))]))
            return ms.astype(np.int64)
        raw = np.asarray(raw, dtype=np.int64)
        if self.kind == "epoch_ms":
            return raw
        if self.kind == "epoch_s":
            if raw.shape[0] and (raw.max() > _I64_MAX // 1000 or raw.min() < _I64_MIN // 1000):
                raise TimesBeyondInt64(float(raw.max() if raw.max() > _I64_MAX // 1000 else raw.min()) * 1000.0)
            return raw * 1000
        if self.kind == "epoch_ns":
            return np.floor_divide(raw, 1_000_000)
        if self._local:
            raw = self._local_to_utc_us(raw)
        return np.floor_divide(raw, 1000)

    def _local_to_utc_us(self, local_us: np.ndarray) -> np.ndarray:
        import pandas as pd

        if local_us.shape[0] == 0:
            return local_us
        idx = pd.DatetimeIndex(local_us.astype("datetime64[us]"))
        # The hour a clock is set back happens twice: a reading in it is taken as the first
        # (summer) one; readings in the hour skipped in spring move forward to the first real
        # instant after it.
        utc = idx.tz_localize(self.zone, ambiguous=np.ones(len(idx), dtype=bool), nonexistent="shift_forward")
        return np.asarray(utc.tz_convert("UTC").tz_localize(None).as_unit("us").asi8, dtype=np.int64)

    def _utc_to_local_us(self, us: int) -> int:
        import pandas as pd

        ts = pd.Timestamp(us, unit="us", tz="UTC").tz_convert(self.zone).tz_localize(None)
        return timestamp_us(ts)

    # ---- ms -> raw -------------------------------------------------------------------------
    def bounds(self, lo_ms: int, hi_ms: int) -> tuple[Any, Any]:
        """The raw values ``[lo, hi]`` (inclusive) whose milliseconds lie in ``[lo_ms, hi_ms]``."""
        lo_ms, hi_ms = int(lo_ms), int(hi_ms)
        if self.is_float:
            return _float_lower(lo_ms), _float_upper(hi_ms)
        if self.kind == "epoch_ms":
            return lo_ms, hi_ms
        if self.kind == "epoch_s":
            return -((-lo_ms) // 1000), hi_ms // 1000  # whole seconds inside [lo_ms, hi_ms]
        if self.kind == "epoch_ns":
            return _clamp(lo_ms * 1_000_000), _clamp((hi_ms + 1) * 1_000_000 - 1)
        lo_us = _clamp(lo_ms * 1000, _US_MIN, _US_MAX)
        hi_us = _clamp((hi_ms + 1) * 1000 - 1, _US_MIN, _US_MAX)
        if self._local:
            # Years 1 and 9999 are far from any reading: the bounds clamped there stay as they are.
            if _US_MIN < lo_us < _US_MAX:
                lo_us = self._utc_to_local_us(lo_us)
            if _US_MIN < hi_us < _US_MAX:
                hi_us = self._utc_to_local_us(hi_us)
        return lo_us, hi_us

    def to_ms_or_none(self, raw: list[Any]) -> list[int | None]:
        """A table column of raw times (None where NULL) as epoch ms (None kept): the few rows of
        a runs table, read as Python values."""
        present = [i for i, v in enumerate(raw) if v is not None]
        ms = self.to_ms(np.array([raw[i] for i in present], dtype=np.float64 if self.is_float else np.int64))
        out: list[int | None] = [None] * len(raw)
        for i, m in zip(present, ms.tolist()):
            out[i] = m
        return out

    def bind(self, raw: Any) -> Any:
        """A raw bound as the value a driver binds: a datetime for timestamps, else the number."""
        if not self.is_timestamp:
            return raw
        moment = _EPOCH + dt.timedelta(microseconds=int(raw))
        return moment.replace(tzinfo=dt.timezone.utc) if self.kind == "timestamptz" else moment


def timestamp_us(ts: Any) -> int:
    """A pandas Timestamp as integer microseconds since 1970 (naive: as if UTC)."""
    return int(ts.as_unit("us").asm8.astype(np.int64))


def timestamp_ms(ts: Any) -> int:
    """A pandas Timestamp as integer milliseconds since 1970 (floored)."""
    return timestamp_us(ts) // 1000


def _float_lower(lo_ms: int) -> float:
    """The smallest float x with rint(x * 1000) >= lo_ms."""
    x = np.float64(lo_ms - 0.5) / 1000.0
    while np.rint(x * 1000.0) >= lo_ms:
        x = np.nextafter(x, -np.inf)
    while np.rint(x * 1000.0) < lo_ms:
        x = np.nextafter(x, np.inf)
    return float(x)


def _float_upper(hi_ms: int) -> float:
    """The largest float x with rint(x * 1000) <= hi_ms."""
    x = np.float64(hi_ms + 0.5) / 1000.0
    while np.rint(x * 1000.0) <= hi_ms:
        x = np.nextafter(x, np.inf)
    while np.rint(x * 1000.0) > hi_ms:
        x = np.nextafter(x, -np.inf)
    return float(x)


def type_class(type_name: str) -> str:
    """A column type (PostgreSQL's ``format_type`` or DuckDB's name) as ``tz``, ``naive``,
    ``int``, ``float``, ``numeric`` or ``other``."""
    t = type_name.lower()
    if t.startswith("timestamp"):
        return "tz" if "with time zone" in t or t == "timestamptz" else "naive"
    if t in ("smallint", "integer", "bigint", "int2", "int4", "int8", "tinyint", "hugeint", "ubigint", "uinteger",
             "usmallint", "utinyint", "int", "long"):
        return "int"
    if t in ("double precision", "real", "double", "float", "float4", "float8"):
        return "float"
    if t.startswith(("numeric", "decimal")):
        return "numeric"
    return "other"


_FITS = {
    "timestamptz": ("tz",),
    "timestamp": ("naive",),
    "epoch_s": ("int", "numeric"),
    "epoch_ms": ("int", "numeric"),
    "epoch_us": ("int", "numeric"),
    "epoch_ns": ("int", "numeric"),
    "epoch_s_float": ("float", "numeric", "int"),
}


def zone_problem(zone: str) -> str | None:
    """Why ``zone`` is not a time zone the reader can use (None: it is)."""
    import zoneinfo

    try:
        zoneinfo.ZoneInfo(zone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        return f"{zone!r} is not a known IANA zone (Europe/Berlin, UTC, ...)"
    return None


def resolve_codec(declared: str | None, zone: str | None, type_name: str, column: str) -> tuple[TimeCodec | None, str]:
    """The codec for a time column of ``type_name`` given what the description declares, or
    (None, why) when it cannot be known or does not fit."""
    cls = type_class(type_name)
    if declared is None:
        if cls == "tz":
            declared = "timestamptz"
        elif cls == "naive":
            if not zone:
                return None, (f"column {column!r} is a timestamp without time zone: say which zone its readings "
                              "are in (time_zone: UTC, or Europe/Berlin, ...)")
            declared = "timestamp"
        elif cls == "float":
            declared = "epoch_s_float"
        elif cls in ("int", "numeric"):
            return None, (f"column {column!r} is a number ({type_name}): say which epoch unit it counts "
                          "(time_type: epoch_s, epoch_ms, epoch_us or epoch_ns; epoch_s_float for fractional seconds)")
        else:
            return None, f"column {column!r} has type {type_name}, which is not a time (timestamp or epoch number)"
    if cls not in _FITS[declared]:
        return None, f"time_type {declared} does not fit column {column!r} of type {type_name}"
    if declared == "timestamp" and not zone:
        return None, f"time_type timestamp needs time_zone (the zone column {column!r} is in)"
    if zone and (problem := zone_problem(zone)):
        return None, f"time_zone {problem}"
    return TimeCodec(declared, zone if declared == "timestamp" else None), ""
