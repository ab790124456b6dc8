"""Isolation of a bad item in the reactive scheduler and the CTL store: a task's bad, slow or huge user code
affects only that task, and bad CTL input is refused before it reaches Postgres."""

import os
import signal
import sys
import threading
import time
import warnings
from datetime import UTC, datetime, timedelta, timezone

import psutil
import psycopg
import pytest
from click.testing import CliRunner
from dagster import OpExecutionContext, job, op

from cmb_dagster import ReactiveOptions, ReactiveTask, cmb_definitions, pubsub
from cmb_dagster.ctl import CTL_BRANCH_ID, CtlStore, InvalidCtlInput
from cmb_dagster.ctl.cli import ctl as ctl_cli
from cmb_dagster.ctl.store import CTL_TOPIC
from cmb_dagster.database import Database
from cmb_dagster.models import Backoff
from cmb_dagster.reactive import InvalidReactiveInput, ReactiveTriggerWarning, status, tick_reactive_sensor
from cmb_dagster.reactive.engine import TaskScheduler
from cmb_dagster.reactive.models import RunInfo, RunState, SchedulerSettings, TaskSpec
from cmb_dagster.triggers import Delta

T0 = datetime(2024, 5, 1, tzinfo=UTC)
NOW = T0 + timedelta(hours=2)
KEY = ("shop/orders", "loaded_until")
BACKOFF = timedelta(minutes=1)
RETRIES = Backoff(first=BACKOFF.total_seconds(), max=3600)


def no_runs(scheduler, run_keys):
    return {}


def engine(db: Database, names, **kwargs) -> TaskScheduler:
    settings = SchedulerSettings(backoff=RETRIES, **kwargs.pop("settings", {}))
    specs = [TaskSpec(name=name, trigger=Delta(*KEY, "1h")) for name in names]
    return TaskScheduler(db, "iso", specs, settings, **kwargs)


def states(db: Database, scheduler: str = "iso"):
    return {s.name: s for s in status(db, scheduler).tasks}


def assert_backs_off(db: Database, name: str, error: str) -> None:
    state = states(db)[name]
    assert state.status == "backoff" and state.backoff_until == NOW + BACKOFF, state
    assert state.explanation.startswith("error: ") and error in state.explanation, state.explanation


# -- 1. error text of user code is sanitised before it is stored -----------------------------------


def test_a_run_config_error_with_nul_and_a_lone_surrogate_backs_off_its_task_alone(db):
    def broken(values):
        raise ValueError("bad \x00 and \udc80")

    scheduler = engine(db, ["bad", "good"], launch_options={"bad": broken})
    CtlStore(db).set(*KEY, T0)
    report = scheduler.tick(no_runs, now=NOW)
    assert [launch.task for launch in report.launches] == ["good"]
    assert_backs_off(db, "bad", "its run config or tags raised ValueError: bad \\0 and \ufffd")
    assert scheduler.tick(no_runs, now=NOW).launches == []  # backing off


def test_a_partition_key_or_run_config_that_cannot_be_stored_or_sent_fails_only_its_task(db):
    partitioners = {
        "nul_key": lambda values, last: ("2024-05\x00", dict(values)),
        "naive_value": lambda values, last: ("2024-05", {KEY: datetime(2024, 5, 1)}),
    }
    options = {
        "object_config": lambda values: ({"ops": {"x": object()}}, {}),
        "huge_tags": lambda values: (None, {"t": "x" * 5_000_000}),
        "unpicklable": lambda values: ({"ops": {"x": lambda: 1}}, {}),
    }
    scheduler = engine(db, [*partitioners, *options, "good"], partitioners=partitioners, launch_options=options)
    CtlStore(db).set(*KEY, T0)
    report = scheduler.tick(no_runs, now=NOW)
    assert [launch.task for launch in report.launches] == ["good"]
    assert_backs_off(db, "nul_key", "choosing the partition returned an unusable result: InvalidInput: partition key")
    assert_backs_off(db, "naive_value", "choosing the partition returned an unusable result")
    assert_backs_off(db, "object_config", "its run config or tags returned an unusable result")
    assert_backs_off(db, "huge_tags", "bytes as JSON, at most")
    assert_backs_off(db, "unpicklable", "its run config or tags returned an unusable result: it cannot be pickled")


def test_a_change_event_published_by_hand_without_entity_does_not_stop_the_tick(db):
    scheduler = engine(db, ["good"])
    scheduler.tick(no_runs, now=NOW)
    with db.connection() as conn:
        pubsub.publish(
            CTL_BRANCH_ID, {"changes": [{"entity": 1}, "nonsense"]}, topic=CTL_TOPIC, schema=db.schema, conn=conn
        )
        pubsub.publish(CTL_BRANCH_ID, {"no changes": True}, topic=CTL_TOPIC, schema=db.schema, conn=conn)
    CtlStore(db).set(*KEY, T0)
    assert [launch.task for launch in scheduler.tick(no_runs, now=NOW).launches] == ["good"]


