"""Alerts: a check that turns red, then green, sends one message each to a real webhook on 127.0.0.1, delivered by
the callbacks engine's worker; sending again after a crash creates nothing twice."""

from datetime import UTC, datetime

from callback_settings import FAST
from checks_helpers import StatusTicks, notes, run_worker
from dagster import build_sensor_context, instance_for_test
from waiting import wait_until

from cmb_dagster import cmb_definitions, health
from cmb_dagster.alerts import AlertOptions, send_alerts
from cmb_dagster.callbacks import CallbackClient
from cmb_dagster.callbacks.models import CallbackOptions
from cmb_dagster.eventqueue import EventQueueOptions, EventWorker, emit, pause, unpause
from cmb_dagster.health import Verdict
from cmb_dagster.resources import CmbResource


def tick_alerts(definitions, database_url: str) -> str:
    with (
        instance_for_test() as instance,
        build_sensor_context(instance=instance, resources={"cmb": CmbResource(database_url=database_url)}) as context,
    ):
        return definitions.resolve_sensor_def("cmb_alerts").evaluate_tick(context).skip_message


def test_a_check_turning_red_and_green_sends_one_message_each_through_the_callbacks_engine(db, database_url, sink):
    definitions = cmb_definitions(
        resource=CmbResource(database_url=database_url),
        events=EventQueueOptions(handlers=notes, checks={"held": {"error_at": 3}}),
        callbacks=CallbackOptions(settings=FAST),
        alerts=AlertOptions(webhook=f"{sink.url}/alerts", severity="error"),
    )
    ticks = StatusTicks(definitions, "cmb_events_status", database_url)
    ticks.tick()
    pause(db, "default", "note")
    for i in range(3):
        emit("default", "note", {"i": i}, db=db)
    worker = EventWorker(db, EventQueueOptions(handlers=notes))
    try:
        worker.run_once()
    finally:
        worker.close()
    ticks.until("eventqueue/note:held", passed=False)
    assert tick_alerts(definitions, database_url) == "1 alerts handed to the callbacks engine"
    assert tick_alerts(definitions, database_url) == "no check changed"
    run_worker(definitions, "cmb_callbacks_worker", 1.5)
    [red] = [call.body for call in sink.received]
    assert red["text"].startswith("[ERROR] eventqueue/note held: 3 events held (pause")
    assert (red["asset"], red["check"], red["severity"], red["previous"]) == ("eventqueue/note", "held", "error", "ok")
    assert set(red) == {"text", "asset", "check", "scope", "severity", "previous", "at"}  # the context alone

    assert unpause(db, "default", "note") == 3
    run_worker(definitions, "cmb_events_worker", 1.0)
    ticks.until("eventqueue/note:held", passed=True)
    assert tick_alerts(definitions, database_url) == "1 alerts handed to the callbacks engine"
    run_worker(definitions, "cmb_callbacks_worker", 1.5)
    wait_until(lambda: len(sink.received) == 2, 10, "the green alert")
    green = sink.received[1].body
    assert green["text"].startswith("[OK] eventqueue/note held is green again (was ERROR)")


def test_sending_again_after_a_crash_creates_no_second_callback(db):
    options = AlertOptions(webhook="http://127.0.0.1:9/alerts")
    health.record(db, [Verdict(("stages", "price"), "parked", "error", "2 parked entries")])
    health.record(db, [Verdict(("stages", "price"), "parked", "warn", "1 parked entries")])
    assert send_alerts(db, options, FAST) == 2
    with db.connection() as conn:  # a crash after the callbacks were created, before the transitions were marked
        conn.execute("UPDATE check_transitions SET alerted_at = NULL")
    assert send_alerts(db, options, FAST) == 2
    with CallbackClient(db, FAST) as client:
        keys = sorted(e.event_key for e in client.list(owner_client_id="cmb"))
    ids = [t.id for t in health.transitions(db)]
    assert keys == sorted(f"check-transition-{i}" for i in ids)
    assert send_alerts(db, options, FAST) == 0


def test_warnings_alert_only_when_asked_and_old_transitions_are_not_sent(db):
    health.record(db, [Verdict(("pubsub", "c"), "lag_events", "warn", "12 events behind")])
    assert send_alerts(db, AlertOptions(webhook="http://127.0.0.1:9/a", severity="error"), FAST) == 0
    health.record(db, [Verdict(("pubsub", "c"), "lag_events", "ok", "0 events behind")])
    with db.connection() as conn:
        conn.execute("UPDATE check_transitions SET at = now() - interval '2 hours' WHERE alerted_at IS NULL")
    assert send_alerts(db, AlertOptions(webhook="http://127.0.0.1:9/a"), FAST) == 0


def test_a_disabled_endpoint_turns_its_worker_jobs_check_red_and_sends_one_alert(db, database_url, sink):
    definitions = cmb_definitions(
        resource=CmbResource(database_url=database_url),
        callbacks=CallbackOptions(settings=FAST),
        alerts=AlertOptions(webhook=f"{sink.url}/alerts", severity="error"),
    )
    ticks = StatusTicks(definitions, "cmb_callbacks_status", database_url)
    ticks.tick()
    down = f"{sink.url}/down"
    with CallbackClient(db, FAST) as client:
        client.disable_endpoint("shop", down)
        for i in range(3):
            client.create("shop", "orders", f"o-{i}", datetime.now(UTC), down)
    run_worker(definitions, "cmb_callbacks_worker", 1.5)  # the gate keeps them as disabled, calling nothing
    assert not sink.received
    evaluation = ticks.until("callbacks/events:disabled_endpoints", passed=False)
    assert evaluation.description.startswith("1 disabled endpoints keep 3 events")
    assert tick_alerts(definitions, database_url) == "1 alerts handed to the callbacks engine"
    assert tick_alerts(definitions, database_url) == "no check changed"
    run_worker(definitions, "cmb_callbacks_worker", 1.5)
    [red] = [call.body for call in sink.received]
    assert red["text"].startswith("[ERROR] callbacks/events disabled_endpoints: 1 disabled endpoints keep 3 events")
