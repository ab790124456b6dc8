"""Dagster shell of the pub/sub engine: consumer jobs kept running, a RunRequest sensor, trim schedule.

Consumer lag shows in the UI as asset observations: each consumer (and each pub/sub sensor) has an
external asset ``pubsub/<consumer_id>/branch_<id>`` whose ``lag_events``, ``lag_seconds`` and
``delivered`` metadata the asset page plots over time; the ``<prefix>pubsub_status`` sensor records them.
"""

import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from enum import Enum
from typing import Any

from dagster import (
    AssetKey,
    AssetObservation,
    Config,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    Definitions,
    JobDefinition,
    OpExecutionContext,
    RunRequest,
    ScheduleDefinition,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    job,
    op,
    sensor,
)
from pydantic import Field

from cmb_dagster.dagster_translator import DEFAULT_TRANSLATOR, CmbTranslator
from cmb_dagster.database import Database
from cmb_dagster.health import Verdict
from cmb_dagster.inputs import BIGINT, check_int
from cmb_dagster.jobs import dagster_name, keep_running_sensor, status_definitions, worker_job
from cmb_dagster.pubsub.admin import status, trim
from cmb_dagster.pubsub.backfill import backfill
from cmb_dagster.pubsub.engine import read_batch, record_watermark, refuse_if_restored
from cmb_dagster.pubsub.errors import InvalidPubSubInput
from cmb_dagster.pubsub.models import (
    CONSUMER_ID_PATTERN,
    BackfillProgress,
    ConsumerSpec,
    Event,
    Lag,
    PubSubOptions,
    Watermark,
)
from cmb_dagster.pubsub.worker import ConsumerWorker
from cmb_dagster.resources import CmbResource
from cmb_dagster.workers import WorkerReport


def lag_asset_key(consumer_id: str, branch_id: int, translator: CmbTranslator = DEFAULT_TRANSLATOR) -> AssetKey:
    """The external asset whose observations carry a consumer's lag."""
    return translator.get_asset_key("pubsub", [dagster_name(consumer_id), f"branch_{branch_id}"])


def lag_observation(lag: Lag, translator: CmbTranslator = DEFAULT_TRANSLATOR) -> AssetObservation:
    """An observation of ``lag`` on the consumer's lag asset."""
    return AssetObservation(
        asset_key=lag_asset_key(lag.consumer_id, lag.branch_id, translator),
        metadata={
            "lag_events": lag.events,
            "lag_seconds": round(lag.seconds, 3),
            "delivered": lag.delivered,
            "failing_event": lag.failing_event or 0,
            "failed_attempts": lag.attempts,
            "parked_events": lag.parked,
            "unserved_seconds": round(lag.unserved_seconds, 3),
            "problem": lag.problem or "",
            "filter": f"topics {', '.join(lag.topics or ['*'])} where {lag.where or '-'}",
            "last_rewind": lag.last_rewind or "",
        },
    )


def consumer_job(
    spec: ConsumerSpec, *, prefix: str = "cmb_", translator: CmbTranslator = DEFAULT_TRANSLATOR
) -> JobDefinition:
    """A job that runs the consumer ``spec`` describes for a bounded time."""

    def run_consumer(database: Database, duration: float, context: OpExecutionContext) -> WorkerReport:
        return ConsumerWorker(database, spec).run(duration)

    name = f"{prefix}pubsub_consumer_{dagster_name(spec.consumer_id)}_branch_{spec.branch_id}"
    return worker_job(
        name,
        run_consumer,
        description=f"Runs pub/sub consumer {spec.consumer_id!r} of branch {spec.branch_id} "
        f"({spec.handler_path or 'a handler given as a function'}).",
        tags=translator.get_worker_tags("pubsub", name),
    )


