"""Validation of ids before they become paths, partition keys or asset keys."""

from __future__ import annotations

import re

from aml_pipeline.errors import InvalidIdError, quote

SPEC_ID_RE = re.compile(r"^[a-z0-9_]+$")
# Run and node ids come from the plant. They become directory names (runs) and Dagster
# partition keys, so path separators, "..", whitespace and Dagster's key delimiters are refused.
EXTERNAL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}$")


def check_spec_id(value: str, *, what: str = "id") -> str:
    if not isinstance(value, str) or not SPEC_ID_RE.fullmatch(value) or len(value) > 64:
        raise InvalidIdError(f"{what} {quote(value)} must match [a-z0-9_]+ (at most 64 characters)")
    return value


def check_external_id(value: str, *, what: str) -> str:
    if (
        not isinstance(value, str)
        or not EXTERNAL_ID_RE.fullmatch(value)
        or ".." in value
    ):
        raise InvalidIdError(
            f"{what} {quote(value)} is not a valid id: use letters, digits and _ . : @ + - "
            "(starting with a letter or digit, at most 128 characters, no '..')"
        )
    return value

