"""The reactive scheduler survives kill -9 mid-tick: no CTL change lost, no values launched twice; and its CLI."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

from waiting import wait_until

from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database
from cmb_dagster.reactive import status

CLI = [sys.executable, "-c", "from cmb_dagster.cli import run; run()"]
TASKS = 40
BASE = datetime(2024, 5, 1, tzinfo=UTC)

# A scheduler process: a ReactiveWorker as a fixed owner (a restarted worker keeps its name), woken by every CTL
# change, with a stand-in run storage in which every launched run has already succeeded.
SCHEDULER = f"""
import sys
from cmb_dagster.database import Database
from cmb_dagster.reactive import ReactiveWorker, RunInfo, RunState, SchedulerSettings, TaskSpec
from cmb_dagster.triggers import Delta

specs = [TaskSpec(name=f"t{{i}}", trigger=Delta(f"e{{i}}", "p", "1s")) for i in range({TASKS})]
succeeded = lambda scheduler, keys: {{k: RunInfo("run-" + k, RunState.SUCCESS) for k in keys}}
ReactiveWorker(Database(sys.argv[1]), SchedulerSettings(tick_seconds=1, idle_sleep=0.1), name="crash", tasks=specs,
               runs=succeeded, launch=lambda launches: None, owner="scheduler-1").run()
"""


def launches(db: Database) -> list[tuple]:
    with db.connection() as conn:
        return conn.execute("SELECT task, values_hash, attempt, outcome FROM reactive_launches").fetchall()


def start_scheduler(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCHEDULER, url], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_kill_9_mid_tick_loses_no_change_and_launches_no_values_twice(db):
    store = CtlStore(db, actor="producer")
    stop = threading.Event()
    moments = {f"e{i}": BASE for i in range(TASKS)}

    def produce() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            entity = f"e{rng.randrange(TASKS)}"
            moments[entity] += timedelta(seconds=rng.randrange(1, 5))
            store.set(entity, "p", moments[entity])
            time.sleep(0.002)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        for _ in range(4):
            process = start_scheduler(db.url)
            before = len(launches(db))
            wait_until(lambda before=before: len(launches(db)) > before + 20, timeout=60)
            time.sleep(random.uniform(0.0, 0.3))  # land anywhere inside a tick
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
    finally:
        stop.set()
        producer.join()

    process = start_scheduler(db.url)  # the same worker comes back and drains everything
    try:

        def settled() -> bool:
            states = {s.name: s for s in status(db, "crash").tasks}
            return len(states) == TASKS and all(
                s.status == "waiting"
                and not s.dirty
                and s.last_values.get(f"e{s.name[1:]}", {}).get("p") == moments[f"e{s.name[1:]}"].isoformat()
                for s in states.values()
            )

        wait_until(settled, timeout=60)  # every last change reached its task and a committed run
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    rows = launches(db)
    assert len(rows) > 80
    assert all(outcome == "success" for *_, outcome in rows)
    assert all(attempt == 1 for _, _, attempt, _ in rows)  # no set of values was launched twice
    assert len({(task, digest) for task, digest, _, _ in rows}) == len(rows)


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CMB_DATABASE_URL": url}
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=60)


def test_cli_sets_reads_and_explains(db):
    assert cli(db.url, "ctl", "set", "sales", "loaded_until", "2024-05-02T00:00:00+00:00").returncode == 0
    back = cli(db.url, "ctl", "set", "sales", "loaded_until", "2024-05-01T00:00:00+00:00")
    assert back.returncode == 0 and "BACKWARDS" in back.stdout
    naive = cli(db.url, "ctl", "set", "sales", "loaded_until", "2024-05-01T00:00:00")
    assert naive.returncode == 1 and naive.stderr.count("\n") == 1 and "time zone" in naive.stderr
    assert "sales/loaded_until = 2024-05-01T00:00:00+00:00" in cli(db.url, "ctl", "get").stdout
    history = cli(db.url, "ctl", "history", "sales").stdout.splitlines()
    assert len(history) == 2 and "BACKWARDS" in history[0]

    from cmb_dagster.reactive.engine import TaskScheduler
    from cmb_dagster.reactive.models import RunInfo, SchedulerSettings, TaskSpec
    from cmb_dagster.triggers import Delta

    spec = TaskSpec(name="mart", trigger=Delta("sales", "loaded_until", "1h"))
    TaskScheduler(db, "cli", [spec], SchedulerSettings()).tick(lambda s, keys: dict[str, RunInfo]())
    shown = cli(db.url, "reactive", "status", "cli")
    assert shown.returncode == 0 and "cli/mart: launched" in shown.stdout and "first run" in shown.stdout
    [state] = json.loads(cli(db.url, "reactive", "status", "cli", "mart", "--json").stdout)
    assert state["trigger"]["kind"] == "Delta" and state["run_key"].startswith("mart:")
    forgot = cli(db.url, "reactive", "forget", "cli", "nobody")
    assert forgot.returncode == 1 and "no reactive task" in forgot.stderr


# A scheduler process whose task 'bad' has run config code that kills the scheduler (its code runs in a child
# process: it kills its parent, as the OOM killer may pick the scheduler while the code runs); 'good' has none. A
# ReactiveWorker ticking every 0.1 s, as a fixed owner.
CRASHY = """
import os, signal, sys
from cmb_dagster.database import Database
from cmb_dagster.reactive import ReactiveWorker, RunInfo, RunState, SchedulerSettings, TaskSpec
from cmb_dagster.triggers import Delta

def crash(values):
    os.kill(os.getppid(), signal.SIGKILL)

specs = [TaskSpec(name="good", trigger=Delta("eg", "p", "1s")), TaskSpec(name="bad", trigger=Delta("eb", "p", "1s"))]
succeeded = lambda scheduler, keys: {k: RunInfo("run-" + k, RunState.SUCCESS) for k in keys}
ReactiveWorker(Database(sys.argv[1]), SchedulerSettings(tick_seconds=1, idle_sleep=0.1), name="crashy", tasks=specs,
               runs=succeeded, launch=lambda launches: None, owner="scheduler-1", launch_options={"bad": crash}).run()
"""


def test_a_task_whose_user_code_kills_the_scheduler_is_parked_and_the_others_launch(db):
    from cmb_dagster.reactive import retry_task

    store = CtlStore(db, actor="producer")
    store.set("eg", "p", BASE)
    store.set("eb", "p", BASE)
    deaths = 0
    process = subprocess.Popen(
        [sys.executable, "-c", CRASHY, db.url], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )

    def state(name: str):
        return next(s for s in status(db, "crashy").tasks if s.name == name)

    def parked() -> bool:
        nonlocal process, deaths
        if process.poll() is not None:
            deaths += 1
            process = subprocess.Popen(
                [sys.executable, "-c", CRASHY, db.url], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
        names = {s.name for s in status(db, "crashy").tasks}
        return names == {"good", "bad"} and "not run again until" in (state("bad").explanation or "")

    try:
        wait_until(parked, 90, "the crashing task parked", interval=0.1)
        assert deaths == 3
        assert any(task == "good" for task, *_ in launches(db))  # the other task launched meanwhile
        assert not any(task == "bad" for task, *_ in launches(db))
        time.sleep(1.5)  # parked: later ticks do not run its code again
        assert process.poll() is None
        assert retry_task(db, "crashy", "bad")
        process.wait(30)  # retried: its code runs, and kills the scheduler again
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
