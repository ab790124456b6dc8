"""The callbacks worker: polls its buckets by two queries and calls due events back.

Query 1 reads due events in ``(run_at, event_id)`` order after a cursor; query 2 reads events inserted behind
that cursor, by id above a horizon. Per bucket the worker keeps, in memory, the cursor and an event id at or
below which every event has been seen (it never passes an id whose transaction may still commit: see
:class:`EventIdHorizon`). In Postgres it keeps a conservative copy of both, written in the same transaction as
the outcomes of calls: a cursor that stops before any event still in flight. A worker that takes a bucket over
starts from that copy, so an event is lost by no crash; only events in flight at a crash are called again (at
least once).

Calls are limited per destination host, or per owner or group (``CallbackSettings.per_host``, ``per_owner``),
across all workers, by the slots of :mod:`cmb_dagster.flow`: the gate takes them for a batch of calls, the worker
keeps a slot whose call ended for its next call under the same limits, and the write of outcomes frees those it
no longer uses; the slots of a worker that died free themselves when their ``lease_ttl`` passes.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from pydantic import ValidationError

from cmb_dagster import flow
from cmb_dagster.callbacks import sql
from cmb_dagster.callbacks.delivery import (
    ABANDONED,
    FAILED,
    GONE,
    HELD,
    RETRY,
    SLOT_RECHECK,
    Answer,
    Delivery,
    DeliveryPool,
    FlowKey,
    target_host,
)
from cmb_dagster.callbacks.errors import InvalidCallbackInput
from cmb_dagster.callbacks.hosts import endpoint_of
from cmb_dagster.callbacks.models import (
    CONTEXT,
    EARLIEST_RUN_AT,
    HOOK_GROUP,
    OWNER_SCOPE,
    CallbackSettings,
    EndpointPolicy,
    RetryPolicy,
)
from cmb_dagster.database import Database, DatabaseSource, OwnAsyncConnection, OwnConnection
from cmb_dagster.isolation import sanitize
from cmb_dagster.models import describe
from cmb_dagster.notifications import channel_name
from cmb_dagster.run_requests import JobLauncher
from cmb_dagster.workers import EngineWorker, Lease, LeaseLost, Leases, Worker, WorkerReport, default_owner

log = logging.getLogger("cmb_dagster.callbacks")

LEASE_KIND = "callbacks.bucket"
COMMIT_EVERY = 0.1  # seconds: outcomes of calls wait at most this long (or for a full batch) to be written
COMMIT_BATCH = 500
REPORT_EVERY_SECONDS = 30.0  # a progress line (and the count of failed calls not logged one by one)
FAILURES_LOGGED_PER_WINDOW = 20
MAX_KEYS_REMEMBERED = 100_000  # owners whose signing secrets a worker remembers
STUCK_CHECK_EVERY = 1.0  # seconds: how often the worker asks whether every call slot is held by a hung launch
ENDPOINTS_EVERY = 0.5  # seconds: how often a worker sends due probes, disables endpoints open too long, releases events
RELEASE_BATCH = 1000  # held events of a closed endpoint sent again per transaction
HEALTHY_EVERY = 1.0  # seconds: good answers alone are written to their endpoints' health at most this late


Position = tuple[datetime, int]
PRIORITY_COLUMN = 14  # the priority's place in a polled row (sql.POLL_COLUMNS)


@dataclass
class BucketState:
    """What a worker knows about one bucket it holds."""

    bucket_id: int
    fence: int
    cursor: Position  # query 1 continues after this (run_at, event_id)
    seen_event_id: int  # query 2: every event id up to this was visible to a poll
    in_flight: dict[int, Position] = field(default_factory=dict)  # polled, outcome not yet written
    urgent: set[int] = field(default_factory=set)  # those of in_flight above priority 0 (query 0 skips them)
    done: list[Delivery] = field(default_factory=list)  # outcome known, not yet written
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_poll: float = 0.0
    last_commit: float = field(default_factory=time.monotonic)
    lease_deadline: float = 0.0  # monotonic; calls that could outlast it are not started
    lease: Lease | None = None

    def saved_cursor(self) -> Position:
        """The cursor to persist: never past an event still in flight."""
        if not self.in_flight:
            return self.cursor
        run_at, event_id = min(self.in_flight.values())
        return min(self.cursor, (run_at, event_id - 1))


class EventIdHorizon:
    """The highest event id at or below which every id drawn belongs to a transaction that has ended.

    Writers draw ids concurrently, so ids do not grow in commit order. Each poll reads the highest id
    drawn and then the transactions drawing ids (holders of ``sql.LOCK_EVENT_IDS``); once none of those
    is still running, every id up to that highest one is committed or rolled back, and a query started
    afterwards sees all of them. With no writer running, the horizon is the highest id drawn at once.
    """

    def __init__(self) -> None:
        self._proven = 0
        self._candidate: tuple[int, frozenset[str]] | None = None
        self._lock = threading.Lock()

    def advance(self, writers: tuple[int, list[str]]) -> int:
        """Given a row of ``sql.EVENT_ID_DRAWERS``, return the horizon (queries started after it see every id up
        to it)."""
        drawn, drawers = writers
        running = frozenset(drawers)
        with self._lock:
            if self._candidate is not None and not self._candidate[1] & running:
                self._proven = max(self._proven, self._candidate[0])
                self._candidate = None
            if not running:
                self._proven = max(self._proven, drawn)
            elif self._candidate is None:
                self._candidate = (drawn, running)
            return self._proven


class HeldSlots:
    """The flow slots a worker holds (their holder is ``holder``): in use by a call, or free for the worker's next
    call under the same limits until released."""

    def __init__(self, settings: CallbackSettings, owner: str) -> None:
        self.holder = f"{owner}/{uuid.uuid4().hex[:8]}"
        self.ttl = settings.lease_ttl
        limits = settings.flow_scopes()
        self._concurrency = {scope: limits.concurrency for scope, limits in limits.items() if limits is not None}
        self._rated = {scope for scope, limits in limits.items() if limits is not None and limits.rate_limit}
        self._lock = threading.Lock()
        self._free: dict[FlowKey, list[int]] = {}
        self._busy: dict[FlowKey, set[int]] = {}
        self.renewed_at = time.monotonic()

    def assign(self, deliveries: list[Delivery]) -> tuple[dict[FlowKey, list[Delivery]], list[Delivery]]:
        """Give deliveries slots held free here; return, per key, those to ask the database for (in order, those
        with a slot first), and those that must wait (every slot of their key is in use here)."""
        asking: dict[FlowKey, list[Delivery]] = {}
        waiting = []
        with self._lock:
            for d in deliveries:
                key = d.flow
                assert key is not None
                free, busy = self._free.get(key), self._busy.setdefault(key, set())
                if free:
                    d.slot = free.pop()
                    busy.add(d.slot)
                elif (limit := self._concurrency.get(key[0])) is not None and len(busy) >= limit:
                    waiting.append(d)
                    continue
                asking.setdefault(key, []).append(d)
        for ds in asking.values():
            ds.sort(key=lambda d: d.slot is None)
        return asking, waiting

    def rated(self, key: FlowKey) -> bool:
        """Whether calls of ``key`` need a token each (their scope has a rate limit)."""
        return key[0] in self._rated

    def add(self, key: FlowKey, d: Delivery, slot: int) -> None:
        with self._lock:
            d.slot = slot
            self._busy.setdefault(key, set()).add(slot)

    def forget(self, deliveries: list[Delivery]) -> None:
        """The slots of ``deliveries``, not held after all (their take was rolled back)."""
        with self._lock:
            for d in deliveries:
                if d.flow is not None and d.slot is not None:
                    self._busy.get(d.flow, set()).discard(d.slot)
                d.slot = None

    def free(self, delivery: Delivery) -> None:
        """``delivery``'s slot, free for the next call of its key here."""
        key, slot = delivery.flow, delivery.slot
        if key is None or slot is None:
            return
        with self._lock:
            busy = self._busy.get(key)
            if busy is not None and slot in busy:
                busy.discard(slot)
                self._free.setdefault(key, []).append(slot)

    def take_free(self) -> list[tuple[str, str, int]]:
        """The slots free here, no longer held (to release in the transaction that writes outcomes)."""
        with self._lock:
            free, self._free = self._free, {}
            self._busy = {key: slots for key, slots in self._busy.items() if slots}
        return [(scope, key, slot) for (scope, key), slots in free.items() for slot in slots]

    def put_back(self, slots: list[tuple[str, str, int]]) -> None:
        """Slots ``take_free`` gave whose release did not commit: held again."""
        with self._lock:
            for scope, key, slot in slots:
                self._free.setdefault((scope, key), []).append(slot)

    def busy(self) -> list[tuple[str, str, int]]:
        with self._lock:
            return [(scope, key, slot) for (scope, key), slots in self._busy.items() for slot in slots]

    def lost(self, kept: set[tuple[str, str, int]], asked: list[tuple[str, str, int]]) -> None:
        """Of the slots ``asked`` to be renewed, those not ``kept`` (expired first) are no longer held."""
        with self._lock:
            for scope, key, slot in asked:
                if (scope, key, slot) not in kept:
                    self._busy.get((scope, key), set()).discard(slot)

    def usage(self) -> dict[FlowKey, int]:
        """Slots in use here per key."""
        with self._lock:
            return {key: len(slots) for key, slots in self._busy.items() if slots}


