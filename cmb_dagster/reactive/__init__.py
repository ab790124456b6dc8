"""Reactive tasks: launch a Dagster job when the CTL values its trigger reads say so.

``ReactiveTask(name, job_or_assets, trigger)`` declares a task; ``cmb_definitions(reactive=
ReactiveOptions(tasks=[...]))`` adds one scheduler sensor per code location and the tasks' jobs.
The engine (:mod:`cmb_dagster.reactive.scheduler`) is plain Python over Postgres; the Dagster names
load Dagster on first use.
"""

from cmb_dagster._lazy import lazy_names
from cmb_dagster.reactive.admin import forget_last_values, retry_task, set_last_value, task_states
from cmb_dagster.reactive.errors import InvalidReactiveTask, ReactiveError, SchedulerConflict
from cmb_dagster.reactive.models import SchedulerSettings, TaskState

__all__ = [
    "InvalidReactiveTask",
    "ReactiveError",
    "ReactiveOptions",
    "ReactiveTask",
    "ReactiveTriggerWarning",
    "SchedulerConflict",
    "SchedulerSettings",
    "TaskState",
    "evaluation_time",
    "forget_last_values",
    "launched_values",
    "reactive_definitions",
    "reactive_sensor_context",
    "retry_task",
    "set_last_value",
    "task_states",
    "tick_reactive_sensor",
    "time_window_partitioner",
]

__getattr__ = lazy_names(
    __name__,
    {
        "ReactiveOptions": "cmb_dagster.reactive.dagster_defs",
        "ReactiveTask": "cmb_dagster.reactive.dagster_defs",
        "reactive_definitions": "cmb_dagster.reactive.dagster_defs",
        "ReactiveTriggerWarning": "cmb_dagster.reactive.dagster_defs",
        "time_window_partitioner": "cmb_dagster.reactive.dagster_defs",
        "launched_values": "cmb_dagster.reactive.dagster_sensors",
        "evaluation_time": "cmb_dagster.reactive.dagster_sensors",
        "reactive_sensor_context": "cmb_dagster.reactive.dagster_testing",
        "tick_reactive_sensor": "cmb_dagster.reactive.dagster_testing",
    },
)
