"""User code and worker scripts for the PgBouncer tests' worker processes (test_pgbouncer.py).

Every call of user code appends one line (pid, time.time(), the items) to the file ``CMB_TEST_CALLS`` names.
Every worker sleeps :data:`IDLE` seconds when it finds nothing to do: a test that waits far less for an item
given to an idle worker proves a notification woke it.
"""

import json
import logging
import os
import time

from pydantic import BaseModel

from cmb_dagster.eventqueue import HandlerRegistry
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult

IDLE = 60.0


def note_call(items: list) -> None:
    with open(os.environ["CMB_TEST_CALLS"], "a") as calls:
        calls.write(json.dumps([os.getpid(), time.time(), items]) + "\n")


def pubsub_record(conn, events) -> None:
    note_call([e.payload["n"] for e in events])


eventqueue = HandlerRegistry()


@eventqueue.handler("record")
def eventqueue_record(event) -> None:
    note_call([event.value])


class Runs(BaseModel):
    runs: int = 0


class Mark(Stage):
    """Marks each entity done once."""

    name = "mark"
    state_model = Runs

    def should_process(self, entity: Entity, state: Runs) -> bool:
        return "done" not in entity.payload

    def process(self, entity: Entity, state: Runs) -> StageResult:
        note_call([entity.id])
        return StageResult(update=MergePatch({"done": state.runs + 1}), new_state=Runs(runs=state.runs + 1))


stages = StageOptions(stages=[Mark()], shard_count=4, batch_size=20, lease_ttl=3.0, idle_sleep=IDLE)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # as the CLI


def pubsub_worker() -> None:
    """A pub/sub consumer ``results`` of :func:`pubsub_record` on the settings' database, polling every IDLE s."""
    from cmb_dagster.database import Database
    from cmb_dagster.pubsub import ConsumerSpec, ConsumerWorker
    from cmb_dagster.workers import stop_workers_on_signals

    _logging()
    spec = ConsumerSpec(consumer_id="results", handler=pubsub_record, idle_sleep=IDLE, lease_ttl=3.0)
    with stop_workers_on_signals():
        ConsumerWorker(Database.from_settings(), spec).run()


REACTIVE_TASKS = 4


def reactive_worker() -> None:
    """A reactive scheduler on the settings' database: tasks ``t<i>`` on ``e<i>.p``; each launch is noted."""
    from cmb_dagster.database import Database
    from cmb_dagster.reactive import ReactiveWorker, RunInfo, RunState, SchedulerSettings, TaskSpec
    from cmb_dagster.triggers import Delta
    from cmb_dagster.workers import stop_workers_on_signals

    specs = [TaskSpec(name=f"t{i}", trigger=Delta(f"e{i}", "p", "1s")) for i in range(REACTIVE_TASKS)]

    def succeeded(scheduler, keys):
        return {k: RunInfo("run-" + k, RunState.SUCCESS) for k in keys}

    def launch(launches) -> None:
        note_call([x.task for x in launches])

    _logging()
    settings = SchedulerSettings(tick_seconds=1, idle_sleep=0.2)
    worker = ReactiveWorker(
        Database.from_settings(), settings, name="bouncer", tasks=specs, runs=succeeded, launch=launch
    )
    with stop_workers_on_signals():
        worker.run()