class OwnerSecrets:
    """The worker's copy of its owners' active signing secrets, each owner's read again once older than
    ``secrets_refresh`` (by the gate, in its transaction: one query for the owners of a batch, not one per call)."""

    def __init__(self, refresh: float) -> None:
        self.refresh = refresh
        self._known: dict[str, tuple[float, tuple[str, ...]]] = {}  # owner: (read at, secrets)

    def stale(self, owners: set[str], now: float) -> list[str]:
        """Of ``owners``, those whose secrets are to be read."""
        return sorted(o for o in owners if (known := self._known.get(o)) is None or now - known[0] >= self.refresh)

    def update(self, owners: list[str], rows: list[tuple[str, list[str]]], now: float) -> None:
        """What the database says of ``owners`` (those without a row have no active secret)."""
        if len(self._known) > MAX_KEYS_REMEMBERED:
            self._known.clear()  # read again where needed
        found = dict(rows)
        for owner in owners:
            self._known[owner] = (now, tuple(found.get(owner) or ()))

    def of(self, owner: str) -> tuple[str, ...]:
        known = self._known.get(owner)
        return () if known is None else known[1]


class BucketGate:
    """The worker's gate (a :class:`~cmb_dagster.callbacks.delivery.Gate`), on a connection of its own.

    One transaction: the slots of the limits the calls need (one statement, when slots held here do not
    suffice), then the leases of every bucket concerned and the events (one statement); the calls start before
    the commit (cancel, update and delete wait for the row locks until then).
    """

    def __init__(
        self,
        db: Database,
        states: dict[int, BucketState],
        owner: str,
        slots: HeldSlots,
        secrets: OwnerSecrets,
        breakers: Breakers,
        settings: dict[str, str],
    ) -> None:
        self._states = states  # the worker's
        self._owner = owner
        self._slots = slots
        self._secrets = secrets
        self._breakers = breakers
        self._conn = OwnAsyncConnection(db, custom_plans=True, settings=settings)  # planned at each run

    def free(self, delivery: Delivery) -> None:
        self._slots.free(delivery)

    async def __call__(
        self, deliveries: list[Delivery], start: Callable[[list[Delivery]], None]
    ) -> tuple[list[Delivery], list[Delivery], float | None]:
        """Take slots, count and start the deliveries still pending in their polled version; return those gone,
        those waiting for a slot or a token, and the seconds after which to ask again for those (None: when a slot
        frees here)."""
        asking, waiting = self._slots.assign([d for d in deliveries if d.flow is not None])
        if waiting:
            parked = {id(d) for d in waiting}
            deliveries = [d for d in deliveries if id(d) not in parked]
        if not deliveries:
            return [], waiting, None
        leases = []
        for bucket_id in sorted({d.bucket_id for d in deliveries}):  # ascending, as renewals lock them
            state = self._states.get(bucket_id)
            if state is None or state.lease is None:
                raise LeaseLost(f"bucket {bucket_id} is not held")
            leases.append(state.lease)
        params = {
            "kind": LEASE_KIND,
            "owner": self._owner,
            "partitions": [lease.partition for lease in leases],
            "fences": [lease.fence for lease in leases],
            "ids": [d.event_id for d in deliveries],
        }
        conn = await self._conn.get()
        wait = None
        async with conn.transaction():
            signed = {d.owner_client_id for d in deliveries if target_host(d.cb_url) is not None}
            if stale := self._secrets.stale(signed, time.monotonic()):
                read_at = time.monotonic()
                cursor = await conn.execute(sql.ACTIVE_SECRETS, {"owners": stale})
                self._secrets.update(stale, await cursor.fetchall(), read_at)
            for d in deliveries:
                d.secrets = self._secrets.of(d.owner_client_id)
            taken: dict[FlowKey, tuple[int, list[int]]] = {}
            need = {k: ds for k, ds in asking.items() if self._slots.rated(k) or any(d.slot is None for d in ds)}
            new: list[Delivery] = []
            if need:
                grants = await flow.take_async(
                    conn,
                    {key: len(ds) for key, ds in need.items()},
                    holder=self._slots.holder,
                    ttl=self._slots.ttl,
                    holding={key: sum(d.slot is not None for d in ds) for key, ds in need.items()},
                )
                for key, grant in grants.items():
                    taken[key] = (grant.count, grant.slots)
                    if grant.count < len(need[key]):  # slots held elsewhere free at any time; tokens come later
                        key_wait = SLOT_RECHECK if grant.retry_after is None else grant.retry_after
                        wait = key_wait if wait is None else min(wait, key_wait)
            refused: list[Delivery] = []
            for key, ds in need.items():
                granted, slots = taken[key]
                new_slots = iter(slots)
                for n, d in enumerate(ds):
                    if n >= granted:
                        refused.append(d)
                    elif d.slot is None and (slot := next(new_slots, None)) is not None:
                        self._slots.add(key, d, slot)
                        new.append(d)
            if refused:
                out = {id(d) for d in refused}
                passing = [d for d in deliveries if id(d) not in out]
            else:
                passing = deliveries
            params["ids"] = [d.event_id for d in passing]
            params.update(_endpoint_pairs(passing))
            try:
                cursor = await conn.execute(sql.GATE_ALL_CLOSED if self._breakers.all_closed else sql.GATE, params)
                held, go_ids, pending_ids, probe_ids, probed = await cursor.fetchone()
                if held != len(leases):
                    raise LeaseLost(f"buckets {params['partitions']} are not all held by {self._owner}")
            except BaseException:
                self._slots.forget(new)  # taken in this transaction: rolled back with it
                raise
            let_through, pending = set(go_ids), set(pending_ids)
            go = [d for d in passing if d.event_id in let_through]
            if probe_ids:
                probes = dict(zip(probe_ids, probed, strict=True))
                for d in go:
                    d.probe = probes.get(d.event_id)
            if go:
                start(go)
        for d in refused:
            self._slots.free(d)
            d.slot = None
        gone = [d for d in passing if d.event_id not in pending and d.event_id not in let_through]
        return gone, waiting + refused, wait

    async def close(self) -> None:
        await self._conn.close()


