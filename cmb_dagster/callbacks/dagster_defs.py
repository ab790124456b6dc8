"""Dagster shell of the callbacks engine: worker jobs and their keepers, cleanup, the schedules materializer,
and the launcher that turns ``dagster://<job>`` callbacks into queued runs."""

import json
from collections.abc import Mapping
from typing import Any

from croniter import croniter
from dagster import (
    AssetKey,
    AssetObservation,
    Config,
    DagsterInstance,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    Definitions,
    OpExecutionContext,
    RepositoryDefinition,
    ObserveResult,
    RunsFilter,
    ScheduleDefinition,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    SourceAsset,
    job,
    observable_source_asset,
    op,
    sensor,
)
from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.run_coordinator import QueuedRunCoordinator
from pydantic import Field, field_validator

from cmb_dagster.callbacks.admin import bucket_set_counts
from cmb_dagster.callbacks.client import CallbackClient
from cmb_dagster.callbacks.models import BucketSetCounts, CallbackSettings
from cmb_dagster.callbacks.schedules import materialize_schedules
from cmb_dagster.callbacks.worker import CallbackWorker, served_bucket_ids
from cmb_dagster.database import Database
from cmb_dagster.jobs import keep_running_sensor, worker_job
from cmb_dagster.models import Options
from cmb_dagster.resources import CmbResource
from cmb_dagster.workers import WorkerReport

RUN_KEY_TAG = "cmb/callbacks/run_key"
LEGACY_RUN_KEY_TAG = "cmb/callback_run_key"  # runs launched by earlier versions


class CallbackOptions(Options):
    """What ``cmb_definitions(callbacks=...)`` adds: worker jobs with keepers, cleanup and the schedules materializer.

    Defaults: one worker job serving every bucket, cleanup at 21:00 UTC of finished events older than
    30 days, schedules materialized every 30 s.
    """

    workers: int = Field(default=1, ge=1, le=64, description="Worker jobs; job i serves buckets with id % workers == i.")
    settings: CallbackSettings = Field(default_factory=CallbackSettings)
    cleanup_cron: str = Field(default="0 21 * * *", description="When the cleanup runs (every evening by default).")
    cleanup_timezone: str = "UTC"
    ttl_days: int = Field(default=30, ge=0, le=36500, description="Finished events and change_log older than this are removed.")
    materialize_interval_seconds: int = Field(default=30, ge=5, le=86400, description="How often schedules are materialized.")

    @field_validator("cleanup_cron")
    @classmethod
    def _cron_is_valid(cls, value: str) -> str:
        if not croniter.is_valid(value):
            raise ValueError(f"{value!r} is not a valid cron expression")
        return value

    def counts_asset_key(self, index: int) -> AssetKey:
        """The observable asset of the events worker job ``index`` serves."""
        return AssetKey(["callbacks", "events" if self.workers == 1 else f"events_{index}_of_{self.workers}"])

    def worker_job_name(self, index: int, prefix: str = "cmb_") -> str:
        """Name of worker job ``index``."""
        return f"{prefix}callbacks_worker" + ("" if self.workers == 1 else f"_{index}_of_{self.workers}")


