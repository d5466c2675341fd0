"""The TSDB port over a plant's own data, as a source description maps it (read-only).

:class:`MappedTsdb` is one more adapter behind :class:`~aml_pipeline.tsdb.port.TsdbPort`, on the
same read base as the embedded and PostgreSQL adapters (:class:`~aml_pipeline.tsdb.reading.
ReadBase`: pages, cursor and prefetch are written there once). It asks its backend
(:mod:`~aml_pipeline.sources.postgres`, :mod:`~aml_pipeline.sources.lake`,
:mod:`~aml_pipeline.sources.influx`) for rows in the source's own terms and turns them into
runs, nodes and the read base's primitives. It never writes: :meth:`MappedTsdb.ingest` refuses.

Order and cursor
    A node's points are ordered by time (as the source stores it, which orders the
    milliseconds too), then by the mapping's ``order`` columns, then by the backend's own tie
    rule (a lake: file name and row number, i.e. file order; a table without ``order``: value,
    then quality). ``seq`` is the point's position among the points of its millisecond (0, 1,
    ...), so ``(ts, seq)`` is strictly increasing and the last point of a millisecond, the one
    cleaning keeps, is the last in that order. A page after the cursor ``(ts, k)`` reads from
    ``ts`` on and skips the first ``k + 1`` points of that millisecond: points sharing a
    timestamp across a page boundary are neither lost nor repeated.

Runs
    A run's points are the node's points in ``[started_at, ended_at]`` (to the end of time while
    it runs), and, where the mapping names a line column, on the run's line.

Versions
    A run's version hashes its record with one aggregate of its points (count, time range and a
    checksum, per the backend) read in one query per batch of runs: a late, deleted or
    corrected point changes exactly the runs whose windows hold it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from aml_pipeline.errors import SourceError, TsdbError, UnknownNodeError, UnknownRunError
from aml_pipeline.ids import EXTERNAL_ID_RE
from aml_pipeline.sources import read_only_error
from aml_pipeline.sources.backend import NO_END, Backend, NodeRef, Series, TableRead, Window
from aml_pipeline.sources.description import LoadedDescription, NodeEntry
from aml_pipeline.sources.runs import runs_from_rows, runs_from_tag, runs_from_windows, table_columns
from aml_pipeline.plausible_time import implausible_times
from aml_pipeline.sources.timecodec import TimesBeyondInt64
from aml_pipeline.tsdb.columns import clamp_i64
from aml_pipeline.tsdb.port import Cursor, Node, Page, Run, RunScope
from aml_pipeline.tsdb.reading import ReadBase, Rows
from aml_pipeline.tsdb.versions import record_digest

# Runs per version query (one aggregate query per batch).
VERSION_BATCH = 256
# Reading a batch-id tag's whole history, page by page.
_TAG_PAGE = 200_000
# The first series of at least this many points is checked for its median sample period too
# (fewer: a setpoint logged on change may rightly be months apart).
_PERIOD_SAMPLE = 100
# Time types whose unit can be wrong (a number read in the wrong unit).
_EPOCH = ("epoch_s", "epoch_ms", "epoch_us", "epoch_ns", "epoch_s_float")


def ranks(ts: np.ndarray, first_offset: int = 0) -> np.ndarray:
    """Each point's position among the points of its millisecond (``ts`` ascending); the first
    group starts at ``first_offset`` (it continues a millisecond a previous page began)."""
    n = ts.shape[0]
    if n == 0:
        return np.empty(0, np.int64)
    if n == 1 or bool(np.all(ts[1:] != ts[:-1])):  # the usual case: no two points share a time
        seq = np.zeros(n, np.int64)
        seq[0] = first_offset
        return seq
    idx = np.arange(n, dtype=np.int64)
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.not_equal(ts[1:], ts[:-1], out=new[1:])
    starts = np.maximum.accumulate(np.where(new, idx, 0))
    seq = idx - starts
    if first_offset:
        seq[starts == 0] += first_offset
    return seq


class MappedTsdb(ReadBase):
    """:class:`~aml_pipeline.tsdb.port.TsdbPort` over a source description (read-only)."""

    read_only = True

    def __init__(self, url: str, loaded: LoadedDescription, backend: Backend | None = None) -> None:
        super().__init__()
        self.url = url
        self.loaded = loaded
        self.spec = loaded.spec
        self._backend: Backend | None = backend if backend is not None else open_backend(loaded)
        self._refs: dict[str, NodeRef] | None = None
        self._catalog: list[Node] | None = None
        self._runs: dict[str, Run] = {}
        self._period_checked = False
        self._latest_checked = False

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise TsdbError(f"{self.url}: this TSDB handle is closed")
        return self._backend

    def _ask(self, name: str, *args: Any) -> Any:
        """One call of the backend, never two at once (a connection, a COPY in progress, an HTTP
        answer being read are not shared between threads)."""
        with self._lock:
            try:
                return getattr(self.backend, name)(*args)
            except TimesBeyondInt64 as e:  # seconds that are not seconds, say which unit they are
                if name == "read_table":
                    why = implausible_times(np.array([e.ms]), args[0].time_type)
                    raise SourceError(f"{self.loaded.path}: {args[0].key}: a time column {why}") from None
                self._check_times(np.array([e.ms]), "a point")
                raise

    def _release(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    def __repr__(self) -> str:
        return f"MappedTsdb({self.url!r}, {self.spec.backend}, {'closed' if self._backend is None else 'open'})"

    def ingest(self, **_: Any) -> int:
        raise read_only_error(self.url)

    # ---- nodes -----------------------------------------------------------------------------
    def _node_refs(self) -> dict[str, NodeRef]:
        with self._lock:
            if self._refs is None:
                self._refs, self._catalog = self._read_catalog()
            return self._refs

    def _read_catalog(self) -> tuple[dict[str, NodeRef], list[Node]]:
        spec, where = self.spec, str(self.loaded.path)
        layout = spec.points.effective_layout
        entries: dict[str, dict[str, Any]] = {}
        if spec.node_table is not None:
            t = spec.node_table
            cols = {"id": t.id, **{k: getattr(t, k) for k in ("key", "unit", "low", "high") if getattr(t, k)}}
            rows = self._ask("read_table", TableRead("node_table", t, cols))
            for i, raw in enumerate(rows["id"]):
                if raw is None:
                    continue
                node_id = _node_id(raw, f"{where}: node_table: node", f"column {t.id}",
                                   "select the nodes you use with node_table.where, or map a column of clean ids")
                if node_id in entries:
                    raise SourceError(f"{where}: node_table: node {node_id!r} appears twice (column {t.id})")
                entries[node_id] = {
                    "key": rows["key"][i] if "key" in rows else node_id,
                    "unit": _text(rows["unit"][i]) if "unit" in rows and rows["unit"][i] is not None else "",
                    **{side: _range_bound(rows[side][i], side, f"{where}: node_table: node {node_id!r} (column {getattr(t, side)})")
                       if side in rows else None for side in ("low", "high")},
                }
        for node_id, entry in spec.nodes.items():
            e = entry or NodeEntry()
            base = entries.setdefault(node_id, {"key": node_id, "unit": "", "low": None, "high": None})
            for name in ("unit", "low", "high", "key"):
                if getattr(e, name) is not None:
                    base[name] = getattr(e, name)
        refs: dict[str, NodeRef] = {}
        if layout == "wide":
            columns = spec.points.wide_columns()
            listed = [n for n in spec.nodes if n not in columns]
            if listed:
                raise SourceError(f"{where}: nodes: node {listed[0]!r} has no column in points.columns")
            for node_id, col in columns.items():
                refs[node_id] = NodeRef(node_id, column=col.column, quality=col.quality_spec())
                entries.setdefault(node_id, {"key": None, "unit": "", "low": None, "high": None})
            entries = {k: v for k, v in entries.items() if k in columns}
        else:
            if not entries:
                for raw in self._ask("distinct_keys"):
                    if raw is None:
                        continue
                    node_id = _node_id(raw, f"{where}: points: node", f"column {spec.points.node}",
                                       "list the nodes you use under nodes (with key: for the source's name) or map a node_table")
                    entries[node_id] = {"key": raw, "unit": "", "low": None, "high": None}
            for node_id, e in entries.items():
                refs[node_id] = NodeRef(node_id, key=e["key"])
        for node_id, e in entries.items():
            lo, hi = e["low"], e["high"]
            if lo is not None and hi is not None and lo > hi:
                raise SourceError(f"{where}: node {node_id!r}: low {lo} is above high {hi}")
        catalog = [Node(n, e["unit"] or "", e["low"], e["high"]) for n, e in sorted(entries.items())]
        return dict(sorted(refs.items())), catalog

    def list_nodes(self) -> list[Node]:
        self._node_refs()
        return list(self._catalog or [])

    def _ref(self, node_id: str) -> NodeRef:
        ref = self._node_refs().get(node_id)
        if ref is None:
            raise UnknownNodeError(f"unknown node {node_id!r}: not in {self.url}")
        return ref

    # ---- runs ------------------------------------------------------------------------------
    def _read_runs(self) -> list[Run]:
        runs_spec, where = self.spec.runs, f"{self.loaded.path}: runs"
        if runs_spec.form == "table":
            read = TableRead("runs", runs_spec, table_columns(runs_spec), ("start", "end"), runs_spec.time_type,
                             runs_spec.time_zone)
            rows = self._ask("read_table", read)
            for field in ("start", "end"):
                times = np.array([t for t in rows[field] if t is not None], dtype=np.int64)
                why = implausible_times(times, runs_spec.time_type if runs_spec.time_type in _EPOCH else None)
                if why:
                    raise SourceError(f"{where}.{field}: column {getattr(runs_spec, field)!r} {why}")
            runs = runs_from_rows(runs_spec, rows, where)
        elif runs_spec.form == "batch_tag":
            tag = runs_spec.batch_tag
            ref = self._node_refs().get(tag.node)
            if ref is None:
                raise SourceError(f"{where}.batch_tag.node: node {tag.node!r} is not in the node catalog")
            series = self._whole_series(ref)
            runs = runs_from_tag(tag, series.ts, series.value)
        else:
            runs = runs_from_windows(runs_spec.windows, self.availability_watermark(), where)
        runs.sort(key=lambda r: (r.started_at, r.run_id))
        with self._lock:
            self._runs = {r.run_id: r for r in runs}
        return runs

    def list_runs(self, scope: RunScope | None = None, finished_only: bool = True) -> list[Run]:
        runs = self._read_runs()
        return [r for r in runs if (not finished_only or r.finished) and (scope is None or scope.admits(r))]

    def get_run(self, run_id: str) -> Run:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            self._read_runs()
            with self._lock:
                run = self._runs.get(run_id)
        if run is None:
            raise UnknownRunError(f"unknown run {run_id!r}: not in {self.url}")
        return run

    # ---- points ----------------------------------------------------------------------------
    def availability_watermark(self) -> int | None:
        refs = list(self._node_refs().values())
        latest = self._ask("max_time", refs) if refs else None
        if latest is not None:
            self._check_times(np.array([latest], dtype=np.int64), "the latest point")
        self._latest_checked = True
        return latest

    def _check_times(self, ts: np.ndarray, what: str) -> None:
        """One line naming the time column, the unit it was read in and the unit its values look
        like, when the times the mapping yields cannot be a plant's (before 1990, more than a year
        ahead; the first series read also by its median sample period)."""
        if ts.shape[0] == 0:
            return
        check = ts if not self._period_checked and ts.shape[0] >= _PERIOD_SAMPLE else ts[[int(ts.argmin()), int(ts.argmax())]]
        codec = self.backend.codec
        why = implausible_times(check, codec.kind if codec is not None else None)
        if check is ts:
            self._period_checked = True
        if why is None:
            return
        p = self.spec.points
        if codec is None:
            raise SourceError(f"{self.loaded.path}: points: {what}: the {self.spec.backend} server's own time {why}")
        raise SourceError(f"{self.loaded.path}: points.time: column {p.time!r} ({what}) {why}")

    def _window(self, run: Run, from_ms: int, to_ms: int) -> tuple[int, int]:
        end = NO_END if run.ended_at is None else run.ended_at
        return max(clamp_i64(from_ms), run.started_at), min(clamp_i64(to_ms), end)

    def _line(self, run: Run) -> str | None:
        return run.line_id if self.spec.points.line else None

    # ---- the read base's primitives -------------------------------------------------------
    def _locate(self, node_id: str, run_id: str, from_ms: int, to_ms: int) -> tuple[Any, int, int]:
        ref = self._ref(node_id)
        run = self.get_run(run_id)
        lo, hi = self._window(run, from_ms, to_ms)
        return (ref, self._line(run)), lo, hi

    def _read(self, series: Any, lo: int, hi: int, after: Cursor | None, want: int) -> Rows:
        """The backend's points from ``lo`` on, in the source order; ``seq`` is each point's rank
        in its millisecond, so after ``(lo, k)`` the first ``k + 1`` points of ``lo`` are skipped."""
        ref, line = series
        skip = 0 if after is None else int(after.seq) + 1
        s = self._ask("fetch", ref, lo, hi, line, want + skip)
        ts, value, state = s.ts, s.value, s.state
        self._check_times(ts, f"node {ref.node_id!r}")
        if len(s) > 1 and not bool(np.all(ts[1:] >= ts[:-1])):
            raise TsdbError(f"{self.url}: points of node {ref.node_id!r} did not come in time order")
        offset = 0
        if skip:
            at_cursor = int(np.searchsorted(ts, lo, side="right"))  # leading points at cursor.ts
            drop = min(skip, at_cursor)
            ts, value, state = ts[drop:], value[drop:], state[drop:]
            if drop == skip:
                offset = skip
        seq = ranks(ts, offset if ts.shape[0] and ts[0] == lo else 0)
        return Rows(ts, value, state, seq).head(want)

    def _read_run(
        self, run_id: str, node_ids: Sequence[str], from_ms: int, to_ms: int, most: int
    ) -> dict[str, Rows] | None:
        """The backend's read of several nodes at once (:meth:`Backend.fetch_many`)."""
        refs = self._node_refs()
        wanted = [refs[n] for n in node_ids if n in refs]
        run = self.get_run(run_id)
        lo, hi = self._window(run, from_ms, to_ms)
        if not wanted or lo > hi:
            return None
        # What a backend keeps past the run for the next one (a lake file holding several runs)
        # has the memory share of a prefetch of its own, whatever this run's bound.
        series = self._ask("fetch_many", wanted, lo, hi, self._line(run), most + 1, self.prefetch_limit())
        if series is None or sum(len(s) for s in series) > most:
            return None
        for ref, s in zip(wanted, series):
            self._check_times(s.ts, f"node {ref.node_id!r}")
        return {ref.node_id: Rows(s.ts, s.value, s.state, ranks(s.ts)) for ref, s in zip(wanted, series)}

    def _whole_series(self, ref: NodeRef) -> Series:
        """Every point of a node (a batch-id tag), page by page."""
        parts: list[Page] = []
        cursor: Cursor | None = None
        while True:
            page = self._page((ref, None), -(2**63), NO_END, cursor, _TAG_PAGE, f"node {ref.node_id!r}")
            parts.append(page)
            if page.done:
                break
            cursor = page.next_cursor
        return Series(
            np.concatenate([p.ts for p in parts]),
            np.concatenate([p.value for p in parts]),
            np.concatenate([p.state for p in parts]),
        )

    # ---- versions --------------------------------------------------------------------------
    def run_versions(self, run_ids: Sequence[str]) -> dict[str, str]:
        ids = list(dict.fromkeys(str(r) for r in run_ids))
        if not ids:
            return {}
        if not self._latest_checked:  # every build plans with versions: its times are checked here
            self.availability_watermark()
        with self._lock:
            known = dict(self._runs)
        if any(i not in known for i in ids):
            known = {r.run_id: r for r in self._read_runs()}
        runs = [known[i] for i in ids if i in known]
        refs = list(self._node_refs().values())
        out: dict[str, str] = {}
        for start in range(0, len(runs), VERSION_BATCH):
            batch = runs[start : start + VERSION_BATCH]
            windows = [Window(*self._window(r, -(2**63), NO_END), self._line(r)) for r in batch]
            aggs = self._ask("aggregates", windows, refs) if refs else [None] * len(batch)
            for run, agg in zip(batch, aggs):
                h = hashlib.sha256(record_digest(run))
                h.update(json.dumps(agg, sort_keys=True, separators=(",", ":"), default=str).encode())
                out[run.run_id] = h.hexdigest()[:32]
        return out

    def describe(self) -> dict[str, Any]:
        return self._ask("describe")

    def engineering(self) -> dict[str, dict[str, Any]]:
        """The source's own unit and range of each node, where it has them (OPC UA's
        EngineeringUnits and EURange): :meth:`Backend.engineering`."""
        refs = self._node_refs()
        return self._ask("engineering", list(refs.values())) if refs else {}


