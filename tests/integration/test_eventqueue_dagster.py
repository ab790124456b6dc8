"""The event queue in Dagster: worker jobs and keepers, status observations, the resource, Dagster-job handlers."""

import sys

import pytest
from dagster import (
    Config,
    DagsterRunStatus,
    Definitions,
    RunsFilter,
    build_sensor_context,
    instance_for_test,
    job,
    op,
)
from dagster._core.code_pointer import CodePointer
from dagster._core.origin import RepositoryPythonOrigin
from dagster._core.remote_origin import InProcessCodeLocationOrigin, RemoteRepositoryOrigin
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
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
from cmb_dagster.eventqueue.dagster_defs import RUN_KEY_TAG, EventQueueResource
from cmb_dagster.jobs import QueuedRunLauncher
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
handlers.dagster_job("typo", job_name="nightly_reprot", max_retries=0)

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
        assert set(observed) == {"note", "report", "typo"}
        assert observed["note"]["held"].value == 1 and observed["note"]["paused"].value is True
        assert observed["note"]["blocked"].value is False and observed["report"]["queued"].value == 0


@pytest.fixture
def queued_instance():
    overrides = {"run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"}}
    with instance_for_test(overrides=overrides) as instance:
        yield instance


def test_dagster_job_handler_launches_one_run_per_event(db, database_url, queued_instance):
    repository = defs(database_url).get_repository_def()
    target = LoadableTargetOrigin(executable_path=sys.executable, python_file=__file__, attribute="location")
    remote = RemoteRepositoryOrigin(InProcessCodeLocationOrigin(target, location_name="test"), "__repository__")
    python = RepositoryPythonOrigin(sys.executable, CodePointer.from_python_file(__file__, "location", None))
    launcher = QueuedRunLauncher(queued_instance, repository, remote, python, run_key_tag=RUN_KEY_TAG)
    options = EventQueueOptions(handlers=handlers, worker=WorkerSettings(listen=False))
    worker = EventWorker(db, options, launcher=launcher)
    worker.register()
    good = emit("ns", "report", {"ops": {"build_report": {"config": {"day": "2030-01-01"}}}}, db=db)
    bad = emit("ns", "typo", {}, db=db)
    edges = worker.dequeue([good, bad])
    assert edges == {good: [Edge.LOCK_NONE, Edge.EXECUTES_TO_COMPLETION], bad: [Edge.LOCK_NONE, Edge.RETRY_TOO_MANY]}
    assert "nightly_reprot" in dead_letters(db)[0].error
    [run] = queued_instance.get_runs(RunsFilter(job_name="nightly_report"))
    assert run.status == DagsterRunStatus.QUEUED
    assert run.run_config == {"ops": {"build_report": {"config": {"day": "2030-01-01"}}}}
    assert run.tags["cmb/eventqueue.event_id"] == str(good)
    assert invalid_tag_keys(run.tags) == []
    assert run.tags["cmb/launched_by"].startswith(f"cmb event {good} (") and "user" not in run.tags
    again = launcher.launch("nightly_report", run_key=run.tags[RUN_KEY_TAG], run_config={}, tags={})
    assert again == run.run_id  # the run key keeps a retried event from launching twice
    assert [s.dead for s in status(db).handlers if s.handler == "typo"] == [1]
    worker.close()


location = Definitions(jobs=[nightly_report])
