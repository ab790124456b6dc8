"""The Settle trigger: fires once a parameter has not changed for a quiet time, on a value the last run did not see."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cmb_dagster.triggers import All, Any, Delay, Delta, Settle, check, evaluate, param, trigger_from_json, uses_last

PRICES = ("shop/prices", "loaded_until")
ORDERS = ("shop/orders", "loaded_until")
NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
VALUE = datetime(2026, 11, 25, 9, 0, tzinfo=UTC)


def settle(quiet="15min", *, now=NOW, changed=NOW - timedelta(minutes=12), current=VALUE, last=None, zone=None):
    return evaluate(
        Settle(*PRICES, quiet),
        now=now,
        current={PRICES: current} if current else {},
        last={PRICES: last} if last else {},
        changed={PRICES: changed} if changed else {},
        timezone=zone,
    )


# --- definition -------------------------------------------------------------------------


def test_settle_is_defined_positionally_round_trips_and_reads_as_the_dsl():
    trigger = Settle(*PRICES, "15min")
    assert trigger.quiet == timedelta(minutes=15)
    assert repr(trigger) == "Settle('shop/prices', 'loaded_until', '15min')"
    assert trigger_from_json(trigger.model_dump_json()) == trigger
    assert param("shop/prices").settled_for("15min") == trigger
    assert trigger_from_json(All(trigger, Delay(*ORDERS, "2h")).model_dump_json()) == All(trigger, Delay(*ORDERS, "2h"))


@pytest.mark.parametrize("quiet", ["0s", "-5min", "101y", "soon", 15])
def test_a_quiet_time_that_is_no_positive_bounded_duration_is_refused_naming_the_field(quiet):
    with pytest.raises(ValidationError, match="quiet"):
        Settle(*PRICES, quiet)


# --- evaluation -------------------------------------------------------------------------


def test_settle_waits_while_the_value_changed_less_than_quiet_ago_and_says_how_long_it_has_been():
    result = settle()
    assert not result.fired
    assert "has not changed for 0:12:00" in result.explanation
    assert "needs 0:15:00 (0:03:00 to go)" in result.explanation
    assert result.wake_at == NOW + timedelta(minutes=3)
    assert result.waits_on == [
        f"Settle(shop/prices/loaded_until, 15min) waits on shop/prices/loaded_until = {VALUE}, "
        "unchanged for 0:12:00, needs 0:15:00"
    ]


def test_settle_fires_from_exactly_quiet_after_the_change_not_a_microsecond_before():
    changed = NOW - timedelta(minutes=15)
    assert settle(changed=changed).fired
    assert settle(changed=changed).used == {PRICES: VALUE}
    early = settle(changed=changed + timedelta(microseconds=1))
    assert not early.fired
    assert early.wake_at == NOW + timedelta(microseconds=1)


def test_settle_fires_on_a_first_run_and_on_a_value_other_than_the_last_runs_only():
    settled = NOW - timedelta(hours=1)
    first = settle(changed=settled)
    assert first.fired and "no last value" in first.explanation
    newer = settle(changed=settled, last=VALUE - timedelta(hours=1))
    assert newer.fired and "differs from the last run's" in newer.explanation
    same = settle(changed=settled, last=VALUE)
    assert not same.fired and same.wake_at is None  # only a new value can make it fire: no wake
    assert "the value the last run saw" in same.explanation


def test_a_value_that_moved_back_is_a_new_value_once_it_settled():
    assert settle(changed=NOW - timedelta(hours=1), last=VALUE + timedelta(days=1)).fired


def test_settle_waits_for_a_value_and_for_its_change_time():
    missing = settle(current=None)
    assert not missing.fired and "has no current value yet" in missing.explanation
    unknown = settle(changed=None)
    assert not unknown.fired and unknown.wake_at is None
    assert "last changed is unknown" in unknown.explanation


def test_the_quiet_time_is_absolute_time_across_the_autumn_dst_change():
    """Berlin, 2026-10-25: 02:50 CEST, then clocks go back; 02:10 CET is 20 minutes later (the wall clock says -40)."""
    berlin = ZoneInfo("Europe/Berlin")
    changed = datetime(2026, 10, 25, 2, 50, tzinfo=berlin)  # fold=0: CEST, +02:00
    now = datetime(2026, 10, 25, 2, 10, fold=1, tzinfo=berlin)  # CET, +01:00
    assert now - changed == timedelta(minutes=-40)  # the wall-clock difference Python gives within one zone
    assert settle(now=now, changed=changed, zone="Europe/Berlin").fired
    waits = settle("45min", now=now, changed=changed, zone="Europe/Berlin")
    assert not waits.fired and "has not changed for 0:20:00" in waits.explanation


def test_the_quiet_time_is_absolute_time_across_the_spring_dst_change():
    """Berlin, 2026-03-29: 01:55 CET, then 03:05 CEST is 10 minutes later (the wall clock says 70)."""
    berlin = ZoneInfo("Europe/Berlin")
    changed = datetime(2026, 3, 29, 1, 55, tzinfo=berlin)
    now = datetime(2026, 3, 29, 3, 5, tzinfo=berlin)
    result = settle(now=now, changed=changed, zone="Europe/Berlin")
    assert not result.fired and "has not changed for 0:10:00" in result.explanation
    assert result.wake_at == datetime(2026, 3, 29, 1, 10, tzinfo=UTC)


@pytest.mark.parametrize(
    "changed",
    [
        datetime(2026, 11, 30, 23, 50, tzinfo=UTC),  # a day's, a month's end
        datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC),  # a year's end
        datetime(2026, 11, 29, 23, 55, tzinfo=ZoneInfo("Asia/Kathmandu")),  # a week's end, a +05:45 zone
    ],
)
def test_a_quiet_time_across_a_chunk_boundary_counts_as_any_other(changed):
    """Settle counts time, not chunks: a change just before midnight settles 15 minutes later, past the boundary."""
    assert not settle(now=changed + timedelta(minutes=14, seconds=59), changed=changed).fired
    assert settle(now=changed + timedelta(minutes=15), changed=changed).fired


# --- combinations and advice ----------------------------------------------------------------


def test_all_wakes_when_its_last_waiting_settle_settles_and_never_for_a_child_only_a_change_fixes():
    other = ("shop/stock", "loaded_until")
    current = {PRICES: VALUE, other: VALUE, ORDERS: VALUE}
    changed = {PRICES: NOW - timedelta(minutes=12), other: NOW - timedelta(minutes=5), ORDERS: NOW}
    both = All(Settle(*PRICES, "15min"), Settle(*other, "15min"))
    assert evaluate(both, now=NOW, current=current, last={}, changed=changed).wake_at == NOW + timedelta(minutes=10)
    with_delta = All(Settle(*PRICES, "15min"), Delta(*ORDERS, "1d"))
    last = {ORDERS: VALUE}
    assert evaluate(with_delta, now=NOW, current=current, last=last, changed=changed).wake_at is None
    either = Any(Settle(*PRICES, "15min"), Settle(*other, "15min"))
    assert evaluate(either, now=NOW, current=current, last={}, changed=changed).wake_at == NOW + timedelta(minutes=3)


def test_a_late_all_names_only_the_triggers_that_wait():
    trigger = All(Settle(*PRICES, "15min"), Delay(*ORDERS, "2h"))
    current = {PRICES: VALUE, ORDERS: NOW - timedelta(hours=11)}
    changed = {PRICES: NOW - timedelta(hours=1), ORDERS: NOW - timedelta(hours=11)}
    [line] = evaluate(trigger, now=NOW, current=current, last={}, changed=changed).waits_on
    assert line == (
        f"Delay(shop/orders/loaded_until, 2h) waits on shop/orders/loaded_until = {current[ORDERS]}, "
        "11:00:00 behind now, allowed 2:00:00"
    )


def test_settle_compares_with_the_last_run_so_check_accepts_it_where_it_accepts_a_delta():
    assert uses_last(Settle(*PRICES, "15min"))
    assert check(Settle(*PRICES, "15min")) == []
    assert check(All(Settle(*PRICES, "15min"), Delay(*ORDERS, "2h"))) == []
    [finding] = check(Any(Settle(*PRICES, "15min"), Delay(*ORDERS, "2h")))
    assert "Delay('shop/orders', 'loaded_until', '2h') is not Delta-type" in finding
    assert "Settle" in finding  # the advice names it among the triggers that do compare


# --- property -----------------------------------------------------------------------------

gaps = st.lists(st.integers(min_value=1, max_value=15 * 60 * 1000 - 1), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(gaps=gaps, probes=st.lists(st.floats(min_value=0, max_value=1, exclude_max=True), min_size=1, max_size=5))
def test_settle_never_fires_while_the_value_keeps_changing_more_often_than_quiet(gaps, probes):
    """Changes every ``gap`` ms (each shorter than 15 min): at any moment before the next change, it waits."""
    quiet = timedelta(minutes=15)
    changed, value = NOW, VALUE
    for gap_ms in gaps:
        gap = timedelta(milliseconds=gap_ms)
        for probe in probes:
            now = changed + gap * probe
            result = evaluate(
                Settle(*PRICES, quiet), now=now, current={PRICES: value}, last={}, changed={PRICES: changed}
            )
            assert not result.fired, result.explanation
            assert result.wake_at == changed + quiet > now
        changed, value = changed + gap, value + gap  # the next change
    quiet_after = evaluate(
        Settle(*PRICES, quiet), now=changed + quiet, current={PRICES: value}, last={}, changed={PRICES: changed}
    )
    assert quiet_after.fired  # once the changes stop, it fires after quiet
