"""Splitting a scan's rows into per-node series (``sources/backend.py``), against ``ORDER BY``
done the plain way: a stable lexsort on (node, time, order columns)."""

from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.sources.backend import _node_blocks, split_by_node

N_NODES = 5


def _reference(node, keys, payload):
    order = np.lexsort((np.arange(node.shape[0]), *reversed(keys), node))
    node = node[order]
    return [[c[order][node == i] for c in (*keys, *payload)] for i in range(N_NODES)]


def _files(rng, *, sorted_by_node: bool, files: int = 3, rows: int = 4000, backwards: bool = False):
    """Rows as a scan of ``files`` files returns them: each file a time range (later files later,
    or earlier with ``backwards``), its rows in time order or sorted by node then time; times
    tie often (whole seconds), and a tie's rows differ in value so their order shows."""
    node, t, v = [], [], []
    for f in range(files):
        start = (files - 1 - f if backwards else f) * 1_000
        ts = np.sort(rng.integers(start, start + 1_000, rows))
        nd = rng.integers(0, N_NODES - 1, rows)  # the last node has no rows
        if sorted_by_node:
            o = np.lexsort((np.arange(rows), ts, nd))
            ts, nd = ts[o], nd[o]
        node.append(nd)
        t.append(ts)
        v.append(rng.standard_normal(rows))
    return np.concatenate(node), np.concatenate(t), np.concatenate(v)


@pytest.mark.parametrize("sorted_by_node", [False, True], ids=["time_order", "sorted_by_node"])
@pytest.mark.parametrize("backwards", [False, True], ids=["files_in_time_order", "files_out_of_time_order"])
def test_split_by_node_orders_as_order_by_would(sorted_by_node, backwards):
    rng = np.random.default_rng(7)
    node, t, v = _files(rng, sorted_by_node=sorted_by_node, backwards=backwards)
    # the rows of a node-sorted scan come in long runs of one node, and are split by slicing those
    assert (_node_blocks(node) is not None) == sorted_by_node
    seq = np.arange(node.shape[0])  # the arrival order, carried along to check ties kept it
    got = split_by_node(node, N_NODES, [t], [v, seq])
    want = _reference(node, [t], [v, seq])
    assert len(got) == N_NODES
    for i, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b, err_msg=f"node {i}")
    assert got[N_NODES - 1][0].shape == (0,)


def test_split_by_node_orders_ties_by_the_order_columns_before_arrival():
    rng = np.random.default_rng(3)
    node, t, v = _files(rng, sorted_by_node=True)
    order_column = rng.integers(0, 3, node.shape[0])  # e.g. a sequence column of the table
    got = split_by_node(node, N_NODES, [t, order_column], [v])
    want = _reference(node, [t, order_column], [v])
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b)


def test_short_runs_of_one_node_are_not_taken_for_blocks():
    node = np.repeat(np.arange(N_NODES), 3)  # runs of 3 rows
    assert _node_blocks(np.tile(node, 100)) is None
    assert _node_blocks(np.repeat(np.arange(N_NODES), 1000)) is not None


@pytest.mark.parametrize("seam", ["in_order", "tie_in_order", "tie_out_of_order", "overlap"])
def test_joined_in_order_compares_the_seams_of_ordered_pieces(seam):
    """Pieces each in (time, order column) order, the second starting after, at or before the
    first's last row: the join equals a stable lexsort of their concatenation."""
    from aml_pipeline.sources.backend import joined_in_order

    a_t, a_o = np.array([1, 2, 5]), np.array([0, 0, 3])
    b_t = {"in_order": [6, 7], "tie_in_order": [5, 7], "tie_out_of_order": [5, 7], "overlap": [3, 7]}[seam]
    b_o = {"in_order": [0, 0], "tie_in_order": [4, 0], "tie_out_of_order": [1, 0], "overlap": [0, 0]}[seam]
    pieces = [[a_t, a_o, np.array([10.0, 11.0, 12.0])], [np.array(b_t), np.array(b_o), np.array([20.0, 21.0])]]
    got = joined_in_order(pieces, 2)
    cat = [np.concatenate(c) for c in zip(*pieces)]
    order = np.lexsort((np.arange(5), cat[1], cat[0]))
    for g, c in zip(got, cat):
        np.testing.assert_array_equal(g, c[order])
    assert (got[2].tolist() == [10.0, 11.0, 12.0, 20.0, 21.0]) == (seam in ("in_order", "tie_in_order"))
