"""The reactive scheduler sensor against real Postgres and a temporary Dagster instance."""

import json
from datetime import UTC, datetime, timedelta

import pytest
from dagster import (
    DagsterEvent,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    Definitions,
    MaterializeResult,
    OpExecutionContext,
    RunRequest,
    asset,
    build_sensor_context,
    job,
    materialize,
    op,
)
from tags import invalid_tag_keys

from cmb_dagster import CtlResource, ReactiveOptions, ReactiveTask, ctl_metadata, launched_values
from cmb_dagster.ctl import CtlStore
from cmb_dagster.database import Database
from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.models import Backoff
from cmb_dagster.reactive import status, tick_reactive_sensor
from cmb_dagster.resources import CmbResource
from cmb_dagster.triggers import Any, ChunkDelay, ChunkDelta, Delay, Delta


@pytest.fixture
def now() -> datetime:
    """The test's start, read when the test runs (never at import: a slow collection must not age CTL values)."""
    return datetime.now(UTC).replace(microsecond=0)


@op
def work(context: OpExecutionContext) -> None:
    if context.run.tags.get("test/fail"):
        raise RuntimeError("the task failed")


@job
def target() -> None:
    work()


class Harness:
    """One code location's reactive scheduler, ticked by hand like the Dagster daemon would."""

    def __init__(self, db: Database, instance: DagsterInstance, resource: CmbResource, tasks, **options) -> None:
        self.db, self.instance, self.resource = db, instance, resource
        self.store = CtlStore(db, actor="test")
        options = {"name": "test", "backoff": Backoff(first=0), **options}
        self.defs: Definitions = cmb_definitions(resource=resource, reactive=ReactiveOptions(tasks=tasks, **options))
        self.clock: datetime | None = None  # the evaluation time of ticks; None: the wall clock

    def tick(self):
        return tick_reactive_sensor(self.defs, instance=self.instance, evaluation_time=self.clock)

    def requests(self) -> list[RunRequest]:
        return list(self.tick().run_requests or [])

    def start(self, request: RunRequest):
        return self.instance.create_run_for_job(target, tags=request.tags, status=DagsterRunStatus.STARTED)

    def finish(self, run, *, success: bool) -> None:
        if success:
            event = DagsterEvent(DagsterEventType.RUN_SUCCESS.value, job_name=run.job_name)
            self.instance.report_dagster_event(event, run_id=run.run_id)
        else:
            self.instance.report_run_failed(run)

    def execute(self, request: RunRequest, *, fail: bool = False) -> None:
        tags = {**request.tags, **({"test/fail": "1"} if fail else {})}
        target.execute_in_process(instance=self.instance, tags=tags, raise_on_error=False)

    def state(self, name: str):
        return {s.name: s for s in status(self.db, "test").tasks}[name]


def test_a_ctl_change_launches_the_task_with_short_tags_and_its_values_and_reason_in_the_runs_log(
    db, instance, resource, now, capfd
):
    h = Harness(db, instance, resource, [ReactiveTask("mart", target, Delta("sales", "loaded_until", "1h"))])
    first = h.tick()
    assert not first.run_requests and "sales/loaded_until has no current value yet" in first.skip_message

    h.store.set("sales", "loaded_until", now)
    capfd.readouterr()
    [request] = h.requests()
    [line] = [line for line in capfd.readouterr().err.splitlines() if " - mart: " in line]  # once per launch
    assert " - mart: launched - " in line and "Delta(sales/loaded_until, 1h) fires" in line
    assert request.job_name == "target"
    assert request.tags["cmb/reactive.task"] == "mart"
    assert launched_values(request.tags, resource) == {("sales", "loaded_until"): now}
    assert sorted(k for k in request.tags if k.startswith("cmb/")) == [
        "cmb/reactive.attempt",
        "cmb/reactive.run_key",
        "cmb/reactive.scheduler",
        "cmb/reactive.task",
    ]
    assert request.run_key == request.tags["cmb/reactive.run_key"]
    assert invalid_tag_keys(request.tags) == []
    run = h.start(request)
    h.tick()
    h.tick()
    [entry] = [e for e in instance.all_logs(run.run_id) if "reactive task mart" in (e.message or "")]
    assert f"launched on sales/loaded_until = {now.isoformat()}" in entry.message and "first run" in entry.message
    assert f"(run_key {request.run_key})" in entry.message


def test_no_relaunch_while_a_run_is_queued_or_running(db, instance, resource, now):
    h = Harness(db, instance, resource, [ReactiveTask("mart", target, Delta("sales", "loaded_until", "1h"))])
    h.store.set("sales", "loaded_until", now)
    [request] = h.requests()
    assert h.requests() == []  # requested, run not created yet: not requested again
    run = h.start(request)
    h.store.set("sales", "loaded_until", now + timedelta(hours=5))
    result = h.tick()
    assert not result.run_requests
    assert f"run {run.run_id}" in result.skip_message and "queued or running" in result.skip_message
    assert h.state("mart").status == "launched" and h.state("mart").run_id == run.run_id


