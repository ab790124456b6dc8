"""Time-driven reactive tasks against real Postgres and a temporary Dagster instance: a Settle that fires with no
CTL change, deadlines (their asset checks, on_deadline='run', `reactive status`) and the scheduler's tick check."""

from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner
from dagster import (
    AssetCheckEvaluation,
    AssetKey,
    DagsterInstance,
    Definitions,
    MaterializeResult,
    OpExecutionContext,
    RunRequest,
    asset,
    build_sensor_context,
    job,
    op,
)

from cmb_dagster import ReactiveOptions, ReactiveTask, health
from cmb_dagster.cli import main
from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database
from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.models import Backoff
from cmb_dagster.reactive import Deadline, ReactiveChecks, status, tick_reactive_sensor
from cmb_dagster.reactive.cli import reactive as reactive_cli
from cmb_dagster.resources import CmbResource
from cmb_dagster.triggers import All, Delay, Delta, Settle

PRICES = ("shop/prices", "loaded_until")
ORDERS = ("shop/orders", "loaded_until")


@op
def work(context: OpExecutionContext) -> None:
    context.log.info("working")


@job
def report() -> None:
    work()


@asset(key=["shop", "mart"])
def mart() -> MaterializeResult:
    return MaterializeResult()


class Location:
    """One code location's reactive scheduler and status sensor, ticked by hand at a chosen time."""

    def __init__(self, db: Database, instance: DagsterInstance, resource: CmbResource, tasks, **options) -> None:
        self.db, self.instance, self.resource = db, instance, resource
        self.store = CtlStore(db, actor="test")
        options = {"name": "test", "backoff": Backoff(first=0), **options}
        self.defs: Definitions = cmb_definitions(
            resource=resource, assets=[mart], reactive=ReactiveOptions(tasks=tasks, **options)
        )
        self.clock: datetime | None = None  # the evaluation time of the scheduler's ticks; None: the wall clock
        self.cursor: str | None = None  # the status sensor's

    def tick(self):
        return tick_reactive_sensor(self.defs, instance=self.instance, evaluation_time=self.clock)

    def requests(self) -> list[RunRequest]:
        return list(self.tick().run_requests or [])

    def execute(self, request: RunRequest) -> None:
        job_def = self.defs.resolve_job_def(request.job_name)
        assert job_def.execute_in_process(instance=self.instance, tags=request.tags).success

    def checks(self) -> dict[tuple[str, str], AssetCheckEvaluation]:
        """The asset check evaluations one tick of the status sensor records (those whose severity or, failing,
        whose text changed)."""
        context = build_sensor_context(instance=self.instance, resources={"cmb": self.resource}, cursor=self.cursor)
        result = self.defs.resolve_sensor_def("cmb_reactive_status").evaluate_tick(context)
        self.cursor = result.cursor or self.cursor
        events = result.asset_events or []
        return {(e.asset_key.to_user_string(), e.check_name): e for e in events if isinstance(e, AssetCheckEvaluation)}

    def state(self, name: str):
        return {s.name: s for s in status(self.db, "test").tasks}[name]

    def sql(self, query: str, **params) -> None:
        with self.db.connection() as conn:
            conn.execute(query, params)

    def changed_at(self, key: tuple[str, str]) -> datetime:
        with self.db.connection() as conn:
            return conn.execute(
                "SELECT updated_at FROM ctl_values WHERE entity = %s AND parameter = %s", key
            ).fetchone()[0]


# -- Settle ----------------------------------------------------------------------------------------


def test_a_settle_task_launches_once_the_quiet_time_passed_with_no_ctl_change(db, instance, resource):
    loc = Location(db, instance, resource, [ReactiveTask("mart", report, Settle(*PRICES, "15min"))])
    loc.store.set(*PRICES, datetime(2026, 11, 25, 21, tzinfo=UTC))
    changed = loc.changed_at(PRICES)
    loc.clock = changed + timedelta(minutes=12)
    assert loc.requests() == []
    waiting = loc.state("mart")
    assert waiting.wake_at == changed + timedelta(minutes=15)
    assert "has not changed for 0:12:00" in waiting.explanation and "needs 0:15:00" in waiting.explanation

    loc.clock = changed + timedelta(minutes=14)
    assert loc.requests() == [] and not loc.state("mart").dirty  # not evaluated again before its wake time

    loc.clock = changed + timedelta(minutes=15)
    [request] = loc.requests()  # woken by time alone: no CTL value changed since
    loc.execute(request)
    loc.clock += timedelta(minutes=1)
    assert loc.requests() == []
    done = loc.state("mart")
    assert done.status == "waiting" and done.wake_at is None  # the value its run saw: only a new value wakes it
    assert "the value the last run saw" in done.explanation


