"""Handler event queue (after the "Events V2" design): code emits events to named handlers; workers run them with delays,
timestamp locks, retries with backoff, pause/block rules and a dead-letter table. Postgres is the truth;
LISTEN/NOTIFY only tells workers when to look.
"""

from cmb_dagster.eventqueue.admin import block, dead_letters, pause, register, replay, rules, status, unblock, unpause
from cmb_dagster.eventqueue.errors import InvalidInput, NotDead, UnknownHandler
from cmb_dagster.eventqueue.handlers import CronHandler, Handler, HandlerRegistry
from cmb_dagster.eventqueue.models import Event, EventQueueOptions, HandlerConfig, WorkerSettings
from cmb_dagster.eventqueue.queue import emit, emit_many
from cmb_dagster.eventqueue.worker import Edge, EventWorker

__all__ = [
    "CronHandler",
    "Edge",
    "Event",
    "EventQueueOptions",
    "EventWorker",
    "Handler",
    "HandlerConfig",
    "HandlerRegistry",
    "InvalidInput",
    "NotDead",
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
