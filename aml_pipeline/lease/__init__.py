"""Shared-environment lease: many readers or one exclusive holder (docs/design.md).

``open_lease(location)`` picks the backend from the location:

* a directory path: single host, ``flock`` on a lock file in that directory;
* a ``postgresql://`` URL: several hosts, PostgreSQL session-level advisory locks.

Either way a killed holder's lease disappears with its process (kernel / server side), no
request ever blocks forever, and a refused one raises :class:`EnvBusy` (``ENV_BUSY``) naming
who holds the environment. An exclusive request with ``wait_s > 0`` refuses new read leases
while it waits, so that readers coming and going cannot starve it::

    lease = open_lease(config.env_location())
    with lease.read("train_a"):
        ...                                  # run code in the environment
    with lease.exclusive("rebuild_shared_env", wait_s=30):
        ...                                  # rebuild it
    lease.status().to_dict()                 # readers, exclusive owner, waiting rebuild
"""

from __future__ import annotations

import os

from aml_pipeline.lease.base import (
    DEFAULT_LEASE_NAME,
    MODES,
    EnvBusy,
    EnvLease,
    HolderInfo,
    LeaseError,
    LeaseHandle,
    LeaseStatus,
)
from aml_pipeline.lease.file_lease import FileLease

_PG_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_location(location: str | os.PathLike[str]) -> bool:
    return isinstance(location, str) and location.lower().startswith(_PG_SCHEMES)


def open_lease(
    location: str | os.PathLike[str] | None = None, *, name: str = DEFAULT_LEASE_NAME
) -> EnvLease:
    """The lease at ``location`` (default: ``AML_ENV_LOCATION`` via :mod:`aml_pipeline.config`).

    ``name`` tells environments sharing one location apart (lock file name, advisory-lock key).
    """
    if location is None:
        from aml_pipeline.config import env_location

        location = env_location()
    if is_postgres_location(location):
        from aml_pipeline.lease.pg_lease import PgLease

        return PgLease(str(location), name=name)
    text = os.fspath(location)
    if not text or (isinstance(text, str) and "://" in text):
        raise LeaseError(
            f"lease location {text!r} must be a directory path or a postgresql:// URL"
        )
    return FileLease(text, name=name)


__all__ = [
    "DEFAULT_LEASE_NAME",
    "MODES",
    "EnvBusy",
    "EnvLease",
    "FileLease",
    "HolderInfo",
    "LeaseError",
    "LeaseHandle",
    "LeaseStatus",
    "is_postgres_location",
    "open_lease",
]
