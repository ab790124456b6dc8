"""Inputs, settings and reports of the reactive scheduler (no Dagster here)."""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from cmb_dagster.ctl.models import Name, ParameterKey, check_name
from cmb_dagster.isolation import DEFAULT_MAX_CRASHES
from cmb_dagster.triggers import Trigger, parameters
from cmb_dagster.triggers.chunks import get_zone

_TASK_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
SCHEDULER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,49}$")  # part of a pub/sub consumer id
TaskName = Annotated[str, Field(pattern=_TASK_NAME.pattern)]
LOWEST_PRIORITY, ABOVE_HIGHEST_PRIORITY = -(2**31), 2**31  # bounds of the priority column (integer)


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


class TaskSpec(BaseModel):
    """What the engine needs to know of a reactive task: name, trigger, priority, time zone, CTL it writes."""

    model_config = ConfigDict(frozen=True)

    name: TaskName
    trigger: ReactiveTrigger
    priority: int = Field(default=0, ge=LOWEST_PRIORITY, lt=ABOVE_HIGHEST_PRIORITY)
    timezone: str = Field(default="UTC", description="IANA zone for chunk triggers without their own.")
    produces: CtlKeys = Field(default=(), description="(entity, parameter) pairs the task's job writes to CTL.")
    upstream: tuple[str, ...] = Field(
        default=(),
        description="Entities (asset keys) upstream of the task's target: while a run materializing one is queued "
        "or running and this task waits, lower-priority tasks are held.",
    )

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        get_zone(value)
        return value

    @property
    def trigger_json(self) -> str:
        return self.trigger.model_dump_json()

    @property
    def trigger_hash(self) -> str:
        """Changes when the trigger or the time zone changes (a changed trigger is evaluated as on a first release)."""
        return hashlib.sha256(f"{self.trigger_json}\n{self.timezone}".encode()).hexdigest()[:16]


class SchedulerSettings(BaseModel):
    """How a reactive scheduler paces itself."""

    model_config = ConfigDict(frozen=True)

    max_concurrent_runs: int = Field(default=10, ge=1, le=100_000, description="Cap of reactive runs queued or running.")
    tick_seconds: float = Field(default=20.0, gt=0, le=3600, description="Time box of one tick; the next resumes.")
    batch_size: int = Field(default=2000, ge=1, le=100_000, description="Tasks evaluated per transaction.")
    retry_backoff: timedelta = Field(default=timedelta(seconds=30), ge=timedelta(0), le=timedelta(days=30))
    max_retry_backoff: timedelta = Field(default=timedelta(hours=1), ge=timedelta(0), le=timedelta(days=30))
    launch_grace: timedelta = Field(
        default=timedelta(minutes=2), gt=timedelta(0), le=timedelta(days=1), description="Re-request a launch whose run never appeared."
    )
    takeover_after: timedelta = Field(
        default=timedelta(minutes=10),
        gt=timedelta(0),
        le=timedelta(days=30),
        description="Another code location may take a scheduler name over once its owner has not ticked for this long.",
    )
    max_crashes: int = Field(
        default=DEFAULT_MAX_CRASHES, ge=1, le=1000,
        description="Runs of a task's user code that may end with the death of their process before the task is parked.")
    callable_timeout: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Seconds a task's partition, run config or tags callable may run: past it the task backs off as "
        "if the callable raised. A tick starts such calls within its time box, or within this long of its first "
        "call if that ends later; the tasks left wait for the next tick.",
    )

    def backoff(self, failures_before: int) -> timedelta:
        """Wait after the ``failures_before + 1``-th consecutive failure."""
        return min(self.max_retry_backoff, self.retry_backoff * 2 ** min(failures_before, 30))


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
"""``options(values)`` -> (run config, extra run tags) of a launch on ``values``."""


@dataclass(frozen=True)
class Launch:
    """A run to request: the task, its run_key and the CTL values it runs on (its trigger's inputs)."""

    task: str
    run_key: str
    attempt: int
    values: dict[ParameterKey, datetime]
    reason: str
    relaunch: bool = False
    partition_key: str | None = None
    run_config: Mapping[str, Any] | None = None
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SeenRun:
    """A launched run seen for the first time: what to write in its log (why it runs, on which values)."""

    task: str
    run_id: str
    run_key: str
    values: dict[ParameterKey, datetime]
    reason: str


@dataclass(frozen=True)
class TaskEvent:
    """What the tick did with one task, and why."""

    task: str
    action: str  # launched, relaunched, ready, waiting, error, in progress, succeeded, failed, capped, held
    detail: str

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

    def note(self, task: str, action: str, detail: str) -> None:
        self.events.append(TaskEvent(task, action, detail))

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


class TaskState(BaseModel):
    """A reactive task's state as stored: status, last-seen values, run in flight, last explanation."""

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
    explanation: str | None
    evaluated_at: datetime | None
    backwards_note: str | None
    last_success_at: datetime | None
    produces: list[ParameterKey]
    partition_key: str | None = None
