"""``StageWorker``: serves shards on the shared worker runtime (lease kind ``stages.shard``).

Its main loop holds the shards, ``shard:<id>/<count>`` each (the count is part of the name, so a re-shard
gives new leases), and serves them together: a step asks the database what is due in all of them (one
query), runs the change path, then batches over all shards and all stages due (a stage with a rate limit or
max parallelism in batches of its own), each stage's low-priority queue only where its main one has nothing
due. Idle, it sleeps until the next timer (a wake-up timer), a NOTIFY from a writer, or ``idle_sleep``. It
registers the stages' limits with :mod:`cmb_dagster.flow` when it starts.

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
from cmb_dagster.workers import EngineWorker, Lease, Worker

log = logging.getLogger("cmb_dagster.stages")

STEP_SECONDS = 1.0  # a shard step stops starting batches after this, so leases are renewed in time
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
        )
        self.stages = self.engine.stages
        self._main: Worker | None = None
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
        self._main = Worker(
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
        """Cancel the wake-up timer and close the engine (calls still set aside run again later)."""
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
        """Everything due in ``shards``, for at most about a second; returns entries handled."""
        deadline = time.monotonic() + STEP_SECONDS
        handled = self.engine.finish_set_aside(shards[0], leases=leases, shard_count=count)
        waits, changes = self.engine.plan(shards)
        while changes and time.monotonic() < deadline:
            n = self.engine.changes_batch(shards, leases=leases, shard_count=count, on_wait=self._keep_alive)
            handled += n
            changes = n >= self.engine.batch_size
        if handled:  # the change path may have queued entries due now
            waits, _ = self.engine.plan(shards)
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
            handled += self._drain(shards, count, names, leases, deadline)
        return handled

    def _drain(
        self, shards: Sequence[int], count: int, names: list[str], leases: Sequence[Lease], deadline: float
    ) -> int:
        handled = 0
        while time.monotonic() < deadline:
            report = self.engine.process_batch(
                shards, names, leases=leases, shard_count=count, on_wait=self._keep_alive
            )
            handled += report.taken
            if report.blocked_until is not None:
                for name in names:
                    self._blocked[name] = report.blocked_until
                self._wake_at(report.blocked_until)
                break
            if report.taken == 0 and not report.held_back:
                break
        return handled

    def _keep_alive(self) -> None:
        if self._main is not None:
            self._main.keep_alive()

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
