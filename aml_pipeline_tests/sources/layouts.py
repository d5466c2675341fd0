"""The simulated plant laid out the ways plants keep their data, for the mapped-source tests.

Each ``*_layout`` function writes the same plant (its points, runs and nodes) into one shape
and returns the source description (a dict) that maps it back; the tests build a dataset
through the description and compare it with a build from the embedded file holding the same
points. The layouts vary what a plant varies: time types and zones, quality codes (OPC UA
numbers, status words), tag ids through a tag table, monthly tables, hive folders.
"""

from __future__ import annotations

import datetime as dt
import json
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import yaml

from aml_pipeline.simulate.plant import SimulatedPlant
from aml_pipeline.tsdb.port import PointColumns

# The plant's states as OPC UA quality codes and as status words.
OPC = {0: 192, 1: 64, 2: 0}
WORDS = {0: "Good", 1: "Uncertain", 2: "Bad"}
OPC_QUALITY = {"good": [192], "states": {64: 1}, "other": 2}
WORD_QUALITY = {"good": ["Good"], "states": {"Uncertain": 1}, "other": 2}
# A tag's id in the historian's tag table.
TAG_ID_BASE = 1000


def write_description(path: Path, desc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(desc, sort_keys=False))
    return path


def node_entries(plant: SimulatedPlant) -> dict[str, dict[str, Any]]:
    return {n.node_id: {"unit": n.unit, "low": n.range_lo, "high": n.range_hi} for n in plant.nodes}


def runs_rows(plant: SimulatedPlant) -> list[dict[str, Any]]:
    return [
        {"batch": r.run_id, "started": r.started_at, "finished": r.ended_at, "line": r.line_id,
         "product": r.product_id, "recipe": r.recipe_id, "recipe_rev": r.recipe_version,
         "recipe_sha": r.recipe_content_hash, "origin": r.evidence_source, "checked": r.context_confirmed}
        for r in plant.runs
    ]


RUNS_MAPPING = {
    "id": "batch", "start": "started", "end": "finished", "line": "line", "product": "product",
    "recipe": "recipe", "recipe_version": "recipe_rev", "recipe_hash": "recipe_sha", "evidence": "origin",
    "confirmed": "checked",
}


def last_write_wins(points: PointColumns) -> PointColumns:
    """The points a store keyed by (node, time) keeps: of points sharing run, node and ts, the
    last in file order (InfluxDB overwrites a point written again at the same time)."""
    order = np.lexsort((np.arange(len(points)), points.ts, points.node_id.astype(str), points.run_id.astype(str)))
    r, n, t = points.run_id[order], points.node_id[order], points.ts[order]
    last = np.ones(len(points), dtype=bool)
    last[:-1] = ~((r[1:] == r[:-1]) & (n[1:] == n[:-1]) & (t[1:] == t[:-1]))
    keep = np.sort(order[last])
    return PointColumns(points.run_id[keep], points.node_id[keep], points.ts[keep], points.value[keep], points.state[keep])


def _utc(ms: np.ndarray | int | None) -> Any:
    if ms is None:
        return None
    return dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(milliseconds=int(ms))


# ---- PostgreSQL --------------------------------------------------------------------------------


def _copy_rows(con: Any, table: str, columns: list[str], rows: list[tuple]) -> None:
    with con.cursor() as cur, cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


def pg_mes_table(con: Any, schema: str, plant: SimulatedPlant, *, naive_zone: str | None = None) -> None:
    """``{schema}.batches``: the runs as an MES keeps them (timestamptz, or local timestamps)."""
    ttype = "timestamp" if naive_zone else "timestamptz"
    con.execute(
        f"CREATE TABLE {schema}.batches (batch text PRIMARY KEY, started {ttype} NOT NULL, finished {ttype}, "
        "line text, product text, recipe text, recipe_rev int, recipe_sha text, origin text, checked boolean)"
    )

    def when(ms: int | None) -> Any:
        t = _utc(ms)
        if t is None or naive_zone is None:
            return t
        import zoneinfo

        return t.astimezone(zoneinfo.ZoneInfo(naive_zone)).replace(tzinfo=None)

    rows = [(r["batch"], when(r["started"]), when(r["finished"]), r["line"], r["product"], r["recipe"],
             r["recipe_rev"], r["recipe_sha"], r["origin"], r["checked"]) for r in runs_rows(plant)]
    _copy_rows(con, f"{schema}.batches", list(runs_rows(plant)[0]), rows)


