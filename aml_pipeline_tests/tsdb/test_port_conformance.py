"""Behaviour every TSDB adapter must have (runs once per adapter in conftest.ADAPTERS)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from aml_pipeline.errors import IngestError, TsdbError, UnknownNodeError, UnknownRunError
from aml_pipeline.tsdb.port import Cursor, Node, PointColumns, Run, RunScope, TsdbPort
from aml_pipeline_tests.tsdb.series import fetch_node_series

FAR = 2**62


def pts(rows: list[tuple]) -> PointColumns:
    """rows of (run_id, node_id, ts, value[, state])."""
    return PointColumns(
        run_id=np.array([r[0] for r in rows], dtype=object),
        node_id=np.array([r[1] for r in rows], dtype=object),
        ts=np.array([r[2] for r in rows], dtype=np.int64),
        value=np.array([r[3] for r in rows], dtype=np.float64),
        state=np.array([r[4] if len(r) > 4 else 0 for r in rows], dtype=np.int32),
    )


def run(run_id: str, started: int = 0, ended: int | None = 1000, **kw) -> Run:
    base = dict(
        line_id="L1",
        product_id="P1",
        recipe_id="R1",
        recipe_version=1,
        recipe_content_hash="abc",
        started_at=started,
        ended_at=ended,
        evidence_source="simulation",
        context_confirmed=True,
    )
    base.update(kw)
    return Run(run_id=run_id, **base)


# Series (R1, A) is spread over two ingests, interleaved with other series and out of time
# order in the file; values name the rows. Sorted by (ts, seq) it reads:
#   ts 10: 2, 3, 7 | ts 20: 4, 10 | ts 30: 1, 5, 8, 11 | ts 40: 9 | ts 50: 6, 12
BATCH1 = [
    ("R1", "A", 30, 1.0),
    ("R1", "B", 10, 101.0),
    ("R1", "A", 10, 2.0),
    ("R2", "A", 10, 201.0),
    ("R1", "A", 10, 3.0, 1),
    ("R1", "A", 20, 4.0),
    ("R1", "A", 30, 5.0),
    ("R1", "A", 50, 6.0),
]
BATCH2 = [
    ("R1", "A", 10, 7.0),
    ("R1", "A", 30, 8.0, 2),
    ("R1", "A", 40, 9.0),
    ("R1", "A", 20, 10.0),
    ("R1", "A", 30, 11.0),
    ("R1", "A", 50, 12.0),
    ("R1", "B", 30, 102.0),
]
EXPECTED = [2.0, 3.0, 7.0, 4.0, 10.0, 1.0, 5.0, 8.0, 11.0, 9.0, 6.0, 12.0]
EXPECTED_TS = [10, 10, 10, 20, 20, 30, 30, 30, 30, 40, 50, 50]
EXPECTED_STATE = {3.0: 1, 8.0: 2}


@pytest.fixture
def tricky(tsdb_factory) -> TsdbPort:
    db = tsdb_factory()
    assert db.ingest(
        runs=[run("R1", 0, 1000), run("R2", 0, 1000), run("R3", 0, 1000)],
        nodes=[Node("A", "degC", 0.0, 100.0), Node("B")],
        points=pts(BATCH1),
    ) == len(BATCH1)
    assert db.ingest(points=pts(BATCH2)) == len(BATCH2)
    return db


def read_all(db: TsdbPort, node: str, run_id: str, limit: int, lo: int = 0, hi: int = FAR):
    """Manual keyset loop; checks each page's own invariants."""
    cursor, values, ts, seq, pages = None, [], [], [], 0
    while True:
        page = db.query_page(node, run_id, lo, hi, cursor, limit)
        pages += 1
        assert len(page) <= limit
        assert page.ts.dtype == np.int64 and page.value.dtype == np.float64
        assert page.state.dtype == np.int32 and page.seq.dtype == np.int64
        values += page.value.tolist()
        ts += page.ts.tolist()
        seq += page.seq.tolist()
        if len(page):
            assert page.next_cursor == Cursor(int(page.ts[-1]), int(page.seq[-1]))
        if page.done:
            break
        assert page.next_cursor is not None and len(page) == limit
        cursor = page.next_cursor
        assert pages < 100, "pagination does not terminate"
    return values, ts, seq, pages


