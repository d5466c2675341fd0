"""What both lease backends share: the error, the status record, the handle and the retry loop.

A lease protects the shared Python environment (docs/design.md): jobs that run code in it
hold a *read* lease (many at once); a rebuild/install holds the *exclusive* lock. Every request
is non-blocking at the OS/database level; ``wait_s`` only repeats the attempt with short sleeps
until a deadline, so no call can block forever. The lock itself is always something the kernel
or the database server drops when its holder dies (``flock`` on an open file, a PostgreSQL
session-level advisory lock), never the existence of a file, so a killed holder leaves nothing
that needs manual cleanup.

Locks do not queue, so a stream of overlapping readers would starve a rebuild forever. A second
lock, the *gate*, prevents that: an exclusive request that waits (``wait_s > 0``) holds the gate
exclusively for as long as it waits, and every other request passes through the gate (holds it
shared only while it tries the main lock). While a rebuild waits, new read leases are refused
with ``ENV_BUSY`` naming it and its deadline; readers already holding keep their lease and the
rebuild gets the lock as soon as they are done. The gate is dropped when the rebuild gets the
lock, gives up at its deadline or dies, the last by the kernel or server like any other lock.
"""

from __future__ import annotations

import math
import os
import random
import re
import socket
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from aml_pipeline.errors import AmlError, InvalidIdError

Mode = Literal["read", "exclusive"]
MODES: tuple[str, ...] = ("read", "exclusive")

DEFAULT_LEASE_NAME = "aml-shared-env"

# Lease names become file names (directory backend) and the input of the advisory-lock key.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MAX_HOLDER_LEN = 200
# How many reader names a message spells out before "and N more".
_MAX_NAMES_IN_MESSAGE = 10

_FIRST_DELAY_S = 0.01
_MAX_DELAY_S = 0.2
# A request passing through the gate holds it for one lock attempt (microseconds): a waiting
# exclusive request that finds the gate taken retries this often at once before backing off.
_GATE_TRIES = 5
_GATE_PAUSE_S = 0.001


class EnvBusy(AmlError):
    """A lease request refused because another holder has the environment.

    ``status`` is the :class:`LeaseStatus` seen when the request was refused (who holds it).
    """

    code = "ENV_BUSY"

    def __init__(
        self,
        message: str,
        *,
        mode: str | None = None,
        holder: str | None = None,
        location: str | None = None,
        status: LeaseStatus | None = None,
    ) -> None:
        super().__init__(message)
        self.mode = mode
        self.holder = holder
        self.location = location
        self.status = status


class LeaseError(AmlError):
    """The lease backend itself cannot be used (directory not writable, database unreachable)."""

    code = "ENV_LEASE_ERROR"


def hostname() -> str:
    return socket.gethostname()


