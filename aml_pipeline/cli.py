"""The ``aml-pipeline`` command line; :func:`build_parser` declares its subcommands and flags.

User errors print one line ``CODE: message`` on stderr and exit 2 (1 for a failed
verification); they never print a traceback. An operating-system error no command expected is
one line naming the file (``FILE_ERROR``), and anything else (a bug) one ``UNEXPECTED`` line with
the traceback saved to a file, both exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from aml_pipeline import config
from aml_pipeline.errors import AmlError, cut
from aml_pipeline.ids import check_spec_id
from aml_pipeline.progress import progress_bars


def _progress(total: int, desc: str, unit: str = "it"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False, disable=None)


# The levels Dagster's console logger takes; checked here, where the flag is read, so a typo is
# the flag's usage error and not a failure deep in the build.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    """``--log-level``'s value, upper-cased; USAGE naming the flag for a level Dagster has not."""
    level = value.strip().upper()
    if level == "WARN":
        level = "WARNING"
    if level not in LOG_LEVELS:
        raise AmlError(f"--log-level {cut(value)!r}: use one of {', '.join(LOG_LEVELS)}", code="USAGE")
    return level


def _home(args: argparse.Namespace) -> Path:
    """``--home DIR`` where the command has it, else ``AML_HOME``: like the variable, the flag moves
    the default TSDB, the intermediates and the published datasets."""
    given = getattr(args, "home", None)
    return config.usable_home(Path(given).resolve(), "--home") if given else config.aml_home()


def _tsdb_url(args: argparse.Namespace) -> str:
    """``--tsdb URL``, else ``AML_TSDB_URL``, else the embedded file in the command's home."""
    return args.tsdb or config.tsdb_url(_home(args))


def cmd_ingest(args: argparse.Namespace) -> int:
    from aml_pipeline.sources import is_source_url, read_only_error
    from aml_pipeline.tsdb.ingest import ingest_into
    from aml_pipeline.tsdb_open import open_tsdb

    if not (args.points or args.runs or args.nodes):
        args.subparser.error("nothing to ingest: give at least one of --points, --runs, --nodes")
    if args.replace_run and not args.points:
        args.subparser.error("--replace-run replaces the points of the runs in --points: give --points")
    _check_wait("--lock-timeout-s", args.lock_timeout_s)
    url = _tsdb_url(args)
    if is_source_url(url):  # said first: the files' runs would be checked against it, and named unknown
        raise read_only_error(url)
    with _progress(0, "ingest", "step") as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        summary = ingest_into(
            url, points=args.points, runs=args.runs, nodes=args.nodes, progress=progress,
            replace_runs=args.replace_run, lock_timeout_s=args.lock_timeout_s, opener=open_tsdb,
        )
    print(json.dumps(summary))
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from aml_pipeline.runner.build import materialize_dataset
    from aml_pipeline.sources import absolute_source_url
    from aml_pipeline.spec import load_spec

    log_level = _log_level(args.log_level)
    spec = load_spec(args.spec)
    # A source description named relative to here must still be found by Dagster's workers.
    url = absolute_source_url(_tsdb_url(args))
    home = _home(args)
    instance = _instance(args, home)
    with progress_bars():
        summary = materialize_dataset(
            spec,
            tsdb_url=url,
            home=home,
            datasets_dir=Path(args.out).resolve() if args.out else None,
            instance=instance,
            console_log_level=log_level,
            full=args.full,
            workers=args.workers,
        )
    _print_summary(summary, as_json=args.json)
    from aml_pipeline.pipeline.stages.split import empty_splits

    why = empty_splits(spec, summary["runs"])
    if why is not None:
        print(f"warning: {why}", file=sys.stderr)
    _say_if_not_recorded(args, instance)
    return 0


def cmd_source_check(args: argparse.Namespace) -> int:
    from aml_pipeline.sources.check import check_source, render

    found = check_source(args.file, sample_run=args.run)
    print(json.dumps(found, indent=1) if args.json else render(found))
    return 0


def _instance(args: argparse.Namespace, home: Path):
    """The persistent instance the UI shows: ``DAGSTER_HOME``'s, else the repository's when the
    command runs in the repository with its default home (``config.repository_instance``, what
    scripts/ui.sh opens); None (an instance of this build only) elsewhere or with --ephemeral."""
    if getattr(args, "ephemeral", False):
        return None
    if not os.environ.get("DAGSTER_HOME"):
        repository = config.repository_instance(home)
        if repository is None:
            return None
        os.environ["DAGSTER_HOME"] = str(repository)  # as scripts/ui.sh sets it; Dagster's workers inherit it
    import dagster as dg

    if not Path(os.environ["DAGSTER_HOME"]).is_dir():
        raise AmlError(
            f"DAGSTER_HOME={cut(os.environ['DAGSTER_HOME'], 300)} is not a directory: it holds the Dagster instance "
            "(dagster.yaml); create it, or unset DAGSTER_HOME to record the command nowhere",
            code="CONFIG_INVALID",
        )

    from aml_pipeline.runner.instance import instance_failures

    with instance_failures(f"in {os.environ['DAGSTER_HOME']}"):
        return dg.DagsterInstance.get()


