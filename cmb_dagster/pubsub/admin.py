"""Operating the stream: status (consumer lag), retention (trim), dead letters and replay, dropping a
consumer, re-basing after a restore."""

from __future__ import annotations

import asyncio
import getpass
import logging
import socket
import warnings
from collections.abc import Sequence
from datetime import datetime, timedelta

import psycopg
from psycopg.rows import tuple_row

from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.executor import is_coroutine_function
from cmb_dagster.inputs import check_int, check_text, refused_input, shorten
from cmb_dagster.isolation import describe_error, describe_traceback
from cmb_dagster.pubsub import sql
from cmb_dagster.pubsub.engine import lock_watermark, rewound
from cmb_dagster.pubsub.errors import InvalidPubSubInput
from cmb_dagster.pubsub.models import (
    BackfillProgress,
    ConsumerKey,
    DeadLetter,
    Event,
    Handler,
    Lag,
    PubSubStatus,
    Watermark,
    load_handler,
)
from cmb_dagster.pubsub.worker import LEASE_KIND

log = logging.getLogger("cmb_dagster.pubsub")

DEFAULT_RETAIN = timedelta(days=7)


@refused_input(InvalidPubSubInput, "arguments")
def status(db: DatabaseSource, consumer_id: str | None = None, branch_id: int | None = None) -> PubSubStatus:
    """The lag of every registered consumer (or of one consumer id, or of one consumer of one branch)."""
    with Database.of(db).connection() as conn:
        return PubSubStatus(
            consumers=_lags(conn, consumer_id, branch_id),
            backfills=[] if consumer_id is not None else _backfills(conn),
        )


def backfills(db: DatabaseSource, *, include_done: bool = False, limit: int = 100) -> list[BackfillProgress]:
    """The backfills not done yet and those done in the last day (with ``include_done``: all), newest first,
    at most ``limit``."""
    check_int(limit, "limit", low=1, high=10_000, error=InvalidPubSubInput)
    with Database.of(db).connection() as conn:
        return _backfills(conn, include_done=include_done, limit=limit)


def backfill_progress(db: DatabaseSource, backfill_id: int) -> BackfillProgress:
    """The progress of backfill ``backfill_id``."""
    with Database.of(db).connection() as conn:
        found = _backfills(conn, backfill_id=backfill_id, include_done=True)
    if not found:
        raise InvalidPubSubInput(f"backfill_id: no backfill {backfill_id}")
    return found[0]


def _backfills(
    conn: psycopg.Connection, *, include_done: bool = False, limit: int = 100, backfill_id: int | None = None
) -> list[BackfillProgress]:
    params = {"id": backfill_id, "all": include_done, "limit": limit}
    return [
        BackfillProgress(
            id=i,
            table=t,
            branch_id=b,
            topic=tp,
            where=w,
            batch_size=bs,
            key_columns=kc,
            last_key=lk,
            rows_done=rd,
            batches=n,
            rows_skipped=rs,
            last_skip=ls,
            state=st,
            error=e,
            started_at=sa,
            updated_at=ua,
            finished_at=fa,
        )
        for i, t, b, tp, w, bs, kc, lk, rd, n, rs, ls, st, e, sa, ua, fa in conn.cursor(row_factory=tuple_row).execute(
            sql.BACKFILLS, params
        )
    ]


def consumer_lag(conn: psycopg.Connection, consumer_id: str | None = None, branch_id: int | None = None) -> list[Lag]:
    """Deprecated (one release): ``status(db, consumer_id, branch_id).consumers``."""
    warnings.warn(
        "consumer_lag(conn, ...) is deprecated; use status(db, ...).consumers", DeprecationWarning, stacklevel=2
    )
    return _lags(conn, consumer_id, branch_id)


def _lags(conn: psycopg.Connection, consumer_id: str | None, branch_id: int | None) -> list[Lag]:
    params = {**_selection(consumer_id, branch_id), "lease_kind": LEASE_KIND}
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
            topics=tp,
            where=wh,
            last_rewind=rw,
            parked=p,
            unserved_seconds=us,
        )
        for c, b, d, h, u, n, s, fe, a, le, no, tp, wh, rw, p, us in rows
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


@refused_input(InvalidPubSubInput, "arguments")
def dead_letters(
    conn: psycopg.Connection,
    consumer_id: str | None = None,
    branch_id: int | None = None,
    *,
    include_replayed: bool = False,
) -> list[DeadLetter]:
    """The events consumers parked (of one consumer id, or of one consumer of one branch); replayed
    ones too with ``include_replayed``."""
    params = {**_selection(consumer_id, branch_id), "all": include_replayed}
    return [_dead_letter(row) for row in conn.cursor(row_factory=tuple_row).execute(sql.DEAD_LETTERS, params)]


