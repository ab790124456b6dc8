"""Operator functions of the callbacks engine: what is pending, late, failed; how many buckets."""

from __future__ import annotations

from pydantic import BaseModel, Field

from cmb_dagster.callbacks import sql
from cmb_dagster.callbacks.models import MAX_BUCKETS, BucketSetCounts, CallbackCounts, validated
from cmb_dagster.callbacks.worker import move_stranded_events
from cmb_dagster.database import Database, DatabaseSource


class _BucketCount(BaseModel):
    count: int = Field(ge=1, le=MAX_BUCKETS)


def callback_counts(database: DatabaseSource) -> CallbackCounts:
    """Events per status, overdue pending events and the age of the oldest one (one scan of the events)."""
    with Database.of(database).connection() as conn:
        cursor = conn.execute(sql.STATUS_COUNTS)
        columns = [c.name for c in cursor.description or ()]
        return CallbackCounts(**dict(zip(columns, cursor.fetchone(), strict=True)))


def bucket_set_counts(database: DatabaseSource, sets: int) -> list[BucketSetCounts]:
    """Per bucket set (set i: the buckets with id % sets == i, one worker job's), the figures its observations plot."""
    with Database.of(database).connection() as conn:
        cursor = conn.execute(sql.BUCKET_SET_COUNTS, {"sets": sets})
        columns = [c.name for c in cursor.description or ()]
        return [BucketSetCounts(**dict(zip(columns, row, strict=True))) for row in cursor.fetchall()]


def set_bucket_count(database: DatabaseSource, count: int) -> list[int]:
    """Set the number of buckets to ``count`` (1 to MAX_BUCKETS); return the bucket ids.

    Raising adds empty buckets (existing events keep theirs). Lowering removes the highest ones at once
    (new events go to the rest) and their pending events move to the remaining buckets: here, for a removed
    bucket no worker holds, otherwise by its worker once its calls in flight have ended. Nothing is lost and
    nothing is called twice by the move.
    """
    count = validated(_BucketCount, {"count": count}).count
    db = Database.of(database)
    with db.connection() as conn:
        conn.execute(sql.LOCK_EVENT_IDS_EXCLUSIVE)  # inserts read the count under the shared lock: none is half-way
        conn.execute(sql.LOCK_BUCKETS)
        current = len(conn.execute(sql.BUCKET_IDS).fetchall())
        if count > current:
            conn.execute(sql.ADD_BUCKETS, {"count": count})
        elif count < current:
            conn.execute(sql.REMOVE_BUCKETS, {"count": count})
    move_stranded_events(db)
    with db.connection() as conn:
        return [row[0] for row in conn.execute(sql.BUCKET_IDS)]

