"""A source that goes away mid-build: ``TSDB_UNAVAILABLE`` (the error the reads' retry keys on);
past the retries the build fails cleanly with nothing published, and a server back in time lets
the same handle go on where it stood."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest

from aml_pipeline.errors import TsdbUnavailableError
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.sources.description import load_description
from aml_pipeline.sources.mapped import MappedTsdb, open_backend
from aml_pipeline_tests import influx_server, pg_server
from aml_pipeline_tests.snapshot_compare import assert_same_v2_snapshot
from aml_pipeline_tests.sources import layouts
from aml_pipeline_tests.sources.support import plant_spec


class StopAt:
    """Wraps a backend: before its ``at``-th read of points, calls ``stop`` (the server goes away
    there, with the build alive and reading), then reads."""

    def __init__(self, backend, at: int, stop) -> None:
        self.inner, self.at, self.stop = backend, at, stop
        self.reads = 0
        self.stopped_at: int | None = None
        self.failed: BaseException | None = None

    def _read(self, name: str, *args):
        self.reads += 1
        if self.reads == self.at:
            self.stop()
            self.stopped_at = self.reads
        try:
            return getattr(self.inner, name)(*args)
        except BaseException as e:
            self.failed = self.failed or e
            raise

    def fetch(self, *args):
        return self._read("fetch", *args)

    def fetch_many(self, *args):
        return self._read("fetch_many", *args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def published_snapshots(root: Path) -> list[Path]:
    spec_dir = root / "mapped_ds"
    return [p for p in spec_dir.iterdir() if p.is_dir()] if spec_dir.exists() else []


def test_postgres_restart_mid_build(plant, reference, tmp_path, monkeypatch):
    """The server stops at the build's third read. Without retries the build fails with
    TSDB_UNAVAILABLE and publishes nothing; with them (the reads' retry, aml_pipeline.tsdb.retry)
    and the server back a second later, the same handle connects again, the fetch resumes from
    its cursor, and the snapshot is the embedded build's."""
    server = pg_server.start_server(owner_pid=None)
    try:
        with psycopg.connect(server.url, autocommit=True) as con:
            con.execute("CREATE SCHEMA hist")
            desc = layouts.pg_narrow_layout(con, "hist", server.url, plant)
            con.execute("CHECKPOINT")  # the test server runs without fsync: survive its immediate stop
        loaded = load_description(layouts.write_description(tmp_path / "plant.yaml", desc))
        spec = plant_spec(plant)

        monkeypatch.setenv("AML_TSDB_RETRY_S", "0")
        backend = StopAt(open_backend(loaded), at=3, stop=lambda: server.stop(remove=False))
        with MappedTsdb(str(loaded.path), loaded, backend=backend) as db, pytest.raises(TsdbUnavailableError) as e:
            build_dataset(spec, db, store_root=tmp_path / "store", datasets_root=tmp_path / "datasets")
        assert e.value.code == "TSDB_UNAVAILABLE"
        assert backend.stopped_at == 3 and isinstance(backend.failed, TsdbUnavailableError)  # after two good reads
        assert "connection" in backend.failed.message
        assert published_snapshots(tmp_path / "datasets") == []
        server.start()

        monkeypatch.setenv("AML_TSDB_RETRY_S", "60")
        back = threading.Timer(1.0, server.start)
        backend = StopAt(open_backend(loaded), at=3, stop=lambda: (server.stop(remove=False), back.start()))
        with MappedTsdb(str(loaded.path), loaded, backend=backend) as db:
            published = build_dataset(spec, db, store_root=tmp_path / "store2", datasets_root=tmp_path / "datasets2")
        back.join()
        assert backend.stopped_at == 3 and isinstance(backend.failed, TsdbUnavailableError)
        assert published.current
        assert_same_v2_snapshot(reference.published.snapshot_dir, published.snapshot_dir, "the embedded and the resumed build")
    finally:
        server.stop()


def test_influxdb_gone_mid_build(plant, tmp_path, monkeypatch):
    server = influx_server.start_server(owner_pid=None)
    try:
        desc = layouts.influx_layout(server.url, "plant", plant)
        layouts._runs_file(plant, tmp_path / "batches.csv")
        loaded = load_description(layouts.write_description(tmp_path / "influx.yaml", desc))
        monkeypatch.setenv("AML_TSDB_RETRY_S", "0")
        backend = StopAt(open_backend(loaded), at=5, stop=server.stop)
        db = MappedTsdb(str(loaded.path), loaded, backend=backend)
        with pytest.raises(TsdbUnavailableError) as e:
            build_dataset(plant_spec(plant), db, store_root=tmp_path / "store", datasets_root=tmp_path / "datasets")
        assert e.value.code == "TSDB_UNAVAILABLE"
        assert backend.stopped_at == 5 and isinstance(backend.failed, TsdbUnavailableError)
        assert published_snapshots(tmp_path / "datasets") == []
        db.close()
    finally:
        if server.base.exists():
            server.stop()


def test_opcua_server_gone_mid_build(plant, reference, tmp_path, monkeypatch):
    """The OPC UA server is killed at the build's third read (mid-run, continuation points
    outstanding). Without retries: TSDB_UNAVAILABLE, nothing published. With them and the
    server back a second later on its port: the source connects again, the read resumes from
    its cursor, and the snapshot is the embedded build's."""
    from aml_pipeline_tests import opcua_server
    from aml_pipeline_tests.sources.support import OPCUA_MAX_VALUES

    base = tmp_path / "historian"
    layouts.opcua_history(base, plant)
    server = opcua_server.start_server(base, max_values=OPCUA_MAX_VALUES)
    try:
        layouts._runs_file(plant, tmp_path / "batches.csv")
        loaded = load_description(layouts.write_description(tmp_path / "opcua.yaml", layouts.opcua_layout(server.url, plant)))
        spec = plant_spec(plant)

        def kill() -> None:
            opcua_server.stop_server(base, remove=False, kill=True)

        monkeypatch.setenv("AML_TSDB_RETRY_S", "0")
        backend = StopAt(open_backend(loaded), at=3, stop=kill)
        with MappedTsdb(str(loaded.path), loaded, backend=backend) as db, pytest.raises(TsdbUnavailableError) as e:
            build_dataset(spec, db, store_root=tmp_path / "store", datasets_root=tmp_path / "datasets")
        assert e.value.code == "TSDB_UNAVAILABLE"
        assert backend.stopped_at == 3 and isinstance(backend.failed, TsdbUnavailableError)
        assert published_snapshots(tmp_path / "datasets") == []

        server = server.start()
        monkeypatch.setenv("AML_TSDB_RETRY_S", "60")
        back = threading.Timer(1.0, server.start)
        backend = StopAt(open_backend(loaded), at=3, stop=lambda: (kill(), back.start()))
        with MappedTsdb(str(loaded.path), loaded, backend=backend) as db:
            published = build_dataset(spec, db, store_root=tmp_path / "store2", datasets_root=tmp_path / "datasets2")
        back.join()
        assert backend.stopped_at == 3 and isinstance(backend.failed, TsdbUnavailableError)
        assert published.current
        assert_same_v2_snapshot(reference.published.snapshot_dir, published.snapshot_dir, "the embedded and the resumed build")
    finally:
        opcua_server.stop_server(base)
