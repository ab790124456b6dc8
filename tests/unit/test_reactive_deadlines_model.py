"""Deadlines of reactive tasks: when each is due, what meets it, how late a task is (no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from cmb_dagster.reactive import Deadline, InvalidReactiveInput, ReactiveChecks, ReactiveOptions, TaskSpec
from cmb_dagster.triggers import Delta

MOSCOW = ZoneInfo("Europe/Moscow")
BERLIN = ZoneInfo("Europe/Berlin")
LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)


def at(text: str, zone: ZoneInfo = MOSCOW) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=zone)


# --- cron -------------------------------------------------------------------------------------


def test_a_cron_deadline_is_late_from_its_time_until_a_successful_run_since_the_time_before():
    deadline = Deadline(cron="0 9 * * *")
    succeeded = at("2026-11-25 08:00")  # before the window of the deadline of 26 November
    on_time = deadline.state(at("2026-11-26 08:59:59"), "Europe/Moscow", succeeded, LONG_AGO)
    assert not on_time.late and not on_time.met
    assert on_time.due_at == at("2026-11-26 09:00") and on_time.slack == timedelta(seconds=1)
    late = deadline.state(at("2026-11-26 09:00"), "Europe/Moscow", succeeded, LONG_AGO)
    assert late.late and late.since == at("2026-11-25 09:00") and late.slack == timedelta(0)
    later = deadline.state(at("2026-11-26 10:20"), "Europe/Moscow", succeeded, LONG_AGO)
    assert later.late and later.slack == -timedelta(hours=1, minutes=20)
    assert later.text().startswith("late by 1:20:00 (due 2026-11-26 09:00:00+03:00")
    ran = deadline.state(at("2026-11-26 10:20"), "Europe/Moscow", at("2026-11-26 10:05"), LONG_AGO)
    assert not ran.late and ran.met and ran.due_at == at("2026-11-27 09:00")


def test_a_success_exactly_at_the_window_start_meets_it_a_microsecond_before_does_not():
    deadline = Deadline(cron="0 9 * * *")
    now = at("2026-11-26 09:30")
    assert not deadline.state(now, "Europe/Moscow", at("2026-11-25 09:00"), LONG_AGO).late
    assert deadline.state(now, "Europe/Moscow", at("2026-11-25 09:00") - timedelta(microseconds=1), LONG_AGO).late


def test_deadlines_before_the_deadline_was_defined_are_not_enforced():
    deadline = Deadline(cron="0 9 * * *")
    defined = at("2026-11-26 09:10")
    fresh = deadline.state(at("2026-11-26 09:30"), "Europe/Moscow", None, defined)
    assert not fresh.late and fresh.due_at == at("2026-11-27 09:00")
    assert deadline.state(at("2026-11-27 09:00"), "Europe/Moscow", None, defined).late


def test_a_cron_deadline_keeps_its_wall_clock_time_across_dst():
    deadline = Deadline(cron="0 9 * * *")
    state = deadline.state(at("2026-10-25 08:00", BERLIN), "Europe/Berlin", at("2026-10-24 10:00", BERLIN), LONG_AGO)
    assert state.due_at == at("2026-10-25 09:00", BERLIN) and state.slack == timedelta(hours=1)
    assert state.due_at.utcoffset() == timedelta(hours=1)  # CET after the change


# --- after a chunk -----------------------------------------------------------------------------


def test_the_days_partition_by_nine_next_day():
    deadline = Deadline(after_chunk="9h", scale="day")
    yesterday_evening = at("2026-11-25 23:00")
    late = deadline.state(at("2026-11-26 09:00"), "Europe/Moscow", yesterday_evening, LONG_AGO)
    assert late.late and late.since == at("2026-11-26 00:00") and late.due_at == at("2026-11-26 09:00")
    just_before = deadline.state(at("2026-11-26 08:59"), "Europe/Moscow", yesterday_evening, LONG_AGO)
    assert not just_before.late and just_before.due_at == at("2026-11-26 09:00")
    after_midnight = deadline.state(at("2026-11-26 09:00"), "Europe/Moscow", at("2026-11-26 00:00"), LONG_AGO)
    assert not after_midnight.late and after_midnight.due_at == at("2026-11-27 09:00")


@pytest.mark.parametrize(
    ("scale", "now", "since", "due"),
    [
        ("month", "2026-12-01 08:00", "2026-11-01 00:00", "2026-11-01 09:00"),  # December's not due yet
        ("month", "2026-12-01 09:00", "2026-12-01 00:00", "2026-12-01 09:00"),
        ("week", "2026-11-30 09:00", "2026-11-30 00:00", "2026-11-30 09:00"),  # a Monday
        ("year", "2027-01-01 09:00", "2027-01-01 00:00", "2027-01-01 09:00"),
        ("6h", "2026-11-26 15:00", "2026-11-26 06:00", "2026-11-26 15:00"),  # 06:00-12:00's, due 15:00
    ],
)
def test_after_chunk_at_chunk_edges(scale, now, since, due):
    state = Deadline(after_chunk="9h", scale=scale).state(at(now), "Europe/Moscow", None, LONG_AGO)
    assert (state.since, state.due_at) == (at(since), at(due))


def test_after_chunk_counts_wall_clock_hours_across_dst():
    """Berlin's 2026-10-25 has 25 hours: the day ending then is still due at 09:00 local next morning."""
    deadline = Deadline(after_chunk="9h", scale="day")
    state = deadline.state(at("2026-10-26 08:00", BERLIN), "Europe/Berlin", None, LONG_AGO)
    assert state.since == at("2026-10-25 00:00", BERLIN) and state.due_at == at("2026-10-25 09:00", BERLIN)
    upcoming = deadline.state(at("2026-10-26 08:00", BERLIN), "Europe/Berlin", at("2026-10-25 12:00", BERLIN), LONG_AGO)
    assert upcoming.due_at == at("2026-10-26 09:00", BERLIN) and upcoming.slack == timedelta(hours=1)


