"""Handler event queue: code emits events to named handlers; workers run them with delays, timestamp locks,
retries with backoff, pause/block rules and a dead-letter table. Postgres is the truth; LISTEN/NOTIFY only
tells workers when to look.
"""

import warnings
from typing import Any

from cmb_dagster.eventqueue.admin import block, dead_letters, pause, register, replay, rules, status, unblock, unpause
from cmb_dagster.eventqueue.errors import EventQueueError, InvalidEventQueueInput, NotDead, UnknownHandler
from cmb_dagster.eventqueue.handlers import CronHandler, Handler, HandlerRegistry
from cmb_dagster.eventqueue.models import (
    Event,
    EventQueueOptions,
    EventQueueStatus,
    HandlerConfig,
    HandlerStatus,
    WorkerSettings,
)
from cmb_dagster.eventqueue.queue import emit, emit_many
from cmb_dagster.eventqueue.worker import Edge, EventWorker
from cmb_dagster.flow import FlowLimits, RateLimit
from cmb_dagster.models import Backoff

__all__ = [
    "Backoff",
    "CronHandler",
    "Edge",
    "Event",
    "EventQueueError",
    "EventQueueOptions",
    "EventQueueStatus",
    "EventWorker",
    "FlowLimits",
    "Handler",
    "HandlerConfig",
    "HandlerRegistry",
    "HandlerStatus",
    "InvalidEventQueueInput",
    "NotDead",
    "RateLimit",
    "UnknownHandler",
    "WorkerSettings",
    "block",
    "dead_letters",
    "emit",
    "emit_many",
    "pause",
    "register",
    "replay",
    "rules",
    "status",
    "unblock",
    "unpause",
]


def __getattr__(name: str) -> Any:
    if name == "InvalidInput":  # deprecated: the engine raises InvalidEventQueueInput, an InvalidInput
        warnings.warn(
            "cmb_dagster.eventqueue.InvalidInput is deprecated: use InvalidEventQueueInput "
            "(or cmb_dagster.InvalidInput)",
            DeprecationWarning,
            stacklevel=2,
        )
        from cmb_dagster.errors import InvalidInput

        return InvalidInput
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
