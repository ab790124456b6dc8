"""The reactive scheduler sensor: one per code location, launching reactive tasks from CTL changes."""

import json
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

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

from cmb_dagster.ctl.dagster_resources import CTL_METADATA_KEY, ctl_mode_from_metadata, ctl_values_from_metadata
from cmb_dagster.ctl.errors import InvalidCtlInput
from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.ctl.store import CtlStore, FeedItem, values_from_json
from cmb_dagster.database import Database, DatabaseSource
from cmb_dagster.reactive.admin import claim_launch_log, launch_values
from cmb_dagster.reactive.engine import TaskScheduler
from cmb_dagster.reactive.errors import InvalidReactiveInput, SchedulerConflict
from cmb_dagster.reactive.models import (
    FixedLaunchOptions,
    Launch,
    LaunchOptions,
    ManualRun,
    Partitioner,
    RunInfo,
    RunState,
    SchedulerSettings,
    SeenRun,
    TaskSpec,
)
from cmb_dagster.resources import CmbResource
from cmb_dagster.triggers import parameters

SCHEDULER_TAG = "cmb/reactive.scheduler"
TASK_TAG = "cmb/reactive.task"
RUN_KEY_TAG = "cmb/reactive.run_key"
ATTEMPT_TAG = "cmb/reactive.attempt"
DEADLINE_TAG = "cmb/reactive.deadline"  # a run launched because its deadline passed (on_deadline='run'): which one
VALUES_TAG = "cmb/reactive.values"  # optional on a run launched by hand: the values it records on success
# The keys older releases tagged reactive runs with (two '/', which Dagster does not accept as a tag key): a run
# launched before an upgrade is still found and read by them.
_OLDER_KEYS = {key: key.replace(".", "/", 1) for key in (SCHEDULER_TAG, RUN_KEY_TAG, VALUES_TAG)}

MATERIALIZATION_FEED = "dagster.asset_materializations"
MATERIALIZATIONS_PER_TICK = 1000
MAX_LOGGED_EVENTS = 500
_FINISHED = {
    DagsterRunStatus.SUCCESS: RunState.SUCCESS,
    DagsterRunStatus.FAILURE: RunState.FAILURE,
    DagsterRunStatus.CANCELED: RunState.FAILURE,
}
_IN_FLIGHT = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]
_TAG_FILTER_CHUNK = 500  # task names per run-storage query for hand-launched runs
IN_FLIGHT_RUNS_PER_TICK = 500

_EVALUATION_TIME: ContextVar[datetime | None] = ContextVar("cmb_reactive_evaluation_time", default=None)


@contextmanager
def evaluation_time(moment: datetime | None) -> Iterator[None]:
    """Within the block, reactive sensor ticks evaluate triggers at ``moment`` instead of the clock (for tests)."""
    if moment is not None and moment.utcoffset() is None:
        raise InvalidReactiveInput(f"evaluation_time: must be timezone-aware, got {moment!r}")
    token = _EVALUATION_TIME.set(moment)
    try:
        yield
    finally:
        _EVALUATION_TIME.reset(token)


def run_tags(scheduler: str, launch: Launch) -> dict[str, str]:
    """Tags of a reactive run: which scheduler, task and attempt, and the passed deadline it was launched for (its
    values and reason are in its launch entry)."""
    tags = {
        SCHEDULER_TAG: scheduler,
        TASK_TAG: launch.task,
        RUN_KEY_TAG: launch.run_key,
        ATTEMPT_TAG: str(launch.attempt),
    }
    if launch.deadline is not None:
        tags[DEADLINE_TAG] = launch.deadline.isoformat()
    return tags


def launched_values(
    tags: Mapping[str, str], database: "CmbResource | DatabaseSource | None" = None
) -> dict[ParameterKey, datetime]:
    """The CTL values a run was launched on (``launched_values(context.run.tags)`` in an op).

    A reactive run's values are read from its launch record in the cmb database (``database``; default: the
    environment's, as ``CmbResource()``); a run launched by hand has those of its ``cmb/reactive.values`` tag, if any.
    """
    tags = _current(tags)
    if RUN_KEY_TAG in tags and SCHEDULER_TAG in tags:
        source = database if database is not None else CmbResource()
        db = source.database if isinstance(source, CmbResource) else Database.of(source)
        return launch_values(db, tags[SCHEDULER_TAG], tags[RUN_KEY_TAG])
    return values_from_json(json.loads(tags.get(VALUES_TAG, "{}")))