def _endpoint_pairs(deliveries: list[Delivery]) -> dict[str, list[Any]]:
    """The gate's parameters naming the endpoints of ``deliveries``: each (owner, endpoint) once, and for each
    delivery the place of its own in that list, from 1 (None: no endpoint)."""
    places: dict[tuple[str, str], int] = {}
    pairs = []
    for d in deliveries:
        if d.endpoint is None:
            pairs.append(None)
        else:
            pairs.append(places.setdefault((d.owner_client_id, d.endpoint), len(places) + 1))
    return {"owners": [k[0] for k in places], "endpoints": [k[1] for k in places], "pairs": pairs}


class Breakers:
    """The endpoints' circuit breakers, as a worker writes them: the answers of its calls, every try, counted per
    endpoint and written with the transitions they cause (within ``COMMIT_EVERY`` of a failure, ``HEALTHY_EVERY`` of
    good answers alone); and the disabling of endpoints open
    too long. Their state is in Postgres (``callback_endpoints``); what is counted here is written within a fraction
    of a second (a crash loses only those counts, never an event)."""

    def __init__(self, default: EndpointPolicy) -> None:
        self.default = default
        self._tallies: dict[tuple[str, str], _Tally] = {}
        self._lock = threading.Lock()
        self._counted_at = math.inf  # monotonic: when the oldest answer not yet written was counted
        self._failed_at = math.inf  # and the oldest failure
        # every endpoint closed, as last read (the worker's upkeep) or written (an open here): the gate then looks up
        # no breaker; one another worker opens is seen here within ENDPOINTS_EVERY
        self.all_closed = False

    def answered(self, delivery: Delivery, answer: Answer) -> None:
        """Count an answer of ``delivery``'s endpoint (from the executor, wherever the call ended): a good one unless
        it is to be retried."""
        assert delivery.endpoint is not None
        with self._lock:
            now = time.monotonic()
            self._counted_at = min(self._counted_at, now)
            if answer.outcome == RETRY:
                self._failed_at = min(self._failed_at, now)
            tally = self._tallies.setdefault((delivery.owner_client_id, delivery.endpoint), _Tally())
            tally.add(answer, delivery.probe is not None)

    def due(self, now: float) -> bool:
        """Whether the answers counted are to be written: a failure within ``COMMIT_EVERY`` (it may open an
        endpoint), good answers alone within ``HEALTHY_EVERY``."""
        return now - self._failed_at >= COMMIT_EVERY or now - self._counted_at >= HEALTHY_EVERY

    def policy(self, stored: str | None) -> EndpointPolicy:
        """An owner's stored policy (JSON; None: the default); an invalid one is the default, with a warning."""
        if stored is None:
            return self.default
        try:
            return stored_endpoint_policy(stored)
        except ValidationError as exc:
            log.warning("an owner's stored endpoint policy is invalid (%s): the default applies", describe(exc))
            return self.default

    def take(self) -> dict[tuple[str, str], _Tally]:
        """The answers counted so far, to write (``give_back`` them if their transaction fails)."""
        with self._lock:
            tallies, self._tallies = self._tallies, {}
            self._counted_at = self._failed_at = math.inf
        return tallies

    def give_back(self, tallies: dict[tuple[str, str], _Tally]) -> None:
        """Counts whose write did not commit, before those counted since."""
        with self._lock:
            for key, tally in tallies.items():
                self._tallies[key] = tally.merged(self._tallies.get(key))
            self._counted_at = self._failed_at = time.monotonic()  # written again after COMMIT_EVERY

    def write(self, conn: psycopg.Connection, tallies: dict[tuple[str, str], _Tally]) -> None:
        """Write ``tallies`` and what they change, in the caller's transaction: an endpoint opens (past its policy's
        failures), closes (any good answer), or waits longer after a failed probe."""
        if not tallies:
            return
        keys = sorted(tallies)  # every writer locks the rows in this order
        rows = conn.execute(
            sql.RECORD_ENDPOINTS,
            {
                "owners": [k[0] for k in keys],
                "endpoints": [k[1] for k in keys],
                "calls": [tallies[k].calls for k in keys],
                "failures": [tallies[k].failures for k in keys],
                "trailing": [tallies[k].trailing for k in keys],
                "errors": [tallies[k].error for k in keys],
                "codes": [tallies[k].code for k in keys],
                "window": self.default.window,
            },
        ).fetchall()
        changes = []
        for endpoint_id, owner, endpoint, state, in_a_row, calls, failures, probes, succeeded, stored in rows:
            policy = self.policy(stored)
            if state == "closed" and policy.opens(in_a_row, calls, failures):
                self.all_closed = False
                changes.append((endpoint_id, "open", 0, policy.probe_interval.delay(0)))
                log.warning(
                    "endpoint %s of owner %s opened: %d failed calls in a row, %d of %d in its window; its due events "
                    "wait, one probe every %gs",
                    endpoint,
                    owner,
                    in_a_row,
                    failures,
                    calls,
                    policy.probe_interval.delay(0),
                )
            elif state == "open" and succeeded:
                changes.append((endpoint_id, "closed", 0, None))
                log.info("endpoint %s of owner %s answered again: closed, its held events go out", endpoint, owner)
            elif state == "open" and tallies[(owner, endpoint)].probe_failed:
                changes.append((endpoint_id, "open", probes + 1, policy.probe_interval.delay(probes + 1)))
        if changes:
            conn.execute(
                sql.ENDPOINT_TRANSITIONS,
                {
                    "ids": [c[0] for c in changes],
                    "states": [c[1] for c in changes],
                    "probes": [c[2] for c in changes],
                    "intervals": [c[3] for c in changes],
                },
            )

    def disable_overdue(self, conn: psycopg.Connection) -> None:
        """Disable the endpoints open longer than their policy's ``disable_after``, each with one notification."""
        rows = conn.execute(
            sql.DISABLE_ENDPOINTS,
            {
                "disable_after": self.default.disable_after,
                "group": HOOK_GROUP,
                "retry": _HOOK_RETRY,
                "lock_timeout": "0",
            },
        ).fetchall()
        for owner, endpoint, opened_at, events, last_error, hooks, _ in rows:
            log.error(
                "endpoint %s of owner %s disabled: open since %s (last error: %s); %d events kept as disabled, %s "
                "(`cmb-dagster callbacks endpoint enable` sends them)",
                endpoint,
                owner,
                opened_at.isoformat(),
                last_error,
                events,
                "its owner's failure hook notified" if hooks else "no failure hook to notify",
            )


