"""The processing engine: calls of stages over many shards, as many at once as the worker's executor has slots.

The worker's loop never waits on user code. Each of its steps over the shards it holds:

1. **collects** the calls that ended (:meth:`Engine.collect`) and **commits** their outcomes in one transaction:
   the leases they were claimed under (key-share-locked until commit) and the shard count again; the entities
   locked (``FOR NO KEY UPDATE``) and their versions compared: the entity version and S's state version must be
   those loaded. Each entity is checked on its own: a conflicted entity keeps its entry (counted) and is loaded
   again, the others commit their entity (version + 1), state, timer (or deleted entry), the offers of the other
   stages, the post-save publication and the counters. A commit refused for the data of one entry is split until
   that entry is alone; it then fails like a ``process`` that raised, and the others commit. Then the calls free
   their flow slots (a dead worker's free themselves when their time-to-live, the lease TTL, passes);
2. runs the **change path** (:meth:`Engine.ask_changes`): the stages are asked ``should_process`` about the
   changed entities in calls of user code (chunks of entities); the batch's offers commit once every chunk
   answered or passed its time limit (then its entities are offered anyway);
3. **claims** due entries (:meth:`Engine.start_batch`) for the executor's free slots, and for fast stages as many
   as calls ended in the last second (those wait for a slot, at most ``batch_seconds``): for each S without a key
   it first takes flow slots (``max_parallelism``, one per call) and tokens (``rate_limit``, one per call) from
   :mod:`cmb_dagster.flow`: an S that gets none waits. One statement, committed before any stage runs, checks
   the worker's leases and the shard count and claims each (shard, stage)'s due entries, the low-priority lane
   only where the main one has nothing due, one entry per entity and none of an entity whose call still runs
   (one stage works on an entity at a time), about ``max_batch_bytes`` of payload; each entry's ``crashes``
   goes up by one (see :mod:`cmb_dagster.isolation`: an entry whose earlier run never ended is claimed alone,
   and parked after the stage's ``max_crashes``), and each entity is loaded with its version and every stage's
   state. For each S with a key, the entries of each key take that key's slots and tokens; those that get none
   are released at once and kept out of this worker's claims until their key may go again. Then ``S.process``
   starts for each in a free slot, with no transaction open; while calls end within milliseconds of each other,
   the waiting entries start in the slots they free (:meth:`Engine.pump`).

Calls run in the worker's :class:`~cmb_dagster.executor.Executor`: ``async def`` ones on its event loop,
cancelled at the stage's ``timeout``; others in threads, or in child processes killed at the timeout
(``isolation="process"``). An entity stays held until its call has really ended: a thread past its timeout keeps
its entity (no other call of it starts) and its flow slot until it returns, and then fails. A ``process`` that
raises (``SystemExit`` too), returns something invalid or times out leaves the entity unchanged; its entry is
retried after the stage's ``backoff`` and parked after ``max_attempts``.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import psycopg

from cmb_dagster import flow
from cmb_dagster.database import Database, OwnConnection
from cmb_dagster.executor import Executor, Isolation, RemoteError, Task, is_coroutine_function
from cmb_dagster.flow import FlowLimits, RateLimit
from cmb_dagster.inputs import max_payload_bytes, to_json
from cmb_dagster.isolation import describe_error, split_until_alone
from cmb_dagster.stages import sql
from cmb_dagster.stages.errors import InvalidStageResult, ShardCountChanged
from cmb_dagster.stages.models import DEFAULT_CONCURRENCY, Entity, MergePatch, StageResult, changed_fields, merge_patch
from cmb_dagster.stages.stage import Stage, check_stages, due_of, parallel_scope, rate_scope
from cmb_dagster.workers import Lease, Leases

log = logging.getLogger("cmb_dagster.stages")

MAIN, LOW = 0, 1
SLOT_RETRY = 0.05
"""Seconds before a stage (or key) whose flow slots were all taken asks again."""
HELD_BACK_MAX = 20_000
"""Entities of one stage a worker keeps out of its claims while their key waits for tokens or a slot."""
MAX_BATCH_BYTES = 16 * 1024 * 1024
"""Payload bytes a claim loads at most (one entity bigger than that is loaded alone)."""
ASK_CHUNK = 100
"""Entities whose stages one call of user code asks ``should_process`` (the change path, the rescan)."""
BATCH_SECONDS = 2.0
"""Seconds a claimed entry may wait for a free slot before it is released (claimed again later)."""
AHEAD_SECONDS = 1.0
"""A claim takes as many entries as calls ended in the last this many seconds (the next ones start as slots free
up), at least the free slots: fast stages claim in big batches, slow ones claim little ahead."""
PUMP_SECONDS = 0.5
"""Longest a worker's step starts waiting entries in the slots of calls that end quickly (:meth:`Engine.pump`)."""
PUMP_GAP = 0.005
"""Seconds :meth:`Engine.pump` waits for the next call to end; none by then: the calls are slow, the step goes on."""
WAIT_STEP = 0.05
"""Seconds between two looks at the calls a caller waits for (:meth:`Engine.process_batch`, the rescan)."""

# the counters of stage_counters, in this order
PROCESSED, CHANGED, CONFLICTS, ERRORS, PARKED, CAPPED = range(6)

Slots = set[flow.HeldSlot]
"""Flow slots held: {(scope, key, slot)}."""


