"""SQL text with bound values, shared by the PostgreSQL and the lake (DuckDB) backends.

Identifiers from a description are quoted (each dotted part: ``historian.samples`` is
``"historian"."samples"``, names taken exactly as written); values are bound, never formatted
into the text. :class:`Q` carries text with a placeholder mark and its values in order, and
renders to either driver's parameter style. A description's own ``query`` names its values
``:node``, ``:from``, ``:to`` and ``:line``; :func:`user_query` binds them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aml_pipeline.errors import SourceError
from aml_pipeline.sources.description import Quality, split_dotted

MARK = "\x00"  # a bound value's place in Q.text (never valid in SQL text)
_NAMED = re.compile(r"(?<![:\w]):(node|from|to|line)\b")
_QUOTED = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"")


@dataclass
class Q:
    text: str = ""
    params: list[Any] = field(default_factory=list)

    def __add__(self, other: Q | str) -> Q:
        if isinstance(other, str):
            return Q(self.text + other, list(self.params))
        return Q(self.text + other.text, self.params + other.params)

    def __radd__(self, other: str) -> Q:
        return Q(other + self.text, list(self.params))

    def render(self, style: str) -> tuple[str, list[Any]]:
        """(text, values) for psycopg (``"pyformat"``: ``%s``, a literal % doubled) or DuckDB
        (``"qmark"``: ``?``)."""
        if style == "pyformat":
            return self.text.replace("%", "%%").replace(MARK, "%s"), list(self.params)
        return self.text.replace(MARK, "?"), list(self.params)


def val(v: Any) -> Q:
    return Q(MARK, [v])


def join(parts: Iterable[Q | str], sep: str) -> Q:
    out = Q()
    for i, p in enumerate(parts):
        out = out + (sep if i else "") + p
    return out


def quote_ident(name: str) -> str:
    if not isinstance(name, str) or not name or "\x00" in name:
        raise SourceError(f"not a usable name: {name!r}")
    return '"' + name.replace('"', '""') + '"'


def dotted_parts(name: str) -> list[str]:
    """``schema.table`` -> ``["schema", "table"]``, unquoted (a quoted part may hold a dot). A
    description's table names were checked when it was loaded (:func:`split_dotted`)."""
    try:
        return split_dotted(name)
    except ValueError as e:
        raise SourceError(str(e)) from None


def quote_dotted(name: str) -> str:
    """``schema.table`` -> ``"schema"."table"`` (a part may be quoted already: ``"My Table"``)."""
    return ".".join(quote_ident(p) for p in dotted_parts(name))


def state_expr(quality: Quality | None, column_sql: str, textual: bool) -> Q:
    """The port's state (0 good) from a quality column: the mapped codes, or the column itself
    when the description lists no good codes. NULL quality is ``other`` (not good)."""
    if quality is None:
        return Q("0")
    if quality.good is None:
        return Q(f"coalesce(CAST({column_sql} AS INTEGER), 2)")

    def code(v: Any) -> Any:
        return str(v) if textual else v

    out = Q("CASE WHEN ") + column_sql + " IN (" + join([val(code(g)) for g in quality.good], ", ") + ") THEN 0"
    for c, s in quality.states.items():
        out = out + " WHEN " + column_sql + " = " + val(code(c)) + f" THEN {int(s)}"
    return out + f" ELSE {int(quality.other)} END"


def user_query(text: str, bind: Callable[[str], Q]) -> Q:
    """A description's query with ``:node``, ``:from``, ``:to``, ``:line`` bound by ``bind(name)``
    (quoted strings and identifiers are left alone)."""
    out = Q()
    pos = 0
    for m in _QUOTED.finditer(text):
        out = out + _bind_named(text[pos : m.start()], bind) + m.group(0)
        pos = m.end()
    return out + _bind_named(text[pos:], bind)


def _bind_named(text: str, bind: Callable[[str], Q]) -> Q:
    out = Q()
    pos = 0
    for m in _NAMED.finditer(text):
        out = out + text[pos : m.start()] + bind(m.group(1))
        pos = m.end()
    return out + text[pos:]


def where_equal(where: dict[str, Any], prefix: str = "") -> list[Q]:
    """``column = value`` for each constant filter of a description."""
    return [Q(f"{prefix}{quote_ident(c)} = ") + val(v) for c, v in where.items()]


def check_columns(have: dict[str, Any], wanted: Sequence[tuple[str, str]], what: str, where: str) -> None:
    """Each (key, column) of ``wanted`` must be in ``have`` (column -> type); else one error naming
    the key, the column and the table."""
    for key, column in wanted:
        if column not in have:
            near = [c for c in have if c.lower() == column.lower()]
            hint = f" (there is {near[0]!r}: names are case-sensitive)" if near else ""
            raise SourceError(
                f"{where}: {key}: column {column!r} is not in {what}{hint}; it has "
                + ", ".join(sorted(have)[:20]) + (" ..." if len(have) > 20 else ""),
                code="SOURCE_NOT_FOUND",
            )
