"""The worker of one engine for the soak test, run as ``python soak_workers.py ENGINE URL LOG``.

Each records what its user code did where a kill -9 cannot lose it: pub/sub and stages write their results in
the database in the engine's own transaction (exactly once); event queue handlers append the event id to LOG
(at least once: an event running when its worker died runs again); callbacks are counted by the test's receiver.
"""

from __future__ import annotations

import os
import sys
import time

import psycopg

from cmb_dagster.callbacks import CallbackSettings, CallbackWorker
from cmb_dagster.database import Database
from cmb_dagster.errors import CmbError
from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, HandlerRegistry, WorkerSettings
from cmb_dagster.models import Backoff
from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker
from cmb_dagster.reactive import ReactiveWorker, RunInfo, RunState, SchedulerSettings, TaskSpec
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult, StageWorker
from cmb_dagster.triggers import Delta

CONSUMER_FILTER = '$.keep == true && $topic == "soak"'
KEYS = 50_000
REACTIVE_TASKS = 20


def record_kept(conn, events) -> None:
    conn.execute("INSERT INTO public.soak_pubsub (event_id) SELECT unnest(%s::bigint[])", ([e.id for e in events],))


class Count(Stage):
    """Counts each entity once: its state's ``n`` goes to 1 (a second run would make it 2)."""

    name = "count"

    def process(self, entity: Entity, state) -> StageResult:
        return StageResult(update=MergePatch({"n": entity.payload.get("n", 0) + 1}))


def eventqueue_options(log: str) -> EventQueueOptions:
    registry = HandlerRegistry()

    def record(event) -> None:
        with open(log, "a") as out:
            out.write(f"{event.id}\n")

    registry.add("limited", record, key="value.k", rate_limit="20/s", concurrency=1, lock_expiry=10)
    return EventQueueOptions(
        handlers=registry, worker=WorkerSettings(sweep_interval=0.5, lease_ttl=3, worker_concurrency=100)
    )  # claims of 100


def worker(engine: str, db: Database, log: str):
    if engine == "pubsub":
        spec = ConsumerSpec(
            consumer_id="soak", handler=record_kept, where=CONSUMER_FILTER, lease_ttl=3, batch_size=200,
            backoff=Backoff(first=0.1, max=1),
        )  # fmt: skip
        return ConsumerWorker(db, spec)
    if engine == "eventqueue":
        return EventWorker(db, eventqueue_options(log))
    if engine == "stages":
        return StageWorker(db, StageOptions(stages=[Count()], shard_count=4, lease_ttl=3, idle_sleep=0.2))
    if engine == "callbacks":
        settings = CallbackSettings(poll_interval=0.2, lease_ttl=6, timeout=2, allowed_hosts=["127.0.0.1"])
        return CallbackWorker(db, settings)
    if engine == "reactive":
        specs = [TaskSpec(name=f"t{i}", trigger=Delta(f"e{i}", "p", "1s")) for i in range(REACTIVE_TASKS)]
        return ReactiveWorker(
            db, SchedulerSettings(tick_seconds=1, idle_sleep=0.1), name="soak", tasks=specs,
            runs=lambda scheduler, keys: {k: RunInfo("run-" + k, RunState.SUCCESS) for k in keys},
            launch=lambda launches: None, owner="soak-scheduler",
        )  # fmt: skip
    raise SystemExit(f"no engine {engine!r}")


if __name__ == "__main__":
    engine, url, log = sys.argv[1:4]
    db = Database(url)
    built = worker(engine, db, log)
    if engine == "eventqueue":  # the producer's first events need the handlers; a restart may be under way
        for _ in range(300):
            try:
                built.register()
                break
            except (psycopg.OperationalError, CmbError):
                time.sleep(0.2)
    print(f"{engine} worker {os.getpid()} ready", flush=True)
    built.run()
