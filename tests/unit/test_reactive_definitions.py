"""Reactive task definitions, the scheduler's options and settings, and the names they replace."""

import importlib
import sys
from datetime import timedelta

import pytest
from dagster import AssetSelection, DefaultSensorStatus, asset, job, op

from cmb_dagster import ReactiveOptions, ReactiveTask, cmb_definitions
from cmb_dagster.models import Backoff
from cmb_dagster.reactive import InvalidReactiveInput, reactive_definitions
from cmb_dagster.reactive.engine import values_hash
from cmb_dagster.reactive.models import SchedulerSettings, TaskSpec
from cmb_dagster.triggers import All, Any, ChunkDelta, Delay, Delta


@op
def noop() -> None:
    pass


@job
def report() -> None:
    noop()


@asset
def mart() -> None:
    pass


DELTA = Delta("sales", "loaded_until", "1h")


def test_cmb_definitions_adds_one_running_scheduler_sensor_the_jobs_and_the_ctl_resource():
    defs = cmb_definitions(
        reactive=ReactiveOptions(tasks=[ReactiveTask("report", report, DELTA), ReactiveTask("mart", [mart], DELTA)]),
        assets=[mart],
    )
    repository = defs.get_repository_def()
    [sensor] = [s for s in repository.sensor_defs if s.name == "cmb_reactive_scheduler"]
    assert sensor.default_status == DefaultSensorStatus.RUNNING and sensor.minimum_interval_seconds == 10
    assert {"report", "cmb_reactive_mart"} <= {j.name for j in repository.get_all_jobs()}
    assert "ctl" in repository.get_top_level_resources()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ReactiveTask("has space", report, DELTA), "name"),
        (lambda: ReactiveTask("t", report, DELTA, timezone="Mars/Olympus"), "timezone"),
        (lambda: ReactiveTask("t", report, "not a trigger"), "trigger"),
        (lambda: ReactiveTask("t", [], DELTA), "selects no asset"),
        (lambda: ReactiveTask("t", report, DELTA, produces=[("sales",)]), "produces"),
        (lambda: ReactiveTask("t", report, DELTA, produces=[("sales", "")]), "produces"),
        (lambda: ReactiveOptions(tasks=[ReactiveTask("t", report, DELTA), ReactiveTask("t", report, DELTA)]), "unique"),
    ],
)
def test_bad_task_definitions_are_clear_errors_naming_the_field(make, message):
    with pytest.raises(InvalidReactiveInput, match=message):
        make()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ReactiveOptions(tasks=[], bogus=1), "ReactiveOptions: bogus: Extra inputs are not permitted"),
        (lambda: ReactiveOptions(tasks=[], tick_seconds=60), "ReactiveOptions: tick_seconds: "),
        (lambda: ReactiveOptions(tasks=[], backoff={"first": -1}), "ReactiveOptions: backoff: .*first: "),
        (lambda: SchedulerSettings(idle_sleep=0), "SchedulerSettings: idle_sleep: "),
        (lambda: SchedulerSettings(max_crashes=0, bogus=1), "SchedulerSettings: max_crashes: .*; bogus: "),
        (lambda: TaskSpec(name="t", trigger=DELTA, priority=2**31), "TaskSpec: priority: "),
    ],
)
def test_bad_options_and_settings_are_one_line_naming_the_field(make, message):
    with pytest.raises(InvalidReactiveInput, match=message) as refused:
        make()
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (ReactiveOptions(tasks=[ReactiveTask("t", report, DELTA), "not a task"]), "tasks.1: expected a ReactiveTask"),
        (ReactiveOptions(tasks=[], default_status="RUNNING"), "default_status: expected a DefaultSensorStatus"),
    ],
)
def test_options_holding_dagster_objects_are_checked_when_the_definitions_are_built(options, message):
    with pytest.raises(InvalidReactiveInput, match=message):
        reactive_definitions(options)


def test_a_stopped_sensor_can_be_asked_for():
    options = ReactiveOptions(tasks=[ReactiveTask("t", report, DELTA)], default_status=DefaultSensorStatus.STOPPED)
    [sensor] = [
        s for s in reactive_definitions(options).get_repository_def().sensor_defs if s.name == "cmb_reactive_scheduler"
    ]
    assert sensor.default_status == DefaultSensorStatus.STOPPED