@pytest.mark.parametrize("limit", range(1, 8))
def test_pagination_keeps_every_point_sharing_a_timestamp_across_page_boundaries(tricky, limit):
    values, ts, seq, pages = read_all(tricky, "A", "R1", limit)
    assert values == EXPECTED
    assert ts == EXPECTED_TS
    keys = list(zip(ts, seq))
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert pages <= math.ceil(len(EXPECTED) / limit) + 1

    series = fetch_node_series(tricky, "A", "R1", 0, FAR, page_limit=limit)
    assert series.value.tolist() == EXPECTED
    assert series.ts.tolist() == EXPECTED_TS
    assert series.seq.tolist() == seq
    assert [int(s) for s in series.state] == [EXPECTED_STATE.get(v, 0) for v in EXPECTED]
    assert series.pages == pages


@pytest.mark.parametrize("limit", [1, 2, 4, 12])
def test_the_prefetch_serves_the_pages_the_reads_serve(tricky, limit):
    """``prefetch`` is part of the port: every adapter takes the call, and whether it takes the
    hint or not, the pages after it are the ones without it."""
    plain = read_all(tricky, "A", "R1", limit, lo=10, hi=40)
    took = tricky.prefetch("R1", ["A", "B", "NOT_A_NODE"], 10, 40)
    assert isinstance(took, bool)
    assert read_all(tricky, "A", "R1", limit, lo=10, hi=40) == plain
    assert read_all(tricky, "B", "R1", limit, lo=10, hi=40)[0] == [101.0, 102.0]
    assert not tricky.prefetch("R1", ["A"], 10, 40, max_points=1)  # more than that: not kept
    assert read_all(tricky, "A", "R1", limit, lo=10, hi=40) == plain


@pytest.mark.parametrize("limit", [1, 2, 3, 5])
def test_pagination_inside_a_window_is_inclusive_at_both_ends(tricky, limit):
    values, ts, _, _ = read_all(tricky, "A", "R1", limit, lo=20, hi=30)
    assert ts == [20, 20, 30, 30, 30, 30]
    assert values == [4.0, 10.0, 1.0, 5.0, 8.0, 11.0]


def test_seq_follows_row_order_within_and_across_ingests(tricky):
    page = tricky.query_page("A", "R1", 0, FAR)
    seq_of = dict(zip(page.value.tolist(), page.seq.tolist()))
    batch1 = [seq_of[r[3]] for r in BATCH1 if r[:2] == ("R1", "A")]
    batch2 = [seq_of[r[3]] for r in BATCH2 if r[:2] == ("R1", "A")]
    assert batch1 == sorted(batch1) and batch2 == sorted(batch2)
    assert max(batch1) < min(batch2)
    # global across series too: B's first-batch row precedes A's second-batch rows
    b = tricky.query_page("B", "R1", 0, FAR)
    assert b.value.tolist() == [101.0, 102.0]
    assert int(b.seq[0]) < min(batch2) and int(b.seq[1]) > max(batch2)


def test_cursor_resumes_in_the_middle_of_a_timestamp_group_from_a_new_handle(tsdb_factory, tricky):
    first = tricky.query_page("A", "R1", 0, FAR, None, 7)  # ends inside the ts=30 group
    assert first.value.tolist() == EXPECTED[:7] and not first.done
    other = tsdb_factory()  # a second handle on the same database
    rest = other.query_page("A", "R1", 0, FAR, first.next_cursor, 100)
    assert rest.value.tolist() == EXPECTED[7:]
    assert rest.done


