"""Reading points, runs and nodes from CSV or Parquet files, validated, into the port's types.

Files
    ``.csv`` (also ``.csv.gz``/``.csv.bz2``: pyarrow decompresses by extension) or
    ``.parquet``/``.pq``. Column names may be snake_case (``run_id``) or camelCase (``runId``);
    case, surrounding blanks and ``-``/space separators do not matter. Columns the file has but
    nobody asked for are ignored.

Columns (docs/ingest.md)
    points: ``run_id, node_id, ts, value, state`` (all required; ``state`` too: a file that
    does not say which points are good must not pass as all-good).
    runs: ``run_id, line_id, product_id, recipe_id, started_at, ended_at`` required;
    ``recipe_version, recipe_content_hash`` (absent/empty -> None), ``evidence_source``
    (absent/empty -> ``unassessed``), ``context_confirmed`` (absent/empty -> false; accepts
    true/false, 1/0, yes/no, t/f, y/n).
    nodes: ``node_id`` required; ``unit`` (absent/empty -> ""), ``range_lo, range_hi``
    (absent/empty -> unknown).

Values
    ``ts``, ``started_at`` and ``ended_at`` are epoch milliseconds (integers) or ISO-8601
    strings. An ISO string with a zone (``Z``, ``+01:00``) is converted to UTC; a naive one is
    taken as UTC. Sub-millisecond digits are floored. Parquet timestamp columns are accepted
    too (naive ones as UTC). Empty ``ended_at`` means the run is still running. A time before
    1990 or more than a year from now is refused (:mod:`aml_pipeline.plausible_time`): it is
    what a file in seconds or microseconds reads as.
    ``value`` may be NaN or +-inf (``nan``, ``inf``, ``-inf``; cleaning counts them) and an
    empty ``value`` cell is read as NaN (a missing reading); any other unparseable text, and a
    number beyond a 64-bit float (``1e400``), is an error.

Errors
    An :class:`IngestError` whose one-line message names the file, the row (``line N`` for CSV,
    the line of the file the record starts on, the header being line 1; ``row N``, 1-based, for
    Parquet), the column and the problem. :func:`ingest_files` parses and validates every file
    before one ``tsdb.ingest`` call, which is all-or-nothing: nothing is ever half-ingested.
    :func:`ingest_into` (the CLI's ``ingest``) also removes an embedded TSDB file that it created
    for an ingest that then failed.

Re-ingesting
    Points already stored (same run, node, ts, value and state) are skipped and counted
    (``skipped``), so ingesting a file twice stores it once; ``replace_runs`` instead replaces
    all stored points of every run the points files name (see :mod:`aml_pipeline.tsdb.writer`).

Validation is vectorised (pyarrow compute, pandas, numpy); Python only loops over the distinct
ids of a column and, after a vectorised check failed, over one chunk to find the first bad row.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from aml_pipeline.errors import IngestError, quote
from aml_pipeline.faults import crash_point
from aml_pipeline.ids import EXTERNAL_ID_RE
from aml_pipeline.plausible_time import epoch_ms_column_problem
from aml_pipeline.tsdb.port import DEFAULT_LOCK_TIMEOUT_S, EVIDENCE_SOURCES, Node, PointColumns, Run, TsdbPort

PathLike = str | os.PathLike[str]
Progress = Callable[[int, int], None]

POINT_COLUMNS = ("run_id", "node_id", "ts", "value", "state")
RUN_REQUIRED = ("run_id", "line_id", "product_id", "recipe_id", "started_at", "ended_at")
RUN_OPTIONAL = ("recipe_version", "recipe_content_hash", "evidence_source", "context_confirmed")
NODE_REQUIRED = ("node_id",)
NODE_OPTIONAL = ("unit", "range_lo", "range_hi")

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_CHUNK = 65_536
_INT_RE = r"^\s*[+-]?[0-9]+\s*$"
_TRUE = {"true", "t", "yes", "y", "1"}
_FALSE = {"false", "f", "no", "n", "0"}


# ---- file access -----------------------------------------------------------------------------


@dataclass
class _Source:
    """A file read into an Arrow table with normalised column names."""

    path: Path
    kind: str  # "csv" | "parquet"
    table: pa.Table
    original: dict[str, str]  # normalised name -> name in the file

    def where(self, row: int) -> str:
        """``file: line N`` / ``file: row N`` for the 0-based data row ``row``. A CSV's line is the
        one the record starts on in the file as a text editor shows it: blank lines (which the
        reader skips) and values quoted across lines are counted."""
        if self.kind == "csv":
            return f"{self.path}: line {_csv_line_of(self.path, row)}"
        return f"{self.path}: row {row + 1}"

    def error(self, row: int, column: str, problem: str) -> IngestError:
        return IngestError(f"{self.where(row)}, column {quote(self.original.get(column, column))}: {problem}")

    def has(self, column: str) -> bool:
        return column in self.original

    def column(self, name: str) -> pa.ChunkedArray:
        return self.table.column(name)

    def require(self, names: Iterable[str], what: str) -> None:
        missing = [n for n in names if n not in self.original]
        if missing:
            have = ", ".join(self.original.values()) or "none"
            raise IngestError(
                f"{self.path}: missing column {quote(missing[0])} for {what} "
                f"(the file has: {have})"
            )

    def __len__(self) -> int:
        return self.table.num_rows


def normalise_column_name(name: str) -> str:
    """``runId``/``RUN_ID``/`` run id `` -> ``run_id``."""
    s = re.sub(r"[\s\-]+", "_", str(name).strip())
    s = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", s)
    return s.lower()


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if re.search(r"\.csv(\.(gz|bz2|zst|lz4))?$", name):
        return "csv"
    raise IngestError(f"{path}: unsupported file type (use .csv, .csv.gz or .parquet)")


def _open(path: PathLike) -> _Source:
    path = Path(path)
    kind = _kind(path)
    if path.is_dir():  # what the system refuses is FILE_ERROR, as for every command (docs/cli.md)
        raise IngestError(f"{path}: a directory, not a file", code="FILE_ERROR")
    if not path.is_file():
        what = "not a regular file (a pipe, socket or device): give a file" if path.exists() else "no such file"
        raise IngestError(f"{path}: {what}")
    try:
        with open(path, "rb"):
            pass
    except PermissionError as e:
        raise IngestError(f"{path}: {e.strerror or 'permission denied'}", code="FILE_ERROR") from None
    try:
        if kind == "parquet":
            table = pq.read_table(path)
        else:
            header = _csv_header(path)
            table = pacsv.read_csv(
                path,
                convert_options=pacsv.ConvertOptions(
                    column_types={h: pa.string() for h in header},
                    strings_can_be_null=True,
                    quoted_strings_can_be_null=False,
                    null_values=[""],
                ),
            )
    except IngestError:
        raise
    except (pa.ArrowException, OSError, ValueError, UnicodeDecodeError) as e:
        placed = _csv_read_problem(path, e) if kind == "csv" else None
        if placed is not None:
            raise IngestError(f"{path}: {placed}") from None
        raise IngestError(f"{path}: cannot read {kind} file ({' '.join(str(e).split())})") from None
    original: dict[str, str] = {}
    names = []
    for name in table.column_names:
        norm = normalise_column_name(name)
        if norm in original:
            raise IngestError(
                f"{path}: columns {quote(original[norm])} and {quote(name)} both mean {quote(norm)}"
            )
        original[norm] = name
        names.append(norm)
    table = table.rename_columns(names)
    return _Source(path, kind, table, original)


def _csv_records(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line, fields)`` of each record of a CSV file, the header first, ``line`` being the file
    line it starts on; blank lines are skipped, as the Arrow reader skips them. For errors only:
    Python's csv module, one record at a time."""
    with pa.input_stream(str(path), compression="detect") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace", newline="")
        reader = csv.reader(text)
        start = 1
        for fields in reader:
            if fields:
                yield start, fields
            start = reader.line_num + 1


