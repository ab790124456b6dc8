"""The reactive scheduler's engine: which reactive tasks to launch now, and why (no Dagster here).

One tick, all state in Postgres (tables ``reactive_tasks`` and ``reactive_marks``, the tasks to evaluate),
time-boxed and resumable, is a sequence of steps, each in a module of its own, passed the tick (:mod:`.tick`):

1. Definitions (:mod:`.start`): tasks new to the code location, or whose trigger changed, are marked for
   evaluation.
2. Changes (:mod:`.changes`): CTL changes since the scheduler's watermark are read from the pub/sub stream; a
   parameter -> tasks index marks the tasks that use them (the watermark commits with the marks).
3. Runs (:mod:`.runs`): the runs in flight are looked up in bulk. On success the values a run was launched on
   become the task's last-seen values and the task is evaluated again; on failure the trigger stays armed and
   the task waits a backoff; when the backoff ends it is evaluated again.
4. Evaluation (:mod:`.evaluation`): only marked tasks, in batches, highest priority first. A task with a run
   queued or in progress is neither evaluated nor launched.
5. Launch (:mod:`.launch`): ready tasks by priority while fewer than ``max_concurrent_runs`` reactive runs are
   queued or running; each is re-evaluated first (a Delay may have decayed while it waited for a slot).
   Hold: while a task P with a run in flight ``produces`` a parameter read by a waiting task H, or any
   run in flight (reactive, scheduled or launched by hand) materializes an asset upstream of H, ready
   tasks of lower priority than H stay ready and are not launched: the queue waits for the more
   important task. The hold is found from the runs in flight and the parameter -> tasks index.
   A task's user code (:mod:`.user_code`: its partition, run config and tags callables) runs between
   transactions, in a child process forked for it, under ``callable_timeout`` (killed at it): one that raises,
   exits, runs past it or returns what cannot be launched backs that task off alone, with its error sanitised;
   the tick leaves no thread or process of user code running behind it.
6. Hand-launched runs (:mod:`.runs`): successful runs tagged with a task's name (not launched by the scheduler)
   record their values as the task's last-seen values, like a reactive run (the manual recovery of a task whose
   trigger compares with the time or another parameter).
7. Record (:mod:`.record`): waiting tasks the tick log has not shown for an hour are shown again; the tick's end
   is stored with the tasks it leaves marked.

Time alone turns a trigger from false to true only through a ``Settle`` whose quiet time ends (Delay-type
conditions only decay), and a passed deadline launches a task with ``on_deadline='run'``: an evaluation stores
when that can happen (``wake_at``) and the tick marks the tasks whose time came. Tasks whose inputs did not
change and whose wake time did not come need no evaluation: there is no periodic full scan.

A tick reads no more than what changed: it knows the marks its own steps write and those left by its previous tick,
and the number of runs in flight, while the ticks follow one another in its process alone (each stores a token the
next finds, and the scheduler's lease stayed with the process). That is a cache, kept in memory by the scheduler
(:class:`~cmb_dagster.reactive.tick.Known`): lost, or another tick ran in between, the next tick reads the marks and
the runs in flight from the tables. Explanations are stored as the facts of each evaluation and rendered when read
(cmb_dagster/reactive/explanations.py).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from cmb_dagster._gc import cyclic_collection_paused
from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.database import Database, OwnConnection
from cmb_dagster.executor import Executor
from cmb_dagster.reactive.admin import current_values
from cmb_dagster.reactive.catalog import TaskCatalog
from cmb_dagster.reactive.changes import ChangeReader
from cmb_dagster.reactive.errors import InvalidReactiveInput
from cmb_dagster.reactive.evaluation import evaluate_marked
from cmb_dagster.reactive.launch import find_hold, launch_ready, values_hash
from cmb_dagster.reactive.models import (
    SCHEDULER_NAME,
    LaunchOptions,
    ManualLookup,
    Partitioner,
    RunLookup,
    SchedulerSettings,
    TaskSpec,
    TickReport,
)
from cmb_dagster.reactive.record import end_tick, remind_waiting
from cmb_dagster.reactive.runs import follow_runs, record_manual_runs
from cmb_dagster.reactive.start import start_tick
from cmb_dagster.reactive.tick import Known, Tick
from cmb_dagster.reactive.user_code import UserCode
from cmb_dagster.workers import Lease, Leases

__all__ = ["LEASE_KIND", "TaskScheduler", "values_hash"]

LEASE_KIND = "reactive.scheduler"


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
        self.location = location
        self.catalog = TaskCatalog.of(tasks)
        partitioners, launch_options = dict(partitioners or {}), dict(launch_options or {})
        unknown = sorted((set(partitioners) | set(launch_options)) - set(self.catalog.tasks))
        if unknown:
            raise InvalidReactiveInput(
                f"partitioners or launch options for unknown reactive task(s): {', '.join(unknown)}"
            )
        self.leases = Leases(database, LEASE_KIND, owner, ttl=self.settings.tick_seconds + 10)
        self.changes = ChangeReader(database, name, self.catalog.index)
        # the tick's connection: statements planned as they run (a plan cached while the tables were small would
        # stay), and no JIT (without statistics, estimates of bulk statements trigger compiles of 100s of ms)
        self._own = OwnConnection(database, custom_plans=True, settings={"jit": "off"})
        self._ticking = threading.Lock()  # the lease is per owner: keep this process's ticks apart too
        # one call at a time, each in a child process forked for it: killed at its deadline, it leaves nothing behind
        self.executor = Executor(f"reactive:{name}", concurrency=1, isolation="process")
        self.user_code = UserCode(database, name, self.executor, partitioners, launch_options)
        self._known: Known | None = None  # what the tables hold, as this process's last tick left them

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
            tick = Tick(self.name, now, lease, self.leases, self.settings, report, started)
            known, self._known = self._known, None  # a tick that raises leaves nothing known
            try:
                with cyclic_collection_paused():
                    self._known = self._steps(tick, known, runs, manual, busy or {})
            finally:
                if not held_by_caller:
                    self.leases.release([self.name])
        finally:
            self._ticking.release()
            report.seconds = time.monotonic() - started
        return report

    def _steps(
        self, tick: Tick, known: Known | None, runs: RunLookup, manual: ManualLookup | None, busy: Mapping[str, str]
    ) -> Known:
        """The steps of ``tick`` on the tick's connection, one transaction per step (a single statement commits
        alone); ``known``: the tables as this process's last tick left them. Return them as this tick leaves them."""
        conn, catalog, token = self._own.get(), self.catalog, uuid.uuid4().hex
        synced, previous = start_tick(conn, tick, catalog, self.location, token)
        if synced or known is None or not known.valid_for(tick.lease, previous):
            known = None  # read the marks and the runs in flight from the tables
        self.changes.read(tick)
        in_flight = follow_runs(conn, tick, catalog, self.user_code, runs, known)
        if manual is not None:
            record_manual_runs(conn, tick, catalog, manual)
        fresh, failures = evaluate_marked(conn, tick, catalog, known)
        hold = find_hold(conn, tick, catalog, in_flight, busy, fresh)
        stored = known is None or known.ready  # tasks may be stored as ready
        running, ready = launch_ready(
            conn, tick, catalog, self.user_code, len(in_flight), hold, fresh, failures, stored
        )
        remind_waiting(conn, tick, catalog)
        end_tick(conn, tick)
        return Known(token, tick.lease.fence, tick.left, running, ready)

    def close(self) -> None:
        """Close the connections kept between ticks (the next tick opens them again)."""
        self._own.close()
        self.changes.close()

    def never_set(self, keys: Sequence[ParameterKey]) -> set[ParameterKey]:
        """Those of ``keys`` that have no CTL value (none was ever set)."""
        if not keys:
            return set()
        with self.database.connection() as conn:
            found, _ = current_values(conn, sorted(set(keys)))
        return {key for key in keys if key not in found}
