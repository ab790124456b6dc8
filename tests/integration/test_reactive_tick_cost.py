"""A reactive tick costs what changed, not what is defined: an idle tick reads no task and no mark, and scans the
reactive tables as often for 3 tasks as for 300 (as the server counts it); what a tick stores to explain its
evaluations renders, read back, the text the evaluation gives; what the engine knows of its tables between ticks is
dropped when a tick raises or another engine ticked in between, and the tasks a time-boxed tick did not get to stay
marked."""

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import psycopg
import pytest
from waiting import wait_until

from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database
from cmb_dagster.reactive import status
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


REACTIVE_TABLES = ("reactive_tasks", "reactive_marks", "reactive_mark_batches")

SERVER_READS = """
SELECT relname, seq_scan + coalesce(idx_scan, 0), seq_tup_read + coalesce(idx_tup_fetch, 0),
       n_tup_ins + n_tup_upd + n_tup_del
FROM pg_stat_user_tables WHERE schemaname = %(schema)s AND relname = ANY(%(tables)s)
"""

OTHER_SESSIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid()
"""


def server_reads(observer: psycopg.Connection, schema: str) -> dict[str, tuple[int, int, int]]:
    """Per reactive table, as the server counts them: its scans, the rows they read, the rows written."""
    rows = observer.execute(SERVER_READS, {"schema": schema, "tables": list(REACTIVE_TABLES)}).fetchall()
    return {name: tuple(figures) for name, *figures in rows}


def sessions_ended(db: Database, engine: TaskScheduler, observer: psycopg.Connection) -> None:
    """Close the engine's and the database's connections (the next use opens them again), and wait until their
    sessions ended: a session's counts reach the server's statistics at the latest when it ends."""
    engine.close()
    db.close()
    wait_until(lambda: observer.execute(OTHER_SESSIONS).fetchone()[0] == 0, 30, "the sessions ended")


@contextmanager
def counted(db: Database, engine: TaskScheduler) -> Iterator[dict[str, tuple[int, int, int]]]:
    """What the block did to the reactive tables, as the server counts it (:func:`server_reads`)."""
    found: dict[str, tuple[int, int, int]] = {}
    with psycopg.connect(db.url, autocommit=True) as observer:
        sessions_ended(db, engine, observer)
        before = server_reads(observer, db.schema)
        yield found
        sessions_ended(db, engine, observer)
        after = server_reads(observer, db.schema)
    for table in REACTIVE_TABLES:
        found[table] = tuple(a - b for a, b in zip(after[table], before[table], strict=True))


def settle(engine: TaskScheduler) -> None:
    for _ in range(5):
        report = engine.tick(all_succeeded, now=NOW)
        if not report.launches and not report.evaluated:
            return
    raise AssertionError("the scheduler did not settle")


def test_an_idle_tick_reads_no_task_nor_mark_and_scans_as_much_for_3_tasks_as_for_300(db):
    CtlStore(db).set_many({(f"e{i}", "p"): T0 for i in range(300)})
    specs = [TaskSpec(name=f"t{i}", trigger=Delta(f"e{i}", "p", "1h")) for i in range(300)]
    few, many = scheduler(db, "few", specs[:3]), scheduler(db, "many", specs, max_concurrent_runs=300)
    reads = []
    for engine in (few, many):
        settle(engine)
        with counted(db, engine) as found:
            report = engine.tick(all_succeeded, now=NOW)
        assert report.idle, report.summary()
        reads.append(found)
    # what changed only: one probe of the tasks each for the backoffs ended, the wake times come and the reminders
    # due, one of the marks for those marked by hand; neither the tasks in flight nor the marks it knows are read
    idle = {"reactive_tasks": (3, 0, 0), "reactive_marks": (1, 0, 0), "reactive_mark_batches": (0, 0, 0)}
    assert reads == [idle, idle]


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