def test_names_a_trigger_reads_are_refused_when_ctl_could_not_store_them():
    for entity, problem in (("shop\x00", "U\\+0000"), ("shop\udc80", "surrogate"), ("s" * 201, "201 characters")):
        with pytest.raises(InvalidReactiveInput, match=f"entity: .*{problem}"):
            ReactiveTask("t", plain, Delta(entity, "loaded_until", "1h"))
        with pytest.raises(ValueError, match=f"entity: .*{problem}"):
            TaskSpec(name="t", trigger=Delta(entity, "loaded_until", "1h"))


# -- 2. user code runs under a deadline, outside any transaction -----------------------------------


def returned_within(timeout: float, call):
    """What ``call`` returned, run in a thread; fails if it still runs after ``timeout`` seconds."""
    returned: list = []
    thread = threading.Thread(target=lambda: returned.append(call()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert returned, f"still running after {timeout} s"
    return returned[0]


def test_a_callable_that_never_returns_times_out_and_backs_off_its_task_alone(db, instance, resource):
    def stuck(values):
        time.sleep(3600)
        return {}

    tasks = [
        ReactiveTask("stuck", plain, Delta(*KEY, "1h"), run_config=stuck),
        ReactiveTask("good", plain, Delta(*KEY, "1h")),
    ]
    location = Location(db, instance, resource, tasks, callable_timeout=0.5)
    CtlStore(db).set(*KEY, T0)
    result = returned_within(60, location.tick)  # not after the hour the callable would take
    assert [r.tags["cmb/reactive.task"] for r in result.run_requests] == ["good"]
    state = location.state("stuck")
    assert state.status == "backoff" and state.backoff_until == NOW + BACKOFF
    assert "its run config or tags raised TimedOut: killed at its 0.5 s limit" in state.explanation


def test_a_tick_starts_no_user_code_after_its_time_box_and_one_timeout(db, tmp_path):
    calls = tmp_path / "calls"  # a line per call (each runs in a process of its own)

    def stuck(values):
        with calls.open("a") as out:
            out.write("called\n")
        time.sleep(3600)
        return None, {}

    options = {"stuck_a": stuck, "stuck_b": stuck}
    scheduler = engine(
        db, ["stuck_a", "stuck_b"], launch_options=options, settings={"tick_seconds": 0.01, "callable_timeout": 0.5}
    )
    CtlStore(db).set(*KEY, T0)
    report = returned_within(60, lambda: scheduler.tick(no_runs, now=NOW))  # not after the hour of a call
    assert calls.read_text().count("called") == 1
    assert report.launches == [] and not report.complete
    assert states(db)["stuck_b"].status == "ready"  # left for the next tick
    assert_backs_off(db, "stuck_a", "raised TimedOut: killed at its 0.5 s limit")
    scheduler.tick(no_runs, now=NOW)
    assert calls.read_text().count("called") == 2
    assert_backs_off(db, "stuck_b", "raised TimedOut: killed at its 0.5 s limit")


def test_user_code_runs_while_the_tick_holds_no_transaction_open(db, tmp_path):
    seen = tmp_path / "seen"  # written by the call's process

    def options(values):
        with psycopg.connect(db.url, autocommit=True) as conn:
            idle_in_transaction = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()"
            ).fetchone()[0]
        seen.write_text(str(idle_in_transaction))
        return None, {}

    scheduler = engine(db, ["good"], launch_options={"good": options})
    CtlStore(db).set(*KEY, T0)
    assert [launch.task for launch in scheduler.tick(no_runs, now=NOW).launches] == ["good"]
    assert seen.read_text() == "0"


def all_succeeded(scheduler, run_keys):
    return {key: RunInfo(f"run-{key}", RunState.SUCCESS) for key in run_keys}


def hang(values):
    threading.Event().wait()


def test_a_callable_that_hangs_ten_ticks_in_a_row_leaves_no_thread_and_no_process_behind(db):
    specs = [TaskSpec(name=name, trigger=Delta(*KEY, "1h")) for name in ("hangs", "good")]
    settings = SchedulerSettings(backoff=RETRIES, callable_timeout=0.5)
    scheduler = TaskScheduler(db, "hanging", specs, settings, launch_options={"hangs": hang})
    threads, children = set(threading.enumerate()), set(psutil.Process().children(recursive=True))
    started_by_first = None
    for tick in range(10):
        CtlStore(db).set(*KEY, T0 + timedelta(hours=2 * tick))  # new data: both tasks fire again
        report = scheduler.tick(all_succeeded, now=NOW + timedelta(days=tick))  # past the last backoff
        assert [launch.task for launch in report.launches] == ["good"]
        hangs = states(db, "hanging")["hangs"]
        assert hangs.status == "backoff" and "raised TimedOut: killed at its 0.5 s limit" in hangs.explanation
        assert scheduler.executor.running == []
        assert set(psutil.Process().children(recursive=True)) == children
        started = set(threading.enumerate()) - threads
        started_by_first = started_by_first or started
        assert started == started_by_first  # nothing piles up, tick after tick
    # the threads of user code the first tick started wait idle for the next call (they exit after a minute without
    # one): one for the scheduler's calls, one for its CTL consumer's
    assert sorted(t.name for t in started_by_first if t.name.startswith("cmb-user-code")) == [
        f"cmb-user-code:pubsub:reactive.hanging@{CTL_BRANCH_ID}",
        "cmb-user-code:reactive:hanging",
    ]


def test_run_config_and_tags_given_as_mappings_start_no_process(db, instance, resource):
    config = {"ops": {"work": {"config": {}}}}
    tasks = [ReactiveTask("fixed", plain, Delta(*KEY, "1h"), run_config=config, tags={"team": "ops"})]
    location = Location(db, instance, resource, tasks, name="fixed_options")
    CtlStore(db).set(*KEY, T0)
    [request] = location.tick().run_requests
    assert request.run_config == config and request.tags["team"] == "ops"
    assert "cmb-user-code:reactive:fixed_options" not in {t.name for t in threading.enumerate()}  # no call ran


@pytest.mark.parametrize(
    ("ending", "error"),
    [
        ("sys.exit", "its run config or tags raised SystemExit: 3"),
        ("os._exit", "its run config or tags raised ChildDied: its process ended without an answer (exit code 3)"),
        ("SIGKILL", "its run config or tags raised ChildDied: its process ended without an answer (killed by SIGKILL)"),
        ("partition sys.exit", "choosing the partition raised SystemExit: 3"),
    ],
)
def test_a_callable_that_exits_fails_its_task_only(db, ending, error):
    def ends(*args):
        if ending.endswith("sys.exit"):
            sys.exit(3)
        if ending == "os._exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)

    if ending.startswith("partition"):
        scheduler = engine(db, ["ends", "good"], partitioners={"ends": ends})
    else:
        scheduler = engine(db, ["ends", "good"], launch_options={"ends": ends})
    CtlStore(db).set(*KEY, T0)
    report = scheduler.tick(no_runs, now=NOW)
    assert [launch.task for launch in report.launches] == ["good"]
    assert_backs_off(db, "ends", error)  # an error of its call: no crash of the scheduler counted


# -- 3. bad input of the CTL API --------------------------------------------------------------------

BAD_INPUT = [
    (("sa\x00les", "loaded_until", T0), "entity", "U\\+0000"),
    (("sales", "loaded\udc80", T0), "parameter", "lone surrogate"),
    (("s" * 1_000_000, "loaded_until", T0), "entity", "1000000 characters, at most 200"),
    (("sales", "p" * 201, T0), "parameter", "201 characters, at most 200"),
    (("sales", "loaded_until", datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))), "value", "between"),
    (("sales", "loaded_until", datetime(1, 1, 1, tzinfo=UTC)), "value", "between"),
]


