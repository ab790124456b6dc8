"""A reactive tick costs what changed, not what is defined: an idle tick makes the same round trips for 3 tasks as
for 300; what a tick stores to explain its evaluations renders, read back, the text the evaluation gives; what the
engine knows of its tables between ticks is dropped when a tick raises or another engine ticked in between, and the
tasks a time-boxed tick did not get to stay marked."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import psycopg
import pytest

from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database
from cmb_dagster.reactive import sql, status
from cmb_dagster.reactive.admin import claim_launch_log, current_values
from cmb_dagster.reactive.engine import LEASE_KIND, TaskScheduler
from cmb_dagster.reactive.explanations import ALREADY_SEEN
from cmb_dagster.reactive.models import RunInfo, RunState, SchedulerSettings, TaskSpec
from cmb_dagster.triggers import All, ChunkDelta, Delay, Delta, Settle, evaluate
from cmb_dagster.workers import Leases

T0 = datetime(2024, 5, 1, tzinfo=UTC)
NOW = datetime(2024, 5, 1, 15, 30, 15, 250_000, tzinfo=ZoneInfo("Europe/Moscow"))
A = ("shop/orders", "loaded_until")
B = ("shop/prices", "loaded_until")


def no_runs(scheduler, run_keys):
    return {}


def all_succeeded(scheduler, run_keys):
    return {key: RunInfo(f"run-{key}", RunState.SUCCESS) for key in run_keys}


def scheduler(db: Database, name: str, specs, **settings) -> TaskScheduler:
    return TaskScheduler(db, name, specs, SchedulerSettings(**settings), owner="shared-owner")


@contextmanager
def watched() -> Iterator[tuple[list[int], list[str]]]:
    """The round trips made inside the block by this thread (psycopg waits for the server), and the statements
    it sent (other threads, e.g. the fixture copying the next test's database, are not counted)."""
    count, statements = [0], []
    wait, execute = psycopg.Connection.wait, psycopg.Cursor.execute
    ours = threading.get_ident()

    def counting(self, gen, *args, **kwargs):
        if threading.get_ident() == ours:
            count[0] += 1
        return wait(self, gen, *args, **kwargs)

    def recording(self, query, *args, **kwargs):
        if threading.get_ident() == ours:
            statements.append(str(query))
        return execute(self, query, *args, **kwargs)

    psycopg.Connection.wait, psycopg.Cursor.execute = counting, recording
    try:
        yield count, statements
    finally:
        psycopg.Connection.wait, psycopg.Cursor.execute = wait, execute


def settle(engine: TaskScheduler) -> None:
    for _ in range(5):
        report = engine.tick(all_succeeded, now=NOW)
        if not report.launches and not report.evaluated:
            return
    raise AssertionError("the scheduler did not settle")


def test_an_idle_tick_reads_no_list_of_tasks_and_makes_the_same_round_trips_for_3_tasks_as_for_300(db):
    CtlStore(db).set_many({(f"e{i}", "p"): T0 for i in range(300)})
    specs = [TaskSpec(name=f"t{i}", trigger=Delta(f"e{i}", "p", "1h")) for i in range(300)]
    few, many = scheduler(db, "few", specs[:3]), scheduler(db, "many", specs, max_concurrent_runs=300)
    counts = []
    for engine in (few, many):
        settle(engine)
        with watched() as (count, statements):
            report = engine.tick(all_succeeded, now=NOW)
        assert report.idle, report.summary()
        # neither the tasks in flight, nor every mark, nor every waiting task: what changed only
        assert not {sql.LAUNCHED_TASKS, sql.MARKED_TASKS, sql.REMIND_WAITING} & set(statements)
        counts.append(count[0])
    assert counts[0] == counts[1], counts


def expected_explanation(trigger, current, changed) -> str:
    """The text a first evaluation gives (no last-seen values)."""
    result = evaluate(trigger, now=NOW, current=current, last={}, timezone="UTC", changed=changed)
    return result.explanation + (ALREADY_SEEN if result.fired and not result.used else "")


def test_explanations_read_back_render_what_the_tick_evaluated(db):
    CtlStore(db).set_many({A: T0 - timedelta(hours=30), B: T0 - timedelta(minutes=1, microseconds=5)})
    specs = {
        "delta": Delta(*A, "1h"),
        "settle": Settle(*B, "15min"),
        "both": All(ChunkDelta(*A, "day", timezone="Europe/Moscow"), Delay(*B, "30d")),
    }
    engine = scheduler(db, "explained", [TaskSpec(name=name, trigger=trigger) for name, trigger in specs.items()])
    report = engine.tick(no_runs, now=NOW)
    with db.connection() as conn:
        current, changed = current_values(conn, [A, B])
    tasks = {s.name: s for s in status(db, "explained").tasks}
    assert sorted(launch.task for launch in report.launches) == ["both", "delta"]
    for launch in report.launches:  # rendered when read: from the run's launch record, from the task's state
        expected = expected_explanation(specs[launch.task], current, changed)
        seen = claim_launch_log(db, "explained", launch.run_key, f"run-{launch.task}")
        assert launch.reason == expected and seen is not None and seen.reason == expected
        assert tasks[launch.task].explanation == expected and tasks[launch.task].status == "launched"
    [waiting] = [event for event in report.events if event.action == "waiting"]
    assert waiting.task == "settle" and tasks["settle"].status == "waiting"
    assert tasks["settle"].explanation == waiting.detail == expected_explanation(specs["settle"], current, changed)


def test_a_tick_that_raises_leaves_its_marks_for_the_next(db):
    engine = scheduler(db, "raises", [TaskSpec(name="t", trigger=Delta(*A, "1h"))])
    settle(engine)

    def broken(after):
        raise RuntimeError("run storage is down")

    CtlStore(db).set(*A, T0)
    with pytest.raises(RuntimeError, match="run storage is down"):
        engine.tick(no_runs, now=NOW, manual=broken)  # the change was read, its task not evaluated yet
    assert status(db, "raises").tasks[0].dirty
    assert [launch.task for launch in engine.tick(no_runs, now=NOW).launches] == ["t"]


@pytest.mark.parametrize("other", ["another process", "this process, on the same lease"])
def test_a_tick_of_another_engine_in_between_is_seen(db, other):
    specs = [TaskSpec(name="t", trigger=Delta(*A, "1h"))]
    first = scheduler(db, "shared", specs)
    lease = None
    if other == "another process":
        second = TaskScheduler(db, "shared", specs, owner="other")
    else:  # the lease stays held between the ticks, as by a worker's loop
        second = scheduler(db, "shared", specs)
        lease = Leases(db, LEASE_KIND, "shared-owner", ttl=60).acquire(["shared"])["shared"]
    for _ in range(3):
        first.tick(all_succeeded, now=NOW, lease=lease)
    CtlStore(db).set(*A, T0)
    [launch] = second.tick(no_runs, now=NOW, lease=lease).launches  # the other engine launches the task
    report = first.tick(all_succeeded, now=NOW, lease=lease)  # this one follows the run it did not launch
    assert next(event.action for event in report.events if event.task == "t") == "succeeded"
    assert status(db, "shared").tasks[0].last_values == {A[0]: {A[1]: T0.isoformat()}}, launch


def test_a_time_boxed_tick_leaves_the_tasks_it_did_not_evaluate_marked(db):
    specs = [TaskSpec(name=f"t{i}", trigger=Delta(*A, "1h"), priority=i) for i in range(3)]
    engine = scheduler(db, "boxed", specs, batch_size=1, tick_seconds=0.001)
    settle_engine = scheduler(db, "boxed", specs)
    settle(settle_engine)
    CtlStore(db).set(*A, T0)
    report = engine.tick(no_runs, now=NOW)
    assert not report.complete and report.evaluated == 1 and [x.task for x in report.launches] == ["t2"]
    assert {s.name for s in status(db, "boxed").tasks if s.dirty} == {"t0", "t1"}
    later = TaskScheduler(db, "boxed", specs, SchedulerSettings(), owner="restarted")  # a process knowing nothing
    assert sorted(launch.task for launch in later.tick(no_runs, now=NOW).launches) == ["t0", "t1"]
    assert not any(s.dirty for s in status(db, "boxed").tasks)
