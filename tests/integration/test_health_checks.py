"""Each engine's asset checks turn red when their condition holds and green after it clears, driven by real workers
and observed through the status sensors (Dagster's test utilities); every change is recorded once in Postgres."""

from datetime import UTC, datetime, timedelta

import pytest
from dagster import (
    AssetCheckSeverity,
    AssetSelection,
    Definitions,
    build_sensor_context,
    define_asset_job,
    instance_for_test,
)
from observed import evaluations
from pydantic import BaseModel
from stages_helpers import drain
from waiting import wait_until

from cmb_dagster import cmb_definitions, health
from cmb_dagster.callbacks import CallbackClient
from cmb_dagster.callbacks.models import CallbackOptions, CallbackSettings
from cmb_dagster.eventqueue import (
    EventQueueOptions,
    EventWorker,
    HandlerRegistry,
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

FAST = CallbackSettings(
    poll_interval=0.2, lease_ttl=3, timeout=1, backoff=Backoff(first=0.01), lookahead=1, allowed_hosts=["127.0.0.1"]
)


class StatusTicks:
    """Ticks of one status sensor, each with the cursor the previous one left."""

    def __init__(self, definitions, sensor: str, database_url: str) -> None:
        self.sensor = definitions.get_sensor_def(sensor)
        self.resources = {"cmb": CmbResource(database_url=database_url)}
        self.cursor: str | None = None
        self.seen: dict[str, object] = {}

    def tick(self) -> dict[str, object]:
        """The evaluations this tick recorded (also kept in ``seen``, the latest of each check)."""
        with (
            instance_for_test() as instance,
            build_sensor_context(instance=instance, resources=self.resources, cursor=self.cursor) as context,
        ):
            result = self.sensor.evaluate_tick(context)
        self.cursor = result.cursor or self.cursor
        recorded = evaluations(result)
        self.seen.update(recorded)
        return recorded

    def until(self, check: str, passed: bool, timeout: float = 20) -> object:
        """Tick until ``check`` was recorded with ``passed``; return that evaluation."""

        def recorded() -> object:
            self.tick()
            evaluation = self.seen.get(check)
            return evaluation if evaluation is not None and evaluation.passed == passed else None

        return wait_until(recorded, timeout, f"{check} recorded as {'passed' if passed else 'failed'}", interval=0.1)


def transitions_of(db, check: str) -> list[tuple[str, str]]:
    asset, name = check.rsplit(":", 1)
    return [(t.previous, t.severity) for t in health.transitions(db) if ("/".join(t.asset), t.check) == (asset, name)]


def run_worker(definitions, job_name: str, seconds: float) -> None:
    job = definitions.get_job_def(job_name)
    with instance_for_test() as instance:
        config = {"ops": {f"{job_name}_op": {"config": {"duration_seconds": seconds}}}}
        assert job.execute_in_process(instance=instance, run_config=config).success


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
        assert definitions.get_job_def("pubsub_demo_place_orders").execute_in_process(instance=instance).success
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
    run_worker(definitions, "cmb_callbacks_worker", 2.0)
    assert sink.count == 3
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


notes = HandlerRegistry()


@notes.handler("note")
def note(event) -> None:
    pass


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
