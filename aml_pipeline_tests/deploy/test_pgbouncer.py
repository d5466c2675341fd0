"""The production instance (deploy/dagster.yaml) through PgBouncer in session pooling, as
docs/deployment.md deploys it: a real PostgreSQL server, a real pgbouncer, a real build."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import dagster as dg
import psycopg
import pytest

from aml_pipeline.runner.build import materialize_dataset
from aml_pipeline.pipeline.registry import RUN_ASSETS
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
from aml_pipeline.spec import parse_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.deploy.cluster import database, instance_env, production_home
from aml_pipeline_tests.pgbouncer import (
    PgBouncerMissing,
    find_pgbouncer,
    pooled_url,
    reap_stale_poolers,
)


@pytest.fixture(scope="module")
def pgbouncer_url(postgres_url: str) -> Iterator[str]:
    try:
        find_pgbouncer()
    except PgBouncerMissing as exc:
        # Never skip: a missing pooler is a set-up error (scripts/test.sh installs it).
        pytest.fail(f"{exc}; run scripts/test.sh, which installs it")
    with pooled_url(postgres_url) as url:
        yield url


def _transactions_through(pooler_url: str, db_name: str) -> int:
    """Transactions PgBouncer has passed to ``db_name`` (its admin console's SHOW STATS)."""
    admin = psycopg.connect(pooler_url.rsplit("/", 1)[0] + "/pgbouncer", autocommit=True)
    try:
        # The admin console speaks only the simple query protocol: PQexec, not a cursor.
        res = admin.pgconn.exec_(b"SHOW STATS")
        names = [res.fname(i).decode() for i in range(res.nfields)]
        for row in range(res.ntuples):
            fields = dict(zip(names, (res.get_value(row, i) for i in range(res.nfields)), strict=True))
            if fields["database"].decode() == db_name:
                return int(fields["total_xact_count"])
        return 0
    finally:
        admin.close()


def test_a_build_on_the_production_instance_through_pgbouncer(postgres_url, pgbouncer_url, tmp_path, monkeypatch) -> None:
    plant = simulate_plant(n_runs=4, run_minutes=4, seed=5)
    tsdb_url = f"duckdb://{tmp_path / 'tsdb.duckdb'}"
    with open_tsdb(tsdb_url, read_only=False) as db:
        db.ingest(runs=plant.runs, nodes=plant.nodes, points=plant.points)
    spec = parse_spec(plant_spec_dict(plant, "pooled", history_steps=20, horizon_steps=10))
    finished = [r.run_id for r in plant.runs if r.ended_at is not None]

    with dg.DagsterInstance.ephemeral() as reference:
        expected = materialize_dataset(spec, tsdb_url=tsdb_url, home=tmp_path / "ref", instance=reference,
                                       console_log_level="CRITICAL")

    home = production_home(tmp_path)
    with database(postgres_url) as name:
        # The instance knows only the pooler's address; the database is the server's.
        for k, v in instance_env(pgbouncer_url, name, max_concurrent_runs=2).items():
            monkeypatch.setenv(k, v)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            summary = materialize_dataset(spec, tsdb_url=tsdb_url, home=tmp_path / "aml", instance=instance,
                                          console_log_level="CRITICAL")
            assert summary["sha256"] == expected["sha256"] and summary["current"] is True
            assert summary["materialized"] == dict.fromkeys(RUN_ASSETS, len(finished))
            # Every run partition and its figures are in the PostgreSQL event log.
            windows_key = dg.AssetKey([spec.id, "run_windows"])
            assert sorted(instance.get_materialized_partitions(windows_key)) == sorted(finished)
            [record] = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=windows_key, asset_partitions=[finished[0]]), limit=1
            ).records
            assert record.asset_materialization.metadata["windows"].value > 0
        assert _transactions_through(pgbouncer_url, name) > 0


def test_a_pooler_whose_starter_was_killed_is_stopped_by_the_next(postgres_url, pgbouncer_url) -> None:
    """A SIGKILLed pytest cannot stop its pgbouncer; the next start of one stops it."""
    starter = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from aml_pipeline_tests.pgbouncer import pooled_url\n"
         "with pooled_url(sys.argv[1]) as url:\n"
         "    print(url, flush=True)\n"
         "    time.sleep(600)\n",
         postgres_url],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
    )
    try:
        url = starter.stdout.readline().strip()
        assert url, "the starter printed no pooler URL"
    finally:
        starter.kill()
        starter.wait()
    port = urlsplit(url).port
    [base] = [d for d in Path(tempfile.gettempdir()).glob("aml-pgbouncer-*")
              if f"listen_port = {port}\n" in (d / "pgbouncer.ini").read_text()]
    with psycopg.connect(url, connect_timeout=5) as conn:  # its starter is gone, it is not
        conn.execute("SELECT 1")

    reaped = reap_stale_poolers()

    assert base in reaped and not base.exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=5).close()
    # The pooler of this live test session is left alone.
    with psycopg.connect(pgbouncer_url, connect_timeout=5) as conn:
        conn.execute("SELECT 1")
