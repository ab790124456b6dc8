"""The readable trigger DSL and the ``&`` / ``|`` operators."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cmb_dagster.triggers import (
    All,
    Any,
    ChunkDelay,
    ChunkDelta,
    ChunkRefDelay,
    Delay,
    Delta,
    RefDelay,
    all_of,
    any_of,
    param,
)

SALES = param("sales", "loaded_until")
PRICES = param("prices", "loaded_until")
MART = param("mart", "loaded_until")


def test_builders_make_the_low_level_triggers():
    assert SALES.advanced_by("1d") == Delta("sales", "loaded_until", "1d")
    assert SALES.advanced_by(2, "day") == ChunkDelta("sales", "loaded_until", "day", 2)
    assert SALES.new_chunk("month", timezone="Europe/Moscow") == ChunkDelta(
        "sales", "loaded_until", "month", timezone="Europe/Moscow"
    )
    assert SALES.fresh_within("2h") == Delay("sales", "loaded_until", "2h")
    assert SALES.fresh_within(1, "day") == ChunkDelay("sales", "loaded_until", "day", 1)
    assert SALES.same_chunk_as_now("day") == ChunkDelay("sales", "loaded_until", "day")
    assert MART.behind(SALES, by_at_most="1h") == RefDelay("mart", "loaded_until", "sales", "loaded_until", "1h")
    assert MART.behind(SALES, 1, "day") == ChunkRefDelay("mart", "loaded_until", "sales", "loaded_until", "day", 1)
    assert MART.caught_up_with(SALES, "day") == ChunkRefDelay("mart", "loaded_until", "sales", "loaded_until", "day")


def test_builders_validate_like_the_classes():
    with pytest.raises(ValidationError, match="min_delta"):
        SALES.advanced_by(2)  # a chunk count needs a scale
    with pytest.raises(ValidationError, match="scale"):
        SALES.new_chunk("fortnight")
    with pytest.raises(ValidationError, match="entity"):
        param("", "loaded_until").advanced_by("1d")


def test_combinators():
    day, fresh = SALES.new_chunk("day"), PRICES.fresh_within("2h")
    assert all_of(day, fresh) == All(day, fresh)
    assert any_of(day, fresh) == Any(day, fresh)


def test_operators_build_and_flatten_aggregates():
    a, b, c = SALES.new_chunk("day"), PRICES.new_chunk("day"), MART.fresh_within("1h")
    assert a & b == All(a, b)
    assert a | b == Any(a, b)
    assert a & b & c == All(a, b, c)
    assert a | (b | c) == Any(a, b, c)
    assert all_of(a & b, c) == All(a, b, c)
    assert any_of(a | b, c) == Any(a, b, c)


def test_mixing_aggregates_is_refused():
    a, b, c = SALES.new_chunk("day"), PRICES.new_chunk("day"), MART.fresh_within("1h")
    with pytest.raises(ValueError, match="cannot put Any.* inside All: aggregate triggers cannot be nested"):
        (a | b) & c
    with pytest.raises(ValueError, match="cannot put All.* inside Any"):
        c | (a & b)
    with pytest.raises(ValueError, match="cannot put Any.* inside All"):
        all_of(a, any_of(b, c))


def test_operators_with_non_triggers():
    with pytest.raises(TypeError):
        SALES.new_chunk("day") & "sales"
