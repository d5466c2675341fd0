"""``aml-pipeline source check FILE.yaml``: what it finds, or one line naming what is missing (exit 2)."""

from __future__ import annotations

import json

import pytest

from aml_pipeline.cli import main
from aml_pipeline_tests.pg_server import free_port
from aml_pipeline_tests.sources import layouts


def check(capsys, path, *extra) -> tuple[int, str, str]:
    code = main(["source", "check", str(path), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_check_prints_what_it_found(plant, pg_schema, postgres_url, tmp_path, capsys):
    con, schema = pg_schema()
    path = layouts.write_description(tmp_path / "p.yaml", layouts.pg_narrow_layout(con, schema, postgres_url, plant))
    code, out, err = check(capsys, path)
    assert code == 0, err
    assert f"points: {schema}.samples (narrow layout)" in out
    assert "time: column ts, timestamp with time zone" in out
    assert "order of points at one time: time, id, value, quality" in out
    assert "nodes: 6: AI910 [%] 0..100" in out
    assert "runs (table): 5, 4 finished" in out
    last = plant.runs[3]
    n = int(((plant.points.run_id == last.run_id) & (plant.points.node_id == "TI101")).sum())
    assert f"sample run {last.run_id}" in out and f"TI101 {n:,}" in out

    code, out, _ = check(capsys, path, "--json", "--run", plant.runs[0].run_id)
    found = json.loads(out)
    assert found["time"]["kind"] == "timestamptz" and found["role"] == "postgres"
    assert found["sample_run"]["run_id"] == plant.runs[0].run_id
    assert found["versions"] == 5 and len(found["nodes"]) == 6


def one_error(capsys, path) -> str:
    code, out, err = check(capsys, path)
    assert code == 2 and out == ""
    assert "\n" not in err and "Traceback" not in err
    return err


def test_postgres_mapping_errors(plant, pg_schema, postgres_url, tmp_path, capsys):
    con, schema = pg_schema()
    desc = layouts.pg_narrow_layout(con, schema, postgres_url, plant)

    def with_points(**over):
        return layouts.write_description(tmp_path / "p.yaml", {**desc, "points": {**desc["points"], **over}})

    err = one_error(capsys, with_points(table=f"{schema}.sample"))
    assert err.startswith("SOURCE_NOT_FOUND:") and f"points.table: table '{schema}.sample' does not exist" in err
    err = one_error(capsys, with_points(value="val"))
    assert err.startswith("SOURCE_NOT_FOUND:") and "points.value: column 'val' is not in table" in err
    err = one_error(capsys, with_points(node="Tag"))
    assert "column 'Tag'" in err and "there is 'tag': names are case-sensitive" in err
    con.execute(f"ALTER TABLE {schema}.samples ADD COLUMN t_ms bigint")
    err = one_error(capsys, with_points(time="t_ms"))
    assert err.startswith("SOURCE_INVALID:") and "points.time_type: column 't_ms' is a number (bigint)" in err
    con.execute(f"ALTER TABLE {schema}.samples ADD COLUMN t_local timestamp")
    err = one_error(capsys, with_points(time="t_local"))
    assert "points.time_type" in err and "say which zone" in err
    err = one_error(capsys, layouts.write_description(
        tmp_path / "p.yaml", {**desc, "runs": {**desc["runs"], "end": "ended"}}))
    assert "runs.end: column 'ended' is not in table" in err
    err = one_error(capsys, layouts.write_description(
        tmp_path / "p.yaml", {**desc, "node_table": {**desc["node_table"], "table": f"{schema}.tag"}}))
    assert "node_table.table: table" in err and "does not exist" in err
    err = one_error(capsys, layouts.write_description(tmp_path / "p.yaml", {**desc, "points": {
        "query": "SELECT ts, value FROM {table} WHERE tag = :node AND ts BETWEEN :from AND :to", "time": "ts",
        "value": "value", "periods": {"table": f"{schema}.s_{{period}}", "every": "month"}}}))
    assert "points.periods: no table matches" in err


def test_descriptions_that_cannot_be_read_are_one_line(tmp_path, capsys):
    """Not UTF-8, or a table name SQL cannot read: exit 2, one line naming the file (and the key)."""
    desc = {"backend": "postgresql", "connection": "postgresql://nobody@127.0.0.1:1/plant",
            "points": {"table": "s", "node": "tag", "time": "ts", "value": "v"},
            "runs": {"windows": {"every": "1d", "start": "2025-01-01", "line": "L", "product": "P", "recipe": "R"}}}
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(layouts.write_description(tmp_path / "ok.yaml", desc).read_bytes() + 'note: "K\u00fchler"\n'.encode("latin-1"))
    err = one_error(capsys, latin1)
    assert err.startswith(f"SOURCE_INVALID: {latin1}: cannot read the source description: line ") and "UTF-8" in err
    bad = layouts.write_description(tmp_path / "quoted.yaml", {**desc, "points": {**desc["points"], "table": 'public."samples"x'}})
    err = one_error(capsys, bad)
    assert err.startswith(f"SOURCE_INVALID: {bad}: points.table: table name "), err


def test_an_unreachable_server_is_unavailable(plant, tmp_path, capsys):
    desc = {"backend": "postgresql", "connection": f"postgresql://nobody@127.0.0.1:{free_port()}/plant?connect_timeout=2",
            "points": {"table": "s", "node": "tag", "time": "ts", "value": "v"},
            "runs": {"windows": {"every": "1d", "start": "2025-01-01", "line": "L", "product": "P", "recipe": "R"}}}
    err = one_error(capsys, layouts.write_description(tmp_path / "p.yaml", desc))
    assert err.startswith("TSDB_UNAVAILABLE:") and "cannot connect" in err


def test_lake_and_influx_errors(plant, influx_url, influx_db, tmp_path, capsys):
    desc = layouts.parquet_lake_layout(tmp_path / "lake", plant)
    err = one_error(capsys, layouts.write_description(
        tmp_path / "lake" / "a.yaml", {**desc, "points": {**desc["points"], "files": "pts/**/*.parquet"}}))
    assert err.startswith("SOURCE_NOT_FOUND:") and "points.files: no file matches" in err
    err = one_error(capsys, layouts.write_description(
        tmp_path / "lake" / "b.yaml", {**desc, "points": {**desc["points"], "time": "ts"}}))
    assert "points.time: column 'ts' is not in the files" in err
    err = one_error(capsys, layouts.write_description(
        tmp_path / "lake" / "c.yaml", {**desc, "runs": {**desc["runs"], "files": "mes/none.csv"}}))
    assert "runs.files: no file matches" in err

    idesc = layouts.influx_layout(influx_url, influx_db, plant)
    layouts._runs_file(plant, tmp_path / "batches.csv")
    err = one_error(capsys, layouts.write_description(
        tmp_path / "i.yaml", {**idesc, "points": {**idesc["points"], "measurement": "proces"}}))
    assert "points.measurement: measurement 'proces' is not in database" in err
    err = one_error(capsys, layouts.write_description(
        tmp_path / "i.yaml", {**idesc, "points": {**idesc["points"], "value": "val"}}))
    assert "points.value: field 'val' is not in measurement 'process'" in err
    err = one_error(capsys, layouts.write_description(tmp_path / "i.yaml", {**idesc, "database": "nope"}))
    assert err.startswith("SOURCE_NOT_FOUND:") and "database not found" in err


def test_a_bad_key_exits_2(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text("backend: oracle\n")
    err = one_error(capsys, path)
    assert err.startswith("SOURCE_INVALID:") and "backend" in err


@pytest.mark.parametrize("name", ["plant.yaml"])
def test_check_of_a_missing_file(tmp_path, capsys, name):
    err = one_error(capsys, tmp_path / name)
    assert "cannot read the source description" in err


def test_period_tables_in_a_schema_whose_quoted_name_holds_a_dot(plant, pg_schema, postgres_url, tmp_path, capsys):
    """``"hist.v2".samples_{period}``: the dot inside the quotes is part of the schema's name."""
    con, plain = pg_schema()
    schema = f'"{plain}.v2"'
    con.execute(f"CREATE SCHEMA {schema}")
    try:
        desc = layouts.pg_monthly_layout(con, schema, postgres_url, plant, mes_schema=plain)
        code, out, err = check(capsys, layouts.write_description(tmp_path / "p.yaml", desc))
        assert code == 0, err
        assert "points: query over 2 period tables" in out, out
        assert "sample run L1-P100-0004" in out and "TI101 600" in out, out  # read from those tables
    finally:
        con.execute(f"DROP SCHEMA {schema} CASCADE")


def test_a_period_table_whose_quoted_name_holds_a_dot(plant, pg_schema, postgres_url, tmp_path, capsys):
    """``schema."samples.{period}"``: the dot inside the quotes is part of each table's name."""
    con, schema = pg_schema()
    desc = layouts.pg_monthly_layout(con, schema, postgres_url, plant)
    months = [r[0] for r in con.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename LIKE "
                                        "'samples\\_%%' ORDER BY 1", [schema]).fetchall()]
    assert len(months) == 2, months
    for name in months:
        con.execute(f'ALTER TABLE {schema}.{name} RENAME TO "{name.replace("samples_", "samples.")}"')
    periods = {**desc["points"]["periods"], "table": f'{schema}."samples.{{period}}"'}
    code, out, err = check(capsys, layouts.write_description(tmp_path / "p.yaml",
                                                            {**desc, "points": {**desc["points"], "periods": periods}}))
    assert code == 0, err
    assert "points: query over 2 period tables" in out, out
    assert "sample run L1-P100-0004" in out and "TI101 600" in out, out  # read from those tables


@pytest.mark.parametrize("table, says", [
    ("{schema}.samples.{{period}}", 'use table or schema.table (double-quote a name that holds a dot: hist."samples.{period}")'),
    ("{schema}_{{period}}.samples", "must contain {period} once, in the table's name (not the schema's)"),
    ("{schema}.samples_{{period}}_{{period}}", "must contain {period} once, in the table's name (not the schema's)"),
], ids=["three_parts", "period_in_the_schema", "period_twice"])
def test_a_period_table_pattern_that_cannot_be_read_exactly_is_refused(plant, pg_schema, postgres_url, tmp_path, capsys,
                                                                        table, says):
    con, schema = pg_schema()
    desc = layouts.pg_monthly_layout(con, schema, postgres_url, plant)
    table = table.format(schema=schema)
    periods = {**desc["points"]["periods"], "table": table}
    err = one_error(capsys, layouts.write_description(tmp_path / "p.yaml",
                                                      {**desc, "points": {**desc["points"], "periods": periods}}))
    assert err.startswith("SOURCE_INVALID: ") and "points.periods.table" in err, err
    assert f"table {table!r}" in err and says in err, err


def test_two_tables_of_one_period_are_refused_by_name(plant, pg_schema, postgres_url, tmp_path, capsys):
    """strptime reads ``samples_2025_1`` as January as well as ``samples_2025_01``: reading both
    would give January's points twice."""
    con, schema = pg_schema()
    desc = layouts.pg_monthly_layout(con, schema, postgres_url, plant)
    path = layouts.write_description(tmp_path / "p.yaml", desc)
    code, out, err = check(capsys, path)
    assert code == 0 and "points: query over 2 period tables" in out, err
    con.execute(f"CREATE TABLE {schema}.samples_2025_1 AS SELECT * FROM {schema}.samples_2025_01")
    err = one_error(capsys, path)
    assert err.startswith("SOURCE_INVALID: ") and "points.periods: tables 'samples_2025_01' and 'samples_2025_1'" in err, err
    assert f"in schema {schema!r} are both the period starting 2025-01-01T00:00:00+00:00" in err, err


def test_a_tag_tables_range_is_read_as_numbers_and_one_that_holds_none_is_named(plant, pg_schema, postgres_url,
                                                                                 tmp_path, capsys):
    """A tag table's low/high: the open side's infinity is no bound (as NULL is); +inf low, or
    text that is no number, is refused naming the node and the column, not read as a bound that
    drops every point."""
    from aml_pipeline.tsdb_open import open_tsdb

    con, schema = pg_schema()
    path = layouts.write_description(tmp_path / "p.yaml", layouts.pg_narrow_layout(con, schema, postgres_url, plant))
    node = plant.nodes[0].node_id
    con.execute(f"UPDATE {schema}.tags SET lo = '-Infinity', hi = 'Infinity' WHERE name = %s", [node])
    with open_tsdb(str(path)) as db:
        found = {n.node_id: n for n in db.list_nodes()}
    assert (found[node].range_lo, found[node].range_hi) == (None, None)
    assert found[plant.nodes[1].node_id].range_hi is not None  # the other tags keep their bounds

    con.execute(f"UPDATE {schema}.tags SET lo = 'Infinity' WHERE name = %s", [node])
    err = one_error(capsys, path)
    assert f"node_table: node {node!r} (column lo): low inf leaves no number in the node's range" in err

    con.execute(f"UPDATE {schema}.tags SET lo = NULL WHERE name = %s", [node])
    con.execute(f"ALTER TABLE {schema}.tags ALTER COLUMN hi TYPE text")
    con.execute(f"UPDATE {schema}.tags SET hi = 'n/a' WHERE name = %s", [node])
    err = one_error(capsys, path)
    assert f"node_table: node {node!r} (column hi): high 'n/a' is not a number" in err


def test_lake_files_that_cannot_be_read_are_named_in_the_descriptions_terms(plant, tmp_path, capsys):
    """No SQL and no DuckDB advice (``types=``, ``sample_size=``, options of DuckDB's, not keys of
    the description): the file, the line and what to change."""
    desc = layouts.csv_layout(tmp_path / "csv", plant)
    exports = sorted((tmp_path / "csv").glob("export-*.csv"))
    # CSV files declared as Parquet
    err = one_error(capsys, layouts.write_description(
        tmp_path / "csv" / "a.yaml", {**desc, "points": {**desc["points"], "format": "parquet"}}))
    assert err == (f"SOURCE_INVALID: {tmp_path / 'csv' / 'a.yaml'}: points.files: {exports[0]} is not a Parquet "
                   "file; if the files hold CSV, set format: csv"), err
    # a value that is not a number far into a file (after the rows DuckDB samples for its types)
    t0 = 1_735_718_400_000
    rows = [f"TI101,{(t0 + 1000 * i) / 1000:.3f},{0.1 * i:.1f},192" for i in range(30_000)]
    rows[25_000] = rows[25_000].replace(",2500.0,", ",oops,")
    big = tmp_path / "big"
    big.mkdir()
    (big / "p.csv").write_text("tag,t,value,quality\n" + "\n".join(rows) + "\n")
    (big / "b.csv").write_text(f"batch,started,finished,line,product,recipe\nB1,{t0},{t0 + 3_600_000},L1,P1,R1\n")
    big_desc = {"backend": "files",
                "points": {"files": "p.csv", "node": "tag", "time": "t", "time_type": "epoch_s_float", "value": "value",
                           "quality": {"column": "quality", "good": [192], "other": 2}},
                "runs": {"files": "b.csv", "id": "batch", "start": "started", "end": "finished", "time_type": "epoch_ms",
                         "line": "line", "product": "product", "recipe": "recipe"},
                "nodes": {"TI101": {"unit": "degC", "low": 0, "high": 150}}}
    err = one_error(capsys, layouts.write_description(big / "b.yaml", big_desc))
    assert err.startswith(f"SOURCE_INVALID: {big / 'b.yaml'}: "), err
    assert f"{big / 'p.csv'}: line 25002: " in err and '"oops"' in err and f"(the line: {rows[25_000]})" in err, err
    assert "Possible solutions" not in err and "sample_size" not in err and "LINE 1" not in err, err
    # a row with more fields than the header: DuckDB's detection no longer finds the header
    lines = exports[-1].read_text().splitlines()
    lines[-1] += ",7,8"
    exports[-1].write_text("\n".join(lines) + "\n")
    err = one_error(capsys, layouts.write_description(tmp_path / "csv" / "c.yaml", desc))
    assert err.startswith(f"SOURCE_INVALID: {tmp_path / 'csv' / 'c.yaml'}: points.files: {exports[-1]}: not readable "
                          "as CSV: "), err
    assert "a row has another number of fields than the header" in err, err
    # small files DuckDB's detection reads otherwise: as one column, or as columns without a header
    for name, text in {"one": "tag,t,value,quality\nTI101,1735718400,1,192\nTI101,1735718401,2,192,7,8\nTI101,1735718402,2,192\n",
                       "headerless": "tag,t,value,quality\nTI101,1735718400,1,192\nTI101,1735718401,2,192,7,8\n"}.items():
        (big / "p.csv").write_text(text)
        err = one_error(capsys, layouts.write_description(big / f"{name}.yaml", big_desc))
        assert err.startswith(f"SOURCE_INVALID: {big / f'{name}.yaml'}: points.files: the files {big / 'p.csv'} read "
                              + ("as one column 'tag,t,value,quality'" if name == "one" else "without a header")), err
        assert "a row has another number of fields than the header" in err, err
