from __future__ import annotations

import numpy as np
import pytest

from aml_pipeline.core.units import UnitTransform, check_unit_contract, to_model_units
from aml_pipeline.errors import UnitContractError

NODES = ["TI101", "FIC200_SP", "PI300"]


def test_valid_variables_become_transforms_by_node() -> None:
    t = check_unit_contract([("T", "TI101", 1.0, -273.15), ("F", "FIC200_SP", "0.001", 0)], NODES)
    assert t == {"TI101": UnitTransform(1.0, -273.15), "FIC200_SP": UnitTransform(0.001, 0.0)}
    assert check_unit_contract([], NODES) == {}


@pytest.mark.parametrize(
    ("scale", "offset"),
    [
        (0.0, 0.0),
        (-0.0, 1.0),
        (None, 0.0),
        (1.0, None),
        (float("nan"), 0.0),
        (float("inf"), 0.0),
        (1.0, float("-inf")),
        (1.0, float("nan")),
        ("abc", 0.0),
        (True, 0.0),
        (1.0, False),
    ],
)
def test_untrustworthy_transforms_fail_closed(scale: object, offset: object) -> None:
    # Never defaulted to 1/0: a silently wrong unit would train a model in the wrong units.
    with pytest.raises(UnitContractError) as err:
        check_unit_contract([("T", "TI101", scale, offset)], NODES)
    assert err.value.code == "UNIT_CONTRACT_INVALID"
    assert "'T'" in err.value.message and "TI101" in err.value.message


def test_variable_for_a_node_outside_the_spec_is_an_error() -> None:
    with pytest.raises(UnitContractError, match="XX999"):
        check_unit_contract([("X", "XX999", 1.0, 0.0)], NODES)


def test_two_variables_for_one_node_are_an_error() -> None:
    with pytest.raises(UnitContractError, match="more than one"):
        check_unit_contract([("A", "TI101", 1.0, 0.0), ("B", "TI101", 2.0, 0.0)], NODES)


def test_unit_contract_error_is_a_value_error_with_a_one_line_message() -> None:
    with pytest.raises(ValueError):
        check_unit_contract([("T", "TI101", 0, 0)], NODES)
    try:
        check_unit_contract([("T", "TI101", 0, 0)], NODES)
    except UnitContractError as e:
        assert e.one_line().startswith("UNIT_CONTRACT_INVALID: ")
        assert "\n" not in e.one_line()


def test_to_model_units_applies_scale_then_offset_per_column() -> None:
    grid = np.array([[300.0, 10.0, 1.0], [np.nan, 20.0, 2.0]])
    transforms = {"TI101": UnitTransform(1.0, -273.15), "FIC200_SP": UnitTransform(0.5, 1.0)}
    out = to_model_units(grid, NODES, transforms)
    assert out[0, 0] == 300.0 * 1.0 - 273.15
    assert np.isnan(out[1, 0])  # missing stays missing
    assert out[:, 1].tolist() == [6.0, 11.0]
    assert out[:, 2].tolist() == [1.0, 2.0]  # node without a variable passes unchanged
    assert grid[0, 0] == 300.0  # input untouched


def test_to_model_units_checks_the_grid_shape() -> None:
    with pytest.raises(ValueError, match="shape"):
        to_model_units(np.zeros((3, 2)), NODES, {})
    with pytest.raises(ValueError, match="shape"):
        to_model_units(np.zeros(3), NODES, {})
