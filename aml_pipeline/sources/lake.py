"""Parquet or CSV files read in place through DuckDB: a glob, hive-style partition folders.

Files
    ``points.files`` is a glob relative to the description's folder (``lake/points/**/*.parquet``);
    the format follows the extension unless ``format`` says. Folders named ``key=value``
    (``date=2026-01-05/``) are columns of every row in them (hive partitioning); with
    ``points.partition`` naming one, every query names only the folders its time range overlaps,
    so DuckDB opens no other file. Nothing is copied or written: DuckDB runs in memory, with the
    memory limit the embedded TSDB's readers get.

Order
    Points of one millisecond keep their file order: ties are ordered by the file's name, then
    the row's position in it (Parquet's ``file_row_number``; for CSV, the row's position in the
    file's scan), after the mapping's ``order`` columns if any.
"""

from __future__ import annotations

import glob as _glob
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import duckdb
import numpy as np

from aml_pipeline.errors import SourceError, TsdbError, TsdbUnavailableError
from aml_pipeline.sources.backend import (Backend, NodeRef, Series, TableRead, Window, joined_in_order,
                                          source_order, split_by_node)
from aml_pipeline.sources.description import LoadedDescription, Quality
from aml_pipeline.sources.sqlbuild import Q, check_columns, join, quote_ident, state_expr, val, where_equal
from aml_pipeline.sources.timecodec import TimeCodec, resolve_codec, type_class

_TIE = ("aml_file", "aml_row")  # the file order columns the relation adds


def file_problem(e: duckdb.Error, fmt: str) -> tuple[str, str]:
    """``(code, text)`` for a DuckDB error about the lake's files, in the description's terms:
    without the SQL DuckDB quotes after it and without its advice, which names DuckDB's own
    options (``types=``, ``sample_size=``) and not the description's keys."""
    text = str(e).split("\nLINE ")[0]
    csv = re.match(r".*?CSV Error on Line: (\d+)\s*\nOriginal Line: (.*?)\n(.*?)(?:\n\n|$)", text, re.S)
    if csv is not None:
        line, original, problem = csv.groups()
        file = re.search(r"^\s*file = (.+)$", text, re.M)
        where = f"{file.group(1).strip()}: line {line}" if file else f"line {line}"
        return "SOURCE_INVALID", f"{where}: {' '.join(problem.split())} (the line: {original.strip()[:200]})"
    sniff = re.search(r'Error when sniffing file "([^"]+)"', text)
    if sniff is not None:
        return "SOURCE_INVALID", (f"{sniff.group(1)}: not readable as CSV: a row has another number of fields than "
                                  "the header, or the separator is not , ; | or a tab")
    text = " ".join(re.split(r"\nPossible (?:solutions|fixes):", text)[0].split())
    name = re.search(r"file '([^']+)'|File '([^']+)' too small", text)
    if fmt == "parquet" and ("magic bytes" in text or "too small to be a Parquet file" in text):
        file = next(g for g in name.groups() if g) if name else "a file"
        return "SOURCE_INVALID", f"{file} is not a Parquet file; if the files hold CSV, set format: csv"
    return "", text


def _one_column_csv(types: dict[str, str], fmt: str, key: str, glob: str, where: str) -> None:
    """A CSV whose rows do not have the header's number of fields is read by DuckDB's detection as
    one column named by the whole header line, or as headerless columns ``column0``, ``column1``
    ...: say so, not that the mapping's columns are missing."""
    if fmt != "csv":
        return
    names = list(types)
    one = len(names) == 1 and re.search(r"[,;\t|]", names[0])
    headerless = all(re.fullmatch(r"column\d+", n) for n in names)
    if one or headerless:
        read = f"as one column {names[0]!r}" if one else f"without a header ({', '.join(names[:3])}, ...)"
        raise SourceError(f"{where}: {key}: the files {glob} read {read}: a row has another number of fields "
                          "than the header, the first line is not a header, or the separator is not , ; | or a tab",
                          code="SOURCE_INVALID")


class _ReadAhead(NamedTuple):
    """What one run's read of the lake decoded past the run's end, kept for the next run: of
    each file in ``files`` (as of its version there), every row later than ``after`` (raw time)
    that passes the filters of ``key``, split by node as :func:`split_by_node` splits them."""

    key: tuple[Any, ...]  # node keys, line
    after: Any
    files: dict[str, tuple[int, int]]  # file -> its version (size, mtime ns)
    by_node: list[list[np.ndarray]]


