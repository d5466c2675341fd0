"""One PostgreSQL connection lifecycle for the TSDB adapter, the mapped source and the lease: the
same failure is classified alike by all three, and no message shows the password."""

from __future__ import annotations

import psycopg
import pytest
import yaml

from aml_pipeline.errors import SourceError, TsdbError, TsdbUnavailableError
from aml_pipeline.lease import LeaseError, open_lease
from aml_pipeline.pg_connection import PgConnectError, PgConnection
from aml_pipeline.tsdb.postgres import PostgresTsdb
from aml_pipeline_tests.pg_server import free_port

SECRET = "s3cr3t-Pa55"
WINDOWS = {"windows": {"every": "1d", "start": "2025-01-01", "line": "L", "product": "P", "recipe": "R"}}


def source(tmp_path, connection: str):
    """Open a mapped PostgreSQL source whose description names ``connection``."""
    from aml_pipeline.sources import open_source

    path = tmp_path / "plant.yaml"
    path.write_text(yaml.safe_dump({"backend": "postgresql", "connection": connection, "runs": WINDOWS,
                                    "points": {"table": "s", "node": "tag", "time": "ts", "value": "v"}}))
    return open_source(str(path))


def with_user(url: str, user: str, password: str | None = None) -> str:
    """``url`` (``postgresql://[user@]host...``) as another user, with a password if given."""
    rest = url.split("://", 1)[1].split("@")[-1]
    return f"postgresql://{user}{':' + password if password else ''}@{rest}"


def test_no_server_is_transient_everywhere_and_never_shows_the_password(tmp_path):
    url = f"postgresql://aml:{SECRET}@127.0.0.1:{free_port()}/plant?connect_timeout=3"
    with pytest.raises(PgConnectError) as e:
        PgConnection(url).open()
    assert e.value.kind == "unavailable" and e.value.transient and SECRET not in e.value.detail
    with pytest.raises(TsdbUnavailableError) as adapter:
        PostgresTsdb(url)
    with pytest.raises(TsdbUnavailableError) as mapped:
        source(tmp_path, url)
    with pytest.raises(LeaseError) as lease:
        open_lease(url).status()
    for err in (adapter.value, mapped.value, lease.value):
        assert "cannot connect" in err.message and SECRET not in err.one_line() and "\n" not in err.one_line()


def test_a_refused_login_is_not_transient(postgres_url, tmp_path):
    url = with_user(postgres_url, "no_such_role_aml")
    with pytest.raises(PgConnectError) as e:
        PgConnection(url).open()
    assert e.value.kind == "authentication" and not e.value.transient
    with pytest.raises(TsdbError) as adapter:
        PostgresTsdb(url)
    assert not isinstance(adapter.value, TsdbUnavailableError)  # a build does not retry it
    with pytest.raises(SourceError) as mapped:
        source(tmp_path, url)
    assert mapped.value.code == "SOURCE_PERMISSION" and "no_such_role_aml" in mapped.value.message


def test_messages_are_scrubbed_of_every_spelling_of_the_password_and_of_urls_in_them():
    pg = PgConnection(f"postgresql://aml:p%40ss@h/db?password={SECRET}")
    text = pg.scrub(f"failed for p@ss, p%40ss and {SECRET}; see postgresql://other:hunter2@x/y")
    assert "p@ss" not in text and "p%40ss" not in text and SECRET not in text and "hunter2" not in text
    assert "postgresql://other:***@x/y" in text
    conninfo = PgConnection("host=h dbname=d password=kv-secret")  # a libpq key=value string too
    assert conninfo.scrub("auth failed: kv-secret") == "auth failed: ***"


def test_a_server_shutting_down_under_a_call_is_a_lost_connection(postgres_url):
    pg = PgConnection(postgres_url)
    conn = pg.connection()
    assert pg.connection() is conn  # kept
    shutdown = psycopg.errors.AdminShutdown("terminating connection due to administrator command")
    assert pg.lost(shutdown)
    assert not pg.lost(psycopg.errors.UndefinedTable("relation does not exist"))
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
    with pytest.raises(psycopg.OperationalError) as e:
        conn.execute("SELECT 1")
    assert pg.lost(e.value)
    again = pg.connection()  # reopened once
    assert again is not conn and again.execute("SELECT 1").fetchone() == (1,)
    pg.close()


def test_defaults_give_way_to_the_url_and_settings_run_on_every_connection(postgres_url):
    sep = "&" if "?" in postgres_url else "?"
    pg = PgConnection(f"{postgres_url}{sep}application_name=mine", defaults={"application_name": "aml_pipeline"},
                      settings=["SET default_transaction_read_only = on"],
                      optional_settings=["SET no_such_setting TO 1", "SET jit = off"])
    conn = pg.open(connect_timeout=5)
    try:
        assert conn.execute("SHOW application_name").fetchone() == ("mine",)
        assert conn.execute("SHOW default_transaction_read_only").fetchone() == ("on",)
        assert conn.execute("SHOW jit").fetchone() == ("off",)
    finally:
        conn.close()
    with pytest.raises(PgConnectError) as e:  # a setting the session needs fails: no connection
        PgConnection(postgres_url, settings=["SET no_such_setting TO 1"]).open()
    assert e.value.setting_up and not e.value.transient and "no_such_setting" in e.value.detail
    fixed = PgConnection(postgres_url, fixed={"application_name": "aml-lease:r:1@h:x"}).open()
    try:
        assert fixed.execute("SHOW application_name").fetchone() == ("aml-lease:r:1@h:x",)
    finally:
        fixed.close()
