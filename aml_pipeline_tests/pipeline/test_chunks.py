"""Bounded memory: a run processed in chunks gives the bytes of the run processed whole."""

from __future__ import annotations

import hashlib
import random
import time

import numpy as np
import pytest

from aml_pipeline.core.normalize import MomentAccumulator, accumulate_window_stats, window_batches
from aml_pipeline_tests.library_build import build_dataset
from aml_pipeline.pipeline.plan import check_nodes_known
from aml_pipeline.pipeline.snapshot_writer import write_snapshot_files
from aml_pipeline.pipeline.registry import GRID, WINDOWS
from aml_pipeline.pipeline.stages import norm, windows
from aml_pipeline.pipeline.stages.grid import clean_run
from aml_pipeline.pipeline.stages.norm import fit_normalization
from aml_pipeline.pipeline.stages.raw import fetch_run
from aml_pipeline.pipeline.stages.split import plan_dataset
from aml_pipeline.pipeline.stages.windows import window_run
from aml_pipeline.pipeline.store import DatasetStore
from aml_pipeline.tsdb_open import open_tsdb


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fetched(make_spec, plant_url, tmp_path):
    spec = make_spec(extras=True)
    store = DatasetStore(tmp_path / "store", spec)
    with open_tsdb(plant_url) as db:
        catalog = check_nodes_known(spec, db.list_nodes())
        finished = [r for r in db.list_runs(None) if r.ended_at is not None]
        for run in finished:
            fetch_run(db, store, run, catalog, page_limit=97)  # many pages per node
    return spec, store, [r.run_id for r in finished]


def test_cleaning_in_chunks_of_any_size_is_byte_identical(fetched):
    spec, store, run_ids = fetched
    run_id = run_ids[0]
    # The whole run in one chunk: every node cleaned and aligned in one call of each kernel.
    summary = clean_run(store, run_id, chunk_points=10**9)
    whole = _digest(store.array_path(run_id, GRID, "values"))
    whole_meta = store.read_meta(run_id, GRID)
    assert whole_meta["counts"][spec.node_ids[0]]["input"] > 100
    assert summary.traces.removed_count.sum() > 0 and any(p is not None for p in summary.sample_period_ms.values())
    for chunk in (1, 2, 7, 64, 500):  # node by node, chunk by chunk
        got = clean_run(store, run_id, chunk_points=chunk)
        assert _digest(store.array_path(run_id, GRID, "values")) == whole, chunk
        assert store.read_meta(run_id, GRID) == whole_meta
        assert got.traces.equals(summary.traces), chunk
        assert (got.sample_period_ms, got.fast, got.missing) == (summary.sample_period_ms, summary.fast, summary.missing)


