"""Any input, one line: every bad file, flag or setting a careless user can give the real command
ends in one line naming the file and the key or field, exit 2 (``verify``: 1 for a snapshot that
fails, as documented), no traceback, and nothing lost: the published snapshot still verifies and
is still ``current``.

Each case runs ``python -m aml_pipeline.cli`` in a fresh process from the same known-good state:
a home with an ingested plant and a published v2 snapshot. Files a case breaks are copies (a
snapshot's files, the catalog, a home), never the originals.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from aml_pipeline.core.hashing import verify_snapshot
from aml_pipeline.pipeline.publish import Catalog
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant, write_plant_files

CLI = [sys.executable, "-m", "aml_pipeline.cli"]
LONG = 10_000


@dataclass
class World:
    root: Path
    home: Path
    spec: Path
    snapshot: Path
    sha256: str
    csv: dict[str, Path]
    parquet: dict[str, Path]

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AML_", "DAGSTER_"))}
        return {**env, "AML_HOME": str(self.home), **extra}

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *argv], cwd=self.root, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("bad_inputs")
    plant = simulate_plant(n_runs=5, run_minutes=6, seed=3)
    world = World(root, root / "home", root / "spec.yaml", Path(), "",
                  write_plant_files(plant, root / "csv", fmt="csv"), write_plant_files(plant, root / "parquet", fmt="parquet"))
    world.spec.write_text(yaml.safe_dump(plant_spec_dict(plant, "bad_ds", history_steps=20, horizon_steps=10, extras=True),
                                         sort_keys=False))
    env = world.env()
    files = [a for n in ("points", "runs", "nodes") for a in (f"--{n}", str(world.csv[n]))]
    assert world.run(["ingest", *files], env).returncode == 0
    built = world.run(["build", str(world.spec), "--json"], env)
    assert built.returncode == 0, built.stderr
    [entry] = Catalog(world.home / "datasets").entries("bad_ds")
    world.snapshot, world.sha256 = Path(entry.path), entry.sha256
    return world


# ---- the broken inputs, made from the good ones ------------------------------------------------


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def truncated(path: Path, out: Path) -> Path:
    data = path.read_bytes()
    return write(out, data[: len(data) // 2 + 7])


GARBAGE = bytes(range(256)) * 8


def spec_with(w: World, out: Path, **changes) -> Path:
    data = yaml.safe_load(w.spec.read_text())
    for key, value in changes.items():
        if key == "node0":
            data["nodes"][0]["nodeId"] = value
        else:
            data[key] = value
    return write(out, yaml.safe_dump(data, sort_keys=False))


def latin1_spec(w: World, out: Path) -> Path:
    return write(out, w.spec.read_bytes().replace(b"note: simulated plant", 'note: "Kühler"'.encode("latin-1")))


def latin1_csv(path: Path, out: Path) -> Path:
    data = path.read_bytes()
    first_row = data.index(b"\n") + 1
    return write(out, data[:first_row] + data[first_row:].replace(b"L1", "Lü".encode("latin-1"), 1).replace(
        b"kg/h", "kg/h\u00b3".encode("latin-1"), 1))


def parquet_with_booleans(path: Path, column: str, out: Path) -> Path:
    """The Parquet file with ``column`` made a boolean column (a quality flag, a mis-typed export)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    i = table.schema.get_field_index(column)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.set_column(i, column, pa.array([True] * len(table))), out)
    return out


def snapshot_copy(w: World, out: Path, change: Callable[[Path], None]) -> Path:
    shutil.copytree(w.snapshot, out, symlinks=True)
    for p in out.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)  # published snapshots are read-only
    change(out)
    return out


def catalog_root(w: World, out: Path, data: Callable[[bytes], bytes]) -> Path:
    write(out / "catalog.sqlite", data((w.home / "datasets" / "catalog.sqlite").read_bytes()))
    return out


def home_copy(w: World, out: Path, change: Callable[[Path], None]) -> Path:
    shutil.copytree(w.home, out, symlinks=True)
    for p in out.rglob("*"):
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    change(out)
    return out