def test_success_commits_the_values_as_last_seen(db, instance, resource, now):
    h = Harness(db, instance, resource, [ReactiveTask("mart", target, Delta("sales", "loaded_until", "1h"))])
    h.store.set("sales", "loaded_until", now)
    [request] = h.requests()
    h.execute(request)
    result = h.tick()
    assert not result.run_requests
    state = h.state("mart")
    assert state.status == "waiting" and state.last_values == {"sales": {"loaded_until": now.isoformat()}}
    assert "short by" in state.explanation

    h.store.set("sales", "loaded_until", now + timedelta(minutes=30))
    assert h.requests() == []  # 30 min < 1 h since the last run's value
    h.store.set("sales", "loaded_until", now + timedelta(hours=1))
    [second] = h.requests()
    assert launched_values(second.tags, resource) == {("sales", "loaded_until"): now + timedelta(hours=1)}
    assert second.run_key != request.run_key


def test_failure_retries_after_a_backoff_with_a_new_run_key(db, instance, resource, now):
    h = Harness(
        db,
        instance,
        resource,
        [ReactiveTask("mart", target, Delta("sales", "loaded_until", "1h"))],
        backoff=Backoff(first=60, max=3600),
    )
    h.clock = now  # ticks evaluate at a time the test sets: no race with a short backoff
    h.store.set("sales", "loaded_until", now)
    [first] = h.requests()
    h.execute(first, fail=True)
    result = h.tick()
    assert not result.run_requests and "failed (failure 1 in a row)" in result.skip_message
    assert h.state("mart").status == "backoff"
    h.clock = now + timedelta(seconds=59)
    assert h.requests() == []  # still backing off
    h.clock = now + timedelta(minutes=1)
    [retry] = h.requests()
    assert retry.run_key != first.run_key
    assert launched_values(retry.tags, resource) == launched_values(first.tags, resource)  # same values, next attempt
    assert retry.tags["cmb/reactive.attempt"] == "2" and "retry after 1 failed run" in h.state("mart").explanation
    h.execute(retry)
    h.tick()
    assert h.state("mart").attempts == 0 and h.state("mart").last_values


def test_cap_launches_highest_priority_first_and_a_freed_slot_launches_the_next(db, instance, resource, now):
    tasks = [ReactiveTask(f"t{p}", target, Delta("sales", "loaded_until", "1h"), priority=p) for p in range(5)]
    h = Harness(db, instance, resource, tasks, max_concurrent_runs=2)
    h.store.set("sales", "loaded_until", now)
    requests = h.requests()
    assert [r.tags["cmb/reactive.task"] for r in requests] == ["t4", "t3"]
    runs = [h.start(r) for r in requests]
    result = h.tick()
    assert not result.run_requests and "ready, waits for a slot: 2/2" in result.skip_message
    h.finish(runs[1], success=True)
    assert [r.tags["cmb/reactive.task"] for r in h.requests()] == ["t2"]


def test_a_bad_task_does_not_break_the_tick_for_the_others(db, instance, resource, now):
    broken = ChunkDelay.model_construct(  # slipped past validation: evaluating it raises
        kind="ChunkDelay", entity="sales", parameter="loaded_until", scale="fortnight", max_delay=None, timezone=None
    )
    tasks = [
        ReactiveTask("good", target, Delta("sales", "loaded_until", "1h")),
        ReactiveTask.model_construct(name="broken", target=target, trigger=broken, priority=5, timezone="UTC"),
        ReactiveTask("patient", target, Delta("not_yet", "loaded_until", "1h")),
    ]
    h = Harness(db, instance, resource, tasks)
    h.store.set("sales", "loaded_until", now)
    result = h.tick()
    assert [r.tags["cmb/reactive.task"] for r in result.run_requests] == ["good"]
    assert h.state("broken").status == "error" and "raised ValueError" in h.state("broken").explanation
    assert "not_yet/loaded_until has no current value yet" in h.state("patient").explanation


def test_only_tasks_whose_inputs_changed_are_evaluated(db, instance, resource, now):
    tasks = [ReactiveTask(f"t{i}", target, Delta(f"e{i}", "loaded_until", "1h")) for i in range(30)]
    h = Harness(db, instance, resource, tasks)
    h.tick()  # first tick: every task is new to the code location
    h.store.set("e7", "loaded_until", now)
    h.store.set("unrelated", "loaded_until", now)
    before = {s.name: s.evaluated_at for s in status(db, "test").tasks}
    [request] = h.requests()
    after = {s.name: s.evaluated_at for s in status(db, "test").tasks}
    assert request.tags["cmb/reactive.task"] == "t7"
    assert [name for name in before if before[name] != after[name]] == ["t7"]