def _current(tags: Mapping[str, str]) -> Mapping[str, str]:
    """A run's tags, those of an older release under today's keys."""
    if not any(older in tags for older in _OLDER_KEYS.values()):
        return tags
    return {**{key: tags[older] for key, older in _OLDER_KEYS.items() if older in tags}, **tags}


def lookup_runs(instance: DagsterInstance, scheduler: str, run_keys: Sequence[str]) -> dict[str, RunInfo]:
    """The newest run of each run_key, with one query to the run storage (and one more for the keys not found, by
    the tag keys of older releases)."""
    found: dict[str, RunInfo] = {}
    for scheduler_tag, run_key_tag in (
        (SCHEDULER_TAG, RUN_KEY_TAG),
        (_OLDER_KEYS[SCHEDULER_TAG], _OLDER_KEYS[RUN_KEY_TAG]),
    ):
        missing = [key for key in run_keys if key not in found]
        if not missing:
            break
        records = instance.get_run_records(RunsFilter(tags={scheduler_tag: scheduler, run_key_tag: missing}))
        for record in records:  # newest first
            run = record.dagster_run
            key = run.tags[run_key_tag]
            if key not in found:
                found[key] = RunInfo(run.run_id, _FINISHED.get(run.status, RunState.ACTIVE))
    return found


def lookup_manual_runs(
    instance: DagsterInstance, scheduler: str, tasks: Sequence[str], after: datetime | None
) -> list[ManualRun]:
    """Successful runs tagged ``cmb/reactive.task`` that the scheduler did not launch, updated after ``after``."""
    found = []
    names = sorted(tasks)
    for start in range(0, len(names), _TAG_FILTER_CHUNK):
        records = instance.get_run_records(
            RunsFilter(
                tags={TASK_TAG: names[start : start + _TAG_FILTER_CHUNK]},
                statuses=[DagsterRunStatus.SUCCESS],
                updated_after=after,
            )
        )
        for record in records:
            tags = record.dagster_run.tags
            if RUN_KEY_TAG in tags or tags.get(SCHEDULER_TAG, scheduler) != scheduler:
                continue  # a reactive run (or a re-execution of one), or another scheduler's
            try:
                values = values_from_json(json.loads(tags[VALUES_TAG])) if VALUES_TAG in tags else None
            except (ValueError, TypeError, AttributeError):
                values = None
            started = record.start_time or _aware(record.create_timestamp).timestamp()
            found.append(
                ManualRun(
                    task=tags[TASK_TAG],
                    run_id=record.dagster_run.run_id,
                    started_at=datetime.fromtimestamp(started, UTC),
                    finished_at=_aware(record.update_timestamp),
                    values=values,
                )
            )
    return found


def runs_in_flight_by_asset(instance: DagsterInstance, repository: Any) -> dict[str, str]:
    """Asset keys (entity strings) that a queued or running run materializes -> that run, for the hold."""
    busy: dict[str, str] = {}
    for record in instance.get_run_records(RunsFilter(statuses=_IN_FLIGHT), limit=IN_FLIGHT_RUNS_PER_TICK):
        run = record.dagster_run
        keys = run.asset_selection
        if keys is None and repository is not None:
            try:
                keys = repository.get_job(run.job_name).asset_layer.executable_asset_keys
            except Exception:  # noqa: BLE001 - a job of another location, or no longer defined
                keys = None
        for key in keys or ():
            busy.setdefault(key.to_user_string(), f"run {run.run_id} of {run.job_name}")
    return busy


