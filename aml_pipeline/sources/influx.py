"""InfluxDB 1.x read over its HTTP query API, read-only.

Connection
    ``connection: http://host:8086`` (``https://`` too; ``user:password@`` in it, with
    ``${VAR}`` from the environment, is sent as HTTP basic authentication) and ``database``.
    Every query is an InfluxQL ``SELECT`` or ``SHOW`` through ``GET /query`` with
    ``epoch=ms`` and ``chunked=true``: a long result arrives in chunks and is never cut by the
    server's ``max-row-limit``; a result still marked ``partial`` at its end is an error
    (``TSDB_TRUNCATED``), never a silent cut. Values (node names, times) are bound parameters
    (``params``); identifiers (measurement, tag and field keys) are double-quoted.

Layouts
    Narrow: ``node`` is the tag that names the node, ``value`` the field that holds the value
    (``quality`` another field). Wide: ``columns`` maps each node to its own field. A point
    without its value field (InfluxDB stores no NaN) but with its quality field is a NaN reading.
    InfluxDB keeps one point per series and time (writing it again replaces it), so there are no
    ties to order; a node's points should be one series (``where`` selects one by its tags).

Versions
    Per run and node: ``count`` and ``sum`` of the value field (and of an integer quality field),
    all runs of a batch in one request (one statement each).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from aml_pipeline.errors import SourceError, TruncationError, TsdbError, TsdbUnavailableError
from aml_pipeline.sources.backend import Backend, NodeRef, Series, Window
from aml_pipeline.sources.description import LoadedDescription, Quality
from aml_pipeline.urls import redact_url

CHUNK_ROWS = 10_000
_TIMEOUT_S = 60.0


def quote_key(name: str) -> str:
    """An InfluxQL identifier: double-quoted, with backslash and quote escaped."""
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


class InfluxSource(Backend):
    """The InfluxDB backend of :class:`~aml_pipeline.sources.mapped.MappedTsdb`: node by node
    (``fetch_many``'s default), runs and node tables from files (``read_table``'s default)."""

    codec = None  # InfluxDB keeps its own time

    def __init__(self, loaded: LoadedDescription) -> None:
        self.loaded = loaded
        self.spec = loaded.spec
        url = loaded.connection()
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SourceError(f"{loaded.path}: connection: {redact_url(url)!r} is not an http:// or https:// URL of InfluxDB")
        self.label = redact_url(url)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port or 8086
        self._base = parts.path.rstrip("/")
        self._auth = None
        if parts.username:
            token = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            self._auth = "Basic " + base64.b64encode(token.encode()).decode()
        self._conn: http.client.HTTPConnection | None = None
        self._closed = False
        p = self.spec.points
        self.layout = p.effective_layout
        rp = f"{quote_key(p.retention_policy)}." if p.retention_policy else ""
        self._from = f"{rp}{quote_key(p.measurement)}"
        try:
            self._check_schema()
        except BaseException:
            self.close()
            raise

    # ---- HTTP --------------------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _connection(self) -> http.client.HTTPConnection:
        if self._closed:
            raise TsdbError(f"{self.label}: this source handle is closed")
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=_TIMEOUT_S)
        return self._conn

    def _statements(self, q: str, params: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """Each JSON object of the chunked answer to ``q`` (one or more statements)."""
        query = {"db": self.spec.database, "q": q, "epoch": "ms", "chunked": "true", "chunk_size": str(CHUNK_ROWS)}
        if params:
            query["params"] = json.dumps(params)
        path = f"{self._base}/query?{urllib.parse.urlencode(query)}"
        headers = {"Accept": "application/json"}
        if self._auth:
            headers["Authorization"] = self._auth
        conn = self._connection()
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            if resp.status in (401, 403):
                body = resp.read().decode(errors="replace")
                raise SourceError(f"{self.loaded.path}: connection {self.label}: not allowed to read database "
                                  f"{self.spec.database!r} ({resp.status}: {_error_text(body)})", code="SOURCE_PERMISSION")
            if resp.status >= 500:
                body = resp.read().decode(errors="replace")
                raise TsdbUnavailableError(f"{self.label}: server error {resp.status} ({_error_text(body)})")
            if resp.status != 200:
                body = resp.read().decode(errors="replace")
                raise SourceError(f"{self.loaded.path}: {self.label}: query refused ({resp.status}: {_error_text(body)})",
                                  code="SOURCE_QUERY")
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if line:
                    yield json.loads(line)
        except (OSError, http.client.HTTPException, socket.timeout) as e:
            self._drop()
            raise TsdbUnavailableError(f"{self.label}: the connection was lost ({type(e).__name__}: {e})") from None
        except BaseException:
            self._drop()
            raise

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _results(self, q: str, params: dict[str, Any] | None = None) -> dict[int, list[dict[str, Any]]]:
        """Every series of every statement (statement id -> series, chunks joined)."""
        out: dict[int, list[dict[str, Any]]] = {}
        last_partial = False
        for obj in self._statements(q, params):
            if "error" in obj:
                raise self._error(obj["error"])
            for res in obj.get("results", []):
                if "error" in res:
                    raise self._error(res["error"])
                sid = int(res.get("statement_id", 0))
                series = out.setdefault(sid, [])
                for s in res.get("series", []):
                    key = (s.get("name"), json.dumps(s.get("tags"), sort_keys=True))
                    same = [x for x in series if (x.get("name"), json.dumps(x.get("tags"), sort_keys=True)) == key]
                    if same:
                        same[0]["values"].extend(s.get("values", []))
                    else:
                        series.append({**s, "values": list(s.get("values", []))})
                    last_partial = bool(s.get("partial"))
                last_partial = last_partial or bool(res.get("partial"))
        if last_partial:
            raise TruncationError(f"{self.label}: the answer to a query ended marked partial (cut by the server); "
                                  "nothing was kept")
        return out

    def _error(self, text: str) -> Exception:
        if "database not found" in text:
            return SourceError(f"{self.loaded.path}: database: {text}", code="SOURCE_NOT_FOUND")
        if "authorized" in text or "permission" in text:
            return SourceError(f"{self.loaded.path}: connection {self.label}: {text}", code="SOURCE_PERMISSION")
        return SourceError(f"{self.loaded.path}: {self.label}: {text}", code="SOURCE_QUERY")

    # ---- schema ------------------------------------------------------------------------------
    def _check_schema(self) -> None:
        p, where = self.spec.points, str(self.loaded.path)
        res = self._results(f"SHOW FIELD KEYS FROM {self._from}; SHOW TAG KEYS FROM {self._from}")
        fields = {v[0]: v[1] for s in res.get(0, []) for v in s["values"]}
        tags = {v[0] for s in res.get(1, []) for v in s["values"]}
        if not fields:
            raise SourceError(f"{where}: points.measurement: measurement {p.measurement!r} is not in database "
                              f"{self.spec.database!r} (or has no fields)", code="SOURCE_NOT_FOUND")
        self._field_types = fields

        def need(key: str, name: str, kind: str) -> None:
            have = fields if kind == "field" else tags
            if name not in have:
                raise SourceError(f"{where}: {key}: {kind} {name!r} is not in measurement {p.measurement!r}; it has "
                                  + ", ".join(sorted(have)), code="SOURCE_NOT_FOUND")

        if self.layout == "narrow":
            need("points.node", p.node, "tag")
            need("points.value", p.value, "field")
            q = p.quality_spec()
            if q is not None:
                need("points.quality", q.column, "field")
        else:
            for node_id, col in p.wide_columns().items():
                need(f"points.columns.{node_id}", col.column, "field")
                if col.quality is not None:
                    need(f"points.columns.{node_id}.quality", col.quality_spec().column, "field")
        if p.line:
            need("points.line", p.line, "tag")
        for tag in p.where:
            need("points.where", tag, "tag")

    # ---- points ------------------------------------------------------------------------------
    def _conditions(self, lo: int, hi: int, line: str | None, params: dict[str, Any], suffix: str = "") -> list[str]:
        p = self.spec.points
        params[f"lo{suffix}"] = max(-(2**63), lo * 1_000_000)
        params[f"hi{suffix}"] = min(2**63 - 1, (hi + 1) * 1_000_000 - 1)
        conds = [f"time >= $lo{suffix}", f"time <= $hi{suffix}"]
        if p.line and line is not None:
            params[f"line{suffix}"] = line
            conds.append(f"{quote_key(p.line)} = $line{suffix}")
        for i, (tag, value) in enumerate(p.where.items()):
            params[f"w{i}"] = str(value)
            conds.append(f"{quote_key(tag)} = $w{i}")
        return conds

    def _fields(self, node: NodeRef) -> tuple[str, Quality | None]:
        p = self.spec.points
        if self.layout == "narrow":
            return p.value, p.quality_spec()
        return node.column, node.quality

    def fetch(self, node: NodeRef, lo: int, hi: int, line: str | None, limit: int) -> Series:
        p = self.spec.points
        params: dict[str, Any] = {}
        conds = self._conditions(max(lo, -(2**62)), min(hi, 2**62), line, params)
        if self.layout == "narrow":
            params["node"] = str(node.key)
            conds.insert(0, f"{quote_key(p.node)} = $node")
        value_field, quality = self._fields(node)
        select = [quote_key(value_field)] + ([quote_key(quality.column)] if quality is not None else [])
        q = (f"SELECT {', '.join(select)} FROM {self._from} WHERE {' AND '.join(conds)} "
             f"ORDER BY time ASC LIMIT {int(limit)}")
        res = self._results(q, params)
        rows = [v for s in res.get(0, []) for v in s["values"]]
        if len(res.get(0, [])) > 1:
            rows.sort(key=lambda r: r[0])  # several series: merge by time (stable)
            rows = rows[: int(limit)]
        if not rows:
            return Series.empty()
        table = np.array(rows, dtype=object)
        ts = table[:, 0].astype(np.int64)
        value = table[:, 1].astype(np.float64)  # a missing value field (None) is NaN
        state = np.zeros(len(rows), np.int32) if quality is None else _states(quality, table[:, 2])
        return Series(ts, value, state)

    def distinct_keys(self) -> list[Any]:
        p = self.spec.points
        res = self._results(f"SHOW TAG VALUES FROM {self._from} WITH KEY = {quote_key(p.node)}")
        return sorted({v[1] for s in res.get(0, []) for v in s["values"]})

    def max_time(self, nodes: Sequence[NodeRef]) -> int | None:
        p = self.spec.points
        params: dict[str, Any] = {}
        conds: list[str] = []
        for i, (tag, value) in enumerate(p.where.items()):
            params[f"w{i}"] = str(value)
            conds.append(f"{quote_key(tag)} = $w{i}")
        statements = []
        if self.layout == "narrow":
            for i, n in enumerate(nodes):
                params[f"n{i}"] = str(n.key)
            match = "(" + " OR ".join(f"{quote_key(p.node)} = $n{i}" for i in range(len(nodes))) + ")"
            q = p.quality_spec()
            fields = [p.value] + ([q.column] if q is not None else [])
            for f in fields:
                statements.append(f"SELECT last({quote_key(f)}) FROM {self._from} WHERE {' AND '.join([match, *conds])}")
        else:
            for n in nodes:
                for f in [n.column] + ([n.quality.column] if n.quality is not None else []):
                    where = f" WHERE {' AND '.join(conds)}" if conds else ""
                    statements.append(f"SELECT last({quote_key(f)}) FROM {self._from}{where}")
        res = self._results("; ".join(statements), params)
        times = [v[0] for series in res.values() for s in series for v in s["values"]]
        return max(times) if times else None

    def aggregates(self, windows: Sequence[Window], nodes: Sequence[NodeRef]) -> list[Any]:
        p = self.spec.points
        params: dict[str, Any] = {}
        statements = []
        group = ""
        fields: list[str] = []
        if self.layout == "narrow":
            for i, n in enumerate(nodes):
                params[f"n{i}"] = str(n.key)
            node_match = "(" + " OR ".join(f"{quote_key(p.node)} = $n{i}" for i in range(len(nodes))) + ")"
            group = f" GROUP BY {quote_key(p.node)}"
            q = p.quality_spec()
            fields = [p.value] + ([q.column] if q is not None else [])
        else:
            node_match = None
            for n in nodes:
                fields += [n.column] + ([n.quality.column] if n.quality is not None else [])
        aggs = []
        for f in fields:
            aggs.append(f"count({quote_key(f)})")
            if self._field_types.get(f) in ("float", "integer"):
                aggs.append(f"sum({quote_key(f)})")
        for k, w in enumerate(windows):
            conds = self._conditions(max(w.lo, -(2**62)), min(w.hi, 2**62), w.line, params, suffix=str(k))
            if node_match:
                conds.insert(0, node_match)
            statements.append(f"SELECT {', '.join(aggs)} FROM {self._from} WHERE {' AND '.join(conds)}{group}")
        res = self._results("; ".join(statements), params)
        out = []
        for k in range(len(windows)):
            per = sorted((json.dumps(s.get("tags"), sort_keys=True), [v[1:] for v in s["values"]]) for s in res.get(k, []))
            out.append(per)
        return out

    def describe(self) -> dict[str, Any]:
        p = self.spec.points
        return {
            "backend": "influxdb",
            "connection": self.label,
            "database": self.spec.database,
            "measurement": p.measurement,
            "layout": self.layout,
            "time": {"column": "time", "type": "InfluxDB time (epoch nanoseconds, read in milliseconds)",
                     "kind": "influxdb", "zone": None},
            "order": "time (one point per series and time)",
        }


def _states(quality: Quality, codes: np.ndarray) -> np.ndarray:
    """The port's state for each quality code: each distinct code is looked up once."""
    import pandas as pd

    index, uniques = pd.factorize(codes, use_na_sentinel=True)  # None -> -1
    if quality.good is None:
        lut = [int(u) for u in uniques]
        missing = 2
    else:
        table: dict[Any, int] = {g: 0 for g in quality.good}
        table.update(quality.states)
        lut = [table.get(u, table.get(str(u), int(quality.other))) for u in uniques]
        missing = int(quality.other)
    return np.asarray(lut + [missing], dtype=np.int32)[index]


def _error_text(body: str) -> str:
    try:
        return str(json.loads(body).get("error", body)).strip()
    except (ValueError, AttributeError):
        return " ".join(body.split())[:200]
