"""Small helpers shared by the benchmark modules: memory, scratch directories, printing results."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any


def proc_status_kb(field: str, pid: int | str = "self") -> int | None:
    """A ``/proc/<pid>/status`` field in kB (VmRSS, VmHWM, ...), None where unavailable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def remove_tree(path: Path) -> None:
    """Remove ``path`` if it exists, published (read-only) snapshot directories included."""

    def make_writable(func, p, _exc):
        parent = os.path.dirname(p)
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IWUSR | stat.S_IXUSR)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, os.stat(p).st_mode | stat.S_IWUSR | stat.S_IXUSR | stat.S_IRUSR)
        func(p)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=make_writable)


def settle(*remove: Path) -> None:
    """Remove ``remove`` and flush every dirty page to disk, before a timed side starts.

    On ext4 (data=ordered, online discard) an fsync commits the journal, which writes back
    other files' dirty data and discards freed blocks first: without this, a side would pay
    for the writes and deletions of the side that ran before it.
    """
    for path in remove:
        remove_tree(path)
    os.sync()


def fresh_dir(path: Path) -> Path:
    remove_tree(path)
    path.mkdir(parents=True)
    return path


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def workload_points(tsdb_url: str, spec):
    """The finished runs in ``spec``'s scope, the node catalog, and every point of the spec's
    nodes in them as :class:`~aml_pipeline.tsdb.port.PointColumns`, read through the port and put
    back in ingestion (seq) order, so a copy of them resolves duplicate timestamps as the source
    does."""
    import numpy as np

    from aml_pipeline.pipeline.plan import run_scope
    from aml_pipeline.pipeline.stages.raw import run_bounds
    from aml_pipeline.tsdb import PointColumns
    from aml_pipeline.tsdb_open import open_tsdb
    from aml_pipeline_tests.tsdb.series import fetch_node_series

    parts = []
    with open_tsdb(tsdb_url) as src:
        runs = src.list_runs(run_scope(spec), finished_only=True)
        nodes = src.list_nodes()
        for run in runs:
            lo, hi = run_bounds(spec, run)
            for node in spec.node_ids:
                parts.append(fetch_node_series(src, node, run.run_id, lo, hi))
    order = np.argsort(np.concatenate([p.seq for p in parts]), kind="stable")
    points = PointColumns(
        np.concatenate([np.full(len(p), p.run_id, dtype=object) for p in parts])[order],
        np.concatenate([np.full(len(p), p.node_id, dtype=object) for p in parts])[order],
        np.concatenate([p.ts for p in parts])[order].astype(np.int64),
        np.concatenate([p.value for p in parts])[order].astype(np.float64),
        np.concatenate([p.state for p in parts])[order].astype(np.int32),
    )
    return runs, nodes, points


def print_results(res: Any, json_path: Path | None) -> None:
    """A benchmark module's results as indented JSON on stdout, and into ``json_path`` if given."""
    text = json.dumps(res, indent=1)
    if json_path:
        json_path.write_text(text + "\n")
    print(text)
