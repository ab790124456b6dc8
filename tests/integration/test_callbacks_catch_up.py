"""Cron catch-up: fire times missed while no worker called them follow the schedule's ``catch_up`` policy,
whether their events were made before the downtime (the gate decides) or after it (the materializer skips)."""

from datetime import datetime

import pytest
from running import Running
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient, CallbackSettings, CallbackWorker, InvalidCallbackInput
from cmb_dagster.callbacks.schedules import materialize_schedules
from cmb_dagster.models import Backoff

FAST = CallbackSettings(
    poll_interval=0.2, lease_ttl=3, timeout=1, backoff=Backoff(first=0.01), allowed_hosts=["127.0.0.1"]
)
MISSED = 10  # fire times of an hourly schedule during a ten-hour downtime

POLICIES = [  # (catch_up, catch_up_limit, how many of the most recent missed fire times are called)
    ("none", 100, 0),
    ("latest", 100, 1),
    ("all", 3, 3),
    ("all", 100, MISSED),
]


@pytest.fixture
def client(db):
    with CallbackClient(db, FAST) as c:
        yield c


def db_now(db) -> datetime:
    with db.connection() as conn:
        return conn.execute("SELECT now()").fetchone()[0]


def hourly_away_from_now(db) -> str:
    """An hourly cron firing half an hour away from now: its last fire time is long missed, the next far off."""
    return f"{(db_now(db).minute + 30) % 60} * * * *"


def down_for_ten_hours(db) -> datetime:
    """Move the schedule's materialization back ten hours, as after a downtime; return the database's now."""
    with db.connection() as conn:
        return conn.execute(
            "UPDATE callback_schedules SET materialized_until = now() - interval '10 hours' RETURNING now()"
        ).fetchone()[0]


def past_events(client, downtime_end: datetime) -> list:
    return sorted(
        (e for e in client.list(limit=10_000) if e.originally_run_at < downtime_end), key=lambda e: e.originally_run_at
    )


def calls_after_the_downtime(client, sink, db, downtime_end: datetime) -> tuple[list, set[str]]:
    """Run a worker until every missed fire time is decided; return the past events and the keys called."""
    running = Running(CallbackWorker(db, FAST))
    try:
        wait_until(lambda: all(e.status.value != "pending" for e in past_events(client, downtime_end)))
    finally:
        running.stop()
    return past_events(client, downtime_end), {c.body["event_key"] for c in sink.received}


@pytest.mark.parametrize(("catch_up", "limit", "called"), POLICIES)
def test_events_made_before_a_downtime_are_called_as_the_policy_says(client, sink, db, catch_up, limit, called):
    client.create_schedule(
        "a", "g", "tick", hourly_away_from_now(db), f"{sink.url}/cb", catch_up="all", catch_up_limit=1000
    )
    downtime_end = down_for_ten_hours(db)
    materialize_schedules(db)
    assert len(past_events(client, downtime_end)) == MISSED
    with db.connection() as conn:  # the policy as it is when the worker comes back
        conn.execute(
            "UPDATE callback_schedules SET catch_up = %s, catch_up_limit = %s, misfire_grace_seconds = 1",
            (catch_up, limit),
        )

    events, keys = calls_after_the_downtime(client, sink, db, downtime_end)

    past_keys = [e.event_key for e in events]
    assert keys & set(past_keys) == set(past_keys[MISSED - called :])
    skipped = [e for e in events if e.status.value == "cancelled"]
    assert len(skipped) == MISSED - called
    assert all(e.attempts == 0 and f"catch_up={catch_up}" in (e.last_error or "") for e in skipped)


@pytest.mark.parametrize(("catch_up", "limit", "called"), POLICIES)
def test_fire_times_missed_before_they_were_made_are_skipped_by_the_materializer(
    client, sink, db, catch_up, limit, called
):
    client.create_schedule(
        "a",
        "g",
        "tick",
        hourly_away_from_now(db),
        f"{sink.url}/cb",
        catch_up=catch_up,
        catch_up_limit=limit,
        misfire_grace=1,
    )
    downtime_end = down_for_ten_hours(db)
    materialize_schedules(db)
    assert len(past_events(client, downtime_end)) == called  # none made only to be cancelled

    events, keys = calls_after_the_downtime(client, sink, db, downtime_end)

    assert keys >= {e.event_key for e in events} and all(e.status.value == "notified" for e in events)


def test_fire_times_within_the_grace_are_called_whatever_the_policy(client, sink, db):
    client.create_schedule(
        "a", "g", "tick", hourly_away_from_now(db), f"{sink.url}/cb", catch_up="none", misfire_grace=86400
    )
    downtime_end = down_for_ten_hours(db)
    materialize_schedules(db)

    events, keys = calls_after_the_downtime(client, sink, db, downtime_end)

    assert len(events) == MISSED and keys >= {e.event_key for e in events}


def test_the_default_policy_is_latest_and_bad_policies_name_the_field(client, sink):
    schedule = client.create_schedule("a", "g", "tick", "* * * * *", f"{sink.url}/cb")
    assert (schedule.catch_up, schedule.catch_up_limit, schedule.misfire_grace) == ("latest", 100, 60.0)
    for field, value in (("catch_up", "some"), ("catch_up_limit", 0), ("catch_up_limit", 1001), ("misfire_grace", 0)):
        with pytest.raises(InvalidCallbackInput, match=field):
            client.create_schedule("a", "g", "other", "* * * * *", f"{sink.url}/cb", **{field: value})
    assert [s.schedule_key for s in client.list_schedules()] == ["tick"]
