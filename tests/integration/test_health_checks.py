"""Each engine's asset checks turn red when their condition holds and green after it clears, driven by real workers
and observed through the status sensors (Dagster's test utilities); every change is recorded once in Postgres."""

from datetime import UTC, datetime, timedelta

import pytest
from callback_settings import FAST
from checks_helpers import StatusTicks, notes, run_worker, transitions_of
from dagster import (
    AssetCheckSeverity,
    AssetSelection,
    Definitions,
    define_asset_job,
    instance_for_test,
)
from pydantic import BaseModel
from stages_helpers import drain
from waiting import wait_until

from cmb_dagster import InvalidInput, cmb_definitions, health
from cmb_dagster.callbacks import CallbackClient
from cmb_dagster.callbacks.models import CallbackOptions
from cmb_dagster.eventqueue import (
    EventQueueOptions,
    EventWorker,
    WorkerSettings,
    emit,
    pause,
    unpause,
)
from cmb_dagster.examples import pubsub as demo
from cmb_dagster.health import Threshold, Verdict
from cmb_dagster.models import Backoff
from cmb_dagster.pubsub import PubSubOptions
from cmb_dagster.resources import CmbResource
from cmb_dagster.stages import Entity, MergePatch, Stage, StageOptions, StageResult, StageStore, StageWorker, retry


def test_a_consumer_nobody_serves_turns_red_and_green_once_a_worker_delivers(db, database_url):
    definitions = cmb_definitions(
        resource=CmbResource(database_url=database_url),
        jobs=[demo.pubsub_demo_place_orders],
        pubsub=PubSubOptions(consumers=[demo.consumer], checks={"unserved_seconds": {"error_at": 0.5}}),
    )
    ticks = StatusTicks(definitions, "cmb_pubsub_status", database_url)
    check = "pubsub/demo_order_totals/branch_100:unserved_seconds"
    worker = "cmb_pubsub_consumer_demo_order_totals_branch_100"
    run_worker(definitions, worker, 0.5)  # registers the consumer, then stops: nobody serves it
    ticks.tick()
    assert ticks.seen[check].passed  # nothing waits
    with instance_for_test() as instance:
        assert definitions.resolve_job_def("pubsub_demo_place_orders").execute_in_process(instance=instance).success
    red = ticks.until(check, passed=False)
    assert red.severity == AssetCheckSeverity.ERROR and "no worker has held the consumer" in red.description
    lag = ticks.seen["pubsub/demo_order_totals/branch_100:lag_events"]
    assert lag.passed  # 100 events behind is within the default limits
    run_worker(definitions, worker, 1.0)
    green = ticks.until(check, passed=True)
    assert "a worker holds the consumer, or nothing waits" in green.description
    assert transitions_of(db, check) == [("ok", "error"), ("error", "ok")]


def test_overdue_callbacks_with_no_worker_turn_red_and_green_once_they_are_called(db, database_url, sink):
    options = CallbackOptions(settings=FAST, checks={"overdue": {"warn_at": 1, "error_at": 3}})
    definitions = cmb_definitions(resource=CmbResource(database_url=database_url), callbacks=options)
    ticks = StatusTicks(definitions, "cmb_callbacks_status", database_url)
    check = "callbacks/events:overdue"
    with CallbackClient(db, FAST, buffered=False) as client:
        for i in range(3):
            client.create("team", "alerts", f"late-{i}", datetime.now(UTC) - timedelta(seconds=5), sink.url)
    red = ticks.until(check, passed=False)
    assert red.severity == AssetCheckSeverity.ERROR and red.description.startswith("3 overdue events")
    assert red.metadata["value"].value == 3 and red.metadata["error_at"].value == 3
    [since] = [s.since for s in health.states(db) if f"{'/'.join(s.asset)}:{s.check}" == check]
    with CallbackClient(db, FAST, buffered=False) as client:
        for i in range(3, 5):
            client.create("team", "alerts", f"late-{i}", datetime.now(UTC) - timedelta(seconds=5), sink.url)
    # still red: the UI and `cmb-dagster checks` say what the latest evaluation found, since when it is red stays
    later = wait_until(lambda: ticks.tick().get(check), 20, "a new evaluation of the red check", interval=0.1)
    assert later.description.startswith("5 overdue events") and later.metadata["value"].value == 5
    [state] = [s for s in health.states(db) if f"{'/'.join(s.asset)}:{s.check}" == check]
    assert state.text.startswith("5 overdue events") and state.since == since
    run_worker(definitions, "cmb_callbacks_worker", 2.0)
    assert sink.count == 5
    ticks.until(check, passed=True)
    assert transitions_of(db, check) == [("ok", "error"), ("error", "ok")]