def test_cursor_resume_sees_points_appended_later_with_an_equal_timestamp(tricky):
    page = tricky.query_page("A", "R1", 0, FAR)
    assert page.done and page.value.tolist() == EXPECTED
    tricky.ingest(points=pts([("R1", "A", 60, 14.0), ("R1", "A", 50, 13.0)]))
    more = tricky.query_page("A", "R1", 0, FAR, page.next_cursor)
    assert more.value.tolist() == [13.0, 14.0]
    assert more.done


def test_empty_series_and_empty_windows(tricky):
    page = tricky.query_page("B", "R2", 0, FAR)  # known node, known run, no points
    assert len(page) == 0 and page.done
    assert fetch_node_series(tricky, "A", "R3", 0, FAR).ts.shape == (0,)
    assert len(tricky.query_page("A", "R1", 11, 19)) == 0  # between points
    assert tricky.query_page("A", "R1", 11, 19).done
    assert len(tricky.query_page("A", "R1", 31, 29)) == 0  # from > to
    end = tricky.query_page("A", "R1", 0, FAR, Cursor(50, 2**62))  # cursor past the end
    assert len(end) == 0 and end.done


def test_unknown_run_or_node_is_named(tricky):
    with pytest.raises(UnknownRunError, match="NOPE"):
        tricky.query_page("A", "NOPE", 0, FAR)
    with pytest.raises(UnknownNodeError, match="ZZZ"):
        tricky.query_page("ZZZ", "R1", 0, FAR)
    with pytest.raises(UnknownRunError, match="NOPE"):
        tricky.get_run("NOPE")
    with pytest.raises(KeyError):  # both are KeyErrors too
        tricky.query_page("ZZZ", "R1", 0, FAR)
    with pytest.raises(UnknownRunError):
        fetch_node_series(tricky, "A", "NOPE", 0, FAR)


RUNS = [
    run("ra", 1000, 2000),
    run("rb", 1000, 1500),  # same start as ra: run_id breaks the tie
    run("rc", 500, 900, line_id="L2"),
    run("rd", 3000, None, product_id="P2"),  # running
    run("re", 2500, 2600, recipe_id="R2", evidence_source="real", context_confirmed=False),
    run("rf", 2500, 2500, recipe_version=None, recipe_content_hash=None, evidence_source="unassessed"),
]


def _expected(scope: RunScope | None, finished_only: bool) -> list[str]:
    ordered = sorted(RUNS, key=lambda r: (r.started_at, r.run_id))
    return [
        r.run_id
        for r in ordered
        if (scope is None or scope.admits(r)) and (r.finished or not finished_only)
    ]


@pytest.fixture
def catalog(tsdb_factory) -> TsdbPort:
    db = tsdb_factory()
    db.ingest(runs=list(reversed(RUNS)), nodes=[Node("Z", "bar"), Node("A", "degC", -1.5, 2.5)])
    return db


@pytest.mark.parametrize(
    "scope",
    [
        None,
        RunScope(),
        RunScope(line_id="L1"),
        RunScope(line_id="L2"),
        RunScope(product_id="P2"),
        RunScope(recipe_id="R2"),
        RunScope(line_id="L1", product_id="P1", recipe_id="R1"),
        RunScope(from_ms=1500, to_ms=2500),  # rb ends exactly at 1500, re/rf start at 2500
        RunScope(from_ms=1501),
        RunScope(to_ms=999),
        RunScope(from_ms=3500),  # only the running run can overlap
        RunScope(from_ms=2600, to_ms=2600),
        RunScope(line_id="nope"),
    ],
    ids=str,
)
@pytest.mark.parametrize("finished_only", [True, False])
def test_list_runs_scope_and_order(catalog, scope, finished_only):
    got = [r.run_id for r in catalog.list_runs(scope, finished_only=finished_only)]
    assert got == _expected(scope, finished_only)