def _say_if_not_recorded(args: argparse.Namespace, instance) -> None:
    """The last line, when the build went into an instance of its own: the UI will not show it."""
    if instance is not None or getattr(args, "ephemeral", False):
        return
    if config.repository_checkout() is not None:
        how = ("run it from the repository's folder with the default AML_HOME, or with DAGSTER_HOME set to the "
               "repository (the instance scripts/ui.sh opens)")
    else:
        how = "run it again with DAGSTER_HOME set to a folder for the instance, and start `dg dev` with the same DAGSTER_HOME"
    print(f"not recorded in a Dagster instance (DAGSTER_HOME is unset), so the UI does not show this build; to record it, "
          f"{how}", file=sys.stderr)


def _print_summary(summary: dict[str, Any], *, as_json: bool) -> None:
    if not as_json:
        w, r = summary["windows"], summary["runs"]
        print(f"snapshot  {summary['snapshotDir']}")
        print(f"sha256    {summary['sha256']}")
        print(f"manifest  v{summary['manifestVersion']}  lineageVerified={summary['lineageVerified']}  "
              f"({_lineage_meaning(summary)})")
        print(f"windows   train {w['train']}  val {w['val']}  test {w['test']}")
        print(f"runs      train {r['train']}  val {r['val']}  test {r['test']}  excluded {r['excluded']}")
        if "materialized" in summary:
            m = summary["materialized"]
            print(f"built     {m['raw_node_series']} fetched, {m['cleaned_grid']} cleaned, {m['run_windows']} windowed"
                  " (the other runs were up to date)")
        if summary.get("published") is False:
            print("published nothing new: the current snapshot already holds these runs and this spec")
    print(json.dumps(summary))


def _lineage_meaning(summary: dict[str, Any]) -> str:
    """What the lineage flag says (docs/lineage.md): v1 assesses no lineage, so its 0 is no failure."""
    if summary["manifestVersion"] == 1:
        return "v1: lineage not assessed, not a failure"
    if summary["lineageVerified"]:
        return "every run's recipe verified"
    return "not every run is lineage-verified: the dataset_manifest's lineage says which, docs/lineage.md why"


def cmd_verify(args: argparse.Namespace) -> int:
    from aml_pipeline.core.hashing import verify_snapshot
    from aml_pipeline.snapshot.verify import catalog_sha256

    _check_looks_like_a_snapshot(Path(args.snapshot_dir))
    snapshot = Path(args.snapshot_dir)
    if not snapshot.is_dir():
        raise AmlError(f"{snapshot}: not a snapshot directory", code="NOT_FOUND")
    # The catalog's hash: by path, or (a copied datasets root) by spec id and directory name.
    result = verify_snapshot(snapshot, catalog_sha256(snapshot))
    if result.ok:
        print(f"OK {result.actual} {snapshot}")
        return 0
    changed = f"; changed: {', '.join(result.changed)}" if result.changed else ""
    print(f"SNAPSHOT_TAMPERED: {snapshot}: {result.problem}{changed}", file=sys.stderr)
    return 1


def cmd_plot(args: argparse.Namespace) -> int:
    from aml_pipeline.pipeline.plots import stored_run_figure_png
    from aml_pipeline.pipeline.store import DatasetStore, atomic_write_bytes
    from aml_pipeline.spec import load_spec

    spec = load_spec(args.spec)
    home = _home(args)
    png = stored_run_figure_png(DatasetStore(config.store_dir(home), spec), args.run)
    out = Path(args.out) if args.out else Path(f"{spec.id}-{args.run}.png")
    atomic_write_bytes(out, png)
    print(out)
    return 0


# The longest wait a flag may ask for. A lock's deadline beyond the platform's time_t overflows,
# and a typo of many zeros would hold a lease (and refuse new readers) for ages.
MAX_WAIT_S = 86_400.0


def _check_wait(flag: str, seconds: float) -> None:
    if not (0 <= seconds <= MAX_WAIT_S):  # NaN fails every comparison
        raise AmlError(f"{flag} {seconds:g}: must be a number of seconds from 0 to {MAX_WAIT_S:.0f} (a day)", code="USAGE")


def cmd_export(args: argparse.Namespace) -> int:
    from aml_pipeline.errors import disk_full
    from aml_pipeline.snapshot import SnapshotError, open_snapshot
    from aml_pipeline.snapshot.export import export_parquet

    _check_looks_like_a_snapshot(Path(args.snapshot_dir))
    _check_export_folder(args.out)
    if args.layout is not None:
        return _export_layout(args)

    bars: list[Any] = []  # opened on the first run written, after every check has passed

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(_progress(total, "export", "run"))
        bars[0].update(done - bars[0].n)

    try:
        snap = open_snapshot(args.snapshot_dir, verify=not args.no_verify)
        splits = tuple(dict.fromkeys(args.split)) if args.split else ("train", "val", "test")
        summary = export_parquet(snap, args.out, splits=splits, progress=progress)
    except SnapshotError as e:
        raise AmlError(str(e), code=e.code) from None
    except FileExistsError as e:
        raise AmlError(str(e), code="EXPORT_EXISTS") from None
    except OSError as e:  # e.g. no space, no permission to create --out
        raise (disk_full(e, args.out) or AmlError(f"{args.out}: {e}", code="EXPORT_FAILED")) from None
    finally:
        for bar in bars:
            bar.close()
    print(json.dumps({k: summary[k] for k in ("outDir", "format", "sha256", "verified", "splits", "rows")}
                     | {"files": len(summary["files"])}))
    return 0