@dataclass
class BatchReport:
    """What a claim (and, for :meth:`Engine.process_batch` and :meth:`Engine.collect`, a commit) did."""

    taken: int = 0
    processed: int = 0
    changed: int = 0
    conflicts: int = 0
    errors: int = 0
    parked: int = 0
    capped: int = 0
    offered: int = 0
    ended: int = 0  # calls whose outcome was collected
    held_back: int = 0  # claimed entries released at once: their key had no tokens or flow slot
    blocked_until: float | None = None  # monotonic time a rate limit / parallelism lets the stage go again

    def add(self, other: BatchReport) -> None:
        """Add the counts of ``other`` (a later report of the same calls)."""
        for name in ("processed", "changed", "conflicts", "errors", "parked", "capped", "offered", "ended"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _Counts:
    by_stage: dict[str, list[int]] = field(default_factory=dict)

    def add(self, stage: str, index: int, n: int = 1) -> None:
        if n:
            self.by_stage.setdefault(stage, [0] * 6)[index] += n

    def total(self, index: int) -> int:
        return sum(c[index] for c in self.by_stage.values())


Offer = tuple[str, str, datetime]  # entity id, stage, due


@dataclass(eq=False)
class _Claimed:
    """A queue entry claimed for a call of its stage, with what the call needs, the lease of its shard it was
    claimed under and the flow slots it holds."""

    entity: Entity | None  # None: the entity is gone
    stage: Stage
    attempts: int
    crashes: int  # runs of the entry that never ended before this claim
    shard: int
    states: dict[str, Any]
    ready: set[str]
    lease: Lease | None = None
    shard_count: int | None = None  # the shard count it was claimed with
    slots: Slots = field(default_factory=set)
    claimed_at: float = field(default_factory=time.monotonic)
    task: Task[Any] | None = None  # its call, once started

    @property
    def label(self) -> str:
        return f"stage {self.stage.name} on {self.entity_id!r}"

    @property
    def entity_id(self) -> str:
        return self.entity.id if self.entity is not None else "?"


@dataclass(eq=False)
class _Outcome:
    """How a claimed entry ends in a commit."""

    claimed: _Claimed
    entity_id: str
    kind: Literal["done", "failed", "gone"]
    new_payload: dict[str, Any] | None = None
    payload_text: str | None = None
    state_text: str | None = None
    state_changed: bool = False
    due: datetime | None = None
    offers: list[Offer] = field(default_factory=list)
    capped: list[str] = field(default_factory=list)
    error: str | None = None
    stage: Stage = field(init=False)

    def __post_init__(self) -> None:
        self.stage = self.claimed.stage


@dataclass
class _Computed:
    """What a call of user code produced for one entry (returned by the call, so it can be sent back from a child
    process)."""

    new_payload: dict[str, Any] | None
    payload_text: str | None
    state_text: str | None
    state_changed: bool
    due: datetime | None
    offers: list[Offer]
    capped: list[str]


@dataclass(eq=False)
class _Change:
    """An entity to ask the stages about: changed (the change path) or met by the rescan."""

    id: str
    entity: Entity | None  # None: the entity is gone
    fields: list[str] | None  # the changed payload keys (None: any)
    seen: str  # the change's xmin when it was read
    states: dict[str, Any]
    ready: set[str]


@dataclass(eq=False)
class _AskChunk:
    """Entities whose stages one call of user code asks ``should_process``; ``answers`` (offers and capped
    stages per entity) once it returned, None when it failed or passed its time limit."""

    changes: list[_Change]
    now: datetime
    task: Task[Any] | None = None
    settled: bool = False
    answers: list[tuple[list[Offer], list[str]]] | None = None

    @property
    def label(self) -> str:
        return f"should_process on {self.changes[0].id!r} and {len(self.changes) - 1} more"

    def settle(self) -> bool:
        """Take the answers of the call once it ended, or none once it passed its time limit (a thread still
        running keeps its executor slot; its answers are dropped); whether the chunk is settled."""
        task = self.task
        if self.settled or task is None:
            return self.settled
        if task.ended:
            if task.error is not None:
                log.warning("stages: %s failed (%s)", self.label, _error_text(task.error))
            else:
                self.answers = task.result
        elif task.seconds > task.timeout:
            log.error("stages: %s ran past its %g s limit; its answers are dropped", self.label, task.timeout)
        else:
            return False
        self.settled = True
        return True


@dataclass(eq=False)
class _ChangeBatch:
    """The change path's batch being asked: its changes, its chunks and the leases it was read under."""

    changes: list[_Change]
    chunks: list[_AskChunk]
    leases: Sequence[Lease]
    shard_count: int | None
    shard: int
    waiting: deque[_AskChunk] = field(init=False)

    def __post_init__(self) -> None:
        self.waiting = deque(self.chunks)

    @property
    def answered(self) -> bool:
        return not self.waiting and all(chunk.settle() for chunk in self.chunks)


def _within_limits(rows: list[tuple[Any, ...]], limits: dict[str, int]) -> list[tuple[Any, ...]]:
    """At most ``limits[stage]`` rows of each stage (the rest stay queued)."""
    taken: dict[str, int] = {}
    kept = []
    for row in rows:
        stage = row[2]
        if taken.get(stage, 0) < limits[stage]:
            taken[stage] = taken.get(stage, 0) + 1
            kept.append(row)
    return kept


def _chunks(changes: list[_Change], now: datetime) -> list[_AskChunk]:
    asked = [c for c in changes if c.entity is not None]
    return [_AskChunk(asked[i : i + ASK_CHUNK], now) for i in range(0, len(asked), ASK_CHUNK)]


def _stuck(task: Task[Any]) -> bool:
    """Whether a call runs on past its time limit (a thread, which cannot be stopped)."""
    return not task.ended and task.seconds > task.timeout


def _error_text(exc: BaseException) -> str:
    """What a failed call stores: a child process's error as it described it, any other described here."""
    return str(exc) if isinstance(exc, RemoteError) else describe_error(exc)


class Engine:
    """Runs calls of stages over shards in an :class:`~cmb_dagster.executor.Executor` of ``concurrency`` slots;
    used by :class:`~cmb_dagster.stages.worker.StageWorker`, the rescan and tests. One thread uses an engine at a
    time (it keeps a connection of its own); ``on_end`` is called from the executor each time a call ends."""

    def __init__(
        self,
        db: Database,
        stages: Sequence[Stage],
        *,
        batch_size: int = 500,
        publish: bool = True,
        idle_timeout: float = 30.0,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        batch_seconds: float = BATCH_SECONDS,
        owner: str | None = None,
        slot_ttl: float = 10.0,
        concurrency: int = DEFAULT_CONCURRENCY,
        isolation: Isolation = "thread",
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self.db = db
        self.stages = check_stages(stages)
        self.batch_size = batch_size
        self.publish = publish
        self.max_batch_bytes = max_batch_bytes
        self.batch_seconds = batch_seconds
        self.max_payload_bytes = max_payload_bytes()
        # a worker that hangs inside one of its own transactions (never inside user code: none is open
        # then) is disconnected by the server, so its leases can be taken over
        self._own = OwnConnection(
            db,
            settings={
                "idle_in_transaction_session_timeout": f"{int(idle_timeout * 1000)}ms",
                "jit": "off",  # without statistics the batch queries' estimates trigger JIT compiles of 100s of ms
            },
        )
        self.name = f"stages:{owner or 'engine'}"
        self.concurrency = concurrency
        self.isolation = isolation
        self.executor = Executor(self.name, concurrency, isolation, on_end=on_end)
        self._calls: dict[str, Task[Any]] = {}  # entity id -> its call, until its outcome is committed
        self._ended: list[Task[Any]] = []  # calls taken from the executor, their outcomes not committed yet
        self._waiting: deque[_Claimed] = deque()  # claimed entries waiting for a free slot, in claim order
        self._alone = False  # an entry whose earlier run never ended runs, or waits to run, with no other call
        self._asking: _ChangeBatch | None = None
        self.slot_ttl = slot_ttl
        self._slots_renewed = time.monotonic()
        self._slot_holder = f"{owner or 'engine'}:{uuid.uuid4().hex[:12]}"  # of the flow slots it takes
        self._held_back: dict[str, dict[str, float]] = {}  # stage -> entity id -> monotonic time it may go
        self._key_paced: dict[tuple[str, str], float] = {}  # (stage, key) -> when its next held-back entry may go
        self._registered = False

    @property
    def busy(self) -> bool:
        """Whether claimed entries wait for a slot, run within their time limit or wait for their commit, or a
        change batch is being asked."""
        return self._occupied() or self._asking is not None

    def close(self) -> None:
        """Release the entries claimed and not started, and those of calls still running within their time limit
        (their results are dropped; they run again), and free their flow slots; a call past its limit keeps its
        entry's crash counted (its run never ended). Close the connection and the executor."""
        live = list(self._waiting) + [task.item for task in self._calls.values() if not _stuck(task)]
        stuck = [task.item for task in self._calls.values() if _stuck(task)]
        self._calls, self._ended, self._waiting, self._asking = {}, [], deque(), None
        if stuck:
            log.warning(
                "stages: %d calls still run past their time limit (%s, ...); their entries count a crash",
                len(stuck),
                stuck[0].label,
            )
        try:
            conn = self._own.get()
            for stage, ids in _by_stage(live).items():
                conn.execute(sql.RELEASE, {"stage": stage, "ids": ids})
            self._free_slots(live)
        except psycopg.Error as exc:
            log.warning("stages: could not release %d entries (%s); they run alone next time", len(live), exc)
        self._own.close()
        self.executor.close()

    def _occupied(self) -> bool:
        """Whether claimed entries wait for a slot, run within their time limit, or ended and wait for their
        commit."""
        return bool(self._waiting) or not all(_stuck(task) for task in self._calls.values())

    def release_waiting(self) -> None:
        """Release the claimed entries that wait for a slot (e.g. when the worker stops)."""
        waiting, self._waiting = list(self._waiting), deque()
        if waiting:
            try:
                self._release_entries(waiting)
            finally:
                self._free_slots(waiting)

    # -- claiming and starting calls -------------------------------------------------------------

    def start_batch(
        self,
        shards: Sequence[int],
        stage_names: Sequence[str] | None = None,
        *,
        leases: Sequence[Lease] = (),
        shard_count: int | None = None,
    ) -> BatchReport:
        """Claim due entries of ``stage_names`` (default: all) in ``shards`` and start their calls in the executor's
        free slots (without waiting for them; the others wait for a slot, see :meth:`pump`): at most one stage per
        entity, each stage's main queue before its low-priority one. ``leases`` are those of ``shards``, in the same
        order."""
        return self._start_batch(shards, stage_names, leases, shard_count)[0]

    def _start_batch(
        self,
        shards: Sequence[int],
        stage_names: Sequence[str] | None,
        leases: Sequence[Lease],
        shard_count: int | None,
    ) -> tuple[BatchReport, list[_Claimed]]:
        names = list(self.stages) if stage_names is None else list(stage_names)
        report = BatchReport()
        shards = list(shards)
        self._start_waiting()
        limit = self._claim_size(names)
        if not shards or limit <= 0 or (self._alone and self._occupied()):
            return report, []
        self._alone = False
        self.register_limits()
        limits, taken = self._take_for_stages(names, limit, report)
        try:
            if not limits:
                return report, []
            for lease in leases:
                lease.require()
            claimed, parked = self._claim(shards, limits, limit, leases, shard_count)
            if any(c.crashes for c in claimed):  # claimed alone: its earlier run never ended
                if self._occupied():  # it waits until no other call runs, so that a crash is charged to it alone
                    self._release_entries(claimed)
                    self.release_waiting()
                    claimed = []
                self._alone = True
            claimed, failed = self._take_for_keys(claimed, report)
            for c in claimed:
                if c.stage.key is None and c.entity is not None and taken.get(c.stage.name):
                    c.slots.add(taken[c.stage.name].pop())
        finally:
            self._free_taken(taken)
        by_shard = dict(zip(shards, leases, strict=True)) if leases else {}
        report.taken = len(claimed)
        counts = _Counts()
        for stage_name, entity_id, _attempts, crashes in parked:
            counts.add(stage_name, PARKED)
            counts.add(stage_name, ERRORS)
            log.error(
                "stage %s: entity %r parked: %d runs in a row ended with the death of their worker",
                stage_name,
                entity_id,
                crashes,
            )
        outcomes = failed + [_Outcome(c, c.entity_id, "gone") for c in claimed if c.entity is None]
        for c in claimed:
            c.lease, c.shard_count = by_shard.get(c.shard), shard_count
        self._waiting.extend(c for c in claimed if c.entity is not None)
        self._start_waiting()
        if outcomes or counts.by_stage:
            try:
                self._commit(outcomes, shards[0], leases, shard_count, counts)
            finally:
                self._free_slots([o.claimed for o in outcomes])
            _report_counts(report, counts, outcomes)
        return report, [c for c in claimed if c.entity is not None]

    def _claim_size(self, names: list[str]) -> int:
        """How many entries of ``names`` to claim now: the free slots, or as many as can start within about
        AHEAD_SECONDS by the calls ended lately (a stage with max parallelism: the free slots only, so that its
        slots are held by calls that run), less those already waiting."""
        free = self.executor.free - len(self._waiting)
        if any(self.stages[n].max_parallelism is not None for n in names):
            return min(self.batch_size, free)
        ahead = self.executor.ends_within(AHEAD_SECONDS) - len(self._waiting)
        return min(self.batch_size, max(free, ahead))

    def _start_waiting(self) -> None:
        """Start the calls of claimed entries in claim order as slots are free; release those that waited longer
        than ``batch_seconds``, or whose lease this process can no longer count on (see :meth:`Lease.require`)."""
        released: list[_Claimed] = []
        now = time.monotonic()
        while self._waiting:
            c = self._waiting[0]
            lease_held = c.lease is None or c.lease.valid_for(c.lease.term.ttl / 3)
            if now - c.claimed_at > self.batch_seconds or not lease_held:
                released.append(self._waiting.popleft())
                continue
            if self.executor.free <= 0:
                break
            self._waiting.popleft()
            run = self._compute_async if is_coroutine_function(c.stage.process) else self._compute
            c.task = self._calls[c.entity_id] = self.executor.start(c, run, c.stage.timeout)
        if released:
            try:
                self._release_entries(released)
            finally:
                self._free_slots(released)

    def pump(self, seconds: float = PUMP_SECONDS) -> None:
        """Start waiting entries as calls end and free their slots, for as long as calls end within a few
        milliseconds of each other (fast stages), at most ``seconds``: slow calls are never waited for."""
        until = time.monotonic() + seconds
        while self._waiting and time.monotonic() < until:
            self._take_ended()
            self._start_waiting()
            if self._waiting and not self.executor.wait(PUMP_GAP):
                return
        self._take_ended()

    def _take_ended(self) -> None:
        self._ended.extend(self.executor.ended())

    def _claim(
        self,
        shards: list[int],
        limits: dict[str, int],
        limit: int,
        leases: Sequence[Lease],
        shard_count: int | None,
    ) -> tuple[list[_Claimed], list[tuple[str, str, int, int]]]:
        """Claim due entries (committed at once); returns the entries to run and those parked instead."""
        per_shard = -(-limit // len(shards))  # shards are hash-balanced: lock little more than used
        conn = self._own.get()
        _, claim = _guarded(
            conn,
            leases,
            shard_count,
            sql.SETTINGS,
            lambda: conn.execute(
                sql.CLAIM,
                {
                    "shards": shards,
                    "stages": list(limits),
                    "limits": [min(n, per_shard) for n in limits.values()],
                    "max_crashes": [self.stages[n].max_crashes for n in limits],
                    "limit": limit,
                    "max_bytes": self.max_batch_bytes,
                    "busy": self._busy_ids() + self._held_back_ids(limits),
                    "shard_count": shard_count,
                    **_lease_params(leases),
                },
            ),
        )
        rows = claim.fetchall()
        claimed: list[_Claimed] = []
        parked = []
        for kind, entity_id, stage_name, attempts, crashes, shard, version, payload, states, ready in rows:
            if kind == "parked":
                parked.append((stage_name, entity_id, attempts, crashes))
                continue
            entity = None if version is None else Entity(entity_id, version, payload)
            stage = self.stages[stage_name]
            claimed.append(_Claimed(entity, stage, attempts, crashes, shard, states or {}, set(ready or ())))
        over = _within_limits([("", c.entity_id, c.stage.name) for c in claimed], limits)
        if len(over) < len(claimed):  # more than the tokens taken: the rest is released at once
            keep = {(r[1], r[2]) for r in over}
            self._release_entries([c for c in claimed if (c.entity_id, c.stage.name) not in keep])
            claimed = [c for c in claimed if (c.entity_id, c.stage.name) in keep]
        return claimed, parked

    def _busy_ids(self) -> list[str]:
        """The entities whose entries wait for a slot or whose calls' outcomes are not committed yet."""
        return [*self._calls, *(c.entity_id for c in self._waiting)]

    def _release_entries(self, claimed: Sequence[_Claimed]) -> None:
        """Undo the claim of entries that will not run now."""
        conn = self._own.get()
        for stage_name, ids in _by_stage(claimed).items():
            conn.execute(sql.RELEASE, {"stage": stage_name, "ids": ids})

    def _compute(self, claimed: _Claimed) -> _Computed:
        """The stage's call on one entity, with the other stages' answers about the change (user code)."""
        stage, entity = claimed.stage, claimed.entity
        assert entity is not None
        now = datetime.now(UTC)
        own = claimed.states.get(stage.name)
        result = stage.process(entity, stage.load_state(own[0] if own else None))
        return self._computed(claimed, own, result, now)

    async def _compute_async(self, claimed: _Claimed) -> _Computed:
        """:meth:`_compute` of a stage whose ``process`` is ``async def`` (on the executor's event loop)."""
        stage, entity = claimed.stage, claimed.entity
        assert entity is not None
        now = datetime.now(UTC)
        own = claimed.states.get(stage.name)
        result = await stage.process(entity, stage.load_state(own[0] if own else None))
        return self._computed(claimed, own, result, now)

    def _computed(self, claimed: _Claimed, own: Any, result: Any, now: datetime) -> _Computed:
        stage, entity = claimed.stage, claimed.entity
        assert entity is not None
        computed = self._validated(stage, entity, own, result, now)
        if computed.new_payload is not None:
            changed = Entity(entity.id, entity.version + 1, computed.new_payload)
            fields = changed_fields(entity.payload, computed.new_payload)
            computed.offers, computed.capped = self._ask(
                changed, claimed.states, claimed.ready, fields, now, skip=stage.name
            )
        return computed

    # -- collecting ended calls ------------------------------------------------------------------

    def collect(self, *, leases: Sequence[Lease] = ()) -> BatchReport:
        """Commit the outcomes of the calls that ended since, each group under the leases and the shard count it
        was claimed with, and the change batch once it is answered; renew the flow slots of the calls still
        running. A call claimed under a lease not in ``leases`` waits for a collect given it, or is dropped once
        that lease is lost (its shard's holder runs the entry again). Raises
        :class:`~cmb_dagster.isolation.WorkerStuck` when every slot of the executor is held by a call long past
        its time limit."""
        report = BatchReport()
        self._renew_slots()
        self._take_ended()
        ended = [task for task in self._ended if isinstance(task.item, _Claimed)]
        self._ended = []
        self._start_waiting()  # in the slots the ended calls freed, before their commit
        groups: dict[int | None, list[Task[Any]]] = {}
        lost: list[Task[Any]] = []
        for task in ended:
            lease = task.item.lease
            if lease is None or lease in leases:
                groups.setdefault(task.item.shard_count, []).append(task)
            elif lease.valid_for(0):
                self._ended.append(task)
            else:
                lost.append(task)
        if lost:
            log.warning(
                "stages: %d calls ended after the lease of their shard was lost; their results are dropped (the "
                "shard's holder runs their entries again)",
                len(lost),
            )
            self._forget(lost)
        pending = list(groups.items())
        while pending:
            shard_count, tasks = pending.pop(0)
            try:
                self._commit_calls(tasks, shard_count, report)
            except psycopg.OperationalError:  # the database may be back at the next turn: committed then
                self._ended.extend(task for _, group in [(shard_count, tasks), *pending] for task in group)
                raise
            except BaseException:
                self._forget(tasks)
                self._ended.extend(task for _, group in pending for task in group)
                raise
            self._forget(tasks)
            report.ended += len(tasks)
        if self._asking is not None and self._asking.answered:
            batch, self._asking = self._asking, None
            self._commit_changes(batch)
        self.executor.check()
        return report

    def _forget(self, ended: list[Task[Any]]) -> None:
        """The calls whose outcomes are committed (or dropped): their entities may be claimed again, their flow
        slots are freed."""
        for task in ended:
            self._calls.pop(task.item.entity_id, None)
        self._free_slots([task.item for task in ended])

    def _commit_calls(self, ended: list[Task[Any]], shard_count: int | None, report: BatchReport) -> None:
        """Commit the outcomes of calls claimed with ``shard_count``, under the leases they were claimed under."""
        outcomes = [self._outcome(task) for task in ended]
        guards = list({task.item.lease.partition: task.item.lease for task in ended if task.item.lease}.values())
        counts, committed = _Counts(), BatchReport()
        self._commit(outcomes, min(task.item.shard for task in ended), guards, shard_count, counts)
        _report_counts(committed, counts, outcomes)
        report.add(committed)

    def _outcome(self, task: Task[Any]) -> _Outcome:
        claimed: _Claimed = task.item
        try:
            computed: _Computed = task.outcome
        except Exception as exc:  # noqa: BLE001 - any failure of user code leaves the entity unchanged
            return _Outcome(claimed, claimed.entity_id, "failed", error=_error_text(exc))
        return _Outcome(
            claimed,
            claimed.entity_id,
            "done",
            computed.new_payload,
            computed.payload_text,
            computed.state_text,
            computed.state_changed,
            computed.due,
            computed.offers,
            computed.capped,
        )

    # -- single batches, waited for --------------------------------------------------------------

    def process_batch(
        self,
        shards: Sequence[int],
        stage_names: Sequence[str] | None = None,
        *,
        leases: Sequence[Lease] = (),
        shard_count: int | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> BatchReport:
        """Claim a batch (:meth:`start_batch`), wait until each of its calls has ended, and commit what ended.
        ``on_wait`` runs every few hundredths of a second meanwhile (e.g. to renew leases)."""
        report, claimed = self._start_batch(shards, stage_names, leases, shard_count)
        while self._unfinished(claimed):
            self._wait(on_wait)
            self._start_waiting()
        report.add(self.collect(leases=leases))
        return report

    def changes_batch(
        self,
        shards: Sequence[int],
        *,
        leases: Sequence[Lease] = (),
        shard_count: int | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> int:
        """Ask the stages about entities changed through the API or plain SQL (one batch of the change path) and
        commit their offers; returns the changes handled."""
        count = self.ask_changes(shards, leases=leases, shard_count=shard_count)
        while self._asking is not None:
            self._wait(on_wait)
            self.ask_changes(shards, leases=leases, shard_count=shard_count)
            self.collect(leases=leases)
        return count

    def _unfinished(self, claimed: Sequence[_Claimed]) -> bool:
        """Whether some of ``claimed`` wait for a slot or run."""
        waiting = {id(c) for c in self._waiting}
        return any(id(c) in waiting or (c.task is not None and not c.task.ended) for c in claimed)

    def _wait(self, on_wait: Callable[[], None] | None) -> None:
        self.executor.wait(WAIT_STEP)
        self._take_ended()
        if on_wait is not None:
            on_wait()
        self._renew_slots()

    # -- the change path -------------------------------------------------------------------------

    def ask_changes(
        self, shards: Sequence[int], *, leases: Sequence[Lease] = (), shard_count: int | None = None
    ) -> int:
        """Start the calls that ask the stages about the change batch in flight, as slots free up; with none in
        flight, read the next one (without locks: only the shard's lease holder asks). Returns the changes read."""
        if self._asking is None:
            rows = self._own.get().execute(sql.PEEK_CHANGES, {"shards": list(shards), "limit": self.batch_size})
            changes = [
                _Change(
                    r[0],
                    Entity(r[0], r[3], r[4]) if r[3] is not None else None,
                    r[1],
                    r[2],
                    r[5] or {},
                    set(r[6] or ()),
                )
                for r in rows.fetchall()
            ]
            if not changes:
                return 0
            self._asking = _ChangeBatch(
                changes, _chunks(changes, datetime.now(UTC)), list(leases), shard_count, min(shards)
            )
            read = len(changes)
        else:
            read = 0
        batch = self._asking
        timeout = max(stage.timeout for stage in self.stages.values())
        while batch.waiting and self.executor.free > 0:
            chunk = batch.waiting.popleft()
            chunk.task = self.executor.start(chunk, self._ask_chunk, timeout)
        if batch.answered:
            self._asking = None
            self._commit_changes(batch)
        return read

    def asks_due(self) -> float:
        """The monotonic time the first call asking about the change batch reaches its time limit (inf: none)."""
        tasks = [c.task for c in self._asking.chunks if c.task is not None and not c.settled] if self._asking else []
        return min((task.started + task.timeout for task in tasks), default=math.inf)

    def _ask_chunk(self, chunk: _AskChunk) -> list[tuple[list[Offer], list[str]]]:
        """The stages' answers about each entity of ``chunk`` (user code)."""
        return [
            self._ask(c.entity, c.states, c.ready, None if c.fields is None else set(c.fields), chunk.now)  # type: ignore[arg-type]
            for c in chunk.changes
        ]

    def _commit_changes(self, batch: _ChangeBatch) -> None:
        """Offer what the stages answered (every stage not due, for a chunk without answers) and delete the
        changes asked about."""
        offers: list[Offer] = []
        counts = _Counts()
        for chunk in batch.chunks:
            if chunk.answers is None:  # the rule for a should_process that fails: every stage offered
                offers.extend(
                    (c.id, name, chunk.now) for c in chunk.changes for name in self.stages if name not in c.ready
                )
                continue
            for found, capped in chunk.answers:
                offers.extend(found)
                for name in capped:
                    counts.add(name, CAPPED)
        conn = self._own.get()
        with conn.transaction():
            settings, _ = _guarded(conn, batch.leases, batch.shard_count, sql.BEGIN_WRITE)
            with conn.pipeline():
                if offers:
                    self._offer(conn, settings[0], offers)
                conn.execute(
                    sql.DELETE_CHANGES, {"ids": [c.id for c in batch.changes], "seen": [c.seen for c in batch.changes]}
                )
                self._count(conn, batch.shard, counts)

    # -- committing ------------------------------------------------------------------------------

    def _commit(
        self,
        outcomes: list[_Outcome],
        count_shard: int,
        leases: Sequence[Lease],
        shard_count: int | None,
        counts: _Counts,
    ) -> None:
        """Commit the outcomes, with ``counts`` counted so far (they become the batch's counts); a commit refused
        for one entry's data is split until that entry is alone."""
        carried = {stage: list(values) for stage, values in counts.by_stage.items()}  # written by the first commit

        def write(part: Sequence[_Outcome]) -> None:
            nonlocal carried
            written = _Counts({stage: list(values) for stage, values in carried.items()})
            self._write(part, count_shard, leases, shard_count, written)
            for stage, values in written.by_stage.items():
                before = carried.get(stage, [0] * 6)
                for index, n in enumerate(values):
                    counts.add(stage, index, n - before[index])
            carried = {}

        def unstorable(outcome: _Outcome, exc: BaseException) -> None:
            log.error(
                "%s: its result cannot be stored (%s); it fails like a process that raised",
                outcome.claimed.label,
                describe_error(exc),
            )
            write(
                [
                    _Outcome(
                        outcome.claimed,
                        outcome.entity_id,
                        "failed",
                        error=f"its result cannot be stored: {describe_error(exc)}",
                    )
                ]
            )

        if outcomes:
            split_until_alone(outcomes, write, unstorable)
        elif carried:
            write([])
        for outcome in outcomes:
            if outcome.kind == "failed":
                self._log_failure(outcome)

    def _write(
        self,
        outcomes: Sequence[_Outcome],
        count_shard: int,
        leases: Sequence[Lease],
        shard_count: int | None,
        counts: _Counts,
    ) -> None:
        """One transaction: check leases and versions, then write every outcome."""
        done = [o for o in outcomes if o.kind == "done"]
        conn = self._own.get()
        with conn.transaction():
            (count, branch, _), versions = _guarded(
                conn, leases, shard_count, sql.BEGIN_BATCH, lambda: _lock_and_check_versions(conn, done)
            )
            current = {(r[0], r[1]): (r[2], r[3]) for r in versions} if versions is not None else {}
            ok, conflicted, gone = [], [], [o for o in outcomes if o.kind == "gone"]
            for o in done:
                own = o.claimed.states.get(o.stage.name)
                now_version = current.get((o.entity_id, o.stage.name))
                if now_version is None:
                    gone.append(o)
                elif now_version != (o.claimed.entity.version, own[1] if own else 0):  # type: ignore[union-attr]
                    conflicted.append(o)
                else:
                    ok.append(o)
            with conn.pipeline():
                self._send_writes(conn, count, branch, ok, conflicted, gone, outcomes, counts)
                self._count(conn, count_shard, counts)
        if conflicted:
            log.info("stages: %d entities changed while processed; they run again on the new version", len(conflicted))

    def _send_writes(
        self,
        conn: psycopg.Connection,
        shard_count: int,
        branch: int,
        ok: list[_Outcome],
        conflicted: list[_Outcome],
        gone: list[_Outcome],
        outcomes: Sequence[_Outcome],
        counts: _Counts,
    ) -> None:
        saves = [o for o in ok if o.new_payload is not None]
        if saves:
            conn.execute(
                sql.SAVE_ENTITIES, {"ids": [o.entity_id for o in saves], "payloads": [o.payload_text for o in saves]}
            )
        offers: list[Offer] = []
        for o in ok:
            counts.add(o.stage.name, PROCESSED)
            if o.new_payload is not None:
                counts.add(o.stage.name, CHANGED)
                offers.extend(o.offers)
                for name in o.capped:
                    counts.add(name, CAPPED)
        for o in conflicted:
            counts.add(o.stage.name, CONFLICTS)
        by_name = {o.stage.name for o in outcomes}
        for name in sorted(by_name):
            stage = self.stages[name]
            mine = [o for o in ok if o.stage.name == name]
            states = [o for o in mine if o.state_changed or stage.max_triggers is not None]
            if states:
                conn.execute(
                    sql.SAVE_STATES,
                    {
                        "stage": name,
                        "ids": [o.entity_id for o in states],
                        "states": [o.state_text for o in states],
                        "changed": [o.state_changed for o in states],
                        "window": stage.trigger_window,
                    },
                )
            finished = [o.entity_id for o in mine if o.due is None]
            finished += [o.entity_id for o in gone if o.stage.name == name]
            if finished:
                conn.execute(sql.DELETE_ENTRIES, {"stage": name, "ids": finished})
            timers = [o for o in mine if o.due is not None]
            if timers:
                conn.execute(
                    sql.SET_TIMERS,
                    {"stage": name, "ids": [o.entity_id for o in timers], "dues": [o.due for o in timers]},
                )
            failed = [o for o in outcomes if o.kind == "failed" and o.stage.name == name]
            if failed:
                delays = [stage.backoff.delay(o.claimed.attempts) for o in failed]
                conn.execute(
                    sql.FAILED,
                    {
                        "stage": name,
                        "max_attempts": stage.max_attempts,
                        "ids": [o.entity_id for o in failed],
                        "errors": [o.error for o in failed],
                        "delays": delays,
                    },
                )
                counts.add(name, ERRORS, len(failed))
                counts.add(name, PARKED, sum(o.claimed.attempts + 1 >= stage.max_attempts for o in failed))
            conflicts = [o.entity_id for o in conflicted if o.stage.name == name]
            if conflicts:
                conn.execute(sql.CONFLICTED, {"stage": name, "ids": conflicts, "max_conflicts": stage.max_conflicts})
            if self.publish and mine:
                conn.execute(
                    sql.PUBLISH,
                    {
                        "branch": branch,
                        "topic": f"stages.{name}",
                        "stage": name,
                        "ids": [o.entity_id for o in mine],
                        "changed": [o.new_payload is not None for o in mine],
                    },
                )
        if offers:
            self._offer(conn, shard_count, offers)

    def _log_failure(self, outcome: _Outcome) -> None:
        stage, attempts = outcome.stage, outcome.claimed.attempts
        if attempts + 1 >= stage.max_attempts:
            log.error("%s: parked after %d attempts: %s", outcome.claimed.label, attempts + 1, outcome.error)
        else:
            log.warning(
                "%s failed (attempt %d of %d, retry in %.1fs): %s",
                outcome.claimed.label,
                attempts + 1,
                stage.max_attempts,
                stage.backoff.delay(attempts),
                outcome.error,
            )

    def _validated(self, stage: Stage, entity: Entity, own: Any, result: Any, now: datetime) -> _Computed:
        if not isinstance(result, StageResult):
            raise InvalidStageResult(
                f"result: stage {stage.name!r} must return a StageResult, not {type(result).__name__}"
            )
        update = result.update
        new_payload = payload_text = None
        if update is not None:
            if not isinstance(update, dict):
                raise InvalidStageResult(
                    f"update: stage {stage.name!r} must return a dict or MergePatch, not {type(update).__name__}"
                )
            candidate = merge_patch(entity.payload, dict(update)) if isinstance(update, MergePatch) else update
            text = to_json(candidate, "update", error=InvalidStageResult, limit=self.max_payload_bytes)
            if candidate != entity.payload:
                new_payload, payload_text = json.loads(text), text
        state_text, state_changed = None, False
        if result.new_state is not None:
            dumped = stage.dump_state(result.new_state)
            if own is None or dumped != own[0]:
                state_text = to_json(dumped, "new_state", error=InvalidStageResult, limit=self.max_payload_bytes)
                state_changed = True
        if isinstance(result.timer, bool):
            raise InvalidStageResult(f"timer: must be None, a timedelta or an aware datetime, not {result.timer}")
        due = due_of(result.timer, now, "timer")
        return _Computed(new_payload, payload_text, state_text, state_changed, due, [], [])

    # -- fan-out -------------------------------------------------------------------------------

    def _ask(
        self,
        entity: Entity,
        states: dict[str, Any],
        ready: set[str],
        fields: set[str] | None,
        now: datetime,
        *,
        skip: str | None = None,
    ) -> tuple[list[Offer], list[str]]:
        """Offers (entity, stage, due) of the stages that want to see ``entity`` after a change, and the
        stages whose re-trigger cap deferred theirs."""
        offers: list[Offer] = []
        capped: list[str] = []
        for name, other in self.stages.items():
            if name == skip or name in ready:
                continue
            if other.fields is not None and fields is not None and not fields.intersection(other.fields):
                continue
            raw = states.get(name)
            try:
                answer = other.should_process(entity, other.load_state(raw[0] if raw else None))
                due = due_of(answer, now, "should_process")
            except Exception as exc:  # noqa: BLE001 - a should_process that fails enqueues the entity
                log.warning(
                    "stage %s: should_process failed on %r (%s); enqueued anyway", name, entity.id, describe_error(exc)
                )
                due = now
            if due is None:
                continue
            if other.max_triggers is not None and raw is not None:
                runs, window_start = raw[2], datetime.fromtimestamp(float(raw[3]), UTC)
                window_end = window_start + timedelta(seconds=other.trigger_window)
                if runs >= other.max_triggers and window_end > now and due < window_end:
                    log.warning(
                        "stage %s: entity %r re-triggered %d times within %.0fs (cap %d); deferred to %s",
                        name,
                        entity.id,
                        runs,
                        other.trigger_window,
                        other.max_triggers,
                        window_end.isoformat(),
                    )
                    capped.append(name)
                    due = window_end
            offers.append((entity.id, name, due))
        return offers, capped

    def _offer(self, conn: psycopg.Connection, shard_count: int, offers: list[Offer], lane: int = MAIN) -> None:
        offers.sort(key=lambda o: (o[0], o[1]))
        conn.execute(
            sql.OFFER if lane == MAIN else sql.OFFER_LOW,
            {
                "shard_count": shard_count,
                "ids": [o[0] for o in offers],
                "stages": [o[1] for o in offers],
                "dues": [o[2] for o in offers],
            },
        )

    # -- limits, counters ----------------------------------------------------------------------

    def register_limits(self) -> None:
        """Record the stages' rate limits and max parallelism with :func:`cmb_dagster.flow.register` (once)."""
        if self._registered:
            return
        limits: dict[str, FlowLimits | None] = {}
        for stage in self.stages.values():
            limits.update(stage.flow_limits())
        with self._own.get().transaction():
            flow.register(self._own.get(), limits)
        self._registered = True

    def _take_for_stages(
        self, names: list[str], limit: int, report: BatchReport
    ) -> tuple[dict[str, int], dict[str, list[flow.HeldSlot]]]:
        """The entries each stage may claim: a stage without a key takes its flow slots and tokens first, one per
        call (none: it waits, ``report.blocked_until``); a stage with a key takes them per key after the claim.
        Returns the limits and the slots taken, per stage."""
        limits: dict[str, int] = {}
        taken: dict[str, list[flow.HeldSlot]] = {}
        conn = self._own.get()
        with conn.transaction():
            for name in sorted(names):  # one lock order for every worker
                stage, want = self.stages[name], limit
                if stage.key is not None:
                    limits[name] = want
                    continue
                slots: list[flow.HeldSlot] = []
                if stage.max_parallelism is not None:
                    slots = self._take_slots(conn, name, "", want)
                    if not slots:
                        report.blocked_until = time.monotonic() + SLOT_RETRY
                        continue
                    want = len(slots)
                if stage.rate_limit is not None:
                    grant = self._take_tokens(conn, name, "", want)
                    self._free(conn, slots[grant.count :])
                    slots = slots[: grant.count]
                    if grant.count == 0:
                        report.blocked_until = time.monotonic() + max(0.01, grant.retry_after or 0.0)
                        continue
                    want = grant.count
                limits[name] = want
                if slots:
                    taken[name] = slots
        return limits, taken

    def _take_for_keys(self, claimed: list[_Claimed], report: BatchReport) -> tuple[list[_Claimed], list[_Outcome]]:
        """The claimed entries of stages with a key that got a flow slot and a token of their key; the others are
        released at once and held back from the next claims until their key may go again. Returns the entries
        to run and the failures of entries whose key raised."""
        by_key: dict[tuple[str, str], list[_Claimed]] = {}
        kept: list[_Claimed] = []  # entries of stages without a key (or of gone entities)
        failed: list[_Outcome] = []
        for c in claimed:
            if c.stage.key is None or c.entity is None:
                kept.append(c)
                continue
            try:
                key = c.stage.key_of(c.entity)[: flow.MAX_KEY_LENGTH]
            except Exception as exc:  # noqa: BLE001 - a key function that raises fails its entry
                failed.append(_Outcome(c, c.entity_id, "failed", error=f"key: {describe_error(exc)}"))
                continue
            by_key.setdefault((c.stage.name, key), []).append(c)
        if not by_key:
            return kept, failed
        granted: set[int] = set()
        waits: dict[str, list[tuple[str, float]]] = {}  # stage -> [(entity id, monotonic time it may go)]
        retry_at = math.inf  # when a key held back may go again (its other entries, not claimed yet, too)
        conn = self._own.get()
        now = time.monotonic()
        with conn.transaction():
            for (name, key), entries in sorted(by_key.items(), key=lambda item: item[0]):
                stage = self.stages[name]
                count, wait = len(entries), 0.0
                slots: list[flow.HeldSlot] = []
                if stage.max_parallelism is not None:
                    slots = self._take_slots(conn, name, key, count)
                    if len(slots) < count:
                        count, wait = len(slots), SLOT_RETRY
                rate = stage.rate()
                if count and rate is not None:
                    grant = self._take_tokens(conn, name, key, count)
                    if grant.count < count:
                        self._free(conn, slots[grant.count :])
                        wait = grant.retry_after if grant.count == 0 and grant.retry_after else 1.0 / rate.per_second
                    count = grant.count
                for c, slot in zip(entries[:count], slots, strict=False):
                    c.slots.add(slot)
                granted.update(id(c) for c in entries[:count])
                if count < len(entries):
                    retry_at = min(retry_at, now + max(wait, 0.01))
                    untils = self._paced(name, key, now + max(wait, 0.01), len(entries) - count, rate)
                    waits.setdefault(name, []).extend(zip((c.entity_id for c in entries[count:]), untils, strict=True))
            for name, held_back in waits.items():
                conn.execute(sql.RELEASE, {"stage": name, "ids": [entity_id for entity_id, _ in held_back]})
        for name, held_back in waits.items():
            memory = self._held_back.setdefault(name, {})
            memory.update(held_back[: max(0, HELD_BACK_MAX - len(memory))])
            report.held_back += len(held_back)
        granted.update(id(c) for c in kept)
        if not granted and not failed and waits:
            report.blocked_until = retry_at
        return [c for c in claimed if id(c) in granted], failed

    def _paced(self, stage: str, key: str, first: float, count: int, rate: RateLimit | None) -> list[float]:
        """When each of ``count`` entries of (stage, key) held back may go again: from ``first`` on, one token's
        time apart under a rate limit, after those of the key held back before (so the claims that follow reach
        the other keys' entries instead of taking the same key's again and again)."""
        if rate is None:
            return [first] * count
        step = 1.0 / rate.per_second
        start = max(first, self._key_paced.get((stage, key), 0.0))
        untils = [start + i * step for i in range(count)]
        for paced, until in list(self._key_paced.items()):
            if until < first:
                del self._key_paced[paced]
        self._key_paced[(stage, key)] = untils[-1] + step
        return untils

    def _take_slots(self, conn: psycopg.Connection, stage: str, key: str, want: int) -> list[flow.HeldSlot]:
        """Up to ``want`` flow slots of (stage, key)'s max parallelism, one per call."""
        scope = parallel_scope(stage)
        grant = flow.take(conn, {(scope, key): want}, holder=self._slot_holder, ttl=self.slot_ttl)[(scope, key)]
        return [(scope, key[: flow.MAX_KEY_LENGTH], slot) for slot in grant.slots]

    def _take_tokens(self, conn: psycopg.Connection, stage: str, key: str, want: int) -> flow.Grant:
        """Up to ``want`` tokens of (stage, key)'s rate limit, one per call."""
        scope = rate_scope(stage)
        return flow.take(conn, {(scope, key): want}, holder=self._slot_holder, ttl=self.slot_ttl)[(scope, key)]

    def _free(self, conn: psycopg.Connection, slots: Sequence[flow.HeldSlot]) -> None:
        """Free flow slots in ``conn``'s transaction."""
        flow.release(conn, slots, holder=self._slot_holder)

    def _free_taken(self, taken: dict[str, list[tuple[tuple[str, str], str, int]]]) -> None:
        """Free the slots taken before a claim that no claimed entry holds."""
        left = [slot for slots in taken.values() for slot in slots]
        if left:
            self._quietly(f"free {len(left)} flow slots", lambda conn: self._free(conn, left))

    def _held_back_ids(self, limits: dict[str, int]) -> list[str]:
        """Entities of the stages in ``limits`` held back until their key may go again."""
        now = time.monotonic()
        ids: list[str] = []
        for name in limits:
            memory = self._held_back.get(name)
            if memory:
                for entity_id in [e for e, until in memory.items() if until <= now]:
                    del memory[entity_id]
                ids.extend(memory)
        return ids

    def _renew_slots(self) -> None:
        """Renew the flow slots of the entries waiting for a slot and of the calls that have not ended (past their
        time limit too) once a third of their time-to-live has passed since they were last renewed."""
        if time.monotonic() < self._slots_renewed + self.slot_ttl / 3:
            return
        held = set().union(*(task.item.slots for task in self._calls.values()), *(c.slots for c in self._waiting))
        if held:

            def renew(conn: psycopg.Connection) -> None:
                flow.renew(conn, held, holder=self._slot_holder, ttl=self.slot_ttl)

            if not self._quietly(f"renew {len(held)} flow slots", renew):
                return
        self._slots_renewed = time.monotonic()

    def _free_slots(self, claimed: Sequence[_Claimed]) -> None:
        """Free the flow slots of entries whose calls ended (once their outcome is committed, or dropped)."""
        held = set().union(*(c.slots for c in claimed))
        for c in claimed:
            c.slots = set()
        if held:
            self._quietly(f"free {len(held)} flow slots", lambda conn: self._free(conn, list(held)))

    def _quietly(self, what: str, write: Callable[[psycopg.Connection], None]) -> bool:
        """Run ``write`` in a transaction of its own; a database error is logged (slots free themselves when their
        time-to-live passes). Whether it committed."""
        conn = self._own.get()
        try:
            with conn.transaction():
                write(conn)
        except psycopg.Error as exc:
            log.warning("stages: could not %s (%s)", what, exc)
            return False
        return True

    def _count(self, conn: psycopg.Connection, shard: int, counts: _Counts) -> None:
        if not counts.by_stage:
            return
        names = sorted(counts.by_stage)
        columns = list(zip(*(counts.by_stage[n] for n in names), strict=True))
        conn.execute(
            sql.COUNT,
            {
                "stages": names,
                "shards": [shard] * len(names),
                "processed": list(columns[0]),
                "changed": list(columns[1]),
                "conflicts": list(columns[2]),
                "errors": list(columns[3]),
                "parked": list(columns[4]),
                "capped": list(columns[5]),
            },
        )

    # -- planning, rescan ----------------------------------------------------------------------

    def plan(self, shards: Sequence[int]) -> tuple[dict[tuple[str, int], float], bool]:
        """Seconds until the earliest entry of each (stage, lane) in ``shards`` is due (<= 0: due now),
        and whether the change path has entries."""
        rows = self._own.get().execute(sql.PLAN, {"shards": list(shards), "stages": list(self.stages)}).fetchall()
        waits: dict[tuple[str, int], float] = {}
        changes = False
        for stage, lane, due, now in rows:
            if due is None:
                continue
            if lane == -1:
                changes = True
            else:
                waits[(stage, lane)] = (due - now).total_seconds()
        return waits, changes

    def rescan(
        self, *, duration: float | None = None, page: int = 1000, after: str = ""
    ) -> tuple[int, int, str | None]:
        """Ask every stage ``should_process`` about every entity not in its queue; offer the ones that ask to the
        low-priority queue. Returns (entities seen, entries offered, where it stopped or None). The stages are
        asked in an executor of the rescan's own, ``concurrency`` calls at once; a call that fails or passes its
        time limit offers nothing."""
        deadline = None if duration is None else time.monotonic() + duration
        seen = offered = 0
        timeout = max(s.timeout for s in self.stages.values())
        executor = Executor(f"{self.name}:rescan", self.concurrency, self.isolation)
        conn = self._own.get()
        try:
            while deadline is None or time.monotonic() < deadline:
                rows = conn.execute(sql.RESCAN_PAGE, {"after": after, "limit": page}).fetchall()
                if not rows:
                    return seen, offered, None
                changes = [_Change(r[0], Entity(r[0], r[1], r[2]), None, "", r[3] or {}, set(r[4] or ())) for r in rows]
                chunks = _chunks(changes, datetime.now(UTC))
                _ask_all(executor, chunks, self._ask_chunk, timeout)
                offers = [offer for c in chunks if c.answers is not None for found, _ in c.answers for offer in found]
                if offers:
                    with conn.transaction():
                        count = conn.execute(sql.BEGIN_WRITE).fetchone()[0]
                        self._offer(conn, count, offers, LOW)
                seen += len(rows)
                offered += len(offers)
                after = rows[-1][0]
        finally:
            executor.close()
        return seen, offered, after


def _by_stage(claimed: Sequence[_Claimed]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for c in claimed:
        found.setdefault(c.stage.name, []).append(c.entity_id)
    return found


def _guarded(
    conn: psycopg.Connection,
    leases: Sequence[Lease],
    shard_count: int | None,
    settings_query: str,
    send: Callable[[], Any] = lambda: None,
) -> tuple[tuple[Any, ...], Any]:
    """In one round trip: check ``leases``, read the settings row with ``settings_query`` and send what ``send``
    sends; raise LeaseLost unless every lease is held, ShardCountChanged unless the shard count is still
    ``shard_count`` (None: any). Returns the settings row and what ``send`` returned."""
    with conn.pipeline():
        leases_held = Leases.check_many(conn, leases)
        settings = conn.execute(settings_query)
        sent = send()
    leases_held()
    row = settings.fetchone()
    if shard_count is not None and row[0] != shard_count:
        raise ShardCountChanged(f"shard count is now {row[0]}, not {shard_count}: leases are taken again")
    return row, sent


def _lock_and_check_versions(conn: psycopg.Connection, done: Sequence[_Outcome]) -> psycopg.Cursor | None:
    """Lock the entities of ``done`` (in id order) and send the query of their entity and state versions."""
    if not done:
        return None
    conn.execute(sql.LOCK_PROCESSED, {"ids": sorted(o.entity_id for o in done)})
    return conn.execute(
        sql.CHECK_VERSIONS, {"ids": [o.entity_id for o in done], "stages": [o.stage.name for o in done]}
    )


def _lease_params(leases: Sequence[Lease]) -> dict[str, Any]:
    first = leases[0] if leases else None
    return {
        "kind": first.kind if first else "",
        "owner": first.owner if first else "",
        "partitions": [lease.partition for lease in leases],
        "fences": [lease.fence for lease in leases],
    }


def _report_counts(report: BatchReport, counts: _Counts, outcomes: list[_Outcome]) -> None:
    report.processed = counts.total(PROCESSED)
    report.changed = counts.total(CHANGED)
    report.conflicts = counts.total(CONFLICTS)
    report.errors = counts.total(ERRORS)
    report.parked = counts.total(PARKED)
    report.capped = counts.total(CAPPED)
    report.offered = sum(len(o.offers) for o in outcomes if o.kind == "done")


def _ask_all(executor: Executor, chunks: list[_AskChunk], ask: Callable[[_AskChunk], Any], timeout: float) -> None:
    """Run the calls of ``chunks``, as many at once as ``executor`` has slots, until each is settled."""
    waiting = deque(chunks)
    while waiting or not all(chunk.settle() for chunk in chunks):
        while waiting and executor.free > 0:
            chunk = waiting.popleft()
            chunk.task = executor.start(chunk, ask, timeout)
        executor.wait(WAIT_STEP)
        executor.ended()  # each chunk reads its own task
        executor.check()


__all__ = ["BatchReport", "Engine"]
