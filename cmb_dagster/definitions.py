"""The one factory that assembles a code location's cmb_dagster Definitions."""

from collections.abc import Sequence
from typing import Any

from dagster import DefaultScheduleStatus, Definitions, OpExecutionContext, ScheduleDefinition, job, op

from cmb_dagster import migrations
from cmb_dagster.callbacks.dagster_defs import CallbackJobs, callback_definitions
from cmb_dagster.eventqueue.dagster_defs import eventqueue_definitions
from cmb_dagster.eventqueue.models import EventQueueOptions
from cmb_dagster.pubsub.dagster_defs import pubsub_definitions
from cmb_dagster.pubsub.models import ConsumerSpec
from cmb_dagster.reactive import ReactiveScheduler, ReactiveTask, reactive_definitions
from cmb_dagster.resources import CmbResource


@op(description="Record that this code location reached the cmb database, with server and schema versions.")
def record_health_check(context: OpExecutionContext, cmb: CmbResource) -> None:
    with cmb.connection() as conn:
        server = conn.execute("SHOW server_version").fetchone()[0]
        version = migrations.current_version(conn, cmb.database.schema)
        row = conn.execute(
            "INSERT INTO health_checks (source, server_version, schema_version) VALUES (%s, %s, %s) RETURNING id",
            (f"dagster run {context.run_id}", server, version),
        ).fetchone()
    context.log.info(f"health check {row[0]}: Postgres {server}, schema {cmb.database.schema} v{version}")


@job(description="Checks the cmb database answers and records it in cmb.health_checks.")
def cmb_health_check() -> None:
    record_health_check()


cmb_health_check_schedule = ScheduleDefinition(
    job=cmb_health_check, cron_schedule="*/5 * * * *", default_status=DefaultScheduleStatus.RUNNING
)


def cmb_definitions(
    *,
    resource: CmbResource | None = None,
    consumers: Sequence[ConsumerSpec | dict[str, Any]] = (),
    reactive_tasks: Sequence[ReactiveTask] | ReactiveScheduler | None = None,
    callbacks: CallbackJobs | bool = False,
    events: EventQueueOptions | None = None,
    **definitions: Any,
) -> Definitions:
    """Definitions with the cmb resource (key ``cmb``), the health check, and your own ``jobs``,
    ``schedules``, ``sensors``, ``assets`` and ``resources`` merged in.

    ``reactive_tasks``: a list of ``ReactiveTask`` (or a ``ReactiveScheduler``) adds the reactive
    scheduler sensor, the tasks' jobs and the ``ctl`` resource.

    ``consumers``: pub/sub ``ConsumerSpec``s (or dicts); each gets a consumer job kept running and a
    lag asset, plus the hourly ``pubsub_trim`` schedule.

    ``callbacks``: ``True`` (or a ``CallbackJobs``) adds the callbacks worker jobs and their keepers,
    the evening cleanup schedule and the schedules materializer.

    ``events``: an ``EventQueueOptions`` adds the event queue's worker jobs and keepers, the status sensor,
    one asset per handler and the ``events`` resource (``EventQueueResource``).
    """
    ours = Definitions(
        jobs=[cmb_health_check],
        schedules=[cmb_health_check_schedule],
        resources={"cmb": resource or CmbResource()},
    )
    parts = [ours, Definitions(**definitions)]
    if reactive_tasks is not None:
        parts.append(reactive_definitions(reactive_tasks, resource))
    if consumers:
        parts.append(pubsub_definitions(consumers))
    if callbacks:
        parts.append(callback_definitions(None if callbacks is True else callbacks))
    if events is not None:
        parts.append(eventqueue_definitions(events, resource=resource))
    return Definitions.merge(*parts)
