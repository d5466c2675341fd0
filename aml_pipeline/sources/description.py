"""The source description: a YAML file that maps a plant's own tables, files or InfluxDB onto the
TSDB port, read-only. Every key is documented in ``docs/sources.md``.

:func:`load_description` reads and validates it; a bad file is one :class:`SourceError` line
naming the file and the key (``plant.yaml: points.value: required for the narrow layout``).
Unknown keys are refused, so a typo is an error, not a silently ignored setting.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from aml_pipeline.errors import InvalidIdError, SourceError
from aml_pipeline.ids import check_external_id
from aml_pipeline.sources.timecodec import TIME_TYPES, zone_problem
from aml_pipeline.spec import ScalarsAsGiven, read_yaml

Backend = Literal["postgresql", "files", "influxdb", "opcua"]
Scalar = Union[bool, int, float, str]
TimeType = Literal["timestamptz", "timestamp", "epoch_s", "epoch_ms", "epoch_us", "epoch_ns", "epoch_s_float"]
assert set(TIME_TYPES) == set(TimeType.__args__)  # one list of time types

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_DURATION_RE = re.compile(r"^\s*(\d+)\s*(s|min|h|d)\s*$")
_DURATION_MS = {"s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


class _M(ScalarsAsGiven):
    model_config = ConfigDict(extra="forbid", frozen=True)


def split_dotted(name: str) -> list[str]:
    """The parts of a table name as SQL reads it: ``schema.table`` -> ``["schema", "table"]``; a
    part may be double-quoted (``"My Table"``, ``""`` for a quote in it). A name that cannot be
    read is a ValueError saying why."""
    parts: list[str] = []
    i = 0
    while i <= len(name):
        if i < len(name) and name[i] == '"':
            j = i + 1
            buf = []
            while j < len(name):
                if name[j] == '"':
                    if j + 1 < len(name) and name[j + 1] == '"':
                        buf.append('"')
                        j += 2
                        continue
                    break
                buf.append(name[j])
                j += 1
            if j >= len(name):
                raise ValueError(f"table name {name!r}: a quoted part is not closed")
            parts.append("".join(buf))
            i = j + 1
            if i < len(name) and name[i] != ".":
                raise ValueError(f"table name {name!r}: expected '.' after a quoted part")
            i += 1
        else:
            j = name.find(".", i)
            j = len(name) if j < 0 else j
            parts.append(name[i:j])
            i = j + 1
    if not all(parts):
        raise ValueError(f"table name {name!r} has an empty part")
    if any("\x00" in part for part in parts):
        raise ValueError(f"table name {name!r} contains a NUL character")
    return parts


def _table_name(name: str) -> str:
    split_dotted(name)
    return name


# A table name that SQL can read (checked when the description is loaded, naming the key).
TableName = Annotated[str, AfterValidator(_table_name)]


class Const(_M):
    """``{value: X}``: the same value for every run (where a column name would otherwise go)."""

    value: Scalar | None


ColumnOrConst = Union[str, Const]


class Quality(_M):
    """Which codes of a quality or status column are good (state 0); the others map to bad states.

    Without ``good``, the column already holds the product's states (0 good, anything else not)."""

    column: str
    good: list[Scalar] | None = None
    states: dict[Scalar, int] = Field(default_factory=dict)
    other: int = 2

    @model_validator(mode="after")
    def _check(self) -> Quality:
        if self.good is not None and not self.good:
            raise ValueError("good: list at least one good code")
        if self.good is None and (self.states or self.other != 2):
            raise ValueError("states and other need good: (which codes are good)")
        for code, state in self.states.items():
            if state == 0:
                raise ValueError(f"states: code {code!r} maps to 0, the good state; list it under good instead")
            if self.good is not None and code in self.good:
                raise ValueError(f"states: code {code!r} is also listed as good")
            _check_state(state, f"states: code {code!r}")
        if self.other == 0:
            raise ValueError("other: must be a bad state (not 0); good codes are listed under good")
        _check_state(self.other, "other")
        return self


def as_quality(quality: str | Quality | None) -> Quality | None:
    """A quality mapping as the description gives it: a column name alone is a column that
    already holds the product's states."""
    return Quality(column=quality) if isinstance(quality, str) else quality


def _check_state(state: int, where: str) -> None:
    if not -(2**31) <= state < 2**31:
        raise ValueError(f"{where}: state {state} does not fit a 32-bit integer")


class WideColumn(_M):
    column: str
    quality: str | Quality | None = None

    def quality_spec(self) -> Quality | None:
        return as_quality(self.quality)


