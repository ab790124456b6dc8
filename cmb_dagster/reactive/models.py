"""Inputs, options, settings, reports and status of the reactive scheduler (no Dagster here)."""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, Field, TypeAdapter, ValidationError, computed_field, model_validator

from cmb_dagster.ctl.models import Name, ParameterKey, check_name
from cmb_dagster.health import Checks, Threshold
from cmb_dagster.isolation import DEFAULT_MAX_CRASHES
from cmb_dagster.models import Backoff, Options
from cmb_dagster.reactive.deadlines import Deadline, DeadlineState, OnDeadline
from cmb_dagster.reactive.errors import InvalidReactiveInput
from cmb_dagster.reactive.explanations import Explanation, stored_trigger
from cmb_dagster.triggers import Trigger, parameters
from cmb_dagster.triggers.chunks import get_zone

_TASK_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
SCHEDULER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,49}$")  # part of a pub/sub consumer id
TaskName = Annotated[str, Field(pattern=_TASK_NAME.pattern)]
LOWEST_PRIORITY, ABOVE_HIGHEST_PRIORITY = -(2**31), 2**31  # bounds of the priority column (integer)
Priority = Annotated[int, Field(ge=LOWEST_PRIORITY, lt=ABOVE_HIGHEST_PRIORITY)]


def sorted_keys(keys: Sequence[tuple[str, str]]) -> tuple[ParameterKey, ...]:
    """CTL parameters without repeats, in a stable order."""
    return tuple(sorted({(entity, parameter) for entity, parameter in keys}))


CtlKeys = Annotated[tuple[tuple[Name, Name], ...], AfterValidator(sorted_keys)]
"""(entity, parameter) pairs, e.g. what a task's job writes to CTL."""


def _storable_names(trigger: Trigger) -> Trigger:
    for entity, parameter in sorted(parameters(trigger)):
        check_name(entity, "entity")
        check_name(parameter, "parameter")
    return trigger


ReactiveTrigger = Annotated[Trigger, AfterValidator(_storable_names)]
"""A trigger whose entity and parameter names are CTL names (they are stored with the task)."""


def _known_zone(value: str) -> str:
    get_zone(value)
    return value


TimeZone = Annotated[str, AfterValidator(_known_zone)]
"""An IANA time zone name."""


class TaskSpec(Options):
    """What the engine needs to know of a reactive task: name, trigger, priority, time zone, CTL it writes, and
    its deadline."""

    error: ClassVar[type[InvalidReactiveInput]] = InvalidReactiveInput

    name: TaskName
    trigger: ReactiveTrigger
    priority: Priority = 0
    timezone: TimeZone = Field(default="UTC", description="IANA zone for chunk triggers without their own.")
    produces: CtlKeys = Field(default=(), description="(entity, parameter) pairs the task's job writes to CTL.")
    upstream: tuple[str, ...] = Field(
        default=(),
        description="Entities (asset keys) upstream of the task's target: while a run materializing one is queued "
        "or running and this task waits, lower-priority tasks are held.",
    )
    deadline: Deadline | None = Field(default=None, description="By when the task must have run successfully.")
    on_deadline: OnDeadline = Field(
        default="alert", description="'run': a passed deadline also launches the task anyway (its run is tagged)."
    )

    @model_validator(mode="after")
    def _on_deadline_needs_one(self) -> TaskSpec:
        if self.on_deadline == "run" and self.deadline is None:
            raise ValueError("on_deadline: 'run' needs a deadline")
        return self

    @property
    def trigger_json(self) -> str:
        return self.trigger.model_dump_json()

    @property
    def deadline_json(self) -> str | None:
        """The deadline and what it does, as stored with the task (None: no deadline)."""
        if self.deadline is None:
            return None
        return json.dumps({**self.deadline.model_dump(mode="json", exclude_none=True), "on_deadline": self.on_deadline})

    @property
    def trigger_hash(self) -> str:
        """Changes when the trigger or the time zone changes (a changed trigger is evaluated as on a first release)."""
        return hashlib.sha256(f"{self.trigger_json}\n{self.timezone}".encode()).hexdigest()[:16]