def _csv_line_of(path: Path, row: int) -> int:
    """The file line data row ``row`` (0-based, after the header) starts on."""
    try:
        for k, (line, _) in enumerate(_csv_records(path)):
            if k == row + 1:
                return line
    except (OSError, csv.Error, pa.ArrowException):
        pass
    return row + 2  # the file changed or cannot be re-read: the line without blank lines


def _csv_read_problem(path: Path, e: Exception) -> str | None:
    """Where the Arrow reader's parse error is, for the two errors it does not place: a record
    with another number of fields than the header, and bytes that are not UTF-8 text."""
    text = str(e)
    try:
        if "Expected" in text and "columns, got" in text:
            expected = None
            for line, fields in _csv_records(path):
                if expected is None:
                    expected = len(fields)
                elif len(fields) != expected:
                    return f"line {line}: {len(fields)} fields where the header has {expected}"
        elif "UTF8" in text or "UTF-8" in text:
            with pa.input_stream(str(path), compression="detect") as raw:
                for line, data in enumerate(io.BufferedReader(raw), start=1):
                    try:
                        data.decode("utf-8")
                    except UnicodeDecodeError as bad:
                        return (f"line {line}: byte 0x{data[bad.start]:02x} (byte {bad.start + 1} of the line) is not UTF-8 "
                                "text (save the file as UTF-8)")
    except (OSError, csv.Error, pa.ArrowException):
        return None
    return None


