"""One PostgreSQL connection's life, for every part of the product that talks to PostgreSQL: the
TSDB adapter (:mod:`aml_pipeline.tsdb.postgres`), a plant's mapped tables
(:mod:`aml_pipeline.sources.postgres`) and the lease (:mod:`aml_pipeline.lease.pg_lease`).

psycopg 3, autocommit; parameters the URL gives win over the caller's ``defaults``. Session
``settings`` run on every new connection (``optional_settings`` are skipped where a server lacks
them). Failures are classified once: a connection that cannot be made or set up is a
:class:`PgConnectError` saying why and whether trying again can help; a call whose connection
went away is :meth:`PgConnection.lost`. Callers turn these into their own errors
(``TSDB_UNAVAILABLE``, the one a build's reads retry; ``SOURCE_*``; ``ENV_LEASE_ERROR``).
:meth:`PgConnection.scrub` makes a message one line without the password
(:func:`aml_pipeline.urls.redact_text` included).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from aml_pipeline.urls import redact_text, url_secrets

CONNECT_TIMEOUT_S = 10
# A connection that fails this way finds no server, one restarting or one full for now: a transient
# loss (libpq's and the server's own words; the server's startup and shutdown refusals are SQLSTATE
# 57P03, a full server's 53300).
_UNAVAILABLE = re.compile(
    r"Connection refused|timeout expired|Connection timed out|No route to host|Network is unreachable"
    r"|server closed the connection unexpectedly|the database system is (starting up|shutting down"
    r"|in recovery mode|not yet accepting connections|not accepting connections)"
    r"|too many clients already|remaining connection slots are reserved"
)
_AUTHENTICATION = re.compile(
    r"password authentication|no password supplied|authentication failed|role .* does not exist|permission denied"
)
_NO_DATABASE = re.compile(r"database .* does not exist")
# admin_shutdown, crash_shutdown, cannot_connect_now: the server is restarting under the query.
_SERVER_GOING_AWAY = ("57P01", "57P02", "57P03")


class PgConnectError(Exception):
    """A connection that could not be made (``setting_up``: or whose session settings failed).

    ``kind``: ``unavailable`` (no server, or one starting, stopping or full), ``authentication``,
    ``no_database``, ``invalid`` (the connection string), ``refused`` (anything else);
    ``detail``: the scrubbed one-line reason; ``transient``: whether trying again can help.
    """

    def __init__(self, kind: str, detail: str, *, transient: bool, setting_up: bool = False) -> None:
        super().__init__(detail)
        self.kind, self.detail, self.transient, self.setting_up = kind, detail, transient, setting_up


class PgConnection:
    """How to open connections to one PostgreSQL URL (or libpq conninfo), and the one it keeps.

    Not thread-safe: its owner serialises the calls (every user holds a lock around them).
    """

    def __init__(
        self,
        conninfo: str,
        *,
        defaults: Mapping[str, Any] | None = None,
        fixed: Mapping[str, Any] | None = None,
        settings: Sequence[str] = (),
        optional_settings: Sequence[str] = (),
        secrets: Sequence[str] = (),
    ) -> None:
        self.conninfo = conninfo
        try:
            given = conninfo_to_dict(conninfo)
        except psycopg.Error:
            given = {}  # refused by libpq when connecting, as an ``invalid`` PgConnectError
        spellings = [*secrets, *url_secrets(conninfo), str(given.get("password") or "")]
        self.secrets = [s for s in dict.fromkeys(spellings) if s]
        self._kwargs = {k: v for k, v in (defaults or {}).items() if k not in given} | dict(fixed or {})
        self.settings, self.optional_settings = tuple(settings), tuple(optional_settings)
        self.connected_before = False
        self._conn: psycopg.Connection | None = None

    # ---- connections -------------------------------------------------------------------------
    def open(self, **fixed: Any) -> psycopg.Connection:
        """A new connection, its session set up (``fixed``: more parameters, over every other)."""
        try:
            conn = psycopg.connect(self.conninfo, autocommit=True, **(self._kwargs | fixed))
        except psycopg.Error as e:
            raise self._connect_error(e) from None
        except Exception as e:  # a connection string psycopg itself cannot take apart
            raise PgConnectError("invalid", self.scrub(e), transient=False) from None
        try:
            for statement in self.optional_settings:
                try:
                    conn.execute(statement)
                except psycopg.Error:
                    if conn.broken:
                        raise
            for statement in self.settings:
                conn.execute(statement)
        except psycopg.Error as e:
            lost = self.lost(e, conn)
            conn.close()
            raise PgConnectError("unavailable" if lost else "refused", self.scrub(e), transient=lost,
                                 setting_up=True) from None
        self.connected_before = True
        return conn

    def connection(self) -> psycopg.Connection:
        """The kept connection; a new one if there is none or the server dropped it."""
        conn = self._conn
        if conn is not None and (conn.broken or conn.closed):
            self._conn = None
            conn.close()
        if self._conn is None:
            self._conn = self.open()
        return self._conn

    @property
    def current(self) -> psycopg.Connection | None:
        """The kept connection as it is (None if there is none), without reopening it."""
        return self._conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # ---- failures ----------------------------------------------------------------------------
    def _connect_error(self, e: psycopg.Error) -> PgConnectError:
        text = self.scrub(e)
        if not isinstance(e, psycopg.OperationalError):
            kind = "invalid"  # e.g. an unknown URL parameter, refused by libpq's parser
        elif _UNAVAILABLE.search(text):
            kind = "unavailable"
        elif _AUTHENTICATION.search(text):
            kind = "authentication"
        elif _NO_DATABASE.search(text):
            kind = "no_database"
        else:
            kind = "refused"
        # A server that answered a moment ago, or one that refuses or is restarting: transient.
        transient = kind == "unavailable" or (self.connected_before and kind != "invalid")
        return PgConnectError(kind, text, transient=transient)

    def lost(self, e: BaseException, conn: psycopg.Connection | None = None) -> bool:
        """Whether ``e``, raised by a call on ``conn`` (default: the kept connection), means the
        connection went away: a transient failure, the next call connects again."""
        conn = self._conn if conn is None else conn
        if conn is not None and conn.broken:
            return True
        if getattr(e, "sqlstate", None) in _SERVER_GOING_AWAY:
            return True
        return isinstance(e, psycopg.OperationalError) and (conn is None or conn.closed)

    def scrub(self, e: BaseException | str) -> str:
        """``e`` as one line, without the password."""
        text = " ".join(str(e).split()) or (type(e).__name__ if isinstance(e, BaseException) else "")
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return redact_text(text)