def test_a_changed_definition_is_evaluated_again_with_the_seeds_release_rules(db, instance, resource, now):
    h = Harness(db, instance, resource, [ReactiveTask("mart", target, Delta("sales", "loaded_until", "1h"))])
    h.store.set_many({("sales", "loaded_until"): now, ("prices", "loaded_until"): now})
    [request] = h.requests()
    h.execute(request)
    assert h.requests() == []  # success: nothing new
    # next release: the trigger also reads prices, a parameter its last run did not see -> fires at once,
    # while the parameter it kept (sales) is evaluated against the last run's value as usual
    changed = Any(Delta("sales", "loaded_until", "1h"), ChunkDelta("prices", "loaded_until", "day"))
    h2 = Harness(db, instance, resource, [ReactiveTask("mart", target, changed)])
    [_] = h2.requests()
    reason = h2.state("mart").explanation
    assert "Delta(sales/loaded_until, 1h) waits" in reason and "the parameter is new to the trigger" in reason
    assert h2.state("mart").last_values == {"sales": {"loaded_until": now.isoformat()}}
    # an unchanged definition in a new process is not evaluated again
    h3 = Harness(db, instance, resource, [ReactiveTask("mart", target, changed)])
    assert "definitions synced" not in h3.tick().skip_message


def test_a_time_boxed_tick_resumes_where_it_stopped(db, instance, resource, now):
    tasks = [ReactiveTask(f"t{i:02d}", target, Delta("sales", "loaded_until", "1h")) for i in range(12)]
    h = Harness(db, instance, resource, tasks, tick_seconds=0.001, batch_size=5, max_concurrent_runs=100)
    h.store.set("sales", "loaded_until", now)
    ticks = [h.tick() for _ in range(4)]
    launched = [r.tags["cmb/reactive.task"] for t in ticks for r in t.run_requests or []]
    assert [len(t.run_requests or []) for t in ticks] == [5, 5, 2, 0]  # one batch per tick, highest priority first
    assert sorted(launched) == [f"t{i:02d}" for i in range(12)]  # each exactly once


def test_asset_materialization_metadata_feeds_ctl_and_bad_metadata_writes_nothing(db, instance, resource, now):
    moment = now - timedelta(minutes=1)

    @asset(key=["shop", "prices"])
    def prices() -> MaterializeResult:
        return MaterializeResult(metadata=ctl_metadata(loaded_until=moment))

    @asset(key=["shop", "broken"])
    def broken() -> MaterializeResult:
        return MaterializeResult(metadata={"cmb/ctl": {"loaded_until": "2024-05-01T00:00:00"}})  # naive

    h = Harness(db, instance, resource, [ReactiveTask("mart", target, Delay("shop/prices", "loaded_until", "10min"))])
    assert materialize([prices, broken], instance=instance).success
    [request] = h.requests()  # the same tick applied the metadata and launched
    assert launched_values(request.tags, resource) == {("shop/prices", "loaded_until"): moment}
    assert h.store.get("shop/broken", "loaded_until") is None
    [change] = h.store.history("shop/prices")
    assert change.changed_by.startswith("dagster run ")
    h.tick()
    assert len(h.store.history("shop/prices")) == 1  # applied exactly once


def test_ctl_resource_writes_from_an_op(db, instance, resource, now):
    @op
    def load(ctl: CtlResource) -> None:
        ctl.set("sales", "loaded_until", now)

    @job
    def loader() -> None:
        load()

    result = loader.execute_in_process(instance=instance, resources={"ctl": CtlResource(cmb=resource)})
    assert CtlStore(db).get("sales", "loaded_until") == now
    [change] = CtlStore(db).history()
    assert change.changed_by == f"dagster run {result.run_id} (loader)"


def test_status_json_shows_the_trigger_state(db, instance, resource):
    h = Harness(db, instance, resource, [ReactiveTask("mart", target, Delta("sales", "loaded_until", "1h"))])
    h.tick()
    state = h.state("mart")
    assert state.trigger == json.loads(Delta("sales", "loaded_until", "1h").model_dump_json())
    assert state.status == "waiting" and "no current value yet" in state.explanation