def test_a_settle_that_keeps_changing_does_not_launch(db, instance, resource):
    loc = Location(db, instance, resource, [ReactiveTask("mart", report, Settle(*PRICES, "15min"))])
    moment = datetime(2026, 11, 25, 21, tzinfo=UTC)
    for minutes in range(0, 40, 10):  # a load every 10 minutes
        loc.store.set(*PRICES, moment + timedelta(minutes=minutes))
        loc.clock = loc.changed_at(PRICES) + timedelta(minutes=9)
        assert loc.requests() == []
    loc.clock = loc.changed_at(PRICES) + timedelta(minutes=15)
    assert len(loc.requests()) == 1


# -- deadlines -------------------------------------------------------------------------------------


def late_prices(loc: Location) -> datetime:
    """Prices loaded until 11 hours ago, and the task's deadline defined an hour ago (so it is due already)."""
    stale = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=11)
    loc.store.set(*PRICES, stale)
    loc.tick()
    loc.sql("UPDATE reactive_tasks SET deadline_since = now() - interval '1 hour'")
    return stale


def test_a_passed_deadline_fails_the_check_of_the_target_asset_naming_what_waits_and_a_success_clears_it(
    db, instance, resource
):
    trigger = All(Delta(*ORDERS, "1h"), Delay(*PRICES, "2h"))
    loc = Location(db, instance, resource, [ReactiveTask("mart", [mart], trigger, deadline=Deadline(cron="* * * * *"))])
    loc.store.set(*ORDERS, datetime.now(UTC))
    stale = late_prices(loc)

    red = loc.checks()[("shop/mart", "deadline_mart")]
    assert not red.passed and red.severity.value == "ERROR"
    assert "reactive task mart: deadline (cron * * * * * in UTC) passed at" in red.description
    assert "without a successful run since" in red.description
    assert f"Delay(shop/prices/loaded_until, 2h) waits on shop/prices/loaded_until = {stale}, 11:00:0" in (
        red.description
    )
    assert "allowed 2:00:00" in red.description and "Delta(" not in red.description  # the Delta fires: not named
    later = loc.checks()[("shop/mart", "deadline_mart")]  # still red: recorded again with how late it is now
    assert not later.passed and later.description != red.description and "passed at" in later.description

    loc.store.set(*PRICES, datetime.now(UTC))
    [request] = loc.requests()
    loc.execute(request)
    loc.tick()
    green = loc.checks()[("shop/mart", "deadline_mart")]
    # met for this minute's deadline, or, when the minute turned since the run, the next one's time left
    assert green.passed and ("met (a successful run since" in green.description or " left (due " in green.description)


def test_a_job_without_assets_has_its_deadline_checked_on_the_reactive_tasks_asset(db, instance, resource):
    loc = Location(db, instance, resource, [ReactiveTask("report", report, Delay(*PRICES, "2h"), deadline="* * * * *")])
    late_prices(loc)
    red = loc.checks()[("reactive/tasks", "deadline_report")]
    assert not red.passed and "waits on shop/prices/loaded_until" in red.description


