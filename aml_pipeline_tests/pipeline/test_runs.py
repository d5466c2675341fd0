"""build_runs: every run through its stages, the next run's fetch overlapped, failures per run."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from aml_pipeline.errors import BuildError, UnknownRunError
from aml_pipeline.pipeline.plan import check_nodes_known, run_scope
from aml_pipeline.pipeline.runs import build_runs, run_outcomes
from aml_pipeline.pipeline.stages.grid import GridSummary
from aml_pipeline.pipeline.stages.raw import STORED_COLUMNS, fetch_run, run_bounds, run_fetcher, write_raw
from aml_pipeline.pipeline.registry import GRID, RAW, WINDOWS
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.tsdb.reading import Rows
from aml_pipeline.tsdb_open import open_tsdb


def test_runs_come_back_in_order_with_each_failure_kept_to_its_run(make_spec, plant_url, tmp_path):
    spec = make_spec()
    store = DatasetStore(tmp_path / "store", spec)
    with open_tsdb(plant_url) as db:
        catalog = check_nodes_known(spec, db.list_nodes())
        runs = {r.run_id: r for r in db.list_runs(run_scope(spec), finished_only=True)}
        ids = sorted(runs)
        bad = ids[2]
        active, overlaps, fetched = [0], [], []
        lock = threading.Lock()

        def fetch(run_id):
            with lock:
                active[0] += 1
                overlaps.append(active[0])
            try:
                fetched.append(run_id)
                if run_id == bad:
                    raise RuntimeError(f"TSDB gone while fetching {run_id}")
                time.sleep(0.02)  # long enough that the next run would overlap if fetches could
                return fetch_run(db, store, runs[run_id], catalog, page_limit=5000)
            finally:
                with lock:
                    active[0] -= 1

        work = [(r, (RAW, GRID, WINDOWS)) for r in ids]
        results = list(build_runs(store, work, fetch))

    assert [r.run_id for r in results] == ids and fetched == ids
    assert max(overlaps) == 1  # one fetch at a time: the TSDB handle is never shared
    failed = [r for r in results if r.error is not None]
    assert [r.run_id for r in failed] == [bad] and "TSDB gone" in str(failed[0].error)
    assert failed[0].raw is None and failed[0].grid is None and failed[0].windows is None
    for r in results:
        if r.run_id != bad:
            assert r.raw.total_points > 0 and r.grid.rows > 0 and r.windows.rows == r.grid.rows
    # Later stages alone read what is stored: no fetch is needed, and none may be asked for.
    again = list(build_runs(store, [(r, (WINDOWS,)) for r in ids if r != bad], None))
    assert [r.windows.windows for r in again] == [r.windows.windows for r in results if r.run_id != bad]
    with pytest.raises(ValueError, match="no fetch was given"):
        next(build_runs(store, [(ids[0], (RAW,))], None))


def test_the_fetcher_reads_runs_in_scope_and_names_why_it_cannot_read_another(make_spec, plant_url, tmp_path):
    spec = make_spec()
    store = DatasetStore(tmp_path / "store", spec)
    with open_tsdb(plant_url) as db:
        catalog = check_nodes_known(spec, db.list_nodes())
        finished = db.list_runs(run_scope(spec), finished_only=True)
        unfinished = [r for r in db.list_runs(run_scope(spec), finished_only=False) if r.ended_at is None]
        assert finished and unfinished
        ids = [r.run_id for r in finished]
        fetch = run_fetcher(db, store, finished, catalog, page_limit=5000, tsdb_versions=db.run_versions(ids))
        raw = fetch(ids[1])
        assert raw.run_id == ids[1] and raw.total_points > 0
        # The run's TSDB version is recorded, for the next build's staleness check.
        assert store.read_meta(ids[1], RAW)["tsdbVersion"] == db.run_versions([ids[1]])[ids[1]]
        with pytest.raises(BuildError, match=f"run '{unfinished[0].run_id}' has not finished"):
            fetch(unfinished[0].run_id)
        with pytest.raises(UnknownRunError, match="no-such-run"):
            fetch("no-such-run")


def test_runs_read_whole_are_stored_as_fetched_one_by_one_without_reading_back(make_spec, plant_url, tmp_path,
                                                                             monkeypatch):
    """The plan's fetcher reads in the fetch thread and leaves the writing to the run's thread, which
    cleans from the arrays it wrote and windows from the grid the cleaning holds: every stored byte
    is the one a plain fetch, read back by each stage, gives."""
    spec = make_spec()
    plain, split = DatasetStore(tmp_path / "plain", spec), DatasetStore(tmp_path / "split", spec)
    with open_tsdb(plant_url) as db:
        catalog = check_nodes_known(spec, db.list_nodes())
        finished = db.list_runs(run_scope(spec), finished_only=True)
        ids = [r.run_id for r in finished]
        versions = db.run_versions(ids)
        work = [(r, (RAW, GRID, WINDOWS)) for r in ids]
        fetcher = run_fetcher(db, split, finished, catalog, page_limit=5000, tsdb_versions=versions, order=ids)
        reads: list[tuple[str, str]] = []
        real = DatasetStore.read_flat

        def counted(self, run_id, stage, name, start, stop):
            if self is split:
                reads.append((stage.name, name))
            return real(self, run_id, stage, name, start, stop)

        monkeypatch.setattr(DatasetStore, "read_flat", counted)
        held = list(build_runs(split, work, fetcher))
        by_id = {r.run_id: r for r in finished}
        one_by_one = list(build_runs(plain, work, lambda r: fetch_run(db, plain, by_id[r], catalog, page_limit=5000,
                                                                      tsdb_version=versions[r])))
    assert all(r.error is None for r in held + one_by_one)
    assert not [r for r in reads if r[0] in (RAW.name, GRID.name)]  # nothing of raw or grid read back
    for run_id in ids:
        for stage in (RAW, GRID, WINDOWS):
            a, b = plain.run_dir(run_id), split.run_dir(run_id)
            names = sorted(p.name for p in a.iterdir() if p.name.startswith(f"{stage.name}."))
            assert names and names == sorted(p.name for p in b.iterdir() if p.name.startswith(f"{stage.name}."))
            for name in names:
                assert (a / name).read_bytes() == (b / name).read_bytes(), (run_id, name)


def test_each_runs_figures_and_plot_are_made_in_its_own_thread_beside_the_other_runs(make_spec, plant_url, tmp_path,
                                                                                     monkeypatch):
    """The Dagster step takes each run's outcome with its figures and plot already made: drawing
    a plot (the slowest figure) in the consumer's thread would hold up the admission of the next
    runs, which happens as the consumer takes a result."""
    spec = make_spec()
    store = DatasetStore(tmp_path / "store", spec)
    drawn: list[tuple[str, str]] = []
    real = GridSummary.figures

    def figures(self, store, *, plot):
        drawn.append((self.run_id, threading.current_thread().name))
        return real(self, store, plot=plot)

    monkeypatch.setattr(GridSummary, "figures", figures)
    with open_tsdb(plant_url) as db:
        catalog = check_nodes_known(spec, db.list_nodes())
        finished = db.list_runs(run_scope(spec), finished_only=True)
        ids = [r.run_id for r in finished]
        fetcher = run_fetcher(db, store, finished, catalog, page_limit=5000, tsdb_versions=db.run_versions(ids), order=ids)
        outcomes = list(run_outcomes(store, [(r, (RAW, GRID, WINDOWS)) for r in ids], fetcher, plot=True))
    assert [o.run_id for o in outcomes] == ids and all(o.error is None for o in outcomes)
    assert all(o.figures[GRID]["plot"].text.startswith("![run ") for o in outcomes), outcomes[0].figures[GRID]["plot"]
    assert sorted(r for r, _ in drawn) == sorted(ids)
    assert {name.rsplit("_", 1)[0] for _, name in drawn} == {"run-stages"}, drawn


def test_the_raw_stage_stores_no_ingest_order_but_a_changed_one_makes_the_run_stale(make_spec, plant_url, tmp_path):
    """``seq`` orders points of equal timestamps, which the stored order already holds: the stage
    stores ts, value and state only, and the same points with another ``seq`` get another data
    version (a TSDB whose ingest order was corrected makes the run stale)."""
    spec = make_spec()
    store = DatasetStore(tmp_path / "store", spec)
    with open_tsdb(plant_url) as db:
        catalog = check_nodes_known(spec, db.list_nodes())
        run = db.list_runs(run_scope(spec), finished_only=True)[0]
        fetch_run(db, store, run, catalog, page_limit=5000)
        lo, hi = run_bounds(spec, run)
    stored = sorted(p.name for p in store.run_dir(run.run_id).iterdir() if p.name.startswith("raw."))
    assert stored == sorted(["raw.json", *(f"raw.{name}.npy" for name, _ in STORED_COLUMNS)])
    assert "raw.seq.npy" not in stored
    # The same points, read back from the store, with two ingest orders.
    meta = store.require(run.run_id, RAW)
    offsets = meta["offsets"]
    columns = {name: store.read_flat(run.run_id, RAW, name, 0, offsets[-1]) for name, _ in STORED_COLUMNS}

    def version(seq_offset: int) -> str:
        nodes = []
        for j, node in enumerate(spec.node_ids):
            a, b = offsets[j], offsets[j + 1]
            page = Rows(columns["ts"][a:b], columns["value"][a:b], columns["state"][a:b],
                        np.arange(a, b, dtype=np.int64) + seq_offset)
            nodes.append((node, [([page], 1)], 1))
        return write_raw(DatasetStore(tmp_path / f"s{seq_offset}", spec), run, catalog, None, (lo, hi), nodes).data_version

    assert version(0) == version(0) != version(10**6)


def test_the_fetch_thread_reads_ahead_of_the_runs_in_flight_and_no_further(make_spec, plant_url, tmp_path, monkeypatch):
    """While the first run is still being cleaned, the fetch thread goes on reading the next runs
    (a read that serves several runs is not waited for when their turn comes), up to
    FETCH_AHEAD runs beyond those in flight, which bounds what it holds."""
    import aml_pipeline.pipeline.runs as runs_module

    spec = make_spec()
    store = DatasetStore(tmp_path / "store", spec)
    with open_tsdb(plant_url) as db:
        catalog = check_nodes_known(spec, db.list_nodes())
        runs = {r.run_id: r for r in db.list_runs(run_scope(spec), finished_only=True)}
        ids = sorted(runs)
        monkeypatch.setattr(runs_module, "FETCH_AHEAD", 2)
        most = runs_module.RUN_THREADS + 1 + 2  # runs fetched before any is done
        assert len(ids) > most
        fetched: list[str] = []
        enough = threading.Event()

        def fetch(run_id):
            fetched.append(run_id)
            if len(fetched) >= most:
                enough.set()
            return fetch_run(db, store, runs[run_id], catalog, page_limit=5000)

        real_clean = runs_module.clean_run
        seen: list[int] = []

        def clean(store, run_id, **kw):
            if run_id == ids[0]:
                assert enough.wait(30)
                time.sleep(0.1)  # time for a fetch beyond the bound, if one were submitted
                seen.append(len(fetched))
            return real_clean(store, run_id, **kw)

        monkeypatch.setattr(runs_module, "clean_run", clean)
        results = list(build_runs(store, [(r, (RAW, GRID, WINDOWS)) for r in ids], fetch))
    assert all(r.error is None for r in results) and [r.run_id for r in results] == ids
    assert seen == [most] and fetched == ids
