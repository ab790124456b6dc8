"""Consuming the stream: watermarks locked for the consumer's transaction, batches read between snapshots
and delivered to the handler, failures narrowed down to the event that causes them."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import psycopg
from psycopg.rows import tuple_row

from cmb_dagster.database import Database
from cmb_dagster.errors import CmbError
from cmb_dagster.executor import Executor, Task, is_coroutine_function
from cmb_dagster.isolation import TimedOut, WorkerStuck, describe_error, describe_traceback
from cmb_dagster.pubsub import sql
from cmb_dagster.pubsub.errors import ConsumerBusy, HandlerFailed, StreamRestored
from cmb_dagster.pubsub.filters import EVENT_VARIABLES, FILTER_ERRORS, check_filter
from cmb_dagster.pubsub.models import ConsumerKey, ConsumerSpec, Event, Handler, Watermark
from cmb_dagster.workers import Lease, Leases

log = logging.getLogger("cmb_dagster.pubsub")

WAIT_STEP = 1.0
"""Seconds between two looks at a handler call that runs (the lease renewed when due, a stuck call found)."""

RESET_HINT = (
    "the database looks restored with pg_dump/pg_restore, so its txids are not this server's; "
    "stop the producers and run `cmb-dagster pubsub reset` once, then start again"
)

Order = Literal["snapshot", "txid"]


def lock_watermark(conn: psycopg.Connection, consumer_id: str, branch_id: int, *, wait: bool = True) -> Watermark:
    """Lock (creating it at zero on first use) the watermark of ``consumer_id`` on ``branch_id`` until
    ``conn``'s transaction ends, and return it.

    Another transaction locking the same watermark waits for this one, or, with ``wait=False``, gets
    :class:`ConsumerBusy` (creating a new watermark still waits for a concurrent creation of the same
    one). Raises :class:`StreamRestored` when the stored txids come from another cluster.
    """
    key = ConsumerKey(consumer_id=consumer_id, branch_id=branch_id)
    params = {"consumer_id": key.consumer_id, "branch_id": key.branch_id}
    query = sql.LOCK_WATERMARK if wait else sql.LOCK_WATERMARK_OR_SKIP
    for _ in range(2):
        row = conn.cursor(row_factory=tuple_row).execute(query, params).fetchone()
        if row is not None:
            break
        if not wait and conn.execute(sql.WATERMARK_EXISTS, params).fetchone():
            raise ConsumerBusy(f"consumer {key.consumer_id!r} of branch {key.branch_id} is busy in another transaction")
        conn.execute(sql.CREATE_WATERMARK, params)
    else:  # pragma: no cover - the row was created and deleted between our two statements
        raise ConsumerBusy(f"consumer {key.consumer_id!r} of branch {key.branch_id} was dropped while locking it")
    return _watermark(row)


def _watermark(row: tuple[Any, ...]) -> Watermark:
    """The watermark a LOCK_WATERMARK row holds; raises :class:`StreamRestored` when its txids are another
    cluster's."""
    consumer, branch, snapshot, target, txid, event_id, delivered, handler, failing, attempts, crashes, problem = row
    if problem:
        raise StreamRestored(f"consumer {consumer!r} of branch {branch}: {problem}; {RESET_HINT}")
    return Watermark(
        consumer_id=consumer,
        branch_id=branch,
        snapshot=snapshot,
        target=target,
        txid=int(txid),
        event_id=event_id,
        delivered=delivered,
        handler=handler,
        failing_event=failing,
        attempts=attempts,
        crashes=crashes,
    )


@dataclass(frozen=True)
class Batch:
    """Events read after a watermark, and the watermark to store once they are handled."""

    events: list[Event]  # those the consumer's filter keeps
    after: Watermark
    changed: bool  # False: nothing new, nothing to store
    scanned: int = 0  # events read past, delivered or filtered out
    raised: tuple[tuple[int, int, str], ...] = ()  # (id, txid, error) of the events the filter raised on