def _stamp(path: str) -> tuple[int, int] | None:
    """A file's version as (size, mtime in ns); None if it is gone."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


class _FileFacts(NamedTuple):
    """What a Parquet file's footer says, as of one version of the file."""

    stamp: tuple[int, int]  # size, mtime (ns)
    span: tuple[Any, Any] | None  # raw time range; None: no statistics
    rows: int | None


def _format_of(pattern: str, declared: str | None, key: str, where: str) -> str:
    if declared:
        return declared
    low = pattern.lower()
    if low.endswith((".parquet", ".parq", ".pq")):
        return "parquet"
    if low.endswith((".csv", ".csv.gz", ".tsv")):
        return "csv"
    raise SourceError(f"{where}: {key}.format: cannot tell the format of {pattern!r} from its extension; "
                      "say format: parquet or format: csv")


def _connect() -> duckdb.DuckDBPyConnection:
    from aml_pipeline.tsdb.duckdb import reader_memory_limit_mb

    # No temp directory: a query that does not fit fails instead of spilling next to the lake.
    return duckdb.connect(":memory:", config={"memory_limit": f"{reader_memory_limit_mb()}MiB", "temp_directory": ""})


class _Files:
    """One glob of Parquet or CSV files as a relation (the table function and its values)."""

    def __init__(self, loaded: LoadedDescription, pattern: str, fmt: str | None, key: str) -> None:
        self.key = key
        self.hive = True  # read key=value folders as columns (LakeSource turns it off when unused)
        self.where = str(loaded.path)
        path = Path(pattern).expanduser()
        self.glob = str(path if path.is_absolute() else loaded.base_dir / path)
        self.format = _format_of(pattern, fmt, key, self.where)

    def files(self) -> list[str]:
        return sorted(_glob.glob(self.glob, recursive=True))

    def relation(self, files: Sequence[str] | None = None, filters: Sequence[Q] = (), *, tie: bool = False) -> Q:
        """FROM clause text: ``files`` (default: the glob), with the tie columns when ``tie``:
        the file's place in ``files`` (sorted by name) and the row's place in the file."""
        what = val(self.glob if files is None else list(files))
        if self.format == "parquet":
            src = Q("read_parquet(") + what + f", hive_partitioning = {str(self.hive).lower()}, hive_types_autocast = false)"
            if not tie:
                return src
            inner = Q("SELECT *, file_index AS aml_file, file_row_number AS aml_row FROM ") + src
        else:
            src = Q("read_csv(") + what + f", hive_partitioning = {str(self.hive).lower()}, hive_types_autocast = false, parallel = false)"
            if not tie:
                return src
            # A CSV scan keeps file order (one thread): the row number within the scan is the
            # file order of the rows that pass the filters, all a tie needs.
            inner = Q("SELECT *, file_index AS aml_file, row_number() OVER () AS aml_row FROM ") + src
        if filters:
            inner = inner + " WHERE " + join(filters, " AND ")
        return Q("(") + inner + ")"


