"""What a mapped source's backend does (PostgreSQL, a lake of files, InfluxDB), as columns.

:class:`~aml_pipeline.sources.mapped.MappedTsdb` implements the port once, over any backend:
runs, the node catalog, pages with their cursor, versions. A backend only answers narrow
questions in the source's own terms: one node's points in a time range, in the source's
deterministic order; the rows of a runs or node table; one aggregate per run window. A new
backend subclasses :class:`Backend` and writes the methods it does not default
(``docs/architecture.md``, "Adding a backend").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aml_pipeline.sources.description import Quality
from aml_pipeline.sources.timecodec import TimeCodec

NO_END = 2**63 - 1  # a run in progress reaches to the end of time


@dataclass(frozen=True)
class NodeRef:
    """Where one node's points are: the value the points hold for it (``key``, narrow layouts),
    or its own column (``column``, wide layouts), with that column's quality mapping."""

    node_id: str
    key: Any = None
    column: str | None = None
    quality: Quality | None = None


@dataclass
class Series:
    """Points of one node in the source's order: ``ts`` (epoch ms, ascending), ``value``,
    ``state`` (0 good)."""

    ts: np.ndarray
    value: np.ndarray
    state: np.ndarray

    def __len__(self) -> int:
        return int(self.ts.shape[0])

    @classmethod
    def empty(cls) -> Series:
        return cls(np.empty(0, np.int64), np.empty(0, np.float64), np.empty(0, np.int32))


@dataclass(frozen=True)
class Window:
    """A run's time range ``[lo, hi]`` (epoch ms, inclusive) and its line (for sources whose
    points name their line)."""

    lo: int
    hi: int
    line: str | None = None


@dataclass(frozen=True)
class TableRead:
    """Which columns of a runs or node table to read: field name -> column name. ``times`` are
    fields read as epoch ms (None where NULL) with the time type declared (or detected) for them."""

    key: str  # the description key, for messages: "runs", "node_table"
    relation: Any  # the description's table/files/query model
    columns: dict[str, str]
    times: tuple[str, ...] = ()
    time_type: str | None = None
    time_zone: str | None = None


class Backend:
    """What a mapped source's backend answers. ``fetch``, ``distinct_keys``, ``max_time``,
    ``aggregates`` and ``describe`` are its own to write; ``fetch_many``, ``read_table`` and
    ``close`` have defaults (node by node; runs and node tables from files; nothing to close)."""

    label: str  # the source in messages: "postgresql://reader@host/plant"
    codec: TimeCodec | None = None  # how the points' time column is stored (None: the backend's own)
    loaded: Any  # the LoadedDescription it reads

    def fetch(self, node: NodeRef, lo: int, hi: int, line: str | None, limit: int) -> Series:
        """The first ``limit`` points of ``node`` with ``lo <= ts <= hi``, in the source order
        (time, then the mapping's tie order). An answer the server cut short (a row limit) is a
        :class:`~aml_pipeline.errors.TruncationError`, never fewer points."""
        raise NotImplementedError

    def fetch_many(
        self, nodes: Sequence[NodeRef], lo: int, hi: int, line: str | None, limit: int, hold: int = 0
    ) -> list[Series] | None:
        """Every point of each node in ``[lo, hi]`` in one read, or None if there are more than
        ``limit`` in all (or the backend reads node by node, the default). The backend may keep
        up to ``hold`` points it read past ``hi`` for the next call (a run read after this one)."""
        return None

    def distinct_keys(self) -> list[Any]:
        """The node values the points hold (narrow layouts without a node catalog)."""
        raise NotImplementedError

    def max_time(self, nodes: Sequence[NodeRef]) -> int | None:
        """The latest point time (epoch ms) of any of ``nodes``; None when they have none."""
        raise NotImplementedError

    def aggregates(self, windows: Sequence[Window], nodes: Sequence[NodeRef]) -> list[Any]:
        """For each window, a JSON-able summary of every point of ``nodes`` in it that changes
        when a point is added, deleted or corrected (count, time range, a checksum)."""
        raise NotImplementedError

    def read_table(self, read: TableRead) -> dict[str, list[Any]]:
        """Every row of a runs or node table, as lists per field (``read.times`` in epoch ms);
        by default from the files the description names."""
        from aml_pipeline.sources.lake import read_file_table

        return read_file_table(self.loaded, read)

    def describe(self) -> dict[str, Any]:
        """What the backend assumed, for ``source check``."""
        raise NotImplementedError

    def engineering(self, nodes: Sequence[NodeRef]) -> dict[str, dict[str, Any]]:
        """What the source itself says of each node's unit and range, where it says anything
        (``{node_id: {"unit": str | None, "range": [low, high] | None}}``), for ``source check``
        to set beside the description's; by default nothing."""
        return {}

    def close(self) -> None:
        """Let go of connections."""


