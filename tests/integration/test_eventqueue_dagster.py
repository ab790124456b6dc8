"""The event queue in Dagster: worker jobs and keepers, status observations, the resource, Dagster-job handlers."""

import pytest
from dagster import (
    Config,
    DagsterInvalidDefinitionError,
    Definitions,
    build_sensor_context,
    instance_for_test,
    job,
    op,
)
from observed import observations
from tags import invalid_tag_keys

from cmb_dagster.definitions import cmb_definitions
from cmb_dagster.eventqueue import (
    Edge,
    EventQueueOptions,
    EventWorker,
    HandlerRegistry,
    WorkerSettings,
    dead_letters,
    emit,
    pause,
    status,
)
from cmb_dagster.eventqueue.dagster_defs import EventQueueResource
from cmb_dagster.jobs import DEFAULT_LOCATION, RunRequestLauncher
from cmb_dagster.resources import CmbResource

SEEN = []
handlers = HandlerRegistry()


@handlers.handler("note")
def note(event):
    SEEN.append(event.value)


class ReportConfig(Config):
    day: str


@op
def build_report(config: ReportConfig) -> str:
    return config.day


@job
def nightly_report() -> None:
    build_report()


handlers.dagster_job("report", job_name="nightly_report", max_retries=0)

OPTIONS = EventQueueOptions(handlers=handlers, workers=2, worker=WorkerSettings(sweep_interval=0.2))


class Fail(Config):
    fail: bool = False


@op
def emitting_op(config: Fail, events: EventQueueResource) -> None:
    with events.connection() as conn:
        events.emit("ns", "note", {"from": "op"}, conn=conn)
        if config.fail:
            raise RuntimeError("the op's transaction rolls back, and the event with it")


@job
def emitting_job() -> None:
    emitting_op()


def defs(database_url: str) -> Definitions:
    return cmb_definitions(
        resource=CmbResource(database_url=database_url), events=OPTIONS, jobs=[nightly_report, emitting_job]
    )


def count(db):
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM eventqueue_events").fetchone()[0]


def test_definitions_status_sensor_worker_job_and_resource(db, database_url):
    d = defs(database_url)
    repo = d.get_repository_def()
    assert {"cmb_events_worker_0_of_2", "cmb_events_worker_1_of_2"} <= set(repo.job_names)
    sensors = {s.name for s in repo.sensor_defs}
    assert {"cmb_events_worker_0_of_2_keeper", "cmb_events_worker_1_of_2_keeper", "cmb_events_status"} <= sensors

    with instance_for_test() as instance:
        sensor = repo.get_sensor_def("cmb_events_status")
        with build_sensor_context(instance=instance, resources={"cmb": CmbResource(database_url=database_url)}) as ctx:
            sensor(ctx)  # registers the handlers, so ops can emit before any worker ran

        emitting = repo.get_job("emitting_job")
        assert not emitting.execute_in_process(
            instance=instance, raise_on_error=False, run_config={"ops": {"emitting_op": {"config": {"fail": True}}}}
        ).success
        assert count(db) == 0
        assert emitting.execute_in_process(instance=instance).success
        assert count(db) == 1
        pause(db, "elsewhere", "note")
        emit("elsewhere", "note", 2, db=db)

        worker = repo.get_job("cmb_events_worker_0_of_2")
        one_second = {"ops": {"cmb_events_worker_0_of_2_op": {"config": {"duration_seconds": 1.0}}}}
        run = worker.execute_in_process(instance=instance, run_config=one_second)
        assert run.success
        assert count(db) == 1 and {"from": "op"} in SEEN  # the paused one waits

        with build_sensor_context(instance=instance, resources={"cmb": CmbResource(database_url=database_url)}) as ctx:
            result = sensor(ctx)
        observed = {e.asset_key.path[-1]: e.metadata for e in observations(result)}
        assert set(observed) == {"note", "report"}
        assert observed["note"]["held"].value == 1 and observed["note"]["paused"].value is True
        assert observed["note"]["blocked"].value is False and observed["report"]["queued"].value == 0


REPORT_CONFIG = {"ops": {"build_report": {"config": {"day": "2030-01-01"}}}}


