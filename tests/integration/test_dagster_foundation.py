import psycopg
from dagster import DagsterInstance, DagsterRunStatus, RunRequest, SkipReason, build_sensor_context, instance_for_test
from dagster._core.test_utils import create_run_for_test

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


def test_worker_job_runs_the_worker_and_the_keeper_relaunches_it(database_url):
    calls = []

    def run_worker(database, duration, context):
        calls.append((database.schema, duration))
        return WorkerReport(owner="test", items=3, steps=1)

    job = worker_job("demo_worker", run_worker, description="demo")
    defs = cmb_definitions(jobs=[job], resource=CmbResource(database_url=database_url))
    with instance_for_test() as instance:
        result = defs.get_job_def("demo_worker").execute_in_process(
            instance=instance, run_config={"ops": {"demo_worker_op": {"config": {"duration_seconds": 1.5}}}}
        )
        assert result.success and calls == [("cmb", 1.5)]
        keeper = keep_running_sensor(job)
        assert isinstance(keeper(build_sensor_context(instance=instance)), RunRequest)
        create_run_for_test(instance, job_name="demo_worker", status=DagsterRunStatus.STARTED)
        # one run works: the keeper queues a standby behind it
        assert isinstance(keeper(build_sensor_context(instance=instance)), RunRequest)
        create_run_for_test(instance, job_name="demo_worker", status=DagsterRunStatus.NOT_STARTED)
        # a standby waits: nothing more to launch
        assert isinstance(keeper(build_sensor_context(instance=instance)), SkipReason)
