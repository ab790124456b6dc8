"""CallMeBack delayed callbacks: call an HTTP endpoint (or launch a Dagster job) at a given moment.

Dagster-free: the Dagster shell lives in ``cmb_dagster.callbacks.dagster_defs``.
"""

from cmb_dagster.callbacks.client import CallbackClient, CleanReport
from cmb_dagster.callbacks.delivery import REJECT_HEADERS, JobLauncher
from cmb_dagster.callbacks.errors import (
    CallbackConflict,
    CallbackError,
    CallbackInvalidState,
    CallbackNotFound,
    CallbackValidationError,
)
from cmb_dagster.callbacks.models import (
    CallbackEvent,
    CallbackSchedule,
    CallbackSettings,
    CallbackStatus,
    NewCallback,
    RetryPolicy,
)
from cmb_dagster.callbacks.schedules import materialize_schedules
from cmb_dagster.callbacks.worker import LEASE_KIND, CallbackWorker

__all__ = [
    "LEASE_KIND",
    "REJECT_HEADERS",
    "CallbackClient",
    "CallbackConflict",
    "CallbackError",
    "CallbackEvent",
    "CallbackInvalidState",
    "CallbackNotFound",
    "CallbackSchedule",
    "CallbackSettings",
    "CallbackStatus",
    "CallbackValidationError",
    "CallbackWorker",
    "CleanReport",
    "JobLauncher",
    "NewCallback",
    "RetryPolicy",
    "materialize_schedules",
]
