"""Inputs and settings of the event queue: events, per-handler settings, worker and Dagster options."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cmb_dagster import inputs
from cmb_dagster.inputs import check_seconds, check_text
from cmb_dagster.isolation import DEFAULT_MAX_CRASHES

DEFAULT_NAMESPACE = "default"
DEFAULT_MODULE = "worker"  # the original design's event space of events emitted by code
CRON_MODULE = "cron"  # the event space of events emitted by cron handlers
DEFAULT_MODIFIER = "_"
MAX_NAME_LENGTH = 200


@dataclass(frozen=True, slots=True)
class Event:
    """An event as a handler sees it."""

    id: int
    namespace: str
    module: str
    handler: str
    modifier: str
    value: Any
    retries: int
    enqueued_at: datetime


@dataclass(frozen=True, slots=True)
class DeadEvent:
    """An event in the dead-letter table, with its last error."""

    id: int
    namespace: str
    module: str
    handler: str
    modifier: str
    value: Any
    retries: int
    enqueued_at: datetime
    died_at: datetime
    error: str
    traceback: str


@dataclass(frozen=True, slots=True)
class HandlerStatus:
    """What a handler has in the queue (``held``: parked by a pause or block rule)."""

    handler: str
    kind: str
    queued: int
    delayed: int
    locked: int
    held: int
    dead: int
    oldest_queued_seconds: float
    rules: list[str]


@dataclass(frozen=True, slots=True)
class Rule:
    """A scheduling rule: ``pause`` (users) or ``block`` (admins) for a (namespace, handler, event space)."""

    rule_type: str
    namespace: str
    handler: str
    event_space: str
    created_at: datetime
    held: int


class HandlerConfig(BaseModel):
    """Per-handler settings: how long a claim holds, how long a call may run, how often and how late a
    failing event is retried, and how many crashed runs park it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lock_expiry: float = Field(default=300.0, gt=0, le=86400, description="Seconds a claim holds without its worker renewing it (a dead worker's events are taken over after this).")
    timeout: float = Field(default=300.0, gt=0, le=86400, description="Seconds a call may run; then it fails (the event is retried) and is abandoned.")
    max_crashes: int = Field(default=DEFAULT_MAX_CRASHES, ge=1, le=1000, description="Runs of one event that may end with the death of their worker before it is dead-lettered.")
    max_retries: int = Field(default=3, ge=0, le=1000, description="Retries after the first attempt; then the event is dead-lettered.")
    retry_delay: float = Field(default=1.0, ge=0, le=86400, description="Delay before the first retry, doubled each retry.")
    max_retry_delay: float = Field(default=300.0, ge=0, le=30 * 86400, description="Upper bound of the retry delay.")

    def backoff(self, retries: int) -> float:
        """Seconds to wait before retry number ``retries + 1``."""
        return min(self.max_retry_delay, self.retry_delay * 2 ** min(retries, 60))


class WorkerSettings(BaseModel):
    """How an event queue worker polls, listens and claims."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(default=100, ge=1, le=10_000, description="Events claimed in one statement.")
    sweep_interval: float = Field(default=2.0, gt=0, le=3600, description="Seconds between sweeps when no notification comes.")
    listen: bool = Field(default=True, description="Wake on LISTEN/NOTIFY hints (off: sweeps only).")
    heartbeat: float = Field(default=5.0, gt=0, le=3600, description="Seconds of silence after which the listener checks its connection.")
    cron_interval: float = Field(default=1.0, gt=0, le=3600, description="Seconds between cron checks.")
    lease_ttl: float = Field(default=10.0, gt=0, le=3600, description="TTL of the worker's liveness lease.")


class EventQueueOptions(BaseModel):
    """What ``cmb_definitions(events=...)`` adds: worker jobs kept running by sensors, and per-handler observations.

    ``handlers``: a ``HandlerRegistry``, or a list of registries, handlers and cron handlers.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    handlers: Any = Field(description="A HandlerRegistry, or a list of registries / Handler / CronHandler.")
    workers: int = Field(default=1, ge=1, le=64, description="Worker jobs; all claim from one queue (SKIP LOCKED).")
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    observe_interval_seconds: int = Field(default=30, ge=5, le=86400, description="How often the status sensor observes handlers.")

    def registry(self):  # type: ignore[no-untyped-def]
        """The handlers as one ``HandlerRegistry``."""
        from cmb_dagster.eventqueue.handlers import HandlerRegistry

        return HandlerRegistry.of(self.handlers)


# -- validation of emitted events ---------------------------------------------------------------------


def check_name(field: str, value: object) -> str:
    """``value`` as a name (namespace, handler, module, modifier), or InvalidInput naming ``field``."""
    return check_text(value, field, max_length=MAX_NAME_LENGTH)


def to_json(value: object, field: str = "value") -> str:
    """``value`` as JSON text within the payload limit, or InvalidInput naming ``field``."""
    return inputs.to_json(value, field)


def delay_seconds(delay: float | timedelta | None) -> float:
    """``delay`` in seconds (None is 0), at most a century, or InvalidInput naming ``delay``."""
    return check_seconds(delay, "delay")
