"""``StageWorker``: serves shards on the shared worker runtime (lease kind ``stages.shard``).

Its main loop holds the shards, ``shard:<id>/<count>`` each (the count is part of the name, so a re-shard
gives new leases), and serves them together. It never waits on user code: a step commits the calls that ended,
asks the database what is due in all shards (one query), runs the change path, then claims entries for the
executor's free slots over all shards and all stages due (a stage with a rate limit or max parallelism in
claims of its own), each stage's low-priority queue only where its main one has nothing due. Between steps it
sleeps until a call ends, the next timer (a wake-up timer), a NOTIFY from a writer, or ``idle_sleep``; while
calls run it turns at least every third of the lease TTL, so leases and flow slots are renewed. It registers
the stages' limits with :mod:`cmb_dagster.flow` when it starts. Stopped, it claims nothing more and stops once
the calls in flight have ended (each within its stage's timeout).

Worker 0 has a second loop, in a thread of its own, for the pub/sub consumers: ``capture`` (puts writes
that bypass the API on the change path) and ``after_commit:<stage>`` per stage with an after-commit
handler, so a slow after-commit handler never holds up the shards.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from cmb_dagster.database import DatabaseSource
from cmb_dagster.notifications import channel_name
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker, Event
from cmb_dagster.stages import sql
from cmb_dagster.stages.admin import set_shard_count
from cmb_dagster.stages.engine import LOW, MAIN, Engine
from cmb_dagster.stages.models import CHANNEL, LEASE_KIND, SavedEntity, StageOptions
from cmb_dagster.stages.stage import Stage
from cmb_dagster.stages.store import enqueue_changes, ensure_capture
from cmb_dagster.workers import EngineWorker, Lease, Worker, WorkerReport

log = logging.getLogger("cmb_dagster.stages")

CONSUMER_IDLE_SECONDS = 0.1  # a pub/sub consumer that found nothing is asked again after this (or a NOTIFY)
SHARD = "shard:"  # the partition name prefix of a shard


class StageWorker(EngineWorker):
    """Processes the stages of the shards it holds: worker ``index`` of ``workers`` (default: the options')
    serves shards with id % workers == index; ``shards`` narrows that further. ``options`` may be a list of
    stages (the other options at their defaults)."""

    def __init__(
        self,
        db: DatabaseSource,
        options: StageOptions | Sequence[Stage],
        *,
        owner: str | None = None,
        index: int = 0,
        workers: int | None = None,
        shards: Sequence[int] | None = None,
        listen: bool | None = None,
    ) -> None:
        super().__init__(db, owner=owner)
        options = options if isinstance(options, StageOptions) else StageOptions(stages=list(options))
        if listen is not None:
            warnings.warn(
                "StageWorker(listen=...) is deprecated: set StageOptions(listen=...)", DeprecationWarning, stacklevel=2
            )
            options = StageOptions(**(dict(options) | {"listen": listen}))
        self.options = options
        self.workers = workers or options.workers
        self.index = index
        self.shards = None if shards is None else set(shards)
        self.engine = Engine(
            self.db,
            options.stages,
            batch_size=options.batch_size,
            publish=options.publish,
            idle_timeout=max(10.0, 3 * options.lease_ttl),
            owner=self.owner,
            slot_ttl=options.lease_ttl,
            concurrency=options.worker_concurrency,
            isolation=options.isolation,
            on_end=self._call_ended,
        )
        self.stages = self.engine.stages
        self._main: _ShardsLoop | None = None
        self._blocked: dict[str, float] = {}
        self._timer: threading.Timer | None = None
        self._timer_at: float | None = None
        self._timer_lock = threading.Lock()
        self._consumers: dict[str, ConsumerWorker] = {}
        self._consumer_idle: dict[str, float] = {}

    # -- running -------------------------------------------------------------------------------

    def setup(self) -> None:
        """Apply the options' shard count, register the stages' limits, install the capture, build the pub/sub
        consumers."""
        if self.options.shard_count is not None:
            previous = set_shard_count(self.db, self.options.shard_count)
            if previous != self.options.shard_count:
                log.info("stages: shard count %d -> %d", previous, self.options.shard_count)
        self.engine.register_limits()
        ensure_capture(self.db)
        with self.db.connection() as conn:
            _, capture_branch, results_branch = conn.execute(sql.SETTINGS).fetchone()
        self._consumers = {
            "capture": ConsumerWorker(
                self.db,
                ConsumerSpec(
                    consumer_id="stages.capture", branch_id=capture_branch, handler=self._captured, batch_size=2000
                ),
            )
        }
        for name, stage in self.stages.items():
            if stage.after_commit is not None:
                self._consumers[f"after_commit:{name}"] = ConsumerWorker(
                    self.db,
                    ConsumerSpec(
                        consumer_id=f"stages.after_commit.{name}",
                        branch_id=results_branch,
                        handler=_after_commit_handler(stage),
                        batch_size=200,
                    ),
                )

    def loops(self) -> list[Worker]:
        """The shards (main loop) and, in worker 0, the pub/sub consumers."""
        self.setup()
        options = self.options
        self._main = _ShardsLoop(
            self.engine,
            self.db,
            LEASE_KIND,
            self.shard_partitions,
            lambda lease: self.joint_step([lease]),
            owner=self.owner,
            ttl=options.lease_ttl,
            idle_sleep=options.idle_sleep,
            channels=[channel_name(self.db, CHANNEL)] if options.listen else [],
            joint=lambda partition: partition.startswith(SHARD),
            joint_step=self.joint_step,
        )
        if self.index != 0:
            return [self._main]
        consumers = Worker(
            self.db,
            LEASE_KIND,
            list(self._consumers),
            self.consumer_step,
            owner=self.owner,
            ttl=options.lease_ttl,
            idle_sleep=CONSUMER_IDLE_SECONDS,
        )
        return [self._main, consumers]

    def finish(self) -> None:
        """Cancel the wake-up timer and close the engine (the entries of calls still running run again later)."""
        with self._timer_lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._timer_at = None
        self._main = None
        self.engine.close()

    def shard_partitions(self) -> list[str]:
        """The shards this worker asks for (asked again at every lease renewal)."""
        with self.db.connection() as conn:
            count = conn.execute(sql.SETTINGS).fetchone()[0]
        mine = [s for s in range(count) if s % self.workers == self.index and (self.shards is None or s in self.shards)]
        return [f"{SHARD}{s}/{count}" for s in mine]

    # -- steps ---------------------------------------------------------------------------------

    def consumer_step(self, lease: Lease) -> int:
        """One pub/sub consumer partition."""
        partition = lease.partition
        consumer = self._consumers.get(partition)
        if consumer is None:
            return 0
        now = time.monotonic()
        if self._consumer_idle.get(partition, 0.0) > now:  # found nothing a moment ago: not every loop
            return 0
        handled = consumer.run_once()
        self._consumer_idle[partition] = 0.0 if handled else now + CONSUMER_IDLE_SECONDS
        return handled

    def joint_step(self, leases: list[Lease]) -> int:
        """Every held shard in one step (their leases are checked together in each batch)."""
        by_count: dict[int, list[tuple[int, Lease]]] = {}
        for lease in leases:
            shard, count = (int(x) for x in lease.partition.removeprefix(SHARD).split("/"))
            by_count.setdefault(count, []).append((shard, lease))
        handled = 0
        for count, held in by_count.items():  # one count, but for the moment of a re-shard
            handled += self.shards_step([s for s, _ in held], count, [lease for _, lease in held])
        return handled

    def shards_step(self, shards: Sequence[int], count: int, leases: Sequence[Lease] = ()) -> int:
        """Commit the calls that ended, ask about changes, then claim what is due in ``shards`` for the free slots;
        returns the calls ended, changes read and entries claimed."""
        handled = self.engine.collect(leases=leases).ended
        if self._main is not None and self._main.draining:
            self.engine.release_waiting()
            if not self.engine.busy:
                self._main.drained()
            return handled
        waits, changes = self.engine.plan(shards)
        if changes:  # what the change path queues is claimed in the step after its batch committed
            handled += self.engine.ask_changes(shards, leases=leases, shard_count=count)
        now = time.monotonic()
        due: list[str] = []
        for name in self.stages:
            if self._blocked.get(name, 0.0) > now:
                self._wake_at(self._blocked[name])
                continue
            lane_waits = [w for w in (waits.get((name, MAIN)), waits.get((name, LOW))) if w is not None]
            if any(w <= 0 for w in lane_waits):
                due.append(name)
            elif lane_waits:
                self._wake_at(now + min(lane_waits))
        free = [n for n in due if self.stages[n].rate_limit is None and self.stages[n].max_parallelism is None]
        groups = ([free] if free else []) + [[n] for n in due if n not in free]  # a limited stage alone
        for names in groups:
            handled += self._claim(shards, count, names, leases)
        self.engine.pump()
        if self.engine.busy:  # turn again in time to renew leases and flow slots, and to settle late asks
            self._wake_at(min(time.monotonic() + self.options.lease_ttl / 3, self.engine.asks_due()))
        return handled

    def _claim(self, shards: Sequence[int], count: int, names: list[str], leases: Sequence[Lease]) -> int:
        """Claim entries of ``names`` for the free slots (and as many as the calls ended lately say can start
        soon); returns the entries claimed or held back (then the loop turns again at once)."""
        report = self.engine.start_batch(shards, names, leases=leases, shard_count=count)
        if report.blocked_until is not None:
            for name in names:
                self._blocked[name] = report.blocked_until
            self._wake_at(report.blocked_until)
            return report.taken
        return report.taken + report.held_back

    def _call_ended(self) -> None:
        """A call ended (from the executor's thread): the main loop collects it."""
        if self._main is not None:
            self._main.wake()

    def _wake_at(self, when: float) -> None:
        """Wake the main loop's idle sleep at monotonic time ``when`` (the earliest asked for wins)."""
        if self._main is None:
            return
        now = time.monotonic()
        with self._timer_lock:
            if self._timer_at is not None and now < self._timer_at <= when:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = threading.Timer(max(0.0, when - now), self._main.wake)
            self._timer.daemon = True
            self._timer.start()

    # -- pub/sub handlers ----------------------------------------------------------------------

    def _captured(self, conn: Any, events: list[Event]) -> None:
        """Writes that bypassed the API: put their entities on the change path (in the consumer's transaction)."""
        ids = sorted({e.key["entity_id"] for e in events if e.key and e.op in ("insert", "update")})
        if ids:
            count = conn.execute(sql.BEGIN_WRITE).fetchone()[0]
            enqueue_changes(conn, self.db, count, [(i, "*") for i in ids])


class _ShardsLoop(Worker):
    """The loop of the shards: stopped, or at the end of its duration, it claims nothing more and stops once the
    calls in flight have ended (each within its stage's timeout), their outcomes committed under its leases."""

    def __init__(self, engine: Engine, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = engine
        self.draining = False
        self._drain_lock = threading.Lock()
        self._timers: list[threading.Timer] = []

    def run(self, duration: float | None = None) -> WorkerReport:
        """Loop for ``duration`` seconds (None: until :meth:`stop`), then stop as :meth:`stop` does."""
        if duration is not None:
            self._later(duration, self.stop)
        try:
            return super().run()
        finally:
            with self._drain_lock:
                for timer in self._timers:
                    timer.cancel()
                self._timers = []

    def stop(self) -> None:
        """Claim nothing more; stop once the step finds no call running within its time limit and none waiting
        for its commit, or once the last call's time limit has passed (safe from any thread)."""
        remaining = max((task.timeout - task.seconds for task in self.engine.executor.running), default=0.0)
        with self._drain_lock:
            first = not self.draining
            self.draining = True
        if first:
            self._later(max(remaining, 0.0) + 1.0, self.drained)
        self.wake()

    def drained(self) -> None:
        """Stop now (no call runs, or the last one's time limit has passed)."""
        super().stop()

    def _later(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        with self._drain_lock:
            self._timers.append(timer)
        timer.start()


def _after_commit_handler(stage: Stage) -> Callable[[Any, list[Event]], None]:
    topic = f"stages.{stage.name}"

    def handle(conn: Any, events: list[Event]) -> None:
        for event in events:
            if event.topic != topic:
                continue
            p = event.payload
            stage.after_commit(
                SavedEntity(
                    event.id,
                    stage.name,
                    p["entity_id"],
                    p["version"],
                    p["payload"],
                    p.get("state"),
                    p.get("changed", True),
                )
            )

    return handle
