"""Reactive tasks: launch a Dagster job when the CTL values its trigger reads say so.

``ReactiveTask(name, job_or_assets, trigger)`` declares a task; ``cmb_definitions(reactive=
ReactiveOptions(tasks=[...]))`` adds one scheduler sensor per code location and the tasks' jobs.
The engine (:mod:`cmb_dagster.reactive.engine`) is plain Python over Postgres; :class:`ReactiveWorker` ticks it
outside Dagster. The Dagster names load Dagster on first use.
"""

from cmb_dagster._lazy import lazy_names
from cmb_dagster.reactive.admin import forget_last_values, retry_task, set_last_value, status
from cmb_dagster.reactive.deadlines import Deadline, DeadlineState
from cmb_dagster.reactive.errors import InvalidReactiveInput, PartitionNotReady, ReactiveError, SchedulerConflict
from cmb_dagster.reactive.models import (
    ReactiveChecks,
    ReactiveOptions,
    ReactiveStatus,
    RunInfo,
    RunState,
    SchedulerSettings,
    SchedulerState,
    TaskSpec,
    TaskState,
)
from cmb_dagster.reactive.worker import ReactiveWorker

__all__ = [
    "Deadline",
    "DeadlineState",
    "InvalidReactiveInput",
    "PartitionNotReady",
    "ReactiveChecks",
    "ReactiveEntityWarning",
    "ReactiveError",
    "ReactiveOptions",
    "ReactiveStatus",
    "ReactiveTask",
    "ReactiveTriggerWarning",
    "ReactiveWorker",
    "RunInfo",
    "RunState",
    "SchedulerConflict",
    "SchedulerSettings",
    "SchedulerState",
    "TaskSpec",
    "TaskState",
    "evaluation_time",
    "forget_last_values",
    "launched_values",
    "reactive_definitions",
    "reactive_sensor_context",
    "retry_task",
    "set_last_value",
    "status",
    "tick_reactive_sensor",
    "time_window_partitioner",
]

__getattr__ = lazy_names(
    __name__,
    {
        "InvalidReactiveTask": "cmb_dagster.reactive.errors",  # deprecated: InvalidReactiveInput
        "task_states": "cmb_dagster.reactive.admin",  # deprecated: status(...).tasks
        "ReactiveTask": "cmb_dagster.reactive.dagster_defs",
        "reactive_definitions": "cmb_dagster.reactive.dagster_defs",
        "ReactiveTriggerWarning": "cmb_dagster.reactive.dagster_defs",
        "ReactiveEntityWarning": "cmb_dagster.reactive.dagster_defs",
        "time_window_partitioner": "cmb_dagster.reactive.dagster_defs",
        "launched_values": "cmb_dagster.reactive.dagster_sensors",
        "evaluation_time": "cmb_dagster.reactive.dagster_sensors",
        "reactive_sensor_context": "cmb_dagster.reactive.dagster_testing",
        "tick_reactive_sensor": "cmb_dagster.reactive.dagster_testing",
    },
)
