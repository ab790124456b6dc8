"""The reactive scheduler's engine: which reactive tasks to launch now, and why (no Dagster here).

One tick, all state in Postgres (tables ``reactive_tasks`` and ``reactive_marks``, the tasks to evaluate),
time-boxed and resumable:

1. Definitions: tasks new to the code location, or whose trigger changed, are marked for evaluation.
2. Changes: CTL changes since the scheduler's watermark are read from the pub/sub stream; a
   parameter -> tasks index marks the tasks that use them (the watermark commits with the marks).
3. Runs: the runs in flight are looked up in bulk. On success the values a run was launched on become
   the task's last-seen values and the task is evaluated again; on failure the trigger stays armed and
   the task waits a backoff; when the backoff ends it is evaluated again.
4. Evaluation: only marked tasks, in batches, highest priority first. A task with a run queued or in
   progress is neither evaluated nor launched.
5. Launch: ready tasks by priority while fewer than ``max_concurrent_runs`` reactive runs are queued or
   running; each is re-evaluated first (a Delay may have decayed while it waited for a slot).
   Hold: while a task P with a run in flight ``produces`` a parameter read by a waiting task H, or any
   run in flight (reactive, scheduled or launched by hand) materializes an asset upstream of H, ready
   tasks of lower priority than H stay ready and are not launched: the queue waits for the more
   important task. The hold is found from the runs in flight and the parameter -> tasks index.
   A task's user code (its partition, run config and tags callables) runs between transactions, in a child
   process forked for it, under ``callable_timeout`` (killed at it): one that raises, exits, runs past it or
   returns what cannot be launched backs that task off alone, with its error sanitised; the tick leaves no
   thread or process of user code running behind it.
6. Hand-launched runs: successful runs tagged with a task's name (not launched by the scheduler) record
   their values as the task's last-seen values, like a reactive run (the manual recovery of a task whose trigger
   compares with the time or another parameter).

Time alone turns a trigger from false to true only through a ``Settle`` whose quiet time ends (Delay-type
conditions only decay), and a passed deadline launches a task with ``on_deadline='run'``: an evaluation stores
when that can happen (``wake_at``) and the tick marks the tasks whose time came. Tasks whose inputs did not
change and whose wake time did not come need no evaluation: there is no periodic full scan.

A tick reads no more than what changed: it knows the marks its own steps write and those left by its previous tick,
and the number of runs in flight, while the ticks follow one another in its process alone (each stores a token the
next finds, and the scheduler's lease stayed with the process). That is a cache, kept in memory: lost, or another
tick ran in between, the next tick reads the marks and the runs in flight from the tables. Explanations are stored
as the facts of each evaluation and rendered when read (cmb_dagster/reactive/explanations.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

import psycopg

from cmb_dagster import pubsub
from cmb_dagster._gc import cyclic_collection_paused
from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import (
    CTL_BRANCH_ID,
    check_values,
    values_as_of,
    values_from_json,
    values_to_json,
)
from cmb_dagster.database import Database, OwnConnection
from cmb_dagster.errors import InvalidInput
from cmb_dagster.executor import Executor, Task
from cmb_dagster.inputs import check_text, to_json
from cmb_dagster.isolation import describe_error, sanitize
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.admin import current_values
from cmb_dagster.reactive.errors import InvalidReactiveInput, PartitionNotReady, SchedulerConflict
from cmb_dagster.reactive.explanations import Explanation, stored_facts
from cmb_dagster.reactive.models import (
    ABOVE_HIGHEST_PRIORITY,
    LOWEST_PRIORITY,
    SCHEDULER_NAME,
    FixedLaunchOptions,
    Launch,
    LaunchOptions,
    ManualLookup,
    Partitioner,
    RunInfo,
    RunLookup,
    RunState,
    SchedulerSettings,
    SeenRun,
    TaskSpec,
    TickReport,
    sorted_keys,
)
from cmb_dagster.triggers import Settle, evaluate, parameters
from cmb_dagster.workers import Lease, Leases

log = logging.getLogger("cmb_dagster.reactive")

LEASE_KIND = "reactive.scheduler"
MANUAL_OVERLAP = timedelta(minutes=5)  # hand-launched runs are read again this far back (recorded once each)
PARTITION_KEY_LIMIT = 1000
"""Longest partition key a partition callable may return (it is stored with the task and its launch)."""
REMIND_AFTER = timedelta(hours=1)
"""A waiting task whose state did not change is shown in the tick log again after this long."""
REMINDERS_PER_TICK = 200
WAIT_STEP = 1.0
"""Seconds between two renewals of the tick's lease (when due) while user code runs."""
CHOOSING = "choosing the partition"
SHAPING = "its run config or tags"


@dataclass(frozen=True)
class _Hold:
    """Ready tasks below ``priority`` wait: ``producer``'s run feeds ``task``, a waiting task of that priority."""

    task: str
    priority: int
    producer: str


class _LaunchError(Exception):
    """A ready task's launch cannot be shaped (its partition, run config or tags raised, timed out or returned
    what cannot be launched)."""


@dataclass(frozen=True, slots=True)
class _Evaluation:
    name: str
    status: str  # ready, waiting, error
    explanation: Explanation
    values: dict[ParameterKey, datetime]
    last: dict[ParameterKey, datetime]
    wake_at: datetime | None = None  # waiting: when time alone can make it ready
    deadline: datetime | None = None  # ready: the passed deadline it launches for (on_deadline='run')


@dataclass(frozen=True, slots=True)
class _Stored:
    """A task's stored state that its evaluation reads."""

    name: str
    last: dict | None
    backwards_note: str | None
    last_success_at: datetime | None
    deadline_since: datetime | None


@dataclass(eq=False)
class _UserCall:
    """The user code of one launch (its partition, unless already chosen, run config and tags); ``code`` names
    what of it runs, for an error that no step of it reported (a timeout, the death of its process)."""

    evaluation: _Evaluation
    choose_partition: bool
    code: str = ""

    @property
    def label(self) -> str:
        return f"reactive task {self.evaluation.name}"


@dataclass(frozen=True)
class _Answer:
    """What a launch's user code gave, sent back from its process: the pickled (partition key, values, run config,
    tags), the partition it waits for (key, detail), or the error of the step that failed."""

    result: tuple[bytes, bytes] | None = None
    waits_for: tuple[str, str] | None = None
    error: str | None = None


@dataclass(frozen=True)
class _Wait:
    """A ready task whose partition does not exist yet: it waits (no attempt counted), evaluated again next tick."""

    evaluation: _Evaluation
    explanation: Explanation


@dataclass
class _Known:
    """What the scheduler's tables hold beyond what a tick reads anew, as the tick of ``token`` left them: valid
    while no other tick ran (the next tick finds that token stored) and no other process held the scheduler's lease
    (its ``fence`` is this one's, or the next). ``marked``: tasks left marked for evaluation (besides marks by
    hand); ``in_flight``: tasks with a run in flight; ``ready``: whether tasks may be stored as ready."""

    token: str
    fence: int
    marked: set[str]
    in_flight: int
    ready: bool

    def valid_for(self, lease: Lease, token: str | None) -> bool:
        return token == self.token and lease.fence in (self.fence, self.fence + 1)


