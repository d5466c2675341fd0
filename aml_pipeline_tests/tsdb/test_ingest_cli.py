"""``aml-pipeline ingest`` and :func:`ingest_into`: re-ingest, --replace-run, usage errors, and no
file left behind by a failed ingest into a new embedded TSDB. Against DuckDB and PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aml_pipeline.cli import main
from aml_pipeline.errors import IngestError
from aml_pipeline.simulate.plant import simulate_plant, write_plant_files
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline.tsdb.ingest import ingest_into
from aml_pipeline_tests.tsdb.series import fetch_node_series

REPO = Path(__file__).resolve().parents[2]
FAR = 2**62


@pytest.fixture(scope="module")
def plant():
    return simulate_plant(n_runs=3, run_minutes=4, seed=5)


@pytest.fixture
def files(plant, tmp_path):
    return write_plant_files(plant, tmp_path / "files", fmt="csv")


@pytest.fixture
def url(new_tsdb_url):
    return new_tsdb_url


def cli(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "aml_pipeline.cli", *argv], capture_output=True, text=True, env=env)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_reingesting_the_same_files_stores_nothing_and_says_so(plant, files, url):
    args = ["ingest", "--tsdb", url, "--points", str(files["points"]), "--runs", str(files["runs"]), "--nodes", str(files["nodes"])]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    summary = last_json(first.stdout)
    assert summary["points"] == len(plant.points) and summary["skipped"] == 0
    with open_tsdb(url) as db:
        versions = db.run_versions([r.run_id for r in plant.runs])
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    summary = last_json(again.stdout)
    assert summary["points"] == 0 and summary["skipped"] == len(plant.points)
    assert summary["runs"] == len(plant.runs)  # read; unchanged records do not change versions
    with open_tsdb(url) as db:
        assert db.run_versions([r.run_id for r in plant.runs]) == versions
        assert sum(len(fetch_node_series(db, n.node_id, r.run_id, -FAR, FAR)) for r in plant.runs for n in plant.nodes) == len(plant.points)


def test_replace_run_replaces_only_the_runs_in_the_points_file(plant, files, url, tmp_path):
    assert ingest_into(url, **files)["points"] == len(plant.points)
    first, other = plant.runs[0].run_id, plant.runs[1].run_id
    lines = files["points"].read_text().splitlines()
    header = lines[0].split(",")
    col = {h.strip('"'): i for i, h in enumerate(header)}
    mine = [row for row in lines[1:] if row.split(",")[col["run_id"]].strip('"') == first]
    kept = mine[: len(mine) // 3]  # the corrected export of one run: a third of its points
    fix = tmp_path / "fix.csv"
    fix.write_text("\n".join([lines[0], *kept]) + "\n")
    with open_tsdb(url) as db:
        before = db.run_versions([first, other])
    out = cli("ingest", "--tsdb", url, "--points", str(fix), "--replace-run")
    assert out.returncode == 0, out.stderr
    assert last_json(out.stdout)["points"] == len(kept) and last_json(out.stdout)["skipped"] == 0
    with open_tsdb(url) as db:
        after = db.run_versions([first, other])
        n_first = sum(len(fetch_node_series(db, n.node_id, first, -FAR, FAR)) for n in plant.nodes)
        n_other = sum(len(fetch_node_series(db, n.node_id, other, -FAR, FAR)) for n in plant.nodes)
    assert n_first == len(kept)
    assert n_other == int((plant.points.run_id == other).sum())
    assert after[first] != before[first] and after[other] == before[other]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ingest"], "nothing to ingest"),
        (["ingest", "--tsdb", "duckdb:///tmp/x.duckdb"], "nothing to ingest"),
        (["ingest", "--runs", "runs.csv", "--replace-run"], "give --points"),
    ],
)
def test_ingest_without_input_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: aml-pipeline ingest" in err and message in err and "Traceback" not in err
    with pytest.raises(IngestError, match="nothing to ingest"):
        ingest_into("duckdb:///tmp/never-created.duckdb")
    assert not Path("/tmp/never-created.duckdb").exists()


def test_a_failed_ingest_into_a_new_file_leaves_nothing_behind(plant, files, tmp_path):
    target = tmp_path / "new" / "tsdb.duckdb"
    bad = tmp_path / "bad.csv"
    bad.write_text(files["points"].read_text() + "NO_SUCH_RUN,TI101,1,1.0,0\n")
    out = cli("ingest", "--tsdb", f"duckdb://{target}", "--points", str(bad), "--runs", str(files["runs"]), "--nodes", str(files["nodes"]))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("INGEST_INVALID: ")
    assert "Traceback" not in out.stderr
    assert not target.parent.exists()  # no .duckdb, .wal, .lock, nor the directory made for them
    # into an existing file, the same failure keeps the file and its data
    assert ingest_into(f"duckdb://{target}", runs=files["runs"], nodes=files["nodes"])["runs"] == len(plant.runs)
    with pytest.raises(IngestError):
        ingest_into(f"duckdb://{target}", points=bad)
    with open_tsdb(f"duckdb://{target}") as db:
        assert [r.run_id for r in db.list_runs(finished_only=False)] == [r.run_id for r in plant.runs]
