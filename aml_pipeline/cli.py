"""``aml-pipeline``: demo, ingest, build, verify, datasets, env.

User errors print one line ``CODE: message`` on stderr and exit 2 (1 for a failed
verification); they never print a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from aml_pipeline import config
from aml_pipeline.errors import AmlError
from aml_pipeline.progress import progress_bars


def _progress(total: int, desc: str, unit: str = "it"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)


def cmd_ingest(args: argparse.Namespace) -> int:
    from aml_pipeline.tsdb.ingest import ingest_into

    if not (args.points or args.runs or args.nodes):
        args.subparser.error("nothing to ingest: give at least one of --points, --runs, --nodes")
    if args.replace_run and not args.points:
        args.subparser.error("--replace-run replaces the points of the runs in --points: give --points")
    url = args.tsdb or config.tsdb_url()
    with _progress(0, "ingest", "step") as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        summary = ingest_into(
            url, points=args.points, runs=args.runs, nodes=args.nodes, progress=progress,
            replace_runs=args.replace_run, lock_timeout_s=args.lock_timeout_s,
        )
    print(json.dumps(summary))
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from aml_pipeline.defs.inprocess import materialize_dataset
    from aml_pipeline.spec import load_spec

    spec = load_spec(args.spec)
    url = args.tsdb or config.tsdb_url()
    home = Path(args.home).resolve() if args.home else config.aml_home()
    with progress_bars():
        summary = materialize_dataset(
            spec,
            tsdb_url=url,
            home=home,
            datasets_dir=Path(args.out).resolve() if args.out else None,
            instance=_instance(args),
            console_log_level=args.log_level,
        )
    _print_summary(summary, as_json=args.json)
    return 0


def _instance(args: argparse.Namespace):
    """The persistent instance when DAGSTER_HOME is set (the UI then shows this build)."""
    if os.environ.get("DAGSTER_HOME") and not getattr(args, "ephemeral", False):
        import dagster as dg

        return dg.DagsterInstance.get()
    return None


def _print_summary(summary: dict[str, Any], *, as_json: bool) -> None:
    if not as_json:
        w, r = summary["windows"], summary["runs"]
        print(f"snapshot  {summary['snapshotDir']}")
        print(f"sha256    {summary['sha256']}")
        print(f"manifest  v{summary['manifestVersion']}  lineageVerified={summary['lineageVerified']}")
        print(f"windows   train {w['train']}  val {w['val']}  test {w['test']}")
        print(f"runs      train {r['train']}  val {r['val']}  test {r['test']}  excluded {r['excluded']}")
    print(json.dumps(summary))


def cmd_verify(args: argparse.Namespace) -> int:
    from aml_pipeline.core.hashing import verify_snapshot
    from aml_pipeline.pipeline.publish import Catalog

    snapshot = Path(args.snapshot_dir)
    if not snapshot.is_dir():
        raise AmlError(f"{snapshot}: not a snapshot directory", code="NOT_FOUND")
    entry = Catalog(snapshot.resolve().parent.parent).find_by_path(snapshot.resolve())
    result = verify_snapshot(snapshot, entry.sha256 if entry else None)
    if result.ok:
        print(f"OK {result.actual} {snapshot}")
        return 0
    print(
        f"SNAPSHOT_TAMPERED: {snapshot}: {result.problem}; changed: {', '.join(result.changed)}",
        file=sys.stderr,
    )
    return 1


def cmd_datasets(args: argparse.Namespace) -> int:
    from aml_pipeline.pipeline.publish import Catalog

    root = Path(args.root) if args.root else config.datasets_dir()
    entries = Catalog(root).entries(args.spec)
    if args.json:
        print(json.dumps([e.to_json() for e in entries]))
        return 0
    if not entries:
        print(f"no published snapshots under {root}")
        return 0
    print(f"{'spec':<16} {'cur':<3} {'sha256':<16} {'v':<2} {'created':<20} {'train/val/test windows':<24} path")
    for e in entries:
        windows = "/".join(str(e.windows[p]) for p in ("train", "val", "test"))
        print(
            f"{e.spec_id:<16} {'*' if e.current else '':<3} {e.sha256[:16]:<16} {e.manifest_version:<2} "
            f"{e.created_at:<20} {windows:<24} {e.path}"
        )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from aml_pipeline.demo import run_demo

    with progress_bars():
        summary = run_demo(
            home=Path(args.home).resolve() if args.home else config.aml_home(),
            spec_path=Path(args.spec) if args.spec else None,
            runs=args.runs,
            instance=_instance(args),
            console_log_level=args.log_level,
        )
    _print_summary(summary, as_json=args.json)
    return 0


def _env_settings(args: argparse.Namespace):
    from aml_pipeline.envs import EnvSettings

    return EnvSettings.from_environment(
        venv_path=args.venv,
        lease_location=args.location,
        requirements=getattr(args, "requirements", None),
        installer=getattr(args, "installer", None),
        python=getattr(args, "python", None),
    )


def cmd_env_status(args: argparse.Namespace) -> int:
    from aml_pipeline.envs import format_status, shared_env_status

    status = shared_env_status(_env_settings(args))
    print(json.dumps(status) if args.json else format_status(status))
    return 0


def cmd_env_rebuild(args: argparse.Namespace) -> int:
    from aml_pipeline.envs import rebuild_shared_env

    build = rebuild_shared_env(
        _env_settings(args),
        holder="aml-pipeline env rebuild",
        wait_s=args.wait_s,
        log=lambda message: print(message, file=sys.stderr),
    )
    if args.json:
        print(json.dumps(build.to_dict()))
        return 0
    print(f"env       {build.venv_path} -> {build.build_dir.name}")
    print(f"python    {build.python} ({build.implementation} {build.python_version})")
    print(f"installer {build.installer}, {len(build.packages)} packages, {build.duration_s:.1f}s")
    for p in build.packages:
        print(f"  {p['name']:<28} {p['version']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aml-pipeline", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="seed the simulated plant and build the example dataset through Dagster")
    d.add_argument("--home", help="AML_HOME (default: $AML_HOME or ./.aml)")
    d.add_argument("--spec", help="spec to build (default specs/reactor_a.yaml)")
    d.add_argument("--runs", type=int, default=12, help="simulated runs to seed")
    d.add_argument("--json", action="store_true", help="print only the JSON summary")
    d.add_argument("--log-level", default="CRITICAL", help="Dagster console log level (the run log is kept in full)")
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser("ingest", help="ingest points/runs/nodes files (CSV or Parquet) into a TSDB")
    i.add_argument("--tsdb", help="TSDB URL (default: $AML_TSDB_URL or the embedded file in AML_HOME)")
    i.add_argument("--points", help="points file: run_id, node_id, ts, value, state")
    i.add_argument("--runs", help="runs file")
    i.add_argument("--nodes", help="nodes file")
    i.add_argument(
        "--replace-run", action="store_true",
        help="replace all stored points of every run in --points by the file's points (one transaction); "
        "without it, points already stored are skipped",
    )
    i.add_argument("--lock-timeout-s", type=float, default=10.0, help="wait this long for readers of an embedded TSDB file (default 10)")
    i.set_defaults(func=cmd_ingest, subparser=i)

    b = sub.add_parser("build", help="build and publish a dataset snapshot through its Dagster assets")
    b.add_argument("spec", help="dataset spec (YAML)")
    b.add_argument("--tsdb", help="TSDB URL (default: $AML_TSDB_URL or the embedded file in AML_HOME)")
    b.add_argument("--out", help="datasets root to publish into (default: $AML_HOME/datasets)")
    b.add_argument("--home", help="AML_HOME for intermediate artifacts (default: $AML_HOME or ./.aml)")
    b.add_argument("--json", action="store_true", help="print only the JSON summary")
    b.add_argument("--ephemeral", action="store_true", help="do not record in $DAGSTER_HOME's instance")
    b.add_argument("--log-level", default="CRITICAL", help="Dagster console log level (the run log is kept in full)")
    b.set_defaults(func=cmd_build)

    v = sub.add_parser("verify", help="check every hashed byte of a snapshot (exit 0 only if intact)")
    v.add_argument("snapshot_dir")
    v.set_defaults(func=cmd_verify)

    ls = sub.add_parser("datasets", help="list published snapshots")
    ls.add_argument("--root", help="datasets root (default: $AML_HOME/datasets)")
    ls.add_argument("--spec", help="only this spec id")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_datasets)

    env = sub.add_parser("env", help="the shared Python environment: lease status, rebuild")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    for name, helptext in (
        ("status", "show readers, holders, the exclusive owner and the environment's interpreter"),
        ("rebuild", "take the exclusive lease and rebuild the environment (ENV_BUSY while in use)"),
    ):
        e = env_sub.add_parser(name, help=helptext)
        e.add_argument("--location", help="lease location: directory or postgresql:// URL (default: $AML_ENV_LOCATION or $AML_HOME/env)")
        e.add_argument("--venv", help="environment path (default: $AML_HOME/shared-env/venv)")
        e.add_argument("--json", action="store_true", help="print JSON")
    env_status, env_rebuild = env_sub.choices["status"], env_sub.choices["rebuild"]
    env_status.set_defaults(func=cmd_env_status)
    env_rebuild.add_argument("--wait-s", type=float, default=0.0, help="wait this long for the lease (default 0: refuse at once)")
    env_rebuild.add_argument("--requirements", help="pinned requirements (default: requirements/shared-env.txt)")
    env_rebuild.add_argument(
        "--installer", choices=("auto", "uv", "pip", "copy"), default="auto",
        help="auto: uv if on PATH, else python -m venv + pip; copy: offline, copy the pinned packages from this environment",
    )
    env_rebuild.add_argument("--python", help="interpreter that creates the venv (default: this one)")
    env_rebuild.set_defaults(func=cmd_env_rebuild)

    return p


def main(argv: list[str] | None = None) -> int:
    # Dagster flags beta parameters (backfill_policy, observable sources) at definition time;
    # useful to a Dagster developer, noise on a user's terminal.
    warnings.filterwarnings("ignore", message=r".*is currently in beta.*")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except AmlError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