def test_small_grid_blocks_give_the_same_windows_and_arrays(fetched, monkeypatch, tmp_path):
    spec, store, run_ids = fetched
    for r in run_ids:
        clean_run(store, r)
        window_run(store, r)
    plan = plan_dataset(store, run_ids)
    norm = fit_normalization(store, plan)
    big = {r: _digest(store.array_path(r, WINDOWS, "starts")) for r in run_ids}
    files_big = write_snapshot_files(store, plan, norm, tmp_path / "big", availability_watermark=1, captured_at="t")

    # Blocks of 37 rows: every run (480 rows) streams through many blocks, windows straddle them.
    monkeypatch.setattr(windows, "grid_block_rows", lambda n: 37)
    for r in run_ids:
        window_run(store, r)
        assert _digest(store.array_path(r, WINDOWS, "starts")) == big[r]
    files_small = write_snapshot_files(store, plan, norm, tmp_path / "small", availability_watermark=1, captured_at="t")
    for name in ("arrays/x.f32", "arrays/u.f32", "arrays/y.f32", "arrays/timestamps.f64", "arrays/mask.f32"):
        assert files_small.files[name] == files_big.files[name], name
    # The series layout's rows and index, written block by block, likewise.
    series = DatasetStore(store.root, spec.model_copy(update={"layout": "series"}), store.versions)
    files_series = write_snapshot_files(series, plan, norm, tmp_path / "series", availability_watermark=1, captured_at="t")
    monkeypatch.setattr(windows, "grid_block_rows", lambda n: 10**6)
    files_series_big = write_snapshot_files(series, plan, norm, tmp_path / "series-big", availability_watermark=1,
                                            captured_at="t")
    for name in ("arrays/x_rows.f32", "arrays/u_rows.f32", "arrays/y_rows.f32", "arrays/segments.i64"):
        assert files_series.files[name] == files_series_big.files[name], name
    # The statistics are accumulated one block per batch: the same up to rounding.
    small_norm = fit_normalization(store, plan)
    for k in ("x", "u", "y"):
        a, b = getattr(norm, k), getattr(small_norm, k)
        np.testing.assert_allclose(b.mean, a.mean, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(b.std, a.std, rtol=1e-9)


def test_any_memory_budget_gives_the_same_snapshot(make_spec, plant_url, tmp_path, monkeypatch):
    spec = make_spec()  # v1: byte-reproducible, hash included
    hashes = []
    for budget in ("64", "100000"):
        monkeypatch.setenv("AML_MEMORY_MB", budget)
        with open_tsdb(plant_url) as db:
            root = tmp_path / budget
            hashes.append(build_dataset(spec, db, store_root=root / "store", datasets_root=root / "ds").sha256)
    assert hashes[0] == hashes[1]


def _series_written(fetched):
    spec, store, run_ids = fetched
    for r in run_ids:
        clean_run(store, r)
        window_run(store, r)
    series = DatasetStore(store.root, spec.model_copy(update={"layout": "series"}), store.versions)
    plan = plan_dataset(series, run_ids)
    return series, plan, fit_normalization(series, plan)


SERIES_FILES = ("arrays/x_rows.f32", "arrays/u_rows.f32", "arrays/y_rows.f32", "arrays/segments.i64")


@pytest.mark.parametrize("linked", [("arrays/u_rows.f32",), ("arrays/x_rows.f32", "arrays/segments.i64"), SERIES_FILES])
def test_series_files_linked_in_any_mix_hash_as_written(fetched, tmp_path, linked):
    # The series files are written in one pass, the first hashed as written and the others read
    # back: whichever of them are links, the hash takes them in the manifest's order.
    store, plan, norm = _series_written(fetched)
    first = write_snapshot_files(store, plan, norm, tmp_path / "first", availability_watermark=1, captured_at="t")
    again = write_snapshot_files(store, plan, norm, tmp_path / "again", availability_watermark=1, captured_at="t",
                                 linked={n: tmp_path / "first" / n for n in linked})
    assert again.sha256 == first.sha256 and again.files == first.files and again.report == first.report
    for name in SERIES_FILES:
        assert ((tmp_path / "again" / name).stat().st_ino == (tmp_path / "first" / name).stat().st_ino) == (name in linked)


def test_an_error_in_the_series_pass_is_raised(fetched, tmp_path, monkeypatch):
    from aml_pipeline.pipeline import snapshot_writer

    store, plan, norm = _series_written(fetched)
    calls = []
    apply_norm = snapshot_writer.apply_norm

    def failing(values, mean, std):
        # A failure in the middle of the pass, with report blocks still being computed and merged.
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("normalisation failed")
        return apply_norm(values, mean, std)

    monkeypatch.setattr(snapshot_writer, "apply_norm", failing)
    with pytest.raises(RuntimeError, match="normalisation failed"):
        write_snapshot_files(store, plan, norm, tmp_path / "failed", availability_watermark=1, captured_at="t")


def _fit_block_by_block(store, plan, order=None):
    """The normalisation fit merged one block after another in the caller's thread; ``order``
    (a list's permutation) changes the order of a run's blocks' merges."""
    spec = store.spec
    cols = windows.Columns.of(spec)
    H, F = spec.history_steps, spec.horizon_steps
    total = tuple(MomentAccumulator(n) for n in (len(spec.node_ids), len(cols.controls), len(cols.targets)))
    for run_id in plan.split["trainRunIds"]:
        run = windows.RunWindows(store, run_id, plan.runs[run_id])
        acc = tuple(MomentAccumulator(a.n_cols) for a in total)
        reader = run.starts()
        blocks = [(run.grid_rows(r0, r1), reader.between(r0 - F + 1, r1 + H), r0) for r0, r1 in run.blocks()]
        if order is None:
            for grid, starts, r0 in blocks:
                accumulate_window_stats(*acc, grid, starts, H, F, cols.controls, cols.targets, first_row=r0)
        else:
            batches = [window_batches(g, s, H, F, cols.controls, cols.targets, first_row=r0) for g, s, r0 in blocks]
            for done in order(batches):
                for a, b in zip(acc, done, strict=True):
                    a.add_batch(b)
        for a, p in zip(total, acc, strict=True):
            a.merge(p)
    return tuple(a.result() for a in total)


def _bits(stats) -> list[bytes]:
    return [b for s in stats for b in (s.mean.tobytes(), s.std.tobytes())]


def test_threaded_fit_merges_blocks_in_order_bit_for_bit(fetched, monkeypatch):
    spec, store, run_ids = fetched
    for r in run_ids:
        clean_run(store, r)
        window_run(store, r)
    plan = plan_dataset(store, run_ids)
    monkeypatch.setattr(windows, "grid_block_rows", lambda n: 37)  # many blocks per run
    sequential = _bits(_fit_block_by_block(store, plan))
    # The merge order shapes the bits on this data: a fit that merged blocks as they finish
    # (in any other order) would not match.
    assert _bits(_fit_block_by_block(store, plan, order=lambda b: b[::-1])) != sequential
    # Runs finish out of order (each block waits at random), and are still merged in order.
    batches = norm.window_batches
    rng = random.Random(3)

    def slow(*args, **kw):
        time.sleep(rng.random() * 0.004)
        return batches(*args, **kw)

    monkeypatch.setattr(norm, "window_batches", slow)
    monkeypatch.setattr(norm, "FIT_RUNS_AHEAD", 6)
    fitted = norm.fit_normalization(store, plan)
    assert _bits((fitted.x, fitted.u, fitted.y)) == sequential
