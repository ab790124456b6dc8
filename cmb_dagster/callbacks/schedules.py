"""The schedules materializer: cron fire times become events, ``horizon`` seconds ahead."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from croniter import croniter
from psycopg.rows import dict_row

from cmb_dagster.callbacks import sql
from cmb_dagster.callbacks.models import NewCallback, RetryPolicy
from cmb_dagster.callbacks.writer import insert_events
from cmb_dagster.database import Database

MAX_FIRE_TIMES = 1000  # per schedule and call; the next call continues


def fire_times(cron: str, timezone: str, after: datetime, until: datetime, limit: int = MAX_FIRE_TIMES) -> list[datetime]:
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
    and each (schedule, fire time) gets at most one event.
    """
    created = 0
    with db.connection() as conn:
        schedules = conn.cursor(row_factory=dict_row).execute(sql.CLAIM_SCHEDULES).fetchall()
        for schedule in schedules:
            until = schedule["db_now"] + timedelta(seconds=schedule["horizon"])
            times = fire_times(schedule["cron"], schedule["timezone"], schedule["materialized_until"], until)
            if len(times) == MAX_FIRE_TIMES:
                until = times[-1]
            sid = schedule["schedule_id"]
            claimed = [r[0] for r in conn.execute(sql.CLAIM_FIRE_TIMES, {"schedule_id": sid, "fire_ats": times})]
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
                created += len(linked)
            conn.execute(sql.SET_MATERIALIZED, {"schedule_id": sid, "until": until})
    return created