def read_batch(
    conn: psycopg.Connection,
    watermark: Watermark,
    limit: int,
    *,
    order: Order = "snapshot",
    topics: Sequence[str] | None = None,
    where: str | None = None,
    judge_each: bool = False,
) -> Batch:
    """The next ``limit`` events after ``watermark``: those whose transactions the current snapshot shows
    committed and the stored one does not (docs/pubsub.md, "How a batch is read").

    ``order="txid"``: only events of transactions below the oldest one still running, so every
    delivered sequence is in txid order (a transaction left open holds the consumer back). ``topics`` and
    ``where`` (an SQL/JSON path predicate, :mod:`cmb_dagster.pubsub.filters`) filter the events read; the
    watermark moves past those filtered out. The filtered read raises one of ``FILTER_ERRORS`` when the filter
    raised on one of the events; ``judge_each`` reads them judging each apart, and returns those it raised on in
    ``raised`` (read past, not delivered).
    """
    params = {
        "branch_id": watermark.branch_id,
        "snapshot": watermark.snapshot,
        "target": watermark.target,
        "strict": order == "txid",
        "limit": limit + 1,
        # the position counts within a half-delivered difference only; a new one starts at its beginning
        "txid": str(watermark.txid) if watermark.target else "0",
        "event_id": watermark.event_id if watermark.target else 0,
        "topics": None if topics is None else list(topics),
        "filter": where,
    }
    raised: tuple[tuple[int, int, str], ...] = ()
    if topics is None and where is None:
        target, found = conn.execute(sql.READ_BATCH, params, prepare=True).fetchone()
        rows = json.loads(found) if found else []
        scanned, rows = len(rows), rows[:limit]
        last = (rows[-1][1], rows[-1][0]) if rows else None
    else:
        if judge_each:
            target, found, scanned, last, errors = conn.execute(sql.READ_JUDGED_BATCH, params).fetchone()
            raised = tuple((event_id, int(txid), error) for event_id, txid, error in json.loads(errors or "[]"))
        else:
            target, found, scanned, last = conn.execute(sql.READ_FILTERED_BATCH, params, prepare=True).fetchone()
        rows = json.loads(found) if found else []
        last = json.loads(last) if last else None
    if target is None:  # order="txid" and no transaction ended beyond the stored snapshot
        return Batch(events=[], after=watermark, changed=False)
    events = [Event(r[0], r[1], r[2], r[3], r[4], r[5], r[6], datetime.fromisoformat(r[7])) for r in rows]
    more = scanned > limit
    last_txid, last_id = last or (watermark.txid, watermark.event_id)
    after = watermark.model_copy(
        update={
            "snapshot": watermark.snapshot if more else target,
            "target": target if more else None,
            "txid": int(last_txid),
            "event_id": last_id,
            "delivered": watermark.delivered + len(events),
            "failing_event": None,
            "attempts": 0,
            "crashes": 0,
        }
    )
    passed = min(scanned, limit)
    changed = bool(passed) or watermark.target is not None
    return Batch(events=events, after=after, changed=changed, scanned=passed, raised=raised)


def snapshot_before(snapshot: str, txid: int) -> str:
    """``snapshot`` (``'xmin:xmax:xip,...'``) restricted to txids below ``txid``: it shows committed exactly the
    txids that ``snapshot`` shows committed and that are below ``txid``."""
    _, xmax, running = snapshot.split(":")
    if txid >= int(xmax):
        return snapshot
    kept = [x for x in running.split(",") if x and int(x) < txid]
    return f"{kept[0] if kept else txid}:{txid}:{','.join(kept)}"