class Periods(_M):
    """Samples split over one table per period: the query's ``{table}`` is each period's table."""

    table: TableName  # e.g. "hist.samples_{period}"
    every: Literal["day", "month", "year"]
    format: str | None = None  # strftime of {period}; default per ``every``
    zone: str = "UTC"

    @field_validator("table")
    @classmethod
    def _pattern(cls, v: str) -> str:
        parts = split_dotted(v)
        if len(parts) > 2:
            raise ValueError(f"table {v!r}: use table or schema.table (double-quote a name that holds a dot: "
                             'hist."samples.{period}")')
        # One {period}, in the table's own name: the tables are listed in one schema and each
        # name is read back as exactly one period.
        if parts[-1].count("{period}") != 1 or any("{period}" in p for p in parts[:-1]):
            raise ValueError(f"table {v!r} must contain {{period}} once, in the table's name (not the schema's)")
        return v

    @property
    def period_format(self) -> str:
        return self.format or {"day": "%Y%m%d", "month": "%Y_%m", "year": "%Y"}[self.every]


class Partition(_M):
    """A hive-style folder key of a lake (``date=2026-01-05/``): queries name only the folders
    their time range overlaps."""

    column: str
    every: Literal["day", "month", "year", "hour"] = "day"
    format: str | None = None  # strftime of the folder value; default per ``every``
    zone: str = "UTC"

    @property
    def value_format(self) -> str:
        return self.format or {"hour": "%Y-%m-%dT%H", "day": "%Y-%m-%d", "month": "%Y-%m", "year": "%Y"}[self.every]


class Points(_M):
    layout: Literal["narrow", "wide", "query"] | None = None
    table: TableName | None = None
    files: str | None = None
    format: Literal["parquet", "csv"] | None = None
    query: str | None = None
    periods: Periods | None = None
    measurement: str | None = None
    retention_policy: str | None = None
    node: str | None = None
    time: str | None = None
    time_type: TimeType | None = None
    time_zone: str | None = None
    value: str | None = None
    quality: str | Quality | None = None
    order: list[str] = Field(default_factory=list)
    line: str | None = None
    where: dict[str, Scalar] = Field(default_factory=dict)
    columns: dict[str, str | WideColumn] = Field(default_factory=dict)
    partition: Partition | None = None
    modified: str | None = None

    @property
    def effective_layout(self) -> str:
        if self.layout:
            return self.layout
        if self.query is not None:
            return "query"
        return "wide" if self.columns else "narrow"

    def quality_spec(self) -> Quality | None:
        return as_quality(self.quality)

    def wide_columns(self) -> dict[str, WideColumn]:
        return {n: WideColumn(column=c) if isinstance(c, str) else c for n, c in self.columns.items()}


class RunConstants(_M):
    line: str
    product: str
    recipe: str
    recipe_version: int | None = None
    recipe_hash: str | None = None
    evidence: Literal["simulation", "real", "unassessed"] = "unassessed"
    confirmed: bool = False
    id_prefix: str = ""


class BatchTag(RunConstants):
    """A run is a maximal interval in which the node holds one value (not one of ``idle``)."""

    node: str
    idle: list[Scalar] = Field(default_factory=list)


class Windows(RunConstants):
    """Fixed windows for a continuous process: one run per ``every`` from ``start``."""

    every: str
    start: str
    zone: str = "UTC"
    end: str | None = None

    @field_validator("every")
    @classmethod
    def _every(cls, v: str) -> str:
        if not _DURATION_RE.match(v) or duration_ms(v) <= 0:
            raise ValueError(f"{v!r} is not a duration: use a whole number with s, min, h or d (8h, 1d, 30min)")
        return v