def _node_id(raw: Any, what: str, where: str, hint: str) -> str:
    """A node id read from the source, checked as ids are everywhere."""
    node_id = _text(raw)
    if not EXTERNAL_ID_RE.fullmatch(node_id) or ".." in node_id:
        raise SourceError(f"{what} {node_id!r} ({where}) is not a valid node id (letters, digits and _ . : @ + -); {hint}")
    return node_id


def _text(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _range_bound(v: Any, side: str, where: str) -> float | None:
    """A tag table's ``low`` or ``high``: a number; empty (NULL, NaN) or the open side's infinity
    (``-inf`` low, ``+inf`` high) is no bound on that side. Text that is no number, or the other
    infinity (a range that holds no number), is refused naming the node and the column."""
    if v is None:
        return None
    try:
        if isinstance(v, bool):  # float(True) is 1.0: a flag column mapped by mistake
            raise ValueError(v)
        f = float(v)
    except (TypeError, ValueError):
        raise SourceError(f"{where}: {side} {v!r} is not a number") from None
    if np.isnan(f):
        return None
    if np.isinf(f):
        if (f < 0) == (side == "low"):
            return None
        raise SourceError(f"{where}: {side} {f} leaves no number in the node's range; "
                          f"leave it empty for no bound on that side")
    return f


def open_backend(loaded: LoadedDescription) -> Backend:
    kind = loaded.spec.backend
    if kind == "postgresql":
        from aml_pipeline.sources.postgres import PostgresSource

        return PostgresSource(loaded)
    if kind == "files":
        from aml_pipeline.sources.lake import LakeSource

        return LakeSource(loaded)
    if kind == "opcua":
        from aml_pipeline.sources.opcua import OpcUaSource

        return OpcUaSource(loaded)
    from aml_pipeline.sources.influx import InfluxSource

    return InfluxSource(loaded)
