"""The schedules materializer: cron fire times become events, ``horizon`` seconds ahead."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
from croniter import croniter
from psycopg.rows import dict_row

from cmb_dagster.callbacks import sql
from cmb_dagster.callbacks.models import NewCallback, RetryPolicy
from cmb_dagster.callbacks.writer import insert_events
from cmb_dagster.database import Database
from cmb_dagster.isolation import describe_error, sanitize

log = logging.getLogger("cmb_dagster.callbacks")

MAX_FIRE_TIMES = 1000  # per schedule and call; the next call continues


def fire_times(
    cron: str, timezone: str, after: datetime, until: datetime, limit: int = MAX_FIRE_TIMES
) -> list[datetime]:
    """Fire times of ``cron`` in ``timezone`` in (after, until], in UTC."""
    it = croniter(cron, after.astimezone(ZoneInfo(timezone)))
    found = []
    while len(found) < limit:
        fire = it.get_next(datetime)
        if fire > until:
            break
        found.append(fire.astimezone(UTC))
    return found


def materialize_schedules(db: Database) -> int:
    """Create the events of every active schedule up to its horizon; return how many were created.

    Safe to run from several processes at once: a schedule is materialized by one of them at a time,
    and each (schedule, fire time) gets at most one event. A schedule that cannot be materialized (e.g. a
    stored retry policy outside RetryPolicy's bounds) is skipped with a warning; the others go on.
    """
    created = 0
    with db.connection() as conn:
        schedules = conn.cursor(row_factory=dict_row).execute(sql.CLAIM_SCHEDULES).fetchall()
        for schedule in schedules:
            try:
                with conn.transaction():  # a savepoint: a schedule that fails leaves nothing behind
                    created += _materialize(conn, schedule)
            except (psycopg.OperationalError, psycopg.InterfaceError):
                raise
            except Exception as exc:  # noqa: BLE001 - one bad schedule is skipped, the others go on
                name = "/".join((schedule["owner_client_id"], schedule["group_key"], schedule["schedule_key"]))
                log.warning("schedule %s skipped: %s", sanitize(name, 600), describe_error(exc))
    return created


def past_skipped(schedule: dict[str, Any]) -> datetime:
    """Where a claimed schedule's fire times resume: past those its catch-up policy would not call.

    A fire time after ``materialized_until`` found later than the misfire grace is missed; it is skipped when
    at least ``calls_kept`` later fire times are due. The gate applies the same rule to events already made
    (sql.GATE); this spares making the events of a long downtime only to cancel them.
    """
    after, now = schedule["materialized_until"], schedule["db_now"]
    missed_before = now - timedelta(seconds=schedule["misfire_grace"])
    if after >= missed_before:
        return after
    earlier = croniter(schedule["cron"], now.astimezone(ZoneInfo(schedule["timezone"])))
    for later_due in range(MAX_FIRE_TIMES):
        fire = earlier.get_prev(datetime).astimezone(UTC)
        if fire <= after:
            return after
        if fire < missed_before and later_due >= schedule["calls_kept"]:
            name = "/".join((schedule["owner_client_id"], schedule["group_key"], schedule["schedule_key"]))
            log.info(
                "schedule %s: fire times missed up to %s not called (catch_up=%s)",
                sanitize(name, 600),
                fire.isoformat(),
                schedule["catch_up"],
            )
            return fire
    return after


def _materialize(conn: psycopg.Connection, schedule: dict[str, Any]) -> int:
    """Create the events of one claimed schedule up to its horizon; return how many were created."""
    until = schedule["db_now"] + timedelta(seconds=schedule["horizon"])
    times = fire_times(schedule["cron"], schedule["timezone"], past_skipped(schedule), until)
    if len(times) == MAX_FIRE_TIMES:
        until = times[-1]
    sid = schedule["schedule_id"]
    claimed = [r[0] for r in conn.execute(sql.CLAIM_FIRE_TIMES, {"schedule_id": sid, "fire_ats": times})]
    linked: list[tuple[datetime, int]] = []
    if claimed:
        retry = RetryPolicy.model_validate(schedule["retry"])
        events = [
            NewCallback(
                owner_client_id=schedule["owner_client_id"],
                group_key=schedule["group_key"],
                event_key=f"{schedule['schedule_key']}@{fire.strftime('%Y-%m-%dT%H:%M:%SZ')}",
                run_at=fire,
                cb_url=schedule["cb_url"],
                context=schedule["context"],
                retry=retry,
            )
            for fire in claimed
        ]
        ids = insert_events(conn, events, schedule_id=sid)
        linked = [(f, i) for f, i in zip(claimed, ids, strict=True) if isinstance(i, int)]
        conn.execute(
            sql.LINK_FIRE_TIMES,
            {"schedule_id": sid, "fire_ats": [f for f, _ in linked], "event_ids": [i for _, i in linked]},
        )
    conn.execute(sql.SET_MATERIALIZED, {"schedule_id": sid, "until": until})
    return len(linked)