def rewound(watermark: Watermark, txid: int, event_id: int) -> Watermark:
    """``watermark`` moved back so that it has delivered exactly the events it had delivered that come before
    event ``event_id`` of transaction ``txid`` in (txid, id) order: those after it are delivered again, and
    nothing it had not delivered is skipped.

    The events delivered at or after the point are delivered again as the difference between the restricted
    snapshot and the old one (``target``), from the position just before the point; a half-delivered
    difference keeps its target and the earlier of the two positions."""
    before = snapshot_before(watermark.snapshot, txid)
    position = (txid, event_id - 1)
    if watermark.target is not None:
        target, position = watermark.target, min(position, (watermark.txid, watermark.event_id))
    elif before != watermark.snapshot:
        target = watermark.snapshot
    else:  # nothing at or after the point was delivered
        return watermark
    return watermark.model_copy(
        update={"snapshot": before, "target": target, "txid": position[0], "event_id": position[1]}
    )


def refuse_if_restored(conn: psycopg.Connection, watermark: Watermark) -> None:
    """Raise :class:`StreamRestored` if ``watermark``'s txids come from another cluster."""
    problem = conn.execute(sql.RESTORE_PROBLEM, {"snapshot": watermark.target or watermark.snapshot}).fetchone()[0]
    if problem:
        raise StreamRestored(
            f"consumer {watermark.consumer_id!r} of branch {watermark.branch_id}: {problem}; {RESET_HINT}"
        )


def record_watermark(conn: psycopg.Connection, watermark: Watermark) -> None:
    """Store ``watermark`` as is (creating the row): a Dagster sensor mirrors the cursor it keeps, so
    that trim keeps the events it has not read."""
    conn.execute(
        sql.RECORD_WATERMARK,
        {
            "consumer_id": watermark.consumer_id,
            "branch_id": watermark.branch_id,
            "snapshot": watermark.snapshot,
            "target": watermark.target,
            "txid": str(watermark.txid),
            "event_id": watermark.event_id,
            "delivered": watermark.delivered,
        },
    )


def save_watermark(conn: psycopg.Connection, before: Watermark, after: Watermark) -> None:
    """Store ``after`` as the watermark (in the transaction that locked ``before``)."""
    conn.execute(
        sql.SAVE_WATERMARK,
        {
            "consumer_id": after.consumer_id,
            "branch_id": after.branch_id,
            "snapshot": after.snapshot,
            "target": after.target,
            "txid": str(after.txid),
            "event_id": after.event_id,
            "count": after.delivered - before.delivered,
        },
    )


