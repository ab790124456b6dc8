import psycopg
from dagster import (
    DagsterEvent,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    RunRequest,
    SkipReason,
    build_sensor_context,
    instance_for_test,
)
from observed import observations

from cmb_dagster import cmb_definitions
from cmb_dagster.examples.definitions import defs as example_defs
from cmb_dagster.examples.health import health_check
from cmb_dagster.jobs import keep_running_sensor, worker_job
from cmb_dagster.resources import CmbResource
from cmb_dagster.workers import WorkerReport


def test_health_check_job_writes_a_row(database_url):
    result = health_check.execute_in_process(
        resources={"cmb": CmbResource(database_url=database_url)}, instance=DagsterInstance.ephemeral()
    )
    assert result.success
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT source, schema_version FROM cmb.health_checks").fetchall()
    assert len(rows) == 1 and rows[0][0].startswith("dagster run ")


def test_example_definitions_load():
    repo = example_defs.get_repository_def()
    assert "health_check" in {job.name for job in repo.get_all_jobs()}


def test_worker_job_runs_the_worker_and_the_keeper_relaunches_it(database_url, monkeypatch):
    calls = []

    def run_worker(database, duration, context):
        calls.append((database.schema, duration))
        return WorkerReport(owner="test", items=3, steps=1)

    job = worker_job("demo_worker", run_worker, description="demo")
    defs = cmb_definitions(jobs=[job], resource=CmbResource(database_url=database_url))
    with instance_for_test() as instance:
        result = defs.resolve_job_def("demo_worker").execute_in_process(
            instance=instance, run_config={"ops": {"demo_worker_op": {"config": {"duration_seconds": 1.5}}}}
        )
        assert result.success and calls == [("cmb", 1.5)]
        keeper = keep_running_sensor(job)
        monkeypatch.setenv("CMB_WORKER_RUN_SECONDS", "1800")
        request = keeper(build_sensor_context(instance=instance))
        assert request.run_config == {"ops": {"demo_worker_op": {"config": {"duration_seconds": 1800.0}}}}
        started(instance, 3600)  # one run works for an hour: its successor comes shortly before it ends
        skip = keeper(build_sensor_context(instance=instance))
        assert isinstance(skip, SkipReason) and "its successor is launched in 35" in skip.skip_message
    with instance_for_test() as instance:
        started(instance, 30)  # within a minute of its end: the successor is launched now
        assert isinstance(keeper(build_sensor_context(instance=instance)), RunRequest)
        started(instance, 3600)  # two runs work (the successor waits for the partitions): nothing more
        assert isinstance(keeper(build_sensor_context(instance=instance)), SkipReason)
    with instance_for_test() as instance:
        started(instance, 30)
        instance.add_run(DagsterRun(job_name="demo_worker", status=DagsterRunStatus.NOT_STARTED))
        # a successor is starting: nothing more to launch
        assert isinstance(keeper(build_sensor_context(instance=instance)), SkipReason)


def started(instance, duration):
    """A working run of demo_worker, started now, configured to work ``duration`` seconds."""
    config = {"ops": {"demo_worker_op": {"config": {"duration_seconds": duration}}}}
    run = instance.add_run(DagsterRun(job_name="demo_worker", status=DagsterRunStatus.STARTED, run_config=config))
    instance.report_dagster_event(
        DagsterEvent(event_type_value=DagsterEventType.RUN_START.value, job_name="demo_worker"), run.run_id
    )
    return run


def test_the_status_sensor_records_what_changed_and_what_waits(database_url):
    from dagster import AssetKey, AssetObservation

    from cmb_dagster.jobs import status_sensor

    figures = {"a": {"queued": 0, "oldest_seconds": 0.0}, "b": {"queued": 0, "oldest_seconds": 0.0}}

    def observe(database):
        return [AssetObservation(asset_key=AssetKey([name]), metadata=dict(f)) for name, f in figures.items()]

    sensor = status_sensor("demo_status", observe, minimum_interval_seconds=5, description="demo")
    resources = {"cmb": CmbResource(database_url=database_url)}

    def tick(cursor):
        with build_sensor_context(resources=resources, cursor=cursor) as context:
            result = sensor.evaluate_tick(context)
        return sorted(e.asset_key.path[0] for e in observations(result)), result.cursor or cursor

    recorded, cursor = tick(None)
    assert recorded == ["a", "b"]  # the first tick records everything
    assert tick(cursor)[0] == []  # nothing changed, nothing waits: an idle engine records nothing
    figures["b"] = {"queued": 3, "oldest_seconds": 0.0}
    recorded, cursor = tick(cursor)
    assert recorded == ["b"]
    figures["b"] = {"queued": 3, "oldest_seconds": 12.5}  # only the age grows while work waits: still recorded
    assert tick(cursor)[0] == ["b"]


def test_the_reactive_status_sensor_counts_tasks_on_the_translated_asset(database_url):
    from dagster import AssetKey, job, op

    from cmb_dagster import CmbTranslator, ReactiveOptions, ReactiveTask
    from cmb_dagster.triggers import Delta

    @op
    def noop() -> None:
        pass

    @job
    def mart() -> None:
        noop()

    class Translator(CmbTranslator):
        def get_asset_key(self, engine, name):
            return AssetKey(["watch", engine, *name])

    defs = cmb_definitions(
        resource=CmbResource(database_url=database_url),
        translator=Translator(),
        reactive=ReactiveOptions(tasks=[ReactiveTask("mart", mart, Delta("a/b", "p", "1h"))]),
    )
    repo = defs.get_repository_def()
    with instance_for_test() as instance:
        with build_sensor_context(
            instance=instance, resources={"cmb": CmbResource(database_url=database_url)}, repository_def=repo
        ) as context:
            repo.get_sensor_def("cmb_reactive_scheduler")(context)  # stores the task's state
        with build_sensor_context(
            instance=instance, resources={"cmb": CmbResource(database_url=database_url)}
        ) as context:
            [observation] = observations(repo.get_sensor_def("cmb_reactive_status").evaluate_tick(context))
    assert observation.asset_key == AssetKey(["watch", "reactive", "tasks"])
    counts = {k: v.value for k, v in observation.metadata.items()}
    assert counts["waiting"] + counts["ready"] + counts["launched"] + counts["backoff"] == 1
    assert repo.assets_defs_by_key[AssetKey(["watch", "reactive", "tasks"])].is_observable
