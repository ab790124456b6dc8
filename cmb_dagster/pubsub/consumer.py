"""Consuming the stream: watermarks locked for the consumer's transaction, batches read between snapshots."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import psycopg
from psycopg.rows import tuple_row

from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.isolation import DEFAULT_MAX_CRASHES, UserCode, describe_error, describe_traceback
from cmb_dagster.notifications import Listener, channel_name
from cmb_dagster.pubsub import sql as q
from cmb_dagster.pubsub.errors import ConsumerBusy, HandlerFailed, StreamRestored
from cmb_dagster.pubsub.models import (
    ConsumerSpec,
    Event,
    Handler,
    Watermark,
    handler_path,
    load_handler,
    validated,
)
from cmb_dagster.workers import Lease, Leases, Worker, WorkerReport

log = logging.getLogger("cmb_dagster.pubsub")

LEASE_KIND = "pubsub.consumer"
HINT_CHANNEL = "pubsub"  # producers NOTIFY '<schema>.pubsub' on commit (migration 0008's trigger)

RESET_HINT = (
    "the database looks restored with pg_dump/pg_restore, so its txids are not this server's; "
    "stop the producers and run `cmb-dagster pubsub reset` once, then start again"
)


def lock_watermark(conn: psycopg.Connection, consumer_id: str, branch_id: int, *, wait: bool = True) -> Watermark:
    """Lock (creating it at zero on first use) the watermark of ``consumer_id`` on ``branch_id`` until
    ``conn``'s transaction ends, and return it.

    Another transaction locking the same watermark waits for this one, or, with ``wait=False``, gets
    :class:`ConsumerBusy` (creating a new watermark still waits for a concurrent creation of the same
    one). Raises :class:`StreamRestored` when the stored txids come from another cluster.
    """
    spec = validated(ConsumerSpec, consumer_id=consumer_id, branch_id=branch_id, handler="unused:unused")
    params = {"consumer_id": spec.consumer_id, "branch_id": spec.branch_id}
    query = q.LOCK_WATERMARK if wait else q.LOCK_WATERMARK_OR_SKIP
    for _ in range(2):
        row = conn.cursor(row_factory=tuple_row).execute(query, params).fetchone()
        if row is not None:
            break
        if not wait and conn.execute(q.WATERMARK_EXISTS, params).fetchone():
            raise ConsumerBusy(f"consumer {spec.consumer_id!r} of branch {spec.branch_id} is busy in another transaction")
        conn.execute(q.CREATE_WATERMARK, params)
    else:  # pragma: no cover - the row was created and deleted between our two statements
        raise ConsumerBusy(f"consumer {spec.consumer_id!r} of branch {spec.branch_id} was dropped while locking it")
    consumer, branch, snapshot, target, txid, event_id, delivered, handler, failing, attempts, crashes, problem = row
    if problem:
        raise StreamRestored(f"consumer {consumer!r} of branch {branch}: {problem}; {RESET_HINT}")
    return Watermark(
        consumer_id=consumer, branch_id=branch, snapshot=snapshot, target=target,
        txid=int(txid), event_id=event_id, delivered=delivered, handler=handler,
        failing_event=failing, attempts=attempts, crashes=crashes,
    )


@dataclass(frozen=True)
class Batch:
    """Events read after a watermark, and the watermark to store once they are handled."""

    events: list[Event]
    after: Watermark
    changed: bool  # False: nothing new, nothing to store


Order = Literal["snapshot", "txid"]


def read_batch(conn: psycopg.Connection, watermark: Watermark, limit: int, *, order: Order = "snapshot") -> Batch:
    """The next ``limit`` events after ``watermark`` (a consistent cut; see the package docstring).

    ``order="txid"``: only events of transactions below the oldest one still running, so every
    delivered sequence is in txid order (a transaction left open holds the consumer back).
    """
    params = {
        "branch_id": watermark.branch_id, "snapshot": watermark.snapshot, "target": watermark.target,
        "strict": order == "txid", "limit": limit + 1,
        # the position counts within a half-delivered difference only; a new one starts at its beginning
        "txid": str(watermark.txid) if watermark.target else "0", "event_id": watermark.event_id if watermark.target else 0,
    }
    target, found = conn.execute(q.READ_BATCH, params, prepare=True).fetchone()
    if target is None:  # order="txid" and no transaction ended beyond the stored snapshot
        return Batch(events=[], after=watermark, changed=False)
    rows = json.loads(found) if found else []
    events = [Event(r[0], r[1], r[2], r[3], r[4], r[5], r[6], datetime.fromisoformat(r[7])) for r in rows[:limit]]
    more = len(rows) > limit
    last = events[-1] if events else None
    after = watermark.model_copy(
        update={
            "snapshot": watermark.snapshot if more else target,
            "target": target if more else None,
            "txid": last.txid if last else watermark.txid,
            "event_id": last.id if last else watermark.event_id,
            "delivered": watermark.delivered + len(events),
            "failing_event": None,
            "attempts": 0,
            "crashes": 0,
        }
    )
    return Batch(events=events, after=after, changed=bool(events) or watermark.target is not None)


def refuse_if_restored(conn: psycopg.Connection, watermark: Watermark) -> None:
    """Raise :class:`StreamRestored` if ``watermark``'s txids come from another cluster."""
    problem = conn.execute(q.RESTORE_PROBLEM, {"snapshot": watermark.target or watermark.snapshot}).fetchone()[0]
    if problem:
        raise StreamRestored(f"consumer {watermark.consumer_id!r} of branch {watermark.branch_id}: {problem}; {RESET_HINT}")