def _check_export_folder(given: str) -> None:
    """The errors --out can be told before anything is read: an empty path (USAGE); the current
    directory, which the export's one rename cannot replace, and a folder inside a snapshot,
    whose hash covers only its own files (EXPORT_FAILED); a folder it goes in that is a file
    (EXPORT_FAILED: the export would make its parents, and the error would name only the file
    in the way, "[Errno 17] File exists")."""
    from aml_pipeline.snapshot.export import snapshot_containing

    if not given.strip():
        raise AmlError("--out: an empty path; name the folder to create", code="USAGE")
    out = Path(given)
    resolved = out.resolve()
    if resolved == Path.cwd().resolve():
        raise AmlError(f"--out {given}: the current directory cannot be replaced by the export; "
                       "name a new folder (or an empty one elsewhere)", code="EXPORT_FAILED")
    if (inside := snapshot_containing(out)) is not None:
        raise AmlError(f"--out {given}: inside the snapshot {inside}; a published snapshot is not written to",
                       code="EXPORT_FAILED")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise AmlError(f"--out {out}: {parent} is a file, not a directory", code="EXPORT_FAILED")
            return


def _export_layout(args: argparse.Namespace) -> int:
    """``export SNAPSHOT --layout windows``: the snapshot rewritten in the windows layout."""
    from aml_pipeline.errors import disk_full
    from aml_pipeline.pipeline.layout_export import export_windows_layout
    from aml_pipeline.snapshot import SnapshotError, open_snapshot

    if args.split:
        raise AmlError("--split selects runs of a Parquet export; --layout writes the whole snapshot", code="USAGE")
    if args.no_verify:
        raise AmlError("--no-verify: not with --layout; the snapshot it writes gets a hash of its own, so it is "
                       "written only from a verified one", code="USAGE")
    try:
        summary = export_windows_layout(open_snapshot(args.snapshot_dir), args.out)
    except SnapshotError as e:
        raise AmlError(str(e), code=e.code) from None
    except FileExistsError as e:
        raise AmlError(str(e), code="EXPORT_EXISTS") from None
    except OSError as e:
        raise (disk_full(e, args.out) or AmlError(f"{args.out}: {e}", code="EXPORT_FAILED")) from None
    print(json.dumps(summary))
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from aml_pipeline.pipeline.publish import Catalog

    if args.spec is not None:
        check_spec_id(args.spec, what="--spec")  # an id no spec can have matches nothing: say so
    root = config.usable_home(Path(args.root), "--root") if args.root else config.datasets_dir()
    entries = Catalog(root).entries(args.spec)
    if args.json:
        print(json.dumps([e.to_json() for e in entries]))
        return 0
    if not entries:
        of = f" of spec {args.spec!r}" if args.spec and Catalog(root).entries() else ""
        print(f"no published snapshots{of} under {root}{'' if root.exists() else ' (no such folder)'}")
        return 0
    print(f"{'spec':<16} {'cur':<3} {'sha256':<16} {'v':<2} {'created':<20} {'train/val/test windows':<24} path")
    for e in entries:
        windows = "/".join(str(e.windows[p]) for p in ("train", "val", "test"))
        print(
            f"{e.spec_id:<16} {'*' if e.current else '':<3} {e.sha256[:16]:<16} {e.manifest_version:<2} "
            f"{e.created_at:<20} {windows:<24} {e.path}"
        )
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from aml_pipeline.pipeline.retention import collect_garbage
    from aml_pipeline.spec import discover_specs

    if args.keep < 0:
        raise AmlError(f"--keep {args.keep}: the non-current snapshots to keep per spec must be >= 0", code="USAGE")
    home = _home(args)
    root = config.usable_home(Path(args.root).resolve(), "--root") if args.root else config.datasets_dir(home)
    specs_dir = config.specs_dir(home)
    if specs_dir.exists() and not specs_dir.is_dir():  # a spec file named instead of its folder
        raise AmlError(f"AML_SPECS {specs_dir}: is a file, not a folder of specs; name the folder that holds them",
                       code="CONFIG_INVALID")
    specs, errors = discover_specs(specs_dir)
    for path, message in errors:
        if path == specs_dir:  # no spec at all: snapshots are still kept per spec, intermediates all left
            print(f"AML_SPECS {message}; no spec's intermediates are cleaned", file=sys.stderr)
        else:
            print(f"spec {path} skipped: {message}", file=sys.stderr)
    report = collect_garbage(root, config.store_dir(home), {s.id: s for _, s in specs}, keep=args.keep, dry_run=args.dry_run)
    retention_days = config.instance_retention_days()
    instance = _instance(args, home)
    pruned = None
    if instance is not None:
        from aml_pipeline.components.maintenance import instance_summary, prune_instance

        with instance:
            pruned = prune_instance(instance, [s.id for _, s in specs], retention_days=retention_days, dry_run=args.dry_run)
    if args.json:
        print(json.dumps({**report.to_json(), "instance": pruned.to_json() if pruned else None}))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for path in report.removed_snapshots:
        print(f"{verb} snapshot {path}")
    for stage in report.removed_stages:
        print(f"{verb} stage {stage} (built for another version of the spec)")
    for path in report.removed_other:
        print(f"{verb} {path}")
    for why in report.skipped:
        print(f"skipped {why}")
    if not root.exists():  # a mistyped --root would otherwise read as "nothing to clean"
        print(f"no snapshots under {root} (no such folder)")
    print(f"{'would free' if args.dry_run else 'freed'} {report.freed_bytes / 1e6:.1f} MB")
    if pruned is None:
        print("Dagster instance: not pruned (no DAGSTER_HOME, and not run in the repository with its default AML_HOME)")
    else:
        print(instance_summary(pruned))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from aml_pipeline.demo import demo_spec, next_steps, run_demo

    log_level = _log_level(args.log_level)
    home = _home(args)
    spec_path = Path(args.spec) if args.spec else demo_spec(home)
    instance = _instance(args, home)
    with progress_bars():
        summary = run_demo(
            home=home,
            spec_path=spec_path,
            runs=args.runs,
            instance=instance,
            console_log_level=log_level,
        )
    _print_summary(summary, as_json=args.json)
    # as typed, or as the README's commands (run from the repository) name the demo's spec
    shown = spec_path.relative_to(config.REPO_ROOT) if not args.spec and spec_path.is_relative_to(config.REPO_ROOT) else spec_path
    print(next_steps(summary, shown, home), file=sys.stderr)
    _say_if_not_recorded(args, instance)
    return 0