@dataclass(frozen=True)
class _Shaped:
    """A launch ready to record: its evaluation (with the values its partition commits), partition, run config, tags."""

    evaluation: _Evaluation
    partition_key: str | None = None
    run_config: Mapping[str, Any] | None = None
    tags: dict[str, str] = field(default_factory=dict)


def values_hash(values: Mapping[ParameterKey, datetime], partition_key: str | None = None) -> str:
    """A short stable digest of CTL values and the partition (part of a run_key)."""
    return _encoded_values(values, partition_key)[1]


def _encoded_values(values: Mapping[ParameterKey, datetime], partition_key: str | None = None) -> tuple[str, str]:
    """``values`` in UTC as stored JSON text, and :func:`values_hash` of them (one encoding for both)."""
    nested: dict[str, dict[str, str]] = {}  # as values_to_json, the keys sorted by json.dumps
    for (entity, parameter), value in values.items():
        nested.setdefault(entity, {})[parameter] = value.astimezone(UTC).isoformat()
    text = json.dumps(nested, sort_keys=True)
    hashed = text if partition_key is None else text + "\n" + partition_key
    return text, hashlib.sha256(hashed.encode()).hexdigest()[:12]


class TaskScheduler:
    """Decides, tick after tick, which reactive tasks of one code location to launch.

    ``name`` identifies the code location's scheduler: task state is kept per (scheduler, task).
    """

    def __init__(
        self,
        database: Database,
        name: str,
        tasks: Sequence[TaskSpec],
        settings: SchedulerSettings | None = None,
        *,
        owner: str | None = None,
        location: str | None = None,
        partitioners: Mapping[str, Partitioner] | None = None,
        launch_options: Mapping[str, LaunchOptions] | None = None,
    ) -> None:
        if not SCHEDULER_NAME.match(name):
            raise InvalidReactiveInput(
                f"scheduler name {name!r} must be 1-50 of A-Z a-z 0-9 _ . - (not starting with . or -)"
            )
        seen: set[str] = set()
        for task in tasks:
            if task.name in seen:
                raise InvalidReactiveInput(f"two reactive tasks are named {task.name!r} in scheduler {name!r}")
            seen.add(task.name)
        self.database = database
        self.name = name
        self.settings = settings or SchedulerSettings()
        self.tasks = {task.name: task for task in tasks}
        self.location = location
        self.partitioners = dict(partitioners or {})
        self.launch_options = dict(launch_options or {})
        unknown = sorted((set(self.partitioners) | set(self.launch_options)) - set(self.tasks))
        if unknown:
            raise InvalidReactiveInput(
                f"partitioners or launch options for unknown reactive task(s): {', '.join(unknown)}"
            )
        self.reads = {task.name: tuple(sorted(parameters(task.trigger))) for task in tasks}  # task -> CTL parameters
        self.settles = {task.name: _settle_keys(task.trigger) for task in tasks}  # parameters whose change time counts
        self.trigger_hashes = {task.name: task.trigger_hash for task in tasks}
        self.index: dict[ParameterKey, list[str]] = defaultdict(list)
        self.downstream: dict[str, list[str]] = defaultdict(list)  # entity (asset key) -> tasks it is upstream of
        for task in tasks:
            for key in self.reads[task.name]:
                self.index[key].append(task.name)
            for entity in sorted(set(task.upstream)):
                self.downstream[entity].append(task.name)
        self.definitions_hash = hashlib.sha256(
            json.dumps(
                sorted((t.name, t.trigger_hash, t.priority, t.produces, t.deadline_json) for t in tasks)
            ).encode()
        ).hexdigest()[:16]
        self.leases = Leases(database, LEASE_KIND, owner, ttl=self.settings.tick_seconds + 10)

        def mark_changed(conn: psycopg.Connection, events: list[pubsub.Event]) -> None:
            self._mark_changed(conn, events)  # a closure: not registered as an importable handler

        spec = pubsub.ConsumerSpec(consumer_id=f"reactive.{name}", branch_id=CTL_BRANCH_ID, handler=mark_changed)
        self.consumer = pubsub.ConsumerWorker(database, spec)  # read batch by batch, within the tick
        # the tick's connection: statements planned as they run (a plan cached while the tables were small would
        # stay), and no JIT (without statistics, estimates of bulk statements trigger compiles of 100s of ms)
        self._own = OwnConnection(database, custom_plans=True, settings={"jit": "off"})
        self._lease: Lease | None = None
        self._report: TickReport | None = None
        self._ticking = threading.Lock()  # the lease is per owner: keep this process's ticks apart too
        # one call at a time, each in a child process forked for it: killed at its deadline, it leaves nothing behind
        self.executor = Executor(f"reactive:{name}", concurrency=1, isolation="process")
        self._deadline = 0.0  # time.monotonic() when the tick's time box ends
        self._user_code_until: float | None = None  # after it the tick starts no user code (None: none started)
        self._renew_at = 0.0  # when the tick's lease is renewed while user code runs
        self._known: _Known | None = None  # what the tables hold, as this process's last tick left them
        self._marked: set[str] = set()  # tasks the tick being run marked for evaluation
        self._single: set[str] = set()  # those of them with a mark of their own (the others are in batches)
        self._batches: set[int] = set()  # the batches of marks the tick being run evaluates
        self._left: set[str] = set()  # tasks the tick being run leaves marked (not evaluated, or evaluated again)

    # -- the tick -----------------------------------------------------------------------------

    def tick(
        self,
        runs: RunLookup,
        *,
        now: datetime | None = None,
        manual: ManualLookup | None = None,
        busy: Mapping[str, str] | None = None,
        lease: Lease | None = None,
    ) -> TickReport:
        """Run one time-boxed tick; return what it did.

        ``runs`` looks launched runs up by run_key; ``now`` is the evaluation time (default: the clock);
        ``manual`` lists successful hand-launched runs of the tasks; ``busy`` maps entities (asset keys)
        that a run in flight materializes to a description of that run (for the hold). ``lease``: the
        scheduler's lease, held for this engine's owner by the caller (a :class:`ReactiveWorker`'s loop);
        without it the tick takes the lease and releases it at its end.
        Raises :class:`SchedulerConflict` when another code location keeps this name with other tasks.
        """
        started = time.monotonic()
        deadline = started + self.settings.tick_seconds
        now = now or datetime.now(UTC)
        report = TickReport(self.name)
        if not self._ticking.acquire(blocking=False):
            report.busy = f"{self.name}: a tick is already running in this process; skipped"
            return report
        held_by_caller = lease is not None
        try:
            if lease is None:
                lease = self.leases.acquire([self.name]).get(self.name)
            if lease is None:
                report.busy = f"{self.name}: another process is running this scheduler's tick; skipped"
                return report
            self._lease, self._report = lease, report
            self._deadline, self._user_code_until = deadline, None
            self._renew_at = time.monotonic() + self.leases.ttl / 3
            known, self._known = self._known, None  # a tick that raises leaves nothing known
            token = uuid.uuid4().hex
            try:
                # one connection for the tick, one transaction per step (a single statement commits alone)
                with cyclic_collection_paused():
                    conn = self._own.get()
                    synced, previous = self._sync_definitions(conn, lease, now, report, token)
                    if synced or known is None or not known.valid_for(lease, previous):
                        known = None  # read the marks and the runs in flight from the tables
                    self._read_changes(deadline, report)
                    in_flight = self._follow_runs(conn, lease, runs, now, report, known)
                    if manual is not None:
                        self._record_manual_runs(conn, lease, manual, now, report)
                    fresh, failures = self._evaluate_marked(conn, lease, now, deadline, report, known)
                    hold = self._hold(conn, in_flight, busy or {}, fresh)
                    running, ready = self._launch_ready(
                        conn, lease, now, len(in_flight), hold, fresh, failures, report, known is None or known.ready
                    )
                    self._remind_waiting(conn, lease, now, report)
                    done = {"scheduler": self.name, "now": now, "seconds": time.monotonic() - started}
                    if self._batches:
                        batches = {"left": sorted(self._left), "batches": sorted(self._batches)}
                        conn.execute(sql.END_TICK, {**done, **batches})
                    else:  # every task left marked has a mark of its own
                        conn.execute(sql.SAVE_TICK, done)
                self._known = _Known(token, lease.fence, self._left, running, ready)
            finally:
                self._lease, self._report = None, None
                # freed within this tick, not at the start of the next
                self._marked, self._single, self._batches, self._left = set(), set(), set(), set()
                if not held_by_caller:
                    self.leases.release([self.name])
        finally:
            self._ticking.release()
            report.seconds = time.monotonic() - started
        return report

    def _sync_definitions(
        self, conn: psycopg.Connection, lease: Lease, now: datetime, report: TickReport, token: str
    ) -> tuple[bool, str | None]:
        """Start the tick of ``token`` and store the tasks' definitions unless stored already; whether they were (new
        and changed tasks are marked), and the token of the tick before."""
        params = {"scheduler": self.name, "location": self.location, "now": now, "token": token}
        row = conn.execute(sql.START_TICK, {**params, "hash": self.definitions_hash}).fetchone()
        previous = None if row is None else row[3]
        if row is not None:
            self._refuse_a_foreign_name(*row[:3], now)
        if row is not None and row[0] == self.definitions_hash:
            if self.location is not None and row[1] != self.location:
                conn.execute(sql.MOVE_SCHEDULER, params)
            return False, previous
        with conn.transaction():
            row = conn.execute(sql.LOCK_SCHEDULER_ROW, params).fetchone()
            if row is not None:
                self._refuse_a_foreign_name(*row, now)
            if row is not None and row[0] == self.definitions_hash:
                return False, previous
            Leases.check(conn, lease)
            if row is None:
                others = conn.execute(sql.OTHER_SCHEDULERS_WITH_STATE, params).fetchall()
                if others:
                    names = ", ".join(f"{name!r} ({count} task(s))" for name, count in others)
                    report.warnings.append(
                        f"scheduler {self.name!r} starts with no remembered state, but {names} "
                        "in the same schema has some: if this code location was renamed, pass that name as "
                        "ReactiveOptions(name=...) to keep the tasks' last-seen values (otherwise every "
                        "Delta-type trigger fires again as on a first release)"
                    )
            conn.execute(sql.SAVE_DEFINITIONS_HASH, {**params, "hash": self.definitions_hash})
            specs = sorted(self.tasks.values(), key=lambda t: t.name)
            conn.execute(
                sql.UPSERT_TASKS,
                {
                    **params,
                    "names": [t.name for t in specs],
                    "triggers": [t.trigger_json for t in specs],
                    "hashes": [t.trigger_hash for t in specs],
                    "priorities": [t.priority for t in specs],
                    "timezones": [t.timezone for t in specs],
                    "produces": [json.dumps(t.produces) for t in specs],
                    "deadlines": [t.deadline_json for t in specs],
                },
            )
            conn.execute(sql.UNDEFINE_MISSING_TASKS, {**params, "names": [t.name for t in specs]})
        report.definitions_synced = True
        return True, previous

    def _refuse_a_foreign_name(
        self, definitions_hash: str, location: str | None, ticked_at: datetime | None, now: datetime
    ) -> None:
        """Two code locations whose scheduler names are the same (e.g. 'team a' and 'team_a') with other tasks."""
        if self.location is None or location is None or location == self.location:
            return
        if definitions_hash == self.definitions_hash:
            return  # the same tasks: a copy of the same code, nothing to fight over
        if ticked_at is not None and ticked_at > now - self.settings.takeover_after:
            raise SchedulerConflict(
                f"reactive scheduler name {self.name!r} is used by code location {location!r} with other tasks "
                f"(it ticked at {ticked_at:%Y-%m-%d %H:%M:%S %Z}); code location {self.location!r} refuses to tick "
                "so the two do not rewrite each other's tasks. Give one of them its own "
                "ReactiveOptions(name=...); if the location was renamed, this one takes over once the old one "
                f"has not ticked for {self.settings.takeover_after}"
            )

    def _read_changes(self, deadline: float, report: TickReport) -> None:
        while self.consumer.run_once():  # at least one batch per tick, so every tick makes progress
            if time.monotonic() >= deadline:
                report.complete = False
                return

    def _mark_changed(self, conn: psycopg.Connection, events: Sequence[pubsub.Event]) -> None:
        """Pub/sub handler, inside the consumer's transaction: mark the tasks that use changed parameters."""
        assert self._lease is not None and self._report is not None, "CTL changes are read inside a tick"
        Leases.check(conn, self._lease)
        affected: set[str] = set()
        notes: dict[str, str] = {}
        changes = [change for event in events for change in _changes(event)]
        for payload in changes:
            key = (payload["entity"], payload["parameter"])
            names = self.index.get(key, ())
            affected.update(names)
            if payload.get("backwards") and names:
                note = sanitize(
                    f"{key[0]}/{key[1]} moved backwards from {payload.get('old')} to {payload.get('new')} "
                    f"(by {payload.get('by')}); Delta triggers on it wait until it passes the last-seen value "
                    f"(move the last-seen value back: cmb-dagster reactive set-last {self.name} TASK "
                    f"--parameter {key[0]} {key[1]} --value VALUE, or forget it: cmb-dagster reactive forget "
                    f"{self.name} TASK)"
                )
                notes.update(dict.fromkeys(names, note))
        params = {"scheduler": self.name}
        if affected:
            self._batches.add(conn.execute(sql.MARK_TASKS, {**params, "names": sorted(affected)}).fetchone()[0])
            self._marked |= affected
        if notes:
            conn.execute(sql.NOTE_BACKWARDS, {**params, "names": list(notes), "notes": list(notes.values())})
        self._report.changes += len(changes)

    def _follow_runs(
        self,
        conn: psycopg.Connection,
        lease: Lease,
        runs: RunLookup,
        now: datetime,
        report: TickReport,
        known: _Known | None,
    ) -> dict[str, tuple[ParameterKey, ...]]:
        """Handle finished runs (none are read when no run is known to be in flight); re-request lost launches; end
        backoffs and wake tasks whose time came. Return the tasks in flight and what they produce."""
        params: dict[str, Any] = {"scheduler": self.name, "now": now}
        launched: list[tuple[Any, ...]] = []
        finished: list[tuple[str, str, str, bool, datetime | None]] = []
        lost: list[Launch] = []
        if known is None or known.in_flight:
            with conn.transaction():
                launched = conn.execute(sql.LAUNCHED_TASKS, params).fetchall()
                found = runs(self.name, [row[1] for row in launched]) if launched else {}
                self._finish(conn, lease, params, launched, found, finished, lost, report)
        self._marked.update(name for name, _, _, success, _ in finished if success)  # in a batch
        for statement in (sql.END_BACKOFFS, sql.WAKE_TASKS):  # the tasks each marks (and those marked by hand)
            self._single.update(row[0] for row in conn.execute(statement, params))
        self._marked |= self._single
        self._relaunch(lost, report)
        done = {f[0] for f in finished}
        return {row[0]: sorted_keys(row[7]) for row in launched if row[0] not in done}

    def _finish(
        self,
        conn: psycopg.Connection,
        lease: Lease,
        params: dict[str, Any],
        launched: Sequence[tuple[Any, ...]],
        found: Mapping[str, RunInfo],
        finished: list[tuple[str, str, str, bool, datetime | None]],
        lost: list[Launch],
        report: TickReport,
    ) -> None:
        """Inside the transaction that read the ``launched`` tasks: note the runs ``found`` for them, record those
        that finished (appended to ``finished``) and collect the launches whose run never appeared (``lost``)."""
        now = params["now"]
        seen: list[tuple[str, str]] = []
        for name, run_key, run_id, launched_at, attempts, ready_values, text, _, partition, facts in launched:
            run = found.get(run_key)
            if run is None:
                if launched_at <= now - self.settings.launch_grace:
                    attempt = int(run_key.rsplit(":", 1)[1])
                    lost.append(
                        Launch(
                            name,
                            run_key,
                            attempt,
                            values_from_json(ready_values),
                            self._explained(name, text, facts),
                            relaunch=True,
                            partition_key=partition,
                        )
                    )
                else:
                    report.note(name, "in progress", f"run {run_key} requested at {launched_at}, not yet created")
            elif run.state is RunState.ACTIVE:
                if run.run_id != run_id:
                    seen.append((name, run.run_id))
                report.note(name, "in progress", f"run {run.run_id} ({run_key}) is queued or running")
            if run is not None and run.run_id != run_id:
                why = self._explained(name, text, facts)
                report.seen_runs.append(SeenRun(name, run.run_id, run_key, values_from_json(ready_values), why))
            if run is None or run.state is RunState.ACTIVE:
                continue
            if run.state is RunState.SUCCESS:
                finished.append((name, run_key, run.run_id, True, None))
                report.note(name, "succeeded", f"run {run.run_id} succeeded: its CTL values are now last-seen")
            else:
                backoff = self._backoff(attempts)
                finished.append((name, run_key, run.run_id, False, now + backoff))
                report.note(
                    name,
                    "failed",
                    f"run {run.run_id} failed (failure {attempts + 1} in a row); trigger stays armed, "
                    f"retry after {backoff} at {now + backoff}",
                )
        if seen or finished:
            Leases.check(conn, lease)
        if seen:
            names, run_ids = [s[0] for s in seen], [s[1] for s in seen]
            conn.execute(sql.NOTE_RUN_IDS, {**params, "names": names, "run_ids": run_ids})
        if finished:
            rows = [
                {"name": n, "run_key": k, "run_id": i, "success": ok, "backoff_until": b.isoformat() if b else None}
                for n, k, i, ok, b in finished
            ]
            batch = conn.execute(sql.FINISH_RUNS, {**params, "rows": json.dumps(rows)}).fetchone()
            if batch is not None:
                self._batches.add(batch[0])

    def _explained(self, name: str, text: str | None, facts: Mapping[str, Any] | None) -> Explanation:
        """A task's explanation as stored (``text`` and ``facts``), rendered with its trigger when read."""
        spec = self.tasks.get(name)
        if spec is None:
            return Explanation.stored(text, facts, None, None, "UTC")
        return Explanation.stored(text, facts, spec.trigger, self.trigger_hashes[name], spec.timezone)

    def _relaunch(self, lost: Sequence[Launch], report: TickReport) -> None:
        """Request again the runs that never appeared, with the run config and tags their user code gives now."""
        shapes = self._shape(
            [_UserCall(_Evaluation(x.task, "ready", _explanation(x.why), x.values, {}), False) for x in lost]
        )
        for launch, shape in zip(lost, shapes, strict=True):
            if shape is None:
                report.note(
                    launch.task,
                    "in progress",
                    f"no run with run_key {launch.run_key} appeared; "
                    "requested again by a later tick (this one's time for user code is spent)",
                )
            elif isinstance(shape, str):
                report.note(launch.task, "error", f"run {launch.run_key} cannot be requested again: {shape}")
            else:
                report.launches.append(replace(launch, run_config=shape.run_config, tags=shape.tags))
                report.note(
                    launch.task, "relaunched", f"no run with run_key {launch.run_key} appeared; requested again"
                )

    def _record_manual_runs(
        self, conn: psycopg.Connection, lease: Lease, manual: ManualLookup, now: datetime, report: TickReport
    ) -> None:
        """Successful hand-launched runs tagged with a task: their values become its last-seen values, once each."""
        params: dict[str, Any] = {"scheduler": self.name, "now": now}
        with conn.transaction():
            row = conn.execute(sql.MANUAL_AFTER, params).fetchone()
            after = row[0] if row else None
            found = [run for run in manual(after - MANUAL_OVERLAP if after else None) if run.task in self.tasks]
            if not found:
                return
            rows = []
            for run in sorted(found, key=lambda r: r.finished_at):
                keys = self.reads[run.task]
                values = run.values if run.values is not None else values_as_of(conn, keys, run.started_at)
                values = {k: v for k, v in values.items() if k in keys}
                rows.append(
                    {
                        "name": run.task,
                        "run_key": f"manual:{run.run_id}",
                        "run_id": run.run_id,
                        "values": values_to_json(values),
                        "hash": values_hash(values),
                        "finished_at": run.finished_at.isoformat(),
                    }
                )
            Leases.check(conn, lease)
            recorded = conn.execute(sql.RECORD_MANUAL_RUNS, {**params, "rows": json.dumps(rows)}).fetchall()
            conn.execute(sql.SAVE_MANUAL_AFTER, {**params, "after": max(r.finished_at for r in found)})
        self._single.update(task for task, _, _ in recorded)
        self._marked |= self._single
        for task, run_id, values in recorded:
            report.manual += 1
            report.note(
                task,
                "recorded",
                f"hand-launched run {run_id} succeeded: its values {json.dumps(values)} are now last-seen",
            )

    def _hold(
        self,
        conn: psycopg.Connection,
        in_flight: Mapping[str, tuple[ParameterKey, ...]],
        busy: Mapping[str, str],
        ready: Mapping[str, _Evaluation],
    ) -> _Hold | None:
        """The highest-priority waiting task fed by a run in flight, if any (it holds the tasks below it);
        ``ready`` tasks, found ready in this tick and not saved yet, do not wait."""
        producers: dict[str, str] = {}  # waiting task -> what feeds it: a reactive task in flight, or another run
        for producer in sorted(in_flight):
            for key in in_flight[producer]:
                for name in self.index.get(key, ()):
                    producers.setdefault(name, producer)
        for entity in sorted(busy):
            for name in self.downstream.get(entity, ()):
                producers.setdefault(name, f"{busy[entity]} (materializes {entity})")
        producers = {name: producer for name, producer in producers.items() if name not in ready}
        if not producers:
            return None
        with conn.transaction():
            row = conn.execute(sql.TOP_WAITING_TASK, {"scheduler": self.name, "names": list(producers)}).fetchone()
        return None if row is None else _Hold(task=row[0], priority=row[1], producer=producers[row[0]])

    def _evaluate_marked(
        self,
        conn: psycopg.Connection,
        lease: Lease,
        now: datetime,
        deadline: float,
        report: TickReport,
        known: _Known | None,
    ) -> tuple[dict[str, _Evaluation], dict[str, int]]:
        """Evaluate the marked tasks in batches, highest priority first, until none is left or the time box ends;
        return the ready ones and their failed runs in a row. The marked tasks are those the tick knows of (its own
        marks, those its last tick left) and those marked by hand; all marks are read when it knows none."""
        params: dict[str, Any] = {"scheduler": self.name, "now": now}
        ready: dict[str, _Evaluation] = {}
        failures: dict[str, int] = {}
        if known is None:
            self._single.update(row[0] for row in conn.execute(sql.MARKED_TASKS, params))
            for batch, names in conn.execute(sql.MARK_BATCHES, params).fetchall():
                self._batches.add(batch)
                self._marked.update(names)
        else:
            self._single |= known.marked
        marked = sorted(self._marked | self._single, key=self._rank)
        size = self.settings.batch_size
        read = self._read(conn, marked, now)  # the CTL values of every batch, in one statement
        for start in range(0, len(marked), size):
            with conn.transaction():
                rows = conn.execute(sql.TASKS_TO_EVALUATE, {**params, "names": marked[start : start + size]}).fetchall()
                evaluations = [self._evaluate_one(_Stored(r[0], r[1], r[2], r[5], r[6]), read) for r in rows]
                Leases.check(conn, lease)
                # ready tasks stay marked: the launch step launches or saves them (a crash meanwhile re-evaluates them)
                self._save(conn, params, [e for e in evaluations if e.status != "ready"])
            report.evaluated += len(evaluations)
            attempts = {r[0]: r[4] for r in rows}
            for e in evaluations:
                if e.status == "ready":
                    ready[e.name] = e
                    failures[e.name] = attempts[e.name]
                else:
                    report.note(e.name, e.status, e.explanation)
            if start + size < len(marked) and time.monotonic() >= deadline:
                report.complete = False
                self._left.update(marked[start + size :])
                break
        return ready, failures

    def _launch_ready(
        self,
        conn: psycopg.Connection,
        lease: Lease,
        now: datetime,
        in_flight: int,
        hold: _Hold | None,
        fresh: Mapping[str, _Evaluation],
        failures: Mapping[str, int],
        report: TickReport,
        stored: bool,
    ) -> tuple[int, bool]:
        """Launch ready tasks by priority under the cap and above a hold: those evaluated in this tick (not saved
        yet) and those left ready by earlier ticks (evaluated again first; ``stored``: there may be some); the rest
        are saved as ready. Their user code runs between transactions. Return the runs now in flight and whether
        tasks may be left stored as ready."""
        cap = self.settings.max_concurrent_runs
        params: dict[str, Any] = {"scheduler": self.name, "now": now}
        floor = hold.priority if hold else LOWEST_PRIORITY
        launchable = {"min_priority": floor, "max_priority": ABOVE_HIGHEST_PRIORITY}
        pending = sorted((e for e in fresh.values() if self.tasks[e.name].priority >= floor), key=self._order)
        unsaved = [e for e in fresh.values() if self.tasks[e.name].priority < floor]
        cut = False  # the tick's time for user code ran out
        while in_flight < cap and (stored or pending):
            with conn.transaction() if stored else nullcontext():
                limit = cap - in_flight
                rows = []
                if stored:
                    rows = conn.execute(sql.READY_TASKS, {**params, **launchable, "limit": limit}).fetchall()
                rows = [r for r in rows if r[0] not in fresh]  # ready before and evaluated again in this tick
                if not rows and not pending:
                    break
                candidates = [(r[4], r[0]) for r in rows] + [(self.tasks[e.name].priority, e.name) for e in pending]
                names = {name for _, name in sorted(candidates, key=lambda c: (-c[0], c[1]))[:limit]}
                stale = [_Stored(r[0], r[1], r[2], r[5], r[6]) for r in rows if r[0] in names]
                attempts_so_far = {**failures, **{r[0]: r[3] for r in rows}}
                evaluations = self._evaluate(conn, stale, now) if stale else []
                ready = [e for e in pending if e.name in names] + [e for e in evaluations if e.status == "ready"]
                pending = [e for e in pending if e.name not in names]
                ready.sort(key=self._order)
                gone = [e for e in evaluations if e.status != "ready"]
                if gone:
                    Leases.check(conn, lease)
                    self._save(conn, params, gone)
            for e in gone:
                report.note(e.name, e.status, e.explanation.prefixed("no longer fires now that a slot is free: "))
            shapes = self._shape([_UserCall(e, True) for e in ready])
            launches = self._launch(conn, lease, params, list(zip(ready, shapes, strict=True)), attempts_so_far, report)
            report.launches.extend(launches)
            for launch in launches:
                report.note(launch.task, "launched", _explanation(launch.why).prefixed(f"run_key {launch.run_key}: "))
            in_flight += len(launches)
            later = [e for e, shape in zip(ready, shapes, strict=True) if shape is None]
            if later:
                unsaved.extend(later)
                report.complete, cut = False, True
                for e in later:
                    report.note(e.name, "ready", "waits for the next tick: this tick's time for user code is spent")
                break
        left = bool(pending or unsaved) or (stored and (in_flight >= cap or hold is not None or cut))
        if pending or unsaved:
            with conn.transaction():
                Leases.check(conn, lease)
                self._save(conn, params, [*pending, *unsaved])
        if hold:
            held = {"min_priority": LOWEST_PRIORITY, "max_priority": hold.priority}
            why = f"waiting for {hold.producer} which feeds higher-priority {hold.task} (priority {hold.priority})"
            self._note_not_launched(conn, {**params, **held}, "held", why, report)
        if in_flight >= cap:
            why = f"ready, waits for a slot: {in_flight}/{cap} reactive runs queued or running"
            self._note_not_launched(conn, {**params, **launchable}, "capped", why, report)
        return in_flight, left

    def _remind_waiting(self, conn: psycopg.Connection, lease: Lease, now: datetime, report: TickReport) -> None:
        """Show again the waiting tasks whose explanation (what blocks them) the tick log has not shown for an hour
        (a task whose state changes is shown on that tick)."""
        params = {"scheduler": self.name, "now": now, "since": now - REMIND_AFTER, "limit": REMINDERS_PER_TICK}
        if not conn.execute(sql.REMINDERS_DUE, params).fetchone()[0]:
            return
        with conn.transaction():
            Leases.check(conn, lease)
            rows = conn.execute(sql.REMIND_WAITING, params).fetchall()
        for name, text, facts, evaluated_at, _ in sorted(rows, key=lambda r: (-r[4], r[0])):
            since = f" since {evaluated_at:%Y-%m-%d %H:%M:%S %Z}" if evaluated_at else ""
            if text is None and facts is None:
                report.note(name, "still waiting", f"unchanged{since}: not evaluated yet")
            else:
                report.note(name, "still waiting", self._explained(name, text, facts).prefixed(f"unchanged{since}: "))

    def close(self) -> None:
        """Close the connections kept between ticks (the next tick opens them again)."""
        self._own.close()
        self.consumer.close()

    def never_set(self, keys: Sequence[ParameterKey]) -> set[ParameterKey]:
        """Those of ``keys`` that have no CTL value (none was ever set)."""
        if not keys:
            return set()
        with self.database.connection() as conn:
            found, _ = current_values(conn, sorted(set(keys)))
        return {key for key in keys if key not in found}

    def _backoff(self, failures_before: int) -> timedelta:
        """How long a task waits after a failure that ``failures_before`` failures in a row preceded."""
        return timedelta(seconds=self.settings.backoff.delay(failures_before))

    def _order(self, evaluation: _Evaluation) -> tuple[int, str]:
        return -self.tasks[evaluation.name].priority, evaluation.name

    def _rank(self, name: str) -> tuple[int, str]:
        """Highest priority first (a task this code does not define: last)."""
        spec = self.tasks.get(name)
        return -(spec.priority if spec is not None else LOWEST_PRIORITY), name

    def _note_not_launched(
        self, conn: psycopg.Connection, params: dict[str, Any], action: str, why: str, report: TickReport
    ) -> None:
        """Report the first ready tasks within ``params``' priority bounds, and how many more there are."""
        with conn.transaction():
            shown = conn.execute(sql.READY_TASKS, {**params, "limit": 20}).fetchall()
            waiting = conn.execute(sql.COUNT_READY, params).fetchone()[0] if len(shown) == 20 else len(shown)
        for row in shown:
            report.note(row[0], action, why)
        if waiting > len(shown):
            report.note("...", action, f"{waiting - len(shown)} more ready task(s): {why}")

    def _shape(self, calls: Sequence[_UserCall]) -> list[_Shaped | _Wait | str | None]:
        """Each launch as its user code shapes it, run outside any transaction: a :class:`_Shaped`, a :class:`_Wait`
        (its partition does not exist yet), the error of its user code (raised, timed out, or an unusable result),
        or None when the tick's time for user code was spent before it started."""
        needed = [c for c in calls if self._has_user_code(c)]
        crashed = self._count_user_code([c.evaluation.name for c in needed])
        runnable = [c for c in needed if c.evaluation.name not in crashed]
        ran = {id(task.item): task for task in self._call_user_code(runnable)}
        self._end_user_code(
            [c.evaluation.name for c in runnable if id(c) in ran],
            [c.evaluation.name for c in runnable if id(c) not in ran],
        )
        shapes: list[_Shaped | _Wait | str | None] = []
        for c in calls:
            name = c.evaluation.name
            try:
                if not self._has_user_code(c):
                    options = self.launch_options.get(name)
                    run_config, tags = options(c.evaluation.values) if options is not None else (None, {})
                    shapes.append(self._checked(c, None, c.evaluation.values, run_config, tags))
                elif name in crashed:
                    shapes.append(
                        f"its user code ended with the death of its process {crashed[name]} times in a row; "
                        f"not run again until `cmb-dagster reactive retry {self.name} {name}`"
                    )
                elif id(c) not in ran:
                    shapes.append(None)
                else:
                    shapes.append(self._shaped(ran[id(c)]))
            except _LaunchError as exc:
                shapes.append(str(exc))
        return shapes

    def _count_user_code(self, names: Sequence[str]) -> dict[str, int]:
        """Count a run of these tasks' user code before it starts (committed); return the tasks whose earlier
        runs ended with the death of their process ``max_crashes`` times, with that count (they do not run)."""
        if not names:
            return {}
        with self.database.connection() as conn:
            return dict(
                conn.execute(
                    sql.COUNT_USER_CODE,
                    {"scheduler": self.name, "names": list(names), "max_crashes": self.settings.max_crashes},
                ).fetchall()
            )

    def _end_user_code(self, ended: Sequence[str], unstarted: Sequence[str]) -> None:
        if ended or unstarted:
            with self.database.connection() as conn:
                conn.execute(
                    sql.END_USER_CODE, {"scheduler": self.name, "ended": list(ended), "unstarted": list(unstarted)}
                )

    def _chooses_partition(self, call: _UserCall) -> bool:
        return call.choose_partition and call.evaluation.name in self.partitioners

    def _user_code_of(self, call: _UserCall) -> str:
        """What user code a launch runs, as its errors name it ("": none)."""
        options = self.launch_options.get(call.evaluation.name)
        shapes = options is not None and not isinstance(options, FixedLaunchOptions)
        return " or ".join(([CHOOSING] if self._chooses_partition(call) else []) + ([SHAPING] if shapes else []))

    def _has_user_code(self, call: _UserCall) -> bool:
        return bool(self._user_code_of(call))

    def _call_user_code(self, calls: Sequence[_UserCall]) -> list[Task[_UserCall]]:
        """Run the user code of ``calls``, one after another, each in a child process under ``callable_timeout``,
        keeping the tick's lease; return the calls that ran (each has ended: its process is gone). A tick starts
        calls within its time box, or within ``callable_timeout`` of its first call if that ends later."""
        if not calls:
            return []
        timeout = self.settings.callable_timeout
        if self._user_code_until is None:
            self._user_code_until = max(self._deadline, time.monotonic() + timeout)
        ran = []
        for call in calls:
            if time.monotonic() >= self._user_code_until:
                break
            call.code = self._user_code_of(call)
            task = self.executor.start(call, self._run_user_code, timeout)
            try:
                while not task.ended:
                    self.executor.wait(WAIT_STEP)
                    self.executor.ended()
                    self._keep_lease()
                    self.executor.check()
            finally:  # a renewal that raised: the call still ends (killed at its deadline) before the tick does
                self.executor.wait_all(timeout)
                self.executor.ended()
            ran.append(task)
        return ran

    def _run_user_code(self, call: _UserCall) -> _Answer:
        """The (partition key, values, run config, tags) of a launch from its user code, pickled to cross back to
        the scheduler's process; or the partition it waits for, or the error of the step that failed. Runs in
        the child process of the call."""
        e = call.evaluation
        key: Any = None
        values: Any = e.values
        run_config: Any = None
        tags: dict[str, str] = {}
        step = CHOOSING
        try:
            partitioner = self.partitioners.get(e.name) if call.choose_partition else None
            if partitioner is not None:
                key, values = partitioner(e.values, e.last)
            step = SHAPING
            options = self.launch_options.get(e.name)
            if options is not None:
                run_config, raw_tags = options(values)
                tags = {str(k): str(v) for k, v in (raw_tags or {}).items()}
        except PartitionNotReady as exc:
            return _Answer(waits_for=(str(exc.partition_key), str(exc.detail)))
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt of user code too
            return _Answer(error=f"{step} raised {describe_error(exc)}")
        pickled = []
        for step, part in ((CHOOSING, (key, values)), (SHAPING, (run_config, tags))):
            try:
                pickled.append(pickle.dumps(part))
            except BaseException as exc:  # noqa: BLE001 - pickling runs the objects' own code
                why = f"it cannot be pickled to reach the scheduler's process ({describe_error(exc)})"
                return _Answer(error=f"{step} returned an unusable result: {why}")
        return _Answer(result=(pickled[0], pickled[1]))

    def _shaped(self, task: Task[_UserCall]) -> _Shaped | _Wait:
        """The launch a call of user code shaped, or a :class:`_Wait` when its partition does not exist yet;
        :class:`_LaunchError` if it raised, exited, timed out or returned what cannot be launched."""
        item = task.item
        try:
            answer: _Answer = task.outcome
        except Exception as exc:  # noqa: BLE001 - its process was killed at the deadline, or died
            raise _LaunchError(f"{item.code} raised {describe_error(exc)}") from None
        if answer.error is not None:
            raise _LaunchError(answer.error)
        if answer.waits_for is not None:
            partition_key, detail = answer.waits_for
            detail = f" ({sanitize(detail)})" if detail else ""
            why = (
                f"waiting for partition {sanitize(partition_key)}: it does not exist yet{detail}; "
                "evaluated again on the next ticks (no failed attempt counted)"
            )
            return _Wait(item.evaluation, item.evaluation.explanation.prefixed(why + "\n"))
        chosen, shaped = answer.result or (b"", b"")
        key, values = _unpickled(CHOOSING, chosen)
        run_config, tags = _unpickled(SHAPING, shaped)
        return self._checked(item, key, values, run_config, tags)

    def _checked(self, item: _UserCall, key: Any, values: Any, run_config: Any, tags: Any) -> _Shaped:
        """The launch of ``item`` on what its user code returned; :class:`_LaunchError` if that cannot be launched
        (a partition key or values CTL cannot store, a run config or tags that are not JSON within the payload
        limit)."""
        e = item.evaluation
        if self._chooses_partition(item):
            try:
                key = check_text(key, "partition key", max_length=PARTITION_KEY_LIMIT)
                values = check_values(values)
            except InvalidInput as exc:
                why = describe_error(exc)
                raise _LaunchError(f"{CHOOSING} returned an unusable result: {why}") from None
            explanation = e.explanation.prefixed(f"partition {key} (commits {_values_text(values)} on success)\n")
            e = _Evaluation(e.name, e.status, explanation, values, e.last)
        try:
            to_json({"run_config": run_config, "tags": tags}, "run config and tags")
        except InvalidInput as exc:
            raise _LaunchError(f"{SHAPING} returned an unusable result: {describe_error(exc)}") from None
        return _Shaped(e, key, run_config, dict(tags))

    def _keep_lease(self) -> None:
        """Renew the tick's lease while user code runs (a slow call must not cost the scheduler its lease)."""
        if time.monotonic() >= self._renew_at:
            self.leases.acquire([self.name])
            self._renew_at = time.monotonic() + self.leases.ttl / 3

    def _launch(
        self,
        conn: psycopg.Connection,
        lease: Lease,
        params: dict[str, Any],
        candidates: Sequence[tuple[_Evaluation, _Shaped | _Wait | str | None]],
        attempts_so_far: Mapping[str, int],
        report: TickReport,
    ) -> list[Launch]:
        """In one transaction, record the launches of the shaped ``candidates``; one whose user code failed backs
        off with the error (those not shaped are left as they are)."""
        shaped = [shape for _, shape in candidates if isinstance(shape, _Shaped)]
        waits = [shape for _, shape in candidates if isinstance(shape, _Wait)]
        refused = []
        for candidate, shape in candidates:
            if isinstance(shape, str):
                backoff = self._backoff(attempts_so_far.get(candidate.name, 0))
                why = f"error: {shape}; not launched, retry after {backoff} at {params['now'] + backoff}"
                explanation = candidate.explanation.prefixed(why + "\n")
                refused.append(
                    {
                        "name": candidate.name,
                        "explanation": explanation.text,
                        "facts": explanation.facts,
                        "backoff_until": (params["now"] + backoff).isoformat(),
                        "unmark": candidate.name in self._single,
                    }
                )
                report.note(candidate.name, "error", why)
        if not shaped and not refused and not waits:
            return []
        with conn.transaction():
            Leases.check(conn, lease)
            if refused:
                conn.execute(sql.LAUNCH_REFUSED, {**params, "rows": json.dumps(refused)})
            if waits:
                rows = [
                    {"name": w.evaluation.name, "explanation": w.explanation.text, "facts": w.explanation.facts}
                    for w in waits
                ]
                shown = dict(conn.execute(sql.WAIT_FOR_PARTITION, {**params, "rows": json.dumps(rows)}).fetchall())
                self._left.update(shown)  # still marked: evaluated again next tick
                for w in waits:
                    if shown.get(w.evaluation.name):  # its state changed: shown now (unchanged: hourly)
                        report.note(w.evaluation.name, "waiting", w.explanation)
            return self._record_launches(conn, params, shaped, attempts_so_far) if shaped else []

    def _record_launches(
        self,
        conn: psycopg.Connection,
        params: dict[str, Any],
        shaped: Sequence[_Shaped],
        attempts_so_far: Mapping[str, int],
    ) -> list[Launch]:
        """Record the launches of ``shaped`` (run_key: task, values and partition, attempt); return those recorded."""
        encoded = {s.evaluation.name: _encoded_values(s.evaluation.values, s.partition_key) for s in shaped}
        hashes = {name: digest for name, (_, digest) in encoded.items()}
        previous = {
            (task, digest): count
            for task, digest, count in conn.execute(
                sql.PREVIOUS_ATTEMPTS,
                {**params, "rows": json.dumps([{"task": t, "values_hash": h} for t, h in hashes.items()])},
            ).fetchall()
        }
        planned = []
        reasons: dict[str, Explanation] = {}
        for s in shaped:
            e = s.evaluation
            attempt = previous.get((e.name, hashes[e.name]), 0) + 1
            reason = e.explanation
            if attempts_so_far.get(e.name):
                reason = reason.prefixed(f"retry after {attempts_so_far[e.name]} failed run(s); ")
            reasons[e.name] = reason
            planned.append(
                Launch(
                    e.name,
                    f"{e.name}:{hashes[e.name]}:{attempt}",
                    attempt,
                    e.values,
                    reason,
                    partition_key=s.partition_key,
                    run_config=s.run_config,
                    tags=s.tags,
                    deadline=e.deadline,
                )
            )
        columns = {
            "names": [p.task for p in planned],
            "run_keys": [p.run_key for p in planned],
            "values": [encoded[p.task][0] for p in planned],
            "hashes": [hashes[p.task] for p in planned],
            "attempts": [p.attempt for p in planned],
            "reasons": [reasons[p.task].text for p in planned],
            "facts": json.dumps([reasons[p.task].facts for p in planned]),
            "partition_keys": [p.partition_key for p in planned],
            "unmarks": [p.task in self._single for p in planned],
        }
        launched = {row[0] for row in conn.execute(sql.MARK_LAUNCHED, {**params, **columns}).fetchall()}
        return [p for p in planned if p.task in launched]

    # -- evaluation ---------------------------------------------------------------------------

    def _evaluate(self, conn: psycopg.Connection, rows: Sequence[_Stored], now: datetime) -> list[_Evaluation]:
        read = self._read(conn, [row.name for row in rows], now)
        return [self._evaluate_one(row, read) for row in rows]

    def _read(self, conn: psycopg.Connection, names: Sequence[str], now: datetime) -> _Read:
        """The current values of the CTL parameters the tasks ``names`` read."""
        keys = sorted({key for name in names for key in self.reads.get(name, ())})
        current, changed = current_values(conn, keys)
        return _Read(now, current, changed)

    def _evaluate_one(self, row: _Stored, read: _Read) -> _Evaluation:
        name, now, last = row.name, read.now, _last_values(row.last)
        spec = self.tasks.get(name)
        if spec is None:
            why = "not defined in this process's code (another version synced it)"
            return _Evaluation(name, "error", Explanation(why), {}, last)
        try:
            result = evaluate(
                spec.trigger, now=now, current=read.current, last=last, timezone=spec.timezone, changed=read.changed
            )
        except Exception as exc:  # noqa: BLE001 - one bad task must not break the tick
            error = describe_error(exc)
            log.warning("reactive task %s: evaluating %r raised %s", name, spec.trigger, error)
            return _Evaluation(name, "error", Explanation(f"evaluating the trigger raised {error}"), {}, last)
        facts = stored_facts(
            self.trigger_hashes[name],
            read.at,
            read.values(self.reads[name], self.settles[name], row.last or {}),
            row.backwards_note,
        )
        explanation = Explanation("", facts, spec.trigger, spec.timezone)
        if result.fired and any(last.get(key) != value for key, value in result.used.items()):
            return _Evaluation(name, "ready", explanation, dict(result.used), last)
        wake_at = result.wake_at
        if spec.deadline is not None and spec.on_deadline == "run" and row.deadline_since is not None:
            state = spec.deadline.state(now, spec.timezone, row.last_success_at, row.deadline_since)
            if state.late:
                why = (
                    f"deadline {spec.deadline.describe(spec.timezone)} passed at {state.due_at} without a successful "
                    f"run since {state.since}: launched anyway (on_deadline='run'), though its trigger waits\n"
                )
                late = explanation.prefixed(why)
                return _Evaluation(name, "ready", late, dict(result.used), last, None, state.due_at)
            wake_at = state.due_at if wake_at is None else min(wake_at, state.due_at)  # met or not: the next follows it
        return _Evaluation(name, "waiting", explanation, {}, last, wake_at)

    def _save(self, conn: psycopg.Connection, params: dict[str, Any], evaluations: Sequence[_Evaluation]) -> None:
        if not evaluations:
            return
        rows = [
            {
                "name": e.name,
                "status": e.status,
                "ready_values": values_to_json(e.values) if e.values else None,
                "explanation": e.explanation.text,
                "facts": e.explanation.facts,
                "wake_at": e.wake_at.isoformat() if e.wake_at else None,
                "unmark": e.name in self._single,
            }
            for e in evaluations
        ]
        conn.execute(sql.SAVE_EVALUATIONS, {**params, "rows": json.dumps(rows)})