class DagsterRunLauncher:
    """Launches ``dagster://<job>`` callbacks as runs of a job in the same code location, queued for the daemon.

    A run is tagged with the event's run key; launching the same key again returns the run launched before.
    """

    def __init__(
        self,
        instance: DagsterInstance,
        repository: RepositoryDefinition,
        remote_origin: RemoteRepositoryOrigin,
        python_origin: RepositoryPythonOrigin,
    ) -> None:
        self.instance = instance
        self.repository = repository
        self.remote_origin = remote_origin
        self.python_origin = python_origin

    @classmethod
    def from_context(cls, context: OpExecutionContext) -> "DagsterRunLauncher | None":
        """The launcher for the code location of the run ``context`` belongs to (None when run in process)."""
        run = context.dagster_run
        if run.remote_job_origin is None or run.job_code_origin is None:
            return None
        return cls(
            context.instance,
            context.repository_def,
            run.remote_job_origin.repository_origin,
            run.job_code_origin.repository_origin,
        )

    def launch(self, job_name: str, *, run_key: str, run_config: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        """Queue a run of ``job_name``; return its run id."""
        for tag in (RUN_KEY_TAG, LEGACY_RUN_KEY_TAG):
            existing = self.instance.get_run_ids(RunsFilter(tags={tag: run_key}), limit=1)
            if existing:
                return existing[0]
        if not self.repository.has_job(job_name):
            raise LookupError(f"code location has no job {job_name!r}")
        if not isinstance(self.instance.run_coordinator, QueuedRunCoordinator):
            raise RuntimeError("dagster:// callbacks need the QueuedRunCoordinator (see dagster.yaml)")
        run = self.instance.create_run_for_job(
            job_def=self.repository.get_job(job_name),
            run_config=dict(run_config),
            tags={**tags, RUN_KEY_TAG: run_key},
            remote_job_origin=RemoteJobOrigin(repository_origin=self.remote_origin, job_name=job_name),
            job_code_origin=JobPythonOrigin(job_name, self.python_origin),
        )
        self.instance.submit_run(run.run_id, workspace=None)  # type: ignore[arg-type]
        return run.run_id


def _run_worker(options: CallbackOptions, index: int):  # type: ignore[no-untyped-def]
    def run(database: Database, duration: float, context: OpExecutionContext) -> WorkerReport:
        def buckets() -> list[int]:  # asked at each lease renewal: a raised or lowered count is picked up
            return [b for b in served_bucket_ids(database) if b % options.workers == index]

        worker = CallbackWorker(
            database, options.settings, buckets=buckets, launcher=DagsterRunLauncher.from_context(context)
        )
        return worker.run(duration)

    return run


class CleanupConfig(Config):
    """How old finished events and change_log entries must be to be removed."""

    ttl_days: int = Field(default=30, ge=0, le=36500)


def callback_definitions(options: CallbackOptions, *, prefix: str = "cmb_") -> Definitions:
    """The callbacks engine's jobs, schedules and sensors, for ``cmb_definitions(callbacks=...)``."""
    workers = [
        worker_job(
            options.worker_job_name(i, prefix),
            _run_worker(options, i),
            description=f"Calls callbacks back: polls buckets with id % {options.workers} == {i} for a bounded time.",
        )
        for i in range(options.workers)
    ]

    @op(name=f"{prefix}callbacks_clean_op", description="Deletes finished callback events and change_log older than ttl_days.")
    def clean_op(context: OpExecutionContext, config: CleanupConfig, cmb: CmbResource) -> None:
        report = CallbackClient(cmb.database, options.settings, buffered=False).clean(config.ttl_days)
        context.log.info(f"removed {report.events} events, {report.change_log} change_log entries")
        context.add_output_metadata({"events": report.events, "change_log": report.change_log})

    @job(name=f"{prefix}callbacks_cleanup", description="Removes old finished callback events and change_log entries.")
    def cleanup_job() -> None:
        clean_op()

    cleanup_schedule = ScheduleDefinition(
        name=f"{prefix}callbacks_cleanup_schedule",
        job=cleanup_job,
        cron_schedule=options.cleanup_cron,
        execution_timezone=options.cleanup_timezone,
        run_config={"ops": {f"{prefix}callbacks_clean_op": {"config": {"ttl_days": options.ttl_days}}}},
        default_status=DefaultScheduleStatus.RUNNING,
    )

    @sensor(
        name=f"{prefix}callbacks_schedules_materializer",
        minimum_interval_seconds=options.materialize_interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description="Turns callback cron schedules into events up to their horizon.",
    )
    def materializer(context: SensorEvaluationContext, cmb: CmbResource) -> SkipReason:
        created = materialize_schedules(cmb.database)
        return SkipReason(f"created {created} scheduled callback events")

    return Definitions(
        jobs=[*workers, cleanup_job],
        schedules=[cleanup_schedule],
        sensors=[*(keep_running_sensor(w) for w in workers), materializer, counts_sensor(options, prefix=prefix)],
        assets=counts_assets(options),
    )


COUNTS_DESCRIPTION = (
    "Callback events of the buckets one worker job serves: pending, overdue (due and not yet called) and the age of "
    "the oldest overdue one; notified, failed and rejected in the last hour."
)


def counts_assets(options: CallbackOptions) -> list[SourceAsset]:
    """One observable asset per bucket set, whose observations plot its events; Observe refreshes it."""
    return [_counts_asset(options, index) for index in range(options.workers)]


def _counts_asset(options: CallbackOptions, index: int) -> SourceAsset:
    @observable_source_asset(
        key=options.counts_asset_key(index),
        group_name="cmb_callbacks",
        description=f"{COUNTS_DESCRIPTION} Buckets with id % {options.workers} == {index}.",
    )
    def callback_events(cmb: CmbResource) -> ObserveResult:
        return ObserveResult(metadata=_figures(bucket_set_counts(cmb.database, options.workers)[index]))

    return callback_events


def counts_sensor(options: CallbackOptions, *, prefix: str = "cmb_", minimum_interval_seconds: int = 60) -> SensorDefinition:
    """Observes each bucket set's events at most once a minute: when a figure changed, or while some are overdue."""

    @sensor(
        name=f"{prefix}callbacks_observer",
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description=COUNTS_DESCRIPTION,
    )
    def observer(context: SensorEvaluationContext, cmb: CmbResource) -> SensorResult | SkipReason:
        previous = json.loads(context.cursor or "{}")
        latest, observations = {}, []
        for counts in bucket_set_counts(cmb.database, options.workers):
            key = str(counts.bucket_set)
            latest[key] = counts.model_dump_json(exclude={"oldest_overdue_seconds"})
            if counts.overdue or latest[key] != previous.get(key):
                observations.append(
                    AssetObservation(asset_key=options.counts_asset_key(counts.bucket_set), metadata=_figures(counts))
                )
        if not observations:
            return SkipReason("no change")
        return SensorResult(asset_events=observations, cursor=json.dumps(latest))

    return observer


def _figures(counts: BucketSetCounts) -> dict[str, float]:
    return counts.model_dump(exclude={"bucket_set"})