class Delivery:
    """Delivers the batches of one consumer (``spec``) to ``handler``, one :meth:`batch` at a time.

    A failed batch is delivered again in halves until the failing event is alone; a single event's failures
    are counted in its watermark and, past ``max_attempts``, it is parked (``on_poison="park"``). After a
    takeover from a worker that died, the next events go one at a time, each start counted first (careful
    mode). The handler runs on an :class:`~cmb_dagster.executor.Executor` of one slot (``async def`` handlers on
    its event loop); a batch waits until its call has ended, also past the deadline, so the next batch of the
    partition never starts beside it. ``keep_alive`` is called while the handler runs (the worker renews its lease
    there).
    """

    def __init__(
        self, db: Database, spec: ConsumerSpec, handler: Handler, *, keep_alive: Callable[[], None] = lambda: None
    ) -> None:
        self.db = db
        self.spec = spec
        self.handler = handler
        self.keep_alive = keep_alive
        self.executor = self._new_executor()
        self._registered = False
        self._judge_each = False  # the filter raised on the next batch: judge its events one by one
        self._retry_limit = 0  # after a failed batch: the size of the next ones, halved at each failure
        self._retry_left = 0  # events of the failed batch not delivered since
        self._careful = 0  # after a takeover from a dead worker: events to deliver alone, each start counted first
        self._inherited_fence: int | None = None
        self._ended_by_server: psycopg.Connection | None = None  # terminated at a handler's deadline
        self._conn: psycopg.Connection | None = None  # kept across batches (a pool's checkout costs a round trip)

    def _new_executor(self) -> Executor:
        return Executor(f"pubsub:{self.partition}", concurrency=1)  # a partition's order: one call at a time

    @property
    def partition(self) -> str:
        """The consumer's partition in the worker runtime's leases."""
        return f"{self.spec.consumer_id}@{self.spec.branch_id}"

    @property
    def label(self) -> str:
        return f"consumer {self.spec.consumer_id!r} of branch {self.spec.branch_id}"

    # -- registering, connections -----------------------------------------------------------------

    def register(self) -> Watermark:
        """Register the consumer (watermark where ``start`` says, handler path) and return its watermark;
        raises :class:`StreamRestored` after a restore, :class:`InvalidPubSubInput` for a filter Postgres refuses.
        Waits while another transaction holds the watermark."""
        spec, path = self.spec, self.spec.handler_path
        with self.db.connection() as conn:
            if not self._registered:
                check_filter(conn, spec.where, field="where", variables=EVENT_VARIABLES)
                params = {"consumer_id": spec.consumer_id, "branch_id": spec.branch_id}
                reads = {"topics": None if spec.topics is None else list(spec.topics), "filter": spec.where}
                created = conn.execute(
                    sql.START_CONSUMER, {**params, **reads, "handler": path, "start": spec.start}
                ).fetchone()
                if created is not None and created[0]:
                    log.warning("consumer %s of branch %s: %s", spec.consumer_id, spec.branch_id, created[0])
                if created is None:
                    registered = conn.execute(sql.REGISTRATION, params).fetchone()
                    wanted = (path or (registered and registered[0]), reads["topics"], reads["filter"])
                    if registered is None or tuple(registered) != wanted:
                        conn.execute(sql.REGISTER_CONSUMER, {**params, **reads, "handler": path})
            self._registered = True
            return lock_watermark(conn, spec.consumer_id, spec.branch_id)

    def close(self) -> None:
        """Close the connection kept between batches and stop the event loop of ``async def`` handlers (the next
        batch opens them again)."""
        self._close_connection()
        self.executor.close()
        self.executor = self._new_executor()

    def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    @property
    def idle_limit(self) -> float:
        """Seconds a transaction of the consumer may stay idle before the server ends it: the handler's time
        limit (it runs inside the transaction) plus the lease's TTL.

        A consumer stopped (SIGSTOP, a long pause) inside its transaction holds its watermark locked and its
        lease key-share-locked (see :meth:`Leases.check`): the server then ends the transaction within this
        bound, and another consumer takes over."""
        return self.spec.handler_timeout + self.spec.lease_ttl

    def _bound_idle_time(self, conn: psycopg.Connection, *, local: bool) -> None:
        """Have the server end ``conn``'s transactions left idle past :attr:`idle_limit` (``local``: only the
        current transaction's, on a connection of the caller's pool)."""
        limit = f"{int(self.idle_limit * 1000)}ms"
        conn.execute("SELECT set_config('idle_in_transaction_session_timeout', %s, %s)", (limit, local))

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction on the consumer's own connection (committed on success), or, for a pool the
        caller passed, on a connection borrowed from it; either way one the server ends once left idle past
        :attr:`idle_limit` (set for the transaction alone on a pool of yours or through a pooler)."""
        if self.db.uses_your_pool:
            with self.db.connection() as conn:
                self._bound_idle_time(conn, local=True)
                try:
                    yield conn
                finally:
                    if conn is self._ended_by_server:  # closed: the pool neither commits nor keeps it
                        self._drop_ended(conn)
            return
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self._close_connection()
            conn = self._conn = self.db.connect(autocommit=True)
            if not self.db.pooled:  # through a pooler, a session setting would stay on a shared server connection
                self._bound_idle_time(conn, local=False)
            conn.autocommit = False
        if self.db.pooled:
            self._bound_idle_time(conn, local=True)
        try:
            yield conn
        except BaseException:
            if conn is self._ended_by_server:
                self._drop_ended(conn)
            else:
                try:
                    conn.rollback()
                except psycopg.Error:
                    self._close_connection()
            raise
        if conn is self._ended_by_server:  # its call ran past the deadline: the server ended its transaction
            self._drop_ended(conn)
            return
        try:
            conn.commit()
        except psycopg.Error:
            self._close_connection()
            raise

    def _drop_ended(self, conn: psycopg.Connection) -> None:
        """Close a connection whose transaction the server ended at a handler's deadline, once no call uses it (a
        call still running, on a stuck worker, keeps it: closing it under its thread is unsafe)."""
        if not self.executor.running:
            self._ended_by_server = None
            conn.close()

    @contextmanager
    def _locked(self, lease: Lease | None) -> Iterator[tuple[psycopg.Connection, Watermark]]:
        """A transaction that checked ``lease`` (if any) and holds the consumer's watermark locked."""
        with self._transaction() as conn:
            if lease is None:
                yield conn, lock_watermark(conn, self.spec.consumer_id, self.spec.branch_id, wait=self.spec.wait)
                return
            spec = self.spec
            params = {"consumer_id": spec.consumer_id, "branch_id": spec.branch_id}
            # The lease check travels with the watermark's lock, one round trip, and a Sync with them: once they
            # ran, the transaction is idle, so the server ends it if this process stops (SIGSTOP) meanwhile
            # (idle_in_transaction_session_timeout); before a Sync it would wait for the process forever.
            with conn.pipeline() as pipeline:
                held = Leases.check_many(conn, [lease])
                locking = conn.cursor(row_factory=tuple_row).execute(
                    sql.LOCK_WATERMARK if spec.wait else sql.LOCK_WATERMARK_OR_SKIP, params
                )
                pipeline.sync()
                row = locking.fetchone()
            held()
            if row is None:  # dropped meanwhile, or busy: as a batch without a lease finds it
                yield conn, lock_watermark(conn, spec.consumer_id, spec.branch_id, wait=spec.wait)
                return
            yield conn, _watermark(row)

    # -- delivering -------------------------------------------------------------------------------

    def batch(self, lease: Lease | None) -> int:
        """Deliver one batch (under ``lease``, if given); return how many events it settled (0: nothing new).

        When the filter raises on an event of the batch, the batch is read again judging each event apart: the
        events it raised on are parked (by name, with the error) and the others go on."""
        try:
            return self._batch(lease)
        except FILTER_ERRORS as exc:
            if self.spec.where is None:
                raise
            log.warning(
                "%s: the filter raised on an event of the next batch (%s); judging its events one by one",
                self.label,
                describe_error(exc),
            )
            self._judge_each = True
            try:
                return self._batch(lease)
            finally:
                self._judge_each = False

    def _batch(self, lease: Lease | None) -> int:
        if not self._registered:
            self.register()
        if lease is not None and lease.inherited and lease.fence != self._inherited_fence:
            self._inherited_fence = lease.fence
            self._careful = self.spec.batch_size  # as many as the dead worker may have had in flight
            log.warning(
                "%s: taken over from a worker that died; the next events are delivered one at a time", self.label
            )
        if self._careful:
            parked = self._record_start(lease)
            if parked is not None:
                return parked
        failure: BaseException | None = None
        with self._locked(lease) as (conn, before):
            batch = self._read(conn, before, self._retry_limit or self.spec.batch_size)
            if batch.events:
                if lease is not None:
                    lease.require()
                try:
                    self._call_handler(conn, batch.events)
                except WorkerStuck:
                    raise
                except Exception as exc:  # noqa: BLE001 - recorded below, after this transaction rolls back
                    failure = exc
                    if conn is not self._ended_by_server:
                        conn.rollback()
            if failure is None and batch.changed:
                save_watermark(conn, before, batch.after)
        if failure is not None:
            return self._failed(lease, before, batch, failure)
        self._settled(batch.scanned)
        return batch.scanned

    def _read(self, conn: psycopg.Connection, watermark: Watermark, limit: int) -> Batch:
        """The next batch; the events the filter raised on (when judging each) are parked in its transaction."""
        spec = self.spec
        batch = read_batch(
            conn, watermark, limit, order=spec.order, topics=spec.topics, where=spec.where, judge_each=self._judge_each
        )
        for event_id, txid, error in batch.raised:
            conn.execute(
                sql.PARK_EVENT,
                {
                    "consumer_id": spec.consumer_id,
                    "branch_id": spec.branch_id,
                    "event_id": event_id,
                    "txid": str(txid),
                    "error": f"the consumer's filter raised on this event: {error}",
                    "traceback": "",
                    "attempts": 1,
                    "first_failed_at": datetime.now(UTC),
                },
            )
            log.warning("%s: parked event %s: the filter raised on it (%s)", self.label, event_id, error)
        return batch

    def _call_handler(self, conn: psycopg.Connection, events: list[Event]) -> None:
        """The handler on ``events``, on the executor; returns once the call has ended. Past ``handler_timeout``
        the server ends the transaction (an ``async def`` handler is also cancelled) and :class:`TimedOut` is
        raised once the call has ended; raises :class:`WorkerStuck` when it runs on past twice its limit."""
        backend = self.db.backend_pid(conn)
        handler, timeout = self.handler, self.spec.handler_timeout
        call: Callable[[_HandlerCall], Any]
        if is_coroutine_function(handler):

            async def call(batch: _HandlerCall) -> None:
                await handler(conn, batch.events)  # type: ignore[misc]
        else:

            def call(batch: _HandlerCall) -> None:
                handler(conn, batch.events)

        label = f"events {events[0].id}..{events[-1].id} of {self.label}"
        task = self.executor.start(_HandlerCall(events, label), call, timeout)
        while not task.ended:
            self.executor.wait(_next_look(task))
            self.executor.ended()
            if not task.ended and task.seconds >= timeout and self._ended_by_server is not conn:
                self._end_transaction(conn, backend)
            self.keep_alive()
            self.executor.check()
        if self._ended_by_server is conn or task.timed_out:
            raise TimedOut(f"timed out after {timeout:g} s (the call ran {task.seconds:.1f} s; its writes rolled back)")
        task.outcome  # noqa: B018 - raises the call's error

    def _end_transaction(self, conn: psycopg.Connection, backend: int) -> None:
        """Have the server end the transaction of a handler call past its deadline (its writes are rolled back); if
        the server cannot be asked now, the next look at the call asks again."""
        try:
            with self.db.connection() as other:
                other.execute("SELECT pg_terminate_backend(%s)", (backend,))
        except (psycopg.Error, CmbError) as exc:
            log.warning("%s: could not end the transaction of a handler past its limit (%s); retrying", self.label, exc)
            return
        self._ended_by_server, self._conn = conn, None
        log.error(
            "%s: the handler ran past its %g s limit; its transaction is ended, the partition waits for the call "
            "to end",
            self.label,
            self.spec.handler_timeout,
        )

    def _settled(self, count: int) -> None:
        """``count`` more events were delivered or parked: after a failed batch, full batches again once all of
        its events were."""
        if self._retry_limit:
            self._retry_left -= count
            if self._retry_left <= 0:
                self._retry_limit = 0

    def _park(
        self,
        conn: psycopg.Connection,
        before: Watermark,
        batch: Batch,
        *,
        error: str,
        traceback: str,
        attempts: int,
        first_failed_at: datetime,
    ) -> None:
        """Move the batch's single event to the dead letters and the watermark past it."""
        event = batch.events[0]
        conn.execute(
            sql.PARK_EVENT,
            {
                "consumer_id": self.spec.consumer_id,
                "branch_id": self.spec.branch_id,
                "event_id": event.id,
                "txid": str(event.txid),
                "error": error,
                "traceback": traceback,
                "attempts": attempts,
                "first_failed_at": first_failed_at,
            },
        )
        save_watermark(conn, before, batch.after.model_copy(update={"delivered": before.delivered}))

    def _record_start(self, lease: Lease | None) -> int | None:
        """In careful mode: count the next event's delivery as started (committed), or park it if its deliveries
        already killed ``max_crashes`` workers (then return 1); None when the next event is to be delivered now."""
        with self._locked(lease) as (conn, before):
            batch = self._read(conn, before, 1)
            if not batch.events:
                if batch.scanned:  # filtered out: passed without a delivery
                    save_watermark(conn, before, batch.after)
                    return batch.scanned
                self._careful = 0
                return None
            event = batch.events[0]
            crashes = before.crashes if before.failing_event == event.id else 0
            if crashes < self.spec.max_crashes:
                conn.execute(
                    sql.RECORD_START,
                    {"consumer_id": self.spec.consumer_id, "branch_id": self.spec.branch_id, "event_id": event.id},
                )
                self._careful -= 1
                self._retry_limit, self._retry_left = 1, max(self._retry_left, 1)
                return None
            error = f"{crashes} deliveries in a row ended with the death of their worker (a crash, kill -9 or OOM)"
            if self.spec.on_poison == "stop":
                raise HandlerFailed(f"{self.label}: stopped on event {event.id}: {error}")
            self._park(
                conn,
                before,
                batch,
                error=error,
                traceback="",
                attempts=before.attempts,
                first_failed_at=datetime.now(UTC),
            )
        self._careful -= 1
        log.error("%s: parked event %s: %s", self.label, event.id, error)
        return 1

    def _failed(self, lease: Lease | None, before: Watermark, batch: Batch, exc: BaseException) -> int:
        """After the handler raised on ``batch`` (rolled back): narrow a batch down to halves; for a single
        event, count the attempt and park the event once it has failed ``max_attempts`` times
        (``on_poison="park"``: then return 1). Raises :class:`HandlerFailed` otherwise."""
        events = batch.events
        error = describe_error(exc)
        if len(events) > 1:
            if not self._retry_limit:
                self._retry_left = len(events)
            self._retry_limit = max(1, len(events) // 2)
            raise HandlerFailed(
                f"{self.label}: handler failed on a batch of {len(events)} events (ids {events[0].id}..{events[-1].id})"
                f": {error}; retrying them in batches of {self._retry_limit}"
            ) from exc
        event = events[0]
        unchanged = {"failing_event", "attempts"}
        with self._locked(lease) as (conn, now):
            if now.model_dump(exclude=unchanged) != before.model_dump(exclude=unchanged):  # moved meanwhile
                raise HandlerFailed(f"{self.label}: handler failed on event {event.id}: {error}") from exc
            attempts, first_failed_at = conn.execute(
                sql.RECORD_FAILURE,
                {
                    "consumer_id": self.spec.consumer_id,
                    "branch_id": self.spec.branch_id,
                    "event_id": event.id,
                    "error": error,
                },
            ).fetchone()
            if attempts >= self.spec.max_attempts and self.spec.on_poison == "park":
                self._park(
                    conn,
                    before,
                    batch,
                    error=error,
                    traceback=describe_traceback(exc),
                    attempts=attempts,
                    first_failed_at=first_failed_at,
                )
                log.warning(
                    "%s: parked event %s after %s failed attempts (%s); `cmb-dagster pubsub dead` lists it, "
                    "`cmb-dagster pubsub replay` runs it again",
                    self.label,
                    event.id,
                    attempts,
                    error,
                )
                self._settled(1)
                return 1
        if attempts >= self.spec.max_attempts:
            log.error(
                "%s: stuck on event %s after %s failed attempts (on_poison='stop'): %s",
                self.label,
                event.id,
                attempts,
                error,
            )
        raise HandlerFailed(
            f"{self.label}: handler failed on event {event.id} (attempt {attempts} of {self.spec.max_attempts}"
            f"{', on_poison=stop' if self.spec.on_poison == 'stop' else ''}): {error}"
        ) from exc


@dataclass(frozen=True)
class _HandlerCall:
    """The events of one call of the handler, and how logs name them."""

    events: list[Event]
    label: str


def _next_look(task: Task[Any]) -> float:
    """Seconds until the next look at a running call: :data:`WAIT_STEP`, or less to act at its deadline."""
    remaining = task.timeout - task.seconds
    return min(WAIT_STEP, remaining) if remaining > 0 else WAIT_STEP
