"""Dataset spec: the YAML a user writes, validated; ``spec.json`` keeps the seed's camelCase.

Both camelCase (the predecessor's spelling) and snake_case keys are accepted. Unknown keys are
refused so that a typo (``hampleK``) is an error naming the field, not a silently ignored
setting.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator
from pydantic.alias_generators import to_camel

from aml_pipeline.core.units import UnitTransform, check_unit_contract
from aml_pipeline.errors import AmlError, InvalidIdError, SpecError, UnitContractError, cut, quote
from aml_pipeline.ids import check_external_id, check_spec_id

Role = Literal["feature", "control", "target"]
Aggregate = Literal["point", "mean"]

# Bounds that keep every number of a spec inside what the build computes with (int64 epoch ms,
# Python datetimes, float64 products): beyond them a value is a typo, and would fail later as an
# overflow instead of naming its field.
MAX_DURATION_MS = 366 * 86_400_000  # a beat, an interpolation gap, a delay: at most a year
MIN_TIME_MS = -62_135_596_800_000  # 0001-01-01, the first day a datetime holds
MAX_TIME_MS = 253_402_300_799_999  # 9999-12-31, its last
MAX_HAMPEL_K = 100_000  # samples each side of a point
MAX_HAMPEL_SIGMA = 1e6
MAX_VERSION = 2**31 - 1  # recipe versions are int32 in the TSDB
MAX_NOTE_CHARS = 10_000
CRON_ALIASES = ("@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@annually", "@midnight")


class ScalarsAsGiven(BaseModel):
    """A model whose number and true/false fields take only a number or true/false as written:
    the spec's models and the source description's."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_loose_scalars(cls, v: Any, info: Any) -> Any:
        # Pydantic takes true for 1 where a number belongs (``beatMs: true`` would build a 1 ms
        # grid, ``historySteps: yes`` a history of one step) and text for what it spells
        # (``causal: "yes"``, ``scale: "1"``), without a word: a quoted value is most often a
        # value meant for another key or a template left unfilled.
        if info.field_name is None:
            return v
        annotation = cls.model_fields[info.field_name].annotation
        members = {annotation, *get_args(annotation)}
        why = _loose_scalar(v, members)
        if why is None and isinstance(v, (list, tuple)):
            items = {t for m in members if get_origin(m) is tuple for t in get_args(m) if t is not Ellipsis}
            why = next((f"item {i}: {w}" for i, x in enumerate(v) if (w := _loose_scalar(x, items))), None)
        if why is not None:
            raise ValueError(why)
        return v


def _valid_id(value: str, what: str) -> str:
    """An id that becomes a path or a key (:func:`aml_pipeline.ids.check_external_id`), as a
    validation error of the field it is in."""
    try:
        return check_external_id(value, what=what)
    except InvalidIdError as e:
        raise ValueError(e.message) from None


class _Model(ScalarsAsGiven):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


def _loose_scalar(v: Any, types: set[Any]) -> str | None:
    """Why ``v`` does not stand for a value of ``types`` as given (None: it may)."""
    if str in types:
        return None
    if bool in types:
        if isinstance(v, str):
            return f"{quote(v)} is text, not true or false"
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return f"{v} is a number, not true or false"
        return None
    if {int, float} & types:
        if isinstance(v, bool):
            return f"{str(v).lower()} is not a number"
        if isinstance(v, str):
            try:
                float(v)
            except ValueError:
                return f"{quote(v)} is text, not a number"
            # Quoted, or an exponent without a dot, which YAML 1.1 reads as text (1e3, not 1.0e3).
            return f"{quote(v)} is text, not a number (write it without quotes, and an exponent with a dot: 1.0e3)"
    return None


