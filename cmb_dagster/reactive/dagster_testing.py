"""Driving the reactive scheduler sensor in a test: the right resources, the sensor's name, an evaluation time.

>>> with instance_for_test() as instance:                                            # doctest: +SKIP
...     result = tick_reactive_sensor(defs, instance=instance, evaluation_time=moment)
...     [request] = result.run_requests
"""

from datetime import datetime
from typing import Any

from dagster import DagsterInstance, Definitions, SensorDefinition, SensorEvaluationContext, build_sensor_context

from cmb_dagster.reactive.dagster_sensors import evaluation_time as _evaluation_time
from cmb_dagster.reactive.errors import InvalidReactiveInput
from cmb_dagster.resources import CmbResource

REACTIVE_SENSOR_SUFFIX = "reactive_scheduler"


def reactive_sensor(defs: Definitions, sensor_name: str | None = None) -> SensorDefinition:
    """The reactive scheduler sensor of ``defs`` (the one whose name ends with ``reactive_scheduler``)."""
    repository = defs.get_repository_def()
    if sensor_name is not None:
        return repository.get_sensor_def(sensor_name)
    found = [s for s in repository.sensor_defs if s.name.endswith(REACTIVE_SENSOR_SUFFIX)]
    if len(found) != 1:
        names = ", ".join(s.name for s in repository.sensor_defs) or "none"
        raise InvalidReactiveInput(
            f"sensor_name: expected one reactive scheduler sensor in the definitions, found: {names}"
        )
    return found[0]


def reactive_sensor_context(
    defs: Definitions, *, instance: DagsterInstance, resource: CmbResource | None = None, **kwargs: Any
) -> SensorEvaluationContext:
    """A sensor context with the ``cmb`` resource of ``defs`` (or ``resource``) and the definitions."""
    resources = defs.resources or {}
    cmb = resource or resources.get("cmb") or CmbResource()
    return build_sensor_context(instance=instance, resources={"cmb": cmb}, definitions=defs, **kwargs)


def tick_reactive_sensor(
    defs: Definitions,
    *,
    instance: DagsterInstance,
    evaluation_time: datetime | None = None,
    resource: CmbResource | None = None,
    sensor_name: str | None = None,
) -> Any:
    """Run one tick of the reactive scheduler sensor at ``evaluation_time`` (default: the clock).

    Returns Dagster's sensor result (``run_requests``, ``skip_message``). Run the requested runs with
    ``instance.create_run_for_job(...)`` or ``job.execute_in_process(instance=..., tags=request.tags)``.
    """
    sensor = reactive_sensor(defs, sensor_name)
    context = reactive_sensor_context(defs, instance=instance, resource=resource)
    with _evaluation_time(evaluation_time):
        return sensor.evaluate_tick(context)