def cmd_baseline(args: argparse.Namespace) -> int:
    """The ridge baseline on a spec's current snapshot, in this process.

    The same functions the ``baseline_model`` asset runs in the shared environment (so the same
    numbers), called here directly: a user gets them without building that environment, and no
    lease is needed because no code runs in it. Materialise ``[<spec>, baseline_model]`` to
    record them in Dagster.
    """
    from aml_pipeline.pipeline.publish import Catalog, current_snapshot
    from aml_pipeline.spec import load_spec
    from aml_pipeline.training import ridge_baseline

    bad = [a for a in args.alphas or () if not (a > 0 and math.isfinite(a))]
    if bad:
        raise AmlError(f"--alphas {bad[0]:g}: a ridge penalty must be a number > 0", code="USAGE")
    spec = load_spec(args.spec)
    root = config.usable_home(Path(args.root), "--root") if args.root else config.datasets_dir()
    if args.snapshot:
        snapshot = Path(args.snapshot)
        _check_looks_like_a_snapshot(snapshot)
        if not snapshot.is_dir():
            raise AmlError(f"--snapshot {snapshot}: not a snapshot directory", code="NOT_FOUND")
    else:
        snapshot = current_snapshot(root, spec.id)
    if snapshot is None or not snapshot.is_dir():
        raise AmlError(
            f"spec {spec.id!r} has no current snapshot under {root}; build it first "
            f"(`aml-pipeline build {args.spec}`) or name one with --snapshot",
            code="NO_SNAPSHOT",
        )
    entry = Catalog(snapshot.resolve().parent.parent).find_by_path(snapshot.resolve())
    try:
        snap = ridge_baseline.open_snapshot(snapshot, expected_sha256=entry.sha256 if entry else None)
        if snap.spec.get("id") != spec.id:
            # The figures would be reported under this spec while they are another spec's.
            raise AmlError(f"--snapshot {snapshot}: a snapshot of spec {snap.spec.get('id')!r}, not of {spec.id!r} "
                           f"({args.spec})", code="USAGE")
        result = ridge_baseline.train_and_evaluate(snap, tuple(args.alphas) if args.alphas else ridge_baseline.DEFAULT_ALPHAS)
    except ridge_baseline.SnapshotError as e:
        raise AmlError(str(e), code=e.code) from None
    metrics, rows = ridge_baseline.summarize(snap, result)
    report = {
        "specId": spec.id, "snapshotDir": str(snap.root), "sha256": snap.sha256, "trainer": ridge_baseline.VERSION,
        "alpha": result["alpha"], "windows": result["counts"], "targets": rows, **metrics,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"snapshot  {snap.root} (sha256 {snap.sha256[:16]}, verified)")
    c = result["counts"]
    chosen = "chosen on val" if c["val"] else "(no val windows to choose it with)"
    print(f"model     {ridge_baseline.VERSION}: ridge regression from history x and future controls u to future "
          f"targets y; alpha {result['alpha']:g} {chosen}")
    print(f"windows   train {c['train']}  val {c['val']}  test {c['test']}"
          + ("  (no val or test windows: the snapshot has too few runs for them)" if not (c["val"] or c["test"]) else ""))
    print("RMSE in model units, model vs persistence (the last observed value held over the horizon):")
    header = f"  {'target':<12} {'unit':<6} {'val':>9} {'persist.':>9} {'test':>9} {'persist.':>9} {'skill':>7}"
    print(header)
    for r in rows:
        def num(v):
            return f"{v:9.4g}" if v is not None else f"{'-':>9}"
        skill = f"{r['test_skill']:7.0%}" if r.get("test_skill") is not None else f"{'-':>7}"
        print(f"  {r['target']:<12} {r['unit'] or '-':<6} {num(r['val_rmse_model'])} {num(r['val_rmse_persistence'])} "
              f"{num(r['test_rmse_model'])} {num(r['test_rmse_persistence'])} {skill}")
    return 0


