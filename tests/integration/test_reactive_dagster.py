"""Reactive tasks that speak Dagster: partitions, run config and tags, manual recovery, asset-sourced CTL,
lineage from the asset graph, warnings users see, and scheduler names owned by one code location."""

import logging
import warnings
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner
from dagster import (
    AssetExecutionContext,
    DagsterRunStatus,
    DailyPartitionsDefinition,
    MaterializeResult,
    MonthlyPartitionsDefinition,
    OpExecutionContext,
    RunRequest,
    asset,
    instance_for_test,
    job,
    materialize,
    op,
)

from cmb_dagster import ReactiveOptions, ReactiveTask, cmb_definitions, ctl_metadata, launched_values
from cmb_dagster.ctl import CtlStore
from cmb_dagster.models import Backoff
from cmb_dagster.reactive import (
    InvalidReactiveInput,
    ReactiveTriggerWarning,
    SchedulerConflict,
    set_last_value,
    status,
    tick_reactive_sensor,
)
from cmb_dagster.reactive.cli import reactive as reactive_cli
from cmb_dagster.reactive.engine import TaskScheduler
from cmb_dagster.triggers import ChunkDelta, Delay, Delta, param

ORDERS = ("shop/orders", "loaded_until")
MONTHLY = MonthlyPartitionsDefinition("2024-01-01")
DAILY = DailyPartitionsDefinition("2024-01-01")
SEEN: list[tuple[str, str | None]] = []  # (asset, partition) materialized by the targets below


@asset(key=["shop", "monthly_mart"], partitions_def=MONTHLY)
def monthly_mart(context: AssetExecutionContext) -> None:
    SEEN.append(("monthly", context.partition_key))


@asset(key=["shop", "daily_mart"], partitions_def=DAILY)
def daily_mart(context: AssetExecutionContext) -> None:
    SEEN.append(("daily", context.partition_key))


@op
def work(context: OpExecutionContext) -> None:
    SEEN.append(("op", context.run.tags.get("team")))


@job
def plain() -> None:
    work()


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _clear_seen() -> None:
    SEEN.clear()


class Location:
    """A code location's definitions, ticked by hand at a time the test sets."""

    def __init__(self, db, instance, resource, tasks, *, assets=(), name="test", location=None, **options) -> None:
        self.db, self.instance, self.resource = db, instance, resource
        self.store = CtlStore(db, actor="test")
        self.name = name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReactiveTriggerWarning)
            self.defs = cmb_definitions(
                resource=resource,
                assets=list(assets),
                reactive=ReactiveOptions(tasks=tasks, name=name, **{"backoff": Backoff(first=0), **options}),
            )
        self.clock = datetime.now(UTC)

    def tick(self):
        return tick_reactive_sensor(self.defs, instance=self.instance, evaluation_time=self.clock)

    def requests(self) -> list[RunRequest]:
        return list(self.tick().run_requests or [])

    def run(self, request: RunRequest) -> bool:
        job_def = self.defs.resolve_job_def(request.job_name)
        result = job_def.execute_in_process(
            instance=self.instance,
            tags=request.tags,
            partition_key=request.partition_key,
            run_config=request.run_config or None,
            raise_on_error=False,
        )
        return result.success

    def state(self, task: str):
        return {s.name: s for s in status(self.db, self.name).tasks}[task]


def drain(location: Location) -> list[RunRequest]:
    """Tick and run each requested run until nothing more is requested; return the requests in order."""
    done = []
    for _ in range(20):
        requests = location.requests()
        if not requests:
            location.tick()  # the last run's success is committed
            if not location.requests():
                return done
            continue
        for request in requests:
            assert location.run(request)
            done.append(request)
    raise AssertionError(f"still requesting after {len(done)} runs")


# -- partitions --------------------------------------------------------------------------------