def pubsub_sensor(
    job: JobDefinition,
    *,
    branch_id: int = 0,
    name: str | None = None,
    batch_size: int = 100,
    run_config: Callable[[Event], dict[str, Any]] | None = None,
    minimum_interval_seconds: int = 30,
    default_status: DefaultSensorStatus = DefaultSensorStatus.STOPPED,
    translator: CmbTranslator = DEFAULT_TRANSLATOR,
) -> SensorDefinition:
    """A sensor that requests one run of ``job`` per event of ``branch_id``: run key = event id,
    cursor = the watermark (registered as consumer ``sensor.<name>``, so trim keeps what it has not read)."""
    for field, value, low, high in (
        ("branch_id", branch_id, *BIGINT),
        ("batch_size", batch_size, 1, 10_000),
        ("minimum_interval_seconds", minimum_interval_seconds, 1, 86_400),
    ):
        check_int(value, field, low=low, high=high, error=InvalidPubSubInput)
    sensor_name = name or f"{job.name}_pubsub_branch_{branch_id}"
    consumer_id = f"sensor.{sensor_name}"
    if not re.match(CONSUMER_ID_PATTERN, consumer_id):
        raise InvalidPubSubInput(f"name: sensor name {sensor_name!r} must be at most 56 of A-Z a-z 0-9 _ . -")

    @sensor(
        name=sensor_name,
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"One run of {job.name} per pub/sub event of branch {branch_id}.",
    )
    def _pubsub_sensor(context: SensorEvaluationContext, cmb: CmbResource) -> SensorResult:
        state = (
            Watermark.model_validate_json(context.cursor)
            if context.cursor
            else Watermark(consumer_id=consumer_id, branch_id=branch_id)
        )
        with cmb.connection() as conn:
            refuse_if_restored(conn, state)
            record_watermark(conn, state)
            batch = read_batch(conn, state, batch_size)
        lags = status(cmb.database, consumer_id, branch_id).consumers
        requests = [
            RunRequest(
                run_key=str(event.id),
                run_config=run_config(event) if run_config else {},
                tags={
                    "cmb/pubsub.event": str(event.id),
                    "cmb/pubsub.topic": event.topic[:63],
                    "cmb/pubsub.op": event.op,
                },
            )
            for event in batch.events
        ]
        return SensorResult(
            run_requests=requests,
            cursor=batch.after.model_dump_json() if batch.changed else context.cursor,
            asset_events=[lag_observation(lag, translator) for lag in lags],
        )

    return _pubsub_sensor


class TrimConfig(Config):
    retain_days: float = Field(default=7.0, ge=0, le=36500, description="Keep events younger than this, read or not.")


def trim_job(*, prefix: str = "cmb_") -> JobDefinition:
    """A job deleting the pub/sub events older than ``retain_days`` that every registered consumer has read."""
    description = (
        "Deletes the pub/sub events older than retain_days every registered consumer of their branch has read."
    )

    @op(name=f"{prefix}pubsub_trim_op", description=description)
    def trim_op(context: OpExecutionContext, config: TrimConfig, cmb: CmbResource) -> None:
        with cmb.database.connect(autocommit=True) as conn:
            deleted = trim(conn, retain=timedelta(days=config.retain_days))
        context.log.info(f"trimmed {deleted} delivered events")
        context.add_output_metadata({"deleted": deleted})

    @job(name=f"{prefix}pubsub_trim", description=description)
    def trim_events() -> None:
        trim_op()

    return trim_events