def cmd_inputs(args: argparse.Namespace) -> int:
    """A model's input at one forecast origin, from the snapshot's own recipe (aml_pipeline.live)."""
    import numpy as np

    from aml_pipeline.live import LiveRecipe
    from aml_pipeline.live.points import NoPlannedPoints, epoch_ms, when
    from aml_pipeline.snapshot import SnapshotError, open_snapshot

    # Flags of the other source are refused, not ignored: the input would silently come from
    # elsewhere than the user named.
    if args.points and args.tsdb:
        raise AmlError("--points reads the points from a file, --tsdb from a TSDB: give one of them", code="USAGE")
    if args.run_start and not args.points:
        raise AmlError("--run-start says when the run of a --points file started (a TSDB knows its runs): "
                       "give --points, or leave --run-start out", code="USAGE")
    _check_looks_like_a_snapshot(Path(args.snapshot_dir))
    try:
        recipe = LiveRecipe(open_snapshot(args.snapshot_dir))
    except SnapshotError as e:
        raise AmlError(str(e), code=e.code) from None
    at = epoch_ms(args.at, "--at")
    origin = at - at % recipe.beat_ms  # the last grid time at or before it
    controls: Any = None
    if args.controls == "realised":
        controls = "realised"
    elif args.controls:
        controls = _points_file(args.controls, args.run)
    try:
        if args.points:
            run_start = epoch_ms(args.run_start, "--run-start") if args.run_start else None
            got = recipe.inputs(origin, _points_file(args.points, args.run), controls=controls, run_start_ms=run_start)
        else:
            got = recipe.inputs(origin, tsdb=args.tsdb or config.tsdb_url(), run_id=args.run, controls=controls)
    except NoPlannedPoints as e:
        if len(controls):
            raise AmlError(f"--controls {args.controls}: {e.message}", code=e.code) from None
        raise AmlError(f"--controls {args.controls}: the planned-controls file holds no points (without one node "
                       f"{e.node} has no value at {when(e.at_ms)})", code=e.code) from None
    if args.out:
        import io

        from aml_pipeline.pipeline.store import atomic_write_bytes

        buf = io.BytesIO()
        np.savez(buf, x=got.x, **({"u": got.u} if got.u is not None else {}), times_ms=got.times_ms,
                 nodes=np.array(got.nodes), controls=np.array(got.controls), may_differ=got.may_differ)
        atomic_write_bytes(Path(args.out), buf.getvalue())
    summary = {
        "snapshotDir": str(recipe.snapshot.root), "sha256": recipe.snapshot.sha256, "originMs": got.origin_ms,
        "runId": got.run_id, "causal": got.causal, "nodes": list(got.nodes), "timesMs": got.times_ms.tolist(),
        "x": got.x.tolist(), "controls": list(got.controls), "u": None if got.u is None else got.u.tolist(),
        "mayDiffer": {n: [int(t) for t in got.times_ms[got.may_differ[:, j]]] for j, n in enumerate(got.nodes)
                      if got.may_differ[:, j].any()},
        "why": got.why, **({"out": str(args.out)} if args.out else {}),
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"snapshot  {recipe.snapshot.root} (sha256 {recipe.snapshot.sha256[:16]}, verified)")
    print(f"origin    {when(got.origin_ms)}" + (f", run {got.run_id}" if got.run_id else "")
          + ("" if got.causal else "  (built without causal: true: rows marked * may differ from the windows')"))
    print(f"x         [{recipe.history_steps}, {len(got.nodes)}] normalised, float32, as a window's x")
    width = max(9, *(len(n) for n in got.nodes))
    print(f"  {'time':<24}" + "".join(f"{n:>{width + 1}}" for n in got.nodes))
    for r, t in enumerate(got.times_ms):
        cells = "".join(f"{got.x[r, j]:>{width}.4f}{'*' if got.may_differ[r, j] else ' '}" for j in range(len(got.nodes)))
        print(f"  {when(int(t)).split(' ')[0]:<24}{cells}")
    if got.u is not None:
        print(f"u         [{recipe.horizon_steps}, {len(got.controls)}] normalised: " + json.dumps(got.u.tolist()))
    for node, reason in got.why.items():
        print(f"* {node}: {reason}")
    if args.out:
        print(f"written   {args.out}")
    return 0