@pytest.mark.parametrize(("arguments", "field", "problem"), BAD_INPUT)
def test_bad_ctl_input_is_refused_naming_the_field_and_the_callers_transaction_goes_on(db, arguments, field, problem):
    store = CtlStore(db)
    with db.connection() as conn:
        conn.execute("CREATE TABLE public.orders (id int)")
    with db.connection() as conn:
        conn.execute("INSERT INTO public.orders VALUES (1)")
        with pytest.raises(InvalidCtlInput, match=rf"\b{field}: .*{problem}") as refused:
            store.set(*arguments, conn=conn)
        assert len(str(refused.value)) < 300
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        conn.execute("INSERT INTO public.orders VALUES (2)")
        store.set("sales", "loaded_until", T0, conn=conn)
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM public.orders").fetchone()[0] == 2
    assert [(c.entity, c.parameter) for c in store.history()] == [("sales", "loaded_until")]


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        (["x" * 100_000, "loaded_until", "2024-05-01T00:00:00+00:00"], "entity"),
        (["sales", "loaded\udc80", "2024-05-01T00:00:00+00:00"], "parameter"),
        (["sales", "loaded_until", "9" * 100_000], "value"),
    ],
)
def test_the_ctl_cli_refuses_bad_input_in_a_short_message_naming_the_field(db, arguments, field):
    result = CliRunner().invoke(ctl_cli, ["set", *arguments], env={"CMB_DATABASE_URL": db.url, "CMB_SCHEMA": db.schema})
    assert isinstance(result.exception, InvalidCtlInput), result.output
    assert str(result.exception).count(f"{field}: ") == 1 and len(str(result.exception)) < 300
    assert CtlStore(db).history() == []


# -- the Dagster side -----------------------------------------------------------------------------


@op
def work(context: OpExecutionContext) -> None:
    pass


@job
def plain() -> None:
    work()


class Location:
    """A code location's reactive tasks under scheduler name ``iso``, ticked by hand at :data:`NOW`."""

    def __init__(self, db, instance, resource, tasks, name="iso", **options) -> None:
        self.db, self.instance, self.name = db, instance, name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReactiveTriggerWarning)
            self.defs = cmb_definitions(
                resource=resource,
                reactive=ReactiveOptions(tasks=tasks, name=name, backoff=RETRIES, **options),
            )

    def tick(self):
        return tick_reactive_sensor(self.defs, instance=self.instance, evaluation_time=NOW)

    def state(self, task: str):
        return states(self.db, self.name)[task]
