"""Delayed callbacks: call an HTTP endpoint (or launch a Dagster job) at a given moment, with retries.

``CallbackClient`` creates, updates and cancels events; ``CallbackWorker`` calls them back;
``admin.status`` reports them; ``cmb_definitions(callbacks=CallbackOptions(...))`` runs workers in Dagster.
"""

from typing import Any

from cmb_dagster.callbacks import errors
from cmb_dagster.callbacks.admin import callback_counts  # noqa: F401 - deprecated: admin.status(db).totals
from cmb_dagster.callbacks.client import CallbackClient, CleanReport
from cmb_dagster.callbacks.delivery import REJECT_HEADERS
from cmb_dagster.callbacks.errors import (
    CallbackConflict,
    CallbackError,
    CallbackInvalidState,
    CallbackNotFound,
    CallbackTimeout,
    InvalidCallbackInput,
)
from cmb_dagster.callbacks.models import (
    CallbackCounts,
    CallbackEvent,
    CallbackOptions,
    CallbackSchedule,
    CallbackSettings,
    CallbacksStatus,
    CallbackStatus,
    EndpointHealth,
    EndpointPolicy,
    NewCallback,
    RetryPolicy,
)
from cmb_dagster.callbacks.schedules import materialize_schedules
from cmb_dagster.callbacks.worker import CallbackWorker
from cmb_dagster.flow import FlowLimits, RateLimit

__all__ = [
    "REJECT_HEADERS",
    "CallbackClient",
    "CallbackConflict",
    "CallbackCounts",
    "CallbackError",
    "CallbackEvent",
    "CallbackInvalidState",
    "CallbackNotFound",
    "CallbackOptions",
    "CallbackSchedule",
    "CallbackSettings",
    "CallbackStatus",
    "CallbackTimeout",
    "CallbackWorker",
    "CallbacksStatus",
    "CleanReport",
    "EndpointHealth",
    "EndpointPolicy",
    "FlowLimits",
    "InvalidCallbackInput",
    "NewCallback",
    "RateLimit",
    "RetryPolicy",
    "materialize_schedules",
]


def __getattr__(name: str) -> Any:
    return errors.renamed(__name__, name)  # the deprecated error names, for one release
