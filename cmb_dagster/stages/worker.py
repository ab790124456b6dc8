"""``StageWorker``: serves shards on the shared worker runtime (lease kind ``stages.shard``).

Partitions: ``shard:<id>/<count>`` per shard (the count is part of the name, so a re-shard gives new
leases), ``capture`` (the pub/sub consumer that puts writes bypassing the API on the change path) and
``after_commit:<stage>`` per stage with an after-commit handler. The held shards are served together:
a step asks the database what is due in all of them (one query), runs the change path, then batches
over all shards and all stages due (a stage with a rate limit or max parallelism in batches of its
own), each stage's low-priority queue only where its main one has nothing due. Idle, the worker sleeps
until the next timer (a wake-up timer), a NOTIFY from a writer, or ``idle_sleep``. The pub/sub consumers
run in a loop of their own (a thread), so a slow after-commit handler never holds up the shards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.notifications import Listener, channel_name
from cmb_dagster.pubsub import Consumer, Event
from cmb_dagster.stages import sql as q
from cmb_dagster.stages.admin import set_shard_count
from cmb_dagster.stages.engine import LOW, MAIN, Engine
from cmb_dagster.stages.models import CHANNEL, LEASE_KIND, SavedEntity, StageOptions
from cmb_dagster.stages.stage import Stage
from cmb_dagster.stages.store import enqueue_changes, ensure_capture
from cmb_dagster.workers import Lease, Worker, WorkerReport

log = logging.getLogger("cmb_dagster.stages")

STEP_SECONDS = 1.0  # a shard step stops starting batches after this, so leases are renewed in time
CONSUMER_IDLE_SECONDS = 0.1  # a pub/sub consumer that found nothing is asked again after this (or a NOTIFY)


class StageWorker:
    """Processes the stages of the shards it holds (job ``index`` of ``workers`` serves shards with
    id % workers == index; ``shards`` narrows that further)."""

    def __init__(
        self,
        source: DatabaseSource,
        options: StageOptions | Sequence[Stage],
        *,
        index: int = 0,
        workers: int | None = None,
        shards: Sequence[int] | None = None,
        owner: str | None = None,
        listen: bool = True,
    ) -> None:
        self.options = options if isinstance(options, StageOptions) else StageOptions(stages=list(options))
        self.db = Database.of(source)
        self.workers = workers or self.options.workers
        self.index = index
        self.shards = None if shards is None else set(shards)
        self.owner = owner
        self.listen = listen
        self.engine = Engine(self.db, self.options.stages, batch_size=self.options.batch_size,
                             publish=self.options.publish, idle_timeout=max(10.0, 3 * self.options.lease_ttl),
                             owner=owner)
        self.stages = self.engine.stages
        self._worker: Worker | None = None
        self._consumer_worker: Worker | None = None
        self._blocked: dict[str, float] = {}
        self._timer: threading.Timer | None = None
        self._timer_at: float | None = None
        self._timer_lock = threading.Lock()
        self._consumers: dict[str, Consumer] = {}
        self._consumer_idle: dict[str, float] = {}
        self._stopping = threading.Event()

    # -- running -------------------------------------------------------------------------------

    def setup(self) -> None:
        """Apply the options' shard count, install the capture, build the pub/sub consumers."""
        if self.options.shard_count is not None:
            previous = set_shard_count(self.db, self.options.shard_count)
            if previous != self.options.shard_count:
                log.info("stages: shard count %d -> %d", previous, self.options.shard_count)
        ensure_capture(self.db)
        with self.db.connection() as conn:
            _, capture_branch, results_branch = conn.execute(q.SETTINGS).fetchone()
        self._consumers = {"capture": Consumer(self.db, "stages.capture", capture_branch, self._captured, batch_size=2000)}
        for name, stage in self.stages.items():
            if stage.after_commit is not None:
                self._consumers[f"after_commit:{name}"] = Consumer(
                    self.db, f"stages.after_commit.{name}", results_branch, _after_commit_handler(stage), batch_size=200)

    def run(self, duration: float | None = None, *, on_progress: Callable[[WorkerReport], None] | None = None) -> WorkerReport:
        """Work for ``duration`` seconds (None: until :meth:`stop`)."""
        self.setup()
        self._worker = worker = Worker(
            self.db, LEASE_KIND, self.shard_partitions, self.step, owner=self.owner, ttl=self.options.lease_ttl,
            idle_sleep=self.options.idle_sleep, on_progress=on_progress,
            joint=lambda partition: partition.startswith("shard:"), joint_step=self.joint_step,
        )
        consumers = None
        if self.index == 0:
            self._consumer_worker = consumers = Worker(
                self.db, LEASE_KIND, list(self._consumers), self.step, owner=worker.owner, ttl=self.options.lease_ttl,
                idle_sleep=CONSUMER_IDLE_SECONDS)
        if self._stopping.is_set():
            worker.stop()
        listener = None
        if self.listen:
            listener = Listener(self.db, [channel_name(self.db, CHANNEL)], lambda channel, payload: worker.wake()).start()
        thread = None
        if consumers is not None:
            thread = threading.Thread(target=consumers.run, args=(duration,), name="cmb-stages-consumers", daemon=True)
            thread.start()
        try:
            return worker.run(duration)
        finally:
            if consumers is not None and thread is not None:
                consumers.stop()
                thread.join()
            if listener is not None:
                listener.stop()
            with self._timer_lock:
                if self._timer is not None:
                    self._timer.cancel()
            self.engine.close()

    def stop(self) -> None:
        """Finish the current batch and return (safe from a signal handler)."""
        self._stopping.set()
        for worker in (self._worker, self._consumer_worker):
            if worker is not None:
                worker.stop()

    def shard_partitions(self) -> list[str]:
        """The shards this worker asks for (asked again at every lease renewal)."""
        with self.db.connection() as conn:
            count = conn.execute(q.SETTINGS).fetchone()[0]
        mine = [s for s in range(count) if s % self.workers == self.index and (self.shards is None or s in self.shards)]
        return [f"shard:{s}/{count}" for s in mine]

    # -- steps ---------------------------------------------------------------------------------

    def step(self, lease: Lease) -> int:
        """One pub/sub consumer partition (shards are served together by :meth:`shards_step`)."""
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
            shard, count = (int(x) for x in lease.partition[len("shard:"):].split("/"))
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

    def _drain(self, shards: Sequence[int], count: int, names: list[str], leases: Sequence[Lease], deadline: float) -> int:
        handled = 0
        while time.monotonic() < deadline:
            report = self.engine.process_batch(shards, names, leases=leases, shard_count=count, on_wait=self._keep_alive)
            handled += report.taken
            if report.blocked_until is not None:
                for name in names:
                    self._blocked[name] = report.blocked_until
                self._wake_at(report.blocked_until)
                break
            if report.taken == 0:
                break
        return handled

    def _keep_alive(self) -> None:
        if self._worker is not None:
            self._worker.keep_alive()

    def _wake_at(self, when: float) -> None:
        """Wake the worker's idle sleep at monotonic time ``when`` (the earliest asked for wins)."""
        if self._worker is None:
            return
        now = time.monotonic()
        with self._timer_lock:
            if self._timer_at is not None and now < self._timer_at <= when:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = threading.Timer(max(0.0, when - now), self._worker.wake)
            self._timer.daemon = True
            self._timer.start()

    # -- pub/sub handlers ----------------------------------------------------------------------

    def _captured(self, conn: Any, events: list[Event]) -> None:
        """Writes that bypassed the API: put their entities on the change path (in the consumer's transaction)."""
        ids = sorted({e.key["entity_id"] for e in events if e.key and e.op in ("insert", "update")})
        if not ids:
            return
        count = conn.execute(q.BEGIN_WRITE).fetchone()[0]
        enqueue_changes(conn, count, [(i, "*") for i in ids])
        conn.execute(q.NOTIFY, {"channel": channel_name(self.db, CHANNEL), "payload": ""})


def _after_commit_handler(stage: Stage) -> Callable[[Any, list[Event]], None]:
    topic = f"stages.{stage.name}"

    def handle(conn: Any, events: list[Event]) -> None:
        for event in events:
            if event.topic != topic:
                continue
            p = event.payload
            stage.after_commit(SavedEntity(event.id, stage.name, p["entity_id"], p["version"], p["payload"],
                                           p.get("state"), p.get("changed", True)))

    return handle
