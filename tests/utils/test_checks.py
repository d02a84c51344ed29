"""The shared argument checkers: what each accepts, and the error naming the option."""

import math

import pytest

from swarmgrad.utils.checks import int_at_least, non_negative_int, number_at_least
from swarmgrad.utils.errors import ValidationError


def test_int_at_least_returns_ints_from_its_bound_up():
    assert int_at_least("size", 2, 2) == 2
    assert int_at_least("size", 10**9, 2) == 10**9
    assert non_negative_int("count", 0) == 0


@pytest.mark.parametrize("value", [1, -3, 2.0, True, "3", None])
def test_int_at_least_refuses_what_is_below_or_not_an_int_naming_the_option(value):
    with pytest.raises(ValidationError, match=rf"^size must be an int >= 2, got {value!r}$"):
        int_at_least("size", value, 2)


def test_non_negative_int_is_int_at_least_zero():
    with pytest.raises(ValidationError, match=r"^count must be an int >= 0, got -1$"):
        non_negative_int("count", -1)


def test_number_at_least_takes_ints_floats_and_infinity_as_floats():
    assert number_at_least("ratio", 1, 1) == 1.0
    assert isinstance(number_at_least("ratio", 1, 1), float)
    assert number_at_least("ratio", 2.5, 1) == 2.5
    assert number_at_least("ratio", math.inf, 1) == math.inf


@pytest.mark.parametrize("value", [0.5, math.nan, -math.inf, True, "2", None])
def test_number_at_least_refuses_what_is_below_nan_or_not_a_number(value):
    with pytest.raises(ValidationError, match=r"^ratio must be a number >= 1, got "):
        number_at_least("ratio", value, 1)
