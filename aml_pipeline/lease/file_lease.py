"""Single-host lease: ``flock`` on a lock file in a directory.

Layout inside the lease directory (``NAME`` defaults to ``aml-shared-env``)::

    NAME.lock                         the lock: LOCK_SH per reader, LOCK_EX for the exclusive
    NAME.gate                         the gate: LOCK_EX while a rebuild waits for the lock;
                                      LOCK_SH by every other request while it tries the lock
    NAME.holders/<mode>-<pid>-<uuid>.json
                                      one file per held lease, and one (``pending-...``) for
                                      the waiting rebuild, for status only; its owner holds
                                      LOCK_EX on it for as long as it lives

Admission is decided by the kernel locks on ``NAME.gate`` and ``NAME.lock`` alone (non-blocking
``flock``): a shared and an exclusive lock on the same file never coexist, whatever the holder
files say. A request that is not a waiting rebuild takes ``LOCK_SH`` on the gate (refused while
a rebuild waits), tries the lock, and lets go of the gate: once a waiting rebuild holds the gate,
every reader that got through it already holds the lock, and no new one can.
Each lease opens the lock file afresh, because ``flock`` locks belong to an open file
description: two leases in one process are two independent locks (so an exclusive request from
a process that holds a read lease is refused, never deadlocked).

Nothing is ever cleaned up by hand. When a holder dies the kernel closes its descriptors,
which drops both its lock and the lock on its holder file; ``status`` lists a holder file only
while its lock is held (a probe with ``LOCK_SH | LOCK_NB`` fails), and deletes the files of dead
holders as it meets them. A holder file is created without a name (``O_TMPFILE``), locked,
written and only then linked into place, so ``status`` never sees a live holder's file unlocked
and a holder killed on the way leaves no file (where ``O_TMPFILE`` is missing: under a temporary
name, renamed into place, that ``status`` deletes once it is unlocked and a minute old).

Local filesystems only: on NFS, Linux emulates ``flock`` with POSIX byte-range locks, which are
per process, not per open file. Use a ``postgresql://`` location to share across hosts. Do not
delete the lease directory while leases may be held (a new lock file would be a new lock).
"""

from __future__ import annotations

import errno
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
    hostname,
    retry_briefly,
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


def _open_unnamed(directory: Path) -> int | None:
    """A new file in ``directory`` with no name yet (``O_TMPFILE``): a holder killed before
    linking it into place leaves nothing behind. None where the system cannot do that."""
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return None  # the filesystem does not support it
        raise


