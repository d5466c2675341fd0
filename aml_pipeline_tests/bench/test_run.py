"""bench/run.py: every goal key reported (a figure or a reason), failures fail the run."""

from __future__ import annotations

import json
import socket

import pytest

from aml_pipeline_tests import pg_server
from bench import pg_bench, run as bench_run
from bench.workload import make_workload


def _results() -> bench_run.Results:
    return bench_run.Results("quick", bench_run.QUICK)


def test_goals_list_every_key_with_a_value_or_a_reason():
    res = _results()
    res.figure("e2e_over_floor", {"value": 1.2, "min": 1.1, "max": 1.4, "repeat": 3, "paired": [1.1, 1.2, 1.4]})
    res.figure("hampel_flags_identical", True)
    res.missing("parallel_speedup_2_workers", "materialize_dataset has no workers parameter yet")
    bench_run._finish(res)
    goals = res.data["goals"]
    assert list(goals) == [g.key for g in bench_run.GOALS]
    assert goals["e2e_over_floor"] == {
        "what": "end-to-end library build / I/O floor", "value": 1.2, "target": "<= 1.5 x", "met": True,
        "min": 1.1, "max": 1.4, "repeat": 3,
    }
    assert "paired" not in res.data["figures"]["e2e_over_floor"]
    assert goals["hampel_flags_identical"]["met"] is True
    assert goals["parallel_speedup_2_workers"]["value"] is None
    assert goals["parallel_speedup_2_workers"]["reason"] == (
        "not measured in this run: materialize_dataset has no workers parameter yet")
    # a key nobody reported still gets a reason, never a number
    assert goals["pg_fetch_over_copy"]["value"] is None
    assert goals["pg_fetch_over_copy"]["reason"].startswith("not measured in this run:")
    assert res.data["pg_fetch_over_copy"] is None and res.data["e2e_over_floor"] == 1.2
    assert res.data["ok"] is True


def test_a_failed_cross_check_or_a_part_error_fails_the_run():
    res = _results()
    res.check("windows equal to the reference", False)
    bench_run._finish(res)
    assert res.data["ok"] is False and res.data["failed"] == ["windows equal to the reference"]

    res = _results()

    def boom():
        raise RuntimeError("adapter bug")

    bench_run._part(res, "pg", boom)
    bench_run._finish(res)
    assert res.data["ok"] is False and res.data["failed"] == ["error in pg"]
    assert "RuntimeError: adapter bug" in res.data["errors"]["pg"]["traceback"]
    assert "raised RuntimeError" in res.data["goals"]["pg_fetch_over_copy"]["reason"]


def test_goal_direction():
    res = _results()
    res.figure("hampel_mpts_per_s", {"value": 19.0, "min": 18.0, "max": 21.0, "repeat": 5})
    res.figure("rss_long_run_mb", 999.0)
    bench_run._finish(res)
    assert res.data["goals"]["hampel_mpts_per_s"]["met"] is False
    assert res.data["goals"]["rss_long_run_mb"]["met"] is True


def test_pg_null_only_when_there_is_no_server(monkeypatch):
    monkeypatch.delenv("AML_BENCH_PG_URL", raising=False)
    monkeypatch.delenv("AML_TEST_PG_URL", raising=False)

    def no_binaries():
        raise pg_server.PgServerError("no PostgreSQL server binaries (initdb, pg_ctl, postgres) found")

    monkeypatch.setattr(pg_server, "find_bindir", no_binaries)
    out = pg_bench.run("duckdb:///nowhere.duckdb", {}, repeat=1)
    assert out["available"] is False and out["ratio"] is None
    assert out["reason"].startswith("no PostgreSQL server: AML_BENCH_PG_URL is not set and no PostgreSQL server binaries")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pg_server_that_fails_is_an_error_that_fails_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AML_BENCH_PG_URL", f"postgresql://postgres@127.0.0.1:{_closed_port()}/nothing")
    out = tmp_path / "bench.json"
    rc = bench_run.main(["--quick", "--only", "pg", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    assert rc == 1
    d = json.loads(out.read_text())
    assert d["ok"] is False and "error in pg" in d["failed"]
    assert "Traceback" in d["errors"]["pg"]["traceback"]
    assert d["pg_fetch_over_copy"] is None
    assert "raised" in d["goals"]["pg_fetch_over_copy"]["reason"]
    assert not (tmp_path / "work").exists()  # scratch removed without --keep


def test_pg_against_a_real_server(tmp_path, monkeypatch, postgres_url):
    monkeypatch.setenv("AML_BENCH_PG_URL", postgres_url)
    w = make_workload(tmp_path / "w", runs=2, minutes=5.0)
    out = pg_bench.run(w.tsdb_url, w.spec, repeat=2)
    assert out["available"] is True and out["server"] == "AML_BENCH_PG_URL"
    assert out["same_rows"] is True and out["points"] == out["copy_rows"] == w.points
    t = out["timings"]
    assert t["repeat"] == 2 and t["order"] == [["fetch", "copy_text", "copy_binary"], ["copy_text", "copy_binary", "fetch"]]
    assert out["ratio"]["value"] == pytest.approx(t["fetch"]["seconds"]["median"] / t["copy_text"]["seconds"]["median"])
    assert out["ratio"]["repeat"] == 2