def stored_requests(db) -> int:
    with db.connection() as conn:
        return conn.execute("SELECT count(*) FROM run_requests").fetchone()[0]


def test_dagster_job_handler_requests_one_run_per_event(db, database_url):
    d = defs(database_url)
    sensor = d.resolve_sensor_def("cmb_events_launch_nightly_report")
    launcher = RunRequestLauncher(
        db, d.get_repository_def(), {"nightly_report": sensor.name}, location=DEFAULT_LOCATION
    )
    launching = HandlerRegistry()
    launching.dagster_job("report", job_name="nightly_report", max_retries=0)
    launching.dagster_job("typo", job_name="nightly_reprot", max_retries=0)
    worker = EventWorker(
        db, EventQueueOptions(handlers=launching, worker=WorkerSettings(listen=False)), launcher=launcher
    )
    worker.register()
    good = emit("ns", "report", {"ops": {"build_report": {"config": {"day": "2030-01-01"}}}}, db=db)
    refused = emit("ns", "report", {"ops": {"build_report": {"config": {"day": 5}}}}, db=db)
    typo = emit("ns", "typo", {}, db=db)
    edges = worker.dequeue([good, refused, typo])
    assert edges[good] == [Edge.LOCK_NONE, Edge.EXECUTES_TO_COMPLETION]
    assert edges[refused] == edges[typo] == [Edge.LOCK_NONE, Edge.RETRY_TOO_MANY]
    errors = {d.id: d.error for d in dead_letters(db)}
    assert "nightly_reprot" in errors[typo] and "refuses the run config" in errors[refused]
    assert stored_requests(db) == 1  # only the good event's run is asked for

    resources = {"cmb": CmbResource(database_url=database_url)}
    with instance_for_test() as instance:
        with build_sensor_context(instance=instance, resources=resources, repository_def=d.get_repository_def()) as ctx:
            first = sensor(ctx)
        [request] = first.run_requests
        assert request.run_key == f"eventqueue:{good}"
        assert request.run_config == {"ops": {"build_report": {"config": {"day": "2030-01-01"}}}}
        assert request.tags["cmb/eventqueue.event_id"] == str(good) and invalid_tag_keys(request.tags) == []
        assert request.tags["cmb/launched_by"].startswith(f"cmb event {good} (") and "user" not in request.tags
        # a retried event asks again under its run key: one request, and Dagster starts one run per key
        launcher.launch("nightly_report", run_key=request.run_key, run_config=request.run_config, tags={})
        assert stored_requests(db) == 1
        with build_sensor_context(instance=instance, resources=resources, cursor=first.cursor) as ctx:
            second = sensor(ctx)
        assert second.run_requests == [] and stored_requests(db) == 0  # launched requests are deleted
    assert [s.dead for s in status(db).handlers if s.handler == "typo"] == [1]
    worker.close()


@pytest.mark.parametrize("cursor", ["[1", '{"a": 1}', '["x"]', "[99999999999999999999999]", "'; DROP TABLE x; --"])
def test_launch_sensor_takes_any_cursor_an_operator_sets(db, database_url, cursor):
    d = defs(database_url)
    sensor = d.resolve_sensor_def("cmb_events_launch_nightly_report")
    launcher = RunRequestLauncher(
        db, d.get_repository_def(), {"nightly_report": sensor.name}, location=DEFAULT_LOCATION
    )
    launcher.launch("nightly_report", run_key="k", run_config=REPORT_CONFIG, tags={})
    resources = {"cmb": CmbResource(database_url=database_url)}
    with (
        instance_for_test() as instance,
        build_sensor_context(instance=instance, resources=resources, cursor=cursor) as ctx,
    ):
        assert [r.run_key for r in sensor(ctx).run_requests] == ["k"]


def test_a_handler_naming_a_missing_job_fails_the_definitions(database_url):
    misspelt = HandlerRegistry()
    misspelt.dagster_job("report", job_name="nightly_reprot")
    d = cmb_definitions(resource=CmbResource(database_url=database_url), events=EventQueueOptions(handlers=misspelt))
    with pytest.raises(DagsterInvalidDefinitionError, match="nightly_reprot"):
        d.get_repository_def()
