"""The processing engine: batches of many stages over many shards.

A batch of stages S1..Sn over the shards a worker holds:

1. takes, for each S without a key, a batch slot (``max_parallelism``) and tokens (``rate_limit``, one per
   entry claimed) from :mod:`cmb_dagster.flow`: an S that gets none waits;
2. **claims** due entries in one statement, committed before any stage runs: the worker's leases and the
   shard count are checked in it; each (shard, stage)'s due entries, the low-priority lane only where the
   main one has nothing due, one entry per entity (one stage works on an entity at a time), up to
   ``batch_size`` entries and about ``max_batch_bytes`` of payload; each entry's ``crashes`` goes up by one
   (see :mod:`cmb_dagster.isolation`: an entry whose earlier run never ended is claimed alone, and parked
   after the stage's ``max_crashes``), and each entity is loaded with its version and every stage's state;
   for each S with a key, the entries of each key take that key's batch slot and tokens; those that get
   none are released at once and kept out of this worker's claims until their key may go again;
3. **runs** ``S.process`` for each, and asks the other stages ``should_process`` about a changed entity,
   in a thread of user code with no transaction open: a call still running after about a second is set
   aside (the others go on; its result commits in a later batch), one past the stage's ``timeout`` fails;
   entries not started after ``batch_seconds`` are released. The calls of a stage with ``max_parallelism``
   run one after another, none set aside, while the batch renews its slots;
4. **commits** in one transaction: the leases (key-share-locked until commit) and the shard count again;
   the entities locked (``FOR NO KEY UPDATE``) and their versions compared: the entity version and S's
   state version must be those loaded. Each entity is checked on its own: a conflicted entity keeps its
   entry (counted) and is loaded again, the others commit their entity (version + 1), state, timer (or
   deleted entry), the offers of the other stages, the post-save publication and the counters. A commit
   refused for the data of one entry is split until that entry is alone; it then fails like a ``process``
   that raised, and the others commit. Then the batch frees its slots (a dead worker's free themselves when
   their time-to-live, the lease TTL, passes).

A ``process`` that raises, returns something invalid or times out leaves the entity unchanged; its entry
is retried after the stage's ``backoff`` and parked after ``max_attempts``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import psycopg

from cmb_dagster import flow
from cmb_dagster.database import Database, OwnConnection
from cmb_dagster.flow import FlowLimits
from cmb_dagster.inputs import max_payload_bytes, to_json
from cmb_dagster.isolation import Call, UserCode, describe_error, split_until_alone
from cmb_dagster.stages import sql
from cmb_dagster.stages.errors import InvalidStageResult, ShardCountChanged
from cmb_dagster.stages.models import Entity, MergePatch, StageResult, changed_fields, merge_patch
from cmb_dagster.stages.stage import Stage, check_stages, due_of, parallel_scope, rate_scope
from cmb_dagster.workers import Lease, LeaseLost, Leases

log = logging.getLogger("cmb_dagster.stages")

MAIN, LOW = 0, 1
SLOT_RETRY = 0.05
"""Seconds before a stage (or key) whose batch slots were all taken asks again."""
HELD_BACK_MAX = 20_000
"""Entities of one stage a worker keeps out of its claims while their key waits for tokens or a slot."""
MAX_BATCH_BYTES = 16 * 1024 * 1024
"""Payload bytes a batch loads at most (one entity bigger than that is loaded alone)."""

# the counters of stage_counters, in this order
PROCESSED, CHANGED, CONFLICTS, ERRORS, PARKED, CAPPED = range(6)


@dataclass
class BatchReport:
    """What one batch did."""

    taken: int = 0
    processed: int = 0
    changed: int = 0
    conflicts: int = 0
    errors: int = 0
    parked: int = 0
    capped: int = 0
    offered: int = 0
    set_aside: int = 0
    held_back: int = 0  # claimed entries released at once: their key had no tokens or batch slot
    blocked_until: float | None = None  # monotonic time a rate limit / parallelism lets the stage go again


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
    """A queue entry claimed for a run of its stage, with what the run needs."""

    entity: Entity | None  # None: the entity is gone
    stage: Stage
    attempts: int
    states: dict[str, Any]
    ready: set[str]

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
    kind: Literal["done", "failed", "released", "gone"]
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
    """What a run of user code produced for one entry (in the user-code thread)."""

    new_payload: dict[str, Any] | None
    payload_text: str | None
    state_text: str | None
    state_changed: bool
    due: datetime | None
    offers: list[Offer]
    capped: list[str]


@dataclass
class _Held:
    """The flow slots a batch holds: {(scope, key): {item: slot}}, and when they were last renewed."""

    slots: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    renewed: float = field(default_factory=time.monotonic)

    def give_back(self, conn: psycopg.Connection, scope: str, key: str) -> None:
        """Free the slot of (scope, key) taken in this transaction, if any."""
        items = self.slots.pop((scope, key[: flow.MAX_KEY_LENGTH]), None)
        if items:
            flow.release(conn, scope, key, items)


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


class Engine:
    """Runs batches of stages over shards; used by :class:`~cmb_dagster.stages.worker.StageWorker`,
    the rescan and tests. One thread uses an engine at a time (it keeps a connection of its own)."""

    def __init__(
        self,
        db: Database,
        stages: Sequence[Stage],
        *,
        batch_size: int = 500,
        publish: bool = True,
        batch_seconds: float = 2.0,
        idle_timeout: float = 30.0,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        owner: str | None = None,
        slot_ttl: float = 10.0,
    ) -> None:
        self.db = db
        self.stages = check_stages(stages)
        self.batch_size = batch_size
        self.publish = publish
        self.batch_seconds = batch_seconds
        self.max_batch_bytes = max_batch_bytes
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
        self.user_code = UserCode(f"stages:{owner or 'engine'}")
        # should_process on the change path and in the rescan: every answer is needed before the commit
        self._asking = UserCode(f"stages:{owner or 'engine'}:asking", set_aside_after=None)
        # a stage with max_parallelism calls process one entity after another, none set aside
        self._in_turn = UserCode(f"stages:{owner or 'engine'}:in-turn", set_aside_after=None)
        self._busy: dict[str, _Claimed] = {}  # entity id -> its entry whose call is set aside
        self.slot_ttl = slot_ttl
        self._batch_item = f"{owner or 'engine'}:{uuid.uuid4().hex[:12]}"
        self._held_back: dict[str, dict[str, float]] = {}  # stage -> entity id -> monotonic time it may go
        self._registered = False

    def close(self) -> None:
        """Release the entries of calls still set aside (their results are dropped; they run again) and
        close the connection."""
        busy, self._busy = list(self._busy.values()), {}
        for stage, ids in _by_stage(busy).items():
            try:
                self._own.get().execute(sql.RELEASE, {"stage": stage, "ids": ids})
            except psycopg.Error as exc:
                log.warning("stages: could not release %d entries (%s); they run alone next time", len(ids), exc)
        self._own.close()

    # -- one batch of stages over shards ---------------------------------------------------------

    def process_batch(
        self,
        shards: Sequence[int],
        stage_names: Sequence[str] | None = None,
        *,
        leases: Sequence[Lease] = (),
        shard_count: int | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> BatchReport:
        """Claim, run and commit one batch: due entries of ``stage_names`` (default: all) in ``shards``, at
        most one stage per entity, each stage's main queue before its low-priority one. ``on_wait`` runs
        while user code does (e.g. to renew leases)."""
        names = list(self.stages) if stage_names is None else list(stage_names)
        report = BatchReport()
        shards = list(shards)
        if not shards:
            return report
        self.register_limits()
        held = _Held()
        try:
            limits = self._take_for_stages(names, held, report)
            if not limits:
                return report
            for lease in leases:
                lease.require()
            claimed, parked = self._claim(shards, limits, leases, shard_count)
            claimed, failed = self._take_for_keys(claimed, held, report)
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
            outcomes = failed + self._run(claimed, self._renewing(held, on_wait), leases)
            report.set_aside = len(claimed) - len(outcomes) + len(failed)
            self._renew(held)
            self._commit(outcomes, shards[0], leases, shard_count, counts)
        finally:
            self._release(held)
        _report_counts(report, counts, outcomes)
        return report

    def finish_set_aside(self, shard: int, *, leases: Sequence[Lease] = (), shard_count: int | None = None) -> int:
        """Commit the results of set-aside calls that ended since (a call past its timeout fails); return how
        many entries that ended."""
        calls = self.user_code.collect()
        if not calls:
            return 0
        for call in calls:
            self._busy.pop(call.item.entity_id, None)
        counts = _Counts()
        self._commit([self._outcome(call) for call in calls], shard, leases, shard_count, counts)
        return len(calls)

    def _claim(
        self,
        shards: list[int],
        limits: dict[str, int],
        leases: Sequence[Lease],
        shard_count: int | None,
    ) -> tuple[list[_Claimed], list[tuple[str, str, int, int]]]:
        """Claim due entries (committed at once); returns the entries to run and those parked instead."""
        per_shard = -(-self.batch_size // len(shards))  # shards are hash-balanced: lock little more than used
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
                    "limit": self.batch_size,
                    "max_bytes": self.max_batch_bytes,
                    "busy": list(self._busy) + self._held_back_ids(limits),
                    "shard_count": shard_count,
                    **_lease_params(leases),
                },
            ),
        )
        rows = claim.fetchall()
        claimed: list[_Claimed] = []
        parked = []
        for kind, entity_id, stage_name, attempts, crashes, version, payload, states, ready in rows:
            if kind == "parked":
                parked.append((stage_name, entity_id, attempts, crashes))
                continue
            entity = None if version is None else Entity(entity_id, version, payload)
            claimed.append(_Claimed(entity, self.stages[stage_name], attempts, states or {}, set(ready or ())))
        over = _within_limits([("", c.entity_id, c.stage.name) for c in claimed], limits)
        if len(over) < len(claimed):  # more than the tokens taken: the rest is released at once
            keep = {(r[1], r[2]) for r in over}
            extra = [c for c in claimed if (c.entity_id, c.stage.name) not in keep]
            for stage_name, ids in _by_stage(extra).items():
                conn.execute(sql.RELEASE, {"stage": stage_name, "ids": ids})
            claimed = [c for c in claimed if (c.entity_id, c.stage.name) in keep]
        return claimed, parked

    def _run(
        self, claimed: list[_Claimed], on_wait: Callable[[], None] | None, leases: Sequence[Lease] = ()
    ) -> list[_Outcome]:
        """Run the claimed entries' stages, each only while ``leases`` are valid by this process's clock; the
        outcomes of those that ended or were never started."""
        gone = [_Outcome(c, c.entity_id, "gone") for c in claimed if c.entity is None]
        runnable = [c for c in claimed if c.entity is not None]
        code = self._in_turn if any(c.stage.max_parallelism is not None for c in runnable) else self.user_code

        def compute(claimed: _Claimed) -> _Computed:
            for lease in leases:  # a process stopped mid-batch starts no call once its leases may be another's
                lease.require()
            return self._compute(claimed)

        calls = code.run(
            runnable, compute, lambda c: c.stage.timeout, on_wait=on_wait, stop_starting_after=self.batch_seconds
        )
        ended = {id(call.item) for call in calls}
        aside = {id(call.item) for call in code.set_aside}
        for c in runnable:
            if id(c) in aside:
                self._busy[c.entity_id] = c
        released = [_Outcome(c, c.entity_id, "released") for c in runnable if id(c) not in ended and id(c) not in aside]
        return gone + [self._outcome(call) for call in calls] + released

    def _compute(self, claimed: _Claimed) -> _Computed:
        """The stage's run on one entity, with the other stages' answers about the change (user code)."""
        stage, entity = claimed.stage, claimed.entity
        assert entity is not None
        now = datetime.now(UTC)
        own = claimed.states.get(stage.name)
        state = stage.load_state(own[0] if own else None)
        result = stage.process(entity, state)
        computed = self._validated(stage, entity, own, result, now)
        if computed.new_payload is not None:
            changed = Entity(entity.id, entity.version + 1, computed.new_payload)
            fields = changed_fields(entity.payload, computed.new_payload)
            computed.offers, computed.capped = self._ask(
                changed, claimed.states, claimed.ready, fields, now, skip=stage.name
            )
        return computed

    def _outcome(self, call: Call[_Claimed]) -> _Outcome:
        claimed = call.item
        try:
            computed: _Computed = call.outcome
        except LeaseLost:  # not run: its shard's lease may be another worker's by now
            return _Outcome(claimed, claimed.entity_id, "released")
        except Exception as exc:  # noqa: BLE001 - any failure of user code leaves the entity unchanged
            return _Outcome(claimed, claimed.entity_id, "failed", error=describe_error(exc))
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
            released = [o.entity_id for o in outcomes if o.kind == "released" and o.stage.name == name]
            if released:
                conn.execute(sql.RELEASE, {"stage": name, "ids": released})
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

    def changes_batch(
        self,
        shards: Sequence[int],
        *,
        leases: Sequence[Lease] = (),
        shard_count: int | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> int:
        """Ask the stages about entities changed through the API or plain SQL (the change path)."""
        conn = self._own.get()
        rows = conn.execute(sql.PEEK_CHANGES, {"shards": list(shards), "limit": self.batch_size}).fetchall()
        if not rows:
            return 0
        changed = [
            _Change(Entity(r[0], r[3], r[4]) if r[3] is not None else None, r[1], r[2], r[5] or {}, set(r[6] or ()))
            for r in rows
        ]
        now = datetime.now(UTC)
        calls = self._asking.run(
            [c for c in changed if c.entity is not None],
            lambda c: self._ask(c.entity, c.states, c.ready, None if c.fields is None else set(c.fields), now),  # type: ignore[arg-type]
            lambda c: max(self.stages[n].timeout for n in self.stages),
        )
        offers: list[Offer] = []
        counts = _Counts()
        for call in calls:
            if call.timed_out:  # the rule for a should_process that fails: offered anyway
                offers.extend((call.item.entity.id, name, now) for name in self.stages if name not in call.item.ready)
                continue
            found, capped = call.result
            offers.extend(found)
            for name in capped:
                counts.add(name, CAPPED)
        with conn.transaction():
            settings, _ = _guarded(conn, leases, shard_count, sql.BEGIN_WRITE)
            count = settings[0]
            with conn.pipeline():
                if offers:
                    self._offer(conn, count, offers)
                conn.execute(sql.DELETE_CHANGES, {"ids": [c.id for c in changed], "seen": [c.seen for c in changed]})
                self._count(conn, shards[0], counts)
        return len(rows)

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

    def _take_for_stages(self, names: list[str], held: _Held, report: BatchReport) -> dict[str, int]:
        """The entries each stage may claim: a stage without a key takes its batch slot and its tokens first
        (none: it waits, ``report.blocked_until``); a stage with a key takes them per key after the claim."""
        limits: dict[str, int] = {}
        conn = self._own.get()
        with conn.transaction():
            for name in sorted(names):  # one lock order for every worker
                stage, limit = self.stages[name], self.batch_size
                if stage.key is not None:
                    limits[name] = limit
                    continue
                if stage.max_parallelism is not None and not self._take_slot(conn, name, "", held):
                    report.blocked_until = time.monotonic() + SLOT_RETRY
                    continue
                if stage.rate_limit is not None:
                    grant = flow.take(conn, rate_scope(name), "", [str(i) for i in range(limit)], ttl=self.slot_ttl)
                    if grant.count == 0:
                        held.give_back(conn, parallel_scope(name), "")
                        report.blocked_until = time.monotonic() + max(0.01, grant.retry_after or 0.0)
                        continue
                    limit = grant.count
                limits[name] = limit
        return limits

    def _take_for_keys(
        self, claimed: list[_Claimed], held: _Held, report: BatchReport
    ) -> tuple[list[_Claimed], list[_Outcome]]:
        """The claimed entries of stages with a key that got their key's batch slot and tokens; the others are
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
        waits: dict[str, list[tuple[list[str], float]]] = {}
        conn = self._own.get()
        now = time.monotonic()
        with conn.transaction():
            for (name, key), entries in sorted(by_key.items(), key=lambda item: item[0]):
                stage = self.stages[name]
                count, wait = len(entries), 0.0
                if stage.max_parallelism is not None and not self._take_slot(conn, name, key, held):
                    count, wait = 0, SLOT_RETRY
                rate = stage.rate()
                if count and rate is not None:
                    grant = flow.take(conn, rate_scope(name), key, [c.entity_id for c in entries], ttl=self.slot_ttl)
                    count = grant.count
                    wait = grant.retry_after if count == 0 and grant.retry_after else 1.0 / rate.per_second
                    if count == 0:
                        held.give_back(conn, parallel_scope(name), key)
                granted.update(id(c) for c in entries[:count])
                if count < len(entries):
                    waits.setdefault(name, []).append(([c.entity_id for c in entries[count:]], now + max(wait, 0.01)))
            for name, held_back in waits.items():
                conn.execute(sql.RELEASE, {"stage": name, "ids": [i for ids, _ in held_back for i in ids]})
        for name, held_back in waits.items():
            memory = self._held_back.setdefault(name, {})
            for ids, until in held_back:
                for entity_id in ids[: max(0, HELD_BACK_MAX - len(memory))]:
                    memory[entity_id] = until
            report.held_back += sum(len(ids) for ids, _ in held_back)
        granted.update(id(c) for c in kept)
        if not granted and not failed and waits:
            report.blocked_until = min(until for held_back in waits.values() for _, until in held_back)
        return [c for c in claimed if id(c) in granted], failed

    def _take_slot(self, conn: psycopg.Connection, stage: str, key: str, held: _Held) -> bool:
        """One of the batch slots of (stage, key), held by this batch; False when none is free."""
        scope = parallel_scope(stage)
        grant = flow.take(conn, scope, key, [self._batch_item], ttl=self.slot_ttl)
        if grant.count:
            held.slots[(scope, key[: flow.MAX_KEY_LENGTH])] = {self._batch_item: grant.slots[0]}
        return bool(grant.count)

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

    def _renewing(self, held: _Held, on_wait: Callable[[], None] | None) -> Callable[[], None] | None:
        """``on_wait``, and the batch's slots renewed while its calls run."""
        if not held.slots:
            return on_wait

        def wait() -> None:
            if on_wait is not None:
                on_wait()
            self._renew(held)

        return wait

    def _renew(self, held: _Held) -> None:
        """Renew the batch's slots once a third of their time-to-live has passed since they were last renewed."""
        if not held.slots or time.monotonic() < held.renewed + self.slot_ttl / 3:
            return
        conn = self._own.get()
        try:
            with conn.transaction():
                for (scope, key), items in held.slots.items():
                    flow.renew(conn, scope, key, items, ttl=self.slot_ttl)
        except psycopg.Error as exc:
            log.warning("stages: could not renew %d batch slots (%s)", len(held.slots), exc)
            return
        held.renewed = time.monotonic()

    def _release(self, held: _Held) -> None:
        """Free the batch's slots (once its commit is done)."""
        if not held.slots:
            return
        conn = self._own.get()
        try:
            with conn.transaction():
                for (scope, key), items in sorted(held.slots.items()):
                    flow.release(conn, scope, key, items)
        except psycopg.Error as exc:  # they free themselves when their time-to-live passes
            log.warning("stages: could not free %d batch slots (%s)", len(held.slots), exc)
        held.slots.clear()

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
        """Ask every stage ``should_process`` about every entity not in its queue; offer the ones that
        ask to the low-priority queue. Returns (entities seen, entries offered, where it stopped or None)."""
        deadline = None if duration is None else time.monotonic() + duration
        seen = offered = 0
        timeout = max(s.timeout for s in self.stages.values())
        conn = self._own.get()
        while deadline is None or time.monotonic() < deadline:
            rows = conn.execute(sql.RESCAN_PAGE, {"after": after, "limit": page}).fetchall()
            if not rows:
                return seen, offered, None
            now = datetime.now(UTC)
            calls = self._asking.run(
                rows,
                lambda r, now=now: self._ask(Entity(r[0], r[1], r[2]), r[3] or {}, set(r[4] or ()), None, now)[0],
                timeout,
            )
            offers = [offer for call in calls if not call.timed_out for offer in call.result]
            if offers:
                with conn.transaction():
                    count = conn.execute(sql.BEGIN_WRITE).fetchone()[0]
                    self._offer(conn, count, offers, LOW)
            seen += len(rows)
            offered += len(offers)
            after = rows[-1][0]
        return seen, offered, after


@dataclass(eq=False)
class _Change:
    entity: Entity | None
    fields: list[str] | None
    seen: str
    states: dict[str, Any]
    ready: set[str]

    @property
    def id(self) -> str:
        return self.entity.id if self.entity is not None else ""

    @property
    def label(self) -> str:
        return f"should_process on {self.id!r}"


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


__all__ = ["BatchReport", "Engine"]