@dataclass
class _Tally:
    """The answers of one endpoint counted since they were last written, in the order they came."""

    calls: int = 0
    failures: int = 0
    trailing: int = 0  # failures after the last good answer
    error: str | None = None
    code: int | None = None
    probe_failed: bool = False

    def add(self, answer: Answer, probe: bool) -> None:
        self.calls += 1
        if answer.outcome != RETRY:
            self.trailing = 0
            return
        self.failures += 1
        self.trailing += 1
        self.error, self.code = sanitize(answer.error or ""), answer.status
        self.probe_failed = self.probe_failed or probe

    def merged(self, later: _Tally | None) -> _Tally:
        """This tally followed by ``later`` (answers counted meanwhile)."""
        if later is None:
            return self
        good_since = later.calls > later.failures
        return _Tally(
            calls=self.calls + later.calls,
            failures=self.failures + later.failures,
            trailing=later.trailing if good_since else self.trailing + later.trailing,
            error=later.error or self.error,
            code=later.code if later.failures else self.code,
            probe_failed=self.probe_failed or later.probe_failed,
        )


class CallbackWorker(EngineWorker):
    """Serves buckets: polls due events, calls them through a :class:`DeliveryPool`, writes outcomes.

    ``buckets`` (ids, or a function asked at every lease renewal) limits it to those buckets (default: all,
    including added ones); ``launcher`` starts the runs of ``dagster://`` events. Several workers (threads,
    processes, hosts) may run on the same buckets; each bucket is served by one of them at a time. A stop, asked
    or at the end of the run's time, drains the worker: no more polls, the calls in flight end and their outcomes
    are written, then the buckets are released.
    """

    def __init__(
        self,
        db: DatabaseSource,
        options: CallbackSettings | None = None,
        *,
        owner: str | None = None,
        buckets: Sequence[int] | Callable[[], Sequence[int]] | None = None,
        launcher: JobLauncher | None = None,
    ) -> None:
        super().__init__(db, owner=owner)
        if options is None:
            warnings.warn(
                "CallbackWorker(db) is deprecated: pass the settings, CallbackWorker(db, CallbackSettings())",
                DeprecationWarning,
                stacklevel=2,
            )
        self.settings = options or CallbackSettings()
        self.buckets = buckets
        self.launcher = launcher
        self._states: dict[int, BucketState] = {}
        self._live: set[int] = set()  # the buckets that exist, as of the last lease renewal
        self._moved: set[tuple[int, int]] = set()  # (bucket, fence): removed buckets whose events this worker moved
        self._pool: DeliveryPool | None = None
        self._bucket_loop: BucketLoop | None = None
        # its own, with no pool check on the path of every call, and planned at each run: a plan cached while
        # callback_events was small (a sequential scan) would be kept as it grows
        # a transaction left open by a stopped process (it holds its buckets' leases key-share-locked) is ended by
        # the server once idle for the lease's TTL, so another worker can take the buckets over
        ended = {"idle_in_transaction_session_timeout": f"{int(self.settings.lease_ttl * 1000)}ms"}
        self._loop_conn = OwnConnection(self.db, custom_plans=True, settings=ended)  # polls and outcome writes
        self._slots = HeldSlots(self.settings, self.owner)
        secrets = OwnerSecrets(self.settings.secrets_refresh)
        self._breakers = Breakers(self.settings.endpoint_policy)
        self._gate = BucketGate(self.db, self._states, self.owner, self._slots, secrets, self._breakers, ended)
        self._flow_key = functools.lru_cache(maxsize=4096)(self.settings.flow_key)
        self._endpoints_at = 0.0
        self._draining = threading.Event()
        self._woken: set[int] = set()  # buckets a notification made due now: polled ahead of the loop's order
        self._woken_lock = threading.Lock()
        self._horizon = EventIdHorizon()
        self.delivered = 0
        self._window_started = time.monotonic()
        self._failures_in_window = self._failures_not_logged = 0
        self._stuck_check_at = 0.0

    def loops(self) -> list[Worker]:
        """One loop over the buckets, with a fresh pool of calls; the limits of the settings registered."""
        register_limits(self.db, self.settings)
        self._draining.clear()
        self._bucket_loop = BucketLoop(self)
        self._pool = DeliveryPool(
            self.settings,
            self.launcher,
            gate=self._gate,
            on_broken=lambda _exc: self.stop(),
            on_answer=self._breakers.answered,
        )
        return [self._bucket_loop]

    def finish(self) -> None:
        """Let the last calls end and close the connections; raise if the dispatcher failed (a bug of ours: the
        worker stopped and released its buckets to others)."""
        if self._pool is None:
            return
        try:
            self._pool.close(timeout=self._longest_call())
        finally:
            self._loop_conn.close()
        if self._pool.broken is not None:
            raise RuntimeError("the callback worker stopped: its dispatcher failed") from self._pool.broken

    def _drain(self, then: Callable[[], None]) -> None:
        """Stop polling and give back the calls not started; ``then`` (the loop's stop) once the calls in flight
        have ended and their outcomes are written, or after the longest call."""
        if self._draining.is_set():
            return
        self._draining.set()
        if self._pool is not None:
            self._pool.abandon_waiting()
        self._wake()
        threading.Thread(target=self._stop_when_drained, args=(then,), name="cmb-callback-drain", daemon=True).start()

    def _stop_when_drained(self, then: Callable[[], None]) -> None:
        deadline = time.monotonic() + self._longest_call()
        while time.monotonic() < deadline:
            if (self._pool is None or self._pool.busy == 0) and not any(map(self._to_write, self._states.values())):
                break
            self._wake()
            time.sleep(0.02)
        then()

    @staticmethod
    def _to_write(state: BucketState) -> bool:
        """Whether ``state`` has outcomes its worker can still write (those of a bucket lost are the next holder's)."""
        return bool(state.done) and state.lease is not None and state.lease.valid_for(0)

    def _wake(self) -> None:
        if self._bucket_loop is not None:
            self._bucket_loop.wake()

    def _on_notify(self, _channel: str, payload: str | None) -> None:
        """A hint: an event due before the next poll was created in a bucket (None: maybe in any).

        The bucket is polled when the event enters the lookahead: at once if it is due already.
        """
        bucket, _, epoch = (payload or "").partition(":")
        try:
            due_in = float(epoch) - time.time() - self.settings.lookahead if epoch else 0.0
        except ValueError:
            due_in = 0.0
        poll_at = time.monotonic() + max(0.0, due_in)
        for bucket_id, state in list(self._states.items()):
            if payload is None or bucket == str(bucket_id):
                state.next_poll = min(state.next_poll, poll_at)
                if due_in <= 0:
                    with self._woken_lock:
                        self._woken.add(bucket_id)
        self._wake()

    @contextmanager
    def _on_loop_connection(self, *, pipeline: bool, transaction: bool) -> Iterator[psycopg.Connection]:
        """The worker loop's own connection. Without ``transaction`` each statement commits alone (polls only
        read); the pipeline sends statements without waiting for each one's answer, and syncs before the
        transaction commits."""
        conn = self._loop_conn.get()
        with conn.transaction() if transaction else nullcontext(), conn.pipeline() if pipeline else nullcontext():
            yield conn

    def partitions(self) -> list[str]:
        """The buckets to hold (asked at every lease renewal): those served, and those with outcomes to write."""
        self._live, self._moved = set(bucket_ids(self.db)), set()
        if self.buckets is None:
            ids = served_bucket_ids(self.db)
        else:
            ids = list(self.buckets() if callable(self.buckets) else self.buckets)
        busy = [b for b, state in self._states.items() if state.in_flight or state.done]  # kept until written
        return [str(b) for b in sorted({*ids, *busy})]

    def _longest_call(self) -> float:
        # no call starts once the lease could lapse before it ends, and no poll extends it while draining
        return self.settings.lease_ttl + self.settings.timeout + 1

    # -- one step for one bucket ---------------------------------------------------------------------

    def step(self, lease: Lease) -> int:
        """Write finished outcomes, then poll when due; return how many events this handled."""
        if int(lease.partition) not in self._live:
            return self._retire(lease)
        handled = self._poll_woken()
        state = self._state(lease)
        now = time.monotonic()
        with state.lock:
            ready = len(state.done) >= COMMIT_BATCH or (state.done and now - state.last_commit >= COMMIT_EVERY)
        if ready or (self._draining.is_set() and state.done):
            handled += self._commit(lease, state) + self._poll_woken()
        if not self._draining.is_set() and now >= state.next_poll:
            handled += self._poll(lease, state)
        self._keep_slots(now)
        if self._breakers.due(now):
            tallies = self._breakers.take()
            try:
                with self._on_loop_connection(pipeline=False, transaction=True) as conn:
                    self._breakers.write(conn, tallies)
            except BaseException:
                self._breakers.give_back(tallies)
                raise
        if now >= self._endpoints_at and not self._draining.is_set():
            self._endpoints_at = now + ENDPOINTS_EVERY
            handled += self._tend_endpoints()
        if now >= self._stuck_check_at:  # a worker whose every call slot hangs stops (WorkerStuck), releasing all
            self._stuck_check_at = now + STUCK_CHECK_EVERY
            self._pool.check()
        return handled

    def _keep_slots(self, now: float) -> None:
        """Renew the slots in use here every third of their time-to-live, and release those free here."""
        if now - self._slots.renewed_at < self._slots.ttl / 3:
            return
        self._slots.renewed_at = now
        free, busy = self._slots.take_free(), self._slots.busy()
        if not free and not busy:
            return
        try:
            with self._on_loop_connection(pipeline=False, transaction=True) as conn:
                flow.release(conn, free, holder=self._slots.holder)
                kept = flow.renew(conn, busy, holder=self._slots.holder, ttl=self._slots.ttl)
        except BaseException:
            self._slots.put_back(free)
            raise
        self._slots.lost(kept, busy)

    def _tend_endpoints(self) -> int:
        """Disable the endpoints open longer than their policy allows, send the probes that are due, and one batch of
        a closed endpoint's held events again; return how many events were released."""
        with self._on_loop_connection(pipeline=False, transaction=True) as conn:
            conn.execute(sql.NO_SEQSCAN)
            self._breakers.disable_overdue(conn)
            probing, releasing, self._breakers.all_closed = conn.execute(sql.ENDPOINT_WORK).fetchone()
        released = 0
        if probing or releasing:
            with self._on_loop_connection(pipeline=False, transaction=True) as conn:
                conn.execute(sql.NO_SEQSCAN)
                conn.execute(sql.LOCK_EVENT_IDS, {"lock_timeout": "0"})  # new ids drawn as a create draws them
                if probing:
                    conn.execute(sql.PROBE_HELD)
                if releasing:
                    found, released, _ = conn.execute(sql.RELEASE_HELD, {"limit": RELEASE_BATCH}).fetchone()
                    if found and released == RELEASE_BATCH:
                        self._endpoints_at = 0.0  # more to release: at the next step
        return released

    def _poll_woken(self) -> int:
        """Poll the buckets a notification made due now, before this step's own work (whichever bucket it is for).

        A failure is left to that bucket's own step, which polls it again and reports it.
        """
        with self._woken_lock:
            woken, self._woken = self._woken, set()
        handled = 0
        for bucket_id in sorted(woken):
            state = self._states.get(bucket_id)
            if state is None or state.lease is None or self._draining.is_set() or bucket_id not in self._live:
                continue
            try:
                handled += self._poll(state.lease, state)
            except Exception as exc:  # noqa: BLE001 - reported by the bucket's own step
                log.debug("bucket %s: early poll failed (%s)", bucket_id, exc)
        return handled

    def _retire(self, lease: Lease) -> int:
        """A removed bucket: write the outcomes of its calls, then, none left in flight, move its pending events."""
        if (int(lease.partition), lease.fence) in self._moved:
            return 0
        state = self._state(lease)
        handled = self._commit(lease, state) if state.done else 0
        with state.lock:
            if state.in_flight or state.done:
                return handled
        moved = move_bucket_events(self.db, lease, self.settings.move_batch)
        if moved:
            log.info("bucket %s was removed: %d pending events moved to the remaining buckets", lease.partition, moved)
        if moved < self.settings.move_batch:  # all moved; otherwise the next step moves the next batch
            self._states.pop(state.bucket_id, None)
            self._moved.add((state.bucket_id, lease.fence))
        return handled + moved

    def _state(self, lease: Lease) -> BucketState:
        bucket_id = int(lease.partition)
        state = self._states.get(bucket_id)
        if state is not None and state.fence == lease.fence:
            state.lease = lease
            return state
        with self.db.connection() as conn:
            saved = conn.execute(sql.LOAD_WATERMARK, {"bucket": bucket_id}).fetchone()
        run_at, cursor_id, seen = saved or (EARLIEST_RUN_AT, 0, 0)  # a removed bucket has no row
        if state is None:
            state = self._states[bucket_id] = BucketState(bucket_id, lease.fence, (run_at, cursor_id), seen)
        else:  # the lease lapsed and came back: continue from the saved watermark, keep the calls in flight
            with state.lock:
                state.fence, state.cursor, state.seen_event_id = lease.fence, (run_at, cursor_id), seen
        state.lease = lease
        return state

    def _poll(self, lease: Lease, state: BucketState) -> int:
        busy = self._pool.busy if self._pool is not None else 0
        room = min(self.settings.poll_batch_size, self.settings.max_in_flight - busy)
        if room <= 0:
            return 0
        params = {"bucket": state.bucket_id, "lookahead": self.settings.lookahead, "limit": room}
        with state.lock:
            cursor, seen, held = state.cursor, state.seen_event_id, list(state.urgent)
        # the lease, the writers, the queries: one round trip
        with self._on_loop_connection(pipeline=True, transaction=False) as conn:
            asked_at = time.monotonic()  # before the database clock is read: the lease deadline errs early
            remaining_cur = conn.execute(sql.LEASE_REMAINING, _lease_params(lease))
            drawers_cur = conn.execute(sql.EVENT_ID_DRAWERS)
            ahead_cur = conn.execute(sql.POLL_AHEAD, {**params, "run_at": cursor[0], "event_id": cursor[1]})
            late_cur = conn.execute(sql.POLL_LATE, {**params, "run_at": cursor[0], "max_event_id": seen})
            urgent_cur = conn.execute(sql.POLL_URGENT, {**params, "held": held})
        read_at = time.monotonic()  # after the database clock is read: due times err late, never early
        remaining = remaining_cur.fetchone()
        if remaining is None:
            raise LeaseLost(f"bucket {state.bucket_id} is no longer held by {lease.owner}")
        state.lease_deadline = asked_at + remaining[0]
        horizon = self._horizon.advance(drawers_cur.fetchone())
        ahead, late, urgent = ahead_cur.fetchall(), late_cur.fetchall(), urgent_cur.fetchall()
        if ahead:
            cursor = max(cursor, (ahead[-1][1], ahead[-1][0]))
        full = len(ahead) == room or len(late) == room
        new_seen = min(late[-1][0], horizon) if len(late) == room else horizon
        fresh = []
        with state.lock:
            state.cursor = max(state.cursor, cursor)
            state.seen_event_id = max(state.seen_event_id, new_seen)
            for row in (*urgent, *ahead, *late):
                if row[0] not in state.in_flight:
                    state.in_flight[row[0]] = (row[1], row[0])
                    if row[PRIORITY_COLUMN] > 0:
                        state.urgent.add(row[0])
                    fresh.append(row)

        def deadline() -> float:
            return state.lease_deadline

        for row in fresh:
            (
                event_id,
                run_at,
                originally,
                owner,
                group,
                key,
                url,
                context,
                body,
                retry,
                attempts,
                main_retries,
                message_id,
                due_in,
                priority,
                endpoint_name,
            ) = row
            try:
                policy = stored_policy(retry)
            except Exception as exc:  # noqa: BLE001 - one bad stored row fails alone, the bucket goes on
                policy = None
                detail = describe(exc) if isinstance(exc, ValidationError) else type(exc).__name__
                error = f"stored retry policy is invalid: {sanitize(detail, 300)}"
            delivery = Delivery(
                bucket_id=state.bucket_id,
                event_id=event_id,
                run_at=run_at,
                originally_run_at=originally,
                owner_client_id=owner,
                group_key=group,
                event_key=key,
                cb_url=url,
                context_json=context,
                context_only=body == CONTEXT,
                retry=policy or RetryPolicy(),
                attempts=attempts,
                main_retries=main_retries,
                due=read_at + max(0.0, due_in),
                lease_deadline=deadline,
                on_done=lambda d, s=state: self._on_done(s, d),
                priority=priority,
                flow=self._flow_key(owner, group, target_host(url), endpoint := endpoint_name or endpoint_of(url)),
                message_id=message_id,
                endpoint=endpoint,
            )
            if policy is None:
                delivery.outcome, delivery.error = FAILED, error
                self._on_done(state, delivery)
            else:
                self._pool.submit(delivery)
        state.next_poll = 0.0 if full else time.monotonic() + self.settings.poll_interval
        return len(fresh)

    def _on_done(self, state: BucketState, delivery: Delivery) -> None:
        with state.lock:
            state.done.append(delivery)
            many = len(state.done) >= COMMIT_BATCH
        if many:
            self._wake()

    def _commit(self, lease: Lease, state: BucketState) -> int:
        with state.lock:
            batch, state.done = state.done, []
        finished = [d for d in batch if d.outcome not in (ABANDONED, GONE)]
        try:
            try:
                self._write(lease, state, batch, finished, careful=False)
            except psycopg.Error as exc:
                if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                    raise
                # one outcome that cannot be written must not hold the others back: one row at a time
                log.warning(
                    "bucket %s: outcomes could not be written together (%s); one at a time", state.bucket_id, exc
                )
                self._write(lease, state, batch, finished, careful=True)
        except BaseException:
            with state.lock:  # not written: keep them (and their places) for the next try
                for d in batch:
                    state.in_flight.setdefault(d.event_id, d.position)
                state.done[:0] = batch
            raise
        state.last_commit = time.monotonic()
        self.delivered += sum(1 for d in finished if d.outcome != "retry")
        self._report(finished)
        return len(batch)

    def _report(self, finished: list[Delivery]) -> None:
        """Log failed calls (at most ``FAILURES_LOGGED_PER_WINDOW`` per 30 s) and a progress line every 30 s."""
        now = time.monotonic()
        if now - self._window_started >= REPORT_EVERY_SECONDS:
            if self._failures_not_logged:
                log.warning(
                    "%d more failed calls in the last %.0fs were not logged one by one",
                    self._failures_not_logged,
                    now - self._window_started,
                )
            log.info(
                "callbacks worker %s: %d calls done so far, %d failed in the last %.0fs",
                self.owner,
                self.delivered,
                self._failures_in_window,
                now - self._window_started,
            )
            self._window_started, self._failures_in_window, self._failures_not_logged = now, 0, 0
        for d in finished:
            if d.outcome not in (FAILED, RETRY):
                continue
            self._failures_in_window += 1
            if self._failures_in_window > FAILURES_LOGGED_PER_WINDOW:
                self._failures_not_logged += 1
                continue
            after = "gives up" if d.outcome == FAILED else f"retries in {d.retry_delay:.0f}s"
            log.warning(
                "callback %s/%s/%s (event %s, attempt %s) failed: %s; %s",
                d.owner_client_id,
                d.group_key,
                d.event_key,
                d.event_id,
                d.attempts,
                d.error,
                after,
            )

    def _write(
        self, lease: Lease, state: BucketState, batch: list[Delivery], finished: list[Delivery], *, careful: bool
    ) -> None:
        free = self._slots.take_free()  # the slots the finished calls held, unless used again meanwhile
        try:
            self._write_outcomes(lease, state, batch, finished, free, careful=careful)
        except BaseException:
            self._slots.put_back(free)
            raise

    def _write_outcomes(
        self,
        lease: Lease,
        state: BucketState,
        batch: list[Delivery],
        finished: list[Delivery],
        free: list[tuple[str, str, int]],
        *,
        careful: bool,
    ) -> None:
        with self._on_loop_connection(pipeline=not careful, transaction=True) as conn:
            Leases.check(conn, lease)
            with state.lock:
                for d in batch:
                    state.in_flight.pop(d.event_id, None)
                    state.urgent.discard(d.event_id)
                for d in batch:  # never called: let query 1 find it again
                    if d.outcome == ABANDONED:
                        state.cursor = min(state.cursor, (d.run_at, d.event_id - 1))
                cursor, saved, seen = state.cursor, state.saved_cursor(), state.seen_event_id
            if finished and not careful:
                conn.execute(sql.FINISH_EVENTS, _outcomes(finished, cursor))
            for d in finished if careful else ():
                try:
                    with conn.transaction():
                        conn.execute(sql.FINISH_EVENTS, _outcomes([d], cursor))
                except psycopg.Error as exc:
                    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                        raise
                    reason = sanitize(str(exc).partition("\n")[0], 200)
                    error = f"outcome {d.outcome} could not be written: {reason}"
                    log.warning("event %s: %s", d.event_id, error)
                    conn.execute(sql.FAIL_EVENT, {"event_id": d.event_id, "error": error})
            # the events that may have failed for good here (a retry past its deadline; any, written one at a time)
            if failed := [d.event_id for d in finished if careful or d.outcome in (FAILED, RETRY, HELD)]:
                conn.execute(sql.INSERT_FAILURE_HOOKS, _hook_params(failed))
            conn.execute(
                sql.SAVE_WATERMARK,
                {"bucket": state.bucket_id, "run_at": saved[0], "event_id": saved[1], "max_event_id": seen},
            )
            flow.release(conn, free, holder=self._slots.holder)