def test_the_example_location_launches_its_reactive_job_after_both_loaders_ran(db, instance, resource):
    from cmb_dagster.examples import reactive as example

    defs = cmb_definitions(
        resource=resource,
        reactive=ReactiveOptions(tasks=example.reactive_tasks, name="example"),
        jobs=example.example_jobs,
        assets=example.example_assets,
        sensors=example.example_sensors,
    )
    sensor = defs.get_repository_def().get_sensor_def("cmb_reactive_scheduler")

    def tick():
        context = build_sensor_context(instance=instance, resources={"cmb": resource}, definitions=defs)
        return sensor.evaluate_tick(context)

    loaders_sensor = defs.get_repository_def().get_sensor_def("example_loaders")
    loaders = loaders_sensor.evaluate_tick(build_sensor_context(instance=instance))
    assert sorted(r.job_name for r in loaders.run_requests) == ["orders_loader", "prices_loader"]
    assert defs.resolve_job_def("orders_loader").execute_in_process(instance=instance).success
    assert "ChunkDelta(shop/orders/loaded_until, 5min in UTC, 1) fires" in tick().skip_message  # prices not loaded yet
    assert defs.resolve_job_def("prices_loader").execute_in_process(instance=instance).success
    [request] = tick().run_requests
    assert request.job_name == "sales_report"
    assert set(launched_values(request.tags, resource)) == {example.ORDERS, example.PRICES}
    result = defs.resolve_job_def("sales_report").execute_in_process(instance=instance, tags=request.tags)
    assert result.success
    logged = [e.message or "" for e in instance.all_logs(result.run_id)]
    assert any("sales report for orders up to 2" in m and "None" not in m for m in logged), logged
    assert "sales_report: succeeded" in tick().skip_message


def test_a_second_scheduler_process_with_the_same_name_stands_by(db, instance, resource, now):
    from cmb_dagster.reactive.engine import LEASE_KIND
    from cmb_dagster.workers import Leases

    h = Harness(db, instance, resource, [ReactiveTask("mart", target, Delta("sales", "loaded_until", "1h"))])
    h.store.set("sales", "loaded_until", now)
    other = Leases(db, LEASE_KIND, "another-daemon", ttl=30)
    assert other.acquire(["test"])
    result = h.tick()
    assert not result.run_requests and "another process is running this scheduler's tick" in result.skip_message
    other.release(["test"])
    assert len(h.requests()) == 1


def producer_and_readers(*, produces: bool = True, **priorities: int) -> list[ReactiveTask]:
    """'orders' writes shop/orders; 'mart' (priority 10) waits for it; the others read sales/loaded_until."""
    return [
        ReactiveTask(
            "orders", target, Delta("erp", "exported_until", "1h"), produces=[("shop", "orders")] if produces else ()
        ),
        ReactiveTask("mart", target, Delta("shop", "orders", "1h"), priority=10),
        *(
            ReactiveTask(name, target, Delta("sales", "loaded_until", "1h"), priority=p)
            for name, p in priorities.items()
        ),
    ]


def start_the_producer(h: Harness, now: datetime):
    h.tick()
    h.store.set("erp", "exported_until", now)
    [request] = h.requests()
    assert request.tags["cmb/reactive.task"] == "orders"
    return h.start(request)


@pytest.mark.parametrize("success", [True, False])
def test_a_producer_in_flight_holds_lower_priority_tasks_until_its_run_ends(db, instance, resource, success, now):
    h = Harness(db, instance, resource, producer_and_readers(low=1), backoff=Backoff(first=3600, max=3600))
    run = start_the_producer(h, now)
    h.store.set("sales", "loaded_until", now)
    for _ in range(2):  # held tick after tick while the producer runs
        result = h.tick()
        assert not result.run_requests
        assert "low: held - waiting for orders which feeds higher-priority mart (priority 10)" in result.skip_message
        assert h.state("low").status == "ready" and h.state("mart").status == "waiting"
    h.finish(run, success=success)
    assert [r.tags["cmb/reactive.task"] for r in h.requests()] == ["low"]


def test_tasks_of_equal_or_higher_priority_than_the_waiting_task_are_not_held(db, instance, resource, now):
    h = Harness(db, instance, resource, producer_and_readers(low=1, peer=10, top=20))
    start_the_producer(h, now)
    h.store.set("sales", "loaded_until", now)
    result = h.tick()
    assert [r.tags["cmb/reactive.task"] for r in result.run_requests] == ["top", "peer"]
    assert h.state("low").status == "ready"


def test_no_hold_without_produces(db, instance, resource, now):
    h = Harness(db, instance, resource, producer_and_readers(produces=False, low=1))
    start_the_producer(h, now)
    h.store.set("sales", "loaded_until", now)
    assert [r.tags["cmb/reactive.task"] for r in h.requests()] == ["low"]


def test_produces_is_synced_without_evaluating_the_task_again(db, instance, resource):
    h = Harness(db, instance, resource, producer_and_readers(produces=False))
    h.tick()
    assert h.state("orders").produces == []
    h2 = Harness(db, instance, resource, producer_and_readers())
    summary = h2.tick().skip_message.splitlines()[0]
    assert "task definitions synced" in summary and "0 task(s) evaluated" in summary
    assert h2.state("orders").produces == [("shop", "orders")]
