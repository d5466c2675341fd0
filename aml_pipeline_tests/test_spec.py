"""Spec validation as a user meets it: an unknown key is named with the key that was meant."""

from __future__ import annotations

import math

import pytest

from aml_pipeline.errors import SpecError
from aml_pipeline.spec import parse_spec

BASE = {"id": "s", "lineId": "L1", "productId": "P1", "recipeId": "R1", "nodes": [{"nodeId": "A", "role": "target"}]}


@pytest.mark.parametrize(
    ("extra", "field", "meant"),
    [
        ({"cleaning": {"hampleK": 5}}, "cleaning.hampleK", "hampelK"),
        ({"histroySteps": 3}, "histroySteps", "historySteps"),
        ({"history_step": 3}, "history_step", "historySteps"),  # named as written, snake_case too
        ({"split": {"metod": "hashed"}}, "split.metod", "method"),
        ({"nodes": [{"nodeId": "A", "role": "target", "maxInterpMS": 5}]}, "nodes[0].maxInterpMS", "maxInterpMs"),
        ({"extras": {"recipeVersion": 1, "recipeContentHash": "h", "variables": [{"id": "a", "nodeId": "A", "scal": 1}]}},
         "extras.variables[0].scal", "scale"),
    ],
)
def test_an_unknown_key_is_named_with_the_nearest_valid_key(extra: dict, field: str, meant: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(BASE | extra, source="specs/x.yaml")
    line = err.value.one_line()
    assert line.startswith(f"SPEC_INVALID: specs/x.yaml: field {field}: unknown key; did you mean {meant}?"), line
    assert "Extra inputs" not in line


def test_a_key_near_no_valid_one_lists_the_keys_of_its_mapping() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(BASE | {"cleaning": {"zzz": 1}}, source="specs/x.yaml")
    line = err.value.one_line()
    assert line.startswith("SPEC_INVALID: specs/x.yaml: field cleaning.zzz: unknown key (the keys here: goodStates, "
                           "hampelK, hampelMinDev, hampelSigma; docs/spec.md)"), line


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ({"causal": "yes"}, "field causal: 'yes' is text, not true or false"),
        ({"causal": 1}, "field causal: 1 is a number, not true or false"),
        ({"stride": "5"}, "field stride: '5' is text, not a number"),
        ({"cleaning": {"hampelSigma": "3"}}, "field cleaning.hampelSigma: '3' is text, not a number"),
        ({"cleaning": {"goodStates": [0, "1"]}}, "field cleaning.goodStates: item 1: '1' is text, not a number"),
        ({"nodes": [{"nodeId": "A", "role": "target", "range": [0, "10"]}]},
         "field nodes[0].range: item 1: '10' is text, not a number"),
        ({"nodes": [{"nodeId": "A", "role": "target", "range": [True, 10]}]},
         "field nodes[0].range: item 0: true is not a number"),
        ({"extras": {"recipeVersion": 1, "recipeContentHash": "h", "variables": [{"id": "a", "nodeId": "A", "scale": "1", "offset": 0}]}},
         "field extras.variables[0].scale: '1' is text, not a number"),
    ],
)
def test_text_where_a_boolean_or_a_number_belongs_is_refused(extra: dict, line: str) -> None:
    # Pydantic would read "yes" as true and "1" as 1: a quoted value is refused, naming the field.
    with pytest.raises(SpecError) as err:
        parse_spec(BASE | extra, source="specs/x.yaml")
    assert err.value.one_line().startswith(f"SPEC_INVALID: specs/x.yaml: {line}"), err.value.one_line()


@pytest.mark.parametrize("bounds", [(math.inf, math.inf), (-math.inf, -math.inf)])
def test_a_node_range_that_holds_no_number_is_refused(bounds: tuple[float, float]) -> None:
    # [inf, inf] passed "lo <= hi" and removed every point of the node.
    with pytest.raises(SpecError, match="holds no number"):
        parse_spec(BASE | {"nodes": [{"nodeId": "A", "role": "target", "range": list(bounds)}]})


def test_a_node_range_may_be_open_on_one_side() -> None:
    spec = parse_spec(BASE | {"nodes": [{"nodeId": "A", "role": "target", "range": [0, math.inf]}]})
    assert spec.nodes[0].range == (0.0, math.inf)


def test_numbers_and_booleans_as_such_still_parse() -> None:
    spec = parse_spec(BASE | {"causal": True, "stride": 2, "cleaning": {"hampelSigma": 2.5, "goodStates": [0, 192]},
                              "nodes": [{"nodeId": "A", "role": "target", "range": [0, 10.5]}]})
    assert (spec.causal, spec.stride, spec.cleaning.hampel_sigma, spec.nodes[0].range) == (True, 2, 2.5, (0.0, 10.5))