def test_list_runs_defaults_and_round_trip(catalog):
    assert [r.run_id for r in catalog.list_runs()] == ["rc", "ra", "rb", "re", "rf"]
    by_id = {r.run_id: r for r in catalog.list_runs(finished_only=False)}
    assert by_id == {r.run_id: r for r in RUNS}
    assert catalog.get_run("re") == RUNS[4]
    assert catalog.get_run("rd").ended_at is None and not catalog.get_run("rd").finished
    assert catalog.list_nodes() == [Node("A", "degC", -1.5, 2.5), Node("Z", "bar", None, None)]


def test_upsert_finishes_a_running_run_and_updates_a_node(catalog):
    catalog.ingest(points=pts([("rd", "A", 3100, 1.0)]))
    assert "rd" not in [r.run_id for r in catalog.list_runs()]
    catalog.ingest(
        runs=[run("rd", 3000, 4000, product_id="P2")], nodes=[Node("A", "K", 271.65, 275.65)]
    )
    assert catalog.get_run("rd").ended_at == 4000
    assert [r.run_id for r in catalog.list_runs()][-1] == "rd"
    assert catalog.list_nodes()[0] == Node("A", "K", 271.65, 275.65)
    assert fetch_node_series(catalog, "A", "rd", 0, FAR).value.tolist() == [1.0]
    assert len(catalog.list_runs(finished_only=False)) == len(RUNS)


def test_failing_ingest_writes_nothing(tricky):
    before_runs = tricky.list_runs(finished_only=False)
    before_nodes = tricky.list_nodes()
    before_mark = tricky.availability_watermark()
    with pytest.raises(IngestError, match=r"index 2.*GHOST|GHOST.*index 2"):
        tricky.ingest(
            runs=[run("RX", 0, 10**9)],
            nodes=[Node("NX")],
            points=pts(
                [
                    ("RX", "NX", 10**8, 1.0),
                    ("R1", "A", 10**8, 1.0),
                    ("GHOST", "A", 5, 1.0),
                    ("ALSO_GHOST", "A", 6, 1.0),
                ]
            ),
        )
    with pytest.raises(IngestError, match="NOPE_NODE"):
        tricky.ingest(runs=[run("RY")], points=pts([("RY", "NOPE_NODE", 1, 1.0)]))
    with pytest.raises((IngestError, TsdbError)):
        tricky.ingest(runs=[run("RZ", evidence_source="guessed")], nodes=[Node("NZ")])
    with pytest.raises((IngestError, TsdbError)):
        tricky.ingest(runs=[run("RW", 100, 50)])
    assert tricky.list_runs(finished_only=False) == before_runs
    assert tricky.list_nodes() == before_nodes
    assert tricky.availability_watermark() == before_mark
    assert fetch_node_series(tricky, "A", "R1", 0, FAR).value.tolist() == EXPECTED
    # the handle still works after the failures
    assert tricky.ingest(points=pts([("R1", "A", 70, 15.0)])) == 1
    assert fetch_node_series(tricky, "A", "R1", 0, FAR).value.tolist() == EXPECTED + [15.0]


def test_watermark(tsdb_factory):
    db = tsdb_factory()
    assert isinstance(db, TsdbPort)
    assert db.availability_watermark() is None
    db.ingest(runs=[run("R1"), run("R2")], nodes=[Node("A")])
    assert db.availability_watermark() is None
    db.ingest(points=pts([("R1", "A", 500, 1.0), ("R2", "A", 300, 1.0)]))
    assert db.availability_watermark() == 500
    db.ingest(points=pts([("R2", "A", 1_735_718_400_123, float("nan"))]))
    assert db.availability_watermark() == 1_735_718_400_123


