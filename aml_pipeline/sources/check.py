"""``aml-pipeline source check FILE.yaml``: connect through a description and say what is there.

It reads what a build would read first (the node catalog, the runs, the latest point, the run
versions) and the points of one run, node by node, and reports them with what it assumed (the
backend, the time type and zone, the order of points sharing a timestamp). Any problem is the
first error a build would meet, as one line naming the key, table, column, permission, run or
node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aml_pipeline.sources import SCHEME
from aml_pipeline.sources.backend import NO_END
from aml_pipeline.sources.description import load_description
from aml_pipeline.sources.mapped import MappedTsdb
from aml_pipeline.plausible_time import ms_text
from aml_pipeline.tsdb.port import iter_node_pages

# Points counted per node of the sample run at most (a check, not a full read).
SAMPLE_POINTS = 1_000_000


def _iso(ms: int | None) -> str | None:
    return None if ms is None else ms_text(ms)


def check_source(path: str | Path, *, sample_run: str | None = None) -> dict[str, Any]:
    loaded = load_description(path)
    with MappedTsdb(f"{SCHEME}{loaded.path}", loaded) as db:
        found: dict[str, Any] = {"description": str(loaded.path), **db.describe()}
        nodes = db.list_nodes()
        found["nodes"] = [
            {"node_id": n.node_id, "unit": n.unit, "range": [n.range_lo, n.range_hi]} for n in nodes
        ]
        found["engineering"] = engineering = db.engineering()
        units = {n.node_id: n.unit for n in nodes}
        found["unit_conflicts"] = [
            {"node_id": node, "description": units[node], "source": e["unit"]}
            for node, e in engineering.items()
            if units.get(node) and e["unit"] and not same_unit(units[node], e["unit"])
        ]
        runs = db.list_runs(None, finished_only=False)
        finished = [r for r in runs if r.finished]
        found["runs"] = {
            "count": len(runs),
            "finished": len(finished),
            "from": runs[0].run_id if runs else None,
            "first_start": _iso(min((r.started_at for r in runs), default=None)),
            "last_end": _iso(max((r.ended_at for r in finished), default=None)),
            "form": loaded.spec.runs.form,
        }
        watermark = db.availability_watermark()
        found["latest_point"] = _iso(watermark)
        found["versions"] = len(db.run_versions([r.run_id for r in runs]))
        pick = None
        if sample_run is not None:
            pick = db.get_run(sample_run)
        elif finished:
            pick = finished[-1]
        elif runs:
            pick = runs[-1]
        if pick is not None:
            end = NO_END if pick.ended_at is None else pick.ended_at
            points = {}
            for n in nodes:
                count = 0
                for page, _ in iter_node_pages(db, n.node_id, pick.run_id, pick.started_at, end):
                    count += len(page)
                points[n.node_id] = count
                if count > SAMPLE_POINTS:
                    break
            found["sample_run"] = {"run_id": pick.run_id, "started_at": _iso(pick.started_at),
                                   "ended_at": _iso(pick.ended_at), "points": points}
    return found


def same_unit(a: str, b: str) -> bool:
    """Whether two spellings name one unit as far as text tells: case, spaces and the degree
    sign's spellings aside (``degC``, ``°C``, ``deg C``)."""

    def key(u: str) -> str:
        return u.casefold().replace(" ", "").replace("°", "deg").replace("degrees", "deg").replace("degree", "deg")

    return key(a) == key(b)


def _node_text(node_id: str, unit: str | None, bounds: list[float | None] | None) -> str:
    """``TI101 [degC] 0..150``: the unit where there is one, the range where both bounds are."""
    return (node_id + (f" [{unit}]" if unit else "")
            + (f" {bounds[0]:g}..{bounds[1]:g}" if bounds is not None and None not in bounds else ""))


def render(found: dict[str, Any]) -> str:
    lines = [f"source {found['description']}: {found['backend']}"
             + (f" {found.get('connection') or found.get('files')}" if found.get("connection") or found.get("files") else "")
             + (f" (role {found['role']})" if found.get("role") else "")]
    where = found.get("points") or found.get("measurement") or found.get("files")
    lines.append(f"points: {where} ({found['layout']} layout)"
                 + (f", {found['file_count']} files ({found['format']})" if "file_count" in found else ""))
    t = found["time"]
    lines.append(f"time: column {t['column']}, {t['type']}")
    lines.append(f"order of points at one time: {found['order']}")
    nodes = found["nodes"]
    shown = ", ".join(_node_text(n["node_id"], n["unit"], n["range"]) for n in nodes[:12])
    lines.append(f"nodes: {len(nodes)}: {shown}" + (" ..." if len(nodes) > 12 else ""))
    engineering = found.get("engineering") or {}
    if engineering:
        said = ", ".join(_node_text(n, e["unit"], e["range"]) for n, e in list(engineering.items())[:12])
        lines.append(f"the source's own units and ranges ({len(engineering)} nodes): {said}"
                     + (" ..." if len(engineering) > 12 else ""))
    for c in found.get("unit_conflicts") or ():
        lines.append(f"note: node {c['node_id']}: the description says unit {c['description']!r}, the source says "
                     f"{c['source']!r}; the description's unit is the one recorded (check which is right)")
    r = found["runs"]
    lines.append(f"runs ({r['form']}): {r['count']}, {r['finished']} finished"
                 + (f", {r['first_start']} .. {r['last_end'] or 'running'}" if r["count"] else ""))
    lines.append(f"latest point: {found['latest_point'] or 'none'}")
    s = found.get("sample_run")
    if s:
        lines.append(f"sample run {s['run_id']} ({s['started_at']} .. {s['ended_at'] or 'running'}): "
                     + ", ".join(f"{k} {v:,}" for k, v in s["points"].items()) + " points")
    return "\n".join(lines)
