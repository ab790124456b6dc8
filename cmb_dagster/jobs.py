"""Dagster shell of the worker runtime: a bounded-time worker job and the sensor that keeps it running."""

from collections.abc import Callable

from dagster import (
    Config,
    DagsterExecutionInterruptedError,
    DagsterRunStatus,
    DefaultSensorStatus,
    JobDefinition,
    OpExecutionContext,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    in_process_executor,
    job,
    op,
    sensor,
)
from pydantic import Field

from cmb_dagster.database import Database
from cmb_dagster.resources import CmbResource
from cmb_dagster.workers import WorkerReport, stop_workers_on_signals

WAITING_STATUSES = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING]
WORKING_STATUSES = [DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]

RunWorker = Callable[[Database, float, OpExecutionContext], WorkerReport]


class WorkerConfig(Config):
    """How long one run of a worker job works before it ends and the sensor launches the next."""

    duration_seconds: float = Field(default=300.0, gt=0, description="Seconds this run keeps working.")


def worker_job(name: str, run_worker: RunWorker, *, description: str) -> JobDefinition:
    """A job whose single op runs ``run_worker(database, duration, context)`` and reports what it did."""

    @op(name=f"{name}_op", description=description)
    def _worker_op(context: OpExecutionContext, config: WorkerConfig, cmb: CmbResource) -> None:
        try:
            with stop_workers_on_signals() as signalled:  # a shutdown ends the run as a success: the next resumes
                report = run_worker(cmb.database, config.duration_seconds, context)
        except DagsterExecutionInterruptedError:  # a signal before the workers started: nothing was in flight
            context.log.info(f"{name} stopped by a shutdown signal before it started working")
            return
        stopped = "; stopped early by a shutdown signal, the next run resumes" if signalled.is_set() else ""
        context.log.info(
            f"worker {report.owner} held {sorted(report.held)}: {report.items} items in {report.steps} steps, "
            f"{report.errors} errors, {report.seconds:.1f}s{stopped}"
        )
        context.add_output_metadata(
            {"items": report.items, "steps": report.steps, "errors": report.errors, "seconds": report.seconds}
        )

    @job(name=name, description=description, tags={"cmb/worker": name}, executor_def=in_process_executor)
    def _worker_job() -> None:
        _worker_op()

    return _worker_job


def keep_running_sensor(
    worker: JobDefinition,
    *,
    minimum_interval_seconds: int = 15,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """A sensor that keeps ``worker`` running with one run standing by behind the working one.

    The standby run waits in the queue (dagster.yaml limits the ``cmb/worker`` tag to one run per
    worker) and starts at the queue's next check after the working run ends (``dequeue_interval_seconds``),
    so the handover costs no sensor interval; without that limit it starts at once and waits for the leases.
    """

    @sensor(
        name=f"{worker.name}_keeper",
        job=worker,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Keeps {worker.name} running, with one run standing by.",
    )
    def _keeper(context: SensorEvaluationContext) -> RunRequest | SkipReason:
        runs = context.instance.get_runs(RunsFilter(job_name=worker.name, statuses=WAITING_STATUSES), limit=1)
        if runs:
            return SkipReason(f"run {runs[0].run_id} of {worker.name} is {runs[0].status.value}: standing by")
        working = context.instance.get_runs(RunsFilter(job_name=worker.name, statuses=WORKING_STATUSES), limit=2)
        if len(working) > 1:
            return SkipReason(f"{len(working)} runs of {worker.name} are working")
        return RunRequest()

    return _keeper