def pg_tag_table(con: Any, schema: str, plant: SimulatedPlant) -> None:
    """``{schema}.tags(tag_id, name, eng_unit, lo, hi)``: a historian's tag table."""
    con.execute(f"CREATE TABLE {schema}.tags (tag_id int PRIMARY KEY, name text UNIQUE, eng_unit text, lo float8, hi float8)")
    rows = [(TAG_ID_BASE + i, n.node_id, n.unit, n.range_lo, n.range_hi) for i, n in enumerate(plant.nodes)]
    _copy_rows(con, f"{schema}.tags", ["tag_id", "name", "eng_unit", "lo", "hi"], rows)


def pg_narrow_layout(con: Any, schema: str, url: str, plant: SimulatedPlant, points: PointColumns | None = None,
                     *, mes_schema: str | None = None) -> dict[str, Any]:
    """A TimescaleDB-style narrow table ``samples(id, tag, ts timestamptz, value, quality)``
    (quality as OPC UA codes), an MES table (in ``mes_schema``, default ``schema``) and a tag
    table. ``id`` is the insert order."""
    p = points if points is not None else plant.points
    con.execute(f"CREATE TABLE {schema}.samples (id bigserial PRIMARY KEY, tag text NOT NULL, "
                "ts timestamptz NOT NULL, value double precision, quality int NOT NULL)")
    rows = [(str(n), _utc(t), None if np.isnan(v) else float(v), OPC[int(s)])
            for n, t, v, s in zip(p.node_id, p.ts, p.value, p.state)]
    _copy_rows(con, f"{schema}.samples", ["tag", "ts", "value", "quality"], rows)
    con.execute(f"CREATE INDEX ON {schema}.samples (tag, ts)")
    con.execute(f"ANALYZE {schema}.samples")
    mes_schema = mes_schema or schema
    pg_mes_table(con, mes_schema, plant)
    pg_tag_table(con, schema, plant)
    return {
        "backend": "postgresql",
        "connection": url,
        "points": {"table": f"{schema}.samples", "node": "tag", "time": "ts", "value": "value",
                   "quality": {"column": "quality", **OPC_QUALITY}, "order": ["id"]},
        "runs": {"table": f"{mes_schema}.batches", **RUNS_MAPPING},
        "node_table": {"table": f"{schema}.tags", "id": "name", "unit": "eng_unit", "low": "lo", "high": "hi"},
    }


def pg_batch_tag(con: Any, schema: str, plant: SimulatedPlant) -> list[int]:
    """A ``BATCH`` tag added to ``{schema}.samples`` (of :func:`pg_narrow_layout`) and its tag
    table: the batch number while a run lasts and 0 between runs, on change and every 10 s.
    Returns each run's batch number (101, 102, ...)."""
    numbers = [101 + k for k in range(len(plant.runs))]
    beats = []
    for number, r in zip(numbers, plant.runs):
        end = r.ended_at if r.ended_at is not None else int(plant.points.ts.max())
        beats += [(t, number) for t in range(r.started_at, end + 1, 10_000)]
        if r.ended_at is not None:
            beats.append((r.ended_at + 1, 0))
    _copy_rows(con, f"{schema}.samples", ["tag", "ts", "value", "quality"],
               [("BATCH", _utc(t), float(v), OPC[0]) for t, v in beats])
    con.execute(f"INSERT INTO {schema}.tags VALUES (999, 'BATCH', '', NULL, NULL)")
    return numbers


