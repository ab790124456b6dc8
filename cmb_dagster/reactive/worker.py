"""The reactive scheduler's worker: one scheduler's ticks on the shared worker loop, outside a Dagster sensor.

Its loop holds the scheduler's lease (kind ``reactive.scheduler``, partition: the scheduler's name); each step is
one tick, which shares the loop's lease: its renewals while user code runs are the loop's, and the runs it decided
on are launched only while the lease is valid by this process's clock. A tick that did something (evaluated or
launched tasks, or stopped at its time box) is followed by the next at once; otherwise the loop sleeps
``idle_sleep`` seconds, or until a write to the pub/sub stream (a CTL change) wakes it. A tick that raises is
retried after the loop's backoff.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from cmb_dagster.database import DatabaseSource
from cmb_dagster.notifications import channel_name
from cmb_dagster.reactive.engine import LEASE_KIND, TaskScheduler
from cmb_dagster.reactive.models import Launcher, LaunchOptions, Partitioner, RunLookup, SchedulerSettings, TaskSpec
from cmb_dagster.workers import EngineWorker, Lease, Worker

log = logging.getLogger("cmb_dagster.reactive")

STREAM_HINTS = "pubsub"
"""Every write to the pub/sub stream (a CTL change among them) NOTIFYs ``<schema>.pubsub`` on commit."""


class ReactiveWorker(EngineWorker):
    """Ticks the reactive scheduler ``name`` of ``tasks`` until its time is up or :meth:`stop` is called.

    ``runs`` looks the launched runs up by run_key and ``launch`` requests the runs each tick decides on (a run
    requested but never seen is requested again after ``launch_grace``). ``partitioners`` and ``launch_options``
    are the tasks' user code, as for :class:`TaskScheduler`.

    >>> settings = SchedulerSettings()  # doctest: +SKIP
    >>> worker = ReactiveWorker(db, settings, name="etl", tasks=specs, runs=lookup, launch=submit)  # doctest: +SKIP
    >>> worker.run(duration=60)  # doctest: +SKIP
    """

    def __init__(
        self,
        db: DatabaseSource,
        options: SchedulerSettings,
        *,
        name: str,
        tasks: Sequence[TaskSpec],
        runs: RunLookup,
        launch: Launcher,
        owner: str | None = None,
        partitioners: Mapping[str, Partitioner] | None = None,
        launch_options: Mapping[str, LaunchOptions] | None = None,
    ) -> None:
        super().__init__(db, owner=owner)
        self.engine = TaskScheduler(
            self.db, name, tasks, options, owner=self.owner, partitioners=partitioners, launch_options=launch_options
        )
        self.runs = runs
        self.launch = launch
        self._warned: set[str] = set()

    def loops(self) -> list[Worker]:
        engine = self.engine
        loop = Worker(
            self.db,
            LEASE_KIND,
            [engine.name],
            self._tick,
            owner=self.owner,
            ttl=engine.leases.ttl,
            idle_sleep=engine.settings.idle_sleep,
            channels=[channel_name(self.db, STREAM_HINTS)],
        )
        engine.leases = loop.leases  # one lease: the tick's renewals while user code runs extend the loop's
        return [loop]

    def finish(self) -> None:
        self.engine.close()  # the connections its tick and its CTL change reader keep between ticks

    def _tick(self, lease: Lease) -> int:
        """One tick under the loop's lease; how many tasks it evaluated or launched (0: nothing to do)."""
        report = self.engine.tick(self.runs, lease=lease)
        for warning in set(report.warnings) - self._warned:
            self._warned.add(warning)
            log.warning("%s", warning)
        if report.launches:
            # a process stopped or cut off past its lease launches nothing: the scheduler's next holder requests
            # these runs again once their launch_grace has passed
            lease.require()
            self.launch(report.launches)
        if report.launches or report.evaluated:
            log.info("%s", report.summary())
        return report.evaluated + len(report.launches) + (0 if report.complete else 1)