@refused_input(InvalidPubSubInput, "arguments")
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
    its attempts and error updated. An ``async def`` handler runs to its end on an event loop of its own.
    """
    key = ConsumerKey(consumer_id=consumer_id, branch_id=branch_id)
    db = Database.of(database)
    params = {"consumer_id": key.consumer_id, "branch_id": key.branch_id}
    if handler is None:
        handler = registered_handler(db, key.consumer_id, key.branch_id)
    run = load_handler(handler) if isinstance(handler, str) else handler
    ids = None if event_ids is None else [check_int(i, "event_ids", low=1, error=InvalidPubSubInput) for i in event_ids]
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
                    if is_coroutine_function(run):
                        asyncio.run(run(conn, [letter.event]))  # type: ignore[arg-type]
                    else:
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


@refused_input(InvalidPubSubInput, "arguments")
def reset_consumer(
    database: DatabaseSource, consumer_id: str, branch_id: int = 0, *, to: int | datetime, by: str | None = None
) -> Watermark:
    """Rewind a consumer to ``to``, an event id or a time: every event from that point on, in the stream's
    (txid, id) order, is delivered again, in order; return the new watermark.

    A time stands for the first such event created at or after it (so every event created since comes
    again). Events the consumer had not delivered yet are not skipped; its failure count is cleared. The
    rewind locks the consumer's watermark like a batch does: it waits for a running batch and the next
    batch reads from the new point, so a worker holding the consumer's lease needs no stopping. Refused
    (:class:`InvalidPubSubInput`, ``to``) for a point in the future or one whose events trim has deleted.
    The rewind is recorded (``by``, default the OS user and host) and shown by ``pubsub status``.
    """
    key = ConsumerKey(consumer_id=consumer_id, branch_id=branch_id)
    if key.consumer_id.startswith("sensor."):
        raise InvalidPubSubInput(
            f"consumer_id: {key.consumer_id!r} mirrors a Dagster sensor's cursor; reset the sensor's cursor instead"
        )
    if isinstance(to, bool) or not isinstance(to, int | datetime):
        raise InvalidPubSubInput(f"to: an event id or a datetime, not {shorten(to)}")
    if isinstance(to, datetime) and to.tzinfo is None:
        raise InvalidPubSubInput(f"to: {to.isoformat()} has no time zone")
    if isinstance(to, int):
        check_int(to, "to", low=1, error=InvalidPubSubInput)
    who = check_text(by or _operator(), "by", max_length=200, error=InvalidPubSubInput)
    params = {"consumer_id": key.consumer_id, "branch_id": key.branch_id}
    label = f"consumer {key.consumer_id!r} of branch {key.branch_id}"
    with Database.of(database).connection() as conn:
        if conn.execute(sql.WATERMARK_EXISTS, params).fetchone() is None:
            raise InvalidPubSubInput(f"consumer_id: no {label}")
        watermark = lock_watermark(conn, key.consumer_id, key.branch_id)  # waits for a running batch
        now = conn.execute(sql.NOW).fetchone()[0]
        if isinstance(to, datetime):
            if to > now:
                raise InvalidPubSubInput(f"to: {to.isoformat()} is in the future")
            point = conn.execute(sql.REWIND_POINT_BY_TIME, {**params, "at": to}).fetchone()
            if point is None:
                log.info("%s: no event created since %s; nothing to deliver again", label, to.isoformat())
                return watermark
        else:
            point = conn.execute(sql.REWIND_POINT_BY_ID, {**params, "event_id": to}).fetchone()
            if point is None:
                raise InvalidPubSubInput(f"to: no event {to} on branch {key.branch_id} (not written yet, or trimmed)")
        event_id, txid, created_at = point[0], int(point[1]), point[2]
        trimmed = conn.execute(sql.TRIMMED, params).fetchone()
        if trimmed is not None and (
            int(trimmed[0]) >= txid or (isinstance(to, datetime) and trimmed[1] is not None and trimmed[1] >= to)
        ):
            raise InvalidPubSubInput(
                f"to: trim has deleted events of branch {key.branch_id} after that point (up to txid {trimmed[0]}, "
                f"created up to {trimmed[1]:%Y-%m-%d %H:%M:%S%z}); rewind to a later point"
            )
        after = rewound(watermark, txid, event_id)
        description = (
            f"{now:%Y-%m-%d %H:%M:%S%z} by {who}: from after event {watermark.event_id} to event {event_id} "
            f"(txid {txid}, created {created_at:%Y-%m-%d %H:%M:%S%z})"
        )
        conn.execute(
            sql.REWIND_WATERMARK,
            {
                **params,
                "snapshot": after.snapshot,
                "target": after.target,
                "txid": str(after.txid),
                "event_id": after.event_id,
                "description": description,
            },
        )
    log.warning("%s rewound %s", label, description)
    return after


def _selection(consumer_id: object, branch_id: object) -> dict[str, object]:
    """The consumer id and branch a read is narrowed to (each optional), checked."""
    return {
        "consumer_id": None if consumer_id is None else ConsumerKey(consumer_id=consumer_id).consumer_id,
        "branch_id": None if branch_id is None else check_int(branch_id, "branch_id", error=InvalidPubSubInput),
    }


def _operator() -> str:
    """Who runs this: the OS user at the host."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no user name in this environment
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


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