def pg_wide_layout(con: Any, schema: str, url: str, plant: SimulatedPlant, *, mes_schema: str | None = None) -> dict[str, Any]:
    """A wide table, one row per sample time and a column (and a status column) per node, times
    as local wall-clock ``timestamp`` in Europe/Berlin; a re-sent sample is another row. Units
    and ranges are listed in the description."""
    import zoneinfo

    p = plant.points
    nodes = [n.node_id for n in plant.nodes]
    cols = {n: f"v_{n.lower()}" for n in nodes}
    qcols = {n: f"q_{n.lower()}" for n in nodes}
    con.execute(f"CREATE TABLE {schema}.wide (row_no bigserial PRIMARY KEY, t timestamp NOT NULL, "
                + ", ".join(f"{cols[n]} double precision, {qcols[n]} text" for n in nodes) + ")")
    berlin = zoneinfo.ZoneInfo("Europe/Berlin")
    rows = []
    index = {n: i for i, n in enumerate(nodes)}
    for n, t, v, s in zip(p.node_id, p.ts, p.value, p.state):
        row: list[Any] = [None] * (2 * len(nodes))
        row[2 * index[n]] = float(v)  # NaN stays NaN: a bad reading, not a missing one
        row[2 * index[n] + 1] = WORDS[int(s)]
        rows.append((_utc(t).astimezone(berlin).replace(tzinfo=None), *row))
    names = ["t"] + [c for n in nodes for c in (cols[n], qcols[n])]
    _copy_rows(con, f"{schema}.wide", names, rows)
    con.execute(f"CREATE INDEX ON {schema}.wide (t)")
    mes_schema = mes_schema or schema
    pg_mes_table(con, mes_schema, plant, naive_zone="Europe/Berlin")
    return {
        "backend": "postgresql",
        "connection": url,
        "points": {"table": f"{schema}.wide", "time": "t", "time_zone": "Europe/Berlin", "order": ["row_no"],
                   "columns": {n: {"column": cols[n], "quality": {"column": qcols[n], **WORD_QUALITY}} for n in nodes}},
        "runs": {"table": f"{mes_schema}.batches", **RUNS_MAPPING, "time_zone": "Europe/Berlin"},
        "nodes": node_entries(plant),
    }


def pg_monthly_layout(con: Any, schema: str, url: str, plant: SimulatedPlant, *, mes_schema: str | None = None) -> dict[str, Any]:
    """An SCADA historian: samples split into monthly tables ``samples_YYYY_MM(tag_id, ts epoch
    ms, val, status)`` keyed by integer tag ids, names in a tag table; read with the query form.
    """
    p = plant.points
    pg_tag_table(con, schema, plant)
    ids = {n.node_id: TAG_ID_BASE + i for i, n in enumerate(plant.nodes)}
    months = np.array([_utc(t).strftime("%Y_%m") for t in p.ts])
    for month in sorted(set(months.tolist())):
        table = f"{schema}.samples_{month}"
        con.execute(f"CREATE TABLE {table} (seq bigint NOT NULL, tag_id int NOT NULL, ts bigint NOT NULL, "
                    "val double precision, status smallint NOT NULL)")
        sel = np.flatnonzero(months == month)
        rows = [(int(i), ids[str(p.node_id[i])], int(p.ts[i]), float(p.value[i]), OPC[int(p.state[i])]) for i in sel]
        _copy_rows(con, table, ["seq", "tag_id", "ts", "val", "status"], rows)
        con.execute(f"CREATE INDEX ON {table} (tag_id, ts)")
    mes_schema = mes_schema or schema
    pg_mes_table(con, mes_schema, plant)
    query = (
        f"SELECT s.ts, s.val AS value, s.status, s.seq FROM {{table}} s JOIN {schema}.tags t ON t.tag_id = s.tag_id "
        "WHERE t.name = :node AND s.ts >= :from AND s.ts <= :to"
    )
    return {
        "backend": "postgresql",
        "connection": url,
        "points": {"query": query, "periods": {"table": f"{schema}.samples_{{period}}", "every": "month"},
                   "time": "ts", "time_type": "epoch_ms", "value": "value",
                   "quality": {"column": "status", **OPC_QUALITY}, "order": ["seq"]},
        "runs": {"query": f"SELECT * FROM {mes_schema}.batches", **RUNS_MAPPING},
        "node_table": {"table": f"{schema}.tags", "id": "name", "unit": "eng_unit", "low": "lo", "high": "hi"},
    }


# ---- files -----------------------------------------------------------------------------------