def _link_unnamed(fd: int, directory: Path, path: str) -> None:
    # linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N, as open(2) documents for O_TMPFILE; Python
    # passes that flag only when a directory descriptor is given (plain link() would try to link
    # the /proc symlink itself).
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


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
        self._holder_fd, self.holder_path = lease._register(mode, holder, self.pid, self.since)
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
    def __init__(self, lease: FileLease, mode: str, holder: str, wait: float) -> None:
        super().__init__(mode, holder, wait)
        self.lease = lease
        # While this (waiting exclusive) request holds the gate: its pending-... holder file.
        self.pending: tuple[int, str] | None = None
        self.gate_fd: int | None = None
        self.fd: int | None = lease._open_lock_file(lease.lock_path)
        try:
            self.gate_fd = lease._open_lock_file(lease.gate_path)
        except BaseException:
            self.abandon()
            raise

    def _flock(self, fd: int, op: int, path: Path) -> bool:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as exc:
            raise LeaseError(f"cannot lock {path}: {exc.strerror}") from exc

    def try_acquire(self) -> LeaseHandle | None:
        assert self.fd is not None and self.gate_fd is not None
        lease = self.lease
        if not self.waits:
            if not self._flock(self.gate_fd, fcntl.LOCK_SH, lease.gate_path):
                self.refused_by = "gate"
                return None
            try:
                op = fcntl.LOCK_SH if self.mode == "read" else fcntl.LOCK_EX
                granted = self._flock(self.fd, op, lease.lock_path)
            finally:
                fcntl.flock(self.gate_fd, fcntl.LOCK_UN)
            self.refused_by = None if granted else "lock"
            return self._grant() if granted else None
        if self.pending is None:
            if not retry_briefly(lambda: self._flock(self.gate_fd, fcntl.LOCK_EX, lease.gate_path)):
                self.refused_by = "gate"  # another rebuild waits
                return None
            try:
                self.pending = lease._register(
                    "pending", self.holder, os.getpid(), self.since, deadline=self.deadline
                )
            except BaseException:
                fcntl.flock(self.gate_fd, fcntl.LOCK_UN)
                raise
        if not self._flock(self.fd, fcntl.LOCK_EX, lease.lock_path):
            self.refused_by = "lock"
            return None
        handle = self._grant()
        self.withdraw()  # the lock itself keeps readers out now
        return handle

    def _grant(self) -> LeaseHandle:
        fd, self.fd = self.fd, None
        assert fd is not None
        try:
            return _FileHandle(self.lease, self.mode, self.holder, fd)
        except BaseException:
            _close_quietly(fd)
            raise

    def busy_status(self) -> LeaseStatus:
        # Refused at the gate: the waiting rebuild's holder file appears a moment after it took
        # the gate. Refused by the lock: the holders' files likewise.
        wanted = (
            (lambda s: s.waiting is not None or s.exclusive is not None)
            if self.refused_by == "gate"
            else (lambda s: not s.idle)
        )
        deadline = time.monotonic() + _NAME_GRACE_S
        while True:
            status = self.lease.status()
            if wanted(status) or time.monotonic() >= deadline:
                return status
            time.sleep(0.01)

    def withdraw(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            # Unregister, then drop the holder file's lock, then the gate: a status that lists
            # this request as waiting has seen it while it still held the gate.
            fd, path = pending
            _unlink_quietly(path)
            _close_quietly(fd)
            if self.gate_fd is not None:
                fcntl.flock(self.gate_fd, fcntl.LOCK_UN)

    def abandon(self) -> None:
        self.withdraw()
        fd, self.fd = self.fd, None
        gate_fd, self.gate_fd = self.gate_fd, None
        _close_quietly(fd)
        _close_quietly(gate_fd)

    def _drop_inherited(self) -> None:
        # Close the child's copies only: the parent keeps its gate, lock and holder file.
        pending, self.pending = self.pending, None
        for fd in (self.fd, self.gate_fd, pending[0] if pending else None):
            _close_quietly(fd)
        self.fd = self.gate_fd = None


class FileLease(EnvLease):
    """Lease on one host, kept in ``directory`` (see the module docstring for the layout)."""

    backend = "file"

    def __init__(self, directory: str | os.PathLike[str], *, name: str = DEFAULT_LEASE_NAME) -> None:
        path = Path(directory).expanduser().absolute()
        super().__init__(location=str(path), name=name)
        self.directory = path
        self.lock_path = path / f"{self.name}.lock"
        self.gate_path = path / f"{self.name}.gate"
        self.holders_dir = path / f"{self.name}.holders"

    def _begin(self, mode: str, holder: str, wait: float) -> _Attempt:
        return _FileAttempt(self, mode, holder, wait)

    def _open_lock_file(self, path: Path) -> int:
        try:
            os.makedirs(self.holders_dir, exist_ok=True)
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except PermissionError:
                # flock needs no write access: a read-only user of a shared directory can lock.
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise LeaseError(f"cannot open lease lock file {path}: {exc.strerror or exc}") from exc

    def _register(
        self, kind: str, holder: str, pid: int, since: float, *, deadline: float | None = None
    ) -> tuple[int, str]:
        """Write the holder file of a just-admitted lease (``kind`` = its mode) or of the waiting
        rebuild (``pending``); it is locked before it is visible."""
        token = f"{kind}-{pid}-{uuid.uuid4().hex}"
        tmp = str(self.holders_dir / f"{_TMP_PREFIX}{token}")
        final = str(self.holders_dir / f"{token}.json")
        record = {
            "holder": holder,
            "mode": "exclusive" if kind == "pending" else kind,
            "pid": pid,
            "host": hostname(),
            "since": since,
        }
        if deadline is not None:
            record["deadline"] = deadline
        payload = json.dumps(record).encode()
        fd = None
        try:
            fd = _open_unnamed(self.holders_dir)
            if fd is None:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            else:
                tmp = None
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            if tmp is None:
                _link_unnamed(fd, self.holders_dir, final)
            else:
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
        waiting: list[HolderInfo] = []
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
            if info is None:
                continue
            if entry.name.startswith("pending-"):
                waiting.append(info)
            else:
                (readers if info.mode == "read" else exclusives).append(info)
        order = lambda h: (h.since if h.since is not None else float("inf"), h.pid or 0)  # noqa: E731
        for found in (readers, exclusives, waiting):
            found.sort(key=order)
        return LeaseStatus(
            location=self.location,
            name=self.name,
            backend=self.backend,
            reader_leases=tuple(readers),
            exclusive=exclusives[0] if exclusives else None,
            waiting=waiting[0] if waiting else None,
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
        mode = "read" if filename.startswith("read-") else "exclusive"
        try:
            data = json.loads(b"".join(chunks))
            since, deadline = data.get("since"), data.get("deadline")
            return HolderInfo(
                holder=str(data["holder"]),
                mode=data.get("mode") if data.get("mode") in ("read", "exclusive") else mode,
                pid=int(data["pid"]) if data.get("pid") is not None else None,
                host=str(data["host"]) if data.get("host") is not None else None,
                since=float(since) if since is not None else None,
                deadline=float(deadline) if deadline is not None else None,
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