class BucketLoop(Worker):
    """The loop of a :class:`CallbackWorker` over its buckets, woken by the NOTIFY of a create due soon.

    Stopping it, when asked or at the end of its time, drains the worker first. Its reports (progress and final)
    count as ``items`` the events whose calls ended.
    """

    def __init__(self, worker: CallbackWorker) -> None:
        super().__init__(
            worker.db,
            LEASE_KIND,
            worker.partitions,
            worker.step,
            owner=worker.owner,
            ttl=worker.settings.lease_ttl,
            idle_sleep=min(COMMIT_EVERY, worker.settings.poll_interval),
            channels=[channel_name(worker.db, sql.CHANNEL)],
            on_notify=worker._on_notify,
        )
        self._worker = worker

    def run(self, duration: float | None = None) -> WorkerReport:
        """Loop until stopped; a stop at the end of ``duration`` drains like any other."""
        delivered = self._worker.delivered

        def counted(report: WorkerReport) -> WorkerReport:
            report.items = self._worker.delivered - delivered
            return report

        if (progress := self.on_progress) is not None:
            self.on_progress = lambda report: progress(counted(report))
        timer = None if duration is None else threading.Timer(duration, self.stop)
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            return counted(super().run())
        finally:
            if timer is not None:
                timer.cancel()

    def stop(self) -> None:
        """Drain the worker, then end the loop."""
        self._worker._drain(super().stop)