# --- definition -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"cron": "0 9 * *"}, "cron"),
        ({"cron": "0 0 9 * * *"}, "cron"),  # six fields: seconds are not a deadline's precision
        ({"cron": 9}, "cron"),
        ({"after_chunk": "9h"}, "scale"),
        ({"after_chunk": "367d", "scale": "day"}, "after_chunk"),
        ({"after_chunk": "-1h", "scale": "day"}, "after_chunk"),
        ({"after_chunk": "9h", "scale": "fortnight"}, "scale"),
        ({"cron": "0 9 * * *", "scale": "day"}, "scale"),
        ({"cron": "0 9 * * *", "after_chunk": "9h", "scale": "day"}, "either cron or after_chunk"),
        ({}, "either cron or after_chunk"),
        ({"cron": "0 9 * * *", "at": "9"}, "at"),
    ],
)
def test_a_bad_deadline_raises_the_typed_error_naming_the_field(fields, named):
    with pytest.raises(InvalidReactiveInput, match=named):
        Deadline(**fields)


def test_a_task_refuses_a_bad_deadline_naming_the_task_and_on_deadline_run_without_one():
    from cmb_dagster.reactive import ReactiveTask

    trigger = Delta("shop/orders", "loaded_until", "1d")
    with pytest.raises(InvalidReactiveInput, match="reactive task 'mart': deadline: .*cron"):
        ReactiveTask("mart", "shop/mart", trigger, deadline="at nine")
    with pytest.raises(InvalidReactiveInput, match="reactive task 'mart': .*on_deadline"):
        ReactiveTask("mart", "shop/mart", trigger, on_deadline="run")
    with pytest.raises(InvalidReactiveInput, match="on_deadline"):
        ReactiveTask("mart", "shop/mart", trigger, deadline="0 9 * * *", on_deadline="later")
    task = ReactiveTask("mart", "shop/mart", trigger, deadline={"after_chunk": "9h", "scale": "day"})
    assert task.spec.deadline == Deadline(after_chunk="9h", scale="day")
    with pytest.raises(InvalidReactiveInput, match="on_deadline"):
        TaskSpec(name="mart", trigger=trigger, on_deadline="run")


def test_the_tick_age_limits_are_bounded_and_ordered():
    assert ReactiveOptions(tasks=[]).checks.tick_age.severity(3) == "warn"
    assert ReactiveOptions(tasks=[]).checks.tick_age.severity(10) == "error"
    with pytest.raises(InvalidReactiveInput, match="tick_age"):
        ReactiveChecks(tick_age={"warn_at": 10, "error_at": 3})
    with pytest.raises(InvalidReactiveInput, match="tick_age"):
        ReactiveChecks(tick_age={"warn_at": -1})
