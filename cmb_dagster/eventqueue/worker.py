"""The dequeue state machine (a flowchart whose edges :class:`Edge` names) and the worker that runs it.

A worker keeps its executor of user code (:class:`~cmb_dagster.executor.Executor`) full: it claims due events in one
statement (``FOR UPDATE SKIP LOCKED``, compare-and-set on ``locked_at``): as many as it has free slots, and, for
handlers without flow limits, as many as calls ended in the last ``AHEAD_SECONDS`` (fast handlers: the next ones
wait in claim order for a slot; the next claim comes once half of them have started). Each event's ``crashes`` is
counted up in the statement that lets its call start, so a worker's death is charged to the events whose calls
were running. It writes the outcomes of the calls that
ended: the finished events are deleted in batches (with the next claim), the failed ones
retried or dead-lettered. An event, its lock and its flow slot stay held until its call has really ended. A claimed
event carries the worker's lease (``locked_by``, ``lock_fence``): the worker renews the locks of the events it
holds from its loop, which never waits on user code, and the events of a worker whose lease lapsed (kill -9, a lost
host) are swept back to the queue by the others within the lease's TTL and a sweep.

LISTEN/NOTIFY hints wake it at once; without them it sweeps every ``sweep_interval`` seconds, and sleeps no longer
than until the next delayed event or lock expiry. Several workers share one queue without partitions; each holds
only a liveness lease of its own (its one partition is its owner name). A rule (pause, block) committed while
handlers run holds every event claimed after it; ``pause()`` returns once every live worker has acknowledged it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
from croniter import croniter
from psycopg.rows import RowFactory, namedtuple_row, tuple_row

from cmb_dagster import flow
from cmb_dagster.database import DatabaseSource, OwnConnection
from cmb_dagster.eventqueue import sql
from cmb_dagster.eventqueue.errors import InvalidEventQueueInput
from cmb_dagster.eventqueue.handlers import Handler
from cmb_dagster.eventqueue.models import Event, EventQueueOptions, WorkerSettings, to_json
from cmb_dagster.executor import Executor, RemoteError, is_coroutine_function
from cmb_dagster.isolation import describe_error, describe_traceback
from cmb_dagster.models import LAUNCHED_BY_TAG, MAX_TAG_VALUE
from cmb_dagster.notifications import channel_name
from cmb_dagster.run_requests import JobLauncher
from cmb_dagster.workers import EngineWorker, Lease, Worker

log = logging.getLogger("cmb_dagster.eventqueue")

WORKER_KIND = "eventqueue.worker"
CHANNEL = "eventqueue"
RULES_HINT = "rules"  # the NOTIFY payload of a new pause or block rule
MIN_SLEEP = 0.005
FILL_COOLDOWN = 0.05
"""Seconds a worker whose calls run waits for half its slots to free before it fills fewer (a claim costs about as
much for one event as for a hundred), at most a tenth of how long calls run lately (a slot idles little)."""
AHEAD_SECONDS = 0.1
"""Handlers without flow limits: a claim also takes as many events as calls ended in the last this many seconds
(they wait for a slot, their locks held and renewed, their crashes not counted until they start)."""


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
TURN_FLOORS_EVERY = 1.0  # seconds between a worker's refreshes of the turn floors of the priorities it claimed
FULL_CLAIM_EVERY = 10.0  # seconds between a worker's claims that read every priority from its first turn


@dataclass(eq=False)
class Claimed:
    """An event this worker holds the lock of, from its claim until it is deleted, retried or released."""

    event: Event
    handler: Handler
    locked_at: datetime
    expired: bool  # the claim took over an expired lock
    renewed_at: float  # time.monotonic() of the claim or of the last renewal of its lock
    batch: list[Event]  # the events of a debounced batch, in order (else the event itself)
    counted: bool  # the claim counted its start (it starts at once); else START counts it when it starts
    suspect: bool  # an earlier run never ended (its worker died): it runs alone in this worker
    ended: bool = False  # its call has ended, or it will not run here

    @property
    def label(self) -> str:
        return f"event {self.event.id} ({self.handler.name})"


class EventWorker(EngineWorker):
    """Runs the handlers of ``options.handlers`` for the events emitted to them.

    ``run(duration)`` loops on the shared worker runtime, woken by notifications, until time is up, running up
    to ``settings.worker_concurrency`` handlers at once; ``run_once()`` runs one batch to its end;
    ``dequeue(ids)`` walks the flowchart for named events. ``EventWorker(db, handlers, settings)`` (a registry, a
    list or ``"module:attr"``, and ``WorkerSettings``) is the deprecated form of
    ``EventWorker(db, EventQueueOptions(handlers=handlers, worker=settings))``.
    """

    def __init__(
        self,
        db: DatabaseSource,
        options: EventQueueOptions,
        settings: WorkerSettings | None = None,
        *,
        owner: str | None = None,
        launcher: JobLauncher | None = None,
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
        self._lease: Lease | None = None  # its liveness lease: the events it claims carry it
        self.executor = Executor(
            f"eventqueue:{self.owner}",
            self.settings.worker_concurrency,
            self.settings.isolation,
            on_end=self._call_ended,
        )
        self._held: dict[int, Claimed] = {}  # events whose lock this worker holds: to start, running, outcome unwritten
        self._waiting: deque[Claimed] = deque()  # claimed, waiting for a slot, in claim order
        self._alone: Claimed | None = None  # a suspect event running: nothing else starts meanwhile
        self._done: list[Claimed] = []  # finished, not deleted yet
        self._rules_changed = threading.Event()
        self._acknowledged = 0  # the newest rule this worker applies to every event it starts
        self._came_due = True  # waiting events came due: staged before the next claim
        self._expired_locks = True  # claims' locks expired: staged with the next waiting events
        self._flow_wait: float | None = None  # seconds until a key at its rate limit has a token again
        self._tick = min(1.0, min(h.config.lock_expiry for h in self.registry.handlers.values()) / 4)
        self._next_reclaim = 0.0
        self._claimed_at = -math.inf  # time.monotonic() of the last claim
        self._claimed_priorities: set[int] = set()  # of the events claimed since the turn floors were refreshed
        self._next_floors = 0.0  # time.monotonic() of the next refresh of the turn floors
        self._next_full_claim = 0.0  # time.monotonic() of the next claim from every priority's first turn

    # -- connection -------------------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        conn = self._own.get()
        if not self._registered:
            with conn.transaction():
                self.registry.register(conn)
            self._registered = True
        return conn

    def _execute(self, query: str, params: Mapping[str, Any], *, row_factory: RowFactory[Any] = tuple_row) -> list[Any]:
        """Run one of the worker's statements; those that take, renew or free flow slots name it their holder."""
        conn = self._connection()
        try:
            cursor = conn.execute(query, {**params, "holder": self.owner})
            cursor.row_factory = row_factory
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
        """Claim up to ``batch_size`` due events, run their handlers to their end and write the outcomes; return how
        many events were claimed or held."""
        with self._lock:
            count, more = 0, True
            while True:
                if more and count < self.settings.batch_size:
                    taken, asked = self._fill(self.settings.batch_size - count)
                    count += taken
                    more = taken >= asked  # fewer: no more due events now
                else:
                    self._start_waiting()
                if not self._waiting and not (more and count < self.settings.batch_size):
                    break
                self._wait_for_calls(all_of_them=False)
            self._wait_for_calls(all_of_them=True)
            self._flush()
            return count

    def dequeue(self, ids: Iterable[int]) -> dict[int, list[Edge]]:
        """Walk the flowchart for each event in ``ids`` (a notification naming them); return the edges taken."""
        with self._lock:
            ids = list(ids)
            params = {"ids": ids, "handlers": self.names, "start_now": 0, "idle": False}
            claimed, edges = self._claim(sql.CLAIM_IDS[self.limited], params)
            missing = [i for i in ids if i not in edges]
            if missing:  # skipped by SKIP LOCKED (someone holds the row) or gone (done)
                present = {r[0] for r in self._execute(sql.EXISTING_IDS, {"ids": missing})}
                for i in missing:
                    edges[i] = [Edge.LOCK_CLAIM_FAILED if i in present else Edge.EVENT_MISSING]
            self._waiting.extend(claimed)
            while self._waiting or any(not item.ended for item in claimed):
                self._start_waiting()
                self._wait_for_calls(all_of_them=False, edges=edges)
            self._flush()
            return edges

    def _fill(self, most: int | None = None) -> tuple[int, int]:
        """Start claimed events in the free slots, claim more (``most`` at most) and start those that have a slot;
        return how many events the claim took or held (not those it passed over at a limit) and how many it asked
        for."""
        self._start_waiting()
        size = self._claim_size() if most is None else min(most, self._claim_size())
        if size <= 0:
            return 0, 0
        # with flow limits a claim takes no more than the free slots, and each of its events starts at once
        start_now = size if self.limited else max(0, self.executor.free - len(self._waiting))
        self._claimed_at = time.monotonic()
        full = self._claimed_at >= self._next_full_claim
        if full:
            self._next_full_claim = self._claimed_at + FULL_CLAIM_EVERY
        params = {
            "handlers": self.names, "limit": size, "start_now": start_now, "idle": not self.executor.running,
            "full": full,
        }  # fmt: skip
        if self._came_due:
            self._stage()
        claimed, edges = self._claim(sql.CLAIM_DUE[self.limited], params)
        if self._came_due and len(edges) < size:  # they take their turns in this claim
            self._stage()
            counted = sum(item.counted for item in claimed)
            more, more_edges = self._claim(
                sql.CLAIM_DUE[self.limited], {**params, "limit": size - len(edges), "start_now": start_now - counted}
            )
            claimed, edges = claimed + more, {**edges, **more_edges}
        for item in claimed:
            if item.counted:
                self._begin(item)
            else:
                self._waiting.append(item)
        self._start_waiting()
        passed_over = (Edge.THROTTLED, Edge.LOCK_CLAIM_FAILED)
        return sum(1 for taken in edges.values() if taken[0] not in passed_over), size

    def _claim_size(self) -> int:
        """How many events to claim now: the free slots, and with no flow limits as many as calls ended in the last
        :data:`AHEAD_SECONDS` (with limits, a key's slot is held only by a call that runs), less those waiting, once
        half of them have started (a claim costs about the same for one event as for a batch); none while a suspect
        event runs or waits."""
        if self._alone is not None or any(item.suspect for item in self._waiting):
            return 0
        waiting = len(self._waiting)
        free = self.executor.free - waiting
        ahead = 0 if self.limited else self.executor.ends_within(AHEAD_SECONDS)
        ahead = ahead - waiting if 2 * waiting <= ahead else 0
        return min(self.settings.batch_size, max(free, ahead))

    def _start_waiting(self) -> None:
        """Start waiting events in the free slots, in claim order, each counting its start (its crash) first; an
        event whose claim is no longer this worker's is dropped."""
        if self._alone is not None:
            if not self._alone.ended:
                return
            self._alone = None
        if self._waiting and self._waiting[0].suspect:  # alone: once no call runs
            count = 0 if self.executor.running else 1
        else:
            count = min(
                self.executor.free, next((i for i, c in enumerate(self._waiting) if c.suspect), len(self._waiting))
            )
        if count <= 0:
            return
        batch = [self._waiting.popleft() for _ in range(count)]
        try:
            rows = self._execute(sql.START, {**self._claims(batch), "owner": self._holder})
        except BaseException:
            self._waiting.extendleft(reversed(batch))
            raise
        may_start = {row[0] for row in rows}
        for item in batch:
            if item.event.id in may_start:
                self._begin(item)
            else:
                self._let_go(item)

    def _release_waiting(self) -> None:
        """Give the waiting events back to the queue (visible at once, their crashes not counted)."""
        if not self._waiting:
            return
        batch = list(self._waiting)
        self._execute(sql.RELEASE, {**self._claims(batch), "owner": self._holder})
        self._waiting.clear()
        for item in batch:
            self._let_go(item)
        self._came_due = True

    def _let_go(self, item: Claimed) -> None:
        """An event claimed and not started will not run here (released, or its claim taken over)."""
        item.ended = True
        self._held.pop(item.event.id, None)

    @staticmethod
    def _claims(items: list[Claimed]) -> dict[str, list[Any]]:
        """The claims of ``items`` as the parameters of a statement that acts on them while they are held."""
        return {"ids": [item.event.id for item in items], "locked": [item.locked_at for item in items]}

    @property
    def _holder(self) -> str | None:
        """The owner name claimed events carry (none outside the loop: ``run_once``, ``dequeue``)."""
        return self._lease.owner if self._lease else None

    def _stage(self) -> None:
        """Make the waiting events that came due ready (they take their turns): those no worker holds, and those
        whose lock expired when the last check found some (outside the loop, always)."""
        params = {"handlers": self.names, "stage_limit": STAGE_LIMIT}
        staged = self._execute(sql.STAGE[False], params)[0][0]
        if self._expired_locks or self._loop is None:
            self._expired_locks = self._execute(sql.STAGE[True], params)[0][0] == STAGE_LIMIT
        self._came_due = staged == STAGE_LIMIT  # more may have come due

    def _refresh_turn_floors(self) -> None:
        """Once a second: move the turn floors of the priorities this worker claimed events of (a hint that bounds
        the reads of emits and claims; kept for the next refresh if the database cannot be reached)."""
        if not self._claimed_priorities or time.monotonic() < self._next_floors:
            return
        self._next_floors = time.monotonic() + TURN_FLOORS_EVERY
        try:
            self._execute(sql.REFRESH_TURN_FLOORS, {"priorities": sorted(self._claimed_priorities)})
        except psycopg.Error as exc:
            log.warning("could not refresh the turn floors (%s); retrying", exc)
            return
        self._claimed_priorities.clear()

    def _claim(self, query: str, params: Mapping[str, Any]) -> tuple[list[Claimed], dict[int, list[Edge]]]:
        """Acknowledge new rules, then claim with ``query``: the events claimed, and the edge each event took. The
        claim first deletes the events finished since the last one (those with limits are deleted before it: the
        slots they free are then free for it). Keys whose flow-control rows do not exist yet get them, and the
        claim runs again."""
        self._acknowledge_new_rules()
        if self.limited:
            self._flush()
        lease = self._lease
        claimant = {"owner": self._holder, "fence": lease.fence if lease else None}
        now = time.monotonic()  # before the database's clock is read: a claim's local deadline errs early
        rows = self._execute(query, {**params, **claimant, **self._finished()}, row_factory=namedtuple_row)
        self._deleted()
        start_now = [params["start_now"]] * len(rows)  # each row's claim counted the starts of places up to this
        missing = [(row.scope, row.flow_key) for row in rows if row.decision == "flow_missing"]
        if missing:
            conn = self._connection()
            with conn.transaction():
                flow.ensure(conn, missing)
            now = time.monotonic()
            rows = [row for row in rows if row.decision != "flow_missing"]
            counted = sum(
                1 for row in rows if row.decision == "claim" and (row.place or math.inf) <= params["start_now"]
            )
            again = {**params, "start_now": params["start_now"] - counted}
            more = self._execute(query, {**again, **claimant, **self._finished()}, row_factory=namedtuple_row)
            start_now = [params["start_now"]] * len(rows) + [again["start_now"]] * len(more)
            rows += more
        claimed: list[tuple[float, int, Claimed]] = []  # in claim order: (place, id, event)
        edges: dict[int, list[Edge]] = {}
        self._came_due, self._flow_wait = False, None
        for row, starts in zip(rows, start_now, strict=True):
            decision = row.decision
            if decision == "rules":
                self._acknowledge(row.id)
            elif decision == "came_due":
                self._came_due = True
            elif decision == "flow_wait":
                self._flow_wait = row.value or 0.0  # 0: keys wait for a slot only
            elif decision in ("flow_missing", "freed"):
                continue
            elif decision == "claim":
                event = Event(
                    row.id, row.namespace, row.module, row.handler, row.modifier, row.value, row.retries,
                    row.enqueued_at, row.priority, row.flow_key,
                )  # fmt: skip
                batch = _members(event) if row.batch_count is not None else [event]
                suspect = row.crashes > 0
                counted = row.place is not None and row.place <= starts and (not suspect or params["idle"])
                handler = self.registry.handlers[row.handler]
                expired = row.seen_locked_at is not None
                item = Claimed(event, handler, row.locked_at, expired, now, batch, counted, suspect)
                self._claimed_priorities.add(row.priority)
                claimed.append((row.place or math.inf, row.id, item))
                self._held[row.id] = item
                edges[row.id] = [Edge.LOCK_EXPIRED if expired else Edge.LOCK_NONE]
            elif row.id not in edges:
                edges[row.id] = [_HELD[decision]]
                if decision == "crashed":
                    log.error(
                        "event %s: its last runs ended with the death of their worker; moved to the dead-letter table",
                        row.id,
                    )
        return [item for *_, item in sorted(claimed, key=lambda c: c[:2])], edges

    def _begin(self, item: Claimed) -> None:
        """Start the event's handler in a free slot (a suspect's alone)."""
        if item.suspect:
            self._alone = item
        fn = item.handler.fn
        function = self._call_async if fn is not None and is_coroutine_function(fn) else self._call
        self.executor.start(item, function, item.handler.config.timeout)

    def _call(self, item: Claimed) -> None:
        """Run the event's handler (in a slot of the executor)."""
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
            "cmb/eventqueue.event_id": str(event.id),
            "cmb/eventqueue.handler": handler.name[:63],
            "cmb/eventqueue.namespace": event.namespace[:63],
            LAUNCHED_BY_TAG: f"cmb event {event.id} ({event.namespace}/{handler.name})"[:MAX_TAG_VALUE],
        }
        self.launcher.launch(
            handler.job_name or handler.name, run_key=f"eventqueue:{event.id}", run_config=run_config, tags=tags
        )

    async def _call_async(self, item: Claimed) -> None:
        """Run the event's ``async def`` handler (on the executor's event loop)."""
        await item.handler.fn(item.batch if item.handler.config.debounce is not None else item.event)  # type: ignore[misc]

    def _call_ended(self) -> None:
        loop = self._loop
        if loop is not None:
            loop.wake()

    def _settle_ended(self, edges: dict[int, list[Edge]] | None = None) -> int:
        """Record how the calls that ended since went: done (deleted with the next claim or flush), or a failure to
        retry or dead-letter; return how many."""
        ended = self.executor.ended()
        for task in ended:
            item: Claimed = task.item
            item.ended = True
            if self._held.get(item.event.id) is not item:
                continue  # its claim was taken over: the event is another worker's now
            try:
                _ = task.outcome  # raises what the call raised
            except Exception as exc:  # noqa: BLE001 - a handler's failure is the event's, not the worker's
                edge = self._retry_check(item, exc)
            else:
                self._done.append(item)
                edge = Edge.EXECUTES_TO_COMPLETION
            if edges is not None:
                edges.setdefault(item.event.id, []).append(edge)
        if ended and self._done and self.limited:  # the slots they hold are free for the next claim at once
            self._flush()
        return len(ended)

    def _wait_for_calls(self, *, all_of_them: bool, edges: dict[int, list[Edge]] | None = None) -> None:
        """Wait for one call to end (or all of them), renewing the locks held meanwhile, and record the outcomes."""
        while self.executor.running:
            if self.executor.wait(self._tick):
                self._settle_ended(edges)
                if not all_of_them:
                    return
            self._housekeeping()
        self._settle_ended(edges)

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
            self._execute(sql.KILL, {**params, "traceback": _traceback_of(exc)})
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

    def _housekeeping(self) -> None:
        """Acknowledge new rules, delete the finished events, renew the locks still held and the worker's lease."""
        self._acknowledge_new_rules()
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
        """Renew the locks (and flow slots) of the events held a third of their lock's expiry ago; forget those
        another worker claimed since."""
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
            else:  # its claim is another worker's now (or it is gone): its outcome is not this worker's to write
                self._held.pop(item.event.id, None)

    def _reclaim_lapsed(self) -> None:
        """Every third of the lease's TTL: the events held by workers whose lease lapsed go back to the queue, and
        those whose lock expired are staged next."""
        if time.monotonic() < self._next_reclaim:
            return
        self._next_reclaim = time.monotonic() + self.settings.lease_ttl / 3
        [(lapsed, expired)] = self._execute(sql.RECLAIM_LAPSED, {"kind": WORKER_KIND, "handlers": self.names})
        if lapsed or expired:
            self._came_due = True
            self._expired_locks = self._expired_locks or expired

    def _acknowledge_new_rules(self) -> None:
        """After a rule changed: give the waiting events back, then acknowledge the newest rule (every event claimed
        from now on is checked against it; those claimed before have started)."""
        if not self._rules_changed.is_set():
            return
        self._rules_changed.clear()
        try:
            self._release_waiting()
            self._acknowledge(self._execute(sql.NEWEST_RULE, {})[0][0])
        except psycopg.Error as exc:
            self._rules_changed.set()
            log.warning("could not acknowledge new rules (%s); retrying", exc)

    def _acknowledge(self, newest: int) -> None:
        """A claim read rules up to ``newest``, and every event claimed earlier has started."""
        if newest > self._acknowledged:
            self._execute(sql.ACKNOWLEDGE_RULES, {"owner": self.owner, "rule": newest})
            self._acknowledged = newest

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
        """One loop holding this worker's liveness lease, woken by the queue's notifications and by calls ending."""
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
            drain=self._drain,
        )
        return [self._loop]

    def _step(self, lease: Lease) -> int:
        """Write the outcomes of the calls that ended, fill the free slots, renew what is held; never waits on
        user code. Returns how many events it claimed or held."""
        if self.registry.crons and time.monotonic() >= self._next_cron:
            self._next_cron = time.monotonic() + self.settings.cron_interval
            self.fire_crons()
        with self._lock:
            self._lease = lease
            self._settle_ended()
            self._reclaim_lapsed()
            fill_in = self._fill_in()
            count = 0 if fill_in else self._fill()[0]
            self._renew_locks()
            self._refresh_turn_floors()
            if count == 0 and not fill_in and not self._waiting:  # idle: no claim deletes the finished events
                self._flush()
        self.executor.check()
        if count == 0 and self._loop is not None:  # a call that ends wakes the loop
            self._loop.idle_sleep = fill_in or (self._tick if self._waiting else self._sleep_for())
        return count

    def _fill_in(self) -> float:
        """Seconds until the free slots are filled: 0 when they are now (none runs, half of them are free, or the
        cooldown since the last claim has passed); a call that ends wakes the loop before."""
        free = self.executor.free
        if free <= 0:
            return self._tick
        if free == self.settings.worker_concurrency or 2 * free >= min(
            self.settings.batch_size, self.settings.worker_concurrency
        ):
            return 0.0
        cooldown = min(FILL_COOLDOWN, self.executor.mean_seconds / 10)
        return max(0.0, self._claimed_at + cooldown - time.monotonic())

    def _sleep_for(self) -> float:
        """Seconds until the next delayed event or lock expiry, at most the sweep interval (at most a tick while
        events are held: their locks are renewed on the way; a call that ends wakes the loop)."""
        sleep = self.settings.sweep_interval
        if self._came_due:
            return MIN_SLEEP
        if self._flow_wait is not None:  # a key at its limit: a token comes, a slot frees (or its holder dies)
            sleep = min(sleep, max(MIN_SLEEP, self._flow_wait or self._tick))
        if self.registry.crons:
            sleep = min(sleep, max(MIN_SLEEP, self._next_cron - time.monotonic()))
        if self._held:
            sleep = min(sleep, self._tick)
        rows = self._execute(sql.NEXT_VISIBLE, {"handlers": self.names})
        if rows:
            sleep = min(sleep, max(MIN_SLEEP, rows[0][0]))
        return sleep

    def _on_notify(self, channel: str, payload: str | None) -> None:
        if payload is None or payload == RULES_HINT:  # a new rule, or a reconnect that may have missed one
            self._rules_changed.set()
        loop = self._loop
        if loop is not None and (not payload or payload == RULES_HINT or payload in self.registry.handlers):
            loop.wake()

    def _drain(self) -> bool:
        """When the loop ends, before its lease is released: let the calls running end within their deadlines
        (renewing locks and lease) and write their outcomes. False when some still run: the lease is then left to
        lapse, so their events go back to the queue only once this worker is gone."""
        deadline = time.monotonic() + max((t.timeout - t.seconds for t in self.executor.running), default=0.0)
        try:
            with self._lock:
                self._release_waiting()
                while self.executor.running and time.monotonic() < deadline:
                    if self.executor.wait(min(self._tick, max(0.0, deadline - time.monotonic()))):
                        self._settle_ended()
                    self._housekeeping()
                self._settle_ended()
                self._flush()
        except psycopg.Error as exc:
            log.warning("event queue worker %s: could not write the outcomes of its last calls (%s)", self.owner, exc)
        running = self.executor.running
        if running:
            log.error(
                "event queue worker %s stops with %d calls still running past their deadline; their events run "
                "again once its lease has lapsed",
                self.owner,
                len(running),
            )
        return not running

    def finish(self) -> None:
        """After the loop: forget this worker's acknowledgement of rules, and close its connection."""
        self._loop = None
        self._lease = None
        try:
            with self._lock:
                self._settle_ended()
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


def _traceback_of(exc: BaseException) -> str:
    """The traceback of a failed call: the child process's for one that ran in a child."""
    if isinstance(exc, RemoteError) and exc.traceback:
        return exc.traceback
    return describe_traceback(exc)


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
