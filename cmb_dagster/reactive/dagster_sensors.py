"""The reactive scheduler sensor: one per code location, launching reactive tasks from CTL changes."""

import json
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    EventRecordsFilter,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from cmb_dagster.ctl.errors import InvalidCtlInput
from cmb_dagster.reactive.models import Launch, RunInfo, RunState, SchedulerSettings, TaskSpec
from cmb_dagster.reactive.scheduler import TaskScheduler
from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import CtlStore, FeedItem, values_from_json, values_to_json
from cmb_dagster.database import Database
from cmb_dagster.ctl.dagster_resources import CTL_METADATA_KEY, ctl_values_from_metadata
from cmb_dagster.resources import CmbResource

SCHEDULER_TAG = "cmb/reactive/scheduler"
TASK_TAG = "cmb/reactive/task"
RUN_KEY_TAG = "cmb/reactive/run_key"
ATTEMPT_TAG = "cmb/reactive/attempt"
VALUES_TAG = "cmb/reactive/values"
REASON_TAG = "cmb/reactive/reason"

MATERIALIZATION_FEED = "dagster.asset_materializations"
MATERIALIZATIONS_PER_TICK = 1000
MAX_LOGGED_EVENTS = 500
_MAX_TAG_LENGTH = 4000
_FINISHED = {DagsterRunStatus.SUCCESS: RunState.SUCCESS, DagsterRunStatus.FAILURE: RunState.FAILURE,
             DagsterRunStatus.CANCELED: RunState.FAILURE}


def run_tags(scheduler: str, launch: Launch) -> dict[str, str]:
    """Tags of a reactive run: which task, which attempt, and the CTL values it runs on."""
    return {
        SCHEDULER_TAG: scheduler,
        TASK_TAG: launch.task,
        RUN_KEY_TAG: launch.run_key,
        ATTEMPT_TAG: str(launch.attempt),
        VALUES_TAG: json.dumps(values_to_json(launch.values), sort_keys=True),
        REASON_TAG: launch.reason[:_MAX_TAG_LENGTH],
    }


def launched_values(tags: Mapping[str, str]) -> dict[ParameterKey, datetime]:
    """The CTL values a reactive run was launched on, from its tags (``context.run.tags`` in an op)."""
    return values_from_json(json.loads(tags.get(VALUES_TAG, "{}")))


def lookup_runs(instance: DagsterInstance, scheduler: str, run_keys: Sequence[str]) -> dict[str, RunInfo]:
    """The newest run of each run_key, with one query to the run storage."""
    records = instance.get_run_records(RunsFilter(tags={SCHEDULER_TAG: scheduler, RUN_KEY_TAG: list(run_keys)}))
    found: dict[str, RunInfo] = {}
    for record in records:  # newest first
        run = record.dagster_run
        key = run.tags[RUN_KEY_TAG]
        if key not in found:
            found[key] = RunInfo(run.run_id, _FINISHED.get(run.status, RunState.ACTIVE))
    return found


def feed_materializations(instance: DagsterInstance, store: CtlStore, log: Callable[[str], None]) -> int | None:
    """Apply ``cmb/ctl`` entries of new asset materializations to CTL, exactly once; None when busy."""

    def read(position: int) -> list[FeedItem]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # get_event_records is the one query across all assets
            records = instance.get_event_records(
                EventRecordsFilter(DagsterEventType.ASSET_MATERIALIZATION, after_cursor=position),
                limit=MATERIALIZATIONS_PER_TICK,
                ascending=True,
            )
        items = []
        for record in records:
            materialization = record.asset_materialization
            values: dict[ParameterKey, datetime] = {}
            if materialization is not None and CTL_METADATA_KEY in materialization.metadata:
                entity = materialization.asset_key.to_user_string()
                try:
                    values = ctl_values_from_metadata(entity, materialization.metadata[CTL_METADATA_KEY])
                except InvalidCtlInput as exc:
                    log(f"asset {entity} in run {record.run_id}: {exc}; this materialization sets no CTL value")
            items.append(FeedItem(record.storage_id, values, f"dagster run {record.run_id} (asset materialization)"))
        return items

    changes = store.ingest(MATERIALIZATION_FEED, read)
    return None if changes is None else len(changes)


def scheduler_name_for(context: SensorEvaluationContext) -> str:
    """The code location's name, as a scheduler name ('default' outside a code location)."""
    origin = context.code_location_origin
    location = origin.location_name if origin is not None else "default"
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", location)[:50] or "default"


def scheduler_sensor(
    *,
    sensor_name: str,
    scheduler_name: str | None,
    tasks: Sequence[TaskSpec],
    job_names: Mapping[str, str],
    jobs: Sequence[object],
    settings: SchedulerSettings,
    minimum_interval_seconds: int,
    default_status: DefaultSensorStatus,
) -> SensorDefinition:
    """The reactive scheduler sensor for ``tasks``; ``job_names`` maps each task to the job it launches."""
    engines: dict[tuple[str, str, str], TaskScheduler] = {}
    lock = threading.Lock()

    def engine_for(database: Database, name: str) -> TaskScheduler:
        key = (database.url, database.schema, name)
        with lock:
            if key not in engines:
                engines[key] = TaskScheduler(database, name, tasks, settings)
            return engines[key]

    @sensor(
        name=sensor_name,
        jobs=list(jobs) or None,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=(
            "Launches reactive tasks when the CTL values their triggers read change; also applies "
            f"'{CTL_METADATA_KEY}' metadata of asset materializations to CTL. Each tick logs what it "
            "evaluated, launched and skipped, and why."
        ),
    )
    def _reactive_scheduler(context: SensorEvaluationContext, cmb: CmbResource) -> SensorResult | SkipReason:
        database = cmb.database
        name = scheduler_name or scheduler_name_for(context)
        fed = feed_materializations(context.instance, CtlStore(database, actor="dagster"), context.log.warning)
        if fed:
            context.log.info(f"{fed} CTL value(s) set from asset materializations")
        report = engine_for(database, name).tick(lambda s, keys: lookup_runs(context.instance, s, keys))
        for event in report.events[:MAX_LOGGED_EVENTS]:
            context.log.info(event.line())
        if len(report.events) > MAX_LOGGED_EVENTS:
            context.log.info(f"... {len(report.events) - MAX_LOGGED_EVENTS} more; `cmb-dagster reactive status` shows every task")
        context.log.info(report.summary())
        requests = [
            RunRequest(run_key=launch.run_key, job_name=job_names[launch.task], tags=run_tags(name, launch))
            for launch in report.launches
        ]
        if requests:
            return SensorResult(run_requests=requests)
        return SkipReason(_skip_text(report.summary(), [e.line() for e in report.events]))

    return _reactive_scheduler


def _skip_text(summary: str, lines: list[str], limit: int = 20) -> str:
    shown = [line.replace("\n", " | ") for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"... and {len(lines) - limit} more (see the tick's logs)")
    return "\n".join([summary, *shown])
