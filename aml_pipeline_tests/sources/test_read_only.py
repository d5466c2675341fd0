"""Read-only, always: a role with CONNECT, USAGE and SELECT only builds the same snapshot, and the
source is left exactly as it was (no row, no table, no temporary table)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from aml_pipeline.cli import main
from aml_pipeline.errors import SourceError
from aml_pipeline.sources import open_source
from aml_pipeline_tests.snapshot_compare import assert_same_v2_snapshot
from aml_pipeline_tests.sources import layouts
from aml_pipeline_tests.sources.support import build, plant_spec


def _url_for(url: str, user: str, database: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.split("@")[-1]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}", path=f"/{database}"))


@pytest.fixture
def plant_database(postgres_url, plant) -> Iterator[dict]:
    """A database of its own holding the plant's historian tables (schema ``hist``), a role
    ``reader`` with CONNECT, USAGE and SELECT only (no CREATE, no TEMPORARY), and a role
    ``stranger`` that may connect but read nothing."""
    tag = uuid.uuid4().hex[:8]
    db, reader, stranger = f"plant_{tag}", f"reader_{tag}", f"stranger_{tag}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {db}")
        admin.execute(f"CREATE ROLE {reader} LOGIN")
        admin.execute(f"CREATE ROLE {stranger} LOGIN")
    owner_url = _url_for(postgres_url, urlsplit(postgres_url).username or "postgres", db)
    try:
        with psycopg.connect(owner_url, autocommit=True) as con:
            con.execute("CREATE SCHEMA hist")
            desc = layouts.pg_narrow_layout(con, "hist", "", plant)
            con.execute(f"REVOKE ALL ON DATABASE {db} FROM PUBLIC")
            con.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
            con.execute(f"GRANT CONNECT ON DATABASE {db} TO {reader}, {stranger}")
            con.execute(f"GRANT USAGE ON SCHEMA hist TO {reader}")
            con.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA hist TO {reader}")
        yield {"owner_url": owner_url, "reader_url": _url_for(postgres_url, reader, db),
               "stranger_url": _url_for(postgres_url, stranger, db), "desc": desc}
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
            admin.execute(f"DROP ROLE IF EXISTS {reader}")
            admin.execute(f"DROP ROLE IF EXISTS {stranger}")


def source_state(owner_url: str) -> dict:
    """Everything a write would change: each table's rows (a digest), its insert, update and
    delete counters, and every relation in the database, temporary ones included. (Not the live
    row estimate: autovacuum's analyze of the freshly loaded tables sets it whenever it runs.)"""
    with psycopg.connect(owner_url, autocommit=True) as con:
        con.execute("SELECT pg_stat_clear_snapshot()")
        relations = con.execute(
            "SELECT n.nspname, c.relname, c.relkind, c.relpersistence FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast') "
            "ORDER BY 1, 2").fetchall()
        counters = con.execute(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables ORDER BY 1").fetchall()
        reads = con.execute("SELECT sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)) FROM pg_stat_user_tables").fetchone()[0]
        digests = {t: con.execute(f"SELECT md5(coalesce(string_agg(x::text, '|' ORDER BY x::text), '')) FROM hist.{t} x").fetchone()[0]
                   for t in ("samples", "batches", "tags")}
    return {"relations": relations, "counters": counters, "digests": digests, "reads": int(reads or 0)}


def test_a_select_only_role_builds_and_writes_nothing(plant, reference, plant_database, tmp_path):
    desc = {**plant_database["desc"], "connection": plant_database["reader_url"]}
    path = layouts.write_description(tmp_path / "plant.yaml", desc)

    # The role really cannot write: not a row, not a temporary table.
    with psycopg.connect(plant_database["reader_url"], autocommit=True) as con:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            con.execute("CREATE TEMPORARY TABLE t (x int)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            con.execute("INSERT INTO hist.batches (batch, started) VALUES ('x', now())")

    before = source_state(plant_database["owner_url"])
    published = build(plant_spec(plant), str(path), tmp_path / "mapped")
    with open_source(str(path)) as db:
        db.run_versions([r.run_id for r in db.list_runs()])
    assert main(["source", "check", str(path)]) == 0
    after = source_state(plant_database["owner_url"])

    assert_same_v2_snapshot(reference.published.snapshot_dir, published.snapshot_dir, "the embedded and the read-only build")
    assert after["relations"] == before["relations"]  # no table, no temporary table left
    assert after["digests"] == before["digests"]
    assert after["counters"] == before["counters"]
    assert after["reads"] > before["reads"]  # the statistics did see the build's reads


def test_missing_privileges_are_one_line_naming_the_table(plant, plant_database, tmp_path, capsys):
    desc = {**plant_database["desc"], "connection": plant_database["stranger_url"]}
    path = layouts.write_description(tmp_path / "plant.yaml", desc)
    assert main(["source", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("SOURCE_PERMISSION:") and "hist" in err and "samples" in err
    with pytest.raises(SourceError) as e:
        open_source(str(path))
    assert e.value.code == "SOURCE_PERMISSION"


LAYOUTS = {"narrow": layouts.pg_narrow_layout, "wide": layouts.pg_wide_layout, "monthly": layouts.pg_monthly_layout}
# The tables each layout reads: the points (monthly tables through the query), the runs table
# (the MES table) and the node table (where the layout has one).
TABLES = {"narrow": {"samples", "batches", "tags"}, "wide": {"wide", "batches"},
          "monthly": {"samples_2025_01", "samples_2025_02", "tags", "batches"}}


@pytest.fixture
def three_layouts(postgres_url, plant) -> Iterator[dict]:
    """A database with the narrow, wide and monthly layouts in schemas of those names, a role
    ``usage`` with CONNECT and USAGE on them but no SELECT, and a role ``stranger`` with CONNECT
    only."""
    tag = uuid.uuid4().hex[:8]
    db, usage, stranger = f"plant_{tag}", f"usage_{tag}", f"stranger_{tag}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {db}")
        admin.execute(f"CREATE ROLE {usage} LOGIN")
        admin.execute(f"CREATE ROLE {stranger} LOGIN")
    owner_url = _url_for(postgres_url, urlsplit(postgres_url).username or "postgres", db)
    try:
        descs = {}
        with psycopg.connect(owner_url, autocommit=True) as con:
            con.execute(f"REVOKE ALL ON DATABASE {db} FROM PUBLIC")
            con.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
            con.execute(f"GRANT CONNECT ON DATABASE {db} TO {usage}, {stranger}")
            for name, make in LAYOUTS.items():
                con.execute(f"CREATE SCHEMA {name}")
                descs[name] = make(con, name, "", plant)
                con.execute(f"GRANT USAGE ON SCHEMA {name} TO {usage}")
        yield {"owner_url": owner_url, "usage": usage, "usage_url": _url_for(postgres_url, usage, db),
               "stranger": stranger, "stranger_url": _url_for(postgres_url, stranger, db), "descs": descs}
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
            admin.execute(f"DROP ROLE IF EXISTS {usage}")
            admin.execute(f"DROP ROLE IF EXISTS {stranger}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_refusal_names_the_role_the_table_and_the_grant(plant, three_layouts, tmp_path, capsys, layout):
    """A role without USAGE on the schema gets the GRANT USAGE; one without SELECT gets, table
    after table as it is granted them, the schema-qualified table and the GRANT SELECT."""
    env = three_layouts

    def refusal(url: str) -> str:
        path = layouts.write_description(tmp_path / "plant.yaml", {**env["descs"][layout], "connection": url})
        assert main(["source", "check", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("SOURCE_PERMISSION: "), err
        return err

    err = refusal(env["stranger_url"])
    assert f"role {env['stranger']} may not use schema {layout}: GRANT USAGE ON SCHEMA {layout} TO {env['stranger']}" in err
    granted = set()
    with psycopg.connect(env["owner_url"], autocommit=True) as owner:
        for _ in range(len(TABLES[layout])):
            err = refusal(env["usage_url"])
            m = re.search(rf"role {env['usage']} may not read (?:column '\w+' of )?table {layout}\.(\w+): "
                          rf"GRANT SELECT ON {layout}\.(\w+) TO {env['usage']}$", err)
            assert m and m.group(1) == m.group(2) and m.group(1) in TABLES[layout] - granted, err
            owner.execute(f"GRANT SELECT ON {layout}.{m.group(1)} TO {env['usage']}")  # the GRANT the line names
            granted.add(m.group(1))
    path = layouts.write_description(tmp_path / "plant.yaml", {**env["descs"][layout], "connection": env["usage_url"]})
    assert main(["source", "check", str(path)]) == 0, capsys.readouterr().err  # each GRANT it named was enough
    assert granted == TABLES[layout]
