"""Reactive tasks in Dagster: ``ReactiveTask`` (a job or asset selection plus a trigger) and their Definitions."""

import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from dagster import AssetSelection, DefaultSensorStatus, Definitions, JobDefinition, define_asset_job
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cmb_dagster.ctl.dagster_resources import CtlResource
from cmb_dagster.reactive.dagster_sensors import scheduler_sensor
from cmb_dagster.reactive.errors import InvalidReactiveTask
from cmb_dagster.reactive.models import CtlKeys, SchedulerSettings, TaskName, TaskSpec
from cmb_dagster.resources import CmbResource
from cmb_dagster.triggers import Trigger, check
from cmb_dagster.triggers.chunks import get_zone

Job = JobDefinition | UnresolvedAssetJobDefinition


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
    trigger: Trigger
    priority: int = Field(default=0, ge=-(2**31), lt=2**31, description="Higher launches first when runs are capped.")
    timezone: str = Field(default="UTC", description="IANA zone for chunk triggers without their own.")
    produces: CtlKeys = Field(
        default=(), description="(entity, parameter) pairs the job writes to CTL; holds lower-priority tasks."
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
    ) -> None:
        try:
            super().__init__(
                name=name, target=target, trigger=trigger, priority=priority, timezone=timezone, produces=produces
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'][:1]) or 'task'}: {e['msg']}" for e in exc.errors()
            )
            raise InvalidReactiveTask(f"reactive task {name!r}: {problems}") from None

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        get_zone(value)
        return value

    @model_validator(mode="after")
    def _target_is_runnable(self) -> "ReactiveTask":
        if isinstance(self.target, Sequence) and not isinstance(self.target, str) and not self.target:
            raise ValueError("target selects no asset")
        return self

    def job(self, prefix: str = "cmb_") -> Job:
        """The job this task launches (for an asset selection, an asset job ``<prefix>reactive_<task>``)."""
        if isinstance(self.target, Job):
            return self.target
        return define_asset_job(f"{prefix}reactive_{re.sub(r'[^A-Za-z0-9_]', '_', self.name)}", selection=self.target)

    @property
    def spec(self) -> TaskSpec:
        """The engine's view of the task."""
        return TaskSpec(
            name=self.name, trigger=self.trigger, priority=self.priority, timezone=self.timezone, produces=self.produces
        )

    @property
    def warnings(self) -> list[str]:
        """Advice on the trigger: one that does not depend on the last run's values may fire again on every new value."""
        return check(self.trigger)


class ReactiveOptions(BaseModel):
    """What ``cmb_definitions(reactive=...)`` adds: the tasks of a code location and how their scheduler paces itself.

    Defaults: at most 10 reactive runs queued or running, a tick every 10 s time-boxed to 20 s, retries after
    30 s doubling up to 1 h, the sensor ``<prefix>reactive_scheduler`` running from the start.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    tasks: list[ReactiveTask]
    name: str | None = Field(
        default=None, description="Scheduler name keying task state; default: the code location's name."
    )
    max_concurrent_runs: int = Field(default=10, ge=1, description="Cap of reactive runs queued or running.")
    minimum_interval_seconds: int = Field(default=10, ge=1)
    tick_seconds: float = Field(default=20.0, gt=0, le=50, description="Time box of a tick (Dagster's limit is 60 s).")
    batch_size: int = Field(default=2000, ge=1, description="Tasks evaluated per transaction.")
    retry_backoff: timedelta = Field(default=timedelta(seconds=30), ge=timedelta(0))
    max_retry_backoff: timedelta = Field(default=timedelta(hours=1), ge=timedelta(0))
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING
    sensor_name: str = "reactive_scheduler"

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
            raise InvalidReactiveTask(f"reactive options: {problems}") from None

    @model_validator(mode="after")
    def _names_are_unique(self) -> "ReactiveOptions":
        names = [task.name for task in self.tasks]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reactive task names must be unique; repeated: {', '.join(duplicates)}")
        return self

    @property
    def settings(self) -> SchedulerSettings:
        return SchedulerSettings(
            max_concurrent_runs=self.max_concurrent_runs,
            tick_seconds=self.tick_seconds,
            batch_size=self.batch_size,
            retry_backoff=self.retry_backoff,
            max_retry_backoff=self.max_retry_backoff,
        )

    def definitions(self, resource: CmbResource | None = None, *, prefix: str = "cmb_") -> Definitions:
        """The scheduler sensor, the tasks' jobs and the ``ctl`` resource."""
        jobs: dict[str, Any] = {}
        job_names: dict[str, str] = {}
        for task in self.tasks:
            job = task.job(prefix)
            if job.name in jobs and jobs[job.name] is not job:
                raise InvalidReactiveTask(f"reactive task {task.name!r}: another job is named {job.name!r}")
            jobs.setdefault(job.name, job)
            job_names[task.name] = job.name
        sensor = scheduler_sensor(
            sensor_name=f"{prefix}{self.sensor_name}",
            scheduler_name=self.name,
            tasks=[task.spec for task in self.tasks],
            job_names=job_names,
            jobs=list(jobs.values()),
            settings=self.settings,
            minimum_interval_seconds=self.minimum_interval_seconds,
            default_status=self.default_status,
        )
        return Definitions(
            jobs=list(jobs.values()), sensors=[sensor], resources={"ctl": CtlResource(cmb=resource or CmbResource())}
        )


def reactive_definitions(
    options: ReactiveOptions, resource: CmbResource | None = None, *, prefix: str = "cmb_"
) -> Definitions:
    """Definitions for reactive tasks: one scheduler sensor, the tasks' jobs and the ``ctl`` resource."""
    return options.definitions(resource, prefix=prefix)
