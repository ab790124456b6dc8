"""What a reactive task tells its users: the launch entry first in the run's log, what blocks a waiting task (when
it changes, hourly otherwise), a trigger entity that is no asset key, a partition not there yet, backoffs that
set-last and forget end. Real Postgres, Dagster's test utilities."""

import warnings
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner
from dagster import (
    DailyPartitionsDefinition,
    Definitions,
    OpExecutionContext,
    asset,
    execute_job,
    job,
    op,
    reconstructable,
)

from cmb_dagster import ReactiveOptions, ReactiveTask, cmb_definitions
from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database
from cmb_dagster.models import Backoff
from cmb_dagster.reactive import ReactiveEntityWarning, ReactiveTriggerWarning, status, tick_reactive_sensor
from cmb_dagster.reactive.cli import reactive as reactive_cli
from cmb_dagster.reactive.errors import InvalidReactiveInput
from cmb_dagster.triggers import Delta

SALES = ("sales", "loaded_until")
ORDERS = ("shop/orders", "loaded_until")
DAILY = DailyPartitionsDefinition("2024-01-01")


@op
def work(context: OpExecutionContext) -> None:
    context.log.info("working")
    if context.run.tags.get("test/fail"):
        raise RuntimeError("the task failed")


@job
def target() -> None:
    work()


@asset(key=["shop", "prices"])
def prices() -> None:
    pass


@asset(key=["shop", "daily"], partitions_def=DAILY)
def daily() -> None:
    pass


_DEFS: list[Definitions] = []  # the location a reconstructable job is read from


def location_target():
    """The ``target`` job as the code location resolves it (with the location's default executor)."""
    return _DEFS[-1].resolve_job_def("target")


def location(resource, tasks, *, assets=(), **options) -> Definitions:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReactiveTriggerWarning)
        return cmb_definitions(
            resource=resource,
            assets=list(assets),
            reactive=ReactiveOptions(tasks=tasks, name="test", **{"backoff": Backoff(first=0), **options}),
        )


def cli(db: Database, *args: str):
    return CliRunner().invoke(reactive_cli, list(args), env={"CMB_DATABASE_URL": db.url, "CMB_SCHEMA": db.schema})


def state(db: Database, name: str):
    return {s.name: s for s in status(db, "test").tasks}[name]


def test_the_tick_that_sees_a_run_writes_its_launch_reason_and_values_into_its_log_once(db, instance, resource):
    defs = location(resource, [ReactiveTask("mart", target, Delta(*SALES, "1h"))])
    _DEFS.append(defs)
    moment = datetime.now(UTC).replace(microsecond=0)
    CtlStore(db).set(*SALES, moment)
    [request] = tick_reactive_sensor(defs, instance=instance).run_requests
    in_process = {"execution": {"config": {"in_process": {}}}}
    with execute_job(reconstructable(location_target), instance, tags=request.tags, run_config=in_process) as result:
        assert result.success
        run_id = result.run_id

    def entries() -> list[str]:
        return [e.message for e in instance.all_logs(run_id) if "reactive task mart" in (e.message or "")]

    assert entries() == []  # the run's executor is Dagster's own: nothing of cmb runs inside it
    tick_reactive_sensor(defs, instance=instance)  # the scheduler sees the run
    tick_reactive_sensor(defs, instance=instance)  # and does not write the entry again
    [message] = entries()
    assert f"launched on sales/loaded_until = {moment.isoformat()}" in message and "first run" in message
    assert request.run_key in message


def test_a_waiting_tasks_blocker_is_shown_when_it_changes_and_hourly_otherwise(db, instance, resource):
    defs = location(resource, [ReactiveTask("mart", target, Delta(*SALES, "1h"))])
    clock = datetime.now(UTC).replace(microsecond=0)

    def tick(at: datetime) -> str:
        return tick_reactive_sensor(defs, instance=instance, evaluation_time=at).skip_message

    assert "mart: waiting - Delta(sales/loaded_until, 1h) waits" in tick(clock)
    assert "mart:" not in tick(clock + timedelta(minutes=1))  # idle, unchanged: not repeated every tick
    assert "mart:" not in tick(clock + timedelta(minutes=59))
    reminded = tick(clock + timedelta(minutes=61))
    assert "mart: still waiting - unchanged since" in reminded and "no current value yet" in reminded
    assert "mart:" not in tick(clock + timedelta(minutes=62))
    CtlStore(db).set(*SALES, clock - timedelta(days=1))
    CtlStore(db).set(*SALES, clock)  # a change: evaluated and shown on this tick (first run: it fires)
    launched = tick_reactive_sensor(defs, instance=instance, evaluation_time=clock + timedelta(minutes=63))
    assert [r.tags["cmb/reactive.task"] for r in launched.run_requests] == ["mart"]
    shown = cli(db, "status", "test", "mart")
    assert shown.exit_code == 0 and "launched" in shown.output, shown.output