def feed_materializations(instance: DagsterInstance, store: CtlStore, log: Callable[[str], None]) -> int | None:
    """Apply ``cmb/ctl`` entries of new asset materializations to CTL, exactly once; None when busy.

    The feed's position belongs to this Dagster storage (its run storage id): a new storage (a fresh instance,
    a reset database) is read from its beginning, and the log says so once. Values only move forward unless
    the materialization says ``cmb/ctl_mode: set``.
    """

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
            forward = True
            if materialization is not None and CTL_METADATA_KEY in materialization.metadata:
                forward = ctl_mode_from_metadata(materialization.metadata) == "forward"
                entity = materialization.asset_key.to_user_string()
                try:
                    values = ctl_values_from_metadata(entity, materialization.metadata[CTL_METADATA_KEY])
                except InvalidCtlInput as exc:
                    log(f"asset {entity} in run {record.run_id}: {exc}; this materialization sets no CTL value")
            items.append(
                FeedItem(record.storage_id, values, f"dagster run {record.run_id} (asset materialization)", forward)
            )
        return items

    identity = newest = None
    try:
        identity = instance.run_storage.get_run_storage_id()
    except Exception:  # noqa: BLE001 - a storage without an id: positions are checked against the newest only
        identity = None
    try:
        newest = instance.event_log_storage.get_maximum_record_id()
    except Exception:  # noqa: BLE001
        newest = None
    changes = store.ingest(MATERIALIZATION_FEED, read, identity=identity, newest=newest or 0, on_restart=log)
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
    partitioners: Mapping[str, Partitioner] | None = None,
    launch_options: Mapping[str, Any] | None = None,
    findings: Mapping[str, Sequence[str]] | None = None,
    entity_hints: Mapping[ParameterKey, str] | None = None,
) -> SensorDefinition:
    """The reactive scheduler sensor for ``tasks``; ``job_names`` maps each task to the job it launches.

    ``launch_options`` maps a task to what gives its run config and extra tags (``run_config_for(values)``,
    ``tags_for(values)``); ``findings`` are the tasks' ``check()`` warnings, logged on the first tick;
    ``entity_hints`` say why a trigger parameter may be misnamed (its entity is no asset key of the location),
    added to the tick log's line about a parameter that never had a CTL value.
    """
    engines: dict[tuple[str, str, str], TaskScheduler] = {}
    lock = threading.Lock()
    task_names = [task.name for task in tasks]
    readers: dict[ParameterKey, list[str]] = {}  # trigger parameter -> the tasks that read it
    for task in tasks:
        for key in sorted(parameters(task.trigger)):
            readers.setdefault(key, []).append(task.name)
    unset: dict[tuple[str, str, str], set[ParameterKey]] = {}  # per engine: parameters without a CTL value yet
    has_upstream = any(task.upstream for task in tasks)

    def engine_for(database: Database, name: str, location: str | None) -> tuple[TaskScheduler, bool]:
        key = (database.url, database.schema, name)
        with lock:
            first = key not in engines
            if first:
                engines[key] = TaskScheduler(
                    database,
                    name,
                    tasks,
                    settings,
                    location=location,
                    partitioners=partitioners,
                    launch_options=options_of,
                )
            return engines[key], first

    def options_for(task: Any) -> LaunchOptions:
        if not callable(task.run_config) and not callable(task.tags):  # no user code to run at each launch
            return FixedLaunchOptions(task.run_config, task.tags_for({}))
        return lambda values: (task.run_config_for(values), task.tags_for(values))

    options_of = {name: options_for(task) for name, task in (launch_options or {}).items()}
    warned: set[str] = set()  # warnings already logged by this process: once each, not on every tick

    def request(name: str, launch: Launch) -> RunRequest:
        return RunRequest(
            run_key=launch.run_key,
            job_name=job_names[launch.task],
            tags={**launch.tags, **run_tags(name, launch)},
            run_config=dict(launch.run_config) if launch.run_config else None,
            partition_key=launch.partition_key,
        )

    def report_unset_parameters(context: SensorEvaluationContext, engine: TaskScheduler, first: bool) -> None:
        """Say once per change whether a trigger parameter has a CTL value: on the first tick, those that never had
        one; later, when one of them gets one (only those are read again, one query a tick)."""
        key = (engine.database.url, engine.database.schema, engine.name)
        if first:
            missing = engine.never_set(list(readers))
            unset[key] = missing
            for entity, parameter in sorted(missing):
                names = ", ".join(repr(n) for n in readers[(entity, parameter)])
                hint = (entity_hints or {}).get((entity, parameter), "")
                context.log.warning(
                    f"reactive task(s) {names}: trigger parameter {entity}/{parameter} has no CTL value, none was "
                    f"ever set{hint}; the trigger waits until one is"
                )
            return
        pending = unset.get(key)
        if not pending:
            return
        for entity, parameter in sorted(pending - engine.never_set(sorted(pending))):
            pending.discard((entity, parameter))
            context.log.info(f"trigger parameter {entity}/{parameter} has a CTL value now")

    def warn_once(context: SensorEvaluationContext, text: str) -> None:
        if text not in warned:
            warned.add(text)
            context.log.warning(text)

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
        origin = context.code_location_origin
        engine, first = engine_for(database, name, origin.location_name if origin is not None else None)
        if first:
            for task, lines in sorted((findings or {}).items()):
                for line in lines:
                    context.log.warning(f"reactive task {task!r}: {line}")
        report_unset_parameters(context, engine, first)
        fed = feed_materializations(context.instance, CtlStore(database, actor="dagster"), context.log.warning)
        if fed:
            context.log.info(f"{fed} CTL value(s) set from asset materializations")
        instance = context.instance
        busy = runs_in_flight_by_asset(instance, _repository(context)) if has_upstream else None
        try:
            report = engine.tick(
                lambda s, keys: lookup_runs(instance, s, keys),
                now=_EVALUATION_TIME.get() or datetime.now(UTC),
                manual=lambda after: lookup_manual_runs(instance, name, task_names, after),
                busy=busy,
            )
        except SchedulerConflict as exc:
            warn_once(context, str(exc))
            raise
        for warning in report.warnings:
            warn_once(context, warning)
        for seen in report.seen_runs:  # the first tick that sees a run writes its launch entry
            claimed = claim_launch_log(database, name, seen.run_key, seen.run_id)
            if claimed is not None:
                log_launch(instance, job_names.get(seen.task), claimed)
        for event in report.events[:MAX_LOGGED_EVENTS]:
            context.log.info(event.line())
        if len(report.events) > MAX_LOGGED_EVENTS:
            more = len(report.events) - MAX_LOGGED_EVENTS
            context.log.info(f"... {more} more; `cmb-dagster reactive status` shows every task")
        if not report.idle:  # an idle tick says so in its skip reason only, not in the log every 10 s
            context.log.info(report.summary())
        requests = [request(name, launch) for launch in report.launches]
        if requests:
            return SensorResult(run_requests=requests)
        return SkipReason(_skip_text(report.summary(), [e.line() for e in report.events]))

    return _reactive_scheduler


def log_launch(instance: DagsterInstance, job_name: str | None, seen: SeenRun) -> None:
    """Write why a reactive run was launched, and on which CTL values, into the run's own log."""
    instance.report_engine_event(
        f"reactive task {seen.task}: launched on {_values_line(seen.values)} (run_key {seen.run_key})\n{seen.reason}",
        run_id=seen.run_id,
        job_name=job_name,
    )


def _values_line(values: Mapping[ParameterKey, datetime]) -> str:
    return ", ".join(f"{e}/{p} = {v.isoformat()}" for (e, p), v in sorted(values.items())) or "no values"


def _aware(moment: datetime) -> datetime:
    """Run storage timestamps are UTC; some storages return them naive."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _repository(context: SensorEvaluationContext) -> Any:
    try:
        return context.repository_def
    except Exception:  # noqa: BLE001 - a context built without definitions
        return None


def _skip_text(summary: str, lines: list[str], limit: int = 20) -> str:
    shown = [line.replace("\n", " | ") for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"... and {len(lines) - limit} more (see the tick's logs)")
    return "\n".join([summary, *shown])
