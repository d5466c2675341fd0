"""The grid stage's parameters, one object per node: every field of ``NodeGridParams`` is taken
from the spec by ``FROM_SPEC``, moves the grid stage's version (and not the raw stage's), and
reaches the core's cleaner or aligner. The cases derive from the dataclass's fields and the
table's rows, so a new field is checked as soon as it exists.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import pytest

from aml_pipeline.core.grid import grid_span
from aml_pipeline.core.grid_params import NodeGridParams
from aml_pipeline.pipeline.registry import StageVersions
from aml_pipeline.pipeline.stages.grid import FROM_SPEC, GRID, node_grid_params
from aml_pipeline.pipeline.stages.raw import RAW
from aml_pipeline.simulate.plant import plant_spec_dict, simulate_plant
from aml_pipeline.spec import parse_spec
from aml_pipeline_tests.core.whole_series import grid_column

FIELDS = [f.name for f in dataclasses.fields(NodeGridParams)]

# Per field, a value other than the base spec's for the first node (a target that sets nothing of
# its own), in spec.json's form, chosen to move the crafted series' grid below.
OTHER_VALUE: dict[str, Any] = {
    "good_states": [0, 3],
    "valid_range": [0.0, 30.0],
    "hampel_k": 2,
    "hampel_sigma": 2.0,
    "hampel_min_dev": 0.5,
    "interp": "hold",
    "max_interp_ms": 1000,
    "aggregate": "mean",
    "causal": True,
}

CATALOG_RANGE = (-100.0, 100.0)  # the first node's catalog range, wider than any value below

# Each (field, where the spec sets it): the node's own key and the spec-wide key, as FROM_SPEC says.
SOURCES = [
    (name, where, key)
    for name, (node_key, spec_key) in FROM_SPEC.items()
    for where, key in (("node", node_key), ("spec", spec_key))
    if key is not None
]


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return plant_spec_dict(simulate_plant(n_runs=2, run_minutes=2, seed=3), "grid_ds", history_steps=5, horizon_steps=2)


def test_every_field_has_a_source_in_the_spec_and_another_value_here() -> None:
    assert list(FROM_SPEC) == FIELDS, "FROM_SPEC must list every field of NodeGridParams, in order"
    assert all(node_key or spec_key for node_key, spec_key in FROM_SPEC.values())
    assert set(OTHER_VALUE) == set(FIELDS), f"fields without another value here: {sorted(set(FIELDS) - set(OTHER_VALUE))}"


def _changed(base: dict[str, Any], name: str, where: str, key: str) -> dict[str, Any]:
    data = copy.deepcopy(base)
    node = data["nodes"][0]
    assert set(node) == {"nodeId", "role"}, "the first node must set nothing of its own"
    if where == "node":
        node[key] = OTHER_VALUE[name]
    else:
        *parents, last = key.split(".")
        target = data
        for p in parents:
            target = target.setdefault(p, {})
        target[last] = OTHER_VALUE[name]
    return data


def _params(data: dict[str, Any]) -> NodeGridParams:
    spec = parse_spec(data)
    return node_grid_params(spec, spec.nodes[0], CATALOG_RANGE)


@pytest.mark.parametrize(("name", "where", "key"), SOURCES, ids=[f"{n}<-{w}:{k}" for n, w, k in SOURCES])
def test_each_source_moves_its_field_and_the_grid_version_only(base, name: str, where: str, key: str) -> None:
    data = _changed(base, name, where, key)
    before, after = _params(base), _params(data)
    moved = [f for f in FIELDS if getattr(before, f) != getattr(after, f)]
    assert moved == [name], f"setting {where} key {key} moved {moved}, not {name}"
    old, new = StageVersions.of(parse_spec(base)), StageVersions.of(parse_spec(data))
    assert new[GRID] != old[GRID], f"{key} is not covered by the grid stage's version"
    assert new[RAW] == old[RAW], f"{key} changes the raw stage's version: editing it would fetch again"


def _series() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three minutes of a jittered 1 Hz series (never on a grid time, some gaps between 1 and 5 s)
    around 25 with noise, rising above 30 for a while, with spikes and points in state 3."""
    rng = np.random.default_rng(4)
    steps = rng.choice([700, 1000, 1000, 1300, 3000], size=180)
    ts = 1_700_000_000_250 + np.cumsum(steps).astype(np.int64)
    value = 25.0 + rng.normal(0.0, 0.2, ts.size)
    value[60:80] += 10.0
    value[rng.choice(ts.size, 8, replace=False)] += rng.choice([-6.0, 6.0], 8)
    state = np.where(rng.random(ts.size) < 0.05, 3, 0).astype(np.int32)
    return ts, value, state


