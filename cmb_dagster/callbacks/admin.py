"""Operator functions of the callbacks engine: its status (events per status, per worker job's buckets, limits
per key), its queue depths at a bounded cost (the metrics), and the number of buckets."""

from __future__ import annotations

import warnings
from typing import Any

import psycopg
from pydantic import BaseModel, Field

from cmb_dagster import flow
from cmb_dagster.callbacks import sql
from cmb_dagster.callbacks.models import (
    MAX_BUCKETS,
    BucketSetCounts,
    CallbackCounts,
    CallbacksStatus,
    LimitUse,
    validated,
)
from cmb_dagster.callbacks.worker import move_stranded_events
from cmb_dagster.database import Database, DatabaseSource


class _BucketCount(BaseModel):
    count: int = Field(ge=1, le=MAX_BUCKETS)


class _StatusRequest(BaseModel):
    bucket_sets: int = Field(ge=0, le=MAX_BUCKETS)


def status(
    database: DatabaseSource, *, bucket_sets: int = 0, totals: bool = True, limits: bool = True
) -> CallbacksStatus:
    """What the engine reports.

    ``totals``: events per status over every bucket, overdue pending events and the age of the oldest one (one
    scan of the events). ``bucket_sets``: for each of that many sets of buckets (set i: the buckets with
    ``id % bucket_sets == i``, one worker job's), the figures its observations plot (read from the indexes).
    ``limits``: each key of the limits the workers registered (destination hosts, owners, groups; at most
    ``LIMIT_KEYS_SHOWN``), its limits and the calls in flight.
    """
    sets = validated(_StatusRequest, {"bucket_sets": bucket_sets}).bucket_sets
    with Database.of(database).connection() as conn:
        counts = _rows(conn, sql.STATUS_COUNTS, {}, CallbackCounts)[0] if totals else None
        per_set = _rows(conn, sql.BUCKET_SET_COUNTS, {"sets": sets}, BucketSetCounts) if sets else []
        uses = _limit_uses(conn) if limits else []
    return CallbacksStatus(totals=counts, bucket_sets=per_set, limits=uses)


LIMIT_KEYS_SHOWN = 1000


def _limit_uses(conn: psycopg.Connection) -> list[LimitUse]:
    scopes = [row[0] for row in conn.execute(sql.FLOW_SCOPES)]
    return [
        LimitUse(
            scope=use.scope,
            key=use.key,
            concurrency=use.concurrency,
            in_flight=use.in_flight,
            rate_per_second=use.rate_per_second,
            burst=use.burst,
            tokens=use.tokens,
        )
        for use in flow.usage(conn, scopes, limit=LIMIT_KEYS_SHOWN)
    ]


class BucketSetDepth(BaseModel):
    """Pending and overdue events of one bucket set and the oldest overdue one's age; ``exact``: counted, not
    estimated (see :func:`depths`)."""

    bucket_set: int
    pending: int
    overdue: int
    oldest_overdue_seconds: float
    exact: bool


EXACT_UP_TO = 1000
"""Pending events per bucket counted one by one at most (fewer past 16 buckets); deeper buckets are estimated."""
SAMPLE_WINDOWS = 128
SAMPLE_WIDTH = 32


def depths(database: DatabaseSource, *, bucket_sets: int = 1) -> list[BucketSetDepth]:
    """Per bucket set (set i: the buckets with ``id % bucket_sets == i``): pending and overdue events and the
    oldest overdue age, read from the indexes at a cost bounded whatever the depth.

    A bucket's pending count is exact up to ``EXACT_UP_TO`` (divided among the buckets past 16, 100 at least), its
    overdue count too unless all of those are overdue, the oldest overdue age always. Deeper buckets are estimated
    from one sample of ``SAMPLE_WINDOWS`` windows of ``SAMPLE_WIDTH`` event ids spread over their pending ids
    (``exact`` is then false).
    """
    sets = validated(_BucketCount, {"count": bucket_sets}).count
    with Database.of(database).connection() as conn:
        buckets = max(conn.execute(sql.BUCKET_COUNT).fetchone()[0], 1)
        params = {
            "sets": sets,
            "bound": max(100, min(EXACT_UP_TO, EXACT_UP_TO * 16 // buckets)),
            "windows": SAMPLE_WINDOWS,
            "width": SAMPLE_WIDTH,
        }
        conn.execute(sql.NO_JIT)  # a bounded read: compiling its plan would cost more than running it
        return _rows(conn, sql.BUCKET_SET_DEPTHS, params, BucketSetDepth)


def _rows(conn: psycopg.Connection, statement: str, params: dict[str, Any], model: type[BaseModel]) -> list[Any]:
    cursor = conn.execute(statement, params)
    columns = [c.name for c in cursor.description or ()]
    return [model(**dict(zip(columns, row, strict=True))) for row in cursor.fetchall()]


def callback_counts(database: DatabaseSource) -> CallbackCounts:
    """Deprecated: ``status(database).totals``."""
    warnings.warn(
        "callback_counts(db) is deprecated: use cmb_dagster.callbacks.admin.status(db).totals",
        DeprecationWarning,
        stacklevel=2,
    )
    return status(database).totals  # type: ignore[return-value]


def bucket_set_counts(database: DatabaseSource, sets: int) -> list[BucketSetCounts]:
    """Deprecated: ``status(database, bucket_sets=sets, totals=False).bucket_sets``."""
    warnings.warn(
        "bucket_set_counts(db, sets) is deprecated: use "
        "cmb_dagster.callbacks.admin.status(db, bucket_sets=sets, totals=False).bucket_sets",
        DeprecationWarning,
        stacklevel=2,
    )
    return status(database, bucket_sets=sets, totals=False).bucket_sets


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