class NodeSpec(_Model):
    node_id: str
    role: Role = "feature"
    interp: Literal["linear", "hold"] = "linear"
    # A plain array in the JSON schema (tools that draw samples from it, like Dagster's component
    # docs, know no per-position items).
    range: Annotated[
        tuple[float, float] | None,
        WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
                                  {"type": "null"}]}),
    ] = None
    hampel_k: int | None = Field(default=None, ge=0, le=MAX_HAMPEL_K)
    hampel_min_dev: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    max_interp_ms: int | None = Field(default=None, ge=0, le=MAX_DURATION_MS)
    # Written to spec.json only when set (DatasetSpec.to_json_dict), like every key added after
    # datasets existed: specs without it keep their bytes and hash.
    aggregate: Aggregate | None = None

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str) -> str:
        return _valid_id(v, "nodeId")

    @field_validator("range")
    @classmethod
    def _range(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None:
            lo, hi = v
            if math.isnan(lo) or math.isnan(hi) or lo > hi:
                raise ValueError(f"range [{lo}, {hi}] must satisfy lo <= hi")
            # One side may be open (``[0, .inf]``); a range that starts at +inf or ends at -inf
            # holds no number, and would remove every point of the node.
            if lo == math.inf or hi == -math.inf:
                raise ValueError(f"range [{lo}, {hi}] holds no number; use -.inf / .inf only for an open side")
        return v


class CleaningSpec(_Model):
    hampel_k: int = Field(default=5, ge=0, le=MAX_HAMPEL_K)
    hampel_sigma: float = Field(default=3.0, gt=0, le=MAX_HAMPEL_SIGMA, allow_inf_nan=False)
    hampel_min_dev: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    good_states: tuple[int, ...] = (0,)

    @field_validator("good_states")
    @classmethod
    def _states(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v:
            raise ValueError("goodStates must list at least one state")
        return tuple(sorted(set(v)))


class SplitSpec(_Model):
    method: Literal["chronological", "hashed"] = "chronological"
    train: float = Field(default=0.7, gt=0, le=1, allow_inf_nan=False)
    val: float = Field(default=0.15, ge=0, le=1, allow_inf_nan=False)
    test: float = Field(default=0.15, ge=0, le=1, allow_inf_nan=False)
    seed: int = 0

    @model_validator(mode="after")
    def _sum_to_one(self) -> SplitSpec:
        total = self.train + self.val + self.test
        if abs(total - 1.0) > 1e-9:
            raise ValueError(
                f"train + val + test must sum to 1 (got {self.train} + {self.val} + {self.test} = {total:g})"
            )
        return self


class VariableSpec(_Model):
    id: str
    node_id: str
    role: str = ""  # free text, as the predecessor's sidecar records it
    unit: str = ""
    model_unit: str | None = None
    # No defaults that could pass as a transform: a missing scale/offset is a contract error.
    # Bounded so that a value times its scale stays a float64 (1e308 would make every point inf).
    scale: float | None = Field(default=None, ge=-1e12, le=1e12, allow_inf_nan=False)
    offset: float | None = Field(default=None, ge=-1e12, le=1e12, allow_inf_nan=False)
    delay_ms: int = Field(default=0, ge=0, le=MAX_DURATION_MS)

    @field_validator("id")
    @classmethod
    def _variable_id(cls, v: str) -> str:
        return _valid_id(v, "variable id")


class ExtrasSpec(_Model):
    """The seed's ProcessDatasetExtras: present -> manifest v2."""

    spec_ref: str = ""
    spec_version: int = Field(default=0, ge=0, le=MAX_VERSION)
    trainer_ref: str = ""
    condition_id: str = ""
    recipe_version: int = Field(ge=0, le=MAX_VERSION)
    recipe_content_hash: str
    evidence_source: Literal["simulation", "real", "unassessed"] = "unassessed"
    availability_watermark: int | None = Field(default=None, ge=0, le=MAX_TIME_MS)
    variables: tuple[VariableSpec, ...] = ()

    @field_validator("variables")
    @classmethod
    def _unique_variables(cls, v: tuple[VariableSpec, ...]) -> tuple[VariableSpec, ...]:
        seen: set[str] = set()
        for i, var in enumerate(v):
            if var.id in seen:
                raise ValueError(f"[{i}].id: variable id {var.id!r} is given twice")
            seen.add(var.id)
        return v


class DatasetSpec(_Model):
    id: str
    line_id: str
    product_id: str
    recipe_id: str
    from_ms: int | None = Field(default=None, ge=MIN_TIME_MS, le=MAX_TIME_MS)
    to_ms: int | None = Field(default=None, ge=MIN_TIME_MS, le=MAX_TIME_MS)
    beat_ms: int = Field(default=1000, ge=1, le=MAX_DURATION_MS)
    max_interp_ms: int = Field(default=5000, ge=0, le=MAX_DURATION_MS)
    aggregate: Aggregate | None = None  # every node's, unless it sets its own; None = point values
    history_steps: int = Field(default=60, ge=1)
    horizon_steps: int = Field(default=30, ge=1)
    stride: int = Field(default=1, ge=1)
    causal: bool = False  # a window's history depends only on points before its origin
    nodes: tuple[NodeSpec, ...] = Field(min_length=1)
    cleaning: CleaningSpec = CleaningSpec()
    split: SplitSpec = SplitSpec()
    note: str = Field(default="", max_length=MAX_NOTE_CHARS)
    extras: ExtrasSpec | None = None
    # How the snapshot stores its windows (docs/snapshot.md): "windows" (the predecessor's
    # x/u/y arrays) or "series" (each grid row once, windows cut on read). The default is left
    # out of spec.json, so a spec that does not choose keeps today's bytes and hash.
    layout: Literal["windows", "series"] = "windows"
    # Operational, not part of the dataset's identity: excluded from spec.json and the hash.
    schedule: str | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        try:
            return check_spec_id(v)
        except InvalidIdError as e:
            raise ValueError(e.message) from None

    @field_validator("schedule")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        # Dagster checks the text only when the definitions load, where a bad one stopped every
        # dataset; here it names the file and the field.
        if v is not None and (why := cron_problem(v)):
            raise ValueError(f"{quote(v)} is not a cron schedule: {why} (e.g. '15 * * * *': minute 15 of every hour)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> DatasetSpec:
        # Messages start with the field they are about: parse_spec shows them without a field.
        counts = Counter(n.node_id for n in self.nodes)
        dup = sorted(i for i, c in counts.items() if c > 1)
        if dup:
            raise ValueError(f"nodes: {cut(', '.join(dup))} listed more than once")
        if not any(n.role == "target" for n in self.nodes):
            raise ValueError("nodes: at least one needs role: target")
        if self.from_ms is not None and self.to_ms is not None and self.from_ms > self.to_ms:
            raise ValueError(f"fromMs ({self.from_ms}) is after toMs ({self.to_ms})")
        return self

    # ---- derived views -------------------------------------------------------------------
    @property
    def node_ids(self) -> list[str]:
        """x column order ("allNodes")."""
        return [n.node_id for n in self.nodes]

    @property
    def control_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes if n.role == "control"]

    @property
    def target_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes if n.role == "target"]

    @property
    def manifest_version(self) -> int:
        return 2 if self.extras is not None else 1

    def unit_transforms(self) -> dict[str, UnitTransform]:
        """Validated v2 unit transforms by node id (empty for v1)."""
        if self.extras is None:
            return {}
        return check_unit_contract(
            ((v.id, v.node_id, v.scale, v.offset) for v in self.extras.variables), self.node_ids
        )

    def to_json_dict(self) -> dict[str, Any]:
        """spec.json's content: every field, except ``schedule`` (operational) and the keys added
        after datasets existed while they have their default (``layout: windows``, ``aggregate``,
        ``causal``), so the specs that do not use them keep the bytes, hash and stage versions
        they had."""
        exclude: dict[str, Any] = {"schedule": True}
        if self.layout == "windows":
            exclude["layout"] = True
        if self.aggregate is None:
            exclude["aggregate"] = True
        if not self.causal:
            exclude["causal"] = True
        plain = {i: {"aggregate"} for i, n in enumerate(self.nodes) if n.aggregate is None}
        if plain:
            exclude["nodes"] = plain
        return self.model_dump(mode="json", by_alias=True, exclude=exclude)

    def to_json_bytes(self) -> bytes:
        """The exact bytes of ``spec.json`` (the first input of the snapshot hash)."""
        return (json.dumps(self.to_json_dict(), indent=2, ensure_ascii=False) + "\n").encode()

    def fingerprint(self) -> str:
        """Short content hash of spec.json: changes whenever the dataset definition changes."""
        return hashlib.sha256(self.to_json_bytes()).hexdigest()[:16]


_CRON_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12), ("day of week", 0, 7))
_CRON_NAMES = {3: ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"),
               4: ("sun", "mon", "tue", "wed", "thu", "fri", "sat")}


