"""Side-by-side timing: the one way every figure of the benchmark is measured.

``side_by_side({"ours": f, "reference": g}, repeat=5)`` runs every side once per repetition,
alternating (the order rotates from one repetition to the next, so neither side always runs
first, on a warmer cache or a quieter machine), and summarises each side as
``{median, min, max, repeat, all}``. A ratio is the ratio of the two medians; its ``min`` and
``max`` are those of the per-repetition (paired) ratios, which show how far one repetition can
stray when the machine is noisy (the two sides of a pair ran seconds apart, on the same load).

A side is a callable. Its wall time is measured around the call with ``time.perf_counter``,
unless it returns a :class:`Sample`, which carries its own ``seconds`` (e.g. measured inside a
child process, so the interpreter's start-up is not counted) and further ``metrics`` (peak RSS,
points, ...) that are summarised the same way. ``prepare(side, i)``, if given, runs untimed
before each call (fresh output directories, a fresh instance).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """What a side may return instead of a plain value: its own timing and other metrics."""

    seconds: float
    value: Any = None
    metrics: dict[str, float] = field(default_factory=dict)


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """``{median, min, max, repeat, all}`` of repeated measurements (numpy's even-count median)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("summarize: no measurements")
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "repeat": len(vals), "all": vals}


@dataclass
class Comparison:
    """Per-side measurements of one :func:`side_by_side` call."""

    seconds: dict[str, list[float]]
    metrics: dict[str, dict[str, list[float]]]
    values: dict[str, Any]  # each side's result of its last repetition
    order: list[list[str]]  # the order the sides ran in, per repetition

    @property
    def repeat(self) -> int:
        return len(self.order)

    def timing(self, side: str) -> dict[str, Any]:
        return summarize(self.seconds[side])

    def metric(self, side: str, name: str) -> dict[str, Any]:
        return summarize(self.metrics[side][name])

    def series(self, side: str, metric: str = "seconds") -> list[float]:
        return self.seconds[side] if metric == "seconds" else self.metrics[side][metric]

    def ratio(self, num: str, den: str, metric: str = "seconds") -> dict[str, Any]:
        """``median(num) / median(den)``, with the min and max of the paired ratios."""
        return ratio_of(self.series(num, metric), self.series(den, metric))

    def difference(self, a: str, b: str, metric: str = "seconds") -> dict[str, Any]:
        """``median(a) - median(b)``, with the min and max of the paired differences."""
        x, y = self.series(a, metric), self.series(b, metric)
        paired = [p - q for p, q in zip(x, y, strict=True)]
        return {"value": statistics.median(x) - statistics.median(y), "min": min(paired), "max": max(paired),
                "repeat": len(paired), "paired": paired}

    def rate_ratio(self, num: str, den: str, num_work: float, den_work: float) -> dict[str, Any]:
        """Ratio of throughputs ``(num_work / t_num) / (den_work / t_den)``: medians, and the
        min and max over pairs, as for :meth:`ratio`."""
        scale = num_work / den_work
        r = ratio_of(self.seconds[den], self.seconds[num])
        return {**r, "value": r["value"] * scale, "min": r["min"] * scale, "max": r["max"] * scale,
                "paired": [p * scale for p in r["paired"]]}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"repeat": self.repeat, "order": self.order}
        for side, secs in self.seconds.items():
            entry = {"seconds": summarize(secs)}
            for name, vals in self.metrics[side].items():
                entry[name] = summarize(vals)
            out[side] = entry
        return out


def ratio_of(num: Sequence[float], den: Sequence[float]) -> dict[str, Any]:
    """``median(num) / median(den)`` and the min/max of the paired ratios ``num[i] / den[i]``."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio_of: need the same number of measurements on both sides, got {len(num)} and {len(den)}")
    paired = [a / b for a, b in zip(num, den, strict=True)]
    return {
        "value": statistics.median(num) / statistics.median(den),
        "min": min(paired),
        "max": max(paired),
        "repeat": len(paired),
        "paired": paired,
    }


def side_by_side(
    sides: Mapping[str, Callable[[], Any]],
    *,
    repeat: int,
    prepare: Callable[[str, int], None] | None = None,
    rotate: bool = True,
) -> Comparison:
    """Run every side ``repeat`` times, alternating; see the module docstring.

    ``rotate=False`` keeps the given order in every repetition, for sides that depend on the
    one before them (a rebuild after a full build).
    """
    if repeat < 1:
        raise ValueError(f"side_by_side: repeat must be >= 1, got {repeat}")
    if not sides:
        raise ValueError("side_by_side: no sides")
    names = list(sides)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    metrics: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    values: dict[str, Any] = {}
    order: list[list[str]] = []
    for i in range(repeat):
        shift = i % len(names) if rotate else 0
        this = names[shift:] + names[:shift]
        order.append(this)
        for name in this:
            if prepare is not None:
                prepare(name, i)
            t0 = time.perf_counter()
            out = sides[name]()
            elapsed = time.perf_counter() - t0
            if isinstance(out, Sample):
                elapsed = out.seconds
                for key, v in out.metrics.items():
                    metrics[name].setdefault(key, []).append(float(v))
                out = out.value
            seconds[name].append(elapsed)
            values[name] = out
    for name, ms in metrics.items():
        for key, vals in ms.items():
            if len(vals) != repeat:
                raise ValueError(f"side_by_side: side {name!r} reported metric {key!r} in {len(vals)} of {repeat} repetitions")
    return Comparison(seconds, metrics, values, order)


def timed(fn: Callable[[], Any], *, repeat: int, prepare: Callable[[str, int], None] | None = None) -> Comparison:
    """One side alone (an absolute figure such as points/s), measured the same way."""
    return side_by_side({"only": fn}, repeat=repeat, prepare=prepare)