class Runs(_M):
    table: TableName | None = None
    files: str | None = None
    format: Literal["parquet", "csv"] | None = None
    query: str | None = None
    id: str | None = None
    start: str | None = None
    end: str | None = None
    line: ColumnOrConst | None = None
    product: ColumnOrConst | None = None
    recipe: ColumnOrConst | None = None
    recipe_version: ColumnOrConst | None = None
    recipe_hash: ColumnOrConst | None = None
    evidence: ColumnOrConst | None = None
    confirmed: ColumnOrConst | None = None
    time_type: TimeType | None = None
    time_zone: str | None = None
    where: dict[str, Scalar] = Field(default_factory=dict)
    batch_tag: BatchTag | None = None
    windows: Windows | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Runs:
        forms = [k for k in ("table", "files", "query", "batch_tag", "windows") if getattr(self, k) is not None]
        if len(forms) != 1:
            raise ValueError(
                "say where runs come from with exactly one of table, files, query (a batch/MES table), "
                "batch_tag or windows" + (f"; got {', '.join(forms)}" if forms else "")
            )
        if forms[0] in ("table", "files", "query"):
            for key in ("id", "start", "end", "line", "product", "recipe"):
                if getattr(self, key) is None:
                    raise _KeyError(key, f"required for runs from a {forms[0]} (the column, or {{value: ...}} for a constant)")
        else:
            extra = [k for k in ("id", "start", "end", "line", "product", "recipe", "recipe_version", "recipe_hash",
                                 "evidence", "confirmed", "time_type", "time_zone") if getattr(self, k) is not None]
            if extra or self.where:
                raise _KeyError((extra or ["where"])[0], f"belongs inside {forms[0]}: (runs from a {forms[0]} have no table)")
        return self

    @property
    def form(self) -> str:
        """``table`` (a batch/MES table: ``table``, ``files`` or ``query``), ``batch_tag`` or ``windows``."""
        if self.batch_tag is not None:
            return "batch_tag"
        if self.windows is not None:
            return "windows"
        return "table"


class NodeEntry(_M):
    unit: str | None = None
    low: float | None = None
    high: float | None = None
    key: Scalar | None = None

    @model_validator(mode="after")
    def _range(self) -> NodeEntry:
        for name in ("low", "high"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"{name}: {v}; leave it out for an unknown or open bound")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low {self.low} is above high {self.high}")
        return self


class NodeTable(_M):
    table: TableName | None = None
    files: str | None = None
    format: Literal["parquet", "csv"] | None = None
    query: str | None = None
    id: str
    key: str | None = None
    unit: str | None = None
    low: str | None = None
    high: str | None = None
    where: dict[str, Scalar] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> NodeTable:
        forms = [k for k in ("table", "files", "query") if getattr(self, k) is not None]
        if len(forms) != 1:
            raise ValueError("give exactly one of table, files or query")
        return self


class Security(_M):
    """An OPC UA secure channel: the mode, the policy, this client's certificate and key (paths
    relative to the description), and the server certificate to accept (default: the one the
    server's endpoint presents)."""

    mode: Literal["None", "Sign", "SignAndEncrypt"] = "None"
    policy: Literal["Basic256Sha256", "Aes128_Sha256_RsaOaep", "Aes256_Sha256_RsaPss"] | None = None
    certificate: str | None = None
    private_key: str | None = None
    private_key_password: str | None = None
    server_certificate: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Security:
        if self.mode == "None":
            given = [k for k in ("policy", "certificate", "private_key", "private_key_password", "server_certificate")
                     if getattr(self, k) is not None]
            if given:
                raise _KeyError(given[0], "only with mode Sign or SignAndEncrypt (mode None sends everything in the clear)")
        else:
            for key in ("certificate", "private_key"):
                if not getattr(self, key):
                    raise _KeyError(key, f"required for mode {self.mode}: this client's certificate and its private key")
        return self