RETRY_BACKOFF = Backoff(first=30, factor=2, max=3600)
"""How long a task waits after a failed run (or failed user code) before it is evaluated again: 30 s, doubling,
at most an hour."""
_RENAMED_BACKOFF_FIELDS = {"retry_backoff": "first", "max_retry_backoff": "max"}
_DURATION = TypeAdapter(timedelta)
_LONGEST_BACKOFF = timedelta(days=30)


def _backoff_seconds(name: str, value: object) -> float:
    """A deprecated ``retry_backoff`` / ``max_retry_backoff`` value (a timedelta, ISO 8601 text or seconds) in
    seconds; ValueError naming the field when it is no duration from 0 to 30 days."""
    try:
        duration = _DURATION.validate_python(value)
    except ValidationError:
        duration = None
    if duration is None or not timedelta(0) <= duration <= _LONGEST_BACKOFF:
        raise ValueError(f"{name}: expected a duration from 0 to 30 days, got {value!r}")
    return duration.total_seconds()


class _SchedulerPacing(Options):
    """What the scheduler's settings and the reactive options share: the cap of runs, the batch, the backoff."""

    error: ClassVar[type[InvalidReactiveInput]] = InvalidReactiveInput

    max_concurrent_runs: int = Field(
        default=10, ge=1, le=100_000, description="Cap of reactive runs queued or running."
    )
    batch_size: int = Field(default=2000, ge=1, le=100_000, description="Tasks evaluated per transaction.")
    backoff: Backoff = Field(
        default=RETRY_BACKOFF,
        description="Seconds a task waits after a failed run, or after its user code failed, before it is retried.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_backoff_fields(cls, data: Any) -> Any:
        """``retry_backoff`` / ``max_retry_backoff`` (timedeltas): deprecated names of ``backoff.first`` / ``.max``."""
        if not isinstance(data, dict) or not data.keys() & _RENAMED_BACKOFF_FIELDS.keys():
            return data
        warnings.warn(
            f"{cls.__name__}(retry_backoff=, max_retry_backoff=) are deprecated: use "
            "backoff=Backoff(first=, max=) in seconds",
            DeprecationWarning,
            stacklevel=4,
        )
        data = dict(data)
        given = {
            part: _backoff_seconds(old, data.pop(old)) for old, part in _RENAMED_BACKOFF_FIELDS.items() if old in data
        }
        backoff = data.get("backoff", RETRY_BACKOFF)
        base = backoff.model_dump() if isinstance(backoff, Backoff) else dict(backoff)
        data["backoff"] = {**base, **given}
        return data


class SchedulerSettings(_SchedulerPacing):
    """How a reactive scheduler paces itself."""

    tick_seconds: float = Field(default=20.0, gt=0, le=3600, description="Time box of one tick; the next resumes.")
    idle_sleep: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="Seconds a ReactiveWorker waits after a tick that had nothing to do (a CTL change wakes it "
        "sooner).",
    )
    launch_grace: timedelta = Field(
        default=timedelta(minutes=2),
        gt=timedelta(0),
        le=timedelta(days=1),
        description="Re-request a launch whose run never appeared.",
    )
    takeover_after: timedelta = Field(
        default=timedelta(minutes=10),
        gt=timedelta(0),
        le=timedelta(days=30),
        description="Another code location may take a scheduler name over once its owner has not ticked for this long.",
    )
    max_crashes: int = Field(
        default=DEFAULT_MAX_CRASHES,
        ge=1,
        le=1000,
        description="Runs of a task's user code that may end with the death of their process before the task is "
        "parked.",
    )
    callable_timeout: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Seconds a task's partition, run config or tags callable may run: past it the task backs off as "
        "if the callable raised. A tick starts such calls within its time box, or within this long of its first "
        "call if that ends later; the tasks left wait for the next tick.",
    )


