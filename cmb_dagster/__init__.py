"""cmb_dagster: reactive, event-driven pipelines for Dagster on Postgres.

Everything a definitions file needs is importable from here. The engines are plain Python over
Postgres; but for the errors and ``__version__``, each name loads its module (Dagster, psycopg, pydantic) only
when first used, so the CLI and workers start fast.
"""

from importlib.metadata import PackageNotFoundError, version

from cmb_dagster._lazy import lazy_names
from cmb_dagster.errors import CmbError, ConfigError, DatabaseUnavailable, InvalidInput, SchemaTooNew

try:
    __version__ = version("cmb-dagster")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "AlertOptions",
    "CallbackOptions",
    "CallbacksComponent",
    "CmbComponent",
    "CmbError",
    "CmbResource",
    "CmbTranslator",
    "ConfigError",
    "ConsumerSpec",
    "CtlResource",
    "Database",
    "DatabaseOptions",
    "DatabaseUnavailable",
    "Deadline",
    "EventQueueComponent",
    "EventQueueOptions",
    "FlowLimits",
    "InvalidInput",
    "PubSubComponent",
    "PubSubOptions",
    "RateLimit",
    "ReactiveComponent",
    "ReactiveOptions",
    "ReactiveTask",
    "SchemaTooNew",
    "Settings",
    "Stage",
    "StageOptions",
    "StageResult",
    "StagesComponent",
    "Threshold",
    "__version__",
    "cmb_definitions",
    "ctl_metadata",
    "launched_values",
    "pubsub_sensor",
    "triggers",
]

__getattr__ = lazy_names(
    __name__,
    {
        "AlertOptions": "cmb_dagster.alerts",
        "CallbackOptions": "cmb_dagster.callbacks.models",
        "CmbComponent": "cmb_dagster.dagster_component",
        "ReactiveComponent": "cmb_dagster.dagster_component",
        "PubSubComponent": "cmb_dagster.dagster_component",
        "CallbacksComponent": "cmb_dagster.dagster_component",
        "StagesComponent": "cmb_dagster.dagster_component",
        "EventQueueComponent": "cmb_dagster.dagster_component",
        "CmbResource": "cmb_dagster.resources",
        "CmbTranslator": "cmb_dagster.dagster_translator",
        "ConsumerSpec": "cmb_dagster.pubsub.models",
        "CtlResource": "cmb_dagster.ctl.dagster_resources",
        "Database": "cmb_dagster.database",
        "Deadline": "cmb_dagster.reactive",
        "FlowLimits": "cmb_dagster.flow",
        "RateLimit": "cmb_dagster.flow",
        "PubSubOptions": "cmb_dagster.pubsub.models",
        "ReactiveOptions": "cmb_dagster.reactive.models",
        "ReactiveTask": "cmb_dagster.reactive.dagster_defs",
        "cmb_definitions": "cmb_dagster.definitions",
        "ctl_metadata": "cmb_dagster.ctl.dagster_resources",
        "launched_values": "cmb_dagster.reactive.dagster_sensors",
        "pubsub_sensor": "cmb_dagster.pubsub.dagster_defs",
        "EventQueueOptions": "cmb_dagster.eventqueue",
        "Stage": "cmb_dagster.stages",
        "StageOptions": "cmb_dagster.stages",
        "StageResult": "cmb_dagster.stages",
        "Settings": "cmb_dagster.settings",
        "Threshold": "cmb_dagster.health",
        "DatabaseOptions": "cmb_dagster.vacuum",
        "triggers": "cmb_dagster.triggers",
    },
)


def __dir__() -> list[str]:
    """The package's names, the lazy ones included (``dg list components`` finds the components among them)."""
    return sorted({*globals(), *__all__})
