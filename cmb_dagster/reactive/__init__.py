"""Reactive tasks as Dagster sensors: launch a job when the CTL values its trigger reads say so.

``ReactiveTask(name, job_or_assets, trigger)`` declares a task; ``reactive_definitions(tasks)`` (or
``cmb_definitions(reactive_tasks=tasks)``) adds one scheduler sensor per code location, the tasks'
jobs and the ``ctl`` resource. The scheduling logic itself lives in :mod:`cmb_dagster.ctl.scheduler`.
"""

from cmb_dagster.reactive.dagster_defs import ReactiveScheduler, ReactiveTask, reactive_definitions
from cmb_dagster.reactive.resources import CTL_METADATA_KEY, CtlResource, ctl_metadata
from cmb_dagster.reactive.sensors import launched_values

__all__ = [
    "CTL_METADATA_KEY",
    "CtlResource",
    "ReactiveScheduler",
    "ReactiveTask",
    "ctl_metadata",
    "launched_values",
    "reactive_definitions",
]
