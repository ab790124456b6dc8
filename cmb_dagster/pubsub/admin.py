"""Operating the stream: status (consumer lag), retention (trim), dead letters and replay, dropping a
consumer, re-basing after a restore."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from datetime import timedelta

import psycopg
from psycopg.rows import tuple_row

from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.inputs import check_int
from cmb_dagster.isolation import describe_error, describe_traceback
from cmb_dagster.pubsub import sql
from cmb_dagster.pubsub.errors import InvalidPubSubInput
from cmb_dagster.pubsub.models import ConsumerKey, DeadLetter, Event, Handler, Lag, PubSubStatus, load_handler
from cmb_dagster.pubsub.worker import LEASE_KIND

log = logging.getLogger("cmb_dagster.pubsub")

DEFAULT_RETAIN = timedelta(days=7)


def status(db: DatabaseSource, consumer_id: str | None = None, branch_id: int | None = None) -> PubSubStatus:
    """The lag of every registered consumer (or of one consumer id, or of one consumer of one branch)."""
    with Database.of(db).connection() as conn:
        return PubSubStatus(consumers=_lags(conn, consumer_id, branch_id))


def consumer_lag(conn: psycopg.Connection, consumer_id: str | None = None, branch_id: int | None = None) -> list[Lag]:
    """Deprecated (one release): ``status(db, consumer_id, branch_id).consumers``."""
    warnings.warn(
        "consumer_lag(conn, ...) is deprecated; use status(db, ...).consumers", DeprecationWarning, stacklevel=2
    )
    return _lags(conn, consumer_id, branch_id)


def _lags(conn: psycopg.Connection, consumer_id: str | None, branch_id: int | None) -> list[Lag]:
    params = {"consumer_id": consumer_id, "branch_id": branch_id, "lease_kind": LEASE_KIND}
    rows = conn.cursor(row_factory=tuple_row).execute(sql.LAG, params)
    return [
        Lag(
            consumer_id=c,
            branch_id=b,
            delivered=d,
            handler=h,
            updated_at=u,
            events=n,
            seconds=s,
            failing_event=fe,
            attempts=a,
            last_error=le,
            notice=no,
            parked=p,
            unserved_seconds=us,
        )
        for c, b, d, h, u, n, s, fe, a, le, no, p, us in rows
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
        raise InvalidPubSubInput(f"retain: must be a timedelta >= 0, not {retain!r}")
    check_int(batch_size, "batch_size", low=1, high=1_000_000, error=InvalidPubSubInput)
    total = 0
    while True:
        with conn.transaction():
            conn.execute(sql.LOCK_WATERMARKS_FOR_TRIM)
            deleted = conn.execute(sql.TRIM, {"limit": batch_size, "retain": retain}).fetchone()[0]
        total += deleted
        if deleted < batch_size:
            return total


def drop_consumer(conn: psycopg.Connection, consumer_id: str, branch_id: int) -> bool:
    """Forget a consumer (its watermark), so it no longer holds events back from trim; False if unknown."""
    key = ConsumerKey(consumer_id=consumer_id, branch_id=branch_id)
    return conn.execute(sql.DROP_CONSUMER, {"consumer_id": key.consumer_id, "branch_id": key.branch_id}).rowcount > 0


def reset(conn: psycopg.Connection) -> tuple[int, int]:
    """After pg_dump/pg_restore into another cluster, re-base the stream's txids; return (old, new) shift.

    One transaction: waits for transactions writing events; then, if the stored txids come from
    another cluster, raises the clock's shift so that every txid from now on sorts after every txid
    and snapshot the stream stored. Stored events and watermarks keep their meaning, so every consumer
    resumes exactly where it stopped. Does nothing when nothing needs it; ``conn`` must be idle.
    """
    with conn.transaction():
        for statement in sql.RESET_LOCKS:
            conn.execute(statement)
        old, new = conn.execute(sql.RESET).fetchone()
    return old, new


def dead_letters(
    conn: psycopg.Connection,
    consumer_id: str | None = None,
    branch_id: int | None = None,
    *,
    include_replayed: bool = False,
) -> list[DeadLetter]:
    """The events consumers parked (of one consumer id, or of one consumer of one branch); replayed
    ones too with ``include_replayed``."""
    params = {"consumer_id": consumer_id, "branch_id": branch_id, "all": include_replayed}
    return [_dead_letter(row) for row in conn.cursor(row_factory=tuple_row).execute(sql.DEAD_LETTERS, params)]


def replay(
    database: DatabaseSource,
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
    key = ConsumerKey(consumer_id=consumer_id, branch_id=branch_id)
    db = Database.of(database)
    params = {"consumer_id": key.consumer_id, "branch_id": key.branch_id}
    if handler is None:
        handler = registered_handler(db, key.consumer_id, key.branch_id)
    run = load_handler(handler) if isinstance(handler, str) else handler
    ids = None if event_ids is None else [int(i) for i in event_ids]
    replayed = failed = 0
    after = 0
    while True:
        error: str | None = None
        with db.connection() as conn:
            row = (
                conn.cursor(row_factory=tuple_row)
                .execute(sql.NEXT_DEAD_LETTER, {**params, "after": after, "event_ids": ids})
                .fetchone()
            )
            if row is None:
                return replayed, failed
            letter = _dead_letter(row)
            after = letter.event.id
            try:
                with conn.transaction():  # a savepoint: the handler's writes go if it fails
                    run(conn, [letter.event])
                conn.execute(sql.DEAD_LETTER_REPLAYED, {**params, "event_id": after})
                replayed += 1
            except Exception as exc:  # noqa: BLE001 - counted and kept parked
                error = describe_error(exc)
                conn.execute(
                    sql.DEAD_LETTER_FAILED_AGAIN,
                    {
                        **params,
                        "event_id": after,
                        "error": error,
                        "traceback": describe_traceback(exc),
                    },
                )
        if error is not None:
            failed += 1
            log.warning(
                "replay of event %s for consumer %s of branch %s failed again: %s", after, consumer_id, branch_id, error
            )


def registered_handler(db: DatabaseSource, consumer_id: str, branch_id: int) -> str:
    """The handler path the consumer registered; InvalidPubSubInput if it has none."""
    with Database.of(db).connection() as conn:
        row = conn.execute(sql.REGISTERED_HANDLER, {"consumer_id": consumer_id, "branch_id": branch_id}).fetchone()
    if row is None or row[0] is None:
        raise InvalidPubSubInput(
            f"handler: consumer {consumer_id!r} of branch {branch_id} has no registered handler; "
            "pass one as 'module:function' (--handler in the CLI)"
        )
    return row[0]


def _dead_letter(row: tuple) -> DeadLetter:
    (
        consumer,
        branch,
        event_id,
        txid,
        topic,
        op,
        key,
        payload,
        created_at,
        error,
        trace,
        attempts,
        first,
        last,
        parked,
        replayed,
    ) = row
    event = Event(event_id, int(txid), branch, topic, op, key, payload, created_at)
    return DeadLetter(
        consumer_id=consumer,
        branch_id=branch,
        event=event,
        error=error,
        traceback=trace,
        attempts=attempts,
        first_failed_at=first,
        last_failed_at=last,
        parked_at=parked,
        replayed_at=replayed,
    )