def _outcomes(finished: list[Delivery], cursor: Position) -> dict[str, object]:
    return {
        "ids": [d.event_id for d in finished],
        "outcomes": [d.outcome for d in finished],
        "errors": [d.error for d in finished],
        "delays": [d.retry_delay for d in finished],
        "codes": [d.status_code for d in finished],
        "responses": [d.response for d in finished],
        "probed": [d.probe for d in finished],
        "cursor_run_at": cursor[0],
    }


_HOOK_RETRY = RetryPolicy().model_dump_json()


def _hook_params(ids: list[int]) -> dict[str, object]:
    """Parameters of ``sql.INSERT_FAILURE_HOOKS`` for the events ``ids`` (those that failed for good get a hook)."""
    return {"ids": ids, "group": HOOK_GROUP, "retry": _HOOK_RETRY, "lock_timeout": "0"}


@functools.lru_cache(maxsize=1024)
def stored_endpoint_policy(text: str) -> EndpointPolicy:
    """A stored endpoint policy (JSON text), validated once per distinct text."""
    return EndpointPolicy.model_validate_json(text)


@functools.lru_cache(maxsize=1024)
def stored_policy(text: str) -> RetryPolicy:
    """A stored retry policy (JSON text), validated once per distinct text (policies are mostly shared)."""
    return RetryPolicy.model_validate_json(text)


