"""Operating the stream: consumer lag, retention (trim), dropping a consumer, re-basing after a restore."""

from __future__ import annotations

import psycopg
from psycopg.rows import tuple_row

from cmb_dagster.pubsub import sql as q
from cmb_dagster.pubsub.models import ConsumerSpec, Lag, validated


def consumer_lag(conn: psycopg.Connection, consumer_id: str | None = None, branch_id: int | None = None) -> list[Lag]:
    """Lag of every registered consumer (or of one consumer id, or of one consumer of one branch)."""
    rows = conn.cursor(row_factory=tuple_row).execute(q.LAG, {"consumer_id": consumer_id, "branch_id": branch_id})
    return [
        Lag(consumer_id=c, branch_id=b, delivered=d, handler=h, updated_at=u, events=n, seconds=s)
        for c, b, d, h, u, n, s in rows
    ]


def trim(conn: psycopg.Connection, *, batch_size: int = 10_000) -> int:
    """Delete the events every registered consumer of their branch has delivered; return how many.

    Works in transactions of up to ``batch_size`` events per branch (``conn`` must be idle, not in a
    transaction). Events of a branch that no consumer reads are kept.
    """
    total = 0
    while True:
        with conn.transaction():
            conn.execute(q.LOCK_WATERMARKS_FOR_TRIM)
            deleted = conn.execute(q.TRIM, {"limit": batch_size}).rowcount
        total += deleted
        if deleted < batch_size:
            return total


def drop_consumer(conn: psycopg.Connection, consumer_id: str, branch_id: int) -> bool:
    """Forget a consumer (its watermark), so it no longer holds events back from trim; False if unknown."""
    spec = validated(ConsumerSpec, consumer_id=consumer_id, branch_id=branch_id, handler="unused:unused")
    return conn.execute(q.DROP_CONSUMER, {"consumer_id": spec.consumer_id, "branch_id": spec.branch_id}).rowcount > 0


def reset(conn: psycopg.Connection) -> tuple[int, int]:
    """After pg_dump/pg_restore into another cluster, re-base the stream's txids; return (old, new) shift.

    One transaction: waits for transactions writing events; then, if the stored txids come from
    another cluster, raises the clock's shift so that every txid from now on sorts after every txid
    and snapshot the stream stored. Stored events and watermarks keep their meaning, so every consumer
    resumes exactly where it stopped. Does nothing when nothing needs it; ``conn`` must be idle.
    """
    with conn.transaction():
        for statement in q.RESET_LOCKS:
            conn.execute(statement)
        old, new = conn.execute(q.RESET).fetchone()
    return old, new
