"""Operating the stream: consumer lag, retention (trim), dead letters and replay, dropping a consumer,
re-basing after a restore."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from datetime import timedelta

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from cmb_dagster.database import Database
from cmb_dagster.pubsub import sql as q
from cmb_dagster.pubsub.errors import InvalidInput
from cmb_dagster.pubsub.models import ConsumerSpec, DeadLetter, Event, Handler, Lag, load_handler, validated

log = logging.getLogger("cmb_dagster.pubsub")

DEFAULT_RETAIN = timedelta(days=7)


def consumer_lag(conn: psycopg.Connection, consumer_id: str | None = None, branch_id: int | None = None) -> list[Lag]:
    """Lag of every registered consumer (or of one consumer id, or of one consumer of one branch)."""
    rows = conn.cursor(row_factory=tuple_row).execute(q.LAG, {"consumer_id": consumer_id, "branch_id": branch_id})
    return [
        Lag(consumer_id=c, branch_id=b, delivered=d, handler=h, updated_at=u, events=n, seconds=s,
            failing_event=fe, attempts=a, last_error=le, notice=no, parked=p)
        for c, b, d, h, u, n, s, fe, a, le, no, p in rows
    ]


def trim(conn: psycopg.Connection, *, batch_size: int = 10_000, retain: timedelta = DEFAULT_RETAIN) -> int:
    """Delete the events older than ``retain`` that every registered consumer of their branch has
    delivered; return how many.

    Works in transactions of up to ``batch_size`` events per branch (``conn`` must be idle, not in a
    transaction). Events of a branch that no consumer reads are kept; so are events younger than
    ``retain`` (default 7 days), for consumers registered later. Deleted events are counted per
    branch, so a consumer that later starts from the beginning is told what it missed.
    """
    if not isinstance(retain, timedelta) or retain < timedelta(0):
        raise InvalidInput(f"retain: must be a timedelta >= 0, not {retain!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 1_000_000:
        raise InvalidInput(f"batch_size: must be an integer from 1 to 1,000,000, not {batch_size!r}")
    total = 0
    while True:
        with conn.transaction():
            conn.execute(q.LOCK_WATERMARKS_FOR_TRIM)
            deleted = conn.execute(q.TRIM, {"limit": batch_size, "retain": retain}).fetchone()[0]
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


def dead_letters(
    conn: psycopg.Connection, consumer_id: str | None = None, branch_id: int | None = None, *, include_replayed: bool = False
) -> list[DeadLetter]:
    """The events consumers parked (of one consumer id, or of one consumer of one branch); replayed
    ones too with ``include_replayed``."""
    params = {"consumer_id": consumer_id, "branch_id": branch_id, "all": include_replayed}
    return [_dead_letter(row) for row in conn.cursor(row_factory=tuple_row).execute(q.DEAD_LETTERS, params)]


def replay(
    database: Database | ConnectionPool | str,
    consumer_id: str,
    branch_id: int = 0,
    handler: Handler | str | None = None,
    *,
    event_ids: Sequence[int] | None = None,
) -> tuple[int, int]:
    """Run the parked events of a consumer (all, or ``event_ids``) through ``handler`` (default: the
    consumer's registered handler) again, one event per transaction, in id order; return (replayed,
    still failing).

    A replayed event is marked in the transaction the handler wrote in: exactly once when its results
    live in this database; concurrent replays take different events. A failing one stays parked with
    its attempts and error updated.
    """
    spec = validated(ConsumerSpec, consumer_id=consumer_id, branch_id=branch_id, handler="unused:unused")
    db = Database.of(database)
    params = {"consumer_id": spec.consumer_id, "branch_id": spec.branch_id}
    if handler is None:
        with db.connection() as conn:
            row = conn.execute(q.REGISTERED_HANDLER, params).fetchone()
        if row is None or row[0] is None:
            raise InvalidInput(f"handler: consumer {consumer_id!r} of branch {branch_id} has no registered handler; pass one")
        handler = row[0]
    run = load_handler(handler) if isinstance(handler, str) else handler
    ids = None if event_ids is None else [int(i) for i in event_ids]
    replayed = failed = 0
    after = 0
    while True:
        error = None
        with db.connection() as conn:
            row = conn.cursor(row_factory=tuple_row).execute(
                q.NEXT_DEAD_LETTER, {**params, "after": after, "event_ids": ids}
            ).fetchone()
            if row is None:
                return replayed, failed
            letter = _dead_letter(row)
            after = letter.event.id
            try:
                with conn.transaction():  # a savepoint: the handler's writes go if it fails
                    run(conn, [letter.event])
                conn.execute(q.DEAD_LETTER_REPLAYED, {**params, "event_id": after})
                replayed += 1
            except Exception as exc:  # noqa: BLE001 - counted and kept parked
                error = exc
                conn.execute(q.DEAD_LETTER_FAILED_AGAIN, {
                    **params, "event_id": after, "error": f"{type(exc).__name__}: {exc}",
                    "traceback": "".join(traceback.format_exception(exc)),
                })
        if error is not None:
            failed += 1
            log.warning("replay of event %s for consumer %s of branch %s failed again: %s: %s",
                        after, consumer_id, branch_id, type(error).__name__, error)


def _dead_letter(row: tuple) -> DeadLetter:
    consumer, branch, event_id, txid, topic, op, key, payload, created_at, error, trace, attempts, first, last, parked, replayed = row
    event = Event(event_id, int(txid), branch, topic, op, key, payload, created_at)
    return DeadLetter(
        consumer_id=consumer, branch_id=branch, event=event, error=error, traceback=trace, attempts=attempts,
        first_failed_at=first, last_failed_at=last, parked_at=parked, replayed_at=replayed,
    )