def test_on_deadline_run_launches_the_waiting_task_when_its_deadline_passes_and_tags_the_run(db, instance, resource):
    deadline = Deadline(after_chunk="30min", scale="hour")
    task = ReactiveTask("mart", report, Delay(*PRICES, "2h"), deadline=deadline, on_deadline="run")
    loc = Location(db, instance, resource, [task])
    stale = datetime(2026, 11, 25, 1, tzinfo=UTC)
    loc.store.set(*PRICES, stale)
    loc.sql("UPDATE ctl_values SET updated_at = %(at)s", at=datetime(2026, 11, 25, 1, tzinfo=UTC))
    loc.clock = datetime(2026, 11, 25, 12, 10, tzinfo=UTC)
    assert loc.requests() == []  # defined now: the 11:30 deadline (of 10:00-11:00) was before it
    waiting = loc.state("mart")
    assert waiting.wake_at == datetime(2026, 11, 25, 12, 30, tzinfo=UTC)  # when 11:00-12:00's deadline passes

    loc.clock = datetime(2026, 11, 25, 12, 29, tzinfo=UTC)
    assert loc.requests() == []
    loc.clock = datetime(2026, 11, 25, 12, 30, tzinfo=UTC)
    [request] = loc.requests()  # woken by its deadline: no CTL value changed
    assert request.tags["cmb/reactive.deadline"] == "2026-11-25T12:30:00+00:00"
    reason = loc.state("mart").explanation
    assert reason.startswith("deadline 30min after each hour in UTC passed at 2026-11-25 12:30:00+00:00")
    assert "launched anyway (on_deadline='run')" in reason and "Delay(shop/prices/loaded_until, 2h) waits" in reason
    loc.execute(request)
    loc.clock = datetime(2026, 11, 25, 12, 31, tzinfo=UTC)
    assert loc.requests() == []  # the run met the deadline
    [entry] = [  # the run's log says why it ran (written when the scheduler first saw it)
        e
        for r in instance.get_runs()
        for e in instance.all_logs(r.run_id)
        if "reactive task mart: launched on" in (e.message or "")
    ]
    assert "on_deadline='run'" in entry.message and stale.isoformat() in entry.message
    assert loc.state("mart").wake_at == datetime(2026, 11, 25, 13, 30, tzinfo=UTC)


def test_on_deadline_run_follows_the_next_deadline_after_one_met_in_advance(db, instance, resource):
    task = ReactiveTask("mart", report, Delta(*ORDERS, "1d"), deadline="0 * * * *", on_deadline="run")
    loc = Location(db, instance, resource, [task])
    loc.store.set(*ORDERS, datetime(2026, 11, 25, tzinfo=UTC))
    loc.clock = datetime(2026, 11, 25, 12, 10, tzinfo=UTC)
    [request] = loc.requests()  # a first run: the Delta fires
    loc.execute(request)
    loc.clock = datetime(2026, 11, 25, 12, 20, tzinfo=UTC)
    assert loc.requests() == []
    assert loc.state("mart").wake_at == datetime(2026, 11, 25, 13, 0, tzinfo=UTC)  # 13:00's is met already
    loc.clock = datetime(2026, 11, 25, 13, 0, tzinfo=UTC)
    assert loc.requests() == []
    assert loc.state("mart").wake_at == datetime(2026, 11, 25, 14, 0, tzinfo=UTC)
    loc.clock = datetime(2026, 11, 25, 14, 0, tzinfo=UTC)
    [forced] = loc.requests()
    assert forced.tags["cmb/reactive.deadline"] == "2026-11-25T14:00:00+00:00"


def test_reactive_status_shows_each_deadline_and_its_slack(db, instance, resource):
    tasks = [
        ReactiveTask("late", report, Delay(*PRICES, "2h"), deadline="* * * * *"),
        ReactiveTask("early", report, Delay(*PRICES, "2h"), deadline=Deadline(after_chunk="366d", scale="year")),
    ]
    loc = Location(db, instance, resource, tasks)
    late_prices(loc)
    shown = CliRunner().invoke(reactive_cli, ["status"], env={"CMB_DATABASE_URL": db.url, "CMB_SCHEMA": db.schema})
    assert shown.exit_code == 0, shown.output
    assert "scheduler test: last tick " in shown.output and ", took " in shown.output
    assert "  deadline (cron * * * * * in UTC): LATE, late by " in shown.output
    assert "    Delay(shop/prices/loaded_until, 2h) waits on shop/prices/loaded_until" in shown.output
    assert "  deadline (366d after each year in UTC): " in shown.output and " left (due " in shown.output


# -- the scheduler's ticks ---------------------------------------------------------------------------


def test_the_tick_check_fails_when_the_scheduler_stopped_ticking_and_passes_again_after_a_tick(db, instance, resource):
    checks = ReactiveChecks(tick_age={"warn_at": 3, "error_at": 10})
    loc = Location(db, instance, resource, [ReactiveTask("mart", report, Delta(*ORDERS, "1h"))], checks=checks)
    loc.tick()
    [ticks] = status(db, "test").schedulers
    assert ticks.name == "test" and ticks.ticked_at is not None and 0 < ticks.tick_seconds < 60
    assert loc.checks()[("reactive/tasks", "tick_age")].passed

    loc.sql("UPDATE reactive_schedulers SET ticked_at = now() - interval '45 seconds'")  # 4.5 intervals of 10 s
    warned = loc.checks()[("reactive/tasks", "tick_age")]
    assert not warned.passed and warned.severity.value == "WARN"
    loc.sql("UPDATE reactive_schedulers SET ticked_at = now() - interval '2 minutes'")
    failed = loc.checks()[("reactive/tasks", "tick_age")]
    assert not failed.passed and failed.severity.value == "ERROR"
    assert "scheduler test last ticked 0:02:0" in failed.description and "intervals of 10 s" in failed.description

    loc.tick()
    assert loc.checks()[("reactive/tasks", "tick_age")].passed