def _csv_header(path: Path) -> list[str]:
    with pa.input_stream(str(path), compression="detect") as stream:
        head = stream.read(1 << 16)
    text = head.decode("utf-8-sig", errors="replace")
    first = text.splitlines()[0] if text.strip() else ""
    if not first.strip():
        raise IngestError(f"{path}: empty file (expected a header line)")
    return next(csv.reader(io.StringIO(first)))


# ---- column parsers (vectorised) ----------------------------------------------------------


def _combined(col: pa.ChunkedArray) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _first_null(src: _Source, arr: pa.Array, name: str, what: str = "empty value") -> None:
    if arr.null_count:
        i = int(np.argmax(arr.is_null().to_numpy(zero_copy_only=False)))
        raise src.error(i, name, what)


def _as_strings(src: _Source, arr: pa.Array, name: str) -> pa.Array:
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr
    if pa.types.is_integer(arr.type) or pa.types.is_dictionary(arr.type):
        return pc.cast(arr, pa.string())
    raise src.error(0, name, f"expected text, the column has type {arr.type}")


def _parse_ids(src: _Source, name: str) -> np.ndarray:
    """Required id column -> object array of str, each checked with the external-id rule."""
    arr = _as_strings(src, _combined(src.column(name)), name)
    _first_null(src, arr, name, f"missing {name}")
    enc = arr.dictionary_encode()
    uniques = enc.dictionary.to_pylist()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    bad = [j for j, v in enumerate(uniques) if not EXTERNAL_ID_RE.fullmatch(v) or ".." in v]
    if bad:
        i = int(np.argmax(np.isin(codes, bad)))
        raise src.error(
            i,
            name,
            f"invalid id {quote(uniques[codes[i]])}: use letters, digits and _ . : @ + - "
            "(starting with a letter or digit, at most 128 characters, no '..')",
        )
    return np.asarray(uniques, dtype=object)[codes] if len(codes) else np.empty(0, dtype=object)


def _cast_or_locate(
    src: _Source, arr: pa.Array, name: str, target: pa.DataType, problem: Callable[[Any], str]
) -> pa.Array:
    """Cast a string array; on failure name the first row that does not convert."""
    try:
        return pc.cast(arr, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    for start in range(0, len(arr), _CHUNK):
        chunk = arr.slice(start, _CHUNK)
        try:
            pc.cast(chunk, target)
            continue
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        for k, v in enumerate(chunk.to_pylist()):
            if v is None:
                continue
            try:
                pc.cast(pa.array([v], type=arr.type), target)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise src.error(start + k, name, problem(v)) from None
    raise src.error(0, name, f"cannot convert the column to {target}")  # pragma: no cover


def _is_text(arr: pa.Array) -> bool:
    return pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)


def _trimmed(arr: pa.Array) -> pa.Array:
    """Numbers in text: surrounding blanks are dropped and a blank cell is empty (null)."""
    trimmed = pc.utf8_trim_whitespace(arr)
    return pc.if_else(pc.equal(trimmed, ""), pa.scalar(None, arr.type), trimmed)


_INF_RE = r"^[+-]?inf(inity)?$"