def test_a_trigger_entity_close_to_an_asset_key_fails_the_definitions_naming_the_key(resource):
    task = ReactiveTask("report", target, Delta("price", "loaded_until", "1h"))
    with pytest.raises(InvalidReactiveInput, match=r"'report': trigger parameter price/loaded_until: .*shop/prices\?"):
        cmb_definitions(resource=resource, assets=[prices], reactive=ReactiveOptions(tasks=[task], name="test"))


def test_a_trigger_entity_that_is_no_asset_key_warns_at_load_and_the_first_tick_says_it_never_had_a_value(
    db, instance, resource, capfd
):
    task = ReactiveTask("report", target, Delta("price", "loaded_until", "1h"))
    options = ReactiveOptions(tasks=[task], name="test", misspelt_entities="warn")
    with pytest.warns(ReactiveEntityWarning, match=r"price/loaded_until: price is not an asset key.*shop/prices\?"):
        defs = cmb_definitions(resource=resource, assets=[prices], reactive=options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReactiveEntityWarning)
        location(resource, [ReactiveTask("ok", target, Delta("shop/prices", "loaded_until", "1h"))], assets=[prices])
    capfd.readouterr()
    tick_reactive_sensor(defs, instance=instance)
    first = capfd.readouterr().err
    assert "trigger parameter price/loaded_until has no CTL value, none was ever set" in first
    assert "did you mean shop/prices?" in first
    tick_reactive_sensor(defs, instance=instance)
    assert "price/loaded_until" not in capfd.readouterr().err  # said once
    CtlStore(db).set("price", "loaded_until", datetime.now(UTC))
    tick_reactive_sensor(defs, instance=instance)
    assert "trigger parameter price/loaded_until has a CTL value now" in capfd.readouterr().err
    tick_reactive_sensor(defs, instance=instance)
    assert "has a CTL value now" not in capfd.readouterr().err


def test_a_partition_that_does_not_exist_yet_waits_without_a_failure(db, instance, resource):
    task = ReactiveTask("daily", [daily], Delta(*ORDERS, "1h"), partition=ORDERS)
    defs = location(resource, [task], assets=[daily], backoff=Backoff(first=3600))
    now = datetime.now(UTC)
    today = DAILY.get_partition_key_for_timestamp(now.timestamp())
    CtlStore(db).set(*ORDERS, now)  # first run: the day holding the newest data, today's, which is not complete
    first = tick_reactive_sensor(defs, instance=instance)
    assert not first.run_requests
    assert f"daily: waiting - waiting for partition {today}: it does not exist yet" in first.skip_message
    s = state(db, "daily")
    assert s.status == "waiting" and s.attempts == 0 and s.backoff_until is None
    assert s.explanation.startswith(f"waiting for partition {today}")
    again = tick_reactive_sensor(defs, instance=instance)  # evaluated again, not a failure, not shown again
    assert "1 task(s) evaluated" in again.skip_message and "daily:" not in again.skip_message
    assert state(db, "daily").attempts == 0
    shown = cli(db, "status", "test", "daily")
    assert shown.exit_code == 0 and "waiting for partition" in shown.output and "in a row" not in shown.output


@pytest.mark.parametrize("command", ["set-last", "forget"])
def test_set_last_and_forget_end_a_backoff(db, instance, resource, command):
    defs = location(resource, [ReactiveTask("mart", target, Delta(*SALES, "1h"))], backoff=Backoff(first=3600))
    moment = datetime.now(UTC).replace(microsecond=0)
    CtlStore(db).set(*SALES, moment)
    [request] = tick_reactive_sensor(defs, instance=instance).run_requests
    target.execute_in_process(instance=instance, tags={**request.tags, "test/fail": "1"}, raise_on_error=False)
    tick_reactive_sensor(defs, instance=instance)
    assert state(db, "mart").status == "backoff" and state(db, "mart").attempts == 1
    assert not tick_reactive_sensor(defs, instance=instance).run_requests  # backing off for an hour
    if command == "set-last":
        args = ["set-last", "test", "mart", "--parameter", *SALES, "--value", (moment - timedelta(hours=2)).isoformat()]
    else:
        args = ["forget", "test", "mart"]
    result = cli(db, *args)
    assert result.exit_code == 0, result.output
    s = state(db, "mart")
    assert s.status == "waiting" and s.attempts == 0 and s.backoff_until is None and s.dirty
    [retry] = tick_reactive_sensor(defs, instance=instance).run_requests  # the next tick evaluates it
    assert retry.tags["cmb/reactive.task"] == "mart"
    assert "retry after" not in state(db, "mart").explanation


def test_status_says_none_when_there_is_nothing_to_list(db):
    shown = cli(db, "status")
    assert shown.exit_code == 0 and shown.output.startswith("none"), shown.output
    shown = cli(db, "status", "test", "nope")
    assert shown.exit_code == 0 and shown.output.startswith("none"), shown.output
