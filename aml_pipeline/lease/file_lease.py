"""Single-host lease: ``flock`` on a lock file in a directory.

Layout inside the lease directory (``NAME`` defaults to ``aml-shared-env``)::

    NAME.lock                         the lock: LOCK_SH per reader, LOCK_EX for the exclusive
    NAME.holders/<mode>-<pid>-<uuid>.json
                                      one file per held lease, for status only; its owner holds
                                      LOCK_EX on it for as long as it lives

Admission is decided by the kernel lock on ``NAME.lock`` alone (non-blocking ``flock``): a
shared and an exclusive lock on the same file never coexist, whatever the holder files say.
Each lease opens the lock file afresh, because ``flock`` locks belong to an open file
description: two leases in one process are two independent locks (so an exclusive request from
a process that holds a read lease is refused, never deadlocked).

Nothing is ever cleaned up by hand. When a holder dies the kernel closes its descriptors,
which drops both its lock and the lock on its holder file; ``status`` lists a holder file only
while its lock is held (a probe with ``LOCK_SH | LOCK_NB`` fails), and deletes the files of dead
holders as it meets them. A holder file is created under a temporary name, locked, written and
only then renamed into place, so ``status`` never sees a live holder's file unlocked.

Local filesystems only: on NFS, Linux emulates ``flock`` with POSIX byte-range locks, which are
per process, not per open file. Use a ``postgresql://`` location to share across hosts. Do not
delete the lease directory while leases may be held (a new lock file would be a new lock).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
import weakref
from pathlib import Path

from aml_pipeline.lease.base import (
    DEFAULT_LEASE_NAME,
    EnvLease,
    HolderInfo,
    LeaseError,
    LeaseHandle,
    LeaseStatus,
    _Attempt,
)

_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 60.0
# A refused request reads status to name the holder; a holder that has just been admitted
# writes its holder file a moment later, so an empty picture is re-read for up to this long.
_NAME_GRACE_S = 0.1


def _close_quietly(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _unlink_quietly(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _release_fds(lock_fd: int, holder_fd: int, holder_path: str) -> None:
    # Unregister first, then drop the lock: a holder file never outlives its lock.
    _unlink_quietly(holder_path)
    _close_quietly(holder_fd)
    _close_quietly(lock_fd)


class _FileHandle(LeaseHandle):
    def __init__(self, lease: FileLease, mode: str, holder: str, lock_fd: int) -> None:
        super().__init__(holder=holder, mode=mode, location=lease.location, name=lease.name)
        self._lock_fd = lock_fd
        self.lock_path = str(lease.lock_path)
        self._holder_fd, self.holder_path = lease._register(self)
        self._finalizer = weakref.finalize(
            self, _release_fds, lock_fd, self._holder_fd, self.holder_path
        )

    def is_held(self) -> bool:
        """Whether this lease still holds its lock: not released, and the lock file it locked is
        still the one at its path (someone deleting the lease directory would break that)."""
        if self._released:
            return False
        try:
            mine, there = os.fstat(self._lock_fd), os.stat(self.lock_path)
        except OSError:
            return False
        return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)

    def _release(self) -> None:
        self._finalizer()

    def _drop_inherited(self) -> None:
        # The child closes its copies only: the parent's open file descriptions (and so its
        # locks and holder file) stay as they are.
        args = self._finalizer.detach()
        self._released = True
        if args is not None:
            _obj, _func, (lock_fd, holder_fd, _path), _kwargs = args
            _close_quietly(holder_fd)
            _close_quietly(lock_fd)


class _FileAttempt(_Attempt):
    def __init__(self, lease: FileLease, mode: str, holder: str) -> None:
        self.lease = lease
        self.mode = mode
        self.holder = holder
        self.fd: int | None = lease._open_lock_file()

    def try_acquire(self) -> LeaseHandle | None:
        assert self.fd is not None
        op = fcntl.LOCK_SH if self.mode == "read" else fcntl.LOCK_EX
        try:
            fcntl.flock(self.fd, op | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise LeaseError(f"cannot lock {self.lease.lock_path}: {exc.strerror}") from exc
        fd, self.fd = self.fd, None
        try:
            return _FileHandle(self.lease, self.mode, self.holder, fd)
        except BaseException:
            _close_quietly(fd)
            raise

    def busy_status(self) -> LeaseStatus:
        deadline = time.monotonic() + _NAME_GRACE_S
        while True:
            status = self.lease.status()
            if not status.idle or time.monotonic() >= deadline:
                return status
            time.sleep(0.01)

    def abandon(self) -> None:
        fd, self.fd = self.fd, None
        _close_quietly(fd)


class FileLease(EnvLease):
    """Lease on one host, kept in ``directory`` (see the module docstring for the layout)."""

    backend = "file"

    def __init__(self, directory: str | os.PathLike[str], *, name: str = DEFAULT_LEASE_NAME) -> None:
        path = Path(directory).expanduser().absolute()
        super().__init__(location=str(path), name=name)
        self.directory = path
        self.lock_path = path / f"{self.name}.lock"
        self.holders_dir = path / f"{self.name}.holders"

    def _begin(self, mode: str, holder: str) -> _Attempt:
        return _FileAttempt(self, mode, holder)

    def _open_lock_file(self) -> int:
        try:
            os.makedirs(self.holders_dir, exist_ok=True)
            try:
                return os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except PermissionError:
                # flock needs no write access: a read-only user of a shared directory can lock.
                return os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise LeaseError(
                f"cannot open lease lock file {self.lock_path}: {exc.strerror or exc}"
            ) from exc

    def _register(self, handle: _FileHandle) -> tuple[int, str]:
        """Write the holder file of a just-admitted lease; it is locked before it is visible."""
        token = f"{handle.mode}-{handle.pid}-{uuid.uuid4().hex}"
        tmp = str(self.holders_dir / f"{_TMP_PREFIX}{token}")
        final = str(self.holders_dir / f"{token}.json")
        payload = json.dumps(
            {
                "holder": handle.holder,
                "mode": handle.mode,
                "pid": handle.pid,
                "host": handle.host,
                "since": handle.since,
            }
        ).encode()
        fd = None
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.rename(tmp, final)
        except OSError as exc:
            _close_quietly(fd)
            _unlink_quietly(tmp)
            raise LeaseError(
                f"cannot register lease holder in {self.holders_dir}: {exc.strerror or exc}"
            ) from exc
        except BaseException:
            _close_quietly(fd)
            _unlink_quietly(tmp)
            raise
        return fd, final

    def status(self) -> LeaseStatus:
        readers: list[HolderInfo] = []
        exclusives: list[HolderInfo] = []
        try:
            entries = list(os.scandir(self.holders_dir))
        except FileNotFoundError:
            entries = []
        except OSError as exc:
            raise LeaseError(f"cannot list {self.holders_dir}: {exc.strerror or exc}") from exc
        for entry in entries:
            if entry.name.startswith(_TMP_PREFIX):
                self._reap_stale_tmp(entry.path)
                continue
            if not entry.name.endswith(".json"):
                continue
            info = self._read_live(entry.path, entry.name)
            if info is not None:
                (readers if info.mode == "read" else exclusives).append(info)
        order = lambda h: (h.since if h.since is not None else float("inf"), h.pid or 0)  # noqa: E731
        readers.sort(key=order)
        exclusives.sort(key=order)
        return LeaseStatus(
            location=self.location,
            name=self.name,
            backend=self.backend,
            reader_leases=tuple(readers),
            exclusive=exclusives[0] if exclusives else None,
        )

    @staticmethod
    def _read_live(path: str, filename: str) -> HolderInfo | None:
        """The holder in ``path`` if its owner is alive (holds its lock); else delete the file."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # released meanwhile (or unreadable: not ours to judge)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # its owner holds it: alive
            else:
                # Nobody holds it: the owner died (a live owner unlinks before unlocking).
                _unlink_quietly(path)
                return None
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            _close_quietly(fd)
        mode = "exclusive" if filename.startswith("exclusive-") else "read"
        try:
            data = json.loads(b"".join(chunks))
            since = data.get("since")
            return HolderInfo(
                holder=str(data["holder"]),
                mode=data.get("mode") if data.get("mode") in ("read", "exclusive") else mode,
                pid=int(data["pid"]) if data.get("pid") is not None else None,
                host=str(data["host"]) if data.get("host") is not None else None,
                since=float(since) if since is not None else None,
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            # Alive but unreadable (written by something else): still a holder.
            return HolderInfo(holder=f"<unreadable holder file {filename}>", mode=mode)

    @staticmethod
    def _reap_stale_tmp(path: str) -> None:
        """Delete a temporary holder file left by a holder that died while registering."""
        try:
            if time.time() - os.stat(path).st_mtime < _STALE_TMP_S:
                return
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        finally:
            _close_quietly(fd)
        _unlink_quietly(path)