def test_a_monthly_partitioned_asset_gets_each_new_month_in_order_committed_per_partition(db, instance, resource):
    task = ReactiveTask("monthly", [monthly_mart], ChunkDelta(*ORDERS, "month"), partition=ORDERS)
    loc = Location(db, instance, resource, [task], assets=[monthly_mart])
    loc.store.set(*ORDERS, utc(2024, 1, 20))
    [first] = loc.requests()
    assert first.partition_key == "2024-01-01"  # first run: the month holding the newest data
    assert loc.run(first)
    loc.tick()
    assert loc.state("monthly").last_values == {"shop/orders": {"loaded_until": "2024-01-20T00:00:00+00:00"}}

    loc.store.set(*ORDERS, utc(2024, 4, 2))  # January's end, February and March arrived at once
    requests = drain(loc)
    assert [r.partition_key for r in requests] == ["2024-01-01", "2024-02-01", "2024-03-01"]
    months = [utc(2024, 2, 1), utc(2024, 3, 1), utc(2024, 4, 1)]
    assert [launched_values(r.tags, resource)[ORDERS] for r in requests] == months
    assert SEEN == [
        ("monthly", "2024-01-01"),
        ("monthly", "2024-01-01"),
        ("monthly", "2024-02-01"),
        ("monthly", "2024-03-01"),
    ]
    state = loc.state("monthly")
    assert state.last_values == {"shop/orders": {"loaded_until": "2024-04-01T00:00:00+00:00"}}
    assert state.status == "waiting"  # April is not complete: its month chunk has not changed


def test_a_daily_partitioned_asset_gets_one_run_per_new_day_and_a_failure_stops_the_later_days(db, instance, resource):
    task = ReactiveTask("daily", [daily_mart], Delta(*ORDERS, "1h"), partition=ORDERS)
    loc = Location(db, instance, resource, [task], assets=[daily_mart])
    loc.store.set(*ORDERS, utc(2024, 3, 1))
    [first] = loc.requests()
    assert first.partition_key == "2024-02-29"
    assert loc.run(first)
    loc.store.set(*ORDERS, utc(2024, 3, 3, 12))
    requests = drain(loc)
    assert [r.partition_key for r in requests] == ["2024-03-01", "2024-03-02", "2024-03-03"]
    # the partial day, up to the value
    assert launched_values(requests[-1].tags, resource)[ORDERS] == utc(2024, 3, 3, 12)
    assert loc.state("daily").last_values == {"shop/orders": {"loaded_until": "2024-03-03T12:00:00+00:00"}}


def test_a_partition_callable_picks_the_key_and_run_config_and_tags_follow_the_values(db, instance, resource):
    task = ReactiveTask(
        "daily",
        [daily_mart],
        Delta(*ORDERS, "1h"),
        partition=lambda values: values[ORDERS].strftime("%Y-%m-%d"),
        tags=lambda values: {"team": "shop", "cmb/reactive.task": "not overridden"},
    )
    op_task = ReactiveTask(
        "plain", plain, Delta(*ORDERS, "1h"), tags={"team": "ops"}, run_config={"ops": {"work": {"config": {}}}}
    )
    loc = Location(db, instance, resource, [task, op_task], assets=[daily_mart])
    loc.store.set(*ORDERS, utc(2024, 3, 5, 6))
    by_task = {r.tags["cmb/reactive.task"]: r for r in loc.requests()}
    assert by_task["daily"].partition_key == "2024-03-05" and by_task["daily"].tags["team"] == "shop"
    assert by_task["plain"].partition_key is None and by_task["plain"].tags["team"] == "ops"
    assert by_task["plain"].run_config == {"ops": {"work": {"config": {}}}}
    assert loc.run(by_task["plain"]) and SEEN == [("op", "ops")]