def _parse_float(src: _Source, name: str, *, null_as_nan: bool) -> np.ndarray:
    """Float column; NaN/inf allowed. Empty cells -> NaN (``null_as_nan``) or an error."""
    arr = _combined(src.column(name))
    if _is_text(arr):
        text = _trimmed(arr)
        arr = _cast_or_locate(
            src, text, name, pa.float64(), lambda v: f"not a number: {quote(v)}"
        )
        # A number too large for float64 (1e400) reads as inf: refused, unlike the text inf itself.
        huge = pc.and_(pc.is_inf(arr), pc.invert(pc.match_substring_regex(text, _INF_RE, ignore_case=True)))
        huge = np.asarray(pc.fill_null(huge, False).to_numpy(zero_copy_only=False), dtype=bool)
        if huge.any():
            i = int(np.argmax(huge))
            raise src.error(i, name, f"{quote(text[i].as_py())} is beyond the range of a 64-bit float")
    elif not (pa.types.is_floating(arr.type) or pa.types.is_integer(arr.type) or pa.types.is_null(arr.type)):
        raise src.error(0, name, f"expected numbers, the column has type {arr.type}")
    if not null_as_nan:
        _first_null(src, arr, name)
    return np.asarray(pc.fill_null(pc.cast(arr, pa.float64()), np.nan).to_numpy(zero_copy_only=False), dtype=np.float64)