def bucket_ids(db: Database) -> list[int]:
    """The ids of every bucket, ascending."""
    with db.connection() as conn:
        return [row[0] for row in conn.execute(sql.BUCKET_IDS)]


def _lease_params(lease: Lease) -> dict[str, object]:
    return {"kind": lease.kind, "partition": lease.partition, "owner": lease.owner, "fence": lease.fence}


def served_bucket_ids(db: Database) -> list[int]:
    """The buckets workers serve: every bucket, and removed ones whose pending events have not moved yet."""
    with db.connection() as conn:
        live = [row[0] for row in conn.execute(sql.BUCKET_IDS)]
        return live + [row[0] for row in conn.execute(sql.STRANDED_BUCKETS)]


def bucket_slice(db: Database, index: int, workers: int) -> Callable[[], list[int]]:
    """The buckets worker ``index`` of ``workers`` serves (id % workers == index), asked again at each lease
    renewal: a raised or lowered bucket count is picked up."""
    if not 0 <= index < workers:
        raise InvalidCallbackInput(f"index: expected 0 to {workers - 1} for {workers} workers, not {index}")
    return lambda: [b for b in served_bucket_ids(db) if b % workers == index]


def move_stranded_events(db: Database, batch: int) -> int:
    """Move the pending events of removed buckets no worker holds to live buckets, ``batch`` per transaction; return
    how many moved.

    A removed bucket still held is left to its worker, which moves its events once its calls have ended.
    """
    with db.connection() as conn:
        stranded = [str(row[0]) for row in conn.execute(sql.STRANDED_BUCKETS)]
    leases = Leases(db, LEASE_KIND, owner=f"cmb-buckets:{default_owner()}", ttl=60)
    held = leases.acquire(stranded) if stranded else {}
    moved = 0
    try:
        for partition, lease in held.items():
            while (done := move_bucket_events(db, lease, batch)) == batch:
                moved += done
                lease = leases.acquire([partition])[partition]  # renewed between batches
            moved += done
    finally:
        if held:
            leases.release(held)
    return moved


def move_bucket_events(db: Database, lease: Lease, batch: int) -> int:
    """Move up to ``batch`` pending events of the removed bucket ``lease`` holds to live buckets; return how many."""
    with db.connection() as conn:
        conn.execute(sql.LOCK_EVENT_IDS, {"lock_timeout": "0"})  # new ids drawn as inserts draw them: the horizon waits
        Leases.check(conn, lease)
        return conn.execute(sql.MOVE_EVENTS, {"bucket": int(lease.partition), "limit": batch}).fetchone()[0]


def register_limits(db: Database, settings: CallbackSettings) -> None:
    """Record the limits of ``settings`` for every worker (the per-owner limits no longer given are forgotten)."""
    scopes = settings.flow_scopes()
    with db.connection() as conn:
        registered = [limits.scope for limits in flow.scopes(conn, OWNER_SCOPE)]
        flow.register(conn, {**dict.fromkeys(registered), **scopes})