def test_two_locations_checking_the_default_tasks_asset_keep_a_tick_state_each(db, instance, resource):
    checks = ReactiveChecks(tick_age={"warn_at": 3, "error_at": 10})
    north = Location(db, instance, resource, [ReactiveTask("mart", report, Delta(*ORDERS, "1h"))], checks=checks)
    south_tasks = [ReactiveTask("other", report, Delta(*ORDERS, "1h"))]
    south = Location(db, instance, resource, south_tasks, checks=checks, name="south")
    north.tick()
    south.tick()
    south.sql("UPDATE reactive_schedulers SET ticked_at = now() - interval '2 minutes' WHERE name = 'south'")
    for _ in range(3):  # both status sensors tick in turn: neither flips the other's state
        north.checks()
        south.checks()
    by_scope = {(s.check, s.scope): s.severity for s in health.states(db) if s.asset == ("reactive", "tasks")}
    assert by_scope == {("tick_age", "test"): "ok", ("tick_age", "south"): "error"}
    moved = [(t.scope, t.previous, t.severity) for t in health.transitions(db) if t.check == "tick_age"]
    assert moved == [("south", "ok", "error")]
    shown = CliRunner().invoke(main, ["checks"], env={"CMB_DATABASE_URL": db.url, "CMB_SCHEMA": db.schema})
    assert "ERROR  reactive/tasks tick_age (south)  since " in shown.output, shown.output


@pytest.mark.parametrize("error_at", [0.5, 1e13])
def test_tick_age_limits_out_of_bounds_are_refused(error_at):
    from cmb_dagster.reactive import InvalidReactiveInput

    with pytest.raises(InvalidReactiveInput, match="tick_age"):
        ReactiveOptions(tasks=[], checks={"tick_age": {"warn_at": 1, "error_at": error_at}})


def test_the_asset_checks_are_declared_on_the_target_assets_and_the_tasks_asset(resource):
    tasks = [
        ReactiveTask("mart", [mart], Delta(*ORDERS, "1h"), deadline="0 9 * * *"),
        ReactiveTask("report", report, Delta(*ORDERS, "1h"), deadline="0 9 * * *"),
    ]
    defs = cmb_definitions(resource=resource, assets=[mart], reactive=ReactiveOptions(tasks=tasks, name="test"))
    graph = defs.resolve_asset_graph()
    declared = {(key.asset_key.to_user_string(), key.name) for key in graph.asset_check_keys}
    assert declared == {
        ("shop/mart", "deadline_mart"),
        ("reactive/tasks", "deadline_report"),
        ("reactive/tasks", "tick_age"),
        ("database/vacuum", "vacuum_horizon_seconds"),
        ("database/vacuum", "dead_rows_share"),
    }
    assert AssetKey(["shop", "mart"]) in graph.get_all_asset_keys()


def test_the_example_heartbeat_deadline_turns_red_without_a_heartbeat_and_green_after_one(db, instance, resource):
    from cmb_dagster.examples import reactive as example

    loc = Location(
        db, instance, resource, example.options.tasks, observe_interval_seconds=example.options.observe_interval_seconds
    )
    loc.tick()
    loc.sql("UPDATE reactive_tasks SET deadline_since = now() - interval '1 hour'")  # as if started an hour ago
    red = loc.checks()[("reactive/tasks", "deadline_heartbeat_report")]
    assert not red.passed and "demo/heartbeat/sent_at: no value yet" in red.description

    loc.store.set(*example.HEARTBEAT, datetime.now(UTC))  # cmb-dagster ctl set demo/heartbeat sent_at <now>
    loc.clock = loc.changed_at(example.HEARTBEAT) + timedelta(seconds=10)
    [request] = loc.requests()
    loc.execute(request)
    loc.tick()
    assert loc.checks()[("reactive/tasks", "deadline_heartbeat_report")].passed