@dataclass
class Case:
    """``make(world, scratch) -> (argv, env)``; the last stderr line must hold every fragment."""

    make: Callable[[World, Path], tuple[list[str], dict[str, str]]]
    fragments: tuple[str, ...]
    code: int = 2


def cmd(*argv: str | Callable[[World, Path], object], env: dict[str, str] | None = None):
    def make(w: World, s: Path) -> tuple[list[str], dict[str, str]]:
        args = [str(a(w, s)) if callable(a) else a for a in argv]
        return args, w.env(**{k: str(v(w, s)) if callable(v) else v for k, v in (env or {}).items()})
    return make


def spec(w: World, s: Path) -> Path:
    return w.spec


def snap_case(change: Callable[[Path], None]) -> Callable[[World, Path], Path]:
    return lambda w, s: snapshot_copy(w, s / "snap", change)


def truncate_file(name: str) -> Callable[[Path], None]:
    return lambda d: truncated(d / name, d / name)


def garbage_file(name: str) -> Callable[[Path], None]:
    return lambda d: write(d / name, GARBAGE)


def directory_instead(name: str) -> Callable[[Path], None]:
    def change(d: Path) -> None:
        (d / name).unlink()
        (d / name).mkdir()
    return change


def missing_file(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def ingest_case(kind: str, how: str, make_file: Callable[[World, Path], Path]) -> Case:
    return Case(cmd("ingest", "--tsdb", lambda w, s: f"duckdb://{s / 'fresh.duckdb'}", f"--{kind}", make_file),
                ("FILE_ERROR", f"{kind}.", "directory") if how == "directory" else ("INGEST_INVALID", f"{kind}."))


CASES: dict[str, Case] = {
    # the spec file
    "spec_latin1": Case(cmd("build", lambda w, s: latin1_spec(w, s / "latin1.yaml")), ("latin1.yaml", "line ", "key note", "UTF-8")),
    "spec_garbage": Case(cmd("build", lambda w, s: write(s / "garbage.yaml", GARBAGE)), ("garbage.yaml", "UTF-8")),
    "spec_truncated": Case(cmd("build", lambda w, s: truncated(w.spec, s / "trunc.yaml")), ("SPEC_INVALID", "trunc.yaml")),
    "spec_empty": Case(cmd("build", lambda w, s: write(s / "empty.yaml", "")), ("empty.yaml", "mapping")),
    "spec_missing": Case(cmd("build", lambda w, s: s / "missing.yaml"), ("missing.yaml", "cannot read")),
    "spec_directory": Case(cmd("build", lambda w, s: (s / "dir.yaml").mkdir() or s / "dir.yaml"), ("dir.yaml", "directory")),
    # a key given twice: plain YAML keeps the last silently (here a history of 5 steps, not 20)
    "spec_key_twice": Case(cmd("build", lambda w, s: write(s / "twice.yaml", w.spec.read_text() + "historySteps: 5\n")),
                           ("SPEC_INVALID", "twice.yaml", "key 'historySteps' is given twice", "first at line")),
    # true where a number belongs is not taken for 1 (a 1 ms beat; a unit scale nobody gave)
    "spec_beat_true": Case(cmd("build", lambda w, s: spec_with(w, s / "beat.yaml", beatMs=True)),
                           ("SPEC_INVALID", "field beatMs: true is not a number")),
    "spec_history_true": Case(cmd("build", lambda w, s: spec_with(w, s / "hist.yaml", historySteps=True)),
                              ("SPEC_INVALID", "field historySteps: true is not a number")),
    # text where a boolean or a number belongs is not read for what it spells ("yes" as true)
    "spec_causal_text": Case(cmd("build", lambda w, s: spec_with(w, s / "causal.yaml", causal="yes")),
                             ("SPEC_INVALID", "field causal: 'yes' is text, not true or false")),
    "spec_stride_text": Case(cmd("build", lambda w, s: spec_with(w, s / "stride.yaml", stride="5")),
                             ("SPEC_INVALID", "field stride: '5' is text, not a number")),
    "spec_long_id": Case(cmd("build", lambda w, s: spec_with(w, s / "long.yaml", id="a" * LONG)), ("field id", f"({LONG} characters)")),
    "spec_long_node": Case(cmd("build", lambda w, s: spec_with(w, s / "long.yaml", node0="N" * LONG)),
                           ("nodes[0].nodeId", f"({LONG} characters)")),
    # a beat longer than every run: no grid time falls in a run, so no windows (not a crash of
    # the grid stage's writer)
    "spec_beat_longer_than_the_runs": Case(cmd("build", lambda w, s: spec_with(w, s / "slow.yaml", beatMs=10**8)),
                                           ("NO_WINDOWS", "run has 0 grid rows")),
    "spec_long_line": Case(cmd("build", lambda w, s: spec_with(w, s / "long.yaml", lineId="L" * LONG)), ("NO_RUNS", f"({LONG} characters)")),
    # every ingest reader: points, runs, nodes as CSV and Parquet
    **{f"ingest_{kind}_{how}": ingest_case(kind, how, make) for kind in ("points", "runs", "nodes") for how, make in {
        "csv_truncated": lambda w, s, k=kind: truncated(w.csv[k], s / f"{k}.csv"),
        "csv_garbage": lambda w, s, k=kind: write(s / f"{k}.csv", GARBAGE),
        "csv_latin1": lambda w, s, k=kind: latin1_csv(w.csv[k], s / f"{k}.csv"),
        "parquet_truncated": lambda w, s, k=kind: truncated(w.parquet[k], s / f"{k}.parquet"),
        "parquet_garbage": lambda w, s, k=kind: write(s / f"{k}.parquet", GARBAGE),
        "missing": lambda w, s, k=kind: s / f"{k}.csv",
        "directory": lambda w, s, k=kind: (s / f"{k}.csv").mkdir() or s / f"{k}.csv",
    }.items()},
    # a boolean Parquet column where an integer or a time belongs is refused, not read as 0/1
    # (a time 1 ms after 1970, a "good" flag as state 1)
    **{f"ingest_{kind}_parquet_boolean_{column}": Case(
        cmd("ingest", "--tsdb", lambda w, s: f"duckdb://{s / 'fresh.duckdb'}",
            *(a for k in ("points", "runs", "nodes") for a in (
                f"--{k}", (lambda w, s, k=k, c=column: parquet_with_booleans(w.parquet[k], c, s / f"{k}.parquet")) if k == kind
                else (lambda w, s, k=k: w.parquet[k])))),
        ("INGEST_INVALID", f"{kind}.parquet: row 1, column '{column}'", "expected integers", "bool"))
        for kind, column in (("points", "ts"), ("points", "state"), ("runs", "started_at"), ("runs", "recipe_version"))},
    # a snapshot's files, for each command that reads them
    **{f"{command}_{name}_{how}": Case(
        cmd(command, *([spec, "--snapshot"] if command == "baseline" else []), snap_case(change),
            *(["--out", lambda w, s: s / "export"] if command == "export" else [])),
        (name,), 1 if command == "verify" else 2)
        for command in ("verify", "export", "baseline")
        for name, how, change in [
            ("manifest.json", "truncated", truncate_file("manifest.json")),
            ("manifest.json", "garbage", garbage_file("manifest.json")),
            ("manifest.json", "missing", missing_file("manifest.json")),
            ("x.f32", "truncated", truncate_file("arrays/x.f32")),
            ("x.f32", "directory", directory_instead("arrays/x.f32")),
            ("sha256.json", "truncated", truncate_file("sha256.json")),
            ("sha256.json", "garbage", garbage_file("sha256.json")),
        ]},
    "verify_missing": Case(cmd("verify", lambda w, s: s / "nowhere"), ("nowhere",)),
    # a folder that is no snapshot (the spec's folder, the datasets root) is named as such, not
    # as a tampered snapshot, and a --snapshot that is a file is not "no current snapshot"
    "export_spec_folder": Case(cmd("export", lambda w, s: w.snapshot.parent, "--out", lambda w, s: s / "export"),
                               ("NOT_A_SNAPSHOT", "its current snapshot is")),
    "export_layout_datasets_root": Case(cmd("export", lambda w, s: w.home / "datasets", "--out", lambda w, s: s / "export",
                                            "--layout", "windows"), ("NOT_A_SNAPSHOT", "datasets root")),
    "export_out_under_a_file": Case(cmd("export", lambda w, s: w.snapshot, "--out", lambda w, s: write(s / "afile", "x") / "export"),
                                    ("EXPORT_FAILED", "--out", "afile is a file, not a directory")),
    "baseline_snapshot_spec_folder": Case(cmd("baseline", spec, "--snapshot", lambda w, s: w.snapshot.parent),
                                          ("NOT_A_SNAPSHOT", "its current snapshot is")),
    "baseline_snapshot_is_a_file": Case(cmd("baseline", spec, "--snapshot", spec), ("NOT_FOUND", "--snapshot", "spec.yaml")),
    "verify_long_path": Case(cmd("verify", "v" * LONG), ("FILE_ERROR", f"({LONG} characters)")),
    # the catalog
    "datasets_catalog_garbage": Case(cmd("datasets", "--root", lambda w, s: catalog_root(w, s / "root", lambda b: GARBAGE)),
                                     ("CATALOG_INVALID", "catalog.sqlite")),
    "datasets_catalog_truncated": Case(cmd("datasets", "--root", lambda w, s: catalog_root(w, s / "root", lambda b: b[:3000])),
                                       ("CATALOG_INVALID", "catalog.sqlite")),
    "build_catalog_garbage": Case(cmd("build", spec, "--full", env={"AML_HOME": lambda w, s: home_copy(
        w, s / "home", lambda h: write(h / "datasets" / "catalog.sqlite", GARBAGE))}), ("CATALOG_INVALID", "catalog.sqlite")),
    # flags
    "gc_keep_negative": Case(cmd("gc", "--keep", "-1"), ("--keep",)),
    "gc_keep_not_a_number": Case(cmd("gc", "--keep", "abc"), ("--keep", "abc")),
    "build_workers_zero": Case(cmd("build", spec, "--workers", "0"), ("--workers",)),
    "build_workers_not_a_number": Case(cmd("build", spec, "--workers", "two"), ("--workers", "two")),
    "build_log_level_unknown": Case(cmd("build", spec, "--log-level", "LOUD"), ("USAGE", "--log-level", "LOUD", "CRITICAL")),
    "demo_log_level_unknown": Case(cmd("demo", "--log-level", "LOUD", "--home", lambda w, s: s / "demo"), ("USAGE", "--log-level", "LOUD")),
    "demo_runs_negative": Case(cmd("demo", "--runs", "-1", "--home", lambda w, s: s / "demo"), ("--runs",)),
    "ingest_lock_timeout_negative": Case(cmd("ingest", "--points", lambda w, s: w.csv["points"], "--lock-timeout-s", "-1"),
                                         ("--lock-timeout-s",)),
    "ingest_lock_timeout_nan": Case(cmd("ingest", "--points", lambda w, s: w.csv["points"], "--lock-timeout-s", "nan"),
                                    ("--lock-timeout-s",)),
    # A wait so long its deadline would overflow the platform's clock (and hold a lock for ages).
    "ingest_lock_timeout_huge": Case(cmd("ingest", "--points", lambda w, s: w.csv["points"], "--lock-timeout-s", "1e10"),
                                     ("USAGE", "--lock-timeout-s 1e+10", "from 0 to 86400 (a day)")),
    "env_rebuild_wait_huge": Case(cmd("env", "rebuild", "--wait-s", "1e12", "--location", lambda w, s: s / "lease",
                                      "--venv", lambda w, s: s / "venv"), ("USAGE", "--wait-s 1e+12", "from 0 to 86400")),
    "env_status_venv_is_a_file": Case(cmd("env", "status", "--location", lambda w, s: s / "lease",
                                          "--venv", lambda w, s: write(s / "venvfile", "x")),
                                      ("ENV_CONFIG_INVALID", "venvfile is a file, not an environment")),
    "baseline_alpha_negative": Case(cmd("baseline", spec, "--alphas", "-1"), ("--alphas",)),
    "env_rebuild_wait_negative": Case(cmd("env", "rebuild", "--wait-s", "-1", "--location", lambda w, s: s / "lease",
                                          "--venv", lambda w, s: s / "venv"), ("--wait-s",)),
    # --out where no file can go: named as given, not by the writer's temporary file
    "plot_out_is_a_directory": Case(cmd("plot", spec, "L1-P100-0001", "--out", lambda w, s: (s / "plotdir").mkdir() or s / "plotdir"),
                                    ("FILE_ERROR", "plotdir: Is a directory")),
    "plot_out_in_a_missing_folder": Case(cmd("plot", spec, "L1-P100-0001", "--out", lambda w, s: s / "nowhere" / "run.png"),
                                         ("FILE_ERROR", "nowhere/run.png: No such file or directory")),
    "plot_long_run_id": Case(cmd("plot", spec, "R" * LONG), ("run id", f"({LONG} characters)")),
    # a datasets root that is a file: not "no published snapshots", not a gc with nothing to do
    **{f"{command}_root_is_a_file": Case(cmd(command, *([spec] if command == "baseline" else []), "--root",
                                             lambda w, s: write(s / "afile", "x"), *(["--dry-run"] if command == "gc" else [])),
                                         ("CONFIG_INVALID", "--root", "afile", "not a directory"))
       for command in ("datasets", "gc", "baseline")},
    "build_home_is_a_file": Case(cmd("build", spec, "--home", lambda w, s: write(s / "afile", "x")), ("--home", "afile", "not a directory")),
    # settings
    "aml_home_is_a_file": Case(cmd("build", spec, env={"AML_HOME": lambda w, s: write(s / "afile", "x")}),
                               ("AML_HOME", "afile", "not a directory")),
    "aml_home_under_a_file": Case(cmd("datasets", env={"AML_HOME": lambda w, s: write(s / "afile", "x") / "home"}),
                                  ("AML_HOME", "afile", "not a directory")),
    "memory_not_a_number": Case(cmd("build", spec, env={"AML_MEMORY_MB": "abc"}), ("AML_MEMORY_MB", "abc")),
    "memory_too_small": Case(cmd("build", spec, env={"AML_MEMORY_MB": "1"}), ("AML_MEMORY_MB", "64")),
    # past what a machine has or a date can hold: one line naming the variable, not a TSDB that
    # cannot be opened or an overflow
    "memory_too_large": Case(cmd("build", spec, env={"AML_MEMORY_MB": str(2**63 - 1)}), ("AML_MEMORY_MB", "1073741824")),
    "retention_too_large": Case(cmd("gc", "--dry-run", env={"AML_INSTANCE_RETENTION_DAYS": "999999999999",
                                                             "DAGSTER_HOME": lambda w, s: (s / "dh").mkdir() or s / "dh"}),
                                ("CONFIG_INVALID", "AML_INSTANCE_RETENTION_DAYS", "36500")),
    "chunk_zero": Case(cmd("build", spec, "--full", env={"AML_BACKFILL_RUNS_PER_CHUNK": "0"}), ("AML_BACKFILL_RUNS_PER_CHUNK",)),
    "run_plots_unknown": Case(cmd("build", spec, "--full", env={"AML_RUN_PLOTS": "maybe"}), ("AML_RUN_PLOTS", "maybe")),
    "tsdb_retry_not_a_number": Case(cmd("build", spec, "--full", env={"AML_TSDB_RETRY_S": "abc"}), ("AML_TSDB_RETRY_S",)),
    "parallel_cells_not_a_number": Case(cmd("build", spec, "--full", "--workers", "2", env={"AML_PARALLEL_MIN_CELLS": "abc"}),
                                        ("AML_PARALLEL_MIN_CELLS",)),
    "tsdb_url_long": Case(cmd("ingest", "--tsdb", "x" * LONG, "--points", lambda w, s: w.csv["points"]),
                          ("TSDB_URL_INVALID", f"({LONG + 3} characters)")),
    "tsdb_url_unknown_scheme": Case(cmd("build", spec, env={"AML_TSDB_URL": "bogus://x"}), ("bogus://x",)),
    "tsdb_url_not_a_database": Case(cmd("build", spec, env={"AML_TSDB_URL": lambda w, s: f"duckdb://{write(s / 'afile', 'x')}"}),
                                    ("afile",)),
    # a DuckDB URL names a DuckDB file whatever its suffix: not read as a source description
    "tsdb_url_duckdb_names_a_yaml_file": Case(
        cmd("build", spec, env={"AML_TSDB_URL": lambda w, s: f"duckdb://{write(s / 'plant.yaml', 'backend: postgres')}"}),
        ("TSDB_NOT_A_DATABASE", "plant.yaml is not a DuckDB database file", "source://")),
    "ingest_into_a_yaml_file": Case(
        cmd("ingest", "--points", lambda w, s: w.csv["points"],
            env={"AML_TSDB_URL": lambda w, s: f"duckdb://{write(s / 'plant.yaml', 'backend: postgres')}"}),
        ("TSDB_NOT_A_DATABASE", "plant.yaml is not a DuckDB database file", "source://")),
    "env_location_is_a_file": Case(cmd("env", "status", env={"AML_ENV_LOCATION": lambda w, s: write(s / "afile", "x")}), ("afile",)),
    "dagster_home_is_a_file": Case(cmd("build", spec, env={"DAGSTER_HOME": lambda w, s: write(s / "afile", "x")}),
                                   ("DAGSTER_HOME", "afile")),
    "dagster_home_missing": Case(cmd("build", spec, env={"DAGSTER_HOME": lambda w, s: s / "nowhere"}), ("DAGSTER_HOME", "nowhere")),
    # a forecast origin beyond the years a time has (a digit too many), and one whose history
    # reaches back before year 1
    "inputs_at_out_of_range": Case(cmd("inputs", lambda w, s: w.snapshot, "--at", "9" * 20),
                                   ("LIVE_ORIGIN_INVALID", "--at " + "9" * 20, "out of range")),
    "inputs_run_start_out_of_range": Case(cmd("inputs", lambda w, s: w.snapshot, "--at", "1735718460000", "--points",
                                              lambda w, s: w.csv["points"], "--run-start", "1" + "0" * 15),
                                          ("LIVE_ORIGIN_INVALID", "--run-start 1000000000000000", "out of range")),
    "inputs_history_before_year_1": Case(cmd("inputs", lambda w, s: w.snapshot, "--at=-62135596800000", "--run", "L1-P100-0001"),
                                         ("LIVE_TOO_FEW_POINTS", "epoch ms -62135596820000")),
    # a flag of the other source is refused, not ignored; a --run the points file does not hold
    # is named as such, not as a node without points
    "inputs_points_and_tsdb": Case(cmd("inputs", lambda w, s: w.snapshot, "--at", "1735718460000", "--points",
                                       lambda w, s: w.csv["points"], "--tsdb", lambda w, s: f"duckdb://{w.home / 'tsdb.duckdb'}"),
                                   ("USAGE", "--points", "--tsdb")),
    "inputs_run_start_without_points": Case(cmd("inputs", lambda w, s: w.snapshot, "--at", "1735718460000", "--run-start",
                                                "1735718400000"), ("USAGE", "--run-start", "--points")),
    "inputs_points_without_the_run": Case(cmd("inputs", lambda w, s: w.snapshot, "--at", "1735718460000", "--points",
                                              lambda w, s: w.csv["points"], "--run", "L9-NOPE"),
                                          ("UNKNOWN_RUN", "--run L9-NOPE", "points.csv holds no point of that run")),
    # a source description, through `source check` only (its reader is sources/)
    "source_key_twice": Case(cmd("source", "check", lambda w, s: write(s / "plant.yaml", "backend: files\nbackend: postgresql\n")),
                             ("SOURCE_INVALID", "plant.yaml", "line 2: key 'backend' is given twice (first at line 1)")),
    "source_garbage": Case(cmd("source", "check", lambda w, s: write(s / "plant.yaml", GARBAGE)), ("plant.yaml",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_is_one_line_naming_it_and_loses_nothing(world, tmp_path, name):
    case = CASES[name]
    argv, env = case.make(world, tmp_path)
    done = world.run(argv, env)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == case.code, f"exit {done.returncode}: {done.stderr[-2000:]}"
    last = done.stderr.strip().splitlines()[-1]
    assert len(last) < 500, f"{len(last)} characters: {last[:300]}"
    for fragment in case.fragments:
        assert fragment in last, f"{fragment!r} not in {last!r}"
    assert not (tmp_path / "fresh.duckdb").exists()  # a failed ingest into a new file leaves none
    # nothing lost: the published snapshot is intact and still current
    assert verify_snapshot(world.snapshot, world.sha256).ok
    assert (world.home / "datasets" / "bad_ds" / "current").resolve() == world.snapshot.resolve()
    [entry] = Catalog(world.home / "datasets").entries("bad_ds")
    assert entry.sha256 == world.sha256 and entry.current


def test_datasets_says_which_spec_has_none_and_that_a_root_is_not_there(world, tmp_path):
    """An empty listing says why: another spec's snapshots are there, or the root does not exist
    (a typo), rather than "no published snapshots" for a root that holds some."""
    other = world.run(["datasets", "--spec", "other_ds"], world.env())
    assert other.returncode == 0 and other.stdout.strip() == (
        f"no published snapshots of spec 'other_ds' under {world.home / 'datasets'}")
    typo = world.run(["datasets", "--root", str(tmp_path / "nowhere")], world.env())
    assert typo.returncode == 0 and typo.stdout.strip().endswith("(no such folder)")
    assert not (tmp_path / "nowhere").exists()


def test_gc_names_an_aml_specs_that_is_a_file(world, tmp_path):
    """AML_SPECS naming a spec file instead of its folder is a setting that cannot work: gc says
    so in one line and removes nothing, rather than going on without any spec."""
    before = sorted(p.relative_to(world.home) for p in world.home.rglob("*"))
    done = world.run(["gc"], world.env(AML_SPECS=str(world.spec)))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"CONFIG_INVALID: AML_SPECS {world.spec}: is a file, not a folder of specs; name the folder that holds them")
    assert sorted(p.relative_to(world.home) for p in world.home.rglob("*")) == before


def test_the_table_covers_every_reader_and_the_cases_of_the_issue():
    """The cases the table must keep: a spec that is not UTF-8, an over-long id, AML_HOME on a
    file, truncated and garbage files for every reader, a missing file, a directory for a file,
    bad flag values and bad settings."""
    names = set(CASES)
    for kind in ("points", "runs", "nodes"):
        for how in ("csv_truncated", "csv_garbage", "parquet_truncated", "parquet_garbage", "missing", "directory"):
            assert f"ingest_{kind}_{how}" in names
    for command in ("verify", "export", "baseline"):
        for name in ("manifest.json", "x.f32", "sha256.json"):
            assert any(n.startswith(f"{command}_{name}_") for n in names)
    assert {"spec_latin1", "spec_long_id", "aml_home_is_a_file", "datasets_catalog_garbage", "gc_keep_negative",
            "memory_not_a_number", "chunk_zero", "spec_missing", "spec_directory"} <= names