class LakeSource(Backend):
    """The files backend of :class:`~aml_pipeline.sources.mapped.MappedTsdb`."""

    def __init__(self, loaded: LoadedDescription) -> None:
        self.loaded = loaded
        self.spec = loaded.spec
        p = self.spec.points
        self._lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = _connect()
        self._listed: dict[str, str | None] | None = None  # file -> its partition folder value
        self._facts: dict[str, _FileFacts] = {}  # Parquet file -> what its footer says
        self._ahead: _ReadAhead | None = None
        self.layout = p.effective_layout
        try:
            if p.query is not None:
                raise SourceError(f"{loaded.path}: points.query: the files backend reads points from points.files")
            self._files = _Files(loaded, p.files, p.format, "points")
            self.label = self._files.glob
            if not self._files.files():
                raise SourceError(f"{loaded.path}: points.files: no file matches {self._files.glob!r}", code="SOURCE_NOT_FOUND")
            self._types = self._describe(self._files.relation(), "points.files")
            needed = [("points.time", p.time)]
            if self.layout == "narrow":
                needed += [("points.node", p.node), ("points.value", p.value)]
            q = p.quality_spec()
            if q is not None:
                needed.append(("points.quality", q.column))
            needed += [("points.order", c) for c in p.order]
            needed += [("points.where", c) for c in p.where]
            if p.line:
                needed.append(("points.line", p.line))
            if p.modified:
                needed.append(("points.modified", p.modified))
            for node_id, col in p.wide_columns().items():
                needed.append((f"points.columns.{node_id}", col.column))
                cq = col.quality_spec()
                if cq is not None:
                    needed.append((f"points.columns.{node_id}.quality", cq.column))
            check_columns(self._types, needed, f"the files {self._files.glob}", str(loaded.path))
            # Folder keys become columns only if the mapping uses one (it costs a little per file).
            self._files.hive = False
            in_files = self._describe(self._files.relation(), "points.files")
            self._files.hive = any(c not in in_files for _, c in needed)
            codec, why = resolve_codec(p.time_type, p.time_zone, self._types[p.time], p.time)
            if codec is None:
                raise SourceError(f"{loaded.path}: points.time_type: {why}")
            self.codec: TimeCodec = codec
            self._t = quote_ident(p.time)
            if p.partition is not None and not any(v is not None for v in self._refresh_values().values()):
                raise SourceError(f"{loaded.path}: points.partition.column: no file is in a folder named "
                                  f"{p.partition.column}=... under {self._files.glob!r}", code="SOURCE_NOT_FOUND")
        except BaseException:
            self.close()
            raise

    # ---- plumbing ----------------------------------------------------------------------------
    @property
    def _c(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            raise TsdbError(f"{self.label}: this source handle is closed")
        return self._con

    def close(self) -> None:
        self._ahead = None
        con, self._con = self._con, None
        if con is not None:
            con.close()

    def _run(self, q: Q, what: str) -> dict[str, np.ndarray]:
        text, params = q.render("qmark")
        with self._lock:
            try:
                return self._c.execute(text, params).fetchnumpy()
            except duckdb.IOException as e:
                # A file listed by the glob went away (a lake being rewritten): try again later.
                raise TsdbUnavailableError(f"{self.label}: {what}: {' '.join(str(e).split())}") from None
            except duckdb.Error as e:
                code, text = file_problem(e, self._files.format)
                raise SourceError(f"{self.loaded.path}: {what}: {text}", code=code or "SOURCE_QUERY") from None

    def _describe(self, rel: Q, key: str) -> dict[str, str]:
        text, params = (Q("DESCRIBE SELECT * FROM ") + rel).render("qmark")
        with self._lock:
            try:
                rows = self._c.execute(text, params).fetchall()
            except duckdb.Error as e:
                code, text = file_problem(e, self._files.format)
                raise SourceError(f"{self.loaded.path}: {key}: {text}", code=code or "SOURCE_NOT_FOUND") from None
        types = {r[0]: r[1] for r in rows}
        _one_column_csv(types, self._files.format, key, self._files.glob, str(self.loaded.path))
        return types

    # ---- expressions -------------------------------------------------------------------------
    def _raw_time(self, expr: str) -> str:
        if self.codec.is_timestamp:
            return f"epoch_us({expr})"
        return f"CAST({expr} AS DOUBLE)" if self.codec.is_float else f"CAST({expr} AS BIGINT)"

    def _bound(self, raw: Any) -> Q:
        v = self.codec.bind(raw)
        if self.codec.kind == "timestamptz":
            return val(v) + "::TIMESTAMPTZ"
        if self.codec.kind == "timestamp":
            return val(v) + "::TIMESTAMP"
        return val(v)

    def _value(self, column: str) -> str:
        return f"coalesce(CAST({quote_ident(column)} AS DOUBLE), 'NaN'::DOUBLE)"

    def _state(self, quality: Quality | None) -> Q:
        if quality is None:
            return Q("0")
        textual = type_class(self._types.get(quality.column, "")) == "other"
        return state_expr(quality, quote_ident(quality.column), textual)

    def _base_filters(self, lo: int, hi: int, line: str | None) -> list[Q]:
        return self._filters(*self.codec.bounds(lo, hi), line)

    def _filters(self, a: Any, b: Any, line: str | None) -> list[Q]:
        """The rows with raw time in ``[a, b]`` of ``line``, and the mapping's ``where``."""
        p = self.spec.points
        conds = [Q(f"{self._t} BETWEEN ") + self._bound(a) + " AND " + self._bound(b)]
        if p.line and line is not None:
            conds.append(Q(f"{quote_ident(p.line)} = ") + val(line))
        return conds + where_equal(p.where)

    # ---- which files -------------------------------------------------------------------------
    def _refresh_values(self) -> dict[str, str | None]:
        self._refresh()
        return self._listed

    def _refresh(self) -> list[str]:
        """List the files again (the catalog calls that begin a build do: files added later are
        read by the next build). Each file's partition value is read from its path, and the time
        range of a Parquet file from its footer, once per version of the file."""
        part = self.spec.points.partition
        listed = self._files.files()
        values: dict[str, str | None] = {}
        for f in listed:
            values[f] = None
            if part is not None:
                for piece in Path(f).parts:
                    if piece.startswith(f"{part.column}="):
                        values[f] = piece[len(part.column) + 1:]
        self._listed = values
        if self._files.format == "parquet":
            self._read_footers(listed)
        return listed

    def _read_footers(self, files: list[str]) -> None:
        """The raw time range and the row count of each file from its Parquet footer (DuckDB's
        ``parquet_metadata``), for files not seen or changed since (path, size, mtime)."""
        stamps = {f: stamp for f in files if (stamp := _stamp(f)) is not None}
        todo = [f for f, stamp in stamps.items() if (seen := self._facts.get(f)) is None or seen.stamp != stamp]
        if not todo:
            return
        duck_type = self._types[self.spec.points.time]
        q = (Q(f"SELECT file_name AS f, min({self._raw_time(f'CAST(stats_min_value AS {duck_type})')}) AS a, "
               f"max({self._raw_time(f'CAST(stats_max_value AS {duck_type})')}) AS b, "
               "count(*) FILTER (WHERE stats_min_value IS NULL OR stats_max_value IS NULL) AS unknown, "
               "sum(row_group_num_rows) AS n "
               "FROM parquet_metadata(") + val(todo) + ") WHERE path_in_schema = " + val(self.spec.points.time)
             + " GROUP BY file_name")
        try:
            cols = self._run(q, "points.files: reading the files' time ranges")
        except SourceError:
            return  # no statistics to use: every file is read
        for f, a, b, unknown, n in zip(*(cols[k].tolist() for k in ("f", "a", "b", "unknown", "n"))):
            if f in stamps:
                span = None if unknown or a is None or b is None else (a, b)
                self._facts[f] = _FileFacts(stamps[f], span, None if n is None else int(n))

    def _rows_at_most(self, files: Sequence[str]) -> int | None:
        """How many rows ``files`` hold at most, from their footers; None if one is unknown."""
        rows = [seen.rows if (seen := self._facts.get(f)) is not None else None for f in files]
        return None if any(n is None for n in rows) else sum(rows)

    def _files_for(self, lo: int, hi: int) -> list[str]:
        """The files that can hold points in [lo, hi] (ms): with ``partition``, those in the
        folders the range overlaps (and any file outside such folders); of Parquet files, those
        whose time statistics overlap it (or have none)."""
        if self._listed is None:
            self._refresh()
        files = list(self._listed)
        part = self.spec.points.partition
        if part is not None:
            import pandas as pd

            bounds = []
            for ms in (lo, hi):
                try:
                    t = pd.Timestamp(min(max(ms, -(2**62)), 2**62), unit="ms", tz="UTC").tz_convert(part.zone)
                except (OverflowError, ValueError, pd.errors.OutOfBoundsDatetime):
                    bounds = []  # the whole time axis: every folder
                    break
                bounds.append(t.strftime(part.value_format))
            if bounds:
                files = [f for f in files if self._listed[f] is None or bounds[0] <= self._listed[f] <= bounds[1]]
        if self._facts:
            a, b = self.codec.bounds(lo, hi)  # raw values, as the spans
            files = [f for f in files if (seen := self._facts.get(f)) is None or seen.span is None
                     or (seen.span[1] >= a and seen.span[0] <= b)]
        return files

    def _node_in(self, nodes: Sequence[NodeRef]) -> Q:
        """``node`` is one of ``nodes`` (a list membership test: cheaper in DuckDB than IN (...))."""
        return Q("list_contains(") + val([n.key for n in nodes]) + f", {quote_ident(self.spec.points.node)})"

    def _order(self) -> str:
        return ", ".join(quote_ident(c) for c in (self.spec.points.time, *self.spec.points.order, *_TIE))

    def _tie_keys(self) -> list[str] | None:
        """The order columns as numbers (for numpy), or None when one is not a number or a time.
        File order needs no column: a scan returns the rows of the files in their order (list
        order, then row order; DuckDB keeps insertion order), and numpy's sorts are stable."""
        keys = []
        for c in self.spec.points.order:
            cls, col = type_class(self._types[c]), quote_ident(c)
            if cls in ("tz", "naive"):
                keys.append(f"coalesce(epoch_us({col}), 9223372036854775807)")
            elif cls == "int":
                keys.append(f"coalesce(CAST({col} AS BIGINT), 9223372036854775807)")
            elif cls in ("float", "numeric"):
                keys.append(f"coalesce(CAST({col} AS DOUBLE), 'NaN'::DOUBLE)")
            else:
                return None
        return keys

    # ---- points ------------------------------------------------------------------------------
    def fetch(self, node: NodeRef, lo: int, hi: int, line: str | None, limit: int) -> Series:
        p = self.spec.points
        files = self._files_for(lo, hi)
        if not files:
            return Series.empty()
        conds = self._base_filters(lo, hi, line)
        if self.layout == "narrow":
            conds.insert(0, Q(f"{quote_ident(p.node)} = ") + val(node.key))
            value_col, quality = p.value, p.quality_spec()
        else:
            conds.append(Q(f"{quote_ident(node.column)} IS NOT NULL"))
            value_col, quality = node.column, node.quality
        q = (Q(f"SELECT {self._raw_time(self._t)} AS t, {self._value(value_col)} AS v, ") + self._state(quality)
             + " AS s FROM " + self._files.relation(files, conds, tie=True)
             + f" ORDER BY {self._order()}, 2, 3 LIMIT " + val(int(limit)))
        cols = self._run(q, f"reading node {node.node_id!r}")
        return Series(self.codec.to_ms(cols["t"]), np.asarray(cols["v"], np.float64), np.asarray(cols["s"], np.int32))

    def fetch_many(self, nodes: Sequence[NodeRef], lo: int, hi: int, line: str | None, limit: int,
                   hold: int = 0) -> list[Series] | None:
        """One scan of the files the run's range overlaps, without ORDER BY; numpy orders each
        node's points as :meth:`fetch` does (time, order columns, file, row, value, state)."""
        p = self.spec.points
        ties = self._tie_keys()
        if ties is None:
            return None
        files = self._files_for(lo, hi)
        if not files:
            return [Series.empty() for _ in nodes]
        select = [f"{self._raw_time(self._t)} AS t"] + [f"{k} AS o{i}" for i, k in enumerate(ties)]
        if self.layout == "narrow":
            if self._files.format == "parquet":
                parts = self._narrow_reading_ahead(nodes, files, lo, hi, line, select, len(ties), limit, hold)
            else:
                parts = self._by_node(self._narrow_rows(nodes, files, self._base_filters(lo, hi, line), select, limit),
                                      len(nodes), len(ties))
            return [Series(self.codec.to_ms(p[0]), p[-2], p[-1]) for p in parts]
        conds = self._base_filters(lo, hi, line)
        conds.append(Q("(") + join([Q(f"{quote_ident(n.column)} IS NOT NULL") for n in nodes], " OR ") + ")")
        per_node = [Q(f"{self._value(n.column)} AS v{k}, {quote_ident(n.column)} IS NOT NULL AS p{k}, ")
                    + self._state(n.quality) + f" AS s{k}" for k, n in enumerate(nodes)]
        q = (Q(f"SELECT {', '.join(select)}, ") + join(per_node, ", ") + " FROM "
             + self._files.relation(files) + " WHERE " + join(conds, " AND ") + " LIMIT " + val(int(limit)))
        cols = self._run(q, f"reading {len(nodes)} nodes")
        t = np.asarray(cols["t"])
        others = [np.asarray(cols[f"o{i}"]) for i in range(len(ties))]
        out = []
        for k in range(len(nodes)):
            has = np.asarray(cols[f"p{k}"], bool)
            v, s = np.asarray(cols[f"v{k}"], np.float64)[has], np.asarray(cols[f"s{k}"], np.int32)[has]
            order = source_order(np.zeros(v.shape[0], np.int64), [t[has], *(o[has] for o in others)])
            out.append(Series(self.codec.to_ms(t[has][order]), v[order], s[order]))
        return out

    def _narrow_rows(self, nodes: Sequence[NodeRef], files: Sequence[str], conds: list[Q], select: list[str],
                     limit: int) -> dict[str, np.ndarray]:
        """The rows of ``nodes`` in ``files`` that pass ``conds``, in file order, each row's node
        as its place in ``nodes`` (``k``, 1-based)."""
        p = self.spec.points
        # Each row's node is one lookup (NULL: not one of `nodes`), as a small integer.
        inner = (Q("SELECT CAST(list_position(") + val([n.key for n in nodes]) + f", {quote_ident(p.node)}) AS INTEGER) AS k, "
                 + f"{', '.join(select)}, {self._value(p.value)} AS v, " + self._state(p.quality_spec())
                 + " AS s FROM " + self._files.relation(files) + " WHERE " + join(conds, " AND "))
        rows = self._rows_at_most(files)
        if rows is not None and rows <= limit:
            # The files hold at most `limit` rows (their footers say): no LIMIT, and the rows of
            # other nodes are dropped here, which costs less than DuckDB's filter on the lookup.
            cols = self._arrow(inner, f"reading {len(nodes)} nodes")
            k = cols["k"]
            if not bool(np.all(k > 0)):
                keep = k > 0
                cols = {name: c[keep] for name, c in cols.items()}
            return cols
        # A LIMIT slows DuckDB's scan down: it is added only where the footers cannot tell that
        # the files hold at most `limit` rows, and then counts the nodes' rows alone.
        q = Q("SELECT * FROM (") + inner + ") WHERE k IS NOT NULL LIMIT " + val(int(limit))
        return self._arrow(q, f"reading {len(nodes)} nodes")

    def _arrow(self, q: Q, what: str) -> dict[str, np.ndarray]:
        """The result of ``q`` as numpy columns through Arrow (no copy of a column without NULLs;
        a NULL integer reads as 0)."""
        import pyarrow.compute as pc

        text, params = q.render("qmark")
        with self._lock:
            try:
                table = self._c.sql(text, params=params).to_arrow_table()
            except duckdb.IOException as e:
                raise TsdbUnavailableError(f"{self.label}: {what}: {' '.join(str(e).split())}") from None
            except duckdb.Error as e:
                raise SourceError(f"{self.loaded.path}: {what}: {' '.join(str(e).split())}", code="SOURCE_QUERY") from None
        out = {}
        for name in table.column_names:
            col = table.column(name)
            if col.null_count:
                col = pc.fill_null(col, 0)
            out[name] = col.to_numpy()
        return out

    @staticmethod
    def _by_node(cols: dict[str, np.ndarray], n_nodes: int, n_ties: int) -> list[list[np.ndarray]]:
        """Rows of :meth:`_narrow_rows` as each node's [t, order columns..., v, s], in order."""
        node = cols["k"].astype(np.int64) - 1
        t, v, s = cols["t"], np.asarray(cols["v"], np.float64), np.asarray(cols["s"], np.int32)
        return split_by_node(node, n_nodes, [t, *(cols[f"o{i}"] for i in range(n_ties))], [v, s])

    def _narrow_reading_ahead(self, nodes: Sequence[NodeRef], files: Sequence[str], lo: int, hi: int, line: str | None,
                              select: list[str], n_ties: int, limit: int, hold: int) -> list[list[np.ndarray]]:
        """:meth:`_by_node` of the run ``[lo, hi]``'s rows, each file decoded once for runs read
        in time order.

        A lake's files seldom end where runs do: a daily file holds a dozen runs, and decoding a
        Parquet file costs about the same whatever part of it a query keeps. So the files are
        read to the end of their time ranges (their footers') and each node's rows past the run
        are kept for the next run, which then reads only the files it does not hold. The points
        are exactly those of reading the run's files alone, in the same order: what is held is
        used only for the same nodes and line, for a run that starts after it, of files that are
        still the same version (size, mtime) and come before the other files the run reads; and
        a held file the run does not read must hold no time of the run. At most ``hold`` rows
        are held: files are read past the run only while the footers' counts of their rows and
        the rows already held stay within it."""
        a, b = self.codec.bounds(lo, hi)
        key = (tuple(n.key for n in nodes), line)
        with self._lock:
            ahead, self._ahead = self._ahead, None
        if ahead is not None and not self._serves(ahead, key, files, a, b):
            ahead = None
        held = {} if ahead is None else ahead.files
        rest = [f for f in files if f not in held]
        stamps = {f: _stamp(f) for f in rest}
        facts = [self._facts.get(f) for f in rest]
        rows = self._rows_at_most(rest)
        held_rows = 0 if ahead is None else sum(int(cols[0].shape[0]) for cols in ahead.by_node)
        whole = bool(rest) and rows is not None and held_rows + rows <= hold and all(
            x is not None and x.span is not None and x.stamp == stamps[f] for f, x in zip(rest, facts))
        end = max([b, *(x.span[1] for x in facts)]) if whole else b
        fresh = (self._by_node(self._narrow_rows(nodes, rest, self._filters(a, end, line), select, hold if whole else limit),
                               len(nodes), n_ties) if rest else None)
        now, later = [], []
        for j in range(len(nodes)):
            pieces, past = [], []
            if ahead is not None:
                cols = ahead.by_node[j]
                i0, i1 = int(np.searchsorted(cols[0], a, "left")), int(np.searchsorted(cols[0], b, "right"))
                pieces.append([c[i0:i1] for c in cols])
                past.append([c[i1:] for c in cols])
            if fresh is not None:
                cols = fresh[j]
                if whole:
                    i1 = int(np.searchsorted(cols[0], b, "right"))
                    pieces.append([c[:i1] for c in cols])
                    past.append([c[i1:] for c in cols])
                else:
                    pieces.append(cols)
            now.append(joined_in_order(pieces, 1 + n_ties))
            later.append(joined_in_order(past, 1 + n_ties) if past else [])
        kept = {f: stamp for f, stamp in held.items() if self._may_hold_after(f, b)}
        if whole:
            kept.update((f, stamps[f]) for f in rest if self._may_hold_after(f, b))
        if kept:
            with self._lock:
                self._ahead = _ReadAhead(key, b, kept, later)
        return now

    def _may_hold_after(self, f: str, b: Any) -> bool:
        x = self._facts.get(f)
        return x is None or x.span is None or x.span[1] > b

    def _serves(self, ahead: _ReadAhead, key: tuple[Any, ...], files: Sequence[str], a: Any, b: Any) -> bool:
        """Whether the rows ``ahead`` holds serve the run ``[a, b]`` that reads ``files`` (see
        :meth:`_narrow_reading_ahead`)."""
        if ahead.key != key or not a > ahead.after:
            return False
        place = {f: i for i, f in enumerate(files)}
        last_held = -1
        for f, stamp in ahead.files.items():
            if f in place:
                if _stamp(f) != stamp:
                    return False
                last_held = max(last_held, place[f])
            else:
                x = self._facts.get(f)
                if x is None or x.stamp != stamp or x.span is None or not (x.span[1] < a or x.span[0] > b):
                    return False
        return all(place[f] > last_held for f in files if f not in ahead.files)

    def distinct_keys(self) -> list[Any]:
        p = self.spec.points
        rel = self._files.relation(self._refresh())
        conds = where_equal(p.where)
        q = Q(f"SELECT DISTINCT {quote_ident(p.node)} AS k FROM ") + rel
        if conds:
            q = q + " WHERE " + join(conds, " AND ")
        cols = self._run(q + " ORDER BY 1", "points: listing the nodes")
        return [x for x in cols["k"].tolist() if x is not None]

    def max_time(self, nodes: Sequence[NodeRef]) -> int | None:
        p = self.spec.points
        if self.layout == "narrow":
            node_cond = self._node_in(nodes)
        else:
            node_cond = Q("(") + join([Q(f"{quote_ident(n.column)} IS NOT NULL") for n in nodes], " OR ") + ")"
        conds = [node_cond, *where_equal(p.where)]
        self._refresh()
        # With partition folders, the newest folder that holds any of the nodes answers (files
        # outside such folders are read with each).
        folders = sorted({v for v in self._listed.values() if v is not None}, reverse=True)
        rest = [f for f, v in self._listed.items() if v is None]
        for folder in folders or [None]:
            files = [f for f, v in self._listed.items() if folder is not None and v == folder] + rest
            q = (Q(f"SELECT max({self._raw_time(self._t)}) AS m FROM ") + self._files.relation(files)
                 + " WHERE " + join(conds, " AND "))
            m = self._run(q, "points: the latest point")["m"]
            if m.shape[0] and not np.ma.is_masked(m[0]) and m[0] is not None:
                return int(self.codec.to_ms(np.asarray([m[0]]))[0])
        return None

    def aggregates(self, windows: Sequence[Window], nodes: Sequence[NodeRef]) -> list[Any]:
        p = self.spec.points
        lo_all, hi_all = min(w.lo for w in windows), max(w.hi for w in windows)
        self._refresh()
        files = self._files_for(lo_all, hi_all)
        if not files:
            return [[0, None, None, None] for _ in windows]
        bounds = [self.codec.bounds(w.lo, w.hi) for w in windows]
        conds = self._base_filters(lo_all, hi_all, None)
        if self.layout == "narrow":
            conds.insert(0, self._node_in(nodes))
            q = p.quality_spec()
            cells = [self._t, quote_ident(p.value)] + ([quote_ident(q.column)] if q is not None else [])
        else:
            cells = [self._t] + [quote_ident(n.column) for n in nodes]
            cells += [quote_ident(n.quality.column) for n in nodes if n.quality is not None]
        check = f"max(pt.{quote_ident(p.modified)})" if p.modified else "sum(pt.h)"
        extra = f", {quote_ident(p.modified)}" if p.modified else ""
        points = (Q(f"(SELECT {self._t} AS t{extra}, hash({', '.join(cells)}) AS h"
                    + (f", {quote_ident(p.line)} AS line" if p.line else "") + " FROM ")
                  + self._files.relation(files) + " WHERE " + join(conds, " AND ") + ") AS pt")
        tt = {"timestamptz": "TIMESTAMPTZ", "timestamp": "TIMESTAMP"}.get(self.codec.kind, "DOUBLE" if self.codec.is_float else "BIGINT")
        w = (Q("(SELECT unnest(") + val(list(range(len(windows)))) + ") AS i, unnest(CAST("
             + val([self.codec.bind(a) for a, _ in bounds]) + f" AS {tt}[])) AS lo, unnest(CAST("
             + val([self.codec.bind(b) for _, b in bounds]) + f" AS {tt}[])) AS hi, unnest(CAST("
             + val([wi.line for wi in windows]) + " AS VARCHAR[])) AS line) AS w")
        join_cond = "pt.t BETWEEN w.lo AND w.hi" + (" AND pt.line = w.line" if p.line else "")
        q = (Q(f"SELECT w.i AS i, count(pt.t) AS n, {self._raw_time('min(pt.t)')} AS a, {self._raw_time('max(pt.t)')} AS b, "
               f"CAST({check} AS VARCHAR) AS c FROM ") + w + " LEFT JOIN " + points + f" ON {join_cond} GROUP BY w.i ORDER BY w.i")
        cols = self._run(q, f"reading the versions of {len(windows)} runs")
        out = []
        for k in range(len(windows)):
            out.append([int(cols["n"][k]), _plain(cols["a"][k]), _plain(cols["b"][k]), _plain(cols["c"][k])])
        return out

    # ---- runs and node tables ----------------------------------------------------------------
    def read_table(self, read: TableRead) -> dict[str, list[Any]]:
        return read_file_table(self.loaded, read, self)

    def describe(self) -> dict[str, Any]:
        p = self.spec.points
        return {
            "backend": "files",
            "files": self._files.glob,
            "format": self._files.format,
            "file_count": len(self._refresh()),
            "layout": self.layout,
            "time": {"column": p.time, "type": self.codec.describe(), "kind": self.codec.kind, "zone": self.codec.zone},
            "order": "time, " + ", ".join([*p.order, "file name", "row in file", "value", "state"]),
        }


def _plain(v: Any) -> Any:
    if v is None or np.ma.is_masked(v):
        return None
    return v.item() if hasattr(v, "item") else v


def read_file_table(loaded: LoadedDescription, read: TableRead, lake: LakeSource | None = None) -> dict[str, list[Any]]:
    """Every row of a runs or node table kept in files (CSV or Parquet), read with DuckDB."""
    rel = read.relation
    where = str(loaded.path)
    if rel.files is None:
        raise SourceError(f"{where}: {read.key}: this backend reads {read.key} from files only")
    files = _Files(loaded, rel.files, rel.format, read.key)
    if not files.files():
        raise SourceError(f"{where}: {read.key}.files: no file matches {files.glob!r}", code="SOURCE_NOT_FOUND")
    con = lake._c if lake is not None else _connect()
    try:
        text, params = (Q("DESCRIBE SELECT * FROM ") + files.relation()).render("qmark")
        types = {r[0]: r[1] for r in con.execute(text, params).fetchall()}
        _one_column_csv(types, files.format, f"{read.key}.files", files.glob, where)
        check_columns(types, [(f"{read.key}.{f}", c) for f, c in read.columns.items()]
                      + [(f"{read.key}.where", c) for c in rel.where], f"the files {files.glob}", where)
        codec = None
        if read.times:
            first = read.columns[read.times[0]]
            codec, why = resolve_codec(read.time_type, read.time_zone, types[first], first)
            if codec is None:
                raise SourceError(f"{where}: {read.key}.time_type: {why}")
        select = []
        for f, c in read.columns.items():
            col = quote_ident(c)
            if f in read.times:
                raw = f"epoch_us({col})" if codec.is_timestamp else (f"CAST({col} AS DOUBLE)" if codec.is_float else f"CAST({col} AS BIGINT)")
                select.append(f"{raw} AS {quote_ident(f)}")
            elif type_class(types[c]) == "numeric":
                select.append(f"CAST({col} AS DOUBLE) AS {quote_ident(f)}")
            else:
                select.append(f"{col} AS {quote_ident(f)}")
        q = Q(f"SELECT {', '.join(select)} FROM ") + files.relation()
        filters = where_equal(rel.where)
        if filters:
            q = q + " WHERE " + join(filters, " AND ")
        text, params = q.render("qmark")
        try:
            rows = con.execute(text, params).fetchall()
        except duckdb.Error as e:
            code, text = file_problem(e, files.format)
            raise SourceError(f"{where}: {read.key}: {text}", code=code or "SOURCE_QUERY") from None
    except duckdb.Error as e:
        code, text = file_problem(e, files.format)
        raise SourceError(f"{where}: {read.key}: {text}", code=code or "SOURCE_NOT_FOUND") from None
    finally:
        if lake is None:
            con.close()
    out: dict[str, list[Any]] = {f: [r[i] for r in rows] for i, f in enumerate(read.columns)}
    for f in read.times:
        out[f] = codec.to_ms_or_none(out[f])
    return out
