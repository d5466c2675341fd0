"""Fresh PostgreSQL schemas for tests, the deployment and the benchmark's tests: a URL naming one,
and dropping it afterwards."""

from __future__ import annotations


def with_schema(url: str, schema: str) -> str:
    """``url`` with ``?schema=`` (or ``&schema=``) appended."""
    return f"{url}{'&' if '?' in url else '?'}schema={schema}"


def drop_schema(url: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as con:
        con.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
