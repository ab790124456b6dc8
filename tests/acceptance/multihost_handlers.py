"""User code for the multi-host tests' worker processes (``--handler multihost_handlers:...``).

Each call is recorded before it does anything, whether or not its work commits: one line per call appended to
the file ``CMB_TEST_CALLS`` names (pid, time.time(), the items). Results go to ``public.results`` in the
worker's transaction (item, pid), so what committed can be compared with what was called.
"""

import json
import logging
import os
import time

from pydantic import BaseModel

from cmb_dagster.eventqueue import HandlerRegistry
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult


def note_call(items: list) -> None:
    """Append one line for this call to the calls file (the filesystem is shared by the test's namespaces)."""
    with open(os.environ["CMB_TEST_CALLS"], "a") as calls:
        calls.write(json.dumps([os.getpid(), time.time(), items]) + "\n")


def pubsub_record(conn, events) -> None:
    """A pub/sub handler: note the call, take a while (so a cut finds a batch in flight), write the results."""
    ids = [e.payload["n"] for e in events]
    note_call(ids)
    time.sleep(0.1)
    conn.execute("INSERT INTO public.results (item, pid) SELECT unnest(%s::int[]), %s", (ids, os.getpid()))


eventqueue = HandlerRegistry()


@eventqueue.handler("record", lock_expiry=3)
def eventqueue_record(event) -> None:
    """An event queue handler: note the call, take a while (so a cut finds handlers in flight)."""
    note_call([event.id])
    time.sleep(0.05)


class Runs(BaseModel):
    runs: int = 0


class Mark(Stage):
    """A stage: note the call, take a while (so a cut finds a batch in flight), mark the entity done once."""

    name = "mark"
    state_model = Runs

    def should_process(self, entity: Entity, state: Runs) -> bool:
        return "done" not in entity.payload

    def process(self, entity: Entity, state: Runs) -> StageResult:
        note_call([entity.id])
        time.sleep(0.01)
        return StageResult(update=MergePatch({"done": state.runs + 1}), new_state=Runs(runs=state.runs + 1))


stages = StageOptions(stages=[Mark()], shard_count=6, batch_size=20, lease_ttl=3.0, idle_sleep=0.2)


REACTIVE_TASKS = 20


def reactive_worker(url: str) -> None:
    """A reactive scheduler process (``python -c 'import multihost_handlers as m; m.reactive_worker(url)'``): tasks
    ``t<i>`` on ``e<i>.p``; its launcher notes each launch (run_key), and every launched run has already succeeded."""
    from cmb_dagster.database import Database
    from cmb_dagster.reactive import ReactiveWorker, RunInfo, RunState, SchedulerSettings, TaskSpec
    from cmb_dagster.triggers import Delta
    from cmb_dagster.workers import stop_workers_on_signals

    specs = [TaskSpec(name=f"t{i}", trigger=Delta(f"e{i}", "p", "1s")) for i in range(REACTIVE_TASKS)]

    def succeeded(scheduler, keys):
        return {k: RunInfo("run-" + k, RunState.SUCCESS) for k in keys}

    def launch(launches) -> None:
        values = [{f"{e}.{p}": at.isoformat() for (e, p), at in x.values.items()} for x in launches]
        note_call([[x.task, x.run_key, v] for x, v in zip(launches, values, strict=True)])

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # as the CLI
    settings = SchedulerSettings(tick_seconds=1, idle_sleep=0.1)
    worker = ReactiveWorker(Database(url), settings, name="multihost", tasks=specs, runs=succeeded, launch=launch)
    with stop_workers_on_signals():
        worker.run()