def test_a_failing_tags_run_config_or_partition_callable_backs_off_that_task_alone(db, instance, resource, capfd):
    broken = {"tags", "run_config", "partition"}

    def fails(what: str, result):
        def call(values):
            if what in broken:
                raise RuntimeError(f"no {what} today")
            return result(values)

        return call

    tasks = [
        ReactiveTask("bad_tags", plain, Delta(*ORDERS, "1h"), tags=fails("tags", lambda v: {"team": "shop"})),
        ReactiveTask("bad_config", plain, Delta(*ORDERS, "1h"), run_config=fails("run_config", lambda v: {})),
        ReactiveTask(
            "bad_partition",
            [daily_mart],
            Delta(*ORDERS, "1h"),
            partition=fails("partition", lambda v: v[ORDERS].strftime("%Y-%m-%d")),
        ),
        ReactiveTask("good", plain, Delta(*ORDERS, "1h")),
    ]
    loc = Location(db, instance, resource, tasks, assets=[daily_mart], backoff=Backoff(first=60, max=3600))
    loc.store.set(*ORDERS, utc(2024, 3, 5, 6))
    assert [r.tags["cmb/reactive.task"] for r in loc.requests()] == ["good"]
    logged = capfd.readouterr().err
    for name, what in (
        ("bad_tags", "run config or tags"),
        ("bad_config", "run config or tags"),
        ("bad_partition", "choosing the partition"),
    ):
        state = loc.state(name)
        assert state.status == "backoff" and state.explanation.startswith("error: ")
        assert f"{what} raised RuntimeError" in state.explanation and "retry after 0:01:00" in state.explanation
        assert f"{name}: error - error: " in logged
    shown = CliRunner().invoke(
        reactive_cli, ["status", "test", "bad_tags"], env={"CMB_DATABASE_URL": db.url, "CMB_SCHEMA": db.schema}
    )
    assert shown.exit_code == 0 and "no tags today" in shown.output, shown.output

    broken.clear()
    assert loc.requests() == []  # backing off
    loc.clock += timedelta(minutes=1)
    again = {r.tags["cmb/reactive.task"]: r for r in loc.requests()}
    assert sorted(again) == ["bad_config", "bad_partition", "bad_tags"]
    assert again["bad_tags"].tags["team"] == "shop" and again["bad_partition"].partition_key == "2024-03-05"


# -- manual recovery -----------------------------------------------------------------------------


def test_set_last_into_the_past_makes_a_delta_task_fire_again_after_a_backwards_move(db, instance, resource):
    loc = Location(db, instance, resource, [ReactiveTask("mart", plain, Delta(*ORDERS, "1d"))])
    loc.store.set(*ORDERS, utc(2024, 5, 10))
    [request] = loc.requests()
    assert loc.run(request)
    loc.tick()
    loc.store.set(*ORDERS, utc(2024, 5, 1))  # reloaded from the 1st: CTL moved backwards
    loc.store.set(*ORDERS, utc(2024, 5, 3))
    assert loc.requests() == []
    assert "moved backwards" in loc.state("mart").backwards_note and "set-last" in loc.state("mart").backwards_note

    result = CliRunner().invoke(
        reactive_cli,
        ["set-last", "test", "mart", "--parameter", *ORDERS, "--value", "2024-05-01T00:00:00+00:00"],
        env={"CMB_DATABASE_URL": db.url, "CMB_SCHEMA": db.schema},
    )
    assert result.exit_code == 0, result.output
    [again] = loc.requests()
    assert launched_values(again.tags, resource) == {ORDERS: utc(2024, 5, 3)}
    assert "2024-05-01" in loc.state("mart").explanation
    assert set_last_value(db, "test", "nope", ORDERS, utc(2024, 1, 1)) is None
    bad = CliRunner().invoke(
        reactive_cli,
        ["set-last", "test", "mart", "--parameter", *ORDERS, "--value", "2024-05-01"],
        env={"CMB_DATABASE_URL": db.url, "CMB_SCHEMA": db.schema},
    )
    assert bad.exit_code != 0 and "no UTC offset" in bad.output


def test_a_hand_launched_run_with_the_task_tag_records_the_values_it_started_on(db, instance, resource):
    loc = Location(db, instance, resource, [ReactiveTask("mart", plain, Delay(*ORDERS, "30d"))])
    loc.store.set(*ORDERS, utc(2024, 5, 10))
    loc.clock = utc(2024, 5, 11)
    [request] = loc.requests()
    assert loc.run(request)
    loc.tick()
    loc.store.set(*ORDERS, utc(2024, 5, 2))  # moved backwards; the seed: a manual run records the state
    manual = plain.execute_in_process(instance=instance, tags={"cmb/reactive.task": "mart"})
    loc.store.set(*ORDERS, utc(2024, 5, 4))  # a change after the manual run started: not part of it
    loc.tick()
    state = loc.state("mart")
    assert state.last_values == {"shop/orders": {"loaded_until": "2024-05-02T00:00:00+00:00"}}
    assert manual.success
    loc.tick()  # read again (the overlap): still recorded once
    with db.connection() as conn:
        rows = conn.execute("SELECT run_key, manual FROM reactive_launches WHERE manual").fetchall()
    assert rows == [(f"manual:{manual.run_id}", True)]