class SourceDescription(_M):
    backend: Backend
    connection: str | None = None
    database: str | None = None
    security: Security | None = None
    user: str | None = None
    password: str | None = None
    points: Points = Field(default_factory=Points)
    runs: Runs
    node_table: NodeTable | None = None
    nodes: dict[str, NodeEntry | None] = Field(default_factory=dict)

    @field_validator("nodes")
    @classmethod
    def _node_ids(cls, v: dict[str, NodeEntry | None]) -> dict[str, NodeEntry | None]:
        for node_id in v:
            _external_id(node_id, "node id")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> SourceDescription:
        p, b = self.points, self.backend
        # Checked here, before anything connects: a zone the reader cannot use is the file's error.
        for key, zone in (("points.time_zone", p.time_zone),
                          ("runs.time_zone", self.runs.time_zone if self.runs.form == "table" else None)):
            if zone and (problem := zone_problem(zone)):
                raise _KeyError(key, problem)
        if b != "opcua":
            for key in ("security", "user", "password"):
                if getattr(self, key) is not None:
                    raise _KeyError(key, "only for backend opcua"
                                    + (" (a PostgreSQL user and password go in the connection URL, or PGPASSWORD)"
                                       if b == "postgresql" else ""))
        else:
            _opcua_rules(self)
            return self
        if b in ("postgresql", "influxdb") and not self.connection:
            raise _KeyError("connection", f"required for backend {b}")
        if b == "files" and self.connection:
            raise _KeyError("connection", "the files backend reads files named by points.files; it has no connection")
        if b == "influxdb" and not self.database:
            raise _KeyError("database", "required for backend influxdb (the InfluxDB database to read)")
        if b != "influxdb" and self.database:
            raise _KeyError("database", f"only for backend influxdb (the database of a {b} source is in its connection)")
        where = {"postgresql": ("table", "query"), "files": ("files", "query"), "influxdb": ("measurement",)}[b]
        given = [k for k in ("table", "files", "query", "measurement") if getattr(p, k) is not None]
        if len(given) != 1 or given[0] not in where:
            raise _KeyError("points", f"backend {b} reads points from exactly one of {' or '.join(where)}"
                            + (f"; got {', '.join(given)}" if given else ""))
        layout = p.effective_layout
        if layout == "query" and p.query is None:
            raise _KeyError("points.query", "required for the query layout")
        if layout != "query" and p.query is not None:
            raise _KeyError("points.layout", f"{layout}: a query has the query layout")
        if p.periods is not None and p.query is None:
            raise _KeyError("points.periods", "only with points.query (its {table} names each period's table)")
        if p.periods is not None and "{table}" not in p.query:
            raise _KeyError("points.query", "must name {table} where each period's table goes (points.periods)")
        if b != "influxdb" and not p.time:
            raise _KeyError("points.time", "required: the time column")
        if b == "influxdb" and (p.time or p.time_type or p.time_zone):
            raise _KeyError("points.time", "InfluxDB keeps its own time; leave time, time_type and time_zone out")
        if p.time_zone and p.time_type not in (None, "timestamp"):
            raise _KeyError("points.time_zone", f"only for time_type timestamp, not {p.time_type}")
        if p.retention_policy and b != "influxdb":
            raise _KeyError("points.retention_policy", "only for backend influxdb")
        if p.format and b != "files":
            raise _KeyError("points.format", "only for backend files")
        if p.partition is not None and b != "files":
            raise _KeyError("points.partition", "only for backend files (hive-style folders)")
        if layout == "narrow":
            for key in ("node", "value"):
                if not getattr(p, key):
                    raise _KeyError(f"points.{key}", "required for the narrow layout"
                                    + (" (the tag that names the node)" if key == "node" and b == "influxdb" else ""))
            if p.columns:
                raise _KeyError("points.columns", "only for the wide layout (a column per node)")
        elif layout == "wide":
            if not p.columns:
                raise _KeyError("points.columns", "required for the wide layout: which column is which node")
            for key in ("node", "value", "quality"):
                if getattr(p, key):
                    raise _KeyError(f"points.{key}", "not for the wide layout: give each node's column (and quality) under columns")
            for node_id in p.columns:
                _external_id(node_id, "node id", key="points.columns")
        else:
            if not p.value:
                raise _KeyError("points.value", "required: the query's value column")
            if p.node or p.columns:
                raise _KeyError("points.node", "not for the query layout: the query selects one node's points (:node)")
            if not (self.nodes or self.node_table):
                raise _KeyError("nodes", "the query layout needs a node catalog: nodes (in this file) or node_table")
            for name in ("node", "from", "to"):
                if f":{name}" not in p.query:
                    raise _KeyError("points.query", f"must use :{name} (the node, and the time range :from .. :to)")
        if b == "influxdb":
            if p.order:
                raise _KeyError("points.order", "InfluxDB keeps one point per series and time; there is nothing to order")
            if p.modified:
                raise _KeyError("points.modified", "InfluxDB has no modification time")
            if self.node_table is not None and self.node_table.files is None:
                raise _KeyError("node_table", "an InfluxDB source reads a node table from files only")
            if self.runs.form == "table" and self.runs.files is None:
                raise _KeyError("runs", "an InfluxDB source reads a batch table from files only (or use batch_tag, windows)")
        for what, rel in (("runs", self.runs if self.runs.form == "table" else None), ("node_table", self.node_table)):
            if rel is None:
                continue
            if rel.table is not None and b != "postgresql":
                raise _KeyError(f"{what}.table", f"backend {b} has no tables; use files")
            if rel.files is None and rel.format is not None:
                raise _KeyError(f"{what}.format", "only with files")
        if self.runs.form == "batch_tag":
            _external_id(self.runs.batch_tag.node, "node id", key="runs.batch_tag.node")
        return self


