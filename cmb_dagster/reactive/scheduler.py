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
6. Hand-launched runs: successful runs tagged with a task's name (not launched by the scheduler) record
   their values as the task's last-seen values, like a reactive run (the original design's manual recovery).

Time alone never turns a trigger from false to true (Delay-type conditions only decay), so tasks whose
inputs did not change need no evaluation: there is no periodic full scan.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from cmb_dagster import pubsub
from cmb_dagster._gc import cyclic_collection_paused
from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import CTL_BRANCH_ID, read_values, values_as_of, values_from_json, values_to_json
from cmb_dagster.database import Database
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.errors import InvalidReactiveTask, SchedulerConflict
from cmb_dagster.reactive.models import (
    ABOVE_HIGHEST_PRIORITY,
    LOWEST_PRIORITY,
    SCHEDULER_NAME,
    Launch,
    LaunchOptions,
    ManualLookup,
    Partitioner,
    RunLookup,
    RunState,
    SchedulerSettings,
    SeenRun,
    TaskSpec,
    TickReport,
    sorted_keys,
)
from cmb_dagster.triggers import evaluate, parameters
from cmb_dagster.workers import Lease, Leases

log = logging.getLogger("cmb_dagster.reactive")

LEASE_KIND = "reactive.scheduler"
MANUAL_OVERLAP = timedelta(minutes=5)  # hand-launched runs are read again this far back (recorded once each)


@dataclass(frozen=True)
class _Hold:
    """Ready tasks below ``priority`` wait: ``producer``'s run feeds ``task``, a waiting task of that priority."""

    task: str
    priority: int
    producer: str


class _LaunchError(Exception):
    """A ready task's launch cannot be shaped (its partition, run config or tags raised)."""


@dataclass(frozen=True, slots=True)
class _Evaluation:
    name: str
    status: str  # ready, waiting, error
    explanation: str
    values: dict[ParameterKey, datetime]
    last: dict[ParameterKey, datetime]


def values_hash(values: Mapping[ParameterKey, datetime], partition_key: str | None = None) -> str:
    """A short stable digest of CTL values and the partition (part of a run_key)."""
    return _encoded_values(values, partition_key)[1]