def record_watermark(conn: psycopg.Connection, watermark: Watermark) -> None:
    """Store ``watermark`` as is (creating the row): a Dagster sensor mirrors the cursor it keeps, so
    that trim keeps the events it has not read."""
    conn.execute(q.RECORD_WATERMARK, {
        "consumer_id": watermark.consumer_id, "branch_id": watermark.branch_id, "snapshot": watermark.snapshot,
        "target": watermark.target, "txid": str(watermark.txid), "event_id": watermark.event_id,
        "delivered": watermark.delivered,
    })


def save_watermark(conn: psycopg.Connection, before: Watermark, after: Watermark) -> None:
    """Store ``after`` as the watermark (in the transaction that locked ``before``)."""
    conn.execute(
        q.SAVE_WATERMARK,
        {
            "consumer_id": after.consumer_id, "branch_id": after.branch_id, "snapshot": after.snapshot,
            "target": after.target, "txid": str(after.txid), "event_id": after.event_id,
            "count": after.delivered - before.delivered,
        },
    )


class Consumer:
    """Delivers the events of one branch to ``handler(conn, events)``, in order, batch after batch.

    The handler runs inside the transaction that advances the watermark: what it writes through
    ``conn`` commits together with the progress, so each event is applied exactly once across crashes,
    restarts and competing consumers with the same id. Effects outside this database (HTTP, other
    databases) happen at least once: make them idempotent, e.g. keyed by ``event.id``.

    A batch whose handler call fails is delivered again in halves, until the failing event is alone. A
    handler failing ``max_attempts`` times on one event (a call running past ``handler_timeout`` fails,
    its transaction ended by the server): with ``on_poison="park"`` the event goes to the consumer's
    dead letters (``pubsub dead`` / ``pubsub replay``) and the watermark moves past it in the same
    transaction; with ``on_poison="stop"`` the consumer keeps retrying it and delivers nothing after it.
    Either way the lag (``pubsub status``, the lag asset) names the event. A consumer taken over from a
    worker that died delivers the next events one at a time, counting each start in Postgres first, so an
    event whose deliveries kill the worker ``max_crashes`` times is parked (with ``on_poison="stop"``: no
    longer delivered). ``database``: a :class:`Database`, a psycopg ``ConnectionPool`` or a URL.
    """

    def __init__(
        self,
        database: DatabaseSource,
        consumer_id: str,
        branch_id: int,
        handler: Handler | str,
        *,
        batch_size: int = 1000,
        idle_sleep: float = 1.0,
        wait: bool = True,
        lease_ttl: float = 10.0,
        schema: str | None = None,
        max_attempts: int = 10,
        on_poison: Literal["park", "stop"] = "park",
        order: Order = "snapshot",
        start: Literal["beginning", "now", "earliest_kept"] = "beginning",
        listen: bool = True,
        max_crashes: int = DEFAULT_MAX_CRASHES,
        handler_timeout: float = 300.0,
    ) -> None:
        path = handler if isinstance(handler, str) else handler_path(handler)
        self.spec = validated(
            ConsumerSpec, consumer_id=consumer_id, branch_id=branch_id, handler=path or "unnamed:handler",
            batch_size=batch_size, idle_sleep=idle_sleep, max_attempts=max_attempts, on_poison=on_poison,
            order=order, start=start, max_crashes=max_crashes, handler_timeout=handler_timeout,
        )
        self.handler: Handler = load_handler(handler) if isinstance(handler, str) else handler
        self.handler_path = path
        self.wait = wait
        self.lease_ttl = lease_ttl
        self.listen = listen
        self.database = Database.of(database, schema=schema)
        self._registered = False
        self._retry_limit = 0  # after a failed batch: the size of the next ones, halved at each failure
        self._retry_left = 0  # events of the failed batch not delivered since
        self._careful = 0  # after a takeover from a dead worker: events to deliver alone, each start counted first
        self._inherited_fence: int | None = None
        self._abandoned: psycopg.Connection | None = None
        self._worker: Worker | None = None
        self.user_code = UserCode(f"pubsub:{self.partition}", set_aside_after=None)
        self._stop_requested = threading.Event()
        self._conn: psycopg.Connection | None = None  # kept across batches (a pool's checkout costs a round trip)

    @classmethod
    def from_spec(cls, database: DatabaseSource, spec: ConsumerSpec) -> Consumer:
        """The consumer a :class:`ConsumerSpec` describes."""
        return cls(database, spec.consumer_id, spec.branch_id, spec.handler, batch_size=spec.batch_size,
                   idle_sleep=spec.idle_sleep, max_attempts=spec.max_attempts, on_poison=spec.on_poison,
                   order=spec.order, start=spec.start, max_crashes=spec.max_crashes,
                   handler_timeout=spec.handler_timeout)

    @property
    def consumer_id(self) -> str:
        return self.spec.consumer_id

    @property
    def branch_id(self) -> int:
        return self.spec.branch_id

    @property
    def partition(self) -> str:
        """This consumer's partition in the worker runtime's leases (kind ``pubsub.consumer``)."""
        return f"{self.consumer_id}@{self.branch_id}"

    def run_once(self) -> int:
        """Handle one batch; return how many events it held (0: nothing new)."""
        return self._batch(None)

    def run(self, duration: float | None = None, *, on_progress: Callable[[WorkerReport], None] | None = None) -> WorkerReport:
        """Handle batches for ``duration`` seconds (None: until :meth:`stop`), holding this consumer's
        lease so identical consumers elsewhere stand by; a failing batch is retried with backoff.

        Producers' commits wake it at once (LISTEN on ``<schema>.pubsub``); ``idle_sleep`` is the
        fallback poll for a lost notification."""
        self._stop_requested.clear()
        self.check()
        self._worker = worker = Worker(
            self.database, LEASE_KIND, [self.partition], self._batch, ttl=self.lease_ttl,
            idle_sleep=self.spec.idle_sleep, on_progress=on_progress,
        )
        listener = None
        if self.listen:
            listener = Listener(self.database, [channel_name(self.database, HINT_CHANNEL)], lambda *_: worker.wake())
            listener.start()
        if self._stop_requested.is_set():  # asked to stop while starting
            worker.stop()
        try:
            return worker.run(duration)
        finally:
            if listener is not None:
                listener.stop()
            self.close()

    def close(self) -> None:
        """Close the connection this consumer keeps between batches (the next batch opens another)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction on this consumer's own connection (committed on success), or, for a pool the
        caller passed, on a connection borrowed from it."""
        if self.database.uses_your_pool:
            with self.database.connection() as conn:
                yield conn
            return
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self.close()
            conn = self._conn = self.database.connect()
        try:
            yield conn
        except BaseException:
            if conn is not self._abandoned:
                try:
                    conn.rollback()
                except psycopg.Error:
                    self.close()
            raise
        if conn is self._abandoned:  # its call ran past the deadline: the server ended its transaction
            return
        try:
            conn.commit()
        except psycopg.Error:
            self.close()
            raise

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current batch (safe from a signal handler)."""
        self._stop_requested.set()
        if self._worker is not None:
            self._worker.stop()

    def check(self) -> Watermark:
        """Register this consumer (watermark where ``start`` says, handler path) and return its
        watermark; raises :class:`StreamRestored` after a restore. Waits while another transaction
        holds the watermark."""
        with self.database.connection() as conn:
            if not self._registered:
                params = {"consumer_id": self.consumer_id, "branch_id": self.branch_id}
                created = conn.execute(
                    q.START_CONSUMER, {**params, "handler": self.handler_path, "start": self.spec.start}
                ).fetchone()
                if created is not None and created[0]:
                    log.warning("consumer %s of branch %s: %s", self.consumer_id, self.branch_id, created[0])
                if created is None and self.handler_path is not None:
                    registered = conn.execute(q.REGISTERED_HANDLER, params).fetchone()
                    if registered is None or registered[0] != self.handler_path:
                        conn.execute(q.REGISTER_CONSUMER, {**params, "handler": self.handler_path})
            self._registered = True
            return lock_watermark(conn, self.consumer_id, self.branch_id)

    def _batch(self, lease: Lease | None) -> int:
        if not self._registered:
            self.check()
        if lease is not None and lease.inherited and lease.fence != self._inherited_fence:
            self._inherited_fence = lease.fence
            self._careful = self.spec.batch_size  # as many as the dead worker may have had in flight
            log.warning("consumer %r of branch %s: taken over from a worker that died; the next events are "
                        "delivered one at a time", self.consumer_id, self.branch_id)
        if self._careful:
            started = self._record_start(lease)
            if started is not None:
                return started
        limit = self._retry_limit or self.spec.batch_size
        failure: BaseException | None = None
        with self._transaction() as conn:
            if lease is not None:
                Leases.check(conn, lease)
            before = lock_watermark(conn, self.consumer_id, self.branch_id, wait=self.wait)
            batch = read_batch(conn, before, limit, order=self.spec.order)
            if batch.events:
                try:
                    self._call_handler(conn, batch.events)
                except Exception as exc:  # noqa: BLE001 - recorded below, after this transaction rolls back
                    failure = exc
                    if conn is not self._abandoned:
                        conn.rollback()
            if failure is None and batch.changed:
                save_watermark(conn, before, batch.after)
        if failure is not None:
            return self._failed(lease, before, batch, failure)
        if self._retry_limit:
            self._retry_left -= len(batch.events)
            if self._retry_left <= 0:
                self._retry_limit = 0
        return len(batch.events)

    def _call_handler(self, conn: psycopg.Connection, events: list[Event]) -> None:
        """The handler on ``events`` in the thread of user code; past ``handler_timeout`` the transaction is
        ended by the server (the call is abandoned) and :class:`TimedOut` raised."""
        backend = conn.info.backend_pid
        [call] = self.user_code.run([events], lambda batch: self.handler(conn, batch), self.spec.handler_timeout,
                                    on_wait=self._keep_alive)
        if call.timed_out:
            self._abandoned, self._conn = conn, None  # left to the abandoned call: not closed under its thread
            with self.database.connection() as other:
                other.execute("SELECT pg_terminate_backend(%s)", (backend,))
        call.outcome

    def _keep_alive(self) -> None:
        if self._worker is not None:
            self._worker.keep_alive()

    def _record_start(self, lease: Lease | None) -> int | None:
        """In careful mode: count the next event's delivery as started (committed), or park it if its deliveries
        already killed ``max_crashes`` workers; None when the next event is to be delivered now."""
        with self._transaction() as conn:
            if lease is not None:
                Leases.check(conn, lease)
            before = lock_watermark(conn, self.consumer_id, self.branch_id, wait=self.wait)
            batch = read_batch(conn, before, 1, order=self.spec.order)
            if not batch.events:
                self._careful = 0
                return None
            event = batch.events[0]
            crashes = before.crashes if before.failing_event == event.id else 0
            params = {"consumer_id": self.consumer_id, "branch_id": self.branch_id, "event_id": event.id}
            if crashes < self.spec.max_crashes:
                conn.execute(q.RECORD_START, params)
                self._careful -= 1
                self._retry_limit, self._retry_left = 1, max(self._retry_left, 1)
                return None
            where = f"consumer {self.consumer_id!r} of branch {self.branch_id}"
            error = f"{crashes} deliveries in a row ended with the death of their worker (a crash, kill -9 or OOM)"
            if self.spec.on_poison == "stop":
                raise HandlerFailed(f"{where}: stopped on event {event.id}: {error}")
            conn.execute(q.PARK_EVENT, {**params, "txid": str(event.txid), "error": error, "traceback": "",
                                        "attempts": before.attempts, "first_failed_at": datetime.now(UTC)})
            save_watermark(conn, before, batch.after.model_copy(update={"delivered": before.delivered}))
        self._careful -= 1
        log.error("%s: parked event %s: %s", where, event.id, error)
        return 1

    def _failed(self, lease: Lease | None, before: Watermark, batch: Batch, exc: BaseException) -> int:
        """After the handler raised on ``batch`` (rolled back): name the event, count the attempt, and
        park the event once it has failed ``max_attempts`` times (``on_poison="park"``)."""
        events = batch.events
        where = f"consumer {self.consumer_id!r} of branch {self.branch_id}"
        error = describe_error(exc)
        if len(events) > 1:
            if not self._retry_limit:
                self._retry_left = len(events)
            self._retry_limit = max(1, len(events) // 2)
            raise HandlerFailed(
                f"{where}: handler failed on a batch of {len(events)} events (ids {events[0].id}..{events[-1].id}): "
                f"{error}; retrying them in batches of {self._retry_limit}"
            ) from exc
        event = events[0]
        trace = describe_traceback(exc)
        with self._transaction() as conn:
            if lease is not None:
                Leases.check(conn, lease)
            now = lock_watermark(conn, self.consumer_id, self.branch_id, wait=self.wait)
            if now.model_dump(exclude={"failing_event", "attempts"}) != before.model_dump(exclude={"failing_event", "attempts"}):
                raise HandlerFailed(f"{where}: handler failed on event {event.id}: {error}") from exc  # moved meanwhile
            params = {"consumer_id": self.consumer_id, "branch_id": self.branch_id, "event_id": event.id, "error": error}
            attempts, first_failed_at = conn.execute(q.RECORD_FAILURE, params).fetchone()
            if attempts >= self.spec.max_attempts and self.spec.on_poison == "park":
                conn.execute(q.PARK_EVENT, {
                    **params, "txid": str(event.txid), "traceback": trace, "attempts": attempts,
                    "first_failed_at": first_failed_at,
                })
                save_watermark(conn, before, batch.after.model_copy(update={"delivered": before.delivered}))
                log.warning(
                    "%s: parked event %s after %s failed attempts (%s); `cmb-dagster pubsub dead` lists it, "
                    "`cmb-dagster pubsub replay` runs it again", where, event.id, attempts, error,
                )
                self._retry_left -= 1
                if self._retry_left <= 0:
                    self._retry_limit = 0
                return 1
        if attempts >= self.spec.max_attempts:
            log.error("%s: stuck on event %s after %s failed attempts (on_poison='stop'): %s",
                      where, event.id, attempts, error)
        raise HandlerFailed(
            f"{where}: handler failed on event {event.id} (attempt {attempts} of {self.spec.max_attempts}"
            f"{', on_poison=stop' if self.spec.on_poison == 'stop' else ''}): {error}"
        ) from exc