# -- asset-sourced CTL -----------------------------------------------------------------------------


@asset(key=["shop", "orders"], partitions_def=DAILY)
def orders_loader(context: AssetExecutionContext) -> MaterializeResult:
    window = context.partition_time_window
    return MaterializeResult(metadata=ctl_metadata(loaded_until=window.end))


def test_a_backfill_never_moves_asset_sourced_ctl_backwards_and_downstream_delta_keeps_firing(db, instance, resource):
    loc = Location(db, instance, resource, [ReactiveTask("mart", plain, Delta(*ORDERS, "1h"))], assets=[orders_loader])
    assert materialize([orders_loader], instance=instance, partition_key="2024-03-10").success
    [first] = loc.requests()
    assert launched_values(first.tags, resource) == {ORDERS: utc(2024, 3, 11)}
    assert loc.run(first)
    for day in range(1, 5):  # a backfill of older days, after the newest one
        assert materialize([orders_loader], instance=instance, partition_key=f"2024-03-0{day}").success
    assert loc.requests() == []
    assert loc.store.get(*ORDERS) == utc(2024, 3, 11)
    assert not loc.store.history(*ORDERS, backwards_only=True)
    assert materialize([orders_loader], instance=instance, partition_key="2024-03-11").success
    [second] = loc.requests()  # new data still fires the Delta task downstream
    assert launched_values(second.tags, resource) == {ORDERS: utc(2024, 3, 12)}


def test_mode_set_writes_a_backwards_value_and_flags_it(db, instance, resource):
    @asset(key=["shop", "orders"])
    def restated() -> MaterializeResult:
        return MaterializeResult(metadata=ctl_metadata(loaded_until=utc(2024, 1, 1), mode="set"))

    loc = Location(db, instance, resource, [ReactiveTask("mart", plain, Delta(*ORDERS, "1h"))])
    loc.store.set(*ORDERS, utc(2024, 6, 1))
    assert materialize([restated], instance=instance).success
    loc.tick()
    assert loc.store.get(*ORDERS) == utc(2024, 1, 1)
    assert [c.backwards for c in loc.store.history(*ORDERS, backwards_only=True)] == [True]


def test_a_fresh_dagster_instance_with_an_existing_cmb_schema_still_feeds_ctl(db, resource, caplog):
    @asset(key=["shop", "orders"])
    def orders(context: AssetExecutionContext) -> MaterializeResult:
        return MaterializeResult(metadata=ctl_metadata(loaded_until=utc(2024, 2, int(context.run.tags["day"]))))

    with instance_for_test() as old:
        loc = Location(db, old, resource, [ReactiveTask("mart", plain, Delta(*ORDERS, "1h"))])
        for day in range(1, 8):  # the old storage's positions run ahead of a new one's
            assert materialize([orders], instance=old, tags={"day": str(day)}).success
        loc.tick()
        assert loc.store.get(*ORDERS) == utc(2024, 2, 7)
    with instance_for_test() as fresh:  # a reset dev database: storage ids start again
        loc.instance = fresh
        assert materialize([orders], instance=fresh, tags={"day": "9"}).success
        with caplog.at_level(logging.WARNING, logger="cmb_dagster.ctl"):
            loc.tick()
        assert loc.store.get(*ORDERS) == utc(2024, 2, 9)
        assert [r.message for r in caplog.records if "reading it from its beginning" in r.message]
        caplog.clear()
        assert materialize([orders], instance=fresh, tags={"day": "10"}).success
        with caplog.at_level(logging.WARNING, logger="cmb_dagster.ctl"):
            loc.tick()
        assert loc.store.get(*ORDERS) == utc(2024, 2, 10)
        assert not [r for r in caplog.records if "beginning" in r.message]  # said once


# -- lineage and the hold ------------------------------------------------------------------------