def test_nested_aggregates_are_refused_at_definition_time():
    with pytest.raises(ValueError, match="nested"):
        All(DELTA, Any(Delay("prices", "loaded_until", "1h")))


def test_check_warns_about_tasks_that_would_run_continuously():
    assert ReactiveTask("fresh", report, Delay("prices", "loaded_until", "1h")).warnings
    assert not ReactiveTask(
        "new_day", report, All(ChunkDelta("sales", "loaded_until", "day"), Delay("prices", "loaded_until", "1h"))
    ).warnings


def test_asset_selection_target_becomes_an_asset_job():
    task = ReactiveTask("marts.daily", AssetSelection.assets(mart), DELTA, priority=3)
    assert task.job().name == "cmb_reactive_marts_daily"
    assert task.spec.priority == 3 and task.spec.trigger == DELTA


def test_trigger_hash_changes_with_the_trigger_or_time_zone_only():
    a = ReactiveTask("t", report, DELTA).spec
    same = ReactiveTask("t", report, Delta("sales", "loaded_until", "60min"), priority=9).spec
    assert a.trigger_hash == same.trigger_hash
    assert a.trigger_hash != ReactiveTask("t", report, DELTA, timezone="Europe/Moscow").spec.trigger_hash
    assert a.trigger_hash != ReactiveTask("t", report, Delta("sales", "loaded_until", "2h")).spec.trigger_hash


def test_backoff_doubles_up_to_its_cap():
    settings = ReactiveOptions(tasks=[], backoff=Backoff(first=10, max=60)).settings
    assert [settings.backoff.delay(n) for n in range(5)] == [10, 20, 40, 60, 60]
    assert isinstance(settings, SchedulerSettings)
    assert SchedulerSettings().backoff == Backoff(first=30, factor=2, max=3600)


def test_the_old_backoff_fields_still_work_and_warn():
    with pytest.warns(DeprecationWarning, match="backoff=Backoff"):
        settings = ReactiveOptions(tasks=[], retry_backoff="PT10S", max_retry_backoff="PT60S").settings
    assert [settings.backoff.delay(n) for n in range(5)] == [10, 20, 40, 60, 60]
    with pytest.warns(DeprecationWarning):
        assert SchedulerSettings(retry_backoff=timedelta(seconds=5)).backoff == Backoff(first=5, max=3600)
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidReactiveInput, match="retry_backoff: .*30 days"):
        SchedulerSettings(retry_backoff=timedelta(days=365))


def test_the_old_names_still_work_and_warn():
    from cmb_dagster.reactive import InvalidReactiveInput as current

    with pytest.warns(DeprecationWarning, match="InvalidReactiveInput"):
        from cmb_dagster.reactive import InvalidReactiveTask
    assert InvalidReactiveTask is current
    sys.modules.pop("cmb_dagster.reactive.scheduler", None)
    with pytest.warns(DeprecationWarning, match="cmb_dagster.reactive.engine"):
        old = importlib.import_module("cmb_dagster.reactive.scheduler")
    assert old.values_hash is values_hash
    with pytest.warns(DeprecationWarning, match="reactive_definitions"):
        defs = ReactiveOptions(tasks=[ReactiveTask("t", report, DELTA)]).definitions()
    assert "cmb_reactive_scheduler" in [s.name for s in defs.get_repository_def().sensor_defs]


def test_values_hash_ignores_the_time_zone_a_value_is_written_in():
    from datetime import UTC, datetime, timedelta, timezone

    moment = datetime(2024, 5, 1, 12, tzinfo=UTC)
    key = ("sales", "loaded_until")
    assert values_hash({key: moment}) == values_hash({key: moment.astimezone(timezone(timedelta(hours=3)))})
    assert values_hash({key: moment}) != values_hash({key: moment + timedelta(seconds=1)})


def test_the_engine_imports_nothing_from_dagster():
    import subprocess
    import sys

    code = (
        "import sys, cmb_dagster.ctl, cmb_dagster.reactive, cmb_dagster.reactive.engine, "
        "cmb_dagster.reactive.worker, cmb_dagster.reactive.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dagster'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_an_idle_tick_is_not_logged_but_any_work_is():
    from cmb_dagster.reactive.models import TickReport

    assert TickReport("s").idle
    assert not TickReport("s", changes=1).idle and not TickReport("s", evaluated=2).idle
    assert not TickReport("s", complete=False).idle and not TickReport("s", definitions_synced=True).idle
