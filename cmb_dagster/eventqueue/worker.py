"""The dequeue state machine (the original design's flowchart) and the worker that runs it in batches.

A worker claims a batch of due events in one statement (``FOR UPDATE SKIP LOCKED``, compare-and-set on
``locked_at``), runs each event's handler, deletes the events that completed, and retries or dead-letters
the ones that raised. LISTEN/NOTIFY hints wake it at once; without them it sweeps every
``sweep_interval`` seconds, and sleeps no longer than until the next delayed event or lock expiry.
Several workers share one queue without partitions; each holds only a liveness lease of its own.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol
from zoneinfo import ZoneInfo

import psycopg
from croniter import croniter

from cmb_dagster.database import Database, DatabaseSource, OwnConnection
from cmb_dagster.eventqueue import sql as q
from cmb_dagster.eventqueue.errors import InvalidInput
from cmb_dagster.eventqueue.handlers import Handler, HandlerRegistry
from cmb_dagster.eventqueue.models import Event, WorkerSettings, to_json
from cmb_dagster.notifications import Listener, channel_name
from cmb_dagster.workers import Lease, Worker, WorkerReport, default_owner

log = logging.getLogger("cmb_dagster.eventqueue")

WORKER_KIND = "eventqueue.worker"
CHANNEL = "eventqueue"
MIN_SLEEP = 0.005


class Edge(StrEnum):
    """The edges of the original design's dequeue flowchart an event can take."""

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


_HELD = {"pause": Edge.PAUSED, "block": Edge.BLOCKED, "delay_not_yet": Edge.DELAY_NOT_YET,
         "is_locked": Edge.IS_LOCKED, "lock_claim_failed": Edge.LOCK_CLAIM_FAILED}