def test_values_round_trip_exactly_including_non_finite(tsdb_factory):
    db = tsdb_factory()
    values = [0.1, -0.0, 1e308, float("nan"), float("inf"), float("-inf"), 5e-324]
    db.ingest(
        runs=[run("R1")],
        nodes=[Node("A")],
        points=pts([("R1", "A", i, v, i - 3) for i, v in enumerate(values)]),
    )
    s = fetch_node_series(db, "A", "R1", -FAR, FAR)
    np.testing.assert_array_equal(s.value, np.array(values))
    assert s.state.tolist() == [-3, -2, -1, 0, 1, 2, 3]


def test_many_ties_many_pages(tsdb_factory):
    rng = np.random.default_rng(7)
    n = 2_000
    ts = rng.integers(0, 50, n)  # ~40 points per timestamp
    db = tsdb_factory()
    db.ingest(runs=[run("R1")], nodes=[Node("A")])
    db.ingest(points=pts([("R1", "A", int(t), float(i)) for i, t in enumerate(ts)]))
    s = fetch_node_series(db, "A", "R1", 0, FAR, page_limit=37)
    assert s.pages == math.ceil(n / 37) or s.pages == math.ceil(n / 37) + 1
    expected = np.lexsort((np.arange(n), ts))  # by ts, then row order (seq)
    assert s.value.astype(int).tolist() == expected.tolist()


def test_data_persists_for_a_read_only_handle(tsdb_factory):
    db = tsdb_factory()
    db.ingest(runs=[run("R1")], nodes=[Node("A")], points=pts([("R1", "A", 1, 2.0)]))
    db.close()
    ro = tsdb_factory(read_only=True)
    assert [r.run_id for r in ro.list_runs()] == ["R1"]
    assert fetch_node_series(ro, "A", "R1", 0, FAR).value.tolist() == [2.0]
    assert ro.availability_watermark() == 1


# ---- per-run data versions ------------------------------------------------------------------


def test_run_versions_change_for_the_run_whose_points_change_and_only_for_it(tricky):
    before = tricky.run_versions(["R1", "R2", "R3"])
    assert set(before) == {"R1", "R2", "R3"} and len(set(before.values())) == 3
    assert all(isinstance(v, str) and v for v in before.values())
    assert tricky.ingest(points=pts([("R2", "B", 60, 1.5)])) == 1  # a late point for R2
    after = tricky.run_versions(["R1", "R2", "R3"])
    assert after["R2"] != before["R2"]
    assert after["R1"] == before["R1"] and after["R3"] == before["R3"]
    # asked again, nothing changed: the same strings
    assert tricky.run_versions(["R3", "R1", "R2", "R1"]) == after


def test_run_versions_unknown_ids_are_absent(tricky):
    assert tricky.run_versions([]) == {}
    got = tricky.run_versions(["R1", "NOPE", "ALSO_NOPE"])
    assert set(got) == {"R1"}
    with pytest.raises(KeyError):
        got["NOPE"]


def test_run_record_changes_change_the_version_identical_upserts_do_not(catalog):
    v0 = catalog.run_versions(["rd", "ra"])
    catalog.ingest(runs=[RUNS[3], RUNS[0]])  # the same records again
    assert catalog.run_versions(["rd", "ra"]) == v0
    catalog.ingest(runs=[run("rd", 3000, 4000, product_id="P2")])  # rd finishes
    v1 = catalog.run_versions(["rd", "ra"])
    assert v1["rd"] != v0["rd"] and v1["ra"] == v0["ra"]
    for change in (
        dict(context_confirmed=False),
        dict(recipe_version=2),
        dict(recipe_content_hash="other"),
        dict(evidence_source="real"),
    ):
        before = catalog.run_versions(["ra"])["ra"]
        changed = Run(**{**RUNS[0].__dict__, **change})
        catalog.ingest(runs=[changed])
        assert catalog.get_run("ra") == changed
        assert catalog.run_versions(["ra"])["ra"] != before, change


def test_a_failed_ingest_changes_no_version(tricky):
    before = tricky.run_versions(["R1", "R2"])
    with pytest.raises(IngestError):
        tricky.ingest(points=pts([("R1", "A", 99, 1.0), ("GHOST", "A", 5, 1.0)]))
    assert tricky.run_versions(["R1", "R2"]) == before