def cron_problem(text: str) -> str | None:
    """Why ``text`` is not a five-field cron schedule (or one of Dagster's ``@daily``-style
    names), or None."""
    text = text.strip()
    if text.lower() in CRON_ALIASES:
        return None
    fields = text.split()
    if len(fields) != 5:
        return f"{len(fields)} fields where cron has 5 (minute hour day-of-month month day-of-week)"
    for k, (field, (name, lo, hi)) in enumerate(zip(fields, _CRON_FIELDS)):
        names = _CRON_NAMES.get(k, ())
        for item in field.split(","):
            base, _, step = item.partition("/")
            if step and not (step.isdigit() and int(step) >= 1):
                return f"the {name} step {quote(step)} is not a whole number >= 1"
            if base == "*":
                continue
            for bound in base.split("-", 1):
                value = names.index(bound.lower()) + (1 if k == 3 else 0) if bound.lower() in names else (
                    int(bound) if bound.isdigit() else None)
                if value is None or not lo <= value <= hi:
                    return f"the {name} {quote(bound)} is not between {lo} and {hi}"
    return None


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            name = to_camel(str(item)) if "_" in str(item) else str(item)
            parts.append(("." if parts else "") + name)
    return "".join(parts) or "<root>"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The spec model whose keys the mapping at ``loc`` holds (list positions skipped)."""
    model: type[BaseModel] = DatasetSpec
    for item in loc:
        if isinstance(item, int):
            continue
        annotation = model.model_fields[str(item)].annotation
        inner = next((t for t in (annotation, *getattr(annotation, "__args__", ()))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if inner is None:
            break
        model = inner
    return model


def _unknown_key(loc: tuple[Any, ...]) -> str:
    """What to say of an unknown key: the nearest valid key of the same mapping, if one is near."""
    given = str(loc[-1])
    fields = _model_at(loc[:-1]).model_fields
    if given in fields and to_camel(given) != given:  # taken as given twice: the other spelling won
        return f"{given} and {to_camel(given)} are one key, given twice; give it once (docs/spec.md)"
    names = {to_camel(name): to_camel(name) for name in fields} | {name: to_camel(name) for name in fields}
    near = difflib.get_close_matches(given, names, n=1, cutoff=0.6)
    valid = ", ".join(sorted({to_camel(name) for name in fields}))
    if near:
        return f"unknown key; did you mean {names[near[0]]}? (docs/spec.md)"
    return f"unknown key (the keys here: {valid}; docs/spec.md)"


def parse_spec(data: Mapping[str, Any], *, source: str = "spec") -> DatasetSpec:
    """Validate a mapping into a :class:`DatasetSpec`; errors name the source and the field."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        spec = DatasetSpec.model_validate(dict(data))
    except RecursionError:
        raise SpecError(f"{source}: lists or mappings nested deeper than a reader follows") from None
    except ValidationError as e:
        first = e.errors()[0]
        msg = first["msg"].removeprefix("Value error, ")
        field = _field_path(first["loc"])
        if first["type"] == "extra_forbidden":  # named as written, with the key meant
            msg = _unknown_key(first["loc"])
            field = ".".join(p for p in (_field_path(first["loc"][:-1]).removesuffix("<root>"), str(first["loc"][-1])) if p)
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        if field == "<root>":  # a check across fields: its message starts with the field it is about
            raise SpecError(f"{source}: {msg}{more}") from None
        raise SpecError(f"{source}: field {field}: {msg}{more}") from None
    try:
        spec.unit_transforms()
    except UnitContractError as e:
        raise UnitContractError(f"{source}: {e.message}") from None
    return spec


