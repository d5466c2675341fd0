"""Runs from where a plant keeps them: a batch/MES table, a batch-id tag, or fixed windows.

Pure functions over columns; the backend reads the rows, :mod:`aml_pipeline.sources.mapped`
calls these. Every run is checked as ``ingest`` checks a runs file (a valid id, once; an end not
before its start; line, product and recipe present) and a bad one is an error naming the run and
where it came from, never dropped.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import numpy as np

from aml_pipeline.errors import InvalidIdError, SourceError
from aml_pipeline.ids import check_external_id
from aml_pipeline.sources.description import BatchTag, Const, Runs, Windows, duration_ms
from aml_pipeline.sources.timecodec import timestamp_ms
from aml_pipeline.tsdb.port import EVIDENCE_SOURCES, Run

# Fixed windows: how many one description may make (a typo such as ``every: 1s`` over years
# must not allocate millions of runs).
MAX_WINDOWS = 1_000_000
RUN_FIELDS = ("line", "product", "recipe", "recipe_version", "recipe_hash", "evidence", "confirmed")


def table_columns(spec: Runs) -> dict[str, str]:
    """Field -> column for the fields a runs table maps to columns (constants are not read)."""
    cols = {"id": spec.id, "start": spec.start, "end": spec.end}
    for field in RUN_FIELDS:
        v = getattr(spec, field)
        if isinstance(v, str):
            cols[field] = v
    return cols


def runs_from_rows(spec: Runs, rows: dict[str, list[Any]], where: str) -> list[Run]:
    """Runs from the rows of a batch/MES table (``rows``: field -> values, times in epoch ms)."""
    n = len(rows["id"])
    runs: list[Run] = []
    seen: dict[str, int] = {}

    def field(name: str, i: int) -> Any:
        v = getattr(spec, name)
        if v is None:
            return None
        return v.value if isinstance(v, Const) else rows[name][i]

    for i in range(n):
        run_id = _id_text(rows["id"][i])
        what = f"{where}: run {run_id!r}"
        if run_id is None:
            raise SourceError(f"{where}: row {i + 1} has no run id (column {spec.id} is NULL)")
        _check_id(run_id, f"{where}: run id")
        if run_id in seen:
            raise SourceError(f"{what} appears twice (rows {seen[run_id] + 1} and {i + 1}); run ids must be unique")
        seen[run_id] = i
        start, end = rows["start"][i], rows["end"][i]
        if start is None:
            raise SourceError(f"{what} has no start (column {spec.start} is NULL)")
        if end is not None and end < start:
            raise SourceError(f"{what} ends before it starts ({spec.end} {_iso(end)} < {spec.start} {_iso(start)})")
        text = {}
        for name in ("line", "product", "recipe"):
            v = field(name, i)
            if v is None or not str(v).strip():
                raise SourceError(f"{what} has no {name} ({_source_of(spec, name)} is empty)")
            text[name] = _id_text(v)
        version = field("recipe_version", i)
        if version is not None:
            try:
                version = int(version)
            except (TypeError, ValueError):
                raise SourceError(f"{what}: recipe_version {version!r} is not an integer") from None
        digest = field("recipe_hash", i)
        evidence = field("evidence", i) or "unassessed"
        if evidence not in EVIDENCE_SOURCES:
            raise SourceError(f"{what}: evidence {evidence!r} is not one of {', '.join(EVIDENCE_SOURCES)}")
        confirmed = field("confirmed", i)
        runs.append(
            Run(
                run_id=run_id,
                line_id=text["line"],
                product_id=text["product"],
                recipe_id=text["recipe"],
                recipe_version=version,
                recipe_content_hash=None if digest is None else str(digest),
                started_at=int(start),
                ended_at=None if end is None else int(end),
                evidence_source=str(evidence),
                context_confirmed=_truthy(confirmed),
            )
        )
    return runs


def runs_from_tag(spec: BatchTag, ts: np.ndarray, value: np.ndarray) -> list[Run]:
    """A run per maximal interval in which the batch-id tag holds one value (not idle, not NaN).

    A run starts at the first sample of its value and ends 1 ms before the first sample of the
    next value; the last one is in progress until the tag changes. A value that comes back
    after another one is a new run: its id gets ``-2``, ``-3``, ... in order of time.
    """
    if ts.shape[0] == 0:
        return []
    idle = {float(v) for v in spec.idle if isinstance(v, (int, float)) and not isinstance(v, bool)}
    idle_text = {str(v) for v in spec.idle}
    value = np.asarray(value, dtype=np.float64)
    # Segments of equal consecutive values (NaN != NaN splits, and NaN is never a run).
    change = np.ones(value.shape[0], dtype=bool)
    change[1:] = ~((value[1:] == value[:-1]) | (np.isnan(value[1:]) & np.isnan(value[:-1])))
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], value.shape[0])  # exclusive
    runs: list[Run] = []
    count: dict[str, int] = {}
    for a, b in zip(starts.tolist(), ends.tolist()):
        v = float(value[a])
        if math.isnan(v) or v in idle:
            continue
        label = _number_text(v)
        if label in idle_text:
            continue
        base = f"{spec.id_prefix}{label}"
        count[base] = count.get(base, 0) + 1
        run_id = base if count[base] == 1 else f"{base}-{count[base]}"
        _check_id(run_id, f"runs.batch_tag ({spec.node}): run id")
        end = int(ts[b]) - 1 if b < ts.shape[0] else None
        runs.append(_constant_run(spec, run_id, int(ts[a]), end))
    return runs


def runs_from_windows(spec: Windows, watermark: int | None, where: str) -> list[Run]:
    """One run per window of ``every`` from ``start`` through the window holding ``watermark``
    (the latest point); that last one is in progress unless ``end`` closes it."""
    import pandas as pd

    if watermark is None:
        return []
    try:
        zone = spec.zone
        start = pd.Timestamp(spec.start)
        start = start.tz_localize(zone) if start.tzinfo is None else start.tz_convert(zone)
        stop = None
        if spec.end is not None:
            stop = pd.Timestamp(spec.end)
            stop = stop.tz_localize(zone) if stop.tzinfo is None else stop.tz_convert(zone)
    except (ValueError, TypeError, KeyError) as e:
        raise SourceError(f"{where}.windows: cannot read start/end/zone ({e})") from None
    every = duration_ms(spec.every)
    days, rest = divmod(every, 86_400_000)
    # Whole days follow the zone's calendar (a day is 23 or 25 hours where clocks change).
    offset = pd.DateOffset(days=days) if days and not rest else pd.Timedelta(milliseconds=every)
    last = pd.Timestamp(watermark, unit="ms", tz="UTC")
    if stop is not None and stop <= last:
        last = stop - pd.Timedelta(milliseconds=1)
    prefix = spec.id_prefix or f"{spec.line}-"
    # A calendar day is at least 23 hours: a bound on the count before making any window.
    shortest = every - 3_600_000 * days if days and not rest else every
    if (timestamp_ms(last) - timestamp_ms(start)) // max(shortest, 1) + 1 > MAX_WINDOWS:
        raise SourceError(f"{where}.windows: more than {MAX_WINDOWS:,} windows of {spec.every} up to the latest point; "
                          "is every right?")
    runs: list[Run] = []
    lo = start
    while lo <= last:
        hi = lo + offset
        run_id = f"{prefix}{lo.strftime('%Y%m%dT%H%M%S' if every % 60_000 else '%Y%m%dT%H%M')}"
        _check_id(run_id, f"{where}.windows: run id")
        started, ended = _ms(lo), _ms(hi) - 1
        closed = stop is not None and hi <= stop
        runs.append(_constant_run(spec, run_id, started, ended if closed or ended < watermark else None))
        lo = hi
    return runs


def _constant_run(spec: Any, run_id: str, start: int, end: int | None) -> Run:
    return Run(
        run_id=run_id,
        line_id=spec.line,
        product_id=spec.product,
        recipe_id=spec.recipe,
        recipe_version=spec.recipe_version,
        recipe_content_hash=spec.recipe_hash,
        started_at=start,
        ended_at=end,
        evidence_source=spec.evidence,
        context_confirmed=bool(spec.confirmed),
    )


def _ms(ts: Any) -> int:
    return timestamp_ms(ts)


def _id_text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, float):
        return _number_text(v)
    return str(v)


def _number_text(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("true", "t", "yes", "y", "1")
    return bool(v) if v is not None else False


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc).isoformat(timespec="milliseconds")


def _check_id(value: str, what: str) -> None:
    try:
        check_external_id(value, what=what)
    except InvalidIdError as e:
        raise SourceError(e.message) from None


def _source_of(spec: Runs, name: str) -> str:
    v = getattr(spec, name)
    return f"column {v}" if isinstance(v, str) else "the constant"
