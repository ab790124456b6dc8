"""User code for the multi-host tests' worker processes (``--handler multihost_handlers:...``).

Each call is recorded before it does anything, whether or not its work commits: one line per call appended to
the file ``CMB_TEST_CALLS`` names (pid, time.time(), the items). Results go to ``public.results`` in the
worker's transaction (item, pid), so what committed can be compared with what was called. With ``CMB_TEST_GATE``
set, a call then waits while the test holds it (:func:`wait_at_gate`): the test can stop a process inside user code.
"""

import json
import logging
import os
import signal
import time

from pydantic import BaseModel

from cmb_dagster.eventqueue import HandlerRegistry
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult


def note_call(items: list) -> None:
    """Append one line for this call to the calls file (the filesystem is shared by the test's namespaces)."""
    with open(os.environ["CMB_TEST_CALLS"], "a") as calls:
        calls.write(json.dumps([os.getpid(), time.time(), items]) + "\n")


def wait_at_gate(items: list) -> None:
    """Wait while the gate directory ``CMB_TEST_GATE`` holds a file named for this process (``<pid>``) or for it
    and one of ``items`` (``<pid>.<item>``); then, if it holds ``stop.<pid>``, remove it and stop this process
    (SIGSTOP) at the end of the call. Nothing without that variable."""
    gate = os.environ.get("CMB_TEST_GATE")
    if not gate:
        return
    names = [str(os.getpid()), *(f"{os.getpid()}.{item}" for item in items)]
    while any(os.path.exists(os.path.join(gate, name)) for name in names):
        time.sleep(0.01)  # user code polling a file the test controls
    stop = os.path.join(gate, f"stop.{os.getpid()}")
    if os.path.exists(stop):
        os.unlink(stop)
        os.kill(os.getpid(), signal.SIGSTOP)


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
    wait_at_gate([event.id])
    time.sleep(0.05)


class Runs(BaseModel):
    runs: int = 0
    pid: int = 0  # the process whose call computed this state


class Mark(Stage):
    """A stage: note the call, take a while (so a cut finds a batch in flight), mark the entity done once."""

    name = "mark"
    state_model = Runs

    def should_process(self, entity: Entity, state: Runs) -> bool:
        return "done" not in entity.payload

    def process(self, entity: Entity, state: Runs) -> StageResult:
        note_call([entity.id])
        time.sleep(0.01)
        wait_at_gate([entity.id])
        return StageResult(
            update=MergePatch({"done": state.runs + 1}), new_state=Runs(runs=state.runs + 1, pid=os.getpid())
        )


stages = StageOptions(stages=[Mark()], shard_count=6, batch_size=20, lease_ttl=3.0, idle_sleep=0.2)
stages_small_batches = StageOptions(stages=[Mark()], shard_count=6, batch_size=5, lease_ttl=3.0, idle_sleep=0.2)


REACTIVE_TASKS = 20


def reactive_worker(url: str, lookups: str | None = None) -> None:
    """A reactive scheduler process (``python -c 'import multihost_handlers as m; m.reactive_worker(url)'``): tasks
    ``t<i>`` on ``e<i>.p``; its launcher notes each launch (run_key), and every launched run has already succeeded.
    ``lookups``: a file where each lookup of runs is noted too (it then waits at the gate)."""
    from cmb_dagster.database import Database
    from cmb_dagster.reactive import ReactiveWorker, RunInfo, RunState, SchedulerSettings, TaskSpec
    from cmb_dagster.triggers import Delta
    from cmb_dagster.workers import stop_workers_on_signals

    specs = [TaskSpec(name=f"t{i}", trigger=Delta(f"e{i}", "p", "1s")) for i in range(REACTIVE_TASKS)]

    def succeeded(scheduler, keys):
        if lookups is not None:
            with open(lookups, "a") as noted:
                noted.write(json.dumps([os.getpid(), time.time(), keys]) + "\n")
            wait_at_gate(["lookup"])
        return {k: RunInfo("run-" + k, RunState.SUCCESS) for k in keys}

    def launch(launches) -> None:
        values = [{f"{e}.{p}": at.isoformat() for (e, p), at in x.values.items()} for x in launches]
        note_call([[x.task, x.run_key, v] for x, v in zip(launches, values, strict=True)])

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # as the CLI
    settings = SchedulerSettings(tick_seconds=1, idle_sleep=0.1)
    worker = ReactiveWorker(Database(url), settings, name="multihost", tasks=specs, runs=succeeded, launch=launch)
    with stop_workers_on_signals():
        worker.run()