def _opcua_rules(d: SourceDescription) -> None:
    """What an OPC UA description may say: a node's points are its raw history, so ``points``
    has nothing to map, and tables come from files."""
    if not d.connection:
        raise _KeyError("connection", "required for backend opcua: the server's endpoint (opc.tcp://host:4840)")
    if d.database:
        raise _KeyError("database", "only for backend influxdb")
    given = [k for k in Points.model_fields if k not in ("order", "where", "columns")
             and getattr(d.points, k) is not None] + [k for k in ("order", "where", "columns") if getattr(d.points, k)]
    if given:
        raise _KeyError(f"points.{given[0]}", "not for an OPC UA source: each node's points are its raw history "
                        "(HistoryRead), with the SourceTimestamp, the value and the StatusCode; leave points out")
    if not (d.nodes or d.node_table):
        raise _KeyError("nodes", "an OPC UA source needs its nodes: nodes (each with key: its NodeId or browse path) "
                        "or node_table (files)")
    if d.node_table is not None and d.node_table.files is None:
        raise _KeyError("node_table", "an OPC UA source reads a node table from files only")
    if d.runs.form == "table" and d.runs.files is None:
        raise _KeyError("runs", "an OPC UA source reads a batch table from files only (or use batch_tag, windows)")
    if d.runs.form == "batch_tag":
        _external_id(d.runs.batch_tag.node, "node id", key="runs.batch_tag.node")



class _KeyError(ValueError):
    """A validation error about one key (its dotted path), raised from a model validator."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _external_id(value: str, what: str, key: str | None = None) -> None:
    try:
        check_external_id(value, what=what)
    except InvalidIdError as e:
        raise (ValueError(e.message) if key is None else _KeyError(key, e.message)) from None


def duration_ms(text: str) -> int:
    m = _DURATION_RE.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    return int(m.group(1)) * _DURATION_MS[m.group(2)]


@dataclass(frozen=True)
class LoadedDescription:
    """A validated description and where it came from (relative paths are relative to it)."""

    path: Path
    spec: SourceDescription

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def where(self, key: str) -> str:
        return f"{self.path}: {key}"

    def error(self, key: str, message: str, code: str | None = None) -> SourceError:
        return SourceError(f"{self.path}: {key}: {message}", code=code)

    def connection(self) -> str:
        """The connection string with ``${VAR}`` taken from the environment (a password stays
        out of the file: ``postgresql://reader:${PLANT_DB_PASSWORD}@host/db``, or PGPASSWORD)."""
        return self.expand("connection", self.spec.connection or "")

    def expand(self, key: str, text: str) -> str:
        """``text`` (the value of ``key``) with each ``${VAR}`` taken from the environment."""

        def var(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in os.environ:
                raise self.error(key, f"environment variable {name} is not set")
            return os.environ[name]

        return _ENV_RE.sub(var, text)


def parse_description(data: Any, path: Path) -> LoadedDescription:
    if not isinstance(data, Mapping):
        raise SourceError(f"{path}: expected a mapping of keys (backend, points, runs, ...), got {type(data).__name__}")
    try:
        spec = SourceDescription.model_validate(dict(data))
    except ValidationError as e:
        first, count = _most_telling(e.errors())
        ctx_error = (first.get("ctx") or {}).get("error")
        msg = first["msg"].removeprefix("Value error, ")
        loc = _loc(first["loc"])
        if isinstance(ctx_error, _KeyError):
            loc = ".".join(p for p in (loc, ctx_error.key) if p)
        if first["type"] == "extra_forbidden":
            msg = "unknown key (see docs/sources.md for the keys)"
        elif first["type"] == "missing":
            msg = "required"
        more = f" (and {count - 1} more)" if count > 1 else ""
        raise SourceError(f"{path}: {loc or '<file>'}: {msg}{more}") from None
    return LoadedDescription(path, spec)


def _most_telling(errors: list[Any]) -> tuple[Any, int]:
    """The error to report: a value given as a mapping fails every branch of ``str | Model``;
    the model's complaint says what is wrong, "should be a valid string" does not."""
    telling = [e for e in errors if not e["type"].endswith("_type")] or errors
    # A typo first, then a value given but wrong, then a key left out.
    rank = {"extra_forbidden": 0, "missing": 2}
    return min(telling, key=lambda e: rank.get(e["type"], 1)), len(telling)


def _loc(loc: tuple[Any, ...]) -> str:
    # pydantic names union members (str, Const, function-after[...]) in the location: drop them.
    parts = []
    for item in loc:
        text = str(item)
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif text in ("str", "Const", "Quality", "WideColumn", "NodeEntry", "int", "float", "bool") or "[" in text:
            continue
        else:
            parts.append(("." if parts else "") + text)
    return "".join(parts)


def load_description(path: str | Path) -> LoadedDescription:
    """Read and validate a source description file."""
    path = Path(path).expanduser().absolute()
    return parse_description(read_yaml(path, what="the source description", error=SourceError), path)