def _points_file(path: str, run_id: str | None):
    """A points file (the ingest format, docs/ingest.md), only ``run_id``'s points when given."""
    from aml_pipeline.tsdb.ingest import read_points
    from aml_pipeline.tsdb.port import PointColumns

    points = read_points(path)  # refuses times no plant wrote (a file in seconds)
    if run_id is None:
        return points
    rows = points.run_id == run_id
    if len(points) and not rows.any():
        from aml_pipeline.errors import UnknownRunError

        raise UnknownRunError(f"--run {cut(run_id)}: {path} holds no point of that run")
    return PointColumns(points.run_id[rows], points.node_id[rows], points.ts[rows], points.value[rows], points.state[rows])


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

    settings = _env_settings(args)
    venv = settings.venv_path
    if venv.is_file() and not venv.is_symlink():  # "not built" would hide a typo'd --venv
        raise AmlError(f"the shared environment's path {venv} is a file, not an environment; name its folder (--venv)",
                       code="ENV_CONFIG_INVALID")
    status = shared_env_status(settings)
    print(json.dumps(status) if args.json else format_status(status))
    return 0


def cmd_env_rebuild(args: argparse.Namespace) -> int:
    from aml_pipeline.envs import rebuild_shared_env

    _check_wait("--wait-s", args.wait_s)
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


