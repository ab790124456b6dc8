"""The reactive scheduler's engine: which reactive tasks to launch now, and why (no Dagster here).

One tick, all state in Postgres (table ``reactive_tasks``), time-boxed and resumable:

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
   Hold: while a task P with a run in flight ``produces`` a parameter read by a waiting task H, ready
   tasks of lower priority than H stay ready and are not launched: the queue waits for the more
   important task. The hold is found from the runs in flight and the parameter -> tasks index.

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
from datetime import UTC, datetime
from typing import Any

import psycopg

from cmb_dagster import pubsub
from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import CTL_BRANCH_ID, read_values, values_from_json, values_to_json
from cmb_dagster.database import Database
from cmb_dagster.reactive import sql
from cmb_dagster.reactive.errors import InvalidReactiveTask
from cmb_dagster.reactive.models import (
    ABOVE_HIGHEST_PRIORITY,
    LOWEST_PRIORITY,
    SCHEDULER_NAME,
    Launch,
    RunLookup,
    RunState,
    SchedulerSettings,
    TaskSpec,
    TickReport,
    sorted_keys,
)
from cmb_dagster.triggers import evaluate, parameters
from cmb_dagster.workers import Lease, Leases

log = logging.getLogger("cmb_dagster.reactive")

LEASE_KIND = "reactive.scheduler"


@dataclass(frozen=True)
class _Hold:
    """Ready tasks below ``priority`` wait: ``producer``'s run feeds ``task``, a waiting task of that priority."""

    task: str
    priority: int
    producer: str


@dataclass(frozen=True)
class _Evaluation:
    name: str
    status: str  # ready, waiting, error
    explanation: str
    values: dict[ParameterKey, datetime]


