"""Reactive tasks in Dagster: ``ReactiveTask`` (a job or asset selection plus a trigger) and their Definitions."""

import difflib
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from dagster import (
    AssetKey,
    AssetObservation,
    AssetSelection,
    DefaultSensorStatus,
    Definitions,
    JobDefinition,
    PartitionsDefinition,
    TimeWindowPartitionsDefinition,
    define_asset_job,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cmb_dagster.ctl.dagster_resources import CtlResource
from cmb_dagster.ctl.models import ParameterKey
from cmb_dagster.dagster_translator import DEFAULT_TRANSLATOR, CmbTranslator
from cmb_dagster.database import Database
from cmb_dagster.health import Verdict
from cmb_dagster.inputs import load_reference, shorten
from cmb_dagster.jobs import Observe, dagster_name, status_definitions
from cmb_dagster.models import describe
from cmb_dagster.reactive.admin import status
from cmb_dagster.reactive.checks import AssetPath, deadline_check, deadline_verdicts, tick_verdicts
from cmb_dagster.reactive.dagster_sensors import scheduler_sensor
from cmb_dagster.reactive.deadlines import Deadline, deadline_from
from cmb_dagster.reactive.errors import InvalidReactiveInput, PartitionNotReady
from cmb_dagster.reactive.models import (
    TASK_STATUSES,
    CtlKeys,
    Partitioner,
    Priority,
    ReactiveOptions,
    ReactiveTrigger,
    TaskName,
    TaskSpec,
    TimeZone,
)
from cmb_dagster.resources import CmbResource
from cmb_dagster.triggers import check, parameters
from cmb_dagster.triggers.models import trigger_data_problems

__all__ = [
    "ReactiveEntityWarning",
    "ReactiveOptions",
    "ReactiveTask",
    "ReactiveTriggerWarning",
    "reactive_definitions",
    "time_window_partitioner",
]

# Dagster names no public type for the asset job ``define_asset_job`` returns; its type is read from that public call.
AssetJob = type(define_asset_job("cmb_asset_job"))
Job = JobDefinition | AssetJob
Values = Mapping[ParameterKey, datetime]
PartitionChoice = Callable[[Values], str]
"""``choose(values)`` -> the partition key to launch for the CTL values the trigger fired on."""


class ReactiveTask(BaseModel):
    """A job (or an asset selection) launched when its CTL trigger fires.

    ``priority`` orders launches when runs are capped. ``produces`` names the CTL parameters the job
    writes: while its run is queued or running, ready tasks of lower priority than a waiting task that
    reads one of them are held, so the queue waits for the more important task. It never launches or
    re-evaluates a task by itself.

    >>> ReactiveTask("sales_mart", sales_mart_job, ChunkDelta("shop/orders", "loaded_until", "day"))  # doctest: +SKIP
    >>> ReactiveTask("orders", load_orders, Delay("erp", "exported_until", "1h"),
    ...              produces=[("shop/orders", "loaded_until")])  # doctest: +SKIP
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    name: TaskName
    target: Job | AssetSelection | Sequence[Any] | str = Field(
        description="The job to launch, or the assets to materialize (an AssetSelection, keys or asset definitions)."
    )
    trigger: ReactiveTrigger
    priority: Priority = Field(default=0, description="Higher launches first when runs are capped.")
    timezone: TimeZone = Field(default="UTC", description="IANA zone for chunk triggers without their own.")
    produces: CtlKeys = Field(
        default=(), description="(entity, parameter) pairs the job writes to CTL; holds lower-priority tasks."
    )
    partition: tuple[str, str] | Callable[..., str] | None = Field(
        default=None,
        description="For a partitioned target: the (entity, parameter) whose new values pick time-window "
        "partitions, one run per partition in order; or a callable(values) -> partition key.",
    )
    run_config: Mapping[str, Any] | Callable[..., Mapping[str, Any]] | None = Field(
        default=None, description="Run config of each launch, or a callable(values) -> run config."
    )
    tags: Mapping[str, str] | Callable[..., Mapping[str, str]] | None = Field(
        default=None, description="Extra run tags, or a callable(values) -> tags (cmb/reactive.* tags win)."
    )
    deadline: Deadline | None = Field(
        default=None,
        description="By when the task must have run successfully: a Deadline, or a cron expression in its time "
        "zone; when it passes without one, the deadline check of its target assets fails.",
    )
    on_deadline: Literal["alert", "run"] = Field(
        default="alert", description="'run': a passed deadline also launches the task anyway, tagged."
    )

    def __init__(
        self,
        name: str,
        target: Any,
        trigger: Any,
        *,
        priority: int = 0,
        timezone: str = "UTC",
        produces: Sequence[tuple[str, str]] = (),
        partition: tuple[str, str] | Callable[..., str] | None = None,
        run_config: Mapping[str, Any] | Callable[..., Mapping[str, Any]] | None = None,
        tags: Mapping[str, str] | Callable[..., Mapping[str, str]] | None = None,
        deadline: Deadline | str | Mapping[str, Any] | None = None,
        on_deadline: str = "alert",
    ) -> None:
        try:
            deadline = deadline_from(dict(deadline) if isinstance(deadline, Mapping) else deadline)
        except InvalidReactiveInput as exc:
            raise InvalidReactiveInput(f"reactive task {name!r}: deadline: {exc}") from None
        try:
            super().__init__(
                name=name,
                target=target,
                trigger=trigger,
                priority=priority,
                timezone=timezone,
                produces=produces,
                partition=tuple(partition) if isinstance(partition, list) else partition,
                run_config=run_config,
                tags=tags,
                deadline=deadline,
                on_deadline=on_deadline,
            )
        except ValidationError as exc:
            raise InvalidReactiveInput(f"reactive task {name!r}: {describe(exc)}") from None

    @model_validator(mode="after")
    def _target_is_runnable(self) -> "ReactiveTask":
        if isinstance(self.target, Sequence) and not isinstance(self.target, str) and not self.target:
            raise ValueError("target selects no asset")
        if isinstance(self.partition, tuple) and self.partition not in parameters(self.trigger):
            raise ValueError(
                f"partition {self.partition[0]}/{self.partition[1]} is not read by the trigger; "
                f"it reads {', '.join(f'{e}/{p}' for e, p in sorted(parameters(self.trigger)))}"
            )
        if self.on_deadline == "run" and self.deadline is None:
            raise ValueError("on_deadline: 'run' needs a deadline")
        return self

    def run_config_for(self, values: Values) -> Mapping[str, Any] | None:
        """The run config of a launch on ``values``."""
        return self.run_config(values) if callable(self.run_config) else self.run_config

    def tags_for(self, values: Values) -> dict[str, str]:
        """The user's extra tags of a launch on ``values``."""
        tags = self.tags(values) if callable(self.tags) else self.tags
        return {str(k): str(v) for k, v in (tags or {}).items()}

    def job(self, prefix: str = "cmb_") -> Job:
        """The job this task launches (for an asset selection, an asset job ``<prefix>reactive_<task>``)."""
        if isinstance(self.target, Job):
            return self.target
        return define_asset_job(f"{prefix}reactive_{dagster_name(self.name)}", selection=self.target)

    @property
    def spec(self) -> TaskSpec:
        """The engine's view of the task."""
        return self.spec_with()

    def spec_with(self, upstream: Sequence[str] = ()) -> TaskSpec:
        """The engine's view of the task, with the entities (asset keys) upstream of its target."""
        return TaskSpec(
            name=self.name,
            trigger=self.trigger,
            priority=self.priority,
            timezone=self.timezone,
            produces=self.produces,
            upstream=tuple(sorted(upstream)),
            deadline=self.deadline,
            on_deadline=self.on_deadline,
        )

    def selection(self) -> AssetSelection | None:
        """The assets the task materializes, when its target is assets (None for an op job)."""
        if isinstance(self.target, AssetJob):
            selection = self.target.selection
            return selection if isinstance(selection, AssetSelection) else None
        if isinstance(self.target, JobDefinition):
            return None
        if isinstance(self.target, AssetSelection):
            return self.target
        if isinstance(self.target, str):
            return AssetSelection.assets(AssetKey.from_user_string(self.target))
        return AssetSelection.assets(*self.target)

    @property
    def warnings(self) -> list[str]:
        """Advice on the trigger: one that does not depend on the last run's values may fire again on every new
        value."""
        return check(self.trigger)


def reactive_definitions(
    options: ReactiveOptions,
    *,
    prefix: str = "cmb_",
    resource: CmbResource | None = None,
    translator: CmbTranslator = DEFAULT_TRANSLATOR,
    assets: Sequence[Any] = (),
) -> Definitions:
    """Definitions for reactive tasks: the scheduler sensor, the tasks' jobs, the ``ctl`` resource, and the status
    sensor observing the tasks (how many wait, are ready, launched or backing off) on the ``reactive/tasks`` asset.

    ``assets`` (the code location's assets; ``cmb_definitions`` passes them) let a task's asset selection be
    resolved: a partitioned target without ``partition=`` is refused, and the assets upstream of a target feed
    the hold.
    """
    tasks = _checked_tasks(options)
    jobs: dict[str, Any] = {}
    job_names: dict[str, str] = {}
    graph = Definitions(assets=list(assets)).resolve_asset_graph() if assets else None
    specs, partitioners = [], {}
    checked: dict[str, list[AssetKey]] = {}  # task with a deadline -> the assets its deadline check is on
    for task in tasks:
        job = task.job(prefix)
        if job.name in jobs and jobs[job.name] is not job:
            raise InvalidReactiveInput(f"reactive task {task.name!r}: another job is named {job.name!r}")
        jobs.setdefault(job.name, job)
        job_names[task.name] = job.name
        partitions_def, upstream, targets = _target_facts(task, job, graph)
        if task.deadline is not None:
            checked[task.name] = targets or [tasks_asset_key(translator)]
        partitioner = _partitioner(task, partitions_def)
        if partitioner is not None:
            partitioners[task.name] = partitioner
        specs.append(task.spec_with(upstream))
        for finding in task.warnings:
            warnings.warn(f"reactive task {task.name!r}: {finding}", ReactiveTriggerWarning, stacklevel=2)
    hints = _entity_hints(tasks, graph)
    for task in tasks:
        for key in sorted(parameters(task.trigger)):
            if key not in hints:
                continue
            finding = f"reactive task {task.name!r}: trigger parameter {key[0]}/{key[1]}{hints[key]}"
            if options.misspelt_entities == "error":
                raise InvalidReactiveInput(
                    f"{finding}; if a job or another system sets its CTL values, pass misspelt_entities='warn'"
                )
            warnings.warn(
                f"{finding}; unless a job or another system sets its CTL values, the trigger never fires",
                ReactiveEntityWarning,
                stacklevel=2,
            )
    resource = resource or CmbResource()
    sensor = scheduler_sensor(
        sensor_name=f"{prefix}{options.sensor_name}",
        scheduler_name=options.name,
        tasks=specs,
        job_names=job_names,
        jobs=list(jobs.values()),
        settings=options.settings,
        minimum_interval_seconds=options.minimum_interval_seconds,
        default_status=_default_status(options.default_status),
        partitioners=partitioners,
        launch_options={task.name: task for task in tasks},
        findings={task.name: task.warnings for task in tasks if task.warnings},
        entity_hints=hints,
    )
    observed = status_definitions(
        f"{prefix}reactive_status",
        observations(options, translator, checked),
        minimum_interval_seconds=options.observe_interval_seconds,
        description="Observes how many reactive tasks wait, are ready, launched or back off, the scheduler's last "
        "tick and the tasks' deadlines.",
        group_name=translator.get_group_name("reactive"),
        assets={tasks_asset_key(translator): "Reactive tasks of this code location by status."},
        checks=_check_specs(options, translator, checked),
    )
    return Definitions.merge(
        Definitions(
            jobs=list(jobs.values()),
            sensors=[sensor],
            resources={"cmb": resource, "ctl": CtlResource(cmb=resource)},
        ),
        observed,
    )


def tasks_asset_key(translator: CmbTranslator = DEFAULT_TRANSLATOR) -> AssetKey:
    """The external asset whose observations count a code location's reactive tasks by status."""
    return translator.get_asset_key("reactive", ["tasks"])


def observations(
    options: ReactiveOptions,
    translator: CmbTranslator = DEFAULT_TRANSLATOR,
    deadline_assets: Mapping[str, Sequence[AssetKey]] | None = None,
) -> Observe:
    """``status(db)`` of this code location's tasks as one observation (tasks per status, attempts of failing ones)
    and the verdicts of their checks: the scheduler's tick age on the reactive tasks asset, and each task's
    deadline on the assets ``deadline_assets`` gives it."""
    names = {task.name for task in options.tasks}
    tasks_key = tasks_asset_key(translator)
    paths: dict[str, list[AssetPath]] = {
        name: [tuple(key.path) for key in keys] for name, keys in (deadline_assets or {}).items()
    }

    def observe(database: Database) -> list[AssetObservation | Verdict]:
        now = datetime.now(UTC)
        found = status(database, options.name)
        tasks = [t for t in found.tasks if t.defined and t.name in names]
        counts = Counter(t.status for t in tasks)
        metadata: dict[str, Any] = {state: counts.get(state, 0) for state in TASK_STATUSES}
        metadata["failed_attempts"] = sum(t.attempts for t in tasks)
        ours = {t.scheduler for t in tasks} if options.name is None else {options.name}
        schedulers = [s for s in found.schedulers if s.name in ours]
        ticks = tick_verdicts(tuple(tasks_key.path), schedulers, now, options.minimum_interval_seconds, options.checks)
        deadlines = deadline_verdicts(database, [t for t in tasks if t.name in paths], paths, now)
        scope = ",".join(sorted(ours))  # two locations may check one asset: each keeps its scheduler's state
        return [
            AssetObservation(asset_key=tasks_key, metadata=metadata),
            *(replace(verdict, scope=scope) for verdict in [*ticks, *deadlines]),
        ]

    return observe


def _check_specs(
    options: ReactiveOptions, translator: CmbTranslator, deadline_assets: Mapping[str, Sequence[AssetKey]]
) -> dict[AssetKey, dict[str, str]]:
    """The asset checks the status sensor evaluates: the scheduler's ticks, and each deadline on its assets."""
    specs: dict[AssetKey, dict[str, str]] = {tasks_asset_key(translator): options.checks.descriptions()}
    deadlines = {task.name: task.deadline for task in options.tasks}
    for name, keys in sorted(deadline_assets.items()):
        check = deadline_check(name)
        for key in keys:
            if check in specs.setdefault(key, {}):
                raise InvalidReactiveInput(
                    f"reactive task {name!r}: its deadline check {check!r} on {key.to_user_string()} is also "
                    "another task's (task names differing only in . and -): rename one"
                )
            specs[key][check] = f"Reactive task {name} ran successfully by its deadline ({deadlines[name]})."
    return specs


def _checked_tasks(options: ReactiveOptions) -> list[ReactiveTask]:
    """``options.tasks``, each a :class:`ReactiveTask`; InvalidReactiveInput naming the first that is not."""
    for index, task in enumerate(options.tasks):
        if not isinstance(task, ReactiveTask):
            raise InvalidReactiveInput(f"ReactiveOptions: tasks.{index}: expected a ReactiveTask, got {shorten(task)}")
    return list(options.tasks)


def _default_status(value: Any) -> DefaultSensorStatus:
    if value is None:
        return DefaultSensorStatus.RUNNING
    if not isinstance(value, DefaultSensorStatus):
        raise InvalidReactiveInput(
            f"ReactiveOptions: default_status: expected a DefaultSensorStatus, got {shorten(value)}"
        )
    return value


class ReactiveTriggerWarning(UserWarning):
    """A reactive task's trigger can fire without new data beyond what its last run saw (``check()``)."""


class ReactiveEntityWarning(ReactiveTriggerWarning):
    """A reactive task's trigger reads an entity that is no asset key of the code location (a typo?)."""


def _entity_hints(tasks: Sequence[ReactiveTask], graph: Any) -> dict[ParameterKey, str]:
    """Trigger parameters whose entity looks like a misspelt asset key of the location -> why, naming the key.

    An entity that is no asset key and close to none is left alone here (a job or another system may set its
    CTL values); the first tick reports every parameter that never had a value."""
    if graph is None:
        return {}
    keys = sorted(key.to_user_string() for key in graph.get_all_asset_keys())
    by_name = {key.rsplit("/", 1)[-1]: key for key in keys}  # "prices" -> "shop/prices"
    hints: dict[ParameterKey, str] = {}
    for task in tasks:
        for entity, parameter in sorted(parameters(task.trigger)):
            if entity in keys:
                continue
            close = difflib.get_close_matches(entity, keys, n=1, cutoff=0.8) or [
                by_name[name] for name in difflib.get_close_matches(entity, list(by_name), n=1, cutoff=0.8)
            ]
            if close:
                hints[(entity, parameter)] = (
                    f": {entity} is not an asset key of this code location (did you mean {close[0]}?)"
                )
    return hints


def _target_facts(
    task: ReactiveTask, job: Any, graph: Any
) -> tuple[PartitionsDefinition | None, list[str], list[AssetKey]]:
    """The partitions of the task's target, the asset keys upstream of it (as entity strings), and its assets."""
    partitions_def = getattr(job, "partitions_def", None)
    selection = task.selection()
    if graph is None or selection is None:
        return partitions_def, [], []
    try:
        keys = selection.resolve(graph)
        ancestors = AssetSelection.assets(*keys).upstream().resolve(graph) - keys
    except Exception as exc:  # noqa: BLE001 - dagster raises several kinds for an unknown key
        raise InvalidReactiveInput(f"reactive task {task.name!r}: its target does not resolve: {exc}") from None
    for key in sorted(keys, key=lambda k: k.to_user_string()):
        node_partitions = graph.get(key).partitions_def
        if node_partitions is not None:
            partitions_def = partitions_def or node_partitions
    return (
        partitions_def,
        sorted(key.to_user_string() for key in ancestors),
        sorted(keys, key=lambda k: k.to_user_string()),
    )


def _partitioner(task: ReactiveTask, partitions_def: PartitionsDefinition | None) -> Partitioner | None:
    """How the task's launches pick their partition; refuses a partitioned target without ``partition=``."""
    if partitions_def is None:
        if task.partition is not None:
            raise InvalidReactiveInput(
                f"reactive task {task.name!r}: partition= is given but its target is not partitioned"
            )
        return None
    if task.partition is None:
        raise InvalidReactiveInput(
            f"reactive task {task.name!r}: its target is partitioned ({partitions_def}) but the task has no "
            "partition=: pass partition=(entity, parameter) for time-window partitions (the partitions its new "
            "values cover), or partition=callable(values) -> partition key"
        )
    if callable(task.partition):
        choose = task.partition

        def by_callable(values: Values, last: Values) -> tuple[str, dict[ParameterKey, datetime]]:
            return str(choose(values)), dict(values)

        return by_callable
    if not isinstance(partitions_def, TimeWindowPartitionsDefinition):
        raise InvalidReactiveInput(
            f"reactive task {task.name!r}: partition=(entity, parameter) needs time-window partitions; "
            f"its target has {partitions_def}: pass partition=callable(values) -> partition key"
        )
    return time_window_partitioner(partitions_def, task.partition)


def time_window_partitioner(partitions_def: TimeWindowPartitionsDefinition, key: ParameterKey) -> Partitioner:
    """One run per time window, oldest first: the window holding the first new value of ``key``.

    New data of ``key`` is ``[last, current)``: the run is for the window that holds ``last`` (or, on a first
    run, the one holding the newest data, just before ``current``); on success it commits ``key`` as the
    window's end (at most ``current``), so the trigger fires again for the next window until it is caught up.
    """
    epsilon = timedelta(microseconds=1)

    def choose(values: Values, last: Values) -> tuple[str, dict[ParameterKey, datetime]]:
        current, previous = values[key], last.get(key)
        point = previous if previous is not None and previous < current else current - epsilon
        partition_key = partitions_def.get_partition_key_for_timestamp(point.timestamp())
        if not partitions_def.has_partition_key(partition_key):
            raise PartitionNotReady(partition_key, f"it holds {key[0]}/{key[1]} = {point.isoformat()}")
        window = partitions_def.time_window_for_partition_key(partition_key)
        return partition_key, {**values, key: min(window.end, current)}

    return choose


class YamlTask(BaseModel):
    """A reactive task as a ``defs.yaml`` writes it: the trigger is data (``kind:`` and its fields), the target a
    job (``'module:attribute'``, a module outside the defs folder: the component adds the job) or asset keys;
    :meth:`task` makes the :class:`ReactiveTask`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: TaskName
    job: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$",
        max_length=500,
        description="'module:attribute' of the job to launch (defined outside the defs folder).",
    )
    assets: list[str] | None = Field(
        default=None, min_length=1, max_length=1000, description="Asset keys to materialize ('shop/sales_mart')."
    )
    trigger: ReactiveTrigger
    priority: Priority = 0
    timezone: TimeZone = "UTC"
    produces: CtlKeys = ()
    partition: tuple[str, str] | None = Field(
        default=None, description="(entity, parameter) whose new values pick time-window partitions."
    )
    run_config: dict[str, Any] | None = None
    tags: dict[str, str] | None = None
    deadline: str | dict[str, Any] | None = Field(default=None, description="A cron expression, or Deadline fields.")
    on_deadline: Literal["alert", "run"] = "alert"

    @field_validator("trigger", mode="before")
    @classmethod
    def _trigger_fields(cls, value: object) -> object:
        problems = trigger_data_problems(value) if isinstance(value, Mapping) else []
        if problems:
            raise ValueError("; ".join(f"{'.'.join(map(str, path))}: {text}" for path, text in problems))
        return value

    @model_validator(mode="after")
    def _one_target(self) -> "YamlTask":
        if (self.job is None) == (self.assets is None):
            raise ValueError("give either job or assets")
        if self.partition is not None and self.partition not in parameters(self.trigger):
            read = ", ".join(f"{e}/{p}" for e, p in sorted(parameters(self.trigger)))
            raise ValueError(f"partition {self.partition[0]}/{self.partition[1]} is not read by the trigger ({read})")
        try:
            deadline_from(self.deadline)
        except InvalidReactiveInput as exc:
            raise ValueError(f"deadline: {exc}") from None
        return self

    def task(self) -> ReactiveTask:
        """The task, its job loaded."""
        if self.job is not None:
            target = load_reference(self.job, f"reactive task {self.name!r}: job", error=InvalidReactiveInput)
            if not isinstance(target, Job):
                raise InvalidReactiveInput(f"reactive task {self.name!r}: job: {self.job} is no Dagster job")
        else:
            target = [AssetKey.from_user_string(a) for a in self.assets or []]
        fields = self.model_dump(exclude={"name", "job", "assets", "trigger"}, exclude_none=True)
        return ReactiveTask(self.name, target, self.trigger, **fields)
