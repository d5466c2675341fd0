"""The command line as a user runs it: one-line errors, exit codes, nothing half-written."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from aml_pipeline import config
from aml_pipeline.cli import main
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant, write_plant_files
from aml_pipeline_tests.cli_tree import parser_tree

CLI = [sys.executable, "-m", "aml_pipeline.cli"]


@pytest.fixture(scope="module")
def small_plant():
    return simulate_plant(n_runs=5, run_minutes=6, seed=3)


@pytest.fixture(scope="module")
def ingested(small_plant, tmp_path_factory):
    """Plant files ingested through the CLI into a fresh DuckDB file."""
    root = tmp_path_factory.mktemp("cli")
    files = write_plant_files(small_plant, root / "files", fmt="csv")
    url = f"duckdb://{root / 'tsdb.duckdb'}"
    assert main(["ingest", "--tsdb", url, "--points", str(files["points"]), "--runs", str(files["runs"]),
                 "--nodes", str(files["nodes"])]) == 0
    return url


def write_spec(path: Path, plant, **overrides) -> Path:
    data = plant_spec_dict(plant, "cli_ds", history_steps=20, horizon_steps=10)
    data.update(overrides)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env={**os.environ, **(env or {})})


def test_build_verify_and_list_through_the_real_command(small_plant, ingested, tmp_path, monkeypatch):
    spec = write_spec(tmp_path / "cli_ds.yaml", small_plant)
    out = tmp_path / "published"
    env = {"AML_HOME": str(tmp_path / "home")}
    monkeypatch.delenv("DAGSTER_HOME", raising=False)  # an ephemeral instance (run_cli passes os.environ)
    build = run_cli("build", str(spec), "--tsdb", ingested, "--out", str(out), "--json", env=env)
    assert build.returncode == 0, build.stderr
    summary = json.loads(build.stdout.strip().splitlines()[-1])
    assert {"snapshotDir", "sha256", "manifestVersion", "windows", "runs"} <= summary.keys()
    assert summary["manifestVersion"] == 1
    assert set(summary["windows"]) == {"train", "val", "test"} and summary["windows"]["train"] > 0
    assert set(summary["runs"]) == {"train", "val", "test", "excluded"}
    snap = Path(summary["snapshotDir"])
    assert snap.parent == out / "cli_ds"
    assert "Traceback" not in build.stderr

    # run elsewhere than the repository without an instance: the last line says the build is not
    # recorded and how to record it; the v1 lineage flag says what it means; the 4 finished runs leave val
    # and test empty, and the build says why
    last = build.stderr.strip().splitlines()[-1]
    assert last.startswith("not recorded in a Dagster instance") and "DAGSTER_HOME" in last, build.stderr
    assert "warning: val and test have no runs: the chronological split of 4 runs gives floor(4 x 0.15) = 0 " \
           "for val, floor(4 x 0.15) = 0 for test (docs/spec.md, split); 7 runs with windows give each at least one" \
           in build.stderr, build.stderr
    text = run_cli("build", str(spec), "--tsdb", ingested, "--out", str(out), env=env)
    assert "manifest  v1  lineageVerified=0  (v1: lineage not assessed, not a failure)" in text.stdout, text.stdout

    ok = run_cli("verify", str(snap))
    assert ok.returncode == 0 and summary["sha256"] in ok.stdout

    listed = run_cli("datasets", "--root", str(out), "--json")
    [entry] = json.loads(listed.stdout)
    assert entry["sha256"] == summary["sha256"] and entry["current"]

    y = snap / "arrays" / "y.f32"
    data = bytearray(y.read_bytes())
    data[-1] ^= 0x80
    y.write_bytes(bytes(data))
    bad = run_cli("verify", str(snap))
    assert bad.returncode == 1
    assert "arrays/y.f32" in bad.stderr and "Traceback" not in bad.stderr


def expect_user_error(capsys, argv, code: str, *fragments: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith(f"{code}: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[-1]
    return lines[-1]


@pytest.mark.parametrize(
    ("overrides", "code", "fragment"),
    [
        ({"historySteps": 0}, "SPEC_INVALID", "historySteps"),
        ({"horizonSteps": 0}, "SPEC_INVALID", "horizonSteps"),
        ({"split": {"train": 0.6, "val": 0.1, "test": 0.1}}, "SPEC_INVALID", "sum to 1"),
        ({"id": "Reactor-A"}, "SPEC_INVALID", "[a-z0-9_]+"),
        ({"id": "../etc"}, "SPEC_INVALID", "[a-z0-9_]+"),
        ({"nodes": [{"nodeId": "../../TI101", "role": "target"}]}, "SPEC_INVALID", "nodeId"),
        ({"nodes": [{"nodeId": "TI101", "role": "target"}, {"nodeId": "NOPE", "role": "feature"}]}, "UNKNOWN_NODE", "NOPE"),
        ({"historySteps": 5000}, "NO_WINDOWS", "fewer than historySteps + horizonSteps"),
        # each run's first window has a gap: the stride, not the data, leaves no other to try
        ({"stride": 10**6}, "NO_WINDOWS", "stride 1000000 is longer than the runs (the longest, L1-P100-"),
        ({"extras": {"recipeVersion": 3, "recipeContentHash": "x", "variables": [
            {"id": "t", "nodeId": "TI101", "scale": 0, "offset": 0}]}}, "UNIT_CONTRACT_INVALID", "scale"),
    ],
)
def test_build_user_errors_are_one_line_and_write_nothing(small_plant, ingested, tmp_path, capsys, monkeypatch, overrides, code, fragment):
    monkeypatch.setenv("AML_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    spec = write_spec(tmp_path / "spec.yaml", small_plant, **overrides)
    out = tmp_path / "published"
    expect_user_error(capsys, ["build", str(spec), "--tsdb", ingested, "--out", str(out)], code, fragment)
    leftovers = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert leftovers == [], leftovers


def test_an_instance_whose_settings_are_missing_from_the_environment_is_one_line(small_plant, ingested, tmp_path, capsys, monkeypatch):
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((config.REPO_ROOT / "deploy" / "dagster.yaml").read_text())
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    for name in ("DAGSTER_PG_PORT", "DAGSTER_PG_DB", "DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DAGSTER_PG_HOST", "127.0.0.1")
    spec = write_spec(tmp_path / "spec.yaml", small_plant)
    expect_user_error(
        capsys, ["build", str(spec), "--tsdb", ingested, "--home", str(tmp_path / "aml")], "INSTANCE_CONFIG_INVALID",
        f"the Dagster instance in {home}: its dagster.yaml reads environment variables that are not set: "
        "DAGSTER_PG_DB, DAGSTER_PG_PASSWORD, DAGSTER_PG_PORT, DAGSTER_PG_USER",
    )
    assert not (tmp_path / "aml").exists()


def test_build_with_no_runs_in_scope(small_plant, ingested, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AML_HOME", str(tmp_path / "home"))
    spec = write_spec(tmp_path / "spec.yaml", small_plant, lineId="NO_SUCH_LINE")
    expect_user_error(capsys, ["build", str(spec), "--tsdb", ingested, "--out", str(tmp_path / "o")], "NO_RUNS", "no finished runs")


def test_ingest_rejects_bad_file_naming_row_and_column_and_writes_nothing(small_plant, tmp_path, capsys):
    files = write_plant_files(small_plant, tmp_path / "files", fmt="csv")
    lines = files["points"].read_text().splitlines()
    header = [h.strip('"') for h in lines[0].split(",")]
    row = lines[5].split(",")
    row[header.index("value")] = "twelve"
    lines[5] = ",".join(row)
    bad = tmp_path / "bad_points.csv"
    bad.write_text("\n".join(lines) + "\n")
    url = f"duckdb://{tmp_path / 'db.duckdb'}"
    line = expect_user_error(
        capsys, ["ingest", "--tsdb", url, "--points", str(bad), "--runs", str(files["runs"]), "--nodes", str(files["nodes"])],
        "INGEST_INVALID", "bad_points.csv", "value",
    )
    assert "6" in line  # the CSV line number of the bad row
    # Nothing half-ingested: the runs and nodes files of the same call were not written either.
    from aml_pipeline.tsdb_open import open_tsdb
    from aml_pipeline.errors import TsdbError

    try:
        with open_tsdb(url) as db:
            assert db.list_runs(None, finished_only=False) == []
    except TsdbError as e:
        assert e.code == "TSDB_EMPTY"


def test_verify_of_a_missing_directory(tmp_path, capsys):
    expect_user_error(capsys, ["verify", str(tmp_path / "nope")], "NOT_FOUND", "nope")


# ---- messages a user reads ---------------------------------------------------------------------


def test_no_runs_describes_the_scope_in_words_and_what_the_tsdb_holds(small_plant, ingested, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AML_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    spec = write_spec(tmp_path / "spec.yaml", small_plant, lineId="L9", fromMs=1_735_718_400_000, toMs=1_735_804_800_000)
    line = expect_user_error(
        capsys, ["build", str(spec), "--tsdb", ingested, "--out", str(tmp_path / "o")], "NO_RUNS",
        "(line L9, product P100, recipe R7, overlapping 2025-01-01 08:00:00 UTC … 2025-01-02 08:00:00 UTC)",
        "holds 5 runs: 4 finished of line L1, product P100, recipe R7; 1 running of line L1",
    )
    assert "RunScope(" not in line


def test_verify_of_a_directory_that_is_not_a_snapshot(small_plant, ingested, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = expect_user_error(capsys, ["verify", str(empty)], "NOT_A_SNAPSHOT", str(empty), "spec.json, manifest.json, sha256.json")
    assert "SNAPSHOT_TAMPERED" not in line

    # a datasets root and a spec's folder: named as such, pointing at what to verify instead
    monkeypatch.setenv("AML_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    out = tmp_path / "published"
    assert main(["build", str(write_spec(tmp_path / "s.yaml", small_plant)), "--tsdb", ingested, "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expect_user_error(capsys, ["verify", str(out)], "NOT_A_SNAPSHOT", "datasets root")
    expect_user_error(capsys, ["verify", str(out / "cli_ds")], "NOT_A_SNAPSHOT", str(out / "cli_ds" / "current"))

    # a copy without its digest file, unknown to any catalog: fails, without an empty "changed:"
    copy = tmp_path / "copy" / "x" / "snap"
    import shutil

    shutil.copytree(summary["snapshotDir"], copy)
    (copy / "sha256.json").unlink()
    assert main(["verify", str(copy)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("SNAPSHOT_TAMPERED: ") and "sha256.json is missing" in err
    assert not err.rstrip().endswith("changed:")


def test_ingest_help_names_every_column(capsys):
    from aml_pipeline.tsdb.ingest import NODE_OPTIONAL, NODE_REQUIRED, POINT_COLUMNS, RUN_OPTIONAL, RUN_REQUIRED

    with pytest.raises(SystemExit) as exit_:
        main(["ingest", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for column in (*POINT_COLUMNS, *RUN_REQUIRED, *RUN_OPTIONAL, *NODE_REQUIRED, *NODE_OPTIONAL):
        assert column in text, column
    assert "docs/ingest.md" in text and "ISO-8601" in text


def test_baseline_prints_rmse_per_target_next_to_persistence(small_plant, ingested, tmp_path, capsys, monkeypatch):
    from aml_pipeline.training import ridge_baseline

    monkeypatch.setenv("AML_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    # four finished runs: two to train on, one each to choose alpha (val) and to test on
    spec = write_spec(tmp_path / "cli_ds.yaml", small_plant, split={"train": 0.5, "val": 0.25, "test": 0.25})
    out = tmp_path / "published"
    expect_user_error(capsys, ["baseline", str(spec), "--root", str(out)], "NO_SNAPSHOT", "cli_ds", "build it first")

    assert main(["build", str(spec), "--tsdb", ingested, "--out", str(out), "--json"]) == 0
    snapshot = Path(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["snapshotDir"])
    assert main(["baseline", str(spec), "--root", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # the very numbers the baseline_model asset computes in the shared environment
    snap = ridge_baseline.open_snapshot(snapshot)
    expected = ridge_baseline.train_and_evaluate(snap)
    assert report["sha256"] == snap.sha256 and report["alpha"] == expected["alpha"]
    targets = [r["target"] for r in report["targets"]]
    assert targets == snap.targets
    for i, row in enumerate(report["targets"]):
        assert row["test_rmse_model"] == pytest.approx(expected["rmse"]["test"]["model"][i], rel=1e-12)
        assert row["test_rmse_persistence"] == pytest.approx(expected["rmse"]["test"]["persistence"][i], rel=1e-12)

    assert main(["baseline", str(spec), "--root", str(out)]) == 0
    text = capsys.readouterr().out
    assert "persistence" in text and "alpha" in text
    for row in report["targets"]:
        assert any(line.split()[:1] == [row["target"]] and f"{row['test_rmse_model']:.4g}" in line for line in text.splitlines())

    # another spec's snapshot is refused, not reported under this spec's name
    other = write_spec(tmp_path / "other_ds.yaml", small_plant, id="other_ds")
    expect_user_error(capsys, ["baseline", str(other), "--snapshot", str(snapshot)], "USAGE",
                      "a snapshot of spec 'cli_ds', not of 'other_ds'")

    y = snapshot / "arrays" / "y.f32"
    data = bytearray(y.read_bytes())
    data[0] ^= 1
    y.write_bytes(bytes(data))
    expect_user_error(capsys, ["baseline", str(spec), "--root", str(out)], "SNAPSHOT_TAMPERED", "arrays/y.f32")


def test_plot_draws_a_built_runs_chart_as_the_ui_shows_it(small_plant, ingested, tmp_path, capsys, monkeypatch):
    import base64
    import re

    import dagster as dg

    home = tmp_path / "instance"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("AML_HOME", str(tmp_path / "home"))
    spec = write_spec(tmp_path / "spec.yaml", small_plant)
    runs = [r.run_id for r in small_plant.runs if r.ended_at is not None]
    assert main(["build", str(spec), "--tsdb", ingested, "--json"]) == 0
    with dg.DagsterInstance.get() as instance:
        [record] = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(["cli_ds", "cleaned_grid"]), asset_partitions=[runs[2]]), limit=1
        ).records
    shown = base64.b64decode(re.search(r"base64,([A-Za-z0-9+/=]+)\)", record.asset_materialization.metadata["plot"].value)[1])
    capsys.readouterr()

    out = tmp_path / "chart.png"
    assert main(["plot", str(spec), runs[2], "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes() == shown  # byte for byte the figure in the run's metadata
    # Built with the plots off, the traces are stored all the same.
    monkeypatch.setenv("AML_RUN_PLOTS", "off")
    assert main(["build", str(spec), "--tsdb", ingested, "--full", "--ephemeral", "--json"]) == 0
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(spec), runs[2]]) == 0
    assert (tmp_path / f"cli_ds-{runs[2]}.png").read_bytes() == shown

    unfinished = next(r.run_id for r in small_plant.runs if r.ended_at is None)
    expect_user_error(capsys, ["plot", str(spec), unfinished], "NOT_BUILT", repr(unfinished), "build the spec first")
    expect_user_error(capsys, ["plot", str(spec), "../etc"], "INVALID_ID", "run id")


def test_an_unexpected_error_is_one_line_and_its_traceback_is_kept_in_a_file(tmp_path, capsys, monkeypatch):
    """The last resort of ``main``: a bug is still one line, exit 2; the traceback is in a file
    the line names, for a bug report."""
    import tempfile

    from aml_pipeline.pipeline.publish import Catalog

    def broken(self, spec_id=None):
        raise RuntimeError("catalog entries exploded\nwith a second line")

    monkeypatch.setattr(Catalog, "entries", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["datasets", "--root", str(tmp_path / "root")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("UNEXPECTED: RuntimeError: catalog entries exploded (a bug in aml-pipeline"), line
    [saved] = tmp_path.glob("aml-pipeline-*.traceback")
    assert str(saved) in line
    text = saved.read_text()
    assert text.splitlines()[0] == f"aml-pipeline datasets --root {tmp_path / 'root'}"
    assert "Traceback" in text and "catalog entries exploded" in text and "def broken" not in line


def test_an_os_error_no_command_expected_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    from aml_pipeline.pipeline.publish import Catalog

    def denied(self, spec_id=None):
        raise PermissionError(13, "Permission denied", str(self.path))

    monkeypatch.setattr(Catalog, "entries", denied)
    assert main(["datasets", "--root", str(tmp_path / "root")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"FILE_ERROR: {tmp_path / 'root' / 'catalog.sqlite'}: Permission denied"


# --- Exit codes as docs/cli.md documents them ----------------------------------------------------


def documented_exit_codes() -> tuple[set[int], dict[str, set[int]]]:
    """The exit codes docs/cli.md promises: for every user error (the sentences of its "Errors"
    paragraph), and per command (its section, ``## verify``, and the Errors sentences that begin
    with it, "`verify` exits 1 ...")."""
    doc = (config.REPO_ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    code = re.compile(r"\bexits? (?:status )?(\d+)\b")
    intro, *sections = re.split(r"^## ", doc, flags=re.M)
    per_section: dict[str, set[int]] = {}
    for section in sections:
        title, _, body = section.partition("\n")
        per_section[title.strip()] = {int(c) for c in code.findall(" ".join(body.split()))}
    errors = " ".join(next(p for p in intro.split("\n\n") if p.startswith("**Errors.**")).split())
    on_error: set[int] = set()
    for sentence in re.split(r"(?<=\.)\s+", errors):
        named = re.match(r"`([a-z ]+)`", sentence)
        target = per_section.setdefault(named.group(1), set()) if named else on_error
        target.update(int(c) for c in code.findall(sentence))
    return on_error, per_section


def test_every_command_exits_with_the_codes_docs_cli_md_documents(small_plant, ingested, tmp_path, capsys, monkeypatch):
    from aml_pipeline.cli import build_parser

    monkeypatch.setenv("AML_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("AML_TSDB_URL", raising=False)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "catalog.sqlite").write_bytes(b"not a catalog" * 100)
    spec = write_spec(tmp_path / "cli_ds.yaml", small_plant)
    assert main(["build", str(spec), "--tsdb", ingested, "--json"]) == 0
    snapshot = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["snapshotDir"]
    tampered = tmp_path / "tampered"
    shutil.copytree(snapshot, tampered)
    (tampered / "arrays" / "y.f32").chmod(0o644)
    with open(tampered / "arrays" / "y.f32", "r+b") as f:
        f.write(b"\x00\x00\x80\x7f")

    t = str(tmp_path)
    user_errors = {  # one user error per command
        "demo": ["demo", "--runs", "0", "--home", f"{t}/demo"],
        "ingest": ["ingest", "--points", f"{t}/missing.csv", "--tsdb", f"duckdb://{t}/t.duckdb"],
        "build": ["build", f"{t}/missing.yaml"],
        "source check": ["source", "check", f"{t}/missing.yaml"],
        "verify": ["verify", f"{t}/nowhere"],
        "plot": ["plot", str(spec), "NO_SUCH_RUN"],
        "export": ["export", f"{t}/nowhere", "--out", f"{t}/export"],
        "datasets": ["datasets", "--root", f"{t}/root"],
        "gc": ["gc", "--keep", "-1"],
        "baseline": ["baseline", f"{t}/missing.yaml"],
        "inputs": ["inputs", str(tampered), "--at", "1735718460000", "--tsdb", ingested],
        "env status": ["env", "status", "--location", f"{t}/afile"],
        "env rebuild": ["env", "rebuild", "--wait-s", "-1", "--location", f"{t}/lease", "--venv", f"{t}/venv"],
    }
    commands = {" ".join(path) for path, parser in parser_tree(build_parser()) if path and not any(
        isinstance(a, argparse._SubParsersAction) for a in parser._actions)}
    assert commands == set(user_errors), "every command has a user error in this table"

    observed: dict[str, set[int]] = {name: set() for name in commands}
    for name, argv in user_errors.items():
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert "Traceback" not in "\n".join(err) and re.match(r"[A-Z_]+: ", err[-1]), (name, err)
        observed[name].add(code)
    for argv in (["verify", snapshot], ["verify", str(tampered)]):
        observed["verify"].add(main(argv))
        capsys.readouterr()

    on_error, per_section = documented_exit_codes()
    assert on_error == {2}, "docs/cli.md: a user error exits 2"
    assert all(codes == on_error for name, codes in observed.items() if name != "verify"), observed
    assert observed["verify"] == {0, 1, 2}
    documented = {name: codes for name, codes in per_section.items() if codes}
    assert documented, "the command sections document their exit codes"
    for section, codes in documented.items():
        names = [n for n in commands if n == section or n.startswith(section + " ")]
        assert names, f"docs/cli.md section {section!r} names no command"
        assert codes <= set().union(*(observed[n] for n in names)), (section, codes, observed)


RELOAD = """mutation Reload($name: String!) { reloadRepositoryLocation(repositoryLocationName: $name) {
  __typename ... on WorkspaceLocationEntry { loadStatus } ... on PythonError { message } } }"""
OWN_DATA = """query OwnData($manifest: AssetKeyInput!, $windows: AssetKeyInput!) {
  manifest: assetNodeOrError(assetKey: $manifest) { __typename ... on AssetNode { assetMaterializations(limit: 1) {
    metadataEntries { label ... on TextMetadataEntry { text } } } } }
  windows: assetNodeOrError(assetKey: $windows) { __typename ... on AssetNode { partitionStats { numMaterialized numPartitions } } }
}"""


def test_the_readme_own_data_block_ends_with_the_dataset_materialised_in_the_ui(small_plant, tmp_path):
    """Followed as the README writes it, in a checkout of the repository (its dagster.yaml and
    scripts/ui.sh), with no variable set: the UI that scripts/ui.sh opens there (DAGSTER_HOME = the
    checkout) runs already; a spec is added, points ingested, the dataset built; the definitions
    are reloaded, as the README says for a spec added while the UI runs; the UI shows it built."""
    from aml_pipeline_tests.dagster_server import DagsterDev, running, wait_for

    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "specs").mkdir()
    for name in ("dagster.yaml", "scripts/ui.sh", "specs/reactor_a.yaml"):
        (checkout / name).write_bytes((config.REPO_ROOT / name).read_bytes())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "DAGSTER_"))}
    # what scripts/ui.sh sets; the specs folder is the checkout's (the code location is the installed package's)
    ui_env = {**env, "DAGSTER_HOME": str(checkout), "AML_SPECS": str(checkout / "specs"), "DAGSTER_DISABLE_TELEMETRY": "1"}
    server = DagsterDev(module="aml_pipeline.definitions", env=ui_env, cwd=checkout, log_path=tmp_path / "ui.log")
    with running(server):
        server.wait_for_graphql(420)
        location = server.wait_for_location(420)

        # The README's own-data block, in the checkout, as a user types it: no variable set.
        write_spec(checkout / "specs" / "my_line.yaml", small_plant, id="my_line")
        files = write_plant_files(small_plant, tmp_path / "files", fmt="parquet")
        cli = {**env, "AML_SPECS": str(checkout / "specs")}
        ingest = subprocess.run([*CLI, "ingest", "--points", str(files["points"]), "--runs", str(files["runs"]),
                                 "--nodes", str(files["nodes"])], cwd=checkout, env=cli, capture_output=True, text=True)
        assert ingest.returncode == 0, ingest.stderr
        build = subprocess.run([*CLI, "build", "specs/my_line.yaml"], cwd=checkout, env=cli, capture_output=True, text=True)
        assert build.returncode == 0, build.stderr
        assert "not recorded" not in build.stderr, build.stderr
        summary = json.loads(build.stdout.strip().splitlines()[-1])
        built = sum(summary["runs"][p] for p in ("train", "val", "test"))

        reloaded = server.graphql(RELOAD, {"name": location["name"]})["reloadRepositoryLocation"]
        assert reloaded["__typename"] == "WorkspaceLocationEntry", reloaded
        server.wait_for_location(420)

        def shown():
            data = server.graphql(OWN_DATA, {"manifest": {"path": ["my_line", "dataset_manifest"]},
                                             "windows": {"path": ["my_line", "run_windows"]}})
            return data if data["manifest"]["__typename"] == "AssetNode" else None

        data = wait_for(shown, timeout=120, what="the asset group my_line in the UI", diagnostics=server.diagnostics)
    [materialization] = data["manifest"]["assetMaterializations"]
    sha = {e["label"]: e.get("text") for e in materialization["metadataEntries"]}["sha256"]
    assert sha == summary["sha256"]
    stats = data["windows"]["partitionStats"]
    assert stats["numMaterialized"] == stats["numPartitions"] >= built > 0, stats


def test_inputs_prints_and_writes_a_causal_window_s_x_and_refuses_bad_input_in_one_line(
    small_plant, ingested, tmp_path, capsys, monkeypatch
):
    """`inputs SNAPSHOT --at TIME`: the model's input at a window's origin, read from the TSDB or
    from a points file, equal to that window's x and u; a bad time or a node missing is one line."""
    import numpy as np

    from aml_pipeline.pipeline.registry import WINDOWS
    from aml_pipeline.pipeline.store import DatasetStore
    from aml_pipeline.snapshot import open_snapshot
    from aml_pipeline.spec import load_spec

    monkeypatch.setenv("AML_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    spec = write_spec(tmp_path / "cli_ds.yaml", small_plant, causal=True)
    assert main(["build", str(spec), "--tsdb", ingested, "--out", str(tmp_path / "published"), "--json"]) == 0
    snapshot = Path(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["snapshotDir"])
    snap = open_snapshot(snapshot)
    block = snap.runs("train")[0]
    store = DatasetStore(config.store_dir(tmp_path / "home"), load_spec(spec))
    start = int(store.read_flat(block.run_id, WINDOWS, "starts", 5, 6)[0])
    origin = store.read_meta(block.run_id, WINDOWS)["firstMs"] + start * 1000
    window = block.start + 5

    assert main(["inputs", str(snapshot), "--at", str(origin + 300), "--tsdb", ingested, "--controls", "realised",
                 "--json", "--out", str(tmp_path / "x.npz")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["originMs"] == origin and out["runId"] == block.run_id and out["causal"] and not out["mayDiffer"]
    assert np.array(out["x"], dtype=np.float32).tobytes() == np.asarray(snap.x[window]).tobytes()
    assert np.array(out["u"], dtype=np.float32).tobytes() == np.asarray(snap.u[window]).tobytes()
    saved = np.load(tmp_path / "x.npz")
    assert saved["x"].tobytes() == np.asarray(snap.x[window]).tobytes() and list(saved["nodes"]) == snap.nodes

    points = tmp_path / "files" / "points.csv"
    write_plant_files(small_plant, points.parent, fmt="csv")
    run_start = next(r.started_at for r in small_plant.runs if r.run_id == block.run_id)
    assert main(["inputs", str(snapshot), "--at", str(origin), "--points", str(points), "--run", block.run_id,
                 "--run-start", str(run_start)]) == 0
    text = capsys.readouterr().out
    assert "origin    " in text and f"({origin})" in text and "normalised" in text
    first_row = next(line for line in text.splitlines() if line.startswith("  20"))
    assert [float(v) for v in first_row.split()[1:]] == pytest.approx(np.asarray(snap.x[window][0]).tolist(), abs=5e-5)

    # a planned-controls file without a point is named as such, not taken for a gap after the origin
    empty = tmp_path / "planned.csv"
    empty.write_text("run_id,node_id,ts,value,state\n")
    for source in (["--tsdb", ingested], ["--points", str(points), "--run", block.run_id, "--run-start", str(run_start)]):
        expect_user_error(capsys, ["inputs", str(snapshot), "--at", str(origin), *source, "--controls", str(empty)],
                          "LIVE_INPUT_INVALID", f"--controls {empty}: the planned-controls file holds no points")
    expect_user_error(capsys, ["inputs", str(snapshot), "--at", "yesterday", "--tsdb", ingested], "LIVE_ORIGIN_INVALID", "yesterday")
    early = next(r.started_at for r in small_plant.runs if r.run_id == block.run_id) + 5_000
    expect_user_error(capsys, ["inputs", str(snapshot), "--at", str(early), "--tsdb", ingested, "--run", block.run_id],
                      "LIVE_TOO_FEW_POINTS", "historySteps")
    expect_user_error(capsys, ["inputs", str(snapshot), "--at", str(origin), "--points", str(points.parent / "runs.csv")],
                      "INGEST_INVALID")
    # The same points in seconds: named as such, not "no points before the origin" for points of 1970.
    import pandas as pd

    in_seconds = tmp_path / "points_s.csv"
    frame = pd.read_csv(points)
    frame.assign(ts=frame["ts"] // 1000).to_csv(in_seconds, index=False)
    expect_user_error(capsys, ["inputs", str(snapshot), "--at", str(origin), "--points", str(in_seconds), "--run",
                               block.run_id, "--run-start", str(run_start)],
                      "INGEST_INVALID", f"{in_seconds}: line 2, column 'ts': 1970-",
                      "the column looks like epoch seconds", "write epoch milliseconds or ISO-8601")


def test_gc_says_whether_it_pruned_the_dagster_instance(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AML_HOME", str(tmp_path / "aml"))
    monkeypatch.setenv("AML_SPECS", str(tmp_path / "specs"))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert main(["gc", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "Dagster instance: not pruned (no DAGSTER_HOME, and not run in the repository with its default AML_HOME)")
    (tmp_path / "dagster_home").mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    monkeypatch.setenv("AML_INSTANCE_RETENTION_DAYS", "7")
    assert main(["gc", "--dry-run", "--json"]) == 0
    instance = json.loads(capsys.readouterr().out.splitlines()[-1])["instance"]
    assert instance == {"dryRun": True, "retentionDays": 7, "deletedRuns": [], "keptOldRuns": 0, "freedBytes": 0}


def test_gc_names_a_root_that_does_not_exist(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AML_HOME", str(tmp_path / "aml"))
    monkeypatch.setenv("AML_SPECS", str(tmp_path / "specs"))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    (tmp_path / "datasets").mkdir()
    assert main(["gc", "--root", str(tmp_path / "datasets")]) == 0
    assert "no such folder" not in capsys.readouterr().out
    assert main(["gc", "--root", str(tmp_path / "dataset")]) == 0  # a typo
    assert f"no snapshots under {tmp_path / 'dataset'} (no such folder)" in capsys.readouterr().out.splitlines()
    assert not (tmp_path / "dataset").exists()


@pytest.mark.parametrize("installed", [False, True], ids=["checkout", "installed"])
def test_gc_reads_the_specs_where_the_demo_puts_its_spec(tmp_path, monkeypatch, capsys, installed):
    """Without AML_SPECS, gc's specs are the folder the demo's spec is in: the repository's
    ``specs/`` in its checkout, ``<home>/specs`` for an installed package (no ``scripts/ui.sh``
    beside the package)."""
    from aml_pipeline.demo import demo_spec

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AML_SPECS", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("AML_HOME", str(home))
    if installed:
        monkeypatch.setattr(config, "REPO_ROOT", tmp_path / "site-packages")
    assert (config.repository_checkout() is None) == installed
    spec = demo_spec(home)
    want = home / "specs" if installed else config.REPO_ROOT / "specs"
    # gc knows the demo's spec: it cleans that spec's intermediates instead of leaving them alone.
    spec_id = yaml.safe_load(spec.read_text())["id"]
    (home / "store" / spec_id).mkdir(parents=True)
    assert main(["gc", "--dry-run", "--json"]) == 0
    skipped = json.loads(capsys.readouterr().out.splitlines()[-1])["skipped"]
    assert not [s for s in skipped if s.startswith(f"{spec_id}:")], skipped
    assert spec.parent == want == config.specs_dir()
    # --home moves an installed package's specs folder with the rest of the home.
    assert config.specs_dir(tmp_path / "other") == (tmp_path / "other" / "specs" if installed else want)
    # AML_SPECS still wins, in either case.
    monkeypatch.setenv("AML_SPECS", str(tmp_path / "mine"))
    assert config.specs_dir(home) == tmp_path / "mine"


def test_ctrl_c_inside_a_build_is_one_line_and_the_same_build_again_finishes(small_plant, ingested, tmp_path, monkeypatch):
    """SIGINT delivered while the build's run stage reads the TSDB (stopped there first, so the
    signal lands inside Dagster's step): one line, exit 130, nothing published; the next build works."""
    import signal

    from aml_pipeline_tests.faults import armed, process_state, wait_stopped

    spec = write_spec(tmp_path / "cli_ds.yaml", small_plant)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    env = armed("fetch.page", tmp_path, {**os.environ, "AML_HOME": str(tmp_path / "home")})
    proc = subprocess.Popen([*CLI, "build", str(spec), "--tsdb", ingested], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = wait_stopped(proc, env, output=lambda: proc.stderr.read())
    assert pid == proc.pid and process_state(pid) == "T"
    os.kill(pid, signal.SIGINT)  # pending while stopped: delivered as it goes on, inside the fetch
    os.kill(pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert lines[-1].startswith("INTERRUPTED: stopped by Ctrl-C (SIGINT)"), err
    assert not (tmp_path / "home" / "datasets" / "cli_ds" / "current").exists()

    again = run_cli("build", str(spec), "--tsdb", ingested, "--json", env={"AML_HOME": str(tmp_path / "home")})
    assert again.returncode == 0, again.stderr
    assert run_cli("verify", json.loads(again.stdout.strip().splitlines()[-1])["snapshotDir"]).returncode == 0


def test_ctrl_c_in_a_build_with_workers_is_one_line_without_tracebacks(small_plant, ingested, tmp_path, monkeypatch):
    """Ctrl-C reaches the whole process group, as a terminal sends it: the CLI and the step
    processes of --workers (one of them stopped first inside its TSDB read). One INTERRUPTED line,
    exit 130, no traceback from a step process, the step server or a helper of Dagster's."""
    import signal

    from aml_pipeline_tests.faults import armed, process_state, wait_stopped

    spec = write_spec(tmp_path / "cli_ds.yaml", small_plant)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    env = armed("fetch.page", tmp_path, {**os.environ, "AML_HOME": str(tmp_path / "home"), "AML_PARALLEL_MIN_CELLS": "0"})
    proc = subprocess.Popen([*CLI, "build", str(spec), "--tsdb", ingested, "--workers", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pid = wait_stopped(proc, env, output=lambda: proc.stderr.read())
        assert pid != proc.pid and process_state(pid) == "T"  # a step process, inside its read
        os.killpg(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 300
        while True:
            # The other step process may stop at its own read, now or later (the crash point
            # stops each process at its first hit): keep continuing the group until the CLI ends.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
            try:
                out, err = proc.communicate(timeout=1)
                break
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "the interrupted build did not end"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # the step server and its children go too
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [ln for ln in err.splitlines() if ln.strip() and "STEP_WORKER_STARTED" not in ln]
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert lines[-1].startswith("INTERRUPTED: stopped by Ctrl-C (SIGINT)"), err
    assert not (tmp_path / "home" / "datasets" / "cli_ds" / "current").exists()