def _runs_file(plant: SimulatedPlant, path: Path) -> None:
    rows = runs_rows(plant)
    table = pa.table({
        "batch": [r["batch"] for r in rows],
        "started": pa.array([_utc(r["started"]) for r in rows], type=pa.timestamp("ms", tz="UTC")),
        "finished": pa.array([_utc(r["finished"]) for r in rows], type=pa.timestamp("ms", tz="UTC")),
        **{k: [r[k] for r in rows] for k in ("line", "product", "recipe", "recipe_rev", "recipe_sha", "origin", "checked")},
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path)


def parquet_lake_layout(root: Path, plant: SimulatedPlant, *, sorted_by_tag: bool = False) -> dict[str, Any]:
    """A Parquet lake partitioned by day (``points/date=YYYY-MM-DD/part-N.parquet``, several
    files a day, rows in ingestion order, or with ``sorted_by_tag`` each file's rows sorted by
    tag, then time, ties kept in ingestion order), ``timestamp with time zone`` times, OPC
    quality codes."""
    p = plant.points
    days = np.array([_utc(t).strftime("%Y-%m-%d") for t in p.ts])
    for day in sorted(set(days.tolist())):
        sel = np.flatnonzero(days == day)
        folder = root / "points" / f"date={day}"
        folder.mkdir(parents=True, exist_ok=True)
        for k, part in enumerate(np.array_split(sel, 3)):  # several files a day, in order
            if sorted_by_tag:
                part = part[np.lexsort((np.arange(part.size), p.ts[part], p.node_id[part].astype(str)))]
            pq.write_table(pa.table({
                "tag": pa.array(p.node_id[part].astype(str)),
                "time": pa.array(p.ts[part], type=pa.timestamp("ms", tz="UTC")),
                "value": pa.array(p.value[part], type=pa.float64()),
                "quality": pa.array([OPC[int(s)] for s in p.state[part]], type=pa.int32()),
            }), folder / f"part-{k}.parquet", row_group_size=4096)
    _runs_file(plant, root / "mes" / "batches.parquet")
    return {
        "backend": "files",
        "points": {"files": "points/**/*.parquet", "node": "tag", "time": "time", "value": "value",
                   "quality": {"column": "quality", **OPC_QUALITY}, "partition": {"column": "date", "every": "day"}},
        "runs": {"files": "mes/batches.parquet", **RUNS_MAPPING},
        "nodes": node_entries(plant),
    }


def csv_layout(root: Path, plant: SimulatedPlant) -> dict[str, Any]:
    """Daily CSV exports (``export-YYYYMMDD.csv``) with float epoch seconds and status words."""
    p = plant.points
    days = np.array([_utc(t).strftime("%Y%m%d") for t in p.ts])
    root.mkdir(parents=True, exist_ok=True)
    for day in sorted(set(days.tolist())):
        sel = np.flatnonzero(days == day)
        pacsv.write_csv(pa.table({
            "tag": pa.array(p.node_id[sel].astype(str)),
            "epoch_s": pa.array(p.ts[sel] / 1000.0, type=pa.float64()),
            "value": pa.array(p.value[sel], type=pa.float64()),
            "status": pa.array([WORDS[int(s)] for s in p.state[sel]]),
        }), root / f"export-{day}.csv")
    _runs_file(plant, root / "batches.csv")
    return {
        "backend": "files",
        "points": {"files": "export-*.csv", "node": "tag", "time": "epoch_s", "time_type": "epoch_s_float",
                   "value": "value", "quality": {"column": "status", **WORD_QUALITY}},
        "runs": {"files": "batches.csv", **RUNS_MAPPING},
        "nodes": node_entries(plant),
    }


# ---- InfluxDB ----------------------------------------------------------------------------------


def influx_write(url: str, database: str, lines: list[str], precision: str = "ms") -> None:
    for start in range(0, len(lines), 20_000):
        body = "\n".join(lines[start:start + 20_000]).encode()
        req = urllib.request.Request(
            f"{url}/write?{urllib.parse.urlencode({'db': database, 'precision': precision})}", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 204, resp.status


def influx_query(url: str, q: str, database: str | None = None) -> Any:
    params = {"q": q, **({"db": database} if database else {})}
    req = urllib.request.Request(f"{url}/query", data=urllib.parse.urlencode(params).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def influx_layout(url: str, database: str, plant: SimulatedPlant) -> dict[str, Any]:
    """Measurement ``process``, tag ``tag`` naming the node, fields ``value`` (absent where the
    reading is NaN: InfluxDB stores no NaN) and ``quality`` (OPC code). A sample written again
    at the same time replaces the first (InfluxDB's rule)."""
    p = plant.points
    influx_query(url, f'CREATE DATABASE "{database}"')
    lines = []
    for n, t, v, s in zip(p.node_id, p.ts, p.value, p.state):
        fields = ([f"value={float(v)!r}"] if not np.isnan(v) else []) + [f"quality={OPC[int(s)]}i"]
        lines.append(f"process,tag={n} {','.join(fields)} {int(t)}")
    influx_write(url, database, lines)
    return {
        "backend": "influxdb",
        "connection": url,
        "database": database,
        "points": {"measurement": "process", "node": "tag", "value": "value",
                   "quality": {"column": "quality", **OPC_QUALITY}},
        "runs": {"files": "batches.csv", **RUNS_MAPPING},
        "nodes": node_entries(plant),
    }
