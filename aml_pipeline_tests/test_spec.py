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
