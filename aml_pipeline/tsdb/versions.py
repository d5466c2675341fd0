"""Per-run data versions: one opaque string per run that changes whenever the run's points or its
record change, and only then.

A version is a hash chain. Every change to a run (its record created or changed, points appended,
its points replaced) hashes the previous version with a digest of the change, inside the ingest
transaction that makes the change. Hence:

* an ingest whose points are all already stored, and whose run records equal the stored ones,
  changes no version (nothing was written);
* the same ingest history gives the same versions in any database and in either adapter (the
  digests hash ids and values, never surrogate keys or ``seq``), so a TSDB re-created from the
  same files does not make built runs stale;
* unlike a counter, a restored backup followed by different ingests never reproduces an old
  version with other data.

Reading a version is one indexed lookup per run; nothing scans the points table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import numpy as np

from aml_pipeline.tsdb.port import Run

VERSION_HEX = 32  # 128 bits


def chain(previous: str, kind: str, digest: bytes) -> str:
    """The version after a change of ``kind`` (record, append, replace) with ``digest``."""
    h = hashlib.sha256()
    h.update(previous.encode())
    h.update(b"\0" + kind.encode() + b"\0")
    h.update(digest)
    return h.hexdigest()[:VERSION_HEX]


def record_digest(run: Run) -> bytes:
    """sha256 of every field of the run record (a field added to :class:`Run` is covered too)."""
    text = json.dumps(dataclasses.asdict(run), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()


def migrated_version(run: Run, points: int, min_seq: int | None, max_seq: int | None) -> str:
    """The first version of a run stored before versions existed (TSDB schema version 1).

    Computed from the record and the run's point count and ``seq`` range, which a version-1
    database can report without knowing the history: a version-1 read-only handle and the
    migration to version 2 give the same string, so migrating makes no run stale.
    """
    tail = json.dumps([points, min_seq, max_seq]).encode()
    return chain("", "v1", record_digest(run) + tail)


def points_digests(
    run_codes: np.ndarray,
    n_runs: int,
    node_codes: np.ndarray,
    node_ids: Sequence[str],
    ts: np.ndarray,
    value: np.ndarray,
    state: np.ndarray,
) -> list[bytes | None]:
    """Per run code (``0 .. n_runs - 1``), the sha256 of the points written for that run in their
    row order, or None for a run with no points here.

    A run's nodes are numbered by their sorted ids (not by surrogate keys, not by first
    appearance in a file that may hold other runs), so the digest depends only on what was
    written to the run.
    """
    codes = np.asarray(run_codes)
    if codes.shape[0] < 2 or bool(np.all(codes[1:] >= codes[:-1])):
        # Files usually come grouped by run: each run's rows are one slice, nothing to gather.
        order: np.ndarray | None = None
        bounds = np.searchsorted(codes, np.arange(n_runs + 1), side="left")
    else:
        # A stable sort of small integers is a radix sort in numpy: each run's rows, in order.
        small = codes.astype(np.int16) if n_runs <= np.iinfo(np.int16).max else codes
        order = np.argsort(small, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(n_runs + 1), side="left")
    out: list[bytes | None] = []
    for r in range(n_runs):
        a, b = int(bounds[r]), int(bounds[r + 1])
        if a == b:
            out.append(None)
            continue
        rows = slice(a, b) if order is None else order[a:b]
        run_nodes = node_codes[rows]
        present = np.flatnonzero(np.bincount(run_nodes, minlength=len(node_ids)))
        ids = [str(node_ids[int(c)]) for c in present]
        lookup = np.empty(len(node_ids), dtype=np.int32)
        lookup[present] = np.argsort(np.argsort(np.array(ids, dtype=object), kind="stable")).astype(np.int32)
        h = hashlib.sha256()
        h.update(json.dumps(sorted(ids)).encode())
        h.update(np.ascontiguousarray(lookup[run_nodes]).data)
        for column in (ts, value, state):
            h.update(np.ascontiguousarray(column[rows]).data)
        out.append(h.digest())
    return out