class ReactiveChecks(Checks):
    """Limits of the reactive tasks asset's checks (a task's deadline check has none: it fails once the deadline
    passed)."""

    error: ClassVar[type[InvalidReactiveInput]] = InvalidReactiveInput

    tick_age: Threshold = Field(
        default=Threshold(warn_at=3, error_at=10),
        description="Time since the reactive scheduler sensor's last tick, in its intervals "
        "(minimum_interval_seconds).",
    )


class ReactiveOptions(_SchedulerPacing):
    """What ``cmb_definitions(reactive=...)`` adds: the tasks of a code location and how their scheduler paces itself.

    Defaults: at most 10 reactive runs queued or running, a tick every 10 s time-boxed to 20 s, retries after
    30 s doubling up to 1 h, 30 s for a task's callables, the sensor ``<prefix>reactive_scheduler`` running from
    the start. ``tasks`` (``ReactiveTask``) and ``default_status`` (Dagster's ``DefaultSensorStatus``) are
    checked when the definitions are built.
    """

    tasks: list[Any] = Field(description="The code location's ReactiveTask definitions.")
    name: str | None = Field(
        default=None, description="Scheduler name keying task state; default: the code location's name."
    )
    minimum_interval_seconds: int = Field(default=10, ge=1, le=86400, description="Seconds between the sensor's ticks.")
    tick_seconds: float = Field(default=20.0, gt=0, le=50, description="Time box of a tick (Dagster's limit is 60 s).")
    callable_timeout: float = Field(
        default=30.0,
        gt=0,
        le=50,
        description="Seconds a task's partition, run_config or tags callable may run before the task backs off "
        "as if it raised.",
    )
    default_status: Any = Field(default=None, description="The sensor's DefaultSensorStatus (default: RUNNING).")
    sensor_name: str = Field(default="reactive_scheduler", description="The sensor's name after the prefix.")
    observe_interval_seconds: int = Field(
        default=60,
        ge=5,
        le=86400,
        description="How often the status sensor counts the tasks by status and evaluates their checks.",
    )
    checks: ReactiveChecks = Field(
        default_factory=lambda: ReactiveChecks(), description="Limits of the reactive tasks asset's checks."
    )
    misspelt_entities: Literal["error", "warn"] = Field(
        default="error",
        description="A trigger entity that is no asset key but close to one (a typo?): 'error' refuses the "
        "definitions, 'warn' warns (ReactiveEntityWarning) when a job or another system sets its CTL values.",
    )

    @model_validator(mode="after")
    def _names_are_unique(self) -> ReactiveOptions:
        names = [getattr(task, "name", None) for task in self.tasks]
        duplicates = sorted({n for n in names if n is not None and names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reactive task names must be unique; repeated: {', '.join(duplicates)}")
        return self

    @property
    def settings(self) -> SchedulerSettings:
        """The scheduler's settings these options give."""
        shared = ("max_concurrent_runs", "tick_seconds", "batch_size", "backoff", "callable_timeout")
        return SchedulerSettings(**{name: getattr(self, name) for name in shared})

    def definitions(self, resource: Any = None, *, prefix: str = "cmb_", assets: Sequence[Any] = ()) -> Any:
        """Deprecated: ``reactive_definitions(options, resource=..., prefix=..., assets=...)``."""
        from cmb_dagster.reactive.dagster_defs import reactive_definitions

        warnings.warn(
            "ReactiveOptions.definitions() is deprecated: use reactive_definitions(options, ...)",
            DeprecationWarning,
            stacklevel=2,
        )
        return reactive_definitions(self, resource=resource, prefix=prefix, assets=assets)


class RunState(StrEnum):
    """Where a launched run is."""

    ACTIVE = "active"  # queued, starting, running or canceling
    SUCCESS = "success"
    FAILURE = "failure"  # failed or canceled


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    state: RunState


RunLookup = Callable[[str, Sequence[str]], Mapping[str, RunInfo]]
"""``lookup(scheduler, run_keys)`` -> the runs found, by run_key (keys without a run yet are left out)."""


@dataclass(frozen=True)
class ManualRun:
    """A successful run launched by hand with a task's tag: its values become the task's last-seen values."""

    task: str
    run_id: str
    started_at: datetime
    finished_at: datetime
    values: dict[ParameterKey, datetime] | None = None  # from its values tag; None: CTL as of started_at


ManualLookup = Callable[[datetime | None], Sequence[ManualRun]]
"""``lookup(after)`` -> successful hand-launched runs that finished after ``after`` (None: all)."""

Partitioner = Callable[
    [Mapping[ParameterKey, datetime], Mapping[ParameterKey, datetime]], tuple[str, dict[ParameterKey, datetime]]
]
"""``partitioner(values, last)`` -> (partition key, the values that partition's run commits on success)."""


LaunchOptions = Callable[[Mapping[ParameterKey, datetime]], tuple[Mapping[str, Any] | None, Mapping[str, str]]]
"""``options(values)`` -> (run config, extra run tags) of a launch on ``values`` (user code: it runs in a child
process; :class:`FixedLaunchOptions` for values known beforehand)."""


@dataclass(frozen=True)
class FixedLaunchOptions:
    """The run config and extra run tags of every launch of a task, as values: no user code runs to get them."""

    run_config: Mapping[str, Any] | None = None
    tags: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, values: Mapping[ParameterKey, datetime]) -> tuple[Mapping[str, Any] | None, Mapping[str, str]]:
        return self.run_config, self.tags


@dataclass(frozen=True)
class Launch:
    """A run to request: the task, its run_key and the CTL values it runs on (its trigger's inputs); ``why`` it
    runs is rendered when read (``reason``)."""

    task: str
    run_key: str
    attempt: int
    values: dict[ParameterKey, datetime]
    why: str | Explanation
    relaunch: bool = False
    partition_key: str | None = None
    run_config: Mapping[str, Any] | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    deadline: datetime | None = None  # the passed deadline this run was launched for (on_deadline='run')

    @property
    def reason(self) -> str:
        """Why the task runs: its trigger's evaluation, and the retry or partition it runs for."""
        return str(self.why)


Launcher = Callable[[Sequence[Launch]], None]
"""``launch(launches)`` requests the runs a tick decided on (the sensor returns them as run requests instead)."""


@dataclass(frozen=True)
class SeenRun:
    """A launched run seen for the first time: what to write in its log (why it runs, on which values)."""

    task: str
    run_id: str
    run_key: str
    values: dict[ParameterKey, datetime]
    why: str | Explanation

    @property
    def reason(self) -> str:
        """Why the run was launched (rendered when read)."""
        return str(self.why)


@dataclass(frozen=True)
class TaskEvent:
    """What the tick did with one task, and why (rendered when read: ``detail``)."""

    task: str
    action: str  # launched, relaunched, ready, waiting, error, in progress, succeeded, failed, capped, held
    why: str | Explanation

    @property
    def detail(self) -> str:
        return str(self.why)

    def line(self) -> str:
        return f"{self.task}: {self.action} - {self.detail}"


@dataclass
class TickReport:
    """Everything one tick did, for the sensor's log and skip reason."""

    scheduler: str
    launches: list[Launch] = field(default_factory=list)
    events: list[TaskEvent] = field(default_factory=list)
    changes: int = 0
    evaluated: int = 0
    complete: bool = True
    busy: str | None = None
    warnings: list[str] = field(default_factory=list)
    manual: int = 0
    seen_runs: list[SeenRun] = field(default_factory=list)
    definitions_synced: bool = False
    seconds: float = 0.0

    def note(self, task: str, action: str, detail: str | Explanation) -> None:
        self.events.append(TaskEvent(task, action, detail))

    @property
    def idle(self) -> bool:
        """Whether the tick found nothing to do (no change read, no task evaluated, nothing to say)."""
        return not (
            self.busy
            or self.changes
            or self.evaluated
            or self.events
            or self.launches
            or self.manual
            or self.definitions_synced
            or not self.complete
        )

    def summary(self) -> str:
        """One line: what was read, evaluated, launched and skipped."""
        if self.busy:
            return self.busy
        counts: dict[str, int] = defaultdict(int)
        for event in self.events:
            counts[event.action] += 1
        parts = [f"{self.changes} CTL change(s) read", f"{self.evaluated} task(s) evaluated"]
        parts += [f"{n} {action}" for action, n in sorted(counts.items()) if action != "launched"]
        parts.append(f"{len(self.launches)} launched")
        if self.manual:
            parts.append(f"{self.manual} hand-launched run(s) recorded")
        if self.definitions_synced:
            parts.append("task definitions synced")
        if not self.complete:
            parts.append("time box reached, the next tick resumes")
        return f"{self.scheduler}: " + ", ".join(parts) + f" in {self.seconds:.2f}s"


TASK_STATUSES = ("waiting", "ready", "launched", "backoff")
"""What a reactive task can be doing, in the order a run goes through them."""


class TaskState(BaseModel):
    """A reactive task's state as stored: status, last-seen values, run in flight, last explanation (rendered from
    its stored facts when read)."""

    scheduler: str
    name: str
    status: str
    defined: bool
    dirty: bool
    priority: int
    timezone: str
    trigger: dict[str, Any]
    last_values: dict[str, dict[str, str]]
    ready_values: dict[str, dict[str, str]] | None
    run_key: str | None
    run_id: str | None
    launched_at: datetime | None
    attempts: int
    backoff_until: datetime | None
    stored_explanation: str | None = Field(
        default=None, exclude=True, description="The explanation's text, or the lines before its facts' text."
    )
    facts: dict[str, Any] | None = Field(
        default=None, description="What its last evaluation read: the trigger's hash, when, the values."
    )
    trigger_hash: str | None = Field(default=None, exclude=True)
    evaluated_at: datetime | None
    backwards_note: str | None
    last_success_at: datetime | None
    produces: list[ParameterKey]
    partition_key: str | None = None
    shown_at: datetime | None = None  # when the tick log last showed its explanation (a waiting task: hourly)
    wake_at: datetime | None = None  # when time alone can make it launch (a Settle, a deadline that runs it)
    deadline: dict[str, Any] | None = None  # its Deadline's fields and on_deadline
    deadline_since: datetime | None = None  # when the deadline was defined: earlier deadlines are not enforced

    @computed_field  # type: ignore[prop-decorator]
    @cached_property
    def explanation(self) -> str | None:
        """Why its trigger fired or waits at its last evaluation (or why it was launched)."""
        if self.stored_explanation is None and self.facts is None:
            return None
        trigger = stored_trigger(self.trigger) if self.facts is not None else None
        return str(Explanation.stored(self.stored_explanation, self.facts, trigger, self.trigger_hash, self.timezone))

    def deadline_state(self, now: datetime) -> DeadlineState | None:
        """Where the task stands against its deadline at ``now`` (None: it has none)."""
        if self.deadline is None or self.deadline_since is None:
            return None
        fields = {k: v for k, v in self.deadline.items() if k != "on_deadline"}
        return Deadline(**fields).state(now, self.timezone, self.last_success_at, self.deadline_since)

    def deadline_text(self) -> str:
        """``'cron 0 9 * * * in UTC'`` (and ``', runs the task when passed'``), or '' without a deadline."""
        if self.deadline is None:
            return ""
        fields = {k: v for k, v in self.deadline.items() if k != "on_deadline"}
        runs = ", runs the task when passed" if self.deadline.get("on_deadline") == "run" else ""
        return Deadline(**fields).describe(self.timezone) + runs


class SchedulerState(BaseModel):
    """A reactive scheduler's last tick: when it started (``ticked_at``) and how long it took."""

    name: str
    location: str | None
    ticked_at: datetime | None
    tick_seconds: float | None


class ReactiveStatus(BaseModel):
    """The stored state of reactive tasks (``cmb-dagster reactive status``), and how many are in each status;
    ``schedulers``: each scheduler's last tick."""

    tasks: list[TaskState]
    schedulers: list[SchedulerState] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def counts(self) -> dict[str, int]:
        """Tasks per status (``waiting``, ``ready``, ``launched``, ``backoff``)."""
        return dict(sorted(Counter(task.status for task in self.tasks).items()))