_INGEST_EPILOG = """\
columns (snake_case or camelCase; other columns are ignored):
  points  run_id, node_id    text ids (letters, digits, _ . : @ + -)
          ts                 epoch milliseconds, or ISO-8601 (a naive time is UTC)
          value              number; empty, nan, inf allowed (cleaning counts them)
          state              integer quality code; the spec's goodStates (default [0]) are good
          (the file's row order is the ingestion order: of duplicate timestamps the last wins)
  runs    run_id, line_id, product_id, recipe_id   required
          started_at, ended_at                     required; epoch ms or ISO-8601; an empty ended_at = running
          recipe_version, recipe_content_hash      optional (manifest v2 lineage)
          evidence_source                          simulation | real | unassessed (default)
          context_confirmed                        true/false (default false)
  nodes   node_id                                  required
          unit, range_lo, range_hi                 optional (an empty range bound = unknown)

Full description with examples and the errors: docs/ingest.md
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aml-pipeline",
        epilog="User errors print one line CODE: message and exit 2 (verify: 1 for a snapshot that fails). "
        "Documentation: README.md and docs/cli.md.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="seed the simulated plant and build the example dataset through Dagster")
    d.add_argument("--home", help="AML_HOME (default: $AML_HOME or ./.aml)")
    d.add_argument("--spec", help="spec to build (default: the example, specs/reactor_a.yaml; installed: a copy in <home>/specs)")
    d.add_argument("--runs", type=int, default=12,
                   help="simulated runs to seed (the last one is still in progress); another number than the "
                   "demo's TSDB holds re-seeds it")
    d.add_argument("--json", action="store_true", help="print only the JSON summary")
    d.add_argument("--log-level", default="CRITICAL",
                   help=f"Dagster console log level: {', '.join(LOG_LEVELS)} (the run log is kept in full)")
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser(
        "ingest",
        help="ingest points/runs/nodes files (CSV or Parquet) into a TSDB",
        description="Ingest points, runs and nodes files (CSV, CSV.gz or Parquet) into a TSDB.\n"
        "Every file is validated first; then everything is written in one transaction, or nothing.",
        epilog=_INGEST_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    i.add_argument("--tsdb", help="TSDB URL (default: $AML_TSDB_URL or the embedded file in AML_HOME)")
    i.add_argument("--points", help="points file: run_id, node_id, ts, value, state")
    i.add_argument("--runs", help="runs file: run_id, line_id, product_id, recipe_id, started_at, ended_at, ...")
    i.add_argument("--nodes", help="nodes file: node_id, unit, range_lo, range_hi")
    i.add_argument(
        "--replace-run", action="store_true",
        help="replace all stored points of every run in --points by the file's points (one transaction); "
        "without it, points already stored are skipped",
    )
    i.add_argument("--lock-timeout-s", type=float, default=10.0, help="wait this long for the TSDB before TSDB_BUSY: for readers of the embedded file to close it, "
                   "for another ingest into PostgreSQL to commit (default 10)")
    i.set_defaults(func=cmd_ingest, subparser=i)

    b = sub.add_parser("build", help="build and publish a dataset snapshot through its Dagster assets")
    b.add_argument("spec", help="dataset spec (YAML)")
    b.add_argument("--tsdb", help="TSDB URL or source description (plant.yaml) (default: $AML_TSDB_URL or the embedded file in AML_HOME)")
    b.add_argument("--out", help="datasets root to publish into (default: $AML_HOME/datasets)")
    b.add_argument("--home", help="AML_HOME: the default TSDB file, intermediates and datasets root (default: $AML_HOME or ./.aml)")
    b.add_argument("--json", action="store_true", help="print only the JSON summary")
    b.add_argument("--ephemeral", action="store_true", help="do not record in $DAGSTER_HOME's instance")
    b.add_argument("--full", action="store_true", help="rebuild every run partition, not only missing or stale ones")
    b.add_argument("--workers", type=int, default=1, help="processes for the run stages (through Dagster's multiprocess executor)")
    b.add_argument("--log-level", default="CRITICAL",
                   help=f"Dagster console log level: {', '.join(LOG_LEVELS)} (the run log is kept in full)")
    b.set_defaults(func=cmd_build)

    src = sub.add_parser("source", help="a plant's own tables, files or InfluxDB mapped by a source description (docs/sources.md)")
    src_sub = src.add_subparsers(dest="source_command", required=True)
    sc = src_sub.add_parser(
        "check", help="connect through a source description and print what it finds (exit 2 on a bad mapping)")
    sc.add_argument("file", help="source description (YAML)")
    sc.add_argument("--run", help="the run whose points to count (default: the latest finished one)")
    sc.add_argument("--json", action="store_true", help="print JSON")
    sc.set_defaults(func=cmd_source_check)

    v = sub.add_parser("verify", help="check every hashed byte of a snapshot (exit 0 only if intact)")
    v.add_argument("snapshot_dir")
    v.set_defaults(func=cmd_verify)

    pl = sub.add_parser("plot", help="draw a built run's strip chart (the UI's run plot) into a PNG file")
    pl.add_argument("spec", help="dataset spec (YAML)")
    pl.add_argument("run", help="run id")
    pl.add_argument("--home", help="AML_HOME the spec was built in (default: $AML_HOME or ./.aml)")
    pl.add_argument("--out", help="PNG file to write (default: ./<spec>-<run>.png)")
    pl.set_defaults(func=cmd_plot)

    x = sub.add_parser("export", help="write a snapshot's model-unit grid per run for dataframe tools, or the "
                                      "snapshot in the windows layout (docs/consumers.md)")
    x.add_argument("snapshot_dir")
    form = x.add_mutually_exclusive_group()
    form.add_argument("--format", choices=("parquet",), default="parquet", help="output format (default parquet)")
    form.add_argument("--layout", choices=("windows",),
                      help="write the snapshot itself in this layout instead (docs/snapshot.md)")
    x.add_argument("--out", required=True, help="directory to create (must not exist, or be empty)")
    x.add_argument("--split", action="append", choices=("train", "val", "test"), help="only this split (repeatable)")
    x.add_argument("--no-verify", action="store_true",
                   help="skip the hash check (the export then records verified=false; not with --layout)")
    x.set_defaults(func=cmd_export)

    ls = sub.add_parser("datasets", help="list published snapshots")
    ls.add_argument("--root", help="datasets root (default: $AML_HOME/datasets)")
    ls.add_argument("--spec", help="only this spec id")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_datasets)

    g = sub.add_parser(
        "gc", help="remove old snapshots and intermediates no current spec version needs, and superseded runs "
        "older than AML_INSTANCE_RETENTION_DAYS from the Dagster instance",
    )
    g.add_argument("--keep", type=int, default=3, help="non-current snapshots to keep per spec, newest first (default 3)")
    g.add_argument("--root", help="datasets root (default: $AML_HOME/datasets)")
    g.add_argument("--home", help="AML_HOME whose intermediates to clean (default: $AML_HOME or ./.aml)")
    g.add_argument("--dry-run", action="store_true", help="list what would be removed or deleted, remove nothing")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_gc)

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
    env_rebuild.add_argument("--wait-s", type=float, default=0.0, help="wait this long for the lease, refusing new readers meanwhile (default 0: refuse at once)")
    env_rebuild.add_argument("--requirements", help="pinned requirements (default: requirements/shared-env.txt)")
    env_rebuild.add_argument(
        "--installer", choices=("auto", "uv", "pip", "copy"), default="auto",
        help="auto: uv if on PATH, else python -m venv + pip; copy: offline, copy the pinned packages from this environment",
    )
    env_rebuild.add_argument("--python", help="interpreter that creates the venv (default: this one)")
    env_rebuild.set_defaults(func=cmd_env_rebuild)

    bl = sub.add_parser(
        "baseline",
        help="ridge baseline on a spec's current snapshot: val/test RMSE per target next to persistence",
    )
    bl.add_argument("spec", help="dataset spec (YAML)")
    bl.add_argument("--root", help="datasets root (default: $AML_HOME/datasets)")
    bl.add_argument("--snapshot", help="a snapshot directory instead of the spec's current one")
    bl.add_argument("--alphas", type=float, nargs="+", help="ridge penalties to choose from on val (default 0.01 … 10000)")
    bl.add_argument("--json", action="store_true", help="print only JSON")
    bl.set_defaults(func=cmd_baseline)

    li = sub.add_parser(
        "inputs",
        help="a model's input at a forecast origin, from live points by the snapshot's own recipe (docs/consumers.md)",
    )
    li.add_argument("snapshot_dir")
    li.add_argument("--at", required=True, help="forecast origin: epoch ms or ISO-8601 (UTC); the last grid time at or before it")
    li.add_argument("--tsdb", help="TSDB URL or source description to read from (default: $AML_TSDB_URL or the embedded file)")
    li.add_argument("--run", help="the run (default: the one of the spec's line, product and recipe under way at the origin)")
    li.add_argument("--points", help="read the points from this file (CSV or Parquet, the ingest format) instead of a TSDB")
    li.add_argument("--run-start", help="with --points: when the run started (epoch ms or ISO-8601)")
    li.add_argument("--controls", help="planned controls: 'realised' (the TSDB's points after the origin) or a points file")
    li.add_argument("--out", help="also write the arrays to this .npz file (x, u, times_ms, nodes, controls, may_differ)")
    li.add_argument("--json", action="store_true", help="print only JSON")
    li.set_defaults(func=cmd_inputs)

    # Named from the subcommands themselves, so a new one is never missing from --help.
    p.description = (
        "Reproducible, leakage-free, tamper-evident training datasets from industrial time series. "
        f"Commands: {', '.join(sub.choices)}."
    )
    return p


def _first_line(record: logging.LogRecord) -> str:
    lines = record.getMessage().strip().splitlines()
    return f"{record.levelname.lower()}: {lines[0] if lines else ''}"


class _FirstLine(logging.Formatter):
    """``warning: <first line of the message>``: a database driver's message runs over several
    lines (hints, a link)."""

    def format(self, record: logging.LogRecord) -> str:
        return _first_line(record)


class _Once(logging.Filter):
    """Each line once per command. While the instance database is down, Dagster logs the same
    retry warning at every attempt of every call, dozens of lines before the build's one-line
    error; the first says what is happening."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        line = _first_line(record)
        if line in self._seen:
            return False
        self._seen.add(line)
        return True