class _RefusedYaml(Exception):
    """A document the spec's loader refuses, with the line (a key twice, a number YAML 1.1
    reads other than it looks)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key twice in one mapping: plain YAML keeps the last and
    drops the first without a word, so a field given twice (a pasted line) would silently
    change the build. It also refuses the YAML 1.1 numbers that do not read as they look
    (``01000`` is octal 512, ``1:30`` base-60 90) and ``!!binary`` values."""

    def construct_yaml_int(self, node):
        text = str(node.value).replace("_", "")
        line = node.start_mark.line + 1
        if re.fullmatch(r"[-+]?0[0-7]+", text):
            raise _RefusedYaml(f"line {line}: {node.value} reads in YAML as an octal number "
                                f"({super().construct_yaml_int(node)}); write it without the leading 0")
        if ":" in text:
            raise _RefusedYaml(f"line {line}: {node.value} reads in YAML as a base-60 number "
                                f"({super().construct_yaml_int(node)}); write the number itself")
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        if ":" in str(node.value):
            raise _RefusedYaml(f"line {node.start_mark.line + 1}: {node.value} reads in YAML as a base-60 number; "
                                "write the number itself")
        return super().construct_yaml_float(node)

    def construct_yaml_binary(self, node):
        raise _RefusedYaml(f"line {node.start_mark.line + 1}: a !!binary value is not text; write the text itself")

    def construct_mapping(self, node, deep=False):
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base`` overrides by design
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in lines:
                    raise _RefusedYaml(f"line {key_node.start_mark.line + 1}: key {quote(key)} is given twice "
                                        f"(first at line {lines[key]}); give it once")
                lines[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the safe loader's own error names it
                continue
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:binary", _UniqueKeyLoader.construct_yaml_binary)


def read_yaml(path: Path, *, what: str, error: type[AmlError]) -> Any:
    """The YAML (or JSON) document in ``path``; a file that cannot be read or parsed is one
    ``error`` naming the file and ``what`` it was to be."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: cannot read {what}: {_not_utf8(data, e)}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except _RefusedYaml as e:
        raise error(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise error(f"{path}: cannot read {what}: lists or mappings nested deeper than a reader follows") from None


def _not_utf8(data: bytes, e: UnicodeDecodeError) -> str:
    """Where a file stops being UTF-8: the line, the key that line holds, the byte."""
    line_start = data.rfind(b"\n", 0, e.start) + 1
    line = data[line_start:data.find(b"\n", e.start) if b"\n" in data[e.start:] else len(data)]
    key = re.match(r"\s*(?:-\s+)?([\w.-]+)\s*:", line.decode("utf-8", errors="replace"))
    line_no = data.count(b"\n", 0, e.start) + 1
    in_key = f", in key {cut(key.group(1))}" if key else ""
    return (f"line {line_no} is not UTF-8 text (byte 0x{data[e.start]:02x}{in_key}; the file is in another "
            "encoding, e.g. Latin-1); save it as UTF-8")


def load_spec(path: str | Path) -> DatasetSpec:
    """Read a YAML (or JSON) spec file."""
    path = Path(path)
    return parse_spec(read_yaml(path, what="spec", error=SpecError), source=str(path))


SPEC_SUFFIXES = (".yaml", ".yml")


def discover_specs(directory: str | Path) -> tuple[list[tuple[Path, DatasetSpec]], list[tuple[Path, str]]]:
    """Every spec file in ``directory``: the valid ones, and one-line errors for the others.

    A broken spec must not take the other datasets down, so errors are returned, not raised.
    Two files declaring the same id are both an error (asset keys would collide).
    """
    directory = Path(directory)
    found: list[tuple[Path, DatasetSpec]] = []
    errors: list[tuple[Path, str]] = []
    if not directory.is_dir():
        why = "is a file, not a folder of specs" if directory.exists() else "specs folder does not exist"
        return found, [(directory, f"{directory}: {why}")]
    for path in sorted(p for p in directory.iterdir() if p.suffix in SPEC_SUFFIXES and p.is_file()):
        try:
            found.append((path, load_spec(path)))
        except (SpecError, UnitContractError) as e:
            errors.append((path, e.one_line()))
    by_id: dict[str, list[Path]] = {}
    for path, spec in found:
        by_id.setdefault(spec.id, []).append(path)
    dup = {i for i, paths in by_id.items() if len(paths) > 1}
    for i in sorted(dup):
        errors.append((by_id[i][0], f"SPEC_INVALID: id {i!r} is declared by {', '.join(map(str, by_id[i]))}"))
    return [(p, s) for p, s in found if s.id not in dup], errors
