"""The dequeue state machine (a flowchart whose edges :class:`Edge` names) and the worker that runs it in batches.

A worker claims a batch of due events in one statement (``FOR UPDATE SKIP LOCKED``, compare-and-set on
``locked_at``, each event's ``crashes`` counted up before any handler runs), runs each event's handler in
a thread of user code (:class:`~cmb_dagster.isolation.UserCode`), deletes the events that completed as they
complete, and retries or dead-letters the ones that raised or ran past their ``timeout``. While a batch
runs, the worker renews the locks of the events it still holds, so a finished event is deleted before its
lock can lapse, and a slow call is set aside after about a second so that the events after it go on. A
rule (pause, block) committed while a batch runs is applied to the events not started yet before the
worker acknowledges it; ``pause()`` returns once every live worker has.

LISTEN/NOTIFY hints wake it at once; without them it sweeps every ``sweep_interval`` seconds, and sleeps
no longer than until the next delayed event or lock expiry. Several workers share one queue without
partitions; each holds only a liveness lease of its own (its one partition is its owner name).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol
from zoneinfo import ZoneInfo

import psycopg
from croniter import croniter

from cmb_dagster import flow
from cmb_dagster.database import DatabaseSource, OwnConnection
from cmb_dagster.eventqueue import sql
from cmb_dagster.eventqueue.errors import InvalidEventQueueInput
from cmb_dagster.eventqueue.handlers import Handler
from cmb_dagster.eventqueue.models import Event, EventQueueOptions, WorkerSettings, to_json
from cmb_dagster.isolation import Call, UserCode, describe_error, describe_traceback
from cmb_dagster.models import LAUNCHED_BY_TAG, MAX_TAG_VALUE
from cmb_dagster.notifications import channel_name
from cmb_dagster.workers import EngineWorker, Lease, Worker

log = logging.getLogger("cmb_dagster.eventqueue")

WORKER_KIND = "eventqueue.worker"
CHANNEL = "eventqueue"
RULES_HINT = "rules"  # the NOTIFY payload of a new pause or block rule
MIN_SLEEP = 0.005


class Edge(StrEnum):
    """The edges of the dequeue flowchart an event can take (docs/eventqueue.md draws them)."""

    EVENT_MISSING = "event_missing"  # EventLoad -> End: it is done
    PAUSED = "paused"  # PauseCheck -> End: held until unpause
    BLOCKED = "blocked"  # PauseCheck -> End: held until unblock
    DELAY_NOT_YET = "delay_not_yet"  # DelayCheck -> Queue: visible again at delay_until
    IS_LOCKED = "is_locked"  # LockCheck -> Queue: visible again when the lock expires
    LOCK_NONE = "lock_none"  # LockCheck -> LockClaim
    LOCK_EXPIRED = "lock_expired"  # LockCheck -> LockClaim
    LOCK_CLAIM_FAILED = "lock_claim_failed"  # LockClaim -> Queue: someone else has it
    EXECUTES_TO_COMPLETION = "executes_to_completion"  # Process -> Delete
    RETRY_ALLOWED = "retry_allowed"  # RetryCheck -> Queue: increment, delay
    RETRY_TOO_MANY = "retry_too_many"  # RetryCheck -> dead-letter table
    RETRY_CHECK_FAILED = "retry_check_failed"  # RetryCheck -> Queue: stays locked until the lock expires
    CRASHED_TOO_OFTEN = "crashed_too_often"  # LockClaim -> dead-letter table: its runs killed their worker
    THROTTLED = "throttled"  # LimitCheck -> Queue: its key is at its rate or concurrency limit


_HELD = {
    "pause": Edge.PAUSED,
    "block": Edge.BLOCKED,
    "delay_not_yet": Edge.DELAY_NOT_YET,
    "is_locked": Edge.IS_LOCKED,
    "lock_claim_failed": Edge.LOCK_CLAIM_FAILED,
    "crashed": Edge.CRASHED_TOO_OFTEN,
    "throttled": Edge.THROTTLED,
}
STAGE_LIMIT = 10_000  # waiting events one staging statement makes ready at most


class Launcher(Protocol):
    """Launches a Dagster job run (the Dagster shell provides one inside a worker job)."""

    def launch(self, job_name: str, *, run_key: str, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> str: ...


class _ClaimLapsed(Exception):
    """The worker could not renew an event's lock in time: another worker may run it; this one does not."""