def _parse_int(
    src: _Source, name: str, lo: int, hi: int, *, nullable: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Integer column -> (int64 values, null mask). Floats must be integral."""
    arr = _combined(src.column(name))
    if _is_text(arr):
        arr = _cast_or_locate(src, _trimmed(arr), name, pa.int64(), lambda v: f"not an integer: {quote(v)}")
    elif pa.types.is_floating(arr.type):
        f = arr.to_numpy(zero_copy_only=False).astype(np.float64)
        valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        bad = valid & ~(np.isfinite(f) & (f == np.floor(f)) & (np.abs(f) < 2**62))
        if bad.any():
            i = int(np.argmax(bad))
            raise src.error(i, name, f"not an integer: {quote(float(f[i]))}")
        arr = pa.array(np.where(valid, f, 0).astype(np.int64), mask=~valid)
    elif pa.types.is_integer(arr.type) or pa.types.is_null(arr.type):
        if pa.types.is_uint64(arr.type):
            arr = _cast_or_locate(src, arr, name, pa.int64(), lambda v: f"out of range: {quote(v)}")
        arr = pc.cast(arr, pa.int64())
    else:
        # A boolean is not taken for 0/1: as a time it is a millisecond after 1970, and as a state
        # a "good" flag (true) would read as state 1, bad under the default goodStates [0].
        raise src.error(0, name, f"expected integers, the column has type {arr.type}")
    if not nullable:
        _first_null(src, arr, name)
    mask = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    values = np.asarray(pc.fill_null(arr, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    out = (values < lo) | (values > hi)
    out &= ~mask
    if out.any():
        i = int(np.argmax(out))
        raise src.error(i, name, f"{values[i]} is out of range [{lo}, {hi}]")
    return values, mask


def _parse_timestamps(src: _Source, name: str, *, nullable: bool) -> tuple[np.ndarray, np.ndarray]:
    """Epoch ms integers or ISO-8601 strings (naive = UTC) -> (int64 epoch ms, null mask)."""
    arr = _combined(src.column(name))
    if pa.types.is_timestamp(arr.type):
        unit_ms = {"s": None, "ms": 1, "us": 1_000, "ns": 1_000_000}[arr.type.unit]
        raw = pc.cast(arr, pa.int64())
        mask = np.asarray(raw.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        v = np.asarray(pc.fill_null(raw, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
        v = v * 1000 if unit_ms is None else v // unit_ms
    elif pa.types.is_date(arr.type):
        raise src.error(0, name, f"a date column ({arr.type}) is not a timestamp; use epoch ms or ISO-8601")
    elif not _is_text(arr):
        return _parse_int(src, name, _I64_MIN, _I64_MAX, nullable=nullable)
    else:
        arr = _trimmed(arr)
        mask = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        is_int = np.asarray(
            pc.fill_null(pc.match_substring_regex(arr, _INT_RE), False).to_numpy(zero_copy_only=False),
            dtype=bool,
        )
        v = np.zeros(len(arr), dtype=np.int64)
        if is_int.any():
            ints = pc.filter(arr, pa.array(is_int))
            ints = pc.utf8_trim_whitespace(ints)
            idx = np.flatnonzero(is_int)
            try:
                v[idx] = np.asarray(pc.cast(ints, pa.int64()).to_numpy(zero_copy_only=False))
            except pa.ArrowInvalid:
                # Too many digits for int64: find it.
                for k, s in zip(idx, ints.to_pylist()):
                    if not (_I64_MIN <= int(s) <= _I64_MAX):
                        raise src.error(int(k), name, f"epoch ms {s.strip()} is out of range") from None
        iso = ~is_int & ~mask
        if iso.any():
            idx = np.flatnonzero(iso)
            strs = pd.Series(pc.filter(arr, pa.array(iso)).to_numpy(zero_copy_only=False), dtype=object)
            parsed = pd.to_datetime(strs, utc=True, format="ISO8601", errors="coerce")
            nat = np.asarray(parsed.isna(), dtype=bool)
            if nat.any():
                k = int(np.argmax(nat))
                raise src.error(
                    int(idx[k]),
                    name,
                    f"unparseable timestamp {quote(strs.iloc[k])} (use epoch ms or ISO-8601, e.g. "
                    "2025-01-01T08:00:00Z)",
                )
            wall = parsed.dt.tz_localize(None).to_numpy()
            v[idx] = wall.astype("datetime64[ms]").astype(np.int64)
    if not nullable and mask.any():
        raise src.error(int(np.argmax(mask)), name, "empty value")
    return v, mask


def _check_plausible(src: _Source, name: str, ms: np.ndarray, null: np.ndarray | None = None) -> None:
    """Refuse a time column a plant cannot have written (before 1990 or more than a year ahead):
    a file in seconds would otherwise be stored as points of 1970, outside every run, where no
    build reads them. The error names the row and the unit the column looks like."""
    rows = np.arange(len(ms)) if null is None else np.flatnonzero(~null)
    found = epoch_ms_column_problem(ms[rows])
    if found is not None:
        k, why = found
        raise src.error(int(rows[k]), name, why)


def _opt_text(src: _Source, name: str) -> list[str | None]:
    if not src.has(name):
        return [None] * len(src)
    arr = _as_strings(src, _combined(src.column(name)), name)
    out = []
    for v in arr.to_pylist():
        v = None if v is None else v.strip()
        out.append(v or None)
    return out


def _required_text(src: _Source, name: str) -> list[str]:
    arr = _as_strings(src, _combined(src.column(name)), name)
    values = arr.to_pylist()
    for i, v in enumerate(values):
        if v is None or not v.strip():
            raise src.error(i, name, f"missing {name}")
        if v != v.strip() or any(ord(c) < 32 for c in v):
            raise src.error(i, name, f"{quote(v)} has surrounding blanks or control characters")
    return values


def _bools(src: _Source, name: str, default: bool) -> list[bool]:
    if not src.has(name):
        return [default] * len(src)
    arr = _combined(src.column(name))
    if pa.types.is_boolean(arr.type):
        return [default if v is None else bool(v) for v in arr.to_pylist()]
    if pa.types.is_integer(arr.type):
        arr = pc.cast(arr, pa.string())
    arr = _as_strings(src, arr, name)
    out = []
    for i, v in enumerate(arr.to_pylist()):
        s = "" if v is None else v.strip().lower()
        if s == "":
            out.append(default)
        elif s in _TRUE:
            out.append(True)
        elif s in _FALSE:
            out.append(False)
        else:
            raise src.error(i, name, f"not a boolean: {quote(v)} (use true/false)")
    return out


# ---- public readers ------------------------------------------------------------------------


def read_points(
    path: PathLike, *, known_runs: Collection[str] | None = None, known_nodes: Collection[str] | None = None
) -> PointColumns:
    """Points file -> :class:`PointColumns` (file row order is kept: it becomes ``seq``).

    ``known_runs`` / ``known_nodes``: the ids the points may name (None: any); the first point
    naming another is an error naming the file, row and id."""
    src = _open(path)
    src.require(POINT_COLUMNS, "points")
    run_id = _parse_ids(src, "run_id")
    node_id = _parse_ids(src, "node_id")
    ts, _ = _parse_timestamps(src, "ts", nullable=False)
    _check_plausible(src, "ts", ts)
    value = _parse_float(src, "value", null_as_nan=True)
    state, _ = _parse_int(src, "state", _I32_MIN, _I32_MAX)
    for column, ids, known, what in (("run_id", run_id, known_runs, "run"), ("node_id", node_id, known_nodes, "node")):
        if known is None:
            continue
        codes, uniques = pd.factorize(ids)
        missing = [j for j, u in enumerate(uniques) if u not in known]
        if missing:
            i = int(np.argmax(np.isin(codes, missing)))
            raise src.error(
                i, column, f"{what} {quote(ids[i])} is neither in the {what}s file(s) of this ingest nor in the database"
            )
    return PointColumns(run_id, node_id, ts, value, state.astype(np.int32))


def read_runs(path: PathLike) -> list[Run]:
    """Runs file -> runs in file order (duplicate run ids and ended_at < started_at refused)."""
    src = _open(path)
    src.require(RUN_REQUIRED, "runs")
    run_ids = _parse_ids(src, "run_id")
    line = _required_text(src, "line_id")
    product = _required_text(src, "product_id")
    recipe = _required_text(src, "recipe_id")
    started, _ = _parse_timestamps(src, "started_at", nullable=False)
    ended, ended_null = _parse_timestamps(src, "ended_at", nullable=True)
    _check_plausible(src, "started_at", started)
    _check_plausible(src, "ended_at", ended, ended_null)
    if src.has("recipe_version"):
        version, version_null = _parse_int(src, "recipe_version", _I32_MIN, _I32_MAX, nullable=True)
    else:
        version, version_null = np.zeros(len(src), np.int64), np.ones(len(src), bool)
    content_hash = _opt_text(src, "recipe_content_hash")
    evidence = _opt_text(src, "evidence_source")
    confirmed = _bools(src, "context_confirmed", False)
    seen: dict[str, int] = {}
    runs: list[Run] = []
    for i in range(len(src)):
        rid = str(run_ids[i])
        if rid in seen:
            raise src.error(
                i, "run_id", f"duplicate run_id {quote(rid)} (first at {src.where(seen[rid]).split(': ')[-1]})"
            )
        seen[rid] = i
        ev = evidence[i] or "unassessed"
        if ev not in EVIDENCE_SOURCES:
            raise src.error(
                i, "evidence_source", f"unknown evidence_source {quote(ev)} (use {', '.join(EVIDENCE_SOURCES)})"
            )
        end = None if ended_null[i] else int(ended[i])
        if end is not None and end < int(started[i]):
            raise src.error(i, "ended_at", f"ended_at {end} is before started_at {int(started[i])}")
        runs.append(
            Run(
                run_id=rid,
                line_id=line[i],
                product_id=product[i],
                recipe_id=recipe[i],
                recipe_version=None if version_null[i] else int(version[i]),
                recipe_content_hash=content_hash[i],
                started_at=int(started[i]),
                ended_at=end,
                evidence_source=ev,
                context_confirmed=confirmed[i],
            )
        )
    return runs


def read_nodes(path: PathLike) -> list[Node]:
    """Nodes file -> node catalog entries in file order."""
    src = _open(path)
    src.require(NODE_REQUIRED, "nodes")
    node_ids = _parse_ids(src, "node_id")
    units = _opt_text(src, "unit")
    ranges = {}
    for name in ("range_lo", "range_hi"):
        if src.has(name):
            arr = _combined(src.column(name))
            nulls = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            vals = _parse_float(src, name, null_as_nan=True)
            # An infinite bound is no bound at all ([inf, inf] would drop every point): refused like NaN.
            bad = ~nulls & ~np.isfinite(vals)
            if bad.any():
                i = int(np.argmax(bad))
                v = "NaN" if np.isnan(vals[i]) else repr(float(vals[i]))
                raise src.error(i, name, f"{v} is not a range bound; leave it empty if unknown")
            ranges[name] = [None if nulls[i] else float(vals[i]) for i in range(len(src))]
        else:
            ranges[name] = [None] * len(src)
    seen: dict[str, int] = {}
    nodes: list[Node] = []
    for i in range(len(src)):
        nid = str(node_ids[i])
        if nid in seen:
            raise src.error(i, "node_id", f"duplicate node_id {quote(nid)}")
        seen[nid] = i
        lo, hi = ranges["range_lo"][i], ranges["range_hi"][i]
        if lo is not None and hi is not None and lo > hi:
            raise src.error(i, "range_hi", f"range_hi {hi} is below range_lo {lo}")
        nodes.append(Node(nid, units[i] or "", lo, hi))
    return nodes


# ---- ingest ----------------------------------------------------------------------------------


def _paths(arg: PathLike | Sequence[PathLike] | None) -> list[Path]:
    if arg is None:
        return []
    if isinstance(arg, (str, os.PathLike)):
        return [Path(arg)]
    return [Path(p) for p in arg]


def ingest_files(
    tsdb: TsdbPort,
    *,
    points: PathLike | Sequence[PathLike] | None = None,
    runs: PathLike | Sequence[PathLike] | None = None,
    nodes: PathLike | Sequence[PathLike] | None = None,
    progress: Progress | None = None,
    replace_runs: bool = False,
) -> dict[str, int]:
    """Read, validate and ingest files in one all-or-nothing ``tsdb.ingest`` call.

    Each of ``points``/``runs``/``nodes`` is a path or a list of paths (points files keep their
    order: seq follows it). Points must reference runs and nodes that are in these files or
    already in the database; the error names the points file, row and id otherwise.
    ``replace_runs``: the stored points of every run named in the points files are replaced by
    the files' points (same transaction). ``progress(n_done, n_total)`` is called after each
    file and after the database write (``n_total`` = number of files + 1). Returns counts:
    ``runs`` and ``nodes`` read, ``points`` written, ``skipped`` (points already stored).
    """
    point_paths, run_paths, node_paths = _paths(points), _paths(runs), _paths(nodes)
    total = len(point_paths) + len(run_paths) + len(node_paths) + 1
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    all_nodes: list[Node] = []
    node_seen: dict[str, Path] = {}
    for p in node_paths:
        for n in read_nodes(p):
            if n.node_id in node_seen:
                raise IngestError(f"{p}: node_id {quote(n.node_id)} is also in {node_seen[n.node_id]}")
            node_seen[n.node_id] = p
            all_nodes.append(n)
        tick()
    all_runs: list[Run] = []
    run_seen: dict[str, Path] = {}
    for p in run_paths:
        for r in read_runs(p):
            if r.run_id in run_seen:
                raise IngestError(f"{p}: run_id {quote(r.run_id)} is also in {run_seen[r.run_id]}")
            run_seen[r.run_id] = p
            all_runs.append(r)
        tick()

    chunks: list[PointColumns] = []
    if point_paths:
        known_runs = set(run_seen) | {r.run_id for r in tsdb.list_runs(None, finished_only=False)}
        known_nodes = set(node_seen) | {n.node_id for n in tsdb.list_nodes()}
        for p in point_paths:
            chunks.append(read_points(p, known_runs=known_runs, known_nodes=known_nodes))
            tick()
    merged = _concat(chunks) if chunks else None
    crash_point("ingest.files_read")
    written = tsdb.ingest(runs=all_runs, nodes=all_nodes, points=merged, replace_runs=replace_runs)
    tick()
    read = len(merged) if merged is not None else 0
    return {"runs": len(all_runs), "nodes": len(all_nodes), "points": int(written), "skipped": read - int(written)}


def ingest_into(
    url: str,
    *,
    points: PathLike | Sequence[PathLike] | None = None,
    runs: PathLike | Sequence[PathLike] | None = None,
    nodes: PathLike | Sequence[PathLike] | None = None,
    progress: Progress | None = None,
    replace_runs: bool = False,
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
    opener: Callable[..., TsdbPort] | None = None,
) -> dict[str, Any]:
    """Open the TSDB at ``url`` for writing, :func:`ingest_files`, close; the counts and the
    printable ``tsdb`` URL. An ingest that fails into an embedded TSDB file that did not exist
    before leaves no file behind (the database, its WAL, its lock file). ``opener`` opens ``url``
    (default :func:`~aml_pipeline.tsdb.open_adapter`; the CLI passes
    :func:`aml_pipeline.tsdb_open.open_tsdb`, so that a source description is refused as such)."""
    if opener is None:
        from aml_pipeline.tsdb import open_adapter as opener

    if not (points or runs or nodes):
        raise IngestError("nothing to ingest: give a points, runs or nodes file")
    db = opener(url, read_only=False, lock_timeout_s=lock_timeout_s)
    try:
        counts = ingest_files(db, points=points, runs=runs, nodes=nodes, progress=progress, replace_runs=replace_runs)
    except BaseException:
        getattr(db, "discard", db.close)()
        raise
    db.close()
    return {"tsdb": db.url, **counts}


def _concat(chunks: list[PointColumns]) -> PointColumns:
    if len(chunks) == 1:
        return chunks[0]
    return PointColumns(
        np.concatenate([c.run_id for c in chunks]),
        np.concatenate([c.node_id for c in chunks]),
        np.concatenate([c.ts for c in chunks]),
        np.concatenate([c.value for c in chunks]),
        np.concatenate([c.state for c in chunks]),
    )