class _Read:
    """What a tick's evaluations read: the time, the current CTL values and when each was set, and both as stored
    (ISO 8601, once per parameter)."""

    __slots__ = ("at", "changed", "changed_text", "current", "current_text", "now")

    def __init__(
        self, now: datetime, current: Mapping[ParameterKey, datetime], changed: Mapping[ParameterKey, datetime]
    ) -> None:
        self.now, self.at = now, now.isoformat()
        self.current, self.changed = current, changed
        self.current_text = {key: value.isoformat() for key, value in current.items()}
        self.changed_text = {key: value.isoformat() for key, value in changed.items()}

    def values(
        self, keys: Sequence[ParameterKey], settles: Sequence[ParameterKey], last: Mapping[str, Mapping[str, str]]
    ) -> list[list[str | None]]:
        """The facts' values of a task reading ``keys``: ``[entity, parameter, current, last]``, and when it was set
        for a parameter of ``settles``; ``last`` as stored."""
        found: list[list[str | None]] = []
        for key in keys:
            entity, parameter = key
            row = [entity, parameter, self.current_text.get(key), last.get(entity, {}).get(parameter)]
            if key in settles:
                row.append(self.changed_text.get(key))
            found.append(row)
        return found


def _unpickled(step: str, pickled: bytes) -> Any:
    """A part of a launch that its user code's process pickled; :class:`_LaunchError` if it cannot be read back."""
    try:
        return pickle.loads(pickled)
    except Exception as exc:  # noqa: BLE001 - unpickling runs the objects' own code
        raise _LaunchError(f"{step} returned an unusable result: {describe_error(exc)}") from None