def short_host(host: str, limit: int = 16) -> str:
    """The host label the PostgreSQL backend can afford in ``application_name``."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", host.split(".")[0])[:limit] or "?"


def iso_utc(epoch_s: float | None) -> str | None:
    if epoch_s is None:
        return None
    stamp = datetime.fromtimestamp(epoch_s, tz=timezone.utc).isoformat(timespec="seconds")
    return stamp.replace("+00:00", "Z")


@dataclass(frozen=True)
class HolderInfo:
    """One live holder: who, in which mode, which process on which host, since when."""

    holder: str
    mode: str  # "read" | "exclusive"
    pid: int | None = None
    host: str | None = None
    since: float | None = None  # epoch seconds
    backend_pid: int | None = None  # PostgreSQL backend serving the lease session, if any
    deadline: float | None = None  # epoch seconds: when a waiting exclusive request gives up

    def to_dict(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "mode": self.mode,
            "pid": self.pid,
            "host": self.host,
            "since": self.since,
            "since_iso": iso_utc(self.since),
            "backend_pid": self.backend_pid,
            "deadline": self.deadline,
            "deadline_iso": iso_utc(self.deadline),
        }

    def describe(self) -> str:
        where = []
        if self.pid is not None:
            where.append(f"pid {self.pid}")
        if self.host:
            where.append(f"on host {self.host}")
        if self.since is not None:
            where.append(f"since {iso_utc(self.since)}")
        if self.deadline is not None:
            where.append(f"until {iso_utc(self.deadline)}")
        return f"{self.holder} ({' '.join(where)})" if where else self.holder


@dataclass(frozen=True)
class LeaseStatus:
    """Who holds the environment right now, and which rebuild waits for it. Dead processes are
    never listed."""

    location: str  # the directory, or the database URL without its password
    name: str
    backend: str  # "file" | "postgres"
    reader_leases: tuple[HolderInfo, ...] = ()
    exclusive: HolderInfo | None = None
    # The exclusive request waiting for the lock (it holds the gate): no new read lease until it
    # has the lock, gives up at ``waiting.deadline`` or dies.
    waiting: HolderInfo | None = None

    @property
    def readers(self) -> int:
        return len(self.reader_leases)

    @property
    def holders(self) -> list[str]:
        """Names of the read-lease holders (one entry per lease)."""
        return [r.holder for r in self.reader_leases]

    @property
    def idle(self) -> bool:
        return self.exclusive is None and not self.reader_leases and self.waiting is None

    def describe(self) -> str:
        """One phrase naming who holds or waits for the environment (used in ENV_BUSY messages)."""
        parts = []
        if self.exclusive is not None:
            parts.append(f"exclusive lock held by {self.exclusive.describe()}")
        if self.waiting is not None:
            parts.append(
                f"a rebuild is waiting for the exclusive lock: {self.waiting.describe()}; no new "
                "read lease until it has the lock or gives up"
            )
        n = self.readers
        if n:
            names = self.holders
            shown = ", ".join(names[:_MAX_NAMES_IN_MESSAGE])
            if n > _MAX_NAMES_IN_MESSAGE:
                shown += f", and {n - _MAX_NAMES_IN_MESSAGE} more"
            parts.append(f"1 reader holds a lease: {shown}" if n == 1 else f"{n} readers hold leases: {shown}")
        if not parts:
            return "no holder is registered (a holder may have just acquired or released)"
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "location": self.location,
            "name": self.name,
            "backend": self.backend,
            "readers": self.readers,
            "holders": self.holders,
            "reader_leases": [r.to_dict() for r in self.reader_leases],
            "exclusive": self.exclusive.to_dict() if self.exclusive else None,
            "waiting": self.waiting.to_dict() if self.waiting else None,
        }


# Live handles and requests in progress of this process, so a forked child can let go of its
# inherited copies (a child that outlived a killed parent would otherwise keep the parent's lock,
# or a waiting rebuild's gate, alive).
_LIVE_HANDLES: weakref.WeakSet[LeaseHandle | _Attempt] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for handle in list(_LIVE_HANDLES):
        try:
            handle._drop_inherited()
        except Exception:  # pragma: no cover - never break a fork
            pass
    _LIVE_HANDLES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class LeaseHandle(ABC):
    """A held lease. Release it with :meth:`release` or by leaving its ``with`` block.

    Released automatically when garbage-collected, and by the kernel/server when the process
    dies. A child made by ``fork()`` does not inherit it.
    """

    def __init__(self, *, holder: str, mode: str, location: str, name: str) -> None:
        self.holder = holder
        self.mode = mode
        self.location = location
        self.name = name
        self.pid = os.getpid()
        self.host = hostname()
        self.since = time.time()
        self._released = False
        self._lock = threading.Lock()
        _LIVE_HANDLES.add(self)

    @property
    def released(self) -> bool:
        return self._released

    def info(self) -> HolderInfo:
        return HolderInfo(self.holder, self.mode, self.pid, self.host, self.since)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            _LIVE_HANDLES.discard(self)
            self._release()

    @abstractmethod
    def is_held(self) -> bool:
        """Whether the lease is still held (e.g. before a long step that relies on it)."""

    @abstractmethod
    def _release(self) -> None: ...

    @abstractmethod
    def _drop_inherited(self) -> None:
        """In a forked child: close this process's copy without touching the parent's lease."""

    def __enter__(self) -> LeaseHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<{type(self).__name__} {self.mode} {self.holder!r} on {self.location} ({state})>"


class _Attempt(ABC):
    """One request in progress: tried repeatedly until it succeeds or the deadline passes.

    An exclusive request with a wait (``waits``) takes the gate before the lock and keeps it
    while it waits; every other request only passes through the gate (see the module docstring).
    """

    def __init__(self, mode: str, holder: str, wait: float) -> None:
        self.mode = mode
        self.holder = holder
        self.waits = mode == "exclusive" and wait > 0
        self.since = time.time()
        self.deadline = self.since + wait
        # Why the last try failed: "gate" (a rebuild is waiting) or "lock" (held).
        self.refused_by: str | None = None
        _LIVE_HANDLES.add(self)

    @abstractmethod
    def try_acquire(self) -> LeaseHandle | None: ...

    @abstractmethod
    def busy_status(self) -> LeaseStatus: ...

    @abstractmethod
    def withdraw(self) -> None:
        """Stop waiting: drop the gate (if held) so that readers are admitted again."""

    @abstractmethod
    def abandon(self) -> None:
        """Withdraw and close what the request opened (a no-op for what a handle now owns)."""

    @abstractmethod
    def _drop_inherited(self) -> None:
        """In a forked child: close this process's copies without touching the parent's."""


def retry_briefly(try_once: Callable[[], bool]) -> bool:
    """``try_once()`` a few times a millisecond apart: for a gate held only by passers-by."""
    for i in range(_GATE_TRIES):
        if try_once():
            return True
        if i + 1 < _GATE_TRIES:
            time.sleep(_GATE_PAUSE_S)
    return False


def check_holder(holder: str) -> str:
    if not isinstance(holder, str) or not holder.strip():
        raise InvalidIdError(f"lease holder {holder!r} must be a non-empty string")
    if len(holder) > _MAX_HOLDER_LEN or any(ord(c) < 32 or ord(c) == 127 for c in holder):
        raise InvalidIdError(
            f"lease holder {holder[:40]!r}... must be at most {_MAX_HOLDER_LEN} characters "
            "without control characters"
        )
    return holder


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidIdError(
            f"lease name {name!r} must be letters, digits and _ . - (at most 64, no '..')"
        )
    return name


def _check_wait(wait_s: float) -> float:
    try:
        value = float(wait_s)
    except (TypeError, ValueError):
        raise LeaseError(f"wait_s {wait_s!r} must be a number of seconds") from None
    if math.isnan(value) or value < 0 or math.isinf(value):
        raise LeaseError(
            f"wait_s {wait_s!r} must be finite and >= 0 (a lease request never blocks forever)"
        )
    return value


class EnvLease(ABC):
    """The shared-environment lease at one location. Cheap to create; holds nothing by itself."""

    backend: str = ""

    def __init__(self, *, location: str, name: str) -> None:
        self.location = location
        self.name = check_name(name)

    # -- public API ---------------------------------------------------------------------------

    @contextmanager
    def read(self, holder: str, wait_s: float = 0) -> Iterator[LeaseHandle]:
        """Hold a read lease for the ``with`` block (many readers may hold at once)."""
        handle = self.acquire("read", holder, wait_s)
        try:
            yield handle
        finally:
            handle.release()

    @contextmanager
    def exclusive(self, holder: str, wait_s: float = 0) -> Iterator[LeaseHandle]:
        """Hold the exclusive lock for the ``with`` block (no reader, no other exclusive)."""
        handle = self.acquire("exclusive", holder, wait_s)
        try:
            yield handle
        finally:
            handle.release()

    def acquire(self, mode: str, holder: str, wait_s: float = 0) -> LeaseHandle:
        """Take a lease and return its handle (release it yourself), or raise :class:`EnvBusy`.

        With ``wait_s == 0`` a refused request raises at once; with ``wait_s > 0`` it is retried
        with short sleeps until ``wait_s`` seconds have passed. An exclusive request with
        ``wait_s > 0`` also stops new read leases from being granted while it waits, so that
        readers coming and going cannot starve it.
        """
        if mode not in MODES:
            raise LeaseError(f"lease mode {mode!r} must be one of {MODES}")
        holder = check_holder(holder)
        wait = _check_wait(wait_s)
        deadline = time.monotonic() + wait
        attempt = self._begin(mode, holder, wait)
        try:
            delay = _FIRST_DELAY_S
            while True:
                handle = attempt.try_acquire()
                if handle is not None:
                    return handle
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                time.sleep(min(remaining, delay * random.uniform(0.5, 1.0)))
                delay = min(delay * 1.6, _MAX_DELAY_S)
            # Readers are admitted again from here on; the status names others, not this request.
            attempt.withdraw()
            status = attempt.busy_status()
        finally:
            # On success the handle owns what the attempt opened; abandon() is then a no-op.
            attempt.abandon()
        raise self._busy(mode, holder, wait, status)

    @abstractmethod
    def status(self) -> LeaseStatus: ...

    # -- backend hooks ------------------------------------------------------------------------

    @abstractmethod
    def _begin(self, mode: str, holder: str, wait: float) -> _Attempt: ...

    def _busy(self, mode: str, holder: str, wait: float, status: LeaseStatus) -> EnvBusy:
        what = "the read lease" if mode == "read" else "the exclusive lock"
        msg = f"cannot take {what} on {self.location} [{self.name}] for {holder}: {status.describe()}"
        if wait > 0:
            msg += f" (waited {wait:g}s)"
        me, here = os.getpid(), {hostname(), short_host(hostname())}
        held = list(status.reader_leases) + [h for h in (status.exclusive, status.waiting) if h]
        if any(h.pid == me and h.host in here for h in held):
            msg += f"; note: this process (pid {me}) is one of these holders"
        return EnvBusy(msg, mode=mode, holder=holder, location=self.location, status=status)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.location} [{self.name}]>"


__all__ = [
    "DEFAULT_LEASE_NAME",
    "EnvBusy",
    "EnvLease",
    "HolderInfo",
    "LeaseError",
    "LeaseHandle",
    "LeaseStatus",
    "MODES",
    "Mode",
]
