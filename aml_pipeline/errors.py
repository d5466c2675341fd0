"""Errors a user can act on.

Every user-facing failure is an :class:`AmlError` with a stable ``code`` and a one-line message
that names the problem (file, field, run, node). The CLI prints ``code: message`` without a
traceback; anything else escaping is a bug: the CLI prints one ``UNEXPECTED`` line for it and
keeps its traceback in a file.
"""

from __future__ import annotations

# Longest id or value a message echoes whole: a 10,000-character id from a file or a flag is cut
# (its start and end, and its length), so the message stays one readable line.
QUOTE_LIMIT = 100
LONGEST_WORD = 300


def cut(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``str(value)`` for a message, cut in the middle beyond ``limit`` characters (its start,
    its end and its length): every message that echoes an id or a value of the user's input
    goes through here or :func:`quote`."""
    text = str(value)
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]}…{text[head - limit:]} ({len(text)} characters)"


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` for a message, cut as :func:`cut` cuts."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(value)
    head = limit * 2 // 3
    return f"{text[:head]!r}…{text[head - limit:]!r} ({len(text)} characters)"


class AmlError(Exception):
    """A failure caused by input or environment, reported to the user as one line."""

    code = "AML_ERROR"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def one_line(self) -> str:
        """``CODE: message`` on one line; a word longer than any path or URL a user types (an
        over-long value echoed by a message that did not :func:`cut` it) is cut too."""
        return f"{self.code}: {' '.join(cut(word, LONGEST_WORD) for word in self.message.split())}"


class SpecError(AmlError, ValueError):
    """A dataset spec that cannot be built; the message names the field."""

    code = "SPEC_INVALID"


class UnitContractError(AmlError, ValueError):
    """A v2 variable whose scale/offset cannot be trusted (never defaulted to 1/0)."""

    code = "UNIT_CONTRACT_INVALID"


class InvalidIdError(AmlError, ValueError):
    """An id that would be unsafe as a path component or a Dagster partition key."""

    code = "INVALID_ID"


class TsdbError(AmlError):
    code = "TSDB_ERROR"


class TsdbBusyError(TsdbError):
    """The embedded database file is locked by another process (e.g. an ingest during a build)."""

    code = "TSDB_BUSY"


class TsdbUnavailableError(TsdbError):
    """The TSDB could not be reached or dropped the connection mid-call (a server restart, a
    network cut, the embedded file briefly locked): transient, so reads retry it with backoff
    before the build fails."""

    code = "TSDB_UNAVAILABLE"


class TsdbReaderBusyError(TsdbBusyError, TsdbUnavailableError):
    """A reader that waited its lock timeout for the embedded file while an ingest wrote it: busy
    (``TSDB_BUSY``) to whoever opened it, transient to a build, which retries it."""


class SourceError(TsdbError):
    """A source description (``docs/sources.md``) that cannot be used as it is: a bad or missing
    key, a table, column or file the description names that is not there, a permission the
    read-only role lacks, or data that breaks the description's rules (a run id twice, an end
    before its start). The message names the file and the key, table, column, node or run."""

    code = "SOURCE_INVALID"


class UnknownRunError(TsdbError, KeyError):
    code = "UNKNOWN_RUN"

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.message


class UnknownNodeError(TsdbError, KeyError):
    code = "UNKNOWN_NODE"

    def __str__(self) -> str:
        return self.message


class PaginationError(TsdbError):
    """A backend returned pages that would lose or repeat points (e.g. a cursor that does not advance)."""

    code = "TSDB_PAGINATION"


class TruncationError(TsdbError):
    """A read hit a row limit; continuing would silently drop points."""

    code = "TSDB_TRUNCATED"


class IngestError(AmlError, ValueError):
    """An input file that cannot be ingested; nothing of it was written."""

    code = "INGEST_INVALID"


class BuildError(AmlError):
    """A dataset build that cannot produce a snapshot (e.g. no windows)."""

    code = "BUILD_FAILED"


class DiskFullError(AmlError):
    """A write ran out of space (ENOSPC/EDQUOT): the step fails as one line naming the path, and
    how many bytes it needed where that is known; nothing partial is left visible."""

    code = "DISK_FULL"


def _size(n: int) -> str:
    # MB for a snapshot, kB for a small file (a digest), where MB would print 0.0.
    return f"{n / 1e6:.1f} MB" if n >= 50_000 else f"{n / 1e3:.1f} kB" if n >= 1000 else f"{n} bytes"


def disk_full(err: BaseException, path: object, *, needed_bytes: int | None = None) -> DiskFullError | None:
    """The :class:`DiskFullError` for ``err`` if it is an out-of-space error, else None.

    Besides an ``OSError`` with ``errno`` ENOSPC/EDQUOT this recognises a database's report of
    one: PostgreSQL's SQLSTATE 53100 (``disk_full``), and DuckDB's IOException or "Failed to
    commit" error, which carry no errno, only the C library's text for it."""
    import errno
    import os

    out_of_space = (
        getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        or getattr(err, "sqlstate", None) == "53100"
        or any(os.strerror(code) in str(err) for code in (errno.ENOSPC, errno.EDQUOT))
    )
    if not out_of_space:
        return None
    need = f"; this step needed about {_size(needed_bytes)} more" if needed_bytes else ""
    return DiskFullError(f"{path}: no space left on the device{need}; free space or point it elsewhere")