def _encoded_values(values: Mapping[ParameterKey, datetime], partition_key: str | None = None) -> tuple[str, str]:
    """``values`` in UTC as stored JSON text, and :func:`values_hash` of them (one encoding for both)."""
    text = json.dumps(values_to_json({k: v.astimezone(UTC) for k, v in values.items()}), sort_keys=True)
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
            raise InvalidReactiveTask(f"scheduler name {name!r} must be 1-50 of A-Z a-z 0-9 _ . - (not starting with . or -)")
        seen: set[str] = set()
        for task in tasks:
            if task.name in seen:
                raise InvalidReactiveTask(f"two reactive tasks are named {task.name!r} in scheduler {name!r}")
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
            raise InvalidReactiveTask(f"partitioners or launch options for unknown reactive task(s): {', '.join(unknown)}")
        self.reads = {task.name: tuple(sorted(parameters(task.trigger))) for task in tasks}  # task -> CTL parameters
        self.index: dict[ParameterKey, list[str]] = defaultdict(list)
        self.downstream: dict[str, list[str]] = defaultdict(list)  # entity (asset key) -> tasks it is upstream of
        for task in tasks:
            for key in self.reads[task.name]:
                self.index[key].append(task.name)
            for entity in sorted(set(task.upstream)):
                self.downstream[entity].append(task.name)
        self.definitions_hash = hashlib.sha256(
            json.dumps(sorted((t.name, t.trigger_hash, t.priority, t.produces) for t in tasks)).encode()
        ).hexdigest()[:16]
        self.leases = Leases(database, LEASE_KIND, owner, ttl=self.settings.tick_seconds + 10)

        def mark_changed(conn: psycopg.Connection, events: list[pubsub.Event]) -> None:
            self._mark_changed(conn, events)  # a closure: not registered as an importable handler

        self.consumer = pubsub.Consumer(database, f"reactive.{name}", CTL_BRANCH_ID, mark_changed)
        self._lease: Lease | None = None
        self._report: TickReport | None = None
        self._ticking = threading.Lock()  # the lease is per owner: keep this process's ticks apart too

    # -- the tick -----------------------------------------------------------------------------

    def tick(
        self,
        runs: RunLookup,
        *,
        now: datetime | None = None,
        manual: ManualLookup | None = None,
        busy: Mapping[str, str] | None = None,
    ) -> TickReport:
        """Run one time-boxed tick; return what it did.

        ``runs`` looks launched runs up by run_key; ``now`` is the evaluation time (default: the clock);
        ``manual`` lists successful hand-launched runs of the tasks; ``busy`` maps entities (asset keys)
        that a run in flight materializes to a description of that run (for the hold).
        Raises :class:`SchedulerConflict` when another code location keeps this name with other tasks.
        """
        started = time.monotonic()
        deadline = started + self.settings.tick_seconds
        now = now or datetime.now(UTC)
        report = TickReport(self.name)
        if not self._ticking.acquire(blocking=False):
            report.busy = f"{self.name}: a tick is already running in this process; skipped"
            return report
        try:
            lease = self.leases.acquire([self.name]).get(self.name)
            if lease is None:
                report.busy = f"{self.name}: another process is running this scheduler's tick; skipped"
                return report
            self._lease, self._report = lease, report
            try:
                # one connection for the tick, one transaction per step
                with cyclic_collection_paused(), self.database.connection() as conn:
                    self._sync_definitions(conn, lease, now, report)
                    self._read_changes(deadline, report)
                    in_flight = self._follow_runs(conn, lease, runs, now, report)
                    if manual is not None:
                        self._record_manual_runs(conn, lease, manual, now, report)
                    fresh, failures = self._evaluate_marked(conn, lease, now, deadline, report)
                    hold = self._hold(conn, in_flight, busy or {}, fresh)
                    self._launch_ready(conn, lease, now, len(in_flight), hold, fresh, failures, report)
            finally:
                self._lease, self._report = None, None
                self.leases.release([self.name])
        finally:
            self._ticking.release()
            report.seconds = time.monotonic() - started
        return report

    def _sync_definitions(self, conn: psycopg.Connection, lease: Lease, now: datetime, report: TickReport) -> None:
        params = {"scheduler": self.name, "location": self.location, "now": now}
        with conn.transaction():
            row = conn.execute(sql.SCHEDULER_ROW, params).fetchone()
            if row is not None:
                self._refuse_a_foreign_name(*row, now)
            if row is not None and row[0] == self.definitions_hash:
                if self.location is not None and (row[1] != self.location or row[2] is None or row[2] < now - self.settings.takeover_after / 10):
                    conn.execute(sql.TOUCH_SCHEDULER, params)
                return
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
                },
            )
            conn.execute(sql.UNDEFINE_MISSING_TASKS, {**params, "names": [t.name for t in specs]})
        report.definitions_synced = True

    def _refuse_a_foreign_name(self, definitions_hash: str, location: str | None, ticked_at: datetime | None, now: datetime) -> None:
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
        changes = [change for event in events for change in event.payload["changes"]]
        for payload in changes:
            key = (payload["entity"], payload["parameter"])
            names = self.index.get(key, ())
            affected.update(names)
            if payload.get("backwards") and names:
                note = (
                    f"{key[0]}/{key[1]} moved backwards from {payload['old']} to {payload['new']} "
                    f"(by {payload.get('by')}); Delta triggers on it wait until it passes the last-seen value "
                    f"(move the last-seen value back: cmb-dagster reactive set-last {self.name} TASK "
                    f"--parameter {key[0]} {key[1]} --value VALUE, or forget it: cmb-dagster reactive forget "
                    f"{self.name} TASK)"
                )
                notes.update(dict.fromkeys(names, note))
        params = {"scheduler": self.name}
        if affected:
            conn.execute(sql.MARK_TASKS, {**params, "names": sorted(affected)})
        if notes:
            conn.execute(sql.NOTE_BACKWARDS, {**params, "names": list(notes), "notes": list(notes.values())})
        self._report.changes += len(changes)

    def _follow_runs(
        self, conn: psycopg.Connection, lease: Lease, runs: RunLookup, now: datetime, report: TickReport
    ) -> dict[str, tuple[ParameterKey, ...]]:
        """Handle finished runs; re-request lost launches; end backoffs. Return the tasks in flight and what they produce."""
        params: dict[str, Any] = {"scheduler": self.name, "now": now}
        with conn.transaction():
            launched = conn.execute(sql.LAUNCHED_TASKS, params).fetchall()
            found = runs(self.name, [row[1] for row in launched]) if launched else {}
            finished: list[tuple[str, str, str, bool, datetime | None]] = []
            seen: list[tuple[str, str]] = []
            for name, run_key, run_id, launched_at, attempts, ready_values, explanation, _, partition in launched:
                run = found.get(run_key)
                if run is None:
                    if launched_at <= now - self.settings.launch_grace:
                        values = values_from_json(ready_values)
                        attempt = int(run_key.rsplit(":", 1)[1])
                        try:
                            run_config, tags = self._options(name, values)
                        except _LaunchError as exc:
                            report.note(name, "error", f"run {run_key} cannot be requested again: {exc}")
                            continue
                        report.launches.append(
                            Launch(name, run_key, attempt, values, explanation or "", relaunch=True,
                                   partition_key=partition, run_config=run_config, tags=tags)
                        )
                        report.note(name, "relaunched", f"no run with run_key {run_key} appeared; requested again")
                    else:
                        report.note(name, "in progress", f"run {run_key} requested at {launched_at}, not yet created")
                elif run.state is RunState.ACTIVE:
                    if run.run_id != run_id:
                        seen.append((name, run.run_id))
                    report.note(name, "in progress", f"run {run.run_id} ({run_key}) is queued or running")
                if run is not None and run.run_id != run_id:
                    report.seen_runs.append(
                        SeenRun(name, run.run_id, run_key, values_from_json(ready_values), explanation or "")
                    )
                if run is None or run.state is RunState.ACTIVE:
                    continue
                if run.state is RunState.SUCCESS:
                    finished.append((name, run_key, run.run_id, True, None))
                    report.note(name, "succeeded", f"run {run.run_id} succeeded: its CTL values are now last-seen")
                else:
                    backoff = self.settings.backoff(attempts)
                    finished.append((name, run_key, run.run_id, False, now + backoff))
                    report.note(
                        name, "failed",
                        f"run {run.run_id} failed (failure {attempts + 1} in a row); trigger stays armed, "
                        f"retry after {backoff} at {now + backoff}",
                    )
            if seen or finished:
                Leases.check(conn, lease)
            if seen:
                conn.execute(sql.NOTE_RUN_IDS, {**params, "names": [s[0] for s in seen], "run_ids": [s[1] for s in seen]})
            if finished:
                rows = [
                    {"name": n, "run_key": k, "run_id": i, "success": ok, "backoff_until": b.isoformat() if b else None}
                    for n, k, i, ok, b in finished
                ]
                conn.execute(sql.FINISH_RUNS, {**params, "rows": json.dumps(rows)})
            conn.execute(sql.END_BACKOFFS, params)
        done = {f[0] for f in finished}
        return {row[0]: sorted_keys(row[7]) for row in launched if row[0] not in done}

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
                rows.append({"name": run.task, "run_key": f"manual:{run.run_id}", "run_id": run.run_id,
                             "values": values_to_json(values), "hash": values_hash(values),
                             "finished_at": run.finished_at.isoformat()})
            Leases.check(conn, lease)
            recorded = conn.execute(sql.RECORD_MANUAL_RUNS, {**params, "rows": json.dumps(rows)}).fetchall()
            conn.execute(sql.SAVE_MANUAL_AFTER, {**params, "after": max(r.finished_at for r in found)})
        for task, run_id, values in recorded:
            report.manual += 1
            report.note(task, "recorded", f"hand-launched run {run_id} succeeded: its values {json.dumps(values)} are now last-seen")

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
        self, conn: psycopg.Connection, lease: Lease, now: datetime, deadline: float, report: TickReport
    ) -> tuple[dict[str, _Evaluation], dict[str, int]]:
        """Evaluate the marked tasks in batches, highest priority first, until none is left or the time box ends;
        return the ready ones and their failed runs in a row."""
        params: dict[str, Any] = {"scheduler": self.name, "now": now}
        ready: dict[str, _Evaluation] = {}
        failures: dict[str, int] = {}
        with conn.transaction():
            marked = [row[0] for row in conn.execute(sql.MARKED_TASKS, params)]
        size = self.settings.batch_size
        for start in range(0, len(marked), size):
            with conn.transaction():
                rows = conn.execute(sql.TASKS_TO_EVALUATE, {**params, "names": marked[start:start + size]}).fetchall()
                evaluations = self._evaluate(conn, [(r[0], r[1], r[2]) for r in rows], now)
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
    ) -> None:
        """Launch ready tasks by priority under the cap and above a hold: those evaluated in this tick (not saved
        yet) and those left ready by earlier ticks (evaluated again first); the rest are saved as ready."""
        cap = self.settings.max_concurrent_runs
        params: dict[str, Any] = {"scheduler": self.name, "now": now}
        floor = hold.priority if hold else LOWEST_PRIORITY
        launchable = {"min_priority": floor, "max_priority": ABOVE_HIGHEST_PRIORITY}
        pending = sorted((e for e in fresh.values() if self.tasks[e.name].priority >= floor), key=self._order)
        unsaved = [e for e in fresh.values() if self.tasks[e.name].priority < floor]
        while in_flight < cap:
            with conn.transaction():
                limit = cap - in_flight
                rows = conn.execute(sql.READY_TASKS, {**params, **launchable, "limit": limit}).fetchall()
                rows = [r for r in rows if r[0] not in fresh]  # ready before and evaluated again in this tick
                if not rows and not pending:
                    break
                candidates = [(r[4], r[0]) for r in rows] + [(self.tasks[e.name].priority, e.name) for e in pending]
                names = {name for _, name in sorted(candidates, key=lambda c: (-c[0], c[1]))[:limit]}
                stale = [(r[0], r[1], r[2]) for r in rows if r[0] in names]
                attempts_so_far = {**failures, **{r[0]: r[3] for r in rows}}
                evaluations = self._evaluate(conn, stale, now) if stale else []
                ready = [e for e in pending if e.name in names] + [e for e in evaluations if e.status == "ready"]
                pending = [e for e in pending if e.name not in names]
                ready.sort(key=self._order)
                self._save(conn, params, [e for e in evaluations if e.status != "ready"])
                for e in evaluations:
                    if e.status != "ready":
                        report.note(e.name, e.status, "no longer fires now that a slot is free: " + e.explanation)
                launches = self._launch(conn, lease, params, ready, attempts_so_far, report)
            report.launches.extend(launches)
            for launch in launches:
                report.note(launch.task, "launched", f"run_key {launch.run_key}: {launch.reason}")
            in_flight += len(launches)
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

    def _order(self, evaluation: _Evaluation) -> tuple[int, str]:
        return -self.tasks[evaluation.name].priority, evaluation.name

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

    def _options(self, name: str, values: Mapping[ParameterKey, datetime]) -> tuple[Mapping[str, Any] | None, dict[str, str]]:
        """The run config and extra tags of a launch of ``name`` on ``values``; :class:`_LaunchError` if they fail."""
        options = self.launch_options.get(name)
        if options is None:
            return None, {}
        try:
            run_config, tags = options(values)
            return run_config, {str(k): str(v) for k, v in (tags or {}).items()}
        except Exception as exc:  # noqa: BLE001 - the user's callable: one bad task must not break the tick
            raise _LaunchError(f"its run config or tags raised {type(exc).__name__}: {exc}") from exc

    def _shape(self, e: _Evaluation) -> tuple[_Evaluation, str | None, Mapping[str, Any] | None, dict[str, str]]:
        """The launch's partition, the values it commits, its run config and tags; :class:`_LaunchError` if one fails."""
        key = None
        partitioner = self.partitioners.get(e.name)
        if partitioner is not None:
            try:
                key, values = partitioner(e.values, e.last)
            except Exception as exc:  # noqa: BLE001 - one bad task must not break the tick
                raise _LaunchError(f"choosing the partition raised {type(exc).__name__}: {exc}") from exc
            explanation = f"partition {key} (commits {_values_text(values)} on success)\n{e.explanation}"
            e = _Evaluation(e.name, e.status, explanation, dict(values), e.last)
        run_config, tags = self._options(e.name, e.values)
        return e, key, run_config, tags

    def _launch(
        self,
        conn: psycopg.Connection,
        lease: Lease,
        params: dict[str, Any],
        candidates: list[_Evaluation],
        attempts_so_far: Mapping[str, int],
        report: TickReport,
    ) -> list[Launch]:
        """Record launches of the ready ``candidates``; one whose launch cannot be shaped backs off with the error."""
        if not candidates:
            return []
        shaped = []
        refused = []
        for candidate in candidates:
            try:
                shaped.append(self._shape(candidate))
            except _LaunchError as exc:
                attempts = attempts_so_far.get(candidate.name, 0)
                backoff = self.settings.backoff(attempts)
                why = f"error: {exc}; not launched, retry after {backoff} at {params['now'] + backoff}"
                refused.append({"name": candidate.name, "explanation": why + "\n" + candidate.explanation,
                                "backoff_until": (params["now"] + backoff).isoformat()})
                report.note(candidate.name, "error", why)
        if refused:
            Leases.check(conn, lease)
            conn.execute(sql.LAUNCH_REFUSED, {**params, "rows": json.dumps(refused)})
        if not shaped:
            return []
        encoded = {e.name: _encoded_values(e.values, key) for e, key, _, _ in shaped}
        hashes = {name: digest for name, (_, digest) in encoded.items()}
        previous = {
            (task, digest): count
            for task, digest, count in conn.execute(
                sql.PREVIOUS_ATTEMPTS,
                {**params, "rows": json.dumps([{"task": t, "values_hash": h} for t, h in hashes.items()])},
            ).fetchall()
        }
        planned = []
        for e, key, run_config, tags in shaped:
            attempt = previous.get((e.name, hashes[e.name]), 0) + 1
            reason = e.explanation
            if attempts_so_far.get(e.name):
                reason = f"retry after {attempts_so_far[e.name]} failed run(s); " + reason
            planned.append(
                Launch(e.name, f"{e.name}:{hashes[e.name]}:{attempt}", attempt, e.values, reason,
                       partition_key=key, run_config=run_config, tags=tags)
            )
        Leases.check(conn, lease)
        columns = {
            "names": [p.task for p in planned],
            "run_keys": [p.run_key for p in planned],
            "values": [encoded[p.task][0] for p in planned],
            "hashes": [hashes[p.task] for p in planned],
            "attempts": [p.attempt for p in planned],
            "reasons": [p.reason for p in planned],
            "partition_keys": [p.partition_key for p in planned],
        }
        launched = {row[0] for row in conn.execute(sql.MARK_LAUNCHED, {**params, **columns}).fetchall()}
        return [p for p in planned if p.task in launched]

    # -- evaluation ---------------------------------------------------------------------------

    def _evaluate(
        self, conn: psycopg.Connection, rows: Sequence[tuple[str, dict | None, str | None]], now: datetime
    ) -> list[_Evaluation]:
        keys = sorted({key for name, _, _ in rows for key in self.reads.get(name, ())})
        current = read_values(conn, keys) if keys else {}
        return [self._evaluate_one(name, values_from_json(last), note, current, now) for name, last, note in rows]

    def _evaluate_one(
        self,
        name: str,
        last: dict[ParameterKey, datetime],
        backwards_note: str | None,
        current: Mapping[ParameterKey, datetime],
        now: datetime,
    ) -> _Evaluation:
        spec = self.tasks.get(name)
        if spec is None:
            return _Evaluation(name, "error", "not defined in this process's code (another version synced it)", {}, last)
        try:
            result = evaluate(spec.trigger, now=now, current=current, last=last, timezone=spec.timezone)
            explanation = result.explanation
        except Exception as exc:  # noqa: BLE001 - one bad task must not break the tick
            log.warning("reactive task %s: evaluating %r raised %r", name, spec.trigger, exc)
            return _Evaluation(name, "error", f"evaluating the trigger raised {type(exc).__name__}: {exc}", {}, last)
        if backwards_note:
            explanation += f"\nnote: {backwards_note}"
        if not result.fired:
            return _Evaluation(name, "waiting", explanation, {}, last)
        if all(last.get(key) == value for key, value in result.used.items()):
            return _Evaluation(
                name, "waiting",
                explanation + "\nbut its last successful run already saw exactly these values: waiting for a change",
                {}, last,
            )
        return _Evaluation(name, "ready", explanation, dict(result.used), last)

    def _save(self, conn: psycopg.Connection, params: dict[str, Any], evaluations: Sequence[_Evaluation]) -> None:
        if not evaluations:
            return
        rows = [
            {"name": e.name, "status": e.status, "ready_values": values_to_json(e.values) if e.values else None,
             "explanation": e.explanation}
            for e in evaluations
        ]
        conn.execute(sql.SAVE_EVALUATIONS, {**params, "rows": json.dumps(rows)})


def _values_text(values: Mapping[ParameterKey, datetime]) -> str:
    return ", ".join(f"{e}/{p}={v.isoformat()}" for (e, p), v in sorted(values.items()))