EXTRAS = {"recipeVersion": 1, "recipeContentHash": "h"}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        # beyond what the build computes with: an overflow, a year a datetime cannot hold
        ({"beatMs": 2**63}, "beatMs"),
        ({"maxInterpMs": 2**63}, "maxInterpMs"),
        ({"fromMs": 10**15}, "fromMs"),
        ({"toMs": 2**63}, "toMs"),
        ({"fromMs": -(2**63) - 1}, "fromMs"),
        ({"cleaning": {"hampelK": 2**63}}, "cleaning.hampelK"),
        ({"cleaning": {"hampelSigma": 1.0e308}}, "cleaning.hampelSigma"),
        ({"nodes": [{"nodeId": "A", "role": "target", "hampelK": 2**63}]}, "nodes[0].hampelK"),
        ({"nodes": [{"nodeId": "A", "role": "target", "hampelMinDev": math.inf}]}, "nodes[0].hampelMinDev"),
        ({"nodes": [{"nodeId": "A", "role": "target", "maxInterpMs": 2**63}]}, "nodes[0].maxInterpMs"),
        ({"note": "n" * 10_001}, "note"),
        ({"schedule": "banana"}, "schedule"),
        ({"schedule": "99 * * * *"}, "schedule"),
        ({"extras": EXTRAS | {"recipeVersion": -3}}, "extras.recipeVersion"),
        ({"extras": EXTRAS | {"specVersion": -1}}, "extras.specVersion"),
        ({"extras": EXTRAS | {"availabilityWatermark": -5}}, "extras.availabilityWatermark"),
        ({"extras": EXTRAS | {"variables": [{"id": "../x", "nodeId": "A", "scale": 1, "offset": 0}]}},
         "extras.variables[0].id"),
        ({"extras": EXTRAS | {"variables": [{"id": "a", "nodeId": "A", "scale": 1, "offset": 0, "delayMs": -500}]}},
         "extras.variables[0].delayMs"),
        ({"extras": EXTRAS | {"variables": [{"id": "a", "nodeId": "A", "scale": 1e308, "offset": 0}]}},
         "extras.variables[0].scale"),
        ({"extras": EXTRAS | {"variables": [{"id": "a", "nodeId": "A", "scale": 1, "offset": 0},
                                            {"id": "a", "nodeId": "A", "scale": 1, "offset": 0}]}},
         "extras.variables"),
    ],
)
def test_values_no_build_can_use_are_refused_naming_the_field(extra: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(BASE | extra, source="specs/x.yaml")
    assert err.value.one_line().startswith(f"SPEC_INVALID: specs/x.yaml: field {field}"), err.value.one_line()


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ({"fromMs": 20, "toMs": 10}, "fromMs (20) is after toMs (10)"),
        ({"nodes": [{"nodeId": "A", "role": "target"}, {"nodeId": "A", "role": "feature"}]}, "nodes: A listed more than once"),
        ({"nodes": [{"nodeId": "A", "role": "feature"}]}, "nodes: at least one needs role: target"),
        ({"historySteps": 60, "history_steps": 5}, "field history_steps: history_steps and historySteps are one key, given twice"),
    ],
)
def test_checks_across_fields_name_the_field_not_the_root(extra: dict, line: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(BASE | extra, source="specs/x.yaml")
    assert err.value.one_line().startswith(f"SPEC_INVALID: specs/x.yaml: {line}"), err.value.one_line()
    assert "<root>" not in err.value.one_line()


def test_cron_schedules_dagster_takes_still_parse() -> None:
    for cron in ("15 * * * *", "*/5 1-3 1,15 jan *", "0 6 * * mon-fri", "0 0 * * 7", "@daily"):
        assert parse_spec(BASE | {"schedule": cron}).schedule == cron


def test_many_nodes_are_checked_in_linear_time_and_named_shortly() -> None:
    nodes = [{"nodeId": f"N{i}", "role": "target"} for i in range(50_000)]
    with pytest.raises(SpecError) as err:
        parse_spec(BASE | {"nodes": [*nodes, {"nodeId": "N7", "role": "feature"}]}, source="specs/x.yaml")
    assert err.value.one_line() == "SPEC_INVALID: specs/x.yaml: nodes: N7 listed more than once"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("beatMs: 01000\n", "line 6: 01000 reads in YAML as an octal number (512); write it without the leading 0"),
        ("historySteps: 1:30\n", "line 6: 1:30 reads in YAML as a base-60 number (90); write the number itself"),
        ("note: !!binary aGVsbG8=\n", "line 6: a !!binary value is not text"),
        ("note: " + "[" * 5000 + "]" * 5000 + "\n", "cannot read spec: lists or mappings nested deeper than a reader follows"),
        ("beatMs: 1e3\n", "field beatMs: '1e3' is text, not a number (write it without quotes, and an exponent with a dot"),
    ],
)
def test_yaml_that_does_not_read_as_it_looks_is_refused_with_its_line(tmp_path, text: str, problem: str) -> None:
    from aml_pipeline.spec import load_spec

    path = tmp_path / "x.yaml"
    path.write_text("id: s\nlineId: L1\nproductId: P1\nrecipeId: R1\nnodes: [{nodeId: A, role: target}]\n" + text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.one_line().startswith(f"SPEC_INVALID: {path}: {problem}"), err.value.one_line()
    ok = tmp_path / "ok.yaml"
    ok.write_text("id: s\nlineId: L1\nproductId: P1\nrecipeId: R1\nnodes: [{nodeId: A, role: target}]\n"
                  "beatMs: 1_000\nhistorySteps: 0x3c\nmaxInterpMs: 0\n")
    spec = load_spec(ok)
    assert (spec.beat_ms, spec.history_steps, spec.max_interp_ms) == (1000, 60, 0)