def _settle_keys(trigger: Any) -> tuple[ParameterKey, ...]:
    """The parameters a trigger's Settle conditions watch (their change times are part of its evaluation)."""
    children = getattr(trigger, "triggers", (trigger,))
    return tuple(sorted({child.key for child in children if isinstance(child, Settle)}))


@lru_cache(maxsize=1 << 16)
def _moment(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _last_values(stored: Mapping[str, Mapping[str, str]] | None) -> dict[ParameterKey, datetime]:
    """:func:`values_from_json`, each value parsed once (many tasks saw the same values)."""
    return {(e, p): _moment(v) for e, parameters in (stored or {}).items() for p, v in parameters.items()}


def _explanation(why: str | Explanation) -> Explanation:
    return why if isinstance(why, Explanation) else Explanation(why)


def _values_text(values: Mapping[ParameterKey, datetime]) -> str:
    return ", ".join(f"{e}/{p}={v.isoformat()}" for (e, p), v in sorted(values.items()))


def _changes(event: pubsub.Event) -> list[dict[str, Any]]:
    """The CTL changes an event carries; those the CTL store would not have written (an event published by hand)
    are skipped with a warning."""
    changes = event.payload.get("changes") if isinstance(event.payload, dict) else None
    if not isinstance(changes, list):
        changes = [changes]
    valid = [
        c
        for c in changes
        if isinstance(c, dict) and isinstance(c.get("entity"), str) and isinstance(c.get("parameter"), str)
    ]
    if len(valid) < len(changes):
        log.warning(
            "CTL event %s: %d change(s) naming no entity and parameter skipped", event.id, len(changes) - len(valid)
        )
    return valid
