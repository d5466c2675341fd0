"""Mapped sources: a plant's own tables, files or InfluxDB behind the TSDB port, read-only.

A source description (YAML, ``docs/sources.md``) is accepted wherever a TSDB URL is: its path
(``plant.yaml``, ``/etc/aml/plant.yml``) or ``source://`` followed by the path
(``source:///etc/aml/plant.yaml``). :func:`open_source` opens the adapter for it.
"""

from __future__ import annotations

from pathlib import Path

from aml_pipeline.errors import TsdbError

SCHEME = "source://"
SUFFIXES = (".yaml", ".yml")


def is_source_url(url: str) -> bool:
    """Whether ``url`` names a source description: by its scheme, or a plain path by its suffix
    (``duckdb:///plant.yaml`` names a DuckDB file, whatever its name)."""
    if not isinstance(url, str):
        return False
    if url.startswith(SCHEME):
        return True
    return "://" not in url and url.lower().endswith(SUFFIXES)


def read_only_error(url: str) -> TsdbError:
    """What an ingest into the source ``url`` names is told: a mapped source is read-only."""
    return TsdbError(f"{url} is a mapped source (read-only): its data stays where the plant keeps it; "
                     "ingest files into the embedded TSDB or a PostgreSQL TSDB instead", code="TSDB_READ_ONLY")


def source_path(url: str) -> Path:
    """The description file ``url`` names (relative paths from the working directory)."""
    text = url[len(SCHEME):] if url.startswith(SCHEME) else url
    if text.startswith("/") and url.startswith(SCHEME):
        text = "/" + text.lstrip("/")
    if not text:
        raise TsdbError(f"source URL {url!r} names no file", code="TSDB_URL_INVALID")
    return Path(text).expanduser().absolute()


def absolute_source_url(url: str) -> str:
    """``url`` with the description's path made absolute (for processes started elsewhere)."""
    return f"{SCHEME}{source_path(url)}" if is_source_url(url) else url


def open_source(url: str):
    """The :class:`~aml_pipeline.sources.mapped.MappedTsdb` for the description ``url`` names."""
    from aml_pipeline.sources.description import load_description
    from aml_pipeline.sources.mapped import MappedTsdb

    return MappedTsdb(url, load_description(source_path(url)))