class Picky(Stage):
    name = "picky"
    max_attempts = 2
    backoff = Backoff(first=0.01, factor=1, max=0.01)

    class state_model(BaseModel):
        pass

    def process(self, entity: Entity, state: BaseModel) -> StageResult:
        if entity.payload.get("fail"):
            raise RuntimeError(f"cannot handle {entity.id}")
        return StageResult(update=MergePatch({"ok": True}))


def test_a_parked_stage_entry_turns_red_and_green_once_retried(db, database_url):
    stage = Picky()
    definitions = cmb_definitions(
        resource=CmbResource(database_url=database_url),
        stages=StageOptions(stages=[stage], checks={"parked": {"error_at": 1}}),
    )
    ticks = StatusTicks(definitions, "cmb_stages_status", database_url)
    check = "stages/picky:parked"
    store = StageStore(db, [stage])
    store.put_many({"bad": {"fail": True}, "good": {}})
    worker = StageWorker(db, [stage])
    drain(worker, settle=0.3)
    red = ticks.until(check, passed=False)
    assert red.description.startswith("1 parked entries") and red.severity == AssetCheckSeverity.ERROR
    store.put("bad", {"fail": False})
    assert retry(db, stage="picky") == 1
    drain(worker)
    ticks.until(check, passed=True)
    assert store.get("bad").payload == {"fail": False, "ok": True}


def test_a_paused_handler_past_its_threshold_turns_red_and_green_once_unpaused(db, database_url):
    options = EventQueueOptions(
        handlers=notes, worker=WorkerSettings(sweep_interval=0.05), checks={"held": {"warn_at": 2, "error_at": 5}}
    )
    definitions = cmb_definitions(resource=CmbResource(database_url=database_url), events=options)
    ticks = StatusTicks(definitions, "cmb_events_status", database_url)
    check = "eventqueue/note:held"
    ticks.tick()  # registers the handler
    pause(db, "default", "note")
    for i in range(5):
        emit("default", "note", {"i": i}, db=db)
    worker = EventWorker(db, options)
    try:
        worker.run_once()  # claims them and parks them under the rule
    finally:
        worker.close()
    red = ticks.until(check, passed=False)
    assert red.description.startswith("5 events held (pause") and red.severity == AssetCheckSeverity.ERROR
    assert unpause(db, "default", "note") == 5
    run_worker(definitions, "cmb_events_worker", 1.0)
    ticks.until(check, passed=True)
    assert transitions_of(db, check) == [("ok", "error"), ("error", "ok")]


def test_executing_the_checks_evaluates_them_from_the_status(db, database_url, sink):
    options = CallbackOptions(settings=FAST, checks={"overdue": {"error_at": 1}})
    definitions = cmb_definitions(resource=CmbResource(database_url=database_url), callbacks=options)
    with CallbackClient(db, FAST, buffered=False) as client:
        client.create("team", "alerts", "late", datetime.now(UTC) - timedelta(seconds=5), sink.url)
    job = Definitions.merge(
        definitions, Definitions(jobs=[define_asset_job("run_checks", AssetSelection.all_asset_checks())])
    ).resolve_job_def("run_checks")
    with instance_for_test() as instance:
        result = job.execute_in_process(instance=instance, raise_on_error=False)
    by_name = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert not by_name["overdue"].passed and by_name["failed_last_hour"].passed


def test_two_processes_recording_the_same_change_record_it_once(db):
    red = Verdict(("pubsub", "c"), "lag_events", "error", "12 events behind")
    assert [t.severity for t in health.record(db, [red])] == ["error"]
    assert health.record(db, [red]) == []
    assert [t.previous for t in health.record(db, [Verdict(("pubsub", "c"), "lag_events", "ok", "0")])] == ["error"]


@pytest.mark.parametrize(
    ("limits", "value", "severity"),
    [
        ({"warn_at": 1, "error_at": 3}, 0, "ok"),
        ({"warn_at": 1, "error_at": 3}, 2, "warn"),
        ({"error_at": 3}, 3, "error"),
    ],
)
def test_a_threshold_judges_a_figure(limits, value, severity):
    assert Threshold(**limits).severity(value) == severity


def test_thresholds_are_checked_where_the_options_are_made():
    with pytest.raises(InvalidInput, match="overdue.*warn_at \\(5\\) must not be above error_at \\(1\\)"):
        CallbackOptions(checks={"overdue": {"warn_at": 5, "error_at": 1}})
    with pytest.raises(InvalidInput, match="lag_events.*less than or equal to 1000000000000"):
        PubSubOptions(checks={"lag_events": {"error_at": 1e13}})
    with pytest.raises(InvalidInput, match="held_count"):
        EventQueueOptions(handlers=notes, checks={"held_count": {"error_at": 1}})
