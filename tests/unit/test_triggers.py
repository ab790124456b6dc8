"""Trigger models, evaluation, explanations and checks (pure Python, no database)."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from pydantic import BaseModel, ValidationError

import cmb_dagster.triggers as triggers_package
from cmb_dagster.triggers import (
    All,
    Any,
    ChunkDelay,
    ChunkDelta,
    ChunkRefDelay,
    Delay,
    Delta,
    RefDelay,
    Trigger,
    check,
    checks,
    chunks,
    dsl,
    durations,
    evaluate,
    evaluation,
    models,
    parameters,
    trigger_from_dict,
    trigger_from_json,
    uses_last,
)

ORDERS = ("sales.orders", "loaded_until")
PRICES = ("sales.prices", "loaded_until")
SEED_LAST = datetime(2021, 4, 23, 3, 51, 16, tzinfo=UTC)
SEED_CURRENT = datetime(2021, 4, 25, 3, 27, 33, tzinfo=UTC)
NOW = datetime(2021, 4, 25, 6, 0, tzinfo=UTC)

ALL_KINDS: list[Trigger] = [
    Delta(*ORDERS, "2d"),
    Delay(*ORDERS, "2h"),
    RefDelay(*ORDERS, *PRICES, "1h"),
    ChunkDelta(*ORDERS, "day", 2),
    ChunkDelta(*ORDERS, "month", timezone="Europe/Moscow"),
    ChunkDelay(*ORDERS, "hour", 1),
    ChunkRefDelay(*ORDERS, *PRICES, "day"),
    All(Delta(*ORDERS, "1d"), Delay(*PRICES, "2h")),
    Any(ChunkDelta(*ORDERS, "day"), ChunkDelta(*PRICES, "week")),
]


def at(text: str, zone: str = "UTC") -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone))


def run(trigger: Trigger, current: dict, last: dict | None = None, now: datetime = NOW, **kwargs):
    return evaluate(trigger, now=now, current=current, last=last or {}, **kwargs)


# --- definition -------------------------------------------------------------------------


def test_positional_arguments_work_as_written():
    assert Delta("e", "p", "2d").min_delta == timedelta(days=2)
    assert Delay("e", "p", timedelta(hours=2)).max_delay == timedelta(hours=2)
    ref = RefDelay("e", "p", "r", "q", "30min")
    assert (ref.ref_entity, ref.ref_parameter, ref.max_delay) == ("r", "q", timedelta(minutes=30))
    assert ChunkDelta("e", "p", "day", 2).min_delta == 2
    assert ChunkDelay("e", "p", "day", 1).max_delay == 1
    chunk_ref = ChunkRefDelay("e", "p", "r", "q", "month", 0, timezone="Europe/Moscow")
    assert (chunk_ref.scale, chunk_ref.max_delay, chunk_ref.timezone) == ("month", 0, "Europe/Moscow")


def test_keyword_arguments_work_too():
    assert Delta(entity="e", parameter="p", min_delta="1h") == Delta("e", "p", "1h")
    assert ChunkDelta(entity="e", parameter="p", scale="day") == ChunkDelta("e", "p", "day")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30min", timedelta(minutes=30)),
        ("2h", timedelta(hours=2)),
        ("2d", timedelta(days=2)),
        ("45s", timedelta(seconds=45)),
        ("1w", timedelta(weeks=1)),
        ("1h30min", timedelta(minutes=90)),
        ("1.5h", timedelta(minutes=90)),
        (" 2 days ", timedelta(days=2)),
    ],
)
def test_duration_strings(text, expected):
    assert Delta("e", "p", text).min_delta == expected


def test_chunk_count_accepts_whole_floats():
    assert ChunkDelta("e", "p", "day", 2.0).min_delta == 2
    assert isinstance(ChunkDelta("e", "p", "day", 2.0).min_delta, int)


@pytest.mark.parametrize(
    ("make", "field", "fragment"),
    [
        (lambda: Delta("", "p", "1d"), "entity", "non-empty"),
        (lambda: Delta("e", "  ", "1d"), "parameter", "non-empty"),
        (lambda: RefDelay("e", "p", "", "q", "1h"), "ref_entity", "non-empty"),
        (lambda: Delta("e", "p", "-1d"), "min_delta", "positive"),
        (lambda: Delta("e", "p", "0s"), "min_delta", "positive"),
        (lambda: Delay("e", "p", timedelta(0)), "max_delay", "positive"),
        (lambda: Delay("e", "p", "2 fortnights"), "max_delay", "fortnights"),
        (lambda: Delay("e", "p", 5), "max_delay", "got 5"),
        (lambda: ChunkDelta("e", "p", "fortnight"), "scale", "'fortnight'"),
        (lambda: ChunkDelta("e", "p", "7min"), "scale", "'7min'"),
        (lambda: ChunkDelta("e", "p", "5h"), "scale", "'5h'"),
        (lambda: ChunkDelta("e", "p", "45s"), "scale", "whole minutes"),
        (lambda: ChunkDelta("e", "p", "2d"), "scale", "'2d'"),
        (lambda: ChunkDelta("e", "p", "day", 2.5), "min_delta", "2.5"),
        (lambda: ChunkDelta("e", "p", "day", True), "min_delta", "True"),
        (lambda: ChunkDelta("e", "p", "day", "2"), "min_delta", "'2'"),
        (lambda: ChunkDelta("e", "p", "day", 0), "min_delta", "at least 1"),
        (lambda: ChunkDelay("e", "p", "day", -1), "max_delay", "at least 0"),
        (lambda: ChunkDelay("e", "p", "day", timezone="Mars/Olympus"), "timezone", "Mars/Olympus"),
        (lambda: ChunkRefDelay("e", "p", "r", "q", "day", timezone=""), "timezone", "''"),
    ],
)
def test_definition_errors_name_the_field_and_value(make, field, fragment):
    with pytest.raises(ValidationError) as caught:
        make()
    (error,) = caught.value.errors()
    assert error["loc"] == (field,)
    assert field in error["msg"]
    assert fragment in error["msg"]


def test_unknown_argument_is_rejected():
    with pytest.raises(ValidationError, match="tz"):
        ChunkDelta.model_validate({"entity": "e", "parameter": "p", "scale": "day", "tz": "UTC"})


def test_zero_chunk_delay_means_same_chunk():
    assert ChunkDelay("e", "p", "day", 0).max_delay == 0


def test_aggregates_take_ctl_triggers_only():
    inner = All(Delta(*ORDERS, "1d"))
    with pytest.raises(ValidationError, match="All cannot contain All"):
        All(inner, Delay(*ORDERS, "1h"))
    with pytest.raises(ValidationError, match="Any cannot contain All"):
        Any(Delta(*ORDERS, "1d"), inner)
    with pytest.raises(ValidationError, match="needs at least one trigger"):
        Any()
    with pytest.raises(ValidationError, match="takes CTL triggers"):
        All("Delta")
    with pytest.raises(ValidationError, match="All cannot contain Any"):
        trigger_from_json('{"kind": "All", "triggers": [{"kind": "Any", "triggers": []}]}')


def test_triggers_are_immutable():
    trigger = Delta(*ORDERS, "1d")
    with pytest.raises(ValidationError):
        trigger.min_delta = timedelta(days=2)


# --- storage, comparison, display ----------------------------------------------------------


@pytest.mark.parametrize("trigger", ALL_KINDS, ids=repr)
def test_json_round_trip(trigger):
    text = trigger.model_dump_json()
    assert json.loads(text)["kind"] == type(trigger).__name__
    assert trigger_from_json(text) == trigger
    assert trigger_from_dict(trigger.model_dump()) == trigger
    assert trigger_from_dict(trigger.model_dump(mode="json")) == trigger


def test_json_is_readable():
    assert json.loads(ChunkDelta(*ORDERS, "1h", 2, timezone="Europe/Moscow").model_dump_json()) == {
        "kind": "ChunkDelta",
        "entity": "sales.orders",
        "parameter": "loaded_until",
        "scale": "hour",
        "min_delta": 2,
        "timezone": "Europe/Moscow",
    }
    assert json.loads(Delay(*ORDERS, timedelta(days=1, minutes=90)).model_dump_json())["max_delay"] == "1d1h30min"


def test_trigger_works_as_pydantic_field():
    class Task(BaseModel):
        name: str
        trigger: Trigger

    task = Task(name="mart", trigger=All(Delta(*ORDERS, "1d"), Delay(*PRICES, "2h")))
    assert Task.model_validate_json(task.model_dump_json()) == task


@pytest.mark.parametrize("trigger", ALL_KINDS, ids=repr)
def test_equal_definitions_are_equal_and_hash_alike(trigger):
    copy = trigger_from_json(trigger.model_dump_json())
    assert copy == trigger
    assert hash(copy) == hash(trigger)
    assert len({trigger, copy}) == 1


def test_equivalent_spellings_are_equal():
    assert Delta("e", "p", "1d") == Delta("e", "p", "24h") == Delta("e", "p", timedelta(days=1))
    assert ChunkDelta("e", "p", "1h") == ChunkDelta("e", "p", "hour") == ChunkDelta("e", "p", "60min")
    assert ChunkDelta("e", "p", "24h") == ChunkDelta("e", "p", "day")
    assert Delta("e", "p", "1d") != Delta("e", "p", "2d")
    assert Delta("e", "p", "1d") != Delay("e", "p", "1d")


@pytest.mark.parametrize("trigger", ALL_KINDS, ids=repr)
def test_repr_is_the_constructor_call(trigger):
    namespace = {name: getattr(triggers_package, name) for name in triggers_package.__all__}
    assert eval(repr(trigger), namespace) == trigger  # our own repr
    assert str(trigger) == repr(trigger)


def test_repr_examples():
    assert repr(Delta(*ORDERS, "2d")) == "Delta('sales.orders', 'loaded_until', '2d')"
    tokyo = ChunkDelay("e", "p", "day", timezone="Asia/Tokyo")
    assert repr(tokyo) == "ChunkDelay('e', 'p', 'day', timezone='Asia/Tokyo')"


# --- evaluate: seed semantics ---------------------------------------------------------------


def test_seed_example_delta_waits_chunk_delta_fires():
    current, last = {ORDERS: SEED_CURRENT}, {ORDERS: SEED_LAST}
    exact = run(Delta(*ORDERS, "2d"), current, last)
    chunked = run(ChunkDelta(*ORDERS, "day", 2), current, last)
    assert not exact.fired
    assert chunked.fired
    assert exact.explanation == (
        "Delta(sales.orders/loaded_until, 2d) waits: current − last = "
        "2021-04-25 03:27:33+00:00 − 2021-04-23 03:51:16+00:00 = 1 day, 23:36:17 < 2 days (short by 0:23:43)"
    )
    assert chunked.explanation == (
        "ChunkDelta(sales.orders/loaded_until, day in UTC, 2) fires: current 2021-04-25 03:27:33+00:00 is in chunk "
        "2021-04-25, last 2021-04-23 03:51:16+00:00 in chunk 2021-04-23: 2 chunks apart >= 2"
    )


def test_delta_fires_at_exactly_min_delta():
    last = {ORDERS: SEED_LAST}
    assert run(Delta(*ORDERS, "2d"), {ORDERS: SEED_LAST + timedelta(days=2)}, last).fired
    assert not run(Delta(*ORDERS, "2d"), {ORDERS: SEED_LAST + timedelta(days=2, microseconds=-1)}, last).fired


def test_delay_compares_now_with_current():
    trigger = Delay(*ORDERS, "2h")
    fresh = run(trigger, {ORDERS: NOW - timedelta(hours=2)})
    stale = run(trigger, {ORDERS: NOW - timedelta(hours=2, minutes=5)})
    assert fresh.fired
    assert not stale.fired
    assert stale.explanation.endswith("= 2:05:00 > 2:00:00 (over by 0:05:00)")


def test_ref_delay_compares_reference_with_current():
    trigger = RefDelay(*ORDERS, *PRICES, "1h")
    assert run(trigger, {ORDERS: NOW - timedelta(hours=1), PRICES: NOW}).fired
    result = run(trigger, {ORDERS: NOW - timedelta(hours=3), PRICES: NOW})
    assert not result.fired
    assert "reference − current" in result.explanation
    assert "(over by 2:00:00)" in result.explanation
    assert result.used == {ORDERS: NOW - timedelta(hours=3), PRICES: NOW}


def test_chunk_delta_without_min_delta_needs_a_newer_chunk():
    trigger = ChunkDelta(*ORDERS, "day")
    last = {ORDERS: at("2021-04-23 00:00:00")}
    assert not run(trigger, {ORDERS: at("2021-04-23 23:59:59")}, last).fired
    assert run(trigger, {ORDERS: at("2021-04-24 00:00:00")}, last).fired


def test_chunk_delta_with_calendar_scales():
    last = {ORDERS: at("2021-01-31 23:00:00")}
    current = {ORDERS: at("2021-02-01 01:00:00")}
    assert run(ChunkDelta(*ORDERS, "month"), current, last).fired
    assert not run(ChunkDelta(*ORDERS, "quarter"), current, last).fired
    assert run(ChunkDelta(*ORDERS, "quarter"), {ORDERS: at("2021-04-01 00:00:00")}, last).fired
    assert run(ChunkDelta(*ORDERS, "month", 3), {ORDERS: at("2021-04-01 00:00:00")}, last).fired
    assert not run(ChunkDelta(*ORDERS, "year"), {ORDERS: at("2021-12-31 23:59:59")}, last).fired
    # 2021-01-31 is a Sunday, 2021-02-01 a Monday: a new ISO week.
    assert run(ChunkDelta(*ORDERS, "week"), current, last).fired


def test_chunk_delay_without_max_delay_means_same_chunk_as_now():
    trigger = ChunkDelay(*ORDERS, "day")
    assert run(trigger, {ORDERS: at("2021-04-25 00:00:00")}).fired
    assert run(trigger, {ORDERS: at("2021-04-26 00:00:00")}).fired  # ahead of now is fine
    result = run(trigger, {ORDERS: at("2021-04-24 23:59:59")})
    assert not result.fired
    assert result.explanation.endswith("1 chunk behind > 0 (over by 1 chunk)")
    assert run(ChunkDelay(*ORDERS, "day", 1), {ORDERS: at("2021-04-24 00:00:00")}).fired


def test_chunk_ref_delay_without_max_delay_means_same_chunk_as_reference():
    trigger = ChunkRefDelay(*ORDERS, *PRICES, "hour")
    assert run(trigger, {ORDERS: at("2021-04-25 05:00:00"), PRICES: at("2021-04-25 05:59:00")}).fired
    assert not run(trigger, {ORDERS: at("2021-04-25 04:59:00"), PRICES: at("2021-04-25 05:00:00")}).fired
    one_behind = {ORDERS: at("2021-04-25 04:00:00"), PRICES: at("2021-04-25 05:59:00")}
    assert run(ChunkRefDelay(*ORDERS, *PRICES, "hour", 1), one_behind).fired


def test_chunks_round_in_the_trigger_timezone():
    # 22:30 UTC on the 23rd is 01:30 on the 24th in Moscow (UTC+3).
    last = {ORDERS: at("2021-04-23 12:00:00")}
    current = {ORDERS: at("2021-04-23 22:30:00")}
    assert not run(ChunkDelta(*ORDERS, "day"), current, last).fired
    moscow = run(ChunkDelta(*ORDERS, "day", timezone="Europe/Moscow"), current, last)
    assert moscow.fired
    assert "day in Europe/Moscow" in moscow.explanation
    assert "in chunk 2021-04-24" in moscow.explanation


def test_task_timezone_applies_when_the_trigger_has_none():
    last = {ORDERS: at("2021-04-23 12:00:00")}
    current = {ORDERS: at("2021-04-23 22:30:00")}
    assert run(ChunkDelta(*ORDERS, "day"), current, last, timezone="Europe/Moscow").fired
    own_zone = ChunkDelta(*ORDERS, "day", timezone="UTC")
    assert not run(own_zone, current, last, timezone="Europe/Moscow").fired


def test_exact_differences_use_real_elapsed_time_across_dst():
    # Berlin, 2021-03-28: clocks jump from 02:00 to 03:00, so 00:00 -> 04:00 wall is 3 real hours.
    berlin = {ORDERS: at("2021-03-28 04:00:00", "Europe/Berlin")}
    last = {ORDERS: at("2021-03-28 00:00:00", "Europe/Berlin")}
    assert not run(Delta(*ORDERS, "4h"), berlin, last).fired
    assert run(Delta(*ORDERS, "3h"), berlin, last).fired
    now = at("2021-03-28 04:00:00", "Europe/Berlin")
    assert run(Delay(*ORDERS, "3h"), last, now=now).fired
    assert not run(Delay(*ORDERS, "2h59min"), last, now=now).fired


def test_values_in_any_zone_compare_as_instants():
    moscow = datetime(2021, 4, 25, 6, 27, 33, tzinfo=ZoneInfo("Europe/Moscow"))  # == SEED_CURRENT
    result = run(Delta(*ORDERS, "2d"), {ORDERS: moscow}, {ORDERS: SEED_LAST})
    assert not result.fired
    assert "(short by 0:23:43)" in result.explanation


# --- evaluate: missing values -------------------------------------------------------------


@pytest.mark.parametrize(
    "trigger",
    [
        Delta(*ORDERS, "1d"),
        Delay(*ORDERS, "1d"),
        RefDelay(*ORDERS, *PRICES, "1d"),
        ChunkDelta(*ORDERS, "day"),
        ChunkDelay(*ORDERS, "day"),
        ChunkRefDelay(*ORDERS, *PRICES, "day"),
    ],
    ids=repr,
)
def test_missing_current_never_fires(trigger):
    result = run(trigger, {PRICES: NOW}, {ORDERS: SEED_LAST})
    assert not result.fired
    assert "sales.orders/loaded_until has no current value yet (waiting for it to appear)" in result.explanation
    assert ORDERS not in result.used


@pytest.mark.parametrize(
    "trigger", [RefDelay(*ORDERS, *PRICES, "1d"), ChunkRefDelay(*ORDERS, *PRICES, "day")], ids=repr
)
def test_missing_reference_never_fires(trigger):
    result = run(trigger, {ORDERS: NOW})
    assert not result.fired
    assert "sales.prices/loaded_until has no current value yet" in result.explanation
    assert result.used == {ORDERS: NOW}


@pytest.mark.parametrize("trigger", [Delta(*ORDERS, "100w"), ChunkDelta(*ORDERS, "year", 50)], ids=repr)
def test_missing_last_fires_when_current_exists(trigger):
    result = run(trigger, {ORDERS: SEED_CURRENT}, {PRICES: SEED_LAST})
    assert result.fired
    assert "no last value of sales.orders/loaded_until" in result.explanation
    assert result.used == {ORDERS: SEED_CURRENT}


def test_parameter_newly_added_to_a_trigger_fires_via_missing_last():
    trigger = All(ChunkDelta(*ORDERS, "day"), ChunkDelta(*PRICES, "day"))
    result = run(trigger, {ORDERS: SEED_CURRENT, PRICES: SEED_CURRENT}, {ORDERS: SEED_CURRENT - timedelta(days=1)})
    assert result.fired
    assert [child.fired for child in result.children] == [True, True]


def test_moved_back_parameter_is_explained():
    result = run(Delta(*ORDERS, "1d"), {ORDERS: SEED_LAST}, {ORDERS: SEED_CURRENT})
    assert not result.fired
    assert "moved back" in result.explanation
    chunked = run(ChunkDelta(*ORDERS, "day"), {ORDERS: SEED_LAST}, {ORDERS: SEED_CURRENT})
    assert "moved back" in chunked.explanation


def test_only_the_read_values_are_used():
    unrelated = ("other", "p")
    result = run(Delta(*ORDERS, "1d"), {ORDERS: SEED_CURRENT, unrelated: NOW}, {ORDERS: SEED_LAST})
    assert result.used == {ORDERS: SEED_CURRENT}


# --- evaluate: input checks -----------------------------------------------------------------


def test_naive_now_is_rejected():
    with pytest.raises(ValueError, match="^now is a naive datetime"):
        evaluate(Delta(*ORDERS, "1d"), now=datetime(2021, 1, 1), current={}, last={})


def test_naive_current_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match=r"current\[\('sales.orders', 'loaded_until'\)\] is a naive datetime"):
        run(Delta(*ORDERS, "1d"), {ORDERS: datetime(2021, 1, 1)})


def test_naive_last_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match=r"last\[\('sales.orders', 'loaded_until'\)\] is a naive datetime"):
        run(Delta(*ORDERS, "1d"), {ORDERS: SEED_CURRENT}, {ORDERS: datetime(2021, 1, 1)})


def test_naive_reference_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match=r"current\[\('sales.prices', 'loaded_until'\)\]"):
        run(RefDelay(*ORDERS, *PRICES, "1h"), {ORDERS: SEED_CURRENT, PRICES: datetime(2021, 1, 1)})


def test_non_datetime_value_is_rejected():
    with pytest.raises(TypeError, match="current"):
        run(Delta(*ORDERS, "1d"), {ORDERS: "2021-01-01"})


def test_unknown_task_timezone_is_rejected():
    with pytest.raises(ValueError, match="timezone: unknown time zone 'Nowhere'"):
        run(ChunkDelta(*ORDERS, "day"), {ORDERS: NOW}, timezone="Nowhere")


def test_evaluate_rejects_non_triggers():
    with pytest.raises(TypeError, match="evaluate expects a trigger"):
        run("Delta", {})


# --- evaluate: aggregates -------------------------------------------------------------------


def test_all_needs_every_child():
    trigger = All(Delta(*ORDERS, "1d"), Delay(*PRICES, "1h"))
    current = {ORDERS: SEED_CURRENT, PRICES: NOW - timedelta(minutes=30)}
    assert run(trigger, current, {ORDERS: SEED_LAST}).fired
    stale = {ORDERS: SEED_CURRENT, PRICES: NOW - timedelta(hours=2)}
    result = run(trigger, stale, {ORDERS: SEED_LAST})
    assert not result.fired
    assert [child.fired for child in result.children] == [True, False]
    assert result.explanation.splitlines()[0] == "All waits: 1 of 2 triggers fired"
    assert result.explanation.splitlines()[1] == f"  - {result.children[0].explanation}"
    assert result.used == stale


def test_any_needs_one_child():
    trigger = Any(ChunkDelta(*ORDERS, "day"), ChunkDelta(*PRICES, "day"))
    last = {ORDERS: SEED_CURRENT, PRICES: SEED_LAST}
    result = run(trigger, {ORDERS: SEED_CURRENT, PRICES: SEED_LAST + timedelta(days=1)}, last)
    assert result.fired
    assert result.explanation.startswith("Any fires: 1 of 2 triggers fired\n  - ChunkDelta")
    assert not run(trigger, last, last).fired


def test_results_are_immutable():
    result = run(Delta(*ORDERS, "1d"), {ORDERS: SEED_CURRENT}, {ORDERS: SEED_LAST})
    with pytest.raises(AttributeError):
        result.fired = False  # type: ignore[misc]


# --- parameters, uses_last, check -----------------------------------------------------------


def test_parameters_include_references():
    assert parameters(Delta(*ORDERS, "1d")) == {ORDERS}
    assert parameters(RefDelay(*ORDERS, *PRICES, "1h")) == {ORDERS, PRICES}
    assert parameters(All(ChunkDelta(*ORDERS, "day"), ChunkRefDelay("x", "y", *PRICES, "day"))) == {
        ORDERS,
        ("x", "y"),
        PRICES,
    }


def test_uses_last():
    assert uses_last(Delta(*ORDERS, "1d"))
    assert uses_last(ChunkDelta(*ORDERS, "day"))
    assert not uses_last(Delay(*ORDERS, "1d"))
    assert not uses_last(ChunkRefDelay(*ORDERS, *PRICES, "day"))
    assert uses_last(All(Delay(*ORDERS, "1d"), ChunkDelta(*PRICES, "day")))
    assert not uses_last(Any(Delay(*ORDERS, "1d"), RefDelay(*ORDERS, *PRICES, "1h")))


def test_check_accepts_triggers_that_wait_for_new_data():
    assert check(Delta(*ORDERS, "1d")) == []
    assert check(ChunkDelta(*ORDERS, "day")) == []
    assert check(All(ChunkDelta(*ORDERS, "day"), Delay(*PRICES, "1h"))) == []
    assert check(Any(ChunkDelta(*ORDERS, "day"), Delta(*PRICES, "1h"))) == []


@pytest.mark.parametrize(
    "trigger",
    [
        Delay(*ORDERS, "1h"),
        RefDelay(*ORDERS, *PRICES, "1h"),
        ChunkDelay(*ORDERS, "day"),
        ChunkRefDelay(*ORDERS, *PRICES, "day"),
    ],
    ids=repr,
)
def test_check_warns_on_single_non_delta_trigger(trigger):
    (warning,) = check(trigger)
    assert repr(trigger) in warning
    assert "runs again whenever any value it reads changes" in warning
    assert "as soon as each run ends" not in warning  # the engine waits for a changed value


def test_check_warns_on_all_without_delta_child():
    (warning,) = check(All(Delay(*ORDERS, "1h"), ChunkDelay(*PRICES, "day")))
    assert "none of its triggers is Delta-type" in warning


def test_check_warns_on_each_non_delta_child_of_any():
    delay = Delay(*ORDERS, "1h")
    ref = ChunkRefDelay(*ORDERS, *PRICES, "day")
    warnings = check(Any(delay, ChunkDelta(*PRICES, "day"), ref))
    assert len(warnings) == 2
    assert repr(delay) in warnings[0]
    assert repr(ref) in warnings[1]


# --- package hygiene -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module", [triggers_package, checks, chunks, dsl, durations, models, evaluation], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
    failures, _ = doctest.testmod(module)
    assert failures == 0


def test_package_imports_neither_dagster_nor_database_code():
    # Load the package under an empty stand-in parent, so only the triggers package's own imports count.
    root = Path(triggers_package.__file__).resolve().parents[1]
    code = f"""