def source_order(node: np.ndarray, keys: Sequence[np.ndarray]) -> np.ndarray:
    """The permutation that orders rows by ``node`` (small integers), then by ``keys`` in turn
    (time, the order columns, ...), ties kept in the order the rows came (a stable sort): what
    ``ORDER BY`` would give, computed in numpy.

    Rows usually arrive in the source's physical order (a table's insertion order, a file's row
    order), which is time order within each node: a stable grouping by node (a radix sort) is
    then enough. That is checked, comparing the other keys only where times tie; otherwise a
    full (stable) ``lexsort``.
    """
    n = node.shape[0]
    if n < 2:
        return np.arange(n)
    small = node.astype(np.int16) if 0 <= node.min() and node.max() < 2**15 else node
    perm = np.argsort(small, kind="stable")
    nd = np.diff(node[perm])
    t = keys[0][perm]
    dt = np.diff(t)
    if not bool(np.any((nd == 0) & ~(dt >= 0))):  # NaN times are never in order
        tied = np.flatnonzero((nd == 0) & (dt == 0))
        if tied.size == 0 or _ascending([k[perm][tied] for k in keys[1:]], [k[perm][tied + 1] for k in keys[1:]]):
            return perm
    return np.lexsort((np.arange(n), *reversed(keys), node))


def _ascending(first: Sequence[np.ndarray], second: Sequence[np.ndarray]) -> bool:
    """Whether each row of ``first`` is at most the same row of ``second`` in lexicographic order
    of the keys (equal counts as in order; NaN never does)."""
    if not first:
        return True
    ge = np.ones(first[0].shape[0], dtype=bool)
    for a, b in zip(reversed(first), reversed(second)):
        d = b.astype(np.float64) - a.astype(np.float64) if a.dtype.kind == "u" else b - a
        ge = (d > 0) | ((d == 0) & ge)
    return bool(np.all(ge))


# Up to this many nodes, rows are split by one comparison per node (each keeps its order);
# beyond, by a stable sort on the node.
_SPLIT_BY_MASK = 32
# Rows that come in runs of one node this long on average (files sorted by node, then time)
# are split by slicing the runs instead.
_MIN_BLOCK_ROWS = 64


def _node_blocks(node: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Start and stop of each maximal run of equal ``node`` values, if they are long on
    average; else None."""
    n = node.shape[0]
    change = np.flatnonzero(node[1:] != node[:-1]) + 1
    if (change.shape[0] + 1) * _MIN_BLOCK_ROWS > n:
        return None
    return np.concatenate(([0], change)), np.append(change, n)


def _joined(column: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    if starts.shape[0] == 1:
        return column[starts[0] : stops[0]]
    return np.concatenate([column[a:b] for a, b in zip(starts.tolist(), stops.tolist())])


def split_by_node(node: np.ndarray, n_nodes: int, keys: Sequence[np.ndarray],
                  payload: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
    """For each node ``0 .. n_nodes - 1``, its rows' ``keys`` and ``payload`` columns, ordered as
    :func:`source_order` orders them (by ``keys``, ties in arrival order): the rows usually
    arrive in time order within each node, which is then only checked."""
    columns = [*keys, *payload]
    blocks = _node_blocks(node) if node.shape[0] > 1 else None
    if blocks is None and n_nodes > _SPLIT_BY_MASK:
        order = source_order(node, list(keys))
        node = node[order]
        bounds = np.searchsorted(node, np.arange(n_nodes + 1))
        return [[c[order[a:b]] for c in columns] for a, b in zip(bounds[:-1], bounds[1:])]
    if blocks is not None:
        starts, stops = blocks
        block_node = node[starts]
    out = []
    for i in range(n_nodes):
        if blocks is not None:
            mine = np.flatnonzero(block_node == i)
            part = [_joined(c, starts[mine], stops[mine]) if mine.shape[0] else c[:0] for c in columns]
        else:
            rows = np.flatnonzero(node == i)
            part = [c[rows] for c in columns]
        ordered = part[: len(keys)]
        if part[0].shape[0] > 1 and not _keys_ascending(ordered):
            order = np.lexsort((np.arange(part[0].shape[0]), *reversed(ordered)))
            part = [c[order] for c in part]
        out.append(part)
    return out


def joined_in_order(pieces: Sequence[Sequence[np.ndarray]], n_keys: int) -> list[np.ndarray]:
    """One node's rows from ``pieces`` (each a list of columns, the first ``n_keys`` the keys,
    each piece already in order by them and arriving before the next), ordered as
    :func:`split_by_node` orders them: by the keys, ties in arrival order."""
    full = [p for p in pieces if p[0].shape[0]]
    if len(full) <= 1:
        return list(full[0] if full else pieces[0])
    columns = [np.concatenate(c) for c in zip(*full)]
    # Each piece is in order: the whole is, if each piece's last row is not after the next one's
    # first (the rows at the seams, not every row, are compared).
    seams = [(a, b) for a, b in zip(full[:-1], full[1:])]
    if not all(_ascending([k[-1:] for k in a[:n_keys]], [k[:1] for k in b[:n_keys]]) for a, b in seams):
        order = np.lexsort((np.arange(columns[0].shape[0]), *reversed(columns[:n_keys])))
        columns = [c[order] for c in columns]
    return columns


def _keys_ascending(keys: Sequence[np.ndarray]) -> bool:
    t = keys[0]
    dt = np.diff(t)
    if not bool(np.all(dt >= 0)):
        return False
    tied = np.flatnonzero(dt == 0)
    return tied.size == 0 or _ascending([k[tied] for k in keys[1:]], [k[tied + 1] for k in keys[1:]])