def test_run_versions_survive_reopening_the_database(tsdb_factory):
    db = tsdb_factory()
    db.ingest(runs=[run("R1")], nodes=[Node("A")], points=pts([("R1", "A", 1, 2.0)]))
    v = db.run_versions(["R1"])
    db.close()
    assert tsdb_factory(read_only=True).run_versions(["R1"]) == v


# ---- idempotent ingest ----------------------------------------------------------------------


def test_reingesting_the_same_points_writes_nothing_and_keeps_versions(tricky):
    before_versions = tricky.run_versions(["R1", "R2", "R3"])
    before_series = fetch_node_series(tricky, "A", "R1", 0, FAR)
    assert tricky.ingest(points=pts(BATCH1)) == 0
    assert tricky.ingest(points=pts(BATCH2 + BATCH1)) == 0
    assert tricky.ingest(
        runs=[run("R1", 0, 1000), run("R2", 0, 1000)], nodes=[Node("A", "degC", 0.0, 100.0)], points=pts(BATCH2)
    ) == 0
    assert tricky.run_versions(["R1", "R2", "R3"]) == before_versions
    after = fetch_node_series(tricky, "A", "R1", 0, FAR)
    for col in ("ts", "value", "state", "seq"):
        assert np.array_equal(getattr(after, col), getattr(before_series, col)), col


def test_only_new_points_are_written_with_seq_in_file_order(tricky):
    top = int(fetch_node_series(tricky, "A", "R1", 0, FAR).seq.max())
    b_top = int(fetch_node_series(tricky, "B", "R1", 0, FAR).seq.max())
    rows = [
        ("R1", "A", 30, 1.0),  # stored
        ("R1", "A", 30, 1.5),  # new value at a stored ts
        ("R1", "A", 10, 3.0, 1),  # stored (state 1)
        ("R1", "A", 10, 3.0, 0),  # new: another state
        ("R1", "A", 70, 20.0),  # new ts
        ("R1", "B", 10, 101.0),  # stored
    ]
    assert tricky.ingest(points=pts(rows)) == 3
    s = fetch_node_series(tricky, "A", "R1", 0, FAR)
    new = {float(v): int(q) for v, q, st in zip(s.value, s.seq, s.state) if q > max(top, b_top)}
    assert sorted(new) == [1.5, 3.0, 20.0]
    assert new[1.5] < new[3.0] < new[20.0]  # row order
    assert min(new.values()) == max(top, b_top) + 1  # seq continues right after the last one
    assert len(s) == len(EXPECTED) + 3


def test_nan_equals_nan_and_negative_zero_differs_from_zero_when_skipping(tsdb_factory):
    db = tsdb_factory()
    values = [float("nan"), 0.0, -0.0, float("inf"), float("-inf"), 1.25]
    db.ingest(runs=[run("R1")], nodes=[Node("A")], points=pts([("R1", "A", 1, v) for v in values[:2]]))
    # NaN is stored already: skipped; -0.0 is not 0.0: written; so are the rest
    assert db.ingest(points=pts([("R1", "A", 1, v) for v in values])) == 4
    assert db.ingest(points=pts([("R1", "A", 1, v) for v in values])) == 0
    s = fetch_node_series(db, "A", "R1", 0, FAR)
    assert len(s) == 6
    zeros = s.value[s.value == 0]
    assert sorted(np.signbit(zeros).tolist()) == [False, True]
    # a NaN with another bit pattern is still NaN
    other_nan = np.frombuffer(np.array([0x7FF8000000000123], dtype=np.uint64).tobytes(), dtype=np.float64)
    assert np.isnan(other_nan[0])
    assert db.ingest(points=pts([("R1", "A", 1, float(other_nan[0]))])) == 0


