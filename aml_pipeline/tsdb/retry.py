"""Transient TSDB loss, retried: a build's reads outlast a database restart.

:class:`RetryingTsdb` wraps any port (an adapter's handle, a :class:`~aml_pipeline.tsdb.session.
BriefHandle`). A call that fails with :class:`~aml_pipeline.errors.TsdbUnavailableError` (any
adapter raises it for a lost or refused connection, a server restarting, the embedded file held
by an ingest past a reader's wait) is made again, the same call with the same arguments, after a
pause that doubles each time: from 1 s, at most 16 s apart, until ``AML_TSDB_RETRY_S`` (default
60) seconds have passed since its first failure. A page is asked for again from the same cursor,
so a fetch resumes where it stood: no point is lost or read twice.

Each retry is one warning line, ``TSDB_UNAVAILABLE: run R, node N: <what failed>; retry 2 in
2.0 s ...``, on the ``aml_pipeline.tsdb.retry`` logger and through ``on_retry`` (the Dagster
layer passes its step's ``context.log.warning``). Past the bound the call fails with one
``TSDB_UNAVAILABLE`` line naming the run and node, and every later call of the same wrapper fails
at once the same way: a build does not wait again for each of its remaining runs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aml_pipeline.errors import AmlError, TsdbUnavailableError
from aml_pipeline.tsdb.port import PortCalls, TsdbPort

RETRY_ENV = "AML_TSDB_RETRY_S"
DEFAULT_RETRY_S = 60.0
FIRST_PAUSE_S = 1.0
MAX_PAUSE_S = 16.0

log = logging.getLogger(__name__)

OnRetry = Callable[[str], None]


@dataclass(frozen=True)
class RetryPolicy:
    """How long a call is retried (``budget_s`` after its first failure; 0: never) and the first
    pause (doubling up to ``max_pause_s``)."""

    budget_s: float = DEFAULT_RETRY_S
    first_pause_s: float = FIRST_PAUSE_S
    max_pause_s: float = MAX_PAUSE_S

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """``AML_TSDB_RETRY_S`` seconds (default 60); a shorter budget starts with shorter pauses
        (a sixteenth of it), so a few retries still fit."""
        raw = os.environ.get(RETRY_ENV, "").strip()
        if not raw:
            return cls()
        try:
            budget = float(raw)
        except ValueError:
            budget = -1.0
        if not budget >= 0 or budget == float("inf"):
            raise AmlError(f"{RETRY_ENV}={raw!r} must be a number of seconds >= 0", code="CONFIG_INVALID")
        return cls(budget, min(FIRST_PAUSE_S, budget / 16), MAX_PAUSE_S)


def _what(name: str, args: tuple, kwargs: dict) -> str:
    """The call in words: the run and node a page belongs to, else what it reads."""
    if name == "query_page":
        node = kwargs.get("node_id", args[0] if args else "?")
        run = kwargs.get("run_id", args[1] if len(args) > 1 else "?")
        return f"run {run}, node {node}"
    if name == "prefetch":
        return f"run {kwargs.get('run_id', args[0] if args else '?')}"
    if name == "get_run":
        return f"run {kwargs.get('run_id', args[0] if args else '?')}"
    return {
        "list_runs": "listing runs",
        "list_nodes": "listing nodes",
        "availability_watermark": "reading the watermark",
        "run_versions": "reading run versions",
    }.get(name, name)


class RetryingTsdb(PortCalls):
    """The port ``port`` with every call retried on :class:`TsdbUnavailableError` (module doc).

    ``reset`` is called before each retry (a :class:`BriefHandle`'s ``release``, so the next
    attempt opens a fresh handle). Used by one thread at a time, like the port it wraps.
    """

    def __init__(
        self,
        port: Any,
        *,
        policy: RetryPolicy | None = None,
        on_retry: OnRetry | None = None,
        reset: Callable[[], None] | None = None,
    ) -> None:
        self.port = port
        self.url = port.url
        self.policy = policy or RetryPolicy.from_env()
        self.on_retry = on_retry
        self.reset = reset
        self.retries = 0  # retries made so far (for tests and metadata)
        self._lost: TsdbUnavailableError | None = None

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._lost is not None:
            raise self._lost
        first_failure: float | None = None
        pause = self.policy.first_pause_s
        attempt = 0
        while True:
            try:
                return getattr(self.port, name)(*args, **kwargs)
            except TsdbUnavailableError as e:
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                left = first_failure + self.policy.budget_s - now
                what = _what(name, args, kwargs)
                if left <= 0:
                    waited = now - first_failure
                    self._lost = TsdbUnavailableError(
                        f"{what}: the TSDB is still unavailable after {attempt} retries over {waited:.0f} s "
                        f"({RETRY_ENV}={self.policy.budget_s:g}): {e.message}"
                    )
                    raise self._lost from None
                attempt += 1
                wait = min(pause, left)
                line = (
                    f"{e.code}: {what}: {' '.join(e.message.split())}; retry {attempt} in {wait:.1f} s "
                    f"(gives up {self.policy.budget_s:g} s after the first failure, {RETRY_ENV})"
                )
                log.warning(line)
                if self.on_retry is not None:
                    self.on_retry(line)
                self.retries += 1
                if self.reset is not None:
                    self.reset()
                time.sleep(wait)
                pause = min(pause * 2, self.policy.max_pause_s)

    def release(self) -> None:
        """Let go of the wrapped handle now, where it can (a :class:`BriefHandle`)."""
        release = getattr(self.port, "release", None)
        if callable(release):
            release()

    def close(self) -> None:
        close = getattr(self.port, "close", None)
        if callable(close):
            close()


def retrying(port: TsdbPort, *, on_retry: OnRetry | None = None) -> RetryingTsdb:
    """``port`` with its calls retried (itself if it already is)."""
    return port if isinstance(port, RetryingTsdb) else RetryingTsdb(port, on_retry=on_retry)