@asset(key=["shop", "raw"])
def raw() -> None:
    pass


@asset(key=["shop", "important"], deps=[raw])
def important() -> None:
    pass


@asset(key=["shop", "minor"])
def minor() -> None:
    pass


RAW = ("shop/raw", "loaded_until")


def test_a_run_materializing_an_upstream_asset_holds_lower_priority_tasks(db, instance, resource):
    tasks = [
        ReactiveTask("important", [important], param(raw.key).advanced_by("1h"), priority=10),
        ReactiveTask("minor", [minor], Delta("shop/other", "loaded_until", "1h"), priority=1),
    ]
    loc = Location(db, instance, resource, tasks, assets=[raw, important, minor])
    loc.store.set(*RAW, utc(2024, 1, 1))
    [first] = loc.requests()
    assert loc.run(first)
    loc.tick()  # important waits for new raw data
    # a scheduled (not reactive) run of the upstream loader is queued
    run = instance.create_run_for_job(
        loc.defs.resolve_job_def("cmb_reactive_important"),
        asset_selection=frozenset({raw.key}),
        status=DagsterRunStatus.STARTED,
    )
    loc.store.set("shop/other", "loaded_until", utc(2024, 1, 1))
    result = loc.tick()
    assert not result.run_requests
    assert f"run {run.run_id}" in result.skip_message and "materializes shop/raw" in result.skip_message
    assert loc.state("minor").status == "ready"
    instance.report_run_canceled(run)
    [minor_request] = loc.requests()
    assert minor_request.tags["cmb/reactive.task"] == "minor"


# -- warnings and names ----------------------------------------------------------------------------


def test_check_findings_warn_at_load_and_on_the_first_tick(db, instance, resource, capfd):
    options = ReactiveOptions(tasks=[ReactiveTask("fresh", plain, Delay(*ORDERS, "1h"))], name="test")
    with pytest.warns(ReactiveTriggerWarning, match="reactive task 'fresh'.*runs again whenever any value"):
        defs = cmb_definitions(resource=resource, reactive=options)
    capfd.readouterr()
    tick_reactive_sensor(defs, instance=instance)  # the sensor's log (the tick's log in the UI)
    first = capfd.readouterr().err
    assert "WARNING - reactive task 'fresh': Delay(" in first and "runs again whenever any value" in first
    tick_reactive_sensor(defs, instance=instance)
    assert "reactive task 'fresh'" not in capfd.readouterr().err  # the first tick only


def test_a_partitioned_target_without_a_partition_mapping_is_refused_naming_the_task(resource):
    with pytest.raises(InvalidReactiveInput, match="reactive task 'monthly': its target is partitioned"):
        cmb_definitions(
            resource=resource,
            assets=[monthly_mart],
            reactive=ReactiveOptions(tasks=[ReactiveTask("monthly", [monthly_mart], Delta(*ORDERS, "1h"))]),
        )
    with pytest.raises(InvalidReactiveInput, match="partition shop/other/loaded_until is not read by the trigger"):
        ReactiveTask("monthly", [monthly_mart], Delta(*ORDERS, "1h"), partition=("shop/other", "loaded_until"))


def test_two_locations_whose_names_normalise_alike_with_other_tasks_do_not_fight(db):
    """'team a' and 'team_a' both become scheduler 'team_a': the second refuses instead of rewriting the first."""
    first = TaskScheduler(db, "team_a", [ReactiveTask("a", plain, Delta(*ORDERS, "1h")).spec], location="team a")
    second = TaskScheduler(db, "team_a", [ReactiveTask("b", plain, Delta(*ORDERS, "1h")).spec], location="team_a")
    first.tick(lambda s, keys: {})
    with pytest.raises(SchedulerConflict, match="used by code location 'team a' with other tasks.*refuses to tick"):
        second.tick(lambda s, keys: {})
    assert {s.name: s.defined for s in status(db, "team_a").tasks} == {"a": True}  # nothing rewritten
    first.tick(lambda s, keys: {})  # the owner keeps ticking
    same = TaskScheduler(db, "team_a", [ReactiveTask("a", plain, Delta(*ORDERS, "1h")).spec], location="team_a")
    same.tick(lambda s, keys: {})  # the same tasks from another location: a copy, allowed
    later = datetime.now(UTC) + timedelta(minutes=11)
    second.tick(lambda s, keys: {}, now=later)  # the owner has been silent past takeover_after: renamed, taken over
    assert {s.name: s.defined for s in status(db, "team_a").tasks} == {"a": False, "b": True}