@dataclass(eq=False)
class Claimed:
    """An event this worker holds the lock of, from its claim until it is deleted, retried or released."""

    event: Event
    handler: Handler
    locked_at: datetime
    expired: bool  # the claim took over an expired lock
    renewed_at: float  # time.monotonic() of the claim or of the last renewal of its lock
    batch: list[Event]  # the events of a debounced batch, in order (else the event itself)

    @property
    def label(self) -> str:
        return f"event {self.event.id} ({self.handler.name})"


class EventWorker(EngineWorker):
    """Runs the handlers of ``options.handlers`` for the events emitted to them.

    ``run_once()`` claims and processes one batch; ``dequeue(ids)`` walks the flowchart for named events;
    ``run(duration)`` loops on the shared worker runtime, woken by notifications, until time is up.
    ``EventWorker(db, handlers, settings)`` (a registry, a list or ``"module:attr"``, and ``WorkerSettings``)
    is the deprecated form of ``EventWorker(db, EventQueueOptions(handlers=handlers, worker=settings))``.
    """

    def __init__(
        self,
        db: DatabaseSource,
        options: EventQueueOptions,
        settings: WorkerSettings | None = None,
        *,
        owner: str | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        super().__init__(db, owner=owner)
        self.options = _options(options, settings)
        self.registry = self.options.registry()
        self.settings = self.options.worker
        self.launcher = launcher
        self.names = self.registry.names
        self.limited = any(h.config.limits.limited for h in self.registry.handlers.values())
        self._own = OwnConnection(self.db, custom_plans=True)  # plans from the actual parameters and table sizes
        self._registered = False
        self._next_cron = 0.0
        self._lock = threading.Lock()
        self._loop: Worker | None = None  # the loop of the current run
        self.user_code = UserCode(f"eventqueue:{self.owner}")
        self._held: dict[int, Claimed] = {}  # events whose lock this worker holds
        self._done: list[Claimed] = []  # finished, not deleted yet
        self._rules_changed = threading.Event()
        self._acknowledged = 0  # the newest rule this worker applies to every event it starts
        self._came_due = True  # waiting events came due: staged before the next claim
        self._flow_wait: float | None = None  # seconds until a key at its rate limit has a token again
        self._tick = min(1.0, min(h.config.lock_expiry for h in self.registry.handlers.values()) / 4)

    # -- connection -------------------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        conn = self._own.get()
        if not self._registered:
            with conn.transaction():
                self.registry.register(conn)
            self._registered = True
        return conn

    def _execute(self, query: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        conn = self._connection()
        try:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []
        except psycopg.OperationalError:
            self._own.close()
            raise

    def close(self) -> None:
        """Close the worker's own connection."""
        self._own.close()

    def register(self) -> None:
        """Record this worker's handlers in the database (done on first use anyway)."""
        self._connection()

    # -- the flowchart ----------------------------------------------------------------------------

    def run_once(self) -> int:
        """Claim one batch of due events and process it; return how many events it claimed or held."""
        with self._lock:
            count = self._batch()
            self._flush()
            return count

    def _batch(self) -> int:
        """Claim one batch and process it (holding ``_lock``); the events it finished are deleted by the next
        claim, or a flush."""
        self._settle_set_aside()
        params = {"handlers": self.names, "limit": self.settings.batch_size}
        if self._came_due:
            self._stage()
        claimed, edges = self._claim(sql.CLAIM_DUE[self.limited], params)
        if self._came_due and len(edges) < self.settings.batch_size:  # they take their turns in this batch
            self._stage()
            rest = {**params, "limit": self.settings.batch_size - len(edges)}
            more, more_edges = self._claim(sql.CLAIM_DUE[self.limited], rest)
            claimed, edges = claimed + more, {**edges, **more_edges}
        self._process(claimed, edges)
        return len(edges)

    def dequeue(self, ids: Iterable[int]) -> dict[int, list[Edge]]:
        """Walk the flowchart for each event in ``ids`` (a notification naming them); return the edges taken."""
        with self._lock:
            ids = list(ids)
            claimed, edges = self._claim(sql.CLAIM_IDS[self.limited], {"ids": ids, "handlers": self.names})
            missing = [i for i in ids if i not in edges]
            if missing:  # skipped by SKIP LOCKED (someone holds the row) or gone (done)
                present = {r[0] for r in self._execute(sql.EXISTING_IDS, {"ids": missing})}
                for i in missing:
                    edges[i] = [Edge.LOCK_CLAIM_FAILED if i in present else Edge.EVENT_MISSING]
            self._process(claimed, edges)
            self._flush()
            return edges

    def _stage(self) -> None:
        """Make the waiting events that came due ready (they take their turns)."""
        staged = self._execute(sql.STAGE, {"handlers": self.names, "stage_limit": STAGE_LIMIT})[0][0]
        self._came_due = staged == STAGE_LIMIT  # more may have come due

    def _claim(self, query: str, params: Mapping[str, Any]) -> tuple[list[Claimed], dict[int, list[Edge]]]:
        """Apply new rules, then claim with ``query``: the events claimed, and the edge each event took. The
        claim first deletes the events finished since the last one (those with limits are deleted before it: the
        slots they free are then free for it). Keys whose flow-control rows do not exist yet get them, and the
        claim runs again."""
        self._apply_new_rules()
        if self.limited:
            self._flush()
        now = time.monotonic()  # before the database's clock is read: a claim's local deadline errs early
        rows = self._execute(query, {**params, **self._finished()})
        self._deleted()
        missing = [(row[2], row[3]) for row in rows if row[0] == "flow_missing"]
        if missing:
            conn = self._connection()
            with conn.transaction():
                flow.ensure(conn, missing)
            now = time.monotonic()
            rows = self._execute(query, {**params, **self._finished()})
        claimed = []
        edges: dict[int, list[Edge]] = {}
        self._came_due, self._flow_wait = False, None
        for row in rows:
            decision, event_id, namespace, module, handler, modifier, value, retries, enqueued, locked, seen = row[:11]
            if decision == "rules":
                self._acknowledge(event_id)
            elif decision == "came_due":
                self._came_due = True
            elif decision == "flow_wait":
                self._flow_wait = value or 0.0  # 0: keys wait for a slot only
            elif decision in ("flow_missing", "freed"):
                continue
            elif decision == "claim":
                priority, key, batch_count = row[11:]
                event = Event(event_id, namespace, module, handler, modifier, value, retries, enqueued, priority, key)
                batch = _members(event) if batch_count is not None else [event]
                item = Claimed(event, self.registry.handlers[handler], locked, seen is not None, now, batch)
                claimed.append(item)
                self._held[event_id] = item
                edges[event_id] = [Edge.LOCK_EXPIRED if seen is not None else Edge.LOCK_NONE]
            else:
                edges[event_id] = [_HELD[decision]]
                if decision == "crashed":
                    log.error(
                        "event %s: its last runs ended with the death of their worker; moved to the dead-letter table",
                        event_id,
                    )
        return claimed, edges

    def _process(self, claimed: list[Claimed], edges: dict[int, list[Edge]]) -> None:
        try:
            calls = self.user_code.run(
                claimed,
                self._call,
                lambda c: c.handler.config.timeout,
                on_wait=self._housekeeping,
                wait_step=self._tick,
            )
            for call in calls:
                self._settle(call, edges)
        finally:
            if self._done and self.limited:  # the slots they hold are free for the next claim at once
                self._flush()

    def _call(self, item: Claimed) -> None:
        """Run the event's handler (in the thread of user code)."""
        if time.monotonic() - item.renewed_at > item.handler.config.lock_expiry:
            raise _ClaimLapsed()
        handler, event = item.handler, item.event
        if handler.fn is not None:
            handler.fn(item.batch if handler.config.debounce is not None else event)  # type: ignore[arg-type]
            return
        if self.launcher is None:
            raise RuntimeError(
                f"handler {handler.name!r} launches Dagster job {handler.job_name!r}: "
                "run this worker inside Dagster (cmb_definitions(events=...))"
            )
        run_config = event.value if isinstance(event.value, dict) else {}
        tags = {
            "cmb/eventqueue/event_id": str(event.id),
            "cmb/eventqueue/handler": handler.name[:63],
            "cmb/eventqueue/namespace": event.namespace[:63],
            LAUNCHED_BY_TAG: f"cmb event {event.id} ({event.namespace}/{handler.name})"[:MAX_TAG_VALUE],
        }
        self.launcher.launch(
            handler.job_name or handler.name, run_key=f"eventqueue:{event.id}", run_config=run_config, tags=tags
        )

    def _settle(self, call: Call[Claimed], edges: dict[int, list[Edge]]) -> None:
        """Record how a call ended: done (deleted with the next flush), or a failure to retry."""
        item = call.item
        try:
            _ = call.outcome  # raises what the call raised
        except _ClaimLapsed:
            self._held.pop(item.event.id, None)  # our claim has lapsed: another worker may run it
        except Exception as exc:  # noqa: BLE001 - a handler's failure is the event's, not the worker's
            edges.setdefault(item.event.id, []).append(self._retry_check(item, exc))
        else:
            self._done.append(item)
            edges.setdefault(item.event.id, []).append(Edge.EXECUTES_TO_COMPLETION)

    def _retry_check(self, item: Claimed, exc: BaseException) -> Edge:
        handler = item.handler
        self._held.pop(item.event.id, None)
        try:
            error = describe_error(exc)
            params = {"id": item.event.id, "locked_at": item.locked_at, "error": error}
            if item.event.retries < handler.config.max_retries:
                delay = handler.config.backoff.delay(item.event.retries)
                self._execute(sql.RETRY, {**params, "delay": delay})
                log.warning(
                    "event %s (%s) failed, retry %s in %.1fs: %s",
                    item.event.id,
                    handler.name,
                    item.event.retries + 1,
                    delay,
                    error,
                )
                return Edge.RETRY_ALLOWED
            self._execute(sql.KILL, {**params, "traceback": describe_traceback(exc)})
            log.error(
                "event %s (%s) failed %s times; moved to the dead-letter table: %s",
                item.event.id,
                handler.name,
                item.event.retries + 1,
                error,
            )
            return Edge.RETRY_TOO_MANY
        except Exception:
            log.exception("event %s: recording its failure failed; it runs again after its lock expires", item.event.id)
            return Edge.RETRY_CHECK_FAILED

    # -- while handlers run ---------------------------------------------------------------------------

    def _housekeeping(self, *, flush: bool = True) -> None:
        """Apply new rules to the events not started, delete the finished ones (``flush``), renew the locks
        still held and the worker's lease (from the worker's thread, while handlers run)."""
        self._apply_new_rules()
        if flush:
            self._flush()
        self._renew_locks()
        if self._loop is not None:
            self._loop.keep_alive()

    def _flush(self) -> None:
        """Delete the finished events; kept for the next flush if the database cannot be reached."""
        if not self._done:
            return
        try:
            self._execute(sql.DELETE_DONE, self._finished())
        except psycopg.Error as exc:
            log.warning("could not delete %d finished events (%s); retrying", len(self._done), exc)
            return
        self._deleted()

    def _finished(self) -> dict[str, list[Any]]:
        """The finished events, as the parameters of a statement that deletes them."""
        return {"done": [item.event.id for item in self._done], "done_locked": [item.locked_at for item in self._done]}

    def _deleted(self) -> None:
        """The finished events were deleted."""
        for item in self._done:
            self._held.pop(item.event.id, None)
        self._done = []

    def _renew_locks(self) -> None:
        now = time.monotonic()
        due = [item for item in self._held.values() if now - item.renewed_at > item.handler.config.lock_expiry / 3]
        if not due:
            return
        try:
            rows = self._execute(
                sql.EXTEND_LOCKS, {"ids": [i.event.id for i in due], "locked": [i.locked_at for i in due]}
            )
        except psycopg.Error as exc:
            log.warning("could not renew the locks of %d events (%s); retrying", len(due), exc)
            return
        renewed = {row[0] for row in rows}
        for item in due:
            if item.event.id in renewed:
                item.renewed_at = now
            else:  # its claim is another worker's now (or it is gone): its handler does not start here
                item.renewed_at = -math.inf
                self._held.pop(item.event.id, None)

    def _apply_new_rules(self) -> None:
        """After a rule changed: park the claimed events not started yet that a rule now holds, then
        acknowledge the newest rule (from now on, every event started was checked against it)."""
        if not self._rules_changed.is_set():
            return
        self._rules_changed.clear()
        try:
            with self.user_code.holding() as pending:
                waiting = [call for call in pending if isinstance(call.item, Claimed)]
                newest, held = self._execute(
                    sql.RECHECK_RULES,
                    {
                        "owner": self.owner,
                        "ids": [c.item.event.id for c in waiting],
                        "locked": [c.item.locked_at for c in waiting],
                    },
                )[0]
                parked = set(held)
                self.user_code.withdraw([c for c in waiting if c.item.event.id in parked])
        except psycopg.Error as exc:
            self._rules_changed.set()
            log.warning("could not check the claimed events against new rules (%s); retrying", exc)
            return
        for event_id in parked:
            self._held.pop(event_id, None)
        self._acknowledged = max(self._acknowledged, newest)

    def _acknowledge(self, newest: int) -> None:
        """A claim read rules up to ``newest``, and nothing claimed earlier is still to start."""
        if newest > self._acknowledged:
            self._execute(sql.ACKNOWLEDGE_RULES, {"owner": self.owner, "rule": newest})
            self._acknowledged = newest

    def _settle_set_aside(self) -> None:
        """Record the calls set aside that ended since (or passed their timeout)."""
        for call in self.user_code.collect():
            self._settle(call, {})

    # -- cron ---------------------------------------------------------------------------------------

    def fire_crons(self) -> int:
        """Emit each cron handler's event for its latest fire time, unless some worker already did; return how many."""
        if not self.registry.crons:
            return 0
        with self._lock:
            now = self._execute(sql.DB_NOW, {})[0][0]
            fired = 0
            for cron in self.registry.crons.values():
                local = now.astimezone(ZoneInfo(cron.timezone))
                fire_time = croniter(cron.schedule, local + timedelta(microseconds=1)).get_prev(datetime)
                rows = self._execute(
                    sql.CRON_FIRE,
                    {
                        "cron": cron.name,
                        "fire_time": fire_time,
                        "namespace": cron.namespace,
                        "module": cron.module,
                        "handler": cron.handler,
                        "modifier": cron.modifier,
                        "value": to_json(cron.value),
                    },
                )
                fired += len(rows)
            return fired

    # -- the loop -----------------------------------------------------------------------------------

    def loops(self) -> list[Worker]:
        """One loop holding this worker's liveness lease, woken by the queue's notifications."""
        self._loop = Worker(
            self.db,
            WORKER_KIND,
            [self.owner],
            self._step,
            owner=self.owner,
            ttl=self.settings.lease_ttl,
            idle_sleep=self.settings.sweep_interval,
            on_notify=self._on_notify,
            heartbeat=self.settings.heartbeat,
            channels=[channel_name(self.db, CHANNEL)] if self.settings.listen else [],
        )
        return [self._loop]

    def _step(self, lease: Lease) -> int:
        if self.registry.crons and time.monotonic() >= self._next_cron:
            self._next_cron = time.monotonic() + self.settings.cron_interval
            self.fire_crons()
        with self._lock:
            count = self._batch()  # the loop's next claim deletes the events it finished
        self._housekeeping(flush=count == 0)
        if count == 0 and self._loop is not None:
            self._loop.idle_sleep = self._sleep_for()
        return count

    def _sleep_for(self) -> float:
        """Seconds until the next delayed event or lock expiry, at most the sweep interval (shorter while
        calls set aside run, or events are held: their locks are renewed on the way)."""
        sleep = self.settings.sweep_interval
        if self._came_due:
            return MIN_SLEEP
        if self._flow_wait is not None:  # a key at its limit: a token comes, a slot frees (or its holder dies)
            sleep = min(sleep, max(MIN_SLEEP, self._flow_wait or self._tick))
        if self.registry.crons:
            sleep = min(sleep, max(MIN_SLEEP, self._next_cron - time.monotonic()))
        if self._held:
            sleep = min(sleep, self._tick, 0.05 if self.user_code.set_aside else self._tick)
        rows = self._execute(sql.NEXT_VISIBLE, {"handlers": self.names})
        if rows:
            sleep = min(sleep, max(MIN_SLEEP, rows[0][0]))
        return sleep

    def _on_notify(self, channel: str, payload: str | None) -> None:
        if payload is None or payload == RULES_HINT:  # a new rule, or a reconnect that may have missed one
            self._rules_changed.set()
            self.user_code.interrupt()
        loop = self._loop
        if loop is not None and (not payload or payload == RULES_HINT or payload in self.registry.handlers):
            loop.wake()

    def finish(self) -> None:
        """After the loop: wait for the calls set aside (within their timeouts, renewing their locks), record
        how they ended, forget this worker's acknowledgement of rules, and close its connection."""
        self._loop = None
        deadline = time.monotonic() + max((c.timeout - c.seconds for c in self.user_code.set_aside), default=0.0)
        try:
            while self.user_code.set_aside and time.monotonic() < deadline:
                with self._lock:
                    self._settle_set_aside()
                    self._housekeeping()
                time.sleep(0.05)
            with self._lock:
                self._settle_set_aside()
                self._flush()
            self._execute(sql.FORGET_WORKER, {"owner": self.owner})
        except psycopg.Error as exc:
            log.warning(
                "event queue worker %s: could not finish cleanly (%s); its events run again after their locks expire",
                self.owner,
                exc,
            )
        finally:
            self.close()


def _members(batch: Event) -> list[Event]:
    """The events a debounced batch holds, in the order they were emitted."""
    return [
        Event(
            m["id"],
            m["namespace"],
            m["module"],
            batch.handler,
            m["modifier"],
            m["value"],
            batch.retries,
            datetime.fromisoformat(m["enqueued_at"]),
            batch.priority,
            batch.key,
        )
        for m in batch.value
    ]


def _options(options: Any, settings: WorkerSettings | None) -> EventQueueOptions:
    """``options``, or the deprecated ``(handlers, settings)`` as options."""
    if isinstance(options, EventQueueOptions):
        if settings is not None:
            raise InvalidEventQueueInput("settings: give them as EventQueueOptions(worker=...)")
        return options
    warnings.warn(
        "EventWorker(db, handlers, settings) is deprecated: use "
        "EventWorker(db, EventQueueOptions(handlers=handlers, worker=settings))",
        DeprecationWarning,
        stacklevel=3,
    )
    return EventQueueOptions(handlers=options, worker=settings or WorkerSettings())
