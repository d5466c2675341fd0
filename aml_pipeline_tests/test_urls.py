"""The one rule for hiding a password in a database URL."""

from aml_pipeline.urls import redact_url, url_secrets


def test_redact_url_for_output():
    assert redact_url("postgresql://u:pw@h/db?schema=s") == "postgresql://u:***@h/db?schema=s"
    assert "hunter2" not in redact_url("postgres://u@h/db?password=hunter2")
    assert "pw" not in redact_url("postgresql://u:pw@h/db?schema=BAD")  # invalid, still redacted
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert redact_url("duckdb:///x/y.duckdb") == "duckdb:///x/y.duckdb"

    # The lease database's URL, as the lease's status shows it: where, never the password.
    assert redact_url("postgres://u:p@[::1]:5432/db?password=p&sslmode=require") == (
        "postgres://u:***@[::1]:5432/db?password=***&sslmode=require"
    )


def test_secrets_of_a_url_cover_every_spelling():
    assert url_secrets("postgresql://u:p%40ss@h/db?password=a%20b") == ["p%40ss", "p@ss", "a b", "a%20b"]
    assert url_secrets("postgresql://u@h/db") == []