class Launcher(Protocol):
    """Launches a Dagster job run (the Dagster shell provides one inside a worker job)."""

    def launch(self, job_name: str, *, run_key: str, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> str: ...


@dataclass(frozen=True, slots=True)
class Claimed:
    event: Event
    locked_at: datetime
    expired: bool  # the claim took over an expired lock
    claimed_at: float  # time.monotonic() of the claim


class EventWorker:
    """Runs the handlers of ``handlers`` for the events emitted to them.

    ``run_once()`` claims and processes one batch; ``dequeue(ids)`` walks the flowchart for named events;
    ``run(duration)`` loops on the shared worker runtime, woken by notifications, until time is up.
    """

    def __init__(
        self,
        db: DatabaseSource,
        handlers: Any,
        settings: WorkerSettings | None = None,
        *,
        owner: str | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.db = Database.of(db)
        self.registry = HandlerRegistry.of(handlers)
        if not self.registry.handlers:
            raise InvalidInput("handlers: an event queue worker needs at least one handler")
        self.settings = settings or WorkerSettings()
        self.owner = owner or default_owner()
        self.launcher = launcher
        self.names = self.registry.names
        self._own = OwnConnection(self.db, custom_plans=True)  # plans from the actual parameters and table sizes
        self._registered = False
        self._next_cron = 0.0
        self._lock = threading.Lock()
        self.listener: Listener | None = None
        self.worker = Worker(self.db, WORKER_KIND, [self.owner], self._step, owner=self.owner,
                             ttl=self.settings.lease_ttl, idle_sleep=self.settings.sweep_interval)

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
            self.close()
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
            rows = self._execute(q.CLAIM_DUE, {"handlers": self.names, "limit": self.settings.batch_size})
            edges: dict[int, list[Edge]] = {}
            claimed = self._sort(rows, edges)
            self._process(claimed, edges)
            return len(rows)

    def dequeue(self, ids: Iterable[int]) -> dict[int, list[Edge]]:
        """Walk the flowchart for each event in ``ids`` (a notification naming them); return the edges taken."""
        with self._lock:
            ids = list(ids)
            rows = self._execute(q.CLAIM_IDS, {"ids": ids, "handlers": self.names})
            edges: dict[int, list[Edge]] = {}
            claimed = self._sort(rows, edges)
            missing = [i for i in ids if i not in edges]
            if missing:  # skipped by SKIP LOCKED (someone holds the row) or gone (done)
                present = {r[0] for r in self._execute(q.EXISTING_IDS, {"ids": missing})}
                for i in missing:
                    edges[i] = [Edge.LOCK_CLAIM_FAILED if i in present else Edge.EVENT_MISSING]
            self._process(claimed, edges)
            return edges

    def _sort(self, rows: list[tuple[Any, ...]], edges: dict[int, list[Edge]]) -> list[Claimed]:
        now = time.monotonic()
        claimed = []
        for decision, event_id, namespace, module, handler, modifier, value, retries, enqueued, locked, seen in rows:
            if decision == "claim":
                event = Event(event_id, namespace, module, handler, modifier, value, retries, enqueued)
                claimed.append(Claimed(event, locked, seen is not None, now))
                edges[event_id] = [Edge.LOCK_EXPIRED if seen is not None else Edge.LOCK_NONE]
            else:
                edges[event_id] = [_HELD[decision]]
        return claimed

    def _process(self, claimed: list[Claimed], edges: dict[int, list[Edge]]) -> None:
        done: list[int] = []
        try:
            for item in claimed:
                handler = self.registry.handlers[item.event.handler]
                if time.monotonic() - item.claimed_at > handler.config.lock_expiry:
                    continue  # our claim has lapsed: another worker may run it; leave it to them
                try:
                    self._call(handler, item.event)
                except Exception as exc:  # noqa: BLE001 - a handler's failure is the event's, not the worker's
                    edges[item.event.id].append(self._retry_check(handler, item, exc))
                else:
                    done.append(item.event.id)
                    edges[item.event.id].append(Edge.EXECUTES_TO_COMPLETION)
        finally:
            if done:
                self._execute(q.DELETE_DONE, {"ids": done})

    def _call(self, handler: Handler, event: Event) -> None:
        if handler.fn is not None:
            handler.fn(event)
            return
        if self.launcher is None:
            raise RuntimeError(f"handler {handler.name!r} launches Dagster job {handler.job_name!r}: "
                               "run this worker inside Dagster (cmb_definitions(events=...))")
        run_config = event.value if isinstance(event.value, dict) else {}
        tags = {"cmb/eventqueue/event_id": str(event.id), "cmb/eventqueue/handler": handler.name[:63],
                "cmb/eventqueue/namespace": event.namespace[:63]}
        self.launcher.launch(handler.job_name or handler.name, run_key=f"eventqueue:{event.id}",
                             run_config=run_config, tags=tags)

    def _retry_check(self, handler: Handler, item: Claimed, exc: BaseException) -> Edge:
        try:
            error = f"{type(exc).__name__}: {exc}".replace("\x00", "\\0")
            params = {"id": item.event.id, "locked_at": item.locked_at, "error": error}
            if item.event.retries < handler.config.max_retries:
                delay = handler.config.backoff(item.event.retries)
                self._execute(q.RETRY, {**params, "delay": delay})
                log.warning("event %s (%s) failed, retry %s in %.1fs: %s", item.event.id, handler.name,
                            item.event.retries + 1, delay, error)
                return Edge.RETRY_ALLOWED
            trace = "".join(traceback.format_exception(exc)).replace("\x00", "\\0")
            self._execute(q.KILL, {**params, "traceback": trace})
            log.error("event %s (%s) failed %s times; moved to the dead-letter table: %s", item.event.id,
                      handler.name, item.event.retries + 1, error)
            return Edge.RETRY_TOO_MANY
        except Exception:
            log.exception("event %s: recording its failure failed; it runs again after its lock expires",
                          item.event.id)
            return Edge.RETRY_CHECK_FAILED

    # -- cron ---------------------------------------------------------------------------------------

    def fire_crons(self) -> int:
        """Emit each cron handler's event for its latest fire time, unless some worker already did; return how many."""
        if not self.registry.crons:
            return 0
        with self._lock:
            now = self._execute(q.DB_NOW, {})[0][0]
            fired = 0
            for cron in self.registry.crons.values():
                local = now.astimezone(ZoneInfo(cron.timezone))
                fire_time = croniter(cron.schedule, local + timedelta(microseconds=1)).get_prev(datetime)
                rows = self._execute(q.CRON_FIRE, {
                    "cron": cron.name, "fire_time": fire_time, "namespace": cron.namespace, "module": cron.module,
                    "handler": cron.handler, "modifier": cron.modifier, "value": to_json(cron.value),
                })
                fired += len(rows)
            return fired

    # -- the loop -----------------------------------------------------------------------------------

    def _step(self, lease: Lease) -> int:
        if self.registry.crons and time.monotonic() >= self._next_cron:
            self._next_cron = time.monotonic() + self.settings.cron_interval
            self.fire_crons()
        count = self.run_once()
        if count == 0:
            self.worker.idle_sleep = self._sleep_for()
        return count

    def _sleep_for(self) -> float:
        """Seconds until the next delayed event or lock expiry, at most the sweep interval."""
        sleep = self.settings.sweep_interval
        if self.registry.crons:
            sleep = min(sleep, max(MIN_SLEEP, self._next_cron - time.monotonic()))
        rows = self._execute(q.NEXT_VISIBLE, {"handlers": self.names})
        if rows:
            visible_at, now = rows[0]
            sleep = min(sleep, max(MIN_SLEEP, (visible_at - now).total_seconds()))
        return sleep

    def _on_notify(self, channel: str, payload: str | None) -> None:
        if not payload or payload in self.registry.handlers:
            self.worker.wake()

    def run(self, duration: float | None = None,
            on_progress: Callable[[WorkerReport], None] | None = None) -> WorkerReport:
        """Process events for ``duration`` seconds (None: until :meth:`stop`)."""
        self.worker.on_progress = on_progress
        if self.settings.listen:
            self.listener = Listener(self.db, [channel_name(self.db, CHANNEL)], self._on_notify,
                                     heartbeat=self.settings.heartbeat).start()
        try:
            return self.worker.run(duration)
        finally:
            if self.listener is not None:
                self.listener.stop()
            self.close()

    @property
    def listening(self) -> bool:
        """Whether the worker's LISTEN connection is up (notifications reach it)."""
        return self.listener is not None and self.listener.connected.is_set()

    def stop(self) -> None:
        """Finish the current batch and return from :meth:`run`."""
        self.worker.stop()