def test_a_location_with_no_state_warns_when_another_scheduler_name_has_state(db, instance, resource):
    old = Location(db, instance, resource, [ReactiveTask("mart", plain, Delta(*ORDERS, "1h"))], name="old_name")
    old.store.set(*ORDERS, utc(2024, 1, 1))
    [request] = old.requests()
    assert old.run(request)
    old.tick()
    engine = TaskScheduler(db, "new_name", [t.spec for t in [ReactiveTask("mart", plain, Delta(*ORDERS, "1h"))]])
    report = engine.tick(lambda s, keys: {})
    assert any("'old_name' (1 task(s))" in w and "ReactiveOptions(name=...)" in w for w in report.warnings)
    assert not engine.tick(lambda s, keys: {}).warnings  # said once, when the state is created


def test_the_sensor_logs_a_scheduler_name_warning_once_across_ticks(db, instance, resource, capfd):
    """A location refused by another's scheduler name, and one starting with no state while another name has some:
    each warning is in the first tick's log only (the refused location's tick keeps failing)."""
    from dagster import SensorEvaluationContext
    from dagster._core.remote_origin import RegisteredCodeLocationOrigin  # Dagster has no public name for it

    from cmb_dagster.reactive.dagster_testing import reactive_sensor

    def tick(defs, location: str) -> str:
        context = SensorEvaluationContext(
            instance_ref=None,
            instance=instance,
            resources={"cmb": resource},
            definitions=defs,
            code_location_origin=RegisteredCodeLocationOrigin(location),
        )
        capfd.readouterr()
        try:
            reactive_sensor(defs).evaluate_tick(context)
        except Exception as exc:  # noqa: BLE001 - the refused location's tick fails with the conflict
            assert "refuses to tick" in str(exc)
        return capfd.readouterr().err

    def defs_of(task: str):
        options = ReactiveOptions(tasks=[ReactiveTask(task, plain, Delta(*ORDERS, "1h"))])
        return cmb_definitions(resource=resource, reactive=options)

    owner, refused, renamed = defs_of("a"), defs_of("b"), defs_of("a")
    tick(owner, "team a")  # scheduler team_a, owned by location 'team a'
    set_last_value(db, "team_a", "a", ORDERS, utc(2024, 1, 1))  # it remembers state
    conflict = "reactive scheduler name 'team_a' is used by code location 'team a'"
    logs = [tick(refused, "team_a"), tick(refused, "team_a")]
    assert [conflict in log for log in logs] == [True, False]
    no_state = "scheduler 'renamed' starts with no remembered state, but 'team_a' (1 task(s))"
    logs = [tick(renamed, "renamed"), tick(renamed, "renamed")]
    assert [no_state in log for log in logs] == [True, False]


def test_a_run_tagged_by_an_older_release_is_still_found_by_its_run_key():
    from dagster import DagsterRun

    from cmb_dagster.reactive.dagster_sensors import lookup_runs
    from cmb_dagster.reactive.models import RunState

    with instance_for_test() as instance:
        older = {"cmb/reactive/scheduler": "s", "cmb/reactive/run_key": "k1", "cmb/reactive/task": "t"}
        old_run = instance.add_run(DagsterRun(job_name="j", status=DagsterRunStatus.SUCCESS, tags=older))
        new = {"cmb/reactive.scheduler": "s", "cmb/reactive.run_key": "k2", "cmb/reactive.task": "t"}
        new_run = instance.add_run(DagsterRun(job_name="j", status=DagsterRunStatus.STARTED, tags=new))
        found = lookup_runs(instance, "s", ["k1", "k2", "k3"])
    assert {key: (info.run_id, info.state) for key, info in found.items()} == {
        "k1": (old_run.run_id, RunState.SUCCESS),
        "k2": (new_run.run_id, RunState.ACTIVE),
    }