def values_hash(values: Mapping[ParameterKey, datetime]) -> str:
    """A short stable digest of CTL values (part of a run_key)."""
    text = json.dumps(values_to_json({k: v.astimezone(UTC) for k, v in values.items()}), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


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
        self.index: dict[ParameterKey, list[str]] = defaultdict(list)
        for task in tasks:
            for key in sorted(parameters(task.trigger)):
                self.index[key].append(task.name)
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

    def tick(self, runs: RunLookup, *, now: datetime | None = None) -> TickReport:
        """Run one time-boxed tick; return what it did. ``runs`` looks launched runs up by run_key."""
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
                with self.database.connection() as conn:  # one connection for the tick, one transaction per step
                    self._sync_definitions(conn, lease, report)
                    self._read_changes(deadline, report)
                    in_flight = self._follow_runs(conn, lease, runs, now, report)
                    fresh = self._evaluate_marked(conn, lease, now, deadline, report)
                    hold = self._hold(conn, in_flight)
                    self._launch_ready(conn, lease, now, len(in_flight), hold, fresh, report)
            finally:
                self._lease, self._report = None, None
                self.leases.release([self.name])
        finally:
            self._ticking.release()
            report.seconds = time.monotonic() - started
        return report

    def _sync_definitions(self, conn: psycopg.Connection, lease: Lease, report: TickReport) -> None:
        params = {"scheduler": self.name}
        with conn.transaction():
            row = conn.execute(sql.DEFINITIONS_HASH, params).fetchone()
            if row is not None and row[0] == self.definitions_hash:
                return
            Leases.check(conn, lease)
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
                    f"(or forget it: cmb-dagster reactive forget {self.name} TASK)"
                )
                notes.update(dict.fromkeys(names, note))
        params = {"scheduler": self.name}
        if affected:
            conn.execute(sql.MARK_DIRTY, {**params, "names": sorted(affected)})
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
            for name, run_key, run_id, launched_at, attempts, ready_values, explanation, _ in launched:
                run = found.get(run_key)
                if run is None:
                    if launched_at <= now - self.settings.launch_grace:
                        values = values_from_json(ready_values)
                        attempt = int(run_key.rsplit(":", 1)[1])
                        report.launches.append(Launch(name, run_key, attempt, values, explanation or "", relaunch=True))
                        report.note(name, "relaunched", f"no run with run_key {run_key} appeared; requested again")
                    else:
                        report.note(name, "in progress", f"run {run_key} requested at {launched_at}, not yet created")
                elif run.state is RunState.ACTIVE:
                    if run.run_id != run_id:
                        seen.append((name, run.run_id))
                    report.note(name, "in progress", f"run {run.run_id} ({run_key}) is queued or running")
                elif run.state is RunState.SUCCESS:
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
                columns = list(zip(*finished, strict=True))
                conn.execute(
                    sql.FINISH_RUNS,
                    {
                        **params,
                        "names": list(columns[0]),
                        "run_keys": list(columns[1]),
                        "run_ids": list(columns[2]),
                        "successes": list(columns[3]),
                        "backoff_until": list(columns[4]),
                    },
                )
            conn.execute(sql.END_BACKOFFS, params)
        done = {f[0] for f in finished}
        return {row[0]: sorted_keys(row[7]) for row in launched if row[0] not in done}

    def _hold(self, conn: psycopg.Connection, in_flight: Mapping[str, tuple[ParameterKey, ...]]) -> _Hold | None:
        """The highest-priority waiting task fed by a run in flight, if any (it holds the tasks below it)."""
        producers: dict[str, str] = {}  # task reading a produced parameter -> the task in flight producing it
        for producer in sorted(in_flight):
            for key in in_flight[producer]:
                for name in self.index.get(key, ()):
                    producers.setdefault(name, producer)
        if not producers:
            return None
        with conn.transaction():
            row = conn.execute(sql.TOP_WAITING_TASK, {"scheduler": self.name, "names": list(producers)}).fetchone()
        return None if row is None else _Hold(task=row[0], priority=row[1], producer=producers[row[0]])

    def _evaluate_marked(
        self, conn: psycopg.Connection, lease: Lease, now: datetime, deadline: float, report: TickReport
    ) -> dict[str, _Evaluation]:
        """Evaluate the marked tasks in batches until none is left or the time box ends; return the ready ones."""
        params: dict[str, Any] = {"scheduler": self.name, "now": now, "limit": self.settings.batch_size}
        ready: dict[str, _Evaluation] = {}
        while True:
            with conn.transaction():
                rows = conn.execute(sql.DIRTY_TASKS, params).fetchall()
                if not rows:
                    return ready
                evaluations = self._evaluate(conn, [(r[0], r[1], r[2]) for r in rows], now)
                Leases.check(conn, lease)
                self._save(conn, params, evaluations)
            report.evaluated += len(evaluations)
            for e in evaluations:
                report.note(e.name, e.status, e.explanation)
                if e.status == "ready":
                    ready[e.name] = e
            if len(rows) < self.settings.batch_size:
                return ready
            if time.monotonic() >= deadline:
                report.complete = False
                return ready

    def _launch_ready(
        self,
        conn: psycopg.Connection,
        lease: Lease,
        now: datetime,
        in_flight: int,
        hold: _Hold | None,
        fresh: Mapping[str, _Evaluation],
        report: TickReport,
    ) -> None:
        """Launch ready tasks by priority under the cap and above a hold; those not evaluated in this tick are
        evaluated again."""
        cap = self.settings.max_concurrent_runs
        params: dict[str, Any] = {"scheduler": self.name, "now": now}
        launchable = {"min_priority": hold.priority if hold else LOWEST_PRIORITY, "max_priority": ABOVE_HIGHEST_PRIORITY}
        while in_flight < cap:
            with conn.transaction():
                rows = conn.execute(sql.READY_TASKS, {**params, **launchable, "limit": cap - in_flight}).fetchall()
                if not rows:
                    break
                attempts_so_far = {r[0]: r[3] for r in rows}
                stale = [(r[0], r[1], r[2]) for r in rows if r[0] not in fresh]
                evaluations = self._evaluate(conn, stale, now) if stale else []
                ready = [fresh[r[0]] for r in rows if r[0] in fresh] + [e for e in evaluations if e.status == "ready"]
                ready.sort(key=lambda e: (-self.tasks[e.name].priority, e.name))
                self._save(conn, params, [e for e in evaluations if e.status != "ready"])
                for e in evaluations:
                    if e.status != "ready":
                        report.note(e.name, e.status, "no longer fires now that a slot is free: " + e.explanation)
                launches = self._launch(conn, lease, params, ready, attempts_so_far)
            report.launches.extend(launches)
            for launch in launches:
                report.note(launch.task, "launched", f"run_key {launch.run_key}: {launch.reason}")
            in_flight += len(launches)
        if hold:
            held = {"min_priority": LOWEST_PRIORITY, "max_priority": hold.priority}
            why = f"waiting for {hold.producer} which feeds higher-priority {hold.task} (priority {hold.priority})"
            self._note_not_launched(conn, {**params, **held}, "held", why, report)
        if in_flight >= cap:
            why = f"ready, waits for a slot: {in_flight}/{cap} reactive runs queued or running"
            self._note_not_launched(conn, {**params, **launchable}, "capped", why, report)

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

    def _launch(
        self,
        conn: psycopg.Connection,
        lease: Lease,
        params: dict[str, Any],
        ready: list[_Evaluation],
        attempts_so_far: Mapping[str, int],
    ) -> list[Launch]:
        if not ready:
            return []
        hashes = {e.name: values_hash(e.values) for e in ready}
        previous = {
            (task, digest): count
            for task, digest, count in conn.execute(
                sql.PREVIOUS_ATTEMPTS,
                {**params, "names": list(hashes), "hashes": list(hashes.values())},
            ).fetchall()
        }
        planned = []
        for e in ready:
            attempt = previous.get((e.name, hashes[e.name]), 0) + 1
            reason = e.explanation
            if attempts_so_far.get(e.name):
                reason = f"retry after {attempts_so_far[e.name]} failed run(s); " + reason
            planned.append(Launch(e.name, f"{e.name}:{hashes[e.name]}:{attempt}", attempt, e.values, reason))
        Leases.check(conn, lease)
        launched = {
            row[0]
            for row in conn.execute(
                sql.MARK_LAUNCHED,
                {
                    **params,
                    "names": [p.task for p in planned],
                    "run_keys": [p.run_key for p in planned],
                    "values": [json.dumps(values_to_json(p.values)) for p in planned],
                    "hashes": [hashes[p.task] for p in planned],
                    "attempts": [p.attempt for p in planned],
                    "reasons": [p.reason for p in planned],
                },
            ).fetchall()
        }
        return [p for p in planned if p.task in launched]

    # -- evaluation ---------------------------------------------------------------------------

    def _evaluate(
        self, conn: psycopg.Connection, rows: Sequence[tuple[str, dict | None, str | None]], now: datetime
    ) -> list[_Evaluation]:
        keys = sorted({key for name, _, _ in rows if name in self.tasks for key in parameters(self.tasks[name].trigger)})
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
            return _Evaluation(name, "error", "not defined in this process's code (another version synced it)", {})
        try:
            result = evaluate(spec.trigger, now=now, current=current, last=last, timezone=spec.timezone)
            explanation = result.explanation
        except Exception as exc:  # noqa: BLE001 - one bad task must not break the tick
            log.warning("reactive task %s: evaluating %r raised %r", name, spec.trigger, exc)
            return _Evaluation(name, "error", f"evaluating the trigger raised {type(exc).__name__}: {exc}", {})
        if backwards_note:
            explanation += f"\nnote: {backwards_note}"
        if not result.fired:
            return _Evaluation(name, "waiting", explanation, {})
        if all(last.get(key) == value for key, value in result.used.items()):
            return _Evaluation(
                name, "waiting",
                explanation + "\nbut its last successful run already saw exactly these values: waiting for a change",
                {},
            )
        return _Evaluation(name, "ready", explanation, dict(result.used))

    def _save(self, conn: psycopg.Connection, params: dict[str, Any], evaluations: Sequence[_Evaluation]) -> None:
        if not evaluations:
            return
        conn.execute(
            sql.SAVE_EVALUATIONS,
            {
                **params,
                "names": [e.name for e in evaluations],
                "statuses": [e.status for e in evaluations],
                "ready_values": [json.dumps(values_to_json(e.values)) if e.values else None for e in evaluations],
                "explanations": [e.explanation for e in evaluations],
            },
        )