def test_duplicates_inside_one_ingest_are_all_written_once(tsdb_factory):
    db = tsdb_factory()
    db.ingest(runs=[run("R1")], nodes=[Node("A")])
    rows = [("R1", "A", 5, 1.0), ("R1", "A", 5, 1.0), ("R1", "A", 6, 2.0)]
    assert db.ingest(points=pts(rows)) == 3  # a file stores what it holds
    v = db.run_versions(["R1"])
    assert db.ingest(points=pts(rows)) == 0  # and stores nothing the second time
    assert db.run_versions(["R1"]) == v
    assert len(fetch_node_series(db, "A", "R1", 0, FAR)) == 3


def test_replace_runs_replaces_the_points_of_the_runs_in_the_file_only(tricky):
    before = tricky.run_versions(["R1", "R2", "R3"])
    r2 = fetch_node_series(tricky, "A", "R2", 0, FAR)
    top = max(int(fetch_node_series(tricky, n, "R1", 0, FAR).seq.max()) for n in ("A", "B"))
    new_rows = [("R1", "A", 15, 1.0), ("R1", "A", 5, 2.0), ("R1", "A", 15, 3.0)]
    assert tricky.ingest(points=pts(new_rows), replace_runs=True) == 3
    a = fetch_node_series(tricky, "A", "R1", 0, FAR)
    assert a.ts.tolist() == [5, 15, 15] and a.value.tolist() == [2.0, 1.0, 3.0]
    assert a.seq.min() > top and a.seq.tolist() == [top + 2, top + 1, top + 3]
    assert len(fetch_node_series(tricky, "B", "R1", 0, FAR)) == 0  # R1's B points went too
    r2_after = fetch_node_series(tricky, "A", "R2", 0, FAR)  # R2 is untouched
    assert r2_after.value.tolist() == r2.value.tolist() and r2_after.seq.tolist() == r2.seq.tolist()
    after = tricky.run_versions(["R1", "R2", "R3"])
    assert after["R1"] != before["R1"] and after["R2"] == before["R2"] and after["R3"] == before["R3"]
    # replacing again with the same points: still a replacement (new seq), a new version
    assert tricky.ingest(points=pts(new_rows), replace_runs=True) == 3
    assert tricky.run_versions(["R1"])["R1"] != after["R1"]
    assert len(fetch_node_series(tricky, "A", "R1", 0, FAR)) == 3


def test_a_failed_replace_deletes_nothing(tricky):
    before = fetch_node_series(tricky, "A", "R1", 0, FAR)
    with pytest.raises(IngestError):
        tricky.ingest(points=pts([("R1", "A", 1, 1.0), ("R1", "GHOST_NODE", 1, 1.0)]), replace_runs=True)
    after = fetch_node_series(tricky, "A", "R1", 0, FAR)
    assert after.value.tolist() == before.value.tolist() == EXPECTED


def test_the_same_ingest_history_gives_the_same_versions(tsdb_factory):
    """Versions hash what was ingested, not keys or seq: a database rebuilt from the same files
    (here: a second, fresh one) reports the same versions."""
    first = tsdb_factory()
    history = [
        dict(runs=[run("R1"), run("R2")], nodes=[Node("A"), Node("B")]),
        dict(points=pts([("R1", "A", 1, 1.0), ("R2", "B", 1, 2.0), ("R1", "B", 2, 3.0)])),
        dict(runs=[run("R2", 0, 2000)]),
        dict(points=pts([("R1", "A", 1, 1.0), ("R2", "A", 9, 9.0)])),
    ]
    for step in history:
        first.ingest(**step)
    versions = first.run_versions(["R1", "R2"])
    first.ingest(runs=[run("R3")], nodes=[Node("C")], points=pts([("R3", "C", 1, 1.0)]))
    assert first.run_versions(["R1", "R2"]) == versions  # another run's ingest changes neither
    assert versions["R1"] != versions["R2"]