def main(argv: list[str] | None = None) -> int:
    # Dagster flags beta parameters (backfill_policy) at definition time; useful to a Dagster
    # developer, noise on a user's terminal. (The TSDB source asset silences its own notice, for
    # the processes that never pass through here.)
    warnings.filterwarnings("ignore", message=r".*is currently in beta.*")
    # What libraries log on the root logger (Dagster retrying its instance database): one line
    # each, each line once.
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(_FirstLine())
        handler.addFilter(_Once())
        logging.getLogger().addHandler(handler)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except AmlError as e:
        if e.code == "NO_RUNS" and args.command == "build":
            e = AmlError(f"{e.message}; {_runs_in_tsdb(_tsdb_url(args))}", code=e.code)
        print(e.one_line(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("INTERRUPTED: stopped by Ctrl-C (SIGINT); a snapshot is published whole or not at all "
              "(`aml-pipeline datasets` lists what is current), and the same command again finishes the work",
              file=sys.stderr)
        return 130
    except OSError as e:  # a file or directory the command could not use, named
        print(_os_error_line(e), file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not the user's input: still one line; the traceback goes to a file
        print(_unexpected_line(e, sys.argv[1:] if argv is None else argv), file=sys.stderr)
        return 2


def _os_error_line(e: OSError) -> str:
    from aml_pipeline.errors import disk_full

    where = cut(e.filename, 300) if e.filename is not None else "a file"
    full = disk_full(e, where)
    return full.one_line() if full is not None else f"FILE_ERROR: {where}: {e.strerror or e}"


def _unexpected_line(e: Exception, argv: list[str]) -> str:
    """One line for an exception no command expects, and where its traceback was saved: the
    line for the user, the file for a bug report."""
    import tempfile
    import traceback

    first = (str(e).strip().splitlines() or [""])[0]
    try:
        fd, path = tempfile.mkstemp(prefix="aml-pipeline-", suffix=".traceback")
        with os.fdopen(fd, "w") as f:
            f.write(f"aml-pipeline {' '.join(argv)}\n")
            traceback.print_exception(e, file=f)
        saved = f"; its traceback is in {path}"
    except OSError:
        saved = ""
    return f"UNEXPECTED: {type(e).__name__}: {cut(first, 300)} (a bug in aml-pipeline, not in the input{saved})"


def _runs_in_tsdb(url: str, limit: int = 4) -> str:
    """What the TSDB does hold, by line, product and recipe (for a NO_RUNS message)."""
    from collections import Counter

    from aml_pipeline.tsdb_open import open_tsdb
    from aml_pipeline.urls import redact_url

    try:
        with open_tsdb(url) as db:
            runs = db.list_runs(None, finished_only=False)
    except AmlError as e:
        return f"the TSDB cannot list its runs ({e.one_line()})"
    if not runs:
        return f"{redact_url(url)} holds no runs at all (ingest them with `aml-pipeline ingest`)"
    groups = Counter((r.line_id, r.product_id, r.recipe_id, r.finished) for r in runs)
    shown = [
        f"{n} {'finished' if finished else 'running'} of line {cut(line)}, product {cut(product)}, recipe {cut(recipe)}"
        for (line, product, recipe, finished), n in groups.most_common(limit)
    ]
    more = f" and {len(groups) - limit} more groups" if len(groups) > limit else ""
    return f"{redact_url(url)} holds {len(runs)} runs: " + "; ".join(shown) + more


def _check_looks_like_a_snapshot(directory: Path) -> None:
    """NOT_A_SNAPSHOT (the library's check) before a command reads ``directory`` as a snapshot."""
    from aml_pipeline.snapshot.verify import check_looks_like_a_snapshot
    from aml_pipeline.snapshot import SnapshotError

    try:
        check_looks_like_a_snapshot(directory)
    except SnapshotError as e:
        raise AmlError(str(e), code=e.code) from None


if __name__ == "__main__":
    sys.exit(main())