def backfill_job(tables: Sequence[str], *, prefix: str = "cmb_") -> JobDefinition:
    """A job publishing the existing rows of one of ``tables`` (those the code location allows) as snapshot events
    (:func:`cmb_dagster.pubsub.backfill`); its progress goes to the run's log and, at the end, to the op's metadata.
    Launching it again resumes a backfill that was interrupted, and publishes a done one again only with ``again``."""
    description = "Publishes a table's existing rows into a branch as pub/sub snapshot events, resumably."
    table_choice = Enum("BackfillTable", {table: table for table in tables})  # type: ignore[misc]

    class BackfillConfig(Config):
        table: table_choice = Field(description="One of the tables the code location's pub/sub options name.")  # type: ignore[valid-type]
        branch_id: int = Field(default=0, ge=BIGINT[0], le=BIGINT[1], description="The branch the events go to.")
        where: str | None = Field(
            default=None,
            description="Only the rows this SQL/JSON path predicate over the row ($) is true for, e.g. "
            '$.status == "paid".',
        )
        batch_size: int = Field(default=1000, ge=1, le=100_000, description="Rows per batch (one transaction each).")
        topic: str | None = Field(default=None, description="Default: 'schema.table'.")
        again: bool = Field(default=False, description="Publish the rows again when this backfill is done already.")

    @op(name=f"{prefix}pubsub_backfill_op", description=description)
    def backfill_op(context: OpExecutionContext, config: BackfillConfig, cmb: CmbResource) -> None:
        def report(progress: BackfillProgress) -> None:
            context.log.info(
                f"backfill {progress.id} of {progress.table}: {progress.rows_done} rows in {progress.batches} "
                f"batches, last key {progress.last_key}"
            )

        done = backfill(
            cmb.database,
            config.table.value,
            config.branch_id,
            where=config.where,
            batch_size=config.batch_size,
            topic=config.topic,
            again=config.again,
            on_progress=report,
        )
        context.add_output_metadata(
            {
                "backfill_id": done.id,
                "rows_done": done.rows_done,
                "rows_skipped": done.rows_skipped,
                "batches": done.batches,
                "state": done.state,
            }
        )

    @job(name=f"{prefix}pubsub_backfill", description=description)
    def backfill_rows() -> None:
        backfill_op()

    return backfill_rows


def pubsub_definitions(
    options: PubSubOptions,
    *,
    prefix: str = "cmb_",
    resource: CmbResource | None = None,
    translator: CmbTranslator = DEFAULT_TRANSLATOR,
) -> Definitions:
    """Per consumer: a job, the sensor keeping one run of it going, its lag asset; the status sensor observing
    every consumer's lag; the trim schedule; the backfill job of the tables ``options.backfill_tables`` names."""
    specs = options.consumers
    jobs = [consumer_job(spec, prefix=prefix, translator=translator) for spec in specs]
    names = [j.name for j in jobs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidPubSubInput(f"consumers: two consumers map to the job name {duplicates[0]!r}; rename one")
    trim_events = trim_job(prefix=prefix)
    backfills = [backfill_job(options.backfill_tables, prefix=prefix)] if options.backfill_tables else []
    trim_schedule = ScheduleDefinition(
        name=f"{prefix}pubsub_trim_schedule",
        job=trim_events,
        cron_schedule=options.trim_cron,
        default_status=DefaultScheduleStatus.RUNNING,
    )

    def observe(database: Database) -> list[AssetObservation | Verdict]:
        wanted = {(spec.consumer_id, spec.branch_id) for spec in specs}
        found: list[AssetObservation | Verdict] = []
        for lag in (lag for lag in status(database).consumers if (lag.consumer_id, lag.branch_id) in wanted):
            found.append(lag_observation(lag, translator))
            found.extend(options.checks.verdicts(lag_asset_key(lag.consumer_id, lag.branch_id, translator).path, lag))
        return found

    engine = Definitions(
        jobs=[*jobs, trim_events, *backfills],
        sensors=[keep_running_sensor(j) for j in jobs],
        schedules=[trim_schedule],
        resources={"cmb": resource or CmbResource()},
    )
    if not specs:
        return engine
    assets = {
        lag_asset_key(s.consumer_id, s.branch_id, translator): f"Lag of pub/sub consumer {s.consumer_id!r} on "
        f"branch {s.branch_id}."
        for s in specs
    }
    observed = status_definitions(
        f"{prefix}pubsub_status",
        observe,
        minimum_interval_seconds=options.observe_interval_seconds,
        description="Observes each consumer's lag (events and seconds behind, delivered, a failing or parked event).",
        group_name=translator.get_group_name("pubsub"),
        assets=assets,
        checks=dict.fromkeys(assets, options.checks.descriptions()),
    )
    return Definitions.merge(engine, observed)
