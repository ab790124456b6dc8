"""Delayed callbacks: call an HTTP endpoint (or launch a Dagster job) at a given moment, with retries.

``CallbackClient`` creates, updates and cancels events; ``CallbackWorker`` calls them back;
``cmb_definitions(callbacks=CallbackOptions(...))`` runs workers in Dagster.
"""

from cmb_dagster._lazy import lazy_names
from cmb_dagster.callbacks.admin import callback_counts

from cmb_dagster.callbacks.client import CallbackClient, CleanReport
from cmb_dagster.callbacks.delivery import REJECT_HEADERS
from cmb_dagster.callbacks.errors import (
    CallbackConflict,
    CallbackError,
    CallbackInvalidState,
    CallbackNotFound,
    CallbackTimeout,
    CallbackValidationError,
)
from cmb_dagster.callbacks.models import (
    CallbackCounts,
    CallbackEvent,
    CallbackSchedule,
    CallbackSettings,
    CallbackStatus,
    NewCallback,
    RetryPolicy,
)
from cmb_dagster.callbacks.schedules import materialize_schedules
from cmb_dagster.callbacks.worker import CallbackWorker

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
    "CallbackValidationError",
    "CallbackWorker",
    "CleanReport",
    "NewCallback",
    "RetryPolicy",
    "callback_counts",
    "materialize_schedules",
]

__getattr__ = lazy_names(__name__, {"CallbackOptions": "cmb_dagster.callbacks.dagster_defs"})