import sys, types
parent = types.ModuleType("cmb_dagster")
parent.__path__ = [{str(root)!r}]
sys.modules["cmb_dagster"] = parent
import cmb_dagster.triggers
foreign = {{"dagster", "psycopg", "psycopg2", "sqlalchemy"}}
print(sorted(
    m for m in sys.modules
    if m.split(".")[0] in foreign or (m.startswith("cmb_dagster.") and not m.startswith("cmb_dagster.triggers"))
))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Delta("e", "p", "99999999999d"), "min_delta"),
        (lambda: Delay("e", "p", "9" * 400 + "h"), "max_delay"),
        (lambda: Delay("e", "p", "100000000000000000000000.5s"), "max_delay"),
        (lambda: RefDelay("e", "p", "r", "q", "36526d"), "max_delay"),
        (lambda: Delta("e", "p", timedelta(days=999_999_999)), "min_delta"),
    ],
)
def test_durations_too_long_are_typed_errors_naming_the_field(make, field):
    with pytest.raises(ValidationError) as raised:
        make()
    assert [error["loc"] for error in raised.value.errors()] == [(field,)]
    assert "too long" in str(raised.value) or "at most" in str(raised.value)
    assert Delta("e", "p", "36525d").min_delta == timedelta(days=36_525)  # 100 years is still fine


@pytest.mark.parametrize(
    ("trigger", "label"),
    [
        (Delay("shop/prices", "loaded_until", "2h"), "Delay(shop/prices/loaded_until, 2h)"),
        (Delta("shop/prices", "loaded_until", "1d12h"), "Delta(shop/prices/loaded_until, 1d12h)"),
        (
            RefDelay("mart", "loaded_until", "shop/prices", "loaded_until", "30min"),
            "RefDelay(mart/loaded_until behind shop/prices/loaded_until, 30min)",
        ),
        (ChunkDelta("shop/prices", "loaded_until", "day", 2), "ChunkDelta(shop/prices/loaded_until, day in UTC, 2)"),
        (ChunkDelay("shop/prices", "loaded_until", "hour"), "ChunkDelay(shop/prices/loaded_until, hour in UTC, 0)"),
    ],
)
def test_explanations_name_each_triggers_threshold(trigger, label):
    values = {("shop/prices", "loaded_until"): NOW, ("mart", "loaded_until"): NOW}
    assert run(trigger, values, values).explanation.startswith(label + " ")