@pytest.mark.parametrize("name", FIELDS)
def test_each_field_reaches_the_core(base, name: str) -> None:
    """Another value of the field, alone, gives another grid for the same points."""
    where, key = next((w, k) for n, w, k in SOURCES if n == name)
    before = _params(base)
    other = dataclasses.replace(before, **{name: getattr(_params(_changed(base, name, where, key)), name)})
    ts, value, state = _series()
    first, rows = grid_span(int(ts[0]), int(ts[-1]), 1000)
    a, _ = grid_column(ts, value, state, first, 1000, rows, before)
    b, _ = grid_column(ts, value, state, first, 1000, rows, other)
    assert np.isfinite(a).any()
    assert a.tobytes() != b.tobytes(), f"{name} = {getattr(other, name)!r} does not change the grid"


def test_a_key_spec_json_leaves_out_is_left_out_of_the_version(base) -> None:
    """A field added later and written to spec.json only when set keeps the grid version of the
    specs that do not set it."""
    spec = parse_spec(base)
    j = spec.to_json_dict()
    full = GRID.covers(spec, j)
    del j["cleaning"]["hampelSigma"], j["nodes"][0]["interp"], j["maxInterpMs"]
    expected = copy.deepcopy(full)
    del expected["cleaning"]["hampelSigma"], expected["nodes"][0]["interp"], expected["maxInterpMs"]
    assert GRID.covers(spec, j) == expected


def test_the_keys_added_later_are_written_to_spec_json_only_when_set(base) -> None:
    """``aggregate`` and ``causal`` leave spec.json (and so its hash and every stage version) as it
    was for a spec that does not set them, and are written when set."""
    plain = parse_spec(base)
    assert not {"aggregate", "causal"} & set(plain.to_json_dict())
    assert all("aggregate" not in n for n in plain.to_json_dict()["nodes"])
    data = copy.deepcopy(base)
    data["causal"] = True
    data["aggregate"] = "mean"
    data["nodes"][1]["aggregate"] = "point"
    j = parse_spec(data).to_json_dict()
    assert j["causal"] is True and j["aggregate"] == "mean"
    assert j["nodes"][1]["aggregate"] == "point" and "aggregate" not in j["nodes"][0]
    assert parse_spec(j).to_json_bytes() == parse_spec(data).to_json_bytes()  # spec.json reads back as itself
    params = [node_grid_params(parse_spec(data), n, CATALOG_RANGE) for n in parse_spec(data).nodes[:2]]
    assert [(p.aggregate, p.causal) for p in params] == [("mean", True), ("point", True)]


@pytest.mark.parametrize("aggregate", [None, "mean"])
def test_a_node_sampled_faster_than_twice_the_beat_is_named_unless_it_takes_the_beat_mean(
    aggregate, plant, plant_url, tmp_path, caplog
) -> None:
    """On a 2 s beat the plant's AI910 (a point every 0.5 s) takes one point in four: the build warns
    once and the cleaned grid's figures name it with its median sample period beside the beat;
    with aggregate: mean on it, neither does."""
    from aml_pipeline.pipeline.plan import BuildPlan
    from aml_pipeline.pipeline.runs import build_runs
    from aml_pipeline.pipeline.store import DatasetStore
    from aml_pipeline.tsdb_open import open_tsdb

    data = plant_spec_dict(plant, f"fast_{aggregate or 'point'}", history_steps=5, horizon_steps=2, beat_ms=2000)
    if aggregate:
        next(n for n in data["nodes"] if n["nodeId"] == "AI910")["aggregate"] = aggregate
    spec = parse_spec(data)
    store = DatasetStore(tmp_path / "store", spec)
    caplog.set_level("WARNING", logger="aml_pipeline")
    with open_tsdb(plant_url) as db:
        plan = BuildPlan.read(db, store)
        results = list(build_runs(store, plan.work()[:3], plan.fetcher(db, page_limit=100_000)))
    figures = [r.grid.figures(store, plot=False) for r in results]
    periods = results[0].grid.sample_period_ms
    assert 450 < periods["AI910"] < 550 and periods["TI900"] is None  # every 2 s: not below the 2 s beat
    warned = [r.getMessage() for r in caplog.records if "node AI910 is sampled faster than twice the beat" in r.getMessage()]
    named = ["AI910: median sample period" in f["sampled_faster_than_beat"] for f in figures]
    if aggregate:
        assert not warned and not any(named)
    else:
        assert len(warned) == 1 and "beat 2000 ms" in warned[0] and "aggregate: mean" in warned[0]
        assert all(named)
