"""The real Dagster webserver and daemon (``dagster dev``) over the demo spec, driven through GraphQL.

Setup (all under a temporary directory): a DuckDB TSDB seeded with a small simulated plant,
``AML_SPECS`` holding a copy of ``specs/reactor_a.yaml``, ``AML_HOME`` and a ``DAGSTER_HOME`` whose
``dagster.yaml`` is the repository's with absolute storage paths. Then ``dagster dev -m
aml_pipeline.definitions`` on a free loopback port, and through its GraphQL API:

1. the asset graph: the six ``reactor_a`` assets and ``tsdb/points``, their groups and partitioning;
   the rebuild job, the new-run sensor (stopped by default) and the schedule;
2. the finished runs added as dynamic partitions (``addDynamicPartition``) and read back;
3. a partition backfill of the run assets over a non-contiguous selection of runs (the daemon
   launches one run per contiguous range: the run stages' single-run backfill policy), waited for,
   and exactly those partitions materialised, each with its own metadata; what a person sees of
   them in a real browser on a 1366 x 768 screen (the run plot whole, the cleaning table uncut);
4. the ``reactor_a__rebuild`` job launched and waited for; the manifest's materialisation carries
   its sha256, its blocking checks passed, and ``current`` points at the published snapshot.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from aml_pipeline import config
from aml_pipeline.pipeline.checks import MANIFEST_CHECKS
from aml_pipeline.demo import DEMO_SPEC, seed_demo
from aml_pipeline.pipeline.plan import run_scope
from aml_pipeline.pipeline.registry import DATASET_ASSETS, RUN_ASSETS
from aml_pipeline.spec import load_spec
from aml_pipeline.tsdb_open import open_tsdb
from aml_pipeline_tests.browser import browser_page, dismiss_dialogs
from aml_pipeline_tests.dagster_server import (
    DagsterDev,
    running,
    wait_for,
    write_instance_yaml,
)
from aml_pipeline_tests.dagster_graphql import (
    ADD_PARTITION,
    ASSET_NODES,
    BACKFILL,
    LAUNCH_BACKFILL,
    LAUNCH_RUN,
    MANIFEST,
    PARTITION_EVENTS,
    PARTITIONS,
    REPOSITORY,
    TERMINAL_BACKFILL,
    TERMINAL_RUN,
)

pytestmark = pytest.mark.timeout(2400)

SPEC_ID = "reactor_a"
MODULE = "aml_pipeline.definitions"
# Five simulated runs: 1-4 finished (run 3 with its context unconfirmed), run 5 still going.
SEEDED_RUNS = 5
# Generous: a busy 2-core machine loads the code location in several processes at once.
LOAD_TIMEOUT = 420
# A page of the UI renders in seconds; this only bounds a wait on a busy host.
BROWSER_TIMEOUT_MS = 120_000
BACKFILL_TIMEOUT = 600
RUN_TIMEOUT = 600


def key(name: str) -> dict[str, list[str]]:
    return {"path": [SPEC_ID, name]}


# ---- setup --------------------------------------------------------------------------------------


@pytest.fixture
def plant(tmp_path: Path) -> dict[str, Any]:
    """A seeded TSDB, a specs folder with the demo spec, AML_HOME and DAGSTER_HOME, and the
    environment ``dagster dev`` runs with."""
    home = tmp_path / "aml"
    specs = tmp_path / "specs"
    dagster_home = tmp_path / "dagster_home"
    for d in (home, specs, dagster_home):
        d.mkdir()
    shutil.copy(DEMO_SPEC, specs / DEMO_SPEC.name)
    write_instance_yaml(dagster_home)

    tsdb_url = config.default_tsdb_url(home)
    assert seed_demo(tsdb_url, runs=SEEDED_RUNS).written > 0
    spec = load_spec(specs / DEMO_SPEC.name)
    with open_tsdb(tsdb_url) as db:
        finished = [r.run_id for r in db.list_runs(run_scope(spec), finished_only=True)]
    # The selection below relies on four finished runs in the spec's scope.
    assert finished == [f"L1-P100-{i:04d}" for i in range(1, SEEDED_RUNS)], finished

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "AML_"))}
    env.update(
        DAGSTER_HOME=str(dagster_home),
        AML_HOME=str(home),
        AML_TSDB_URL=tsdb_url,
        AML_SPECS=str(specs),
        AML_ENV_LOCATION=str(home / "env"),
        PYTHONUNBUFFERED="1",
    )
    return {"tmp": tmp_path, "home": home, "env": env, "finished": finished}


@pytest.fixture
def dagster(plant: dict[str, Any]):
    """``dagster dev`` on a free loopback port, with its code location loaded; the whole process
    tree is stopped at the end, whatever happened."""
    server = DagsterDev(module=MODULE, env=plant["env"], cwd=plant["tmp"], log_path=plant["tmp"] / "dagster-dev.log")
    with running(server):
        server.wait_for_graphql(LOAD_TIMEOUT)
        location = server.wait_for_location(LOAD_TIMEOUT)
        assert location["repositories"], f"code location {location['name']} has no repository\n{server.diagnostics()}"
        server.repository = {
            "repositoryLocationName": location["name"],
            "repositoryName": location["repositories"][0],
        }
        yield server


# ---- GraphQL ------------------------------------------------------------------------------------


def _assert_success(result: dict[str, Any], expected: str, what: str) -> dict[str, Any]:
    assert result["__typename"] == expected, f"{what}: {result}"
    return result


def _partition_statuses(server: DagsterDev, name: str) -> dict[str, Any]:
    node = server.graphql(PARTITIONS, {"key": key(name)})["assetNodeOrError"]
    return _assert_success(node, "AssetNode", f"assetNodeOrError({SPEC_ID}/{name})")


def _wait_for_backfill(server: DagsterDev, backfill_id: str) -> dict[str, Any]:
    """Until the backfill is done and none of its runs is still going; the backfill."""

    def probe() -> dict[str, Any] | None:
        backfill = server.graphql(BACKFILL, {"id": backfill_id})["partitionBackfillOrError"]
        _assert_success(backfill, "PartitionBackfill", f"partitionBackfillOrError({backfill_id})")
        if backfill["status"] in TERMINAL_BACKFILL and all(r["status"] in TERMINAL_RUN for r in backfill["runs"]):
            return backfill
        return None

    def diagnostics() -> str:
        try:
            backfill = server.graphql(BACKFILL, {"id": backfill_id})["partitionBackfillOrError"]
        except Exception as e:  # noqa: BLE001
            return f"backfill {backfill_id}: {e}\n{server.diagnostics()}"
        runs = "\n".join(server.run_failures(r["runId"]) for r in backfill.get("runs") or [])
        return f"backfill: {backfill}\n{runs}\n{server.diagnostics()}"

    return wait_for(probe, timeout=BACKFILL_TIMEOUT, what=f"backfill {backfill_id}", diagnostics=diagnostics)


# ---- the test -----------------------------------------------------------------------------------


def test_webserver_lists_backfills_and_rebuilds_the_demo_spec(plant: dict[str, Any], dagster: DagsterDev) -> None:
    server = dagster
    repo = server.repository
    finished: list[str] = plant["finished"]
    partitions_def = f"{SPEC_ID}__runs"

    # 1. The asset graph, as the UI shows it.
    nodes = {tuple(n["assetKey"]["path"]): n for n in server.graphql(ASSET_NODES)["assetNodes"]}
    expected = {(SPEC_ID, n) for n in (*RUN_ASSETS, *DATASET_ASSETS)} | {("tsdb", "points")}
    assert expected <= nodes.keys(), f"missing assets {sorted(expected - nodes.keys())}; have {sorted(nodes)}"
    for name in RUN_ASSETS:
        n = nodes[(SPEC_ID, name)]
        assert n["groupName"] == SPEC_ID, n
        assert n["isPartitioned"] and n["isMaterializable"], n
        assert n["partitionDefinition"] == {"type": "DYNAMIC", "name": partitions_def}, n
        # A backfill runs each contiguous range of runs in one Dagster run.
        assert n["backfillPolicy"] == {"policyType": "SINGLE_RUN", "maxPartitionsPerRun": None}, n
    for name in DATASET_ASSETS:
        n = nodes[(SPEC_ID, name)]
        assert n["groupName"] == SPEC_ID, n
        assert not n["isPartitioned"] and n["partitionDefinition"] is None, n
        assert n["isMaterializable"], n
        assert f"{SPEC_ID}__rebuild" in n["jobNames"], n
    source = nodes[("tsdb", "points")]
    assert source["groupName"] == "tsdb" and source["isObservable"] and not source["isMaterializable"], source

    repository = server.graphql(REPOSITORY, {"selector": repo})["repositoryOrError"]
    _assert_success(repository, "Repository", "repositoryOrError")
    assert f"{SPEC_ID}__rebuild" in {j["name"] for j in repository["jobs"]}, repository["jobs"]
    sensors = {s["name"]: s["sensorState"]["status"] for s in repository["sensors"]}
    # Stopped until someone turns it on, so it cannot race the partitions added below.
    assert sensors.get(f"{SPEC_ID}__new_runs") == "STOPPED", sensors
    schedules = {s["name"]: s["scheduleState"]["status"] for s in repository["schedules"]}
    assert f"{SPEC_ID}__rebuild_schedule" in schedules, schedules

    # 2. Run partitions: none on a fresh instance; then the finished runs, added as the sensor would.
    assert _partition_statuses(server, "raw_node_series")["partitionKeys"] == []
    for run_id in finished:
        added = server.graphql(ADD_PARTITION, {"name": partitions_def, "key": run_id, "selector": repo})
        _assert_success(added["addDynamicPartition"], "AddDynamicPartitionSuccess", f"addDynamicPartition({run_id})")
    for name in RUN_ASSETS:
        node = _partition_statuses(server, name)
        assert node["partitionKeys"] == finished, (name, node["partitionKeys"])
        assert [d["partitionKeys"] for d in node["partitionKeysByDimension"]] == [finished], node
        assert node["partitionStats"]["numMaterialized"] == 0, node

    # 3. A backfill of the run assets over runs 1, 2 and 4: two contiguous ranges, so two runs.
    selected = [finished[0], finished[1], finished[3]]
    skipped = [finished[2]]
    launched = server.graphql(
        LAUNCH_BACKFILL,
        {
            "params": {
                "assetSelection": [key(n) for n in RUN_ASSETS],
                "partitionNames": selected,
                "title": "test_webserver: non-contiguous runs",
            }
        },
    )["launchPartitionBackfill"]
    backfill_id = _assert_success(launched, "LaunchBackfillSuccess", "launchPartitionBackfill")["backfillId"]
    backfill = _wait_for_backfill(server, backfill_id)
    failures = "\n".join(server.run_failures(r["runId"]) for r in backfill["runs"] if r["status"] != "SUCCESS")
    assert backfill["status"] in ("COMPLETED", "COMPLETED_SUCCESS") and backfill["runs"], (
        f"backfill {backfill}\n{failures}\n{server.diagnostics()}"
    )
    assert all(r["status"] == "SUCCESS" for r in backfill["runs"]), f"{failures}\n{server.diagnostics()}"
    ranges = sorted(
        (tags.get("dagster/asset_partition_range_start") or tags.get("dagster/partition"),
         tags.get("dagster/asset_partition_range_end") or tags.get("dagster/partition"))
        for tags in ({t["key"]: t["value"] for t in r["tags"]} for r in backfill["runs"])
    )
    assert ranges == [(finished[0], finished[1]), (finished[3], finished[3])], backfill["runs"]

    for name in RUN_ASSETS:
        node = _partition_statuses(server, name)
        statuses = node["assetPartitionStatuses"]
        assert statuses["__typename"] == "DefaultPartitionStatuses", statuses
        assert sorted(statuses["materializedPartitions"]) == selected, (name, statuses)
        assert sorted(statuses["unmaterializedPartitions"]) == skipped, (name, statuses)
        assert statuses["failedPartitions"] == [] and statuses["materializingPartitions"] == [], (name, statuses)
        assert node["partitionStats"] == {
            "numMaterialized": len(selected), "numPartitions": len(finished), "numFailed": 0, "numMaterializing": 0,
        }, (name, node["partitionStats"])
    # Each partition of the two-run range got its own figures, not just the range's summary, and
    # each stage's figures are on its own asset (the one a person opens): the partition view's
    # metadata table is the latest materialisation's entries (where the build puts them) and those
    # of any observations newer than it.
    own = {
        "raw_node_series": {"points", "pages", "per_node"},
        "cleaned_grid": {"cleaning", "removed_by_cause", "plot", "max_missing_ratio", "worst_missing_node", "points_removed"},
        "run_windows": {"windows", "reason"},
    }
    for run_id in selected:
        for name, expected in own.items():
            events = server.graphql(PARTITION_EVENTS, {"key": key(name), "partition": run_id})
            history = events["assetOrError"]["assetEventHistory"]["results"]
            latest = next(e for e in history if e["__typename"] == "MaterializationEvent")
            labels = {m["label"] for e in history if e["__typename"] == "ObservationEvent"
                      and int(e["timestamp"]) > int(latest["timestamp"]) for m in e["metadataEntries"]}
            labels |= {m["label"] for m in latest["metadataEntries"]}
            assert expected <= labels, (run_id, name, events)
            others = set().union(*(v for n, v in own.items() if n != name))
            assert not labels & others, (run_id, name, labels & others)

    # The same, as a person sees it: each asset's partition view in a real browser shows its own
    # figures in its metadata table.
    with browser_page() as page:
        for name, expected in own.items():
            page.goto(f"{server.url}/assets/{SPEC_ID}/{name}?view=partitions&partition={selected[0]}")
            dismiss_dialogs(page)
            table = page.locator("table", has=page.get_by_role("cell", name=sorted(expected)[0], exact=True)).first
            table.wait_for(timeout=BROWSER_TIMEOUT_MS)
            shown = {c.strip() for c in table.locator("tr > td:first-child").all_inner_texts()}
            page.screenshot(path=str(plant["tmp"] / f"ui-{name}.png"))
            assert expected <= shown, (name, shown)
            assert not shown & set().union(*(v for n, v in own.items() if n != name)), (name, shown)
    # The cleaned grid's plot opens whole, at its full size, on a laptop's 1366 x 768 screen:
    # Dagster's dialog is four fifths of the window, and what is wider is cut at its right edge
    # (a scroll bar, if the system shows one at all, only below the plot).
    with browser_page(1366, 768) as page:
        page.goto(f"{server.url}/assets/{SPEC_ID}/cleaned_grid?view=partitions&partition={selected[0]}")
        dismiss_dialogs(page)
        plot_row = page.locator("tr", has=page.get_by_role("cell", name="plot", exact=True))
        plot_row.get_by_text("[Show Markdown]").click(timeout=BROWSER_TIMEOUT_MS)
        image = page.locator("img[src^='data:image/png']").first
        image.wait_for(timeout=BROWSER_TIMEOUT_MS)
        # Measured once the dialog has opened: it zooms in (a CSS transition), and the page's
        # boxes are scaled until it ends.
        shown = image.evaluate("""async e => {
            await Promise.all(document.getAnimations().map(a => a.finished));
            // and until the dialog stands still (it also slides in): 10 frames in the same place
            for (let still = 0, last = null; still < 10;) {
                await new Promise(requestAnimationFrame);
                const r = e.getBoundingClientRect(), at = `${r.top},${r.left},${r.width},${r.height}`;
                still = at === last ? still + 1 : 0;
                last = at;
            }
            let box = e.parentElement;  // the dialog's scrolling box
            while (getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
            let vbox = e.parentElement;  // the box that scrolls it vertically
            while (vbox && !['auto', 'scroll'].includes(getComputedStyle(vbox).overflowY)) vbox = vbox.parentElement;
            vbox = vbox || document.documentElement;
            return {complete: e.complete, width: e.naturalWidth, height: e.naturalHeight, rendered: e.offsetWidth,
                    right: e.getBoundingClientRect().right, boxRight: box.getBoundingClientRect().right,
                    hidden: box.scrollWidth - box.clientWidth,
                    bottom: e.getBoundingClientRect().bottom, boxBottom: vbox.getBoundingClientRect().bottom,
                    hiddenBelow: vbox.scrollHeight - vbox.clientHeight, windowHeight: window.innerHeight,
                    top: e.getBoundingClientRect().top};
        }""")
        page.screenshot(path=str(plant["tmp"] / "ui-plot.png"))
        assert shown["complete"] and shown["width"] >= 1000 and shown["height"] >= 400, shown
        assert shown["rendered"] == shown["width"], shown  # not shrunk
        assert shown["hidden"] <= 0 and shown["right"] <= shown["boxRight"], shown  # nothing cut off
        # and its last band and time axis above the fold: nothing to scroll to, inside the window
        assert shown["hiddenBelow"] <= 0 and shown["bottom"] <= min(shown["boxBottom"], shown["windowHeight"]), str(shown)

    # The cleaning table on the same screen: every column in view, none cut at the right edge.
    with browser_page(1366, 768) as page:
        page.goto(f"{server.url}/assets/{SPEC_ID}/cleaned_grid?view=partitions&partition={selected[0]}")
        dismiss_dialogs(page)
        header = page.get_by_role("columnheader", name="missing_ratio", exact=True).first
        header.wait_for(timeout=BROWSER_TIMEOUT_MS)
        header.scroll_into_view_if_needed()
        seen = header.evaluate("""e => {
            const table = e.closest('table');
            let box = table.parentElement;  // the nearest box that clips or scrolls it
            while (box && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
            const right = r => r.getBoundingClientRect().right;
            return {header: right(e), table: right(table), box: box ? right(box) : window.innerWidth,
                    hidden: box ? box.scrollWidth - box.clientWidth : 0, window: document.documentElement.clientWidth,
                    pageHidden: document.documentElement.scrollWidth - document.documentElement.clientWidth};
        }""")
        page.screenshot(path=str(plant["tmp"] / "ui-cleaning-1366.png"), full_page=True)
        assert seen["hidden"] <= 0 and seen["pageHidden"] <= 0, seen
        assert seen["header"] <= seen["box"] <= seen["window"], seen

    # 4. The rebuild job: split, normalise and publish from the partitions materialised so far.
    launched = server.graphql(
        LAUNCH_RUN, {"params": {"selector": {**repo, "jobName": f"{SPEC_ID}__rebuild"}}}
    )["launchRun"]
    run_id = _assert_success(launched, "LaunchRunSuccess", "launchRun")["run"]["runId"]
    status = server.wait_for_run(run_id, RUN_TIMEOUT)
    assert status == "SUCCESS", f"{server.run_failures(run_id)}\n{server.diagnostics()}"

    node = server.graphql(MANIFEST, {"key": key("dataset_manifest")})["assetNodeOrError"]
    [materialization] = node["assetMaterializations"]
    assert materialization["runId"] == run_id, materialization
    metadata = {e["label"]: e for e in materialization["metadataEntries"]}
    sha256 = metadata["sha256"]["text"]
    assert re.fullmatch(r"[0-9a-f]{64}", sha256), metadata["sha256"]
    assert metadata["current"]["boolValue"] is True, metadata["current"]
    # Runs 1, 2 and 4 are in the dataset; run 3 (not materialised) is excluded with its reason.
    in_splits = sum(metadata[f"runs_{p}"]["intValue"] for p in ("train", "val", "test"))
    assert (in_splits, metadata["runs_excluded"]["intValue"]) == (len(selected), len(skipped)), metadata

    checks_or_error = node["assetChecksOrError"]
    assert checks_or_error["__typename"] == "AssetChecks", checks_or_error
    checks = {c["name"]: c for c in checks_or_error["checks"]}
    assert set(MANIFEST_CHECKS) <= checks.keys(), checks
    for name in MANIFEST_CHECKS:
        check = checks[name]
        execution = check["executionForLatestMaterialization"]
        assert check["blocking"], check
        assert execution and execution["runId"] == run_id, check
        assert execution["status"] == "SUCCEEDED" and execution["evaluation"]["success"], check

    current = plant["home"] / "datasets" / SPEC_ID / "current"
    assert current.is_symlink(), f"{current} is not a symlink"
    snapshot = current.resolve()
    assert snapshot.name == sha256[:16], (snapshot, sha256)
    assert snapshot == Path(metadata["snapshot_dir"]["path"]).resolve(), (snapshot, metadata["snapshot_dir"])
    assert (snapshot / "manifest.json").is_file(), sorted(p.name for p in snapshot.iterdir())

    # The split's overview, as a person opens it on a laptop: whole in its dialog (its columns are
    # labelled by run id: test_plots.py checks the labels, the screenshot shows them).
    with browser_page(1366, 768) as page:
        page.goto(f"{server.url}/assets/{SPEC_ID}/dataset_split")
        dismiss_dialogs(page)
        row = page.locator("tr", has=page.get_by_role("cell", name="overview", exact=True)).first
        row.get_by_text("[Show Markdown]").click(timeout=BROWSER_TIMEOUT_MS)
        image = page.locator("img[alt='dataset overview']").first
        image.wait_for(timeout=BROWSER_TIMEOUT_MS)
        seen = image.evaluate("""async e => {
            await Promise.all(document.getAnimations().map(a => a.finished));
            let box = e.parentElement;
            while (getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
            return {complete: e.complete, width: e.naturalWidth, rendered: e.offsetWidth,
                    right: e.getBoundingClientRect().right, boxRight: box.getBoundingClientRect().right,
                    hidden: box.scrollWidth - box.clientWidth};
        }""")
        page.screenshot(path=str(plant["tmp"] / "ui-overview.png"))
        assert seen["complete"] and seen["rendered"] == seen["width"], seen
        assert seen["hidden"] <= 0 and seen["right"] <= seen["boxRight"], seen
