"""Dagster shell of the callbacks engine: worker jobs and their keepers, cleanup, the schedules materializer,
and the status sensor observing each worker job's buckets. ``dagster://<job>`` callbacks to the jobs
the options open become runs, launched by each job's launch sensor."""

from dagster import (
    AssetKey,
    AssetObservation,
    Config,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    Definitions,
    OpExecutionContext,
    ScheduleDefinition,
    SensorEvaluationContext,
    SkipReason,
    job,
    op,
    sensor,
)
from pydantic import Field

from cmb_dagster.callbacks.admin import status
from cmb_dagster.callbacks.client import CallbackClient
from cmb_dagster.callbacks.models import MAX_TTL_DAYS, CallbackOptions
from cmb_dagster.callbacks.schedules import materialize_schedules
from cmb_dagster.callbacks.worker import CallbackWorker, bucket_slice
from cmb_dagster.dagster_translator import DEFAULT_TRANSLATOR, CmbTranslator
from cmb_dagster.database import Database
from cmb_dagster.health import Verdict
from cmb_dagster.jobs import (
    Observe,
    RunRequestLauncher,
    keep_running_sensor,
    launch_sensor_name,
    launch_sensors,
    status_definitions,
    worker_job,
    worker_job_names,
)
from cmb_dagster.resources import CmbResource
from cmb_dagster.workers import WorkerReport

# a run of an older release counts too
OLDER_RUN_KEY_TAGS = ("cmb/callbacks.run_key", "cmb/callbacks/run_key", "cmb/callback_run_key")


def counts_asset_key(options: CallbackOptions, index: int, translator: CmbTranslator = DEFAULT_TRANSLATOR) -> AssetKey:
    """The observable asset of the events worker job ``index`` serves."""
    return translator.get_asset_key("callbacks", [worker_job_names("", "events", options.workers)[index]])


def _run_worker(options: CallbackOptions, index: int, sensors: dict[str, str]):  # type: ignore[no-untyped-def]
    def run(database: Database, duration: float, context: OpExecutionContext) -> WorkerReport:
        buckets = bucket_slice(database, index, options.workers)
        launcher = RunRequestLauncher.from_context(database, context, sensors)
        return CallbackWorker(database, options.settings, buckets=buckets, launcher=launcher).run(duration)

    return run


class CleanupConfig(Config):
    """How old finished events and change_log entries must be to be removed."""

    ttl_days: int = Field(default=30, ge=0, le=MAX_TTL_DAYS)


def callback_definitions(
    options: CallbackOptions,
    *,
    prefix: str = "cmb_",
    resource: CmbResource | None = None,
    translator: CmbTranslator = DEFAULT_TRANSLATOR,
) -> Definitions:
    """The callbacks engine's jobs, schedules and sensors, for ``cmb_definitions(callbacks=...)``.

    ``resource`` is the ``cmb`` resource the engine's ops use (``cmb_definitions`` passes its own).
    """
    names = worker_job_names(prefix, "callbacks_worker", options.workers)
    sensors = {job: launch_sensor_name(prefix, "callbacks", job) for job in options.jobs}
    workers = [
        worker_job(
            name,
            _run_worker(options, i, sensors),
            description=f"Calls callbacks back: polls buckets with id % {options.workers} == {i} for a bounded time.",
            tags=translator.get_worker_tags("callbacks", name),
        )
        for i, name in enumerate(names)
    ]

    @op(
        name=f"{prefix}callbacks_clean_op",
        description="Deletes finished callback events and change_log older than ttl_days.",
    )
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

    assets = {
        counts_asset_key(options, index, translator): f"{COUNTS_DESCRIPTION} Buckets with id % {options.workers} "
        f"== {index}."
        for index in range(options.workers)
    }
    status = status_definitions(
        f"{prefix}callbacks_status",
        observations(options, translator),
        minimum_interval_seconds=options.observe_interval_seconds,
        description=COUNTS_DESCRIPTION,
        group_name=translator.get_group_name("callbacks"),
        assets=assets,
        checks=dict.fromkeys(assets, options.checks.descriptions()),
    )
    return Definitions.merge(
        Definitions(
            jobs=[*workers, cleanup_job],
            schedules=[cleanup_schedule],
            sensors=[
                *(keep_running_sensor(w) for w in workers),
                materializer,
                *launch_sensors(prefix, "callbacks", options.jobs, older_run_key_tags=OLDER_RUN_KEY_TAGS),
            ],
            resources={"cmb": resource or CmbResource()},
        ),
        status,
    )


COUNTS_DESCRIPTION = (
    "Callback events of the buckets one worker job serves: pending, overdue (due and not yet called) and the age of "
    "the oldest overdue one; notified, failed and rejected in the last hour; dead letters (failed for good, not "
    "replayed: `cmb-dagster callbacks failed`)."
)


def observations(options: CallbackOptions, translator: CmbTranslator = DEFAULT_TRANSLATOR) -> Observe:
    """``status(db)`` as one observation per bucket set (one per worker job), and the verdicts of its checks."""

    def observe(database: Database) -> list[AssetObservation | Verdict]:
        found: list[AssetObservation | Verdict] = []
        for counts in status(database, bucket_sets=options.workers, totals=False).bucket_sets:
            key = counts_asset_key(options, counts.bucket_set, translator)
            found.append(AssetObservation(asset_key=key, metadata=counts.model_dump(exclude={"bucket_set"})))
            found.extend(options.checks.verdicts(key.path, counts))
        return found

    return observe
