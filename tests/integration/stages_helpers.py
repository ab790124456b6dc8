"""Stages used by the stage scheduler tests, and a helper that steps a worker until nothing is due."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from pydantic import BaseModel

from cmb_dagster.stages import Entity, MergePatch, Stage, StageResult, StageWorker, shard_count
from cmb_dagster.stages.models import LEASE_KIND
from cmb_dagster.stages.worker import CONSUMER_IDLE_SECONDS
from cmb_dagster.workers import Lease


class Seen(BaseModel):
    runs: int = 0
    last_version: int = 0


class Step(Stage):
    """Sets payload[field] = payload[source] + 1 (a merge patch) once ``source`` is there."""

    state_model = Seen

    def __init__(self, name: str, source: str, target: str, **kw: object) -> None:
        super().__init__(**kw)
        self.name = name  # type: ignore[misc]
        self.source, self.target = source, target
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.active: set[str] = set()
        self.overlaps = 0

    def should_process(self, entity: Entity, state: Seen) -> bool:
        p = entity.payload
        return self.source in p and p.get(self.target) != p[self.source] + 1

    def process(self, entity: Entity, state: Seen) -> StageResult:
        with self.lock:
            self.calls.append((entity.id, entity.version))
        p = entity.payload
        if self.source not in p or p.get(self.target) == p[self.source] + 1:
            return StageResult()
        return StageResult(
            update=MergePatch({self.target: p[self.source] + 1}),
            new_state=Seen(runs=state.runs + 1, last_version=entity.version),
        )


def consumer_partitions(worker: StageWorker) -> list[str]:
    """The pub/sub consumers of worker 0, the capture first (its loops built: the shard count applied, the capture
    installed)."""
    _, consumers = worker.loops()
    return sorted(consumers.partitions, key=lambda partition: partition != "capture")


def pipeline(**kw: object) -> list[Step]:
    """a -> b -> c -> d: each stage changes the entity once."""
    return [Step("first", "a", "b", **kw), Step("second", "b", "c", **kw), Step("third", "c", "d", **kw)]


def drain(worker: StageWorker, rounds: int = 200, *, settle: float = 0.0) -> int:
    """Step every shard (no leases) and every pub/sub consumer until a round handles nothing and no call runs
    (for ``settle`` seconds, and long enough for each consumer to be asked again); a round with calls running waits
    for one to end."""
    consumers = [Lease(LEASE_KIND, partition, worker.owner, 0) for partition in consumer_partitions(worker)]
    quiet_for = max(settle, 2 * CONSUMER_IDLE_SECONDS)  # a consumer that found nothing is asked again after that
    total = 0
    quiet_since = None
    for _ in range(rounds):
        count = shard_count(worker.db)
        n = worker.consumer_step(consumers[0])  # the capture first: the changes the shards then read
        n += worker.shards_step(range(count), count)
        for consumer in consumers[1:]:
            n += worker.consumer_step(consumer)
        total += n
        if worker.engine.executor.running:
            worker.engine.executor.wait(1.0)
            quiet_since = None
        elif worker.engine.busy:
            quiet_since = None
        elif n == 0:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= quiet_for:
                return total
            time.sleep(0.02)
        else:
            quiet_since = None
    raise AssertionError(f"still busy after {rounds} rounds")


__all__ = ["Seen", "Step", "drain", "pipeline", "timedelta"]
