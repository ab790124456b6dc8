"""Inputs, settings and status of the event queue: events, per-handler settings, worker and Dagster options,
and what :func:`cmb_dagster.eventqueue.status` reports."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, computed_field, field_validator, model_validator

from cmb_dagster import inputs
from cmb_dagster.eventqueue.errors import InvalidEventQueueInput
from cmb_dagster.executor import Isolation
from cmb_dagster.flow import MAX_VERSION, FlowLimits, KeyUse, RateLimit
from cmb_dagster.health import Checks, Threshold, Verdict
from cmb_dagster.isolation import DEFAULT_MAX_CRASHES
from cmb_dagster.models import Backoff, Options, deprecated_iteration

DEFAULT_NAMESPACE = "default"
DEFAULT_MODULE = "worker"  # the event space of events emitted by code
CRON_MODULE = "cron"  # the event space of events emitted by cron handlers
DEFAULT_MODIFIER = "_"
MAX_NAME_LENGTH = 200
MAX_PRIORITY = 1000
MAX_BATCH_BYTES = 32 * 1024 * 1024
"""Largest debounced batch as its handler receives it (the JSON text of its events); an event that would pass it
begins a new batch, and an event larger than it alone is a batch of one. Stored as jsonb a batch can take four
times its text (an array of small numbers), and one jsonb holds less than 256 MiB."""
KEY_FIELDS = ("value", "namespace", "module", "modifier")
"""What a handler's key path may start with; only ``value`` may go on (``value.account.id``)."""
RETRY_BACKOFF = Backoff(first=1.0, factor=2, max=300.0)
"""How long a failed event waits before its next attempt, unless its handler says otherwise."""


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
    priority: int
    key: str  # under the handler's key path ('' without one)


@dataclass(frozen=True, slots=True)
class DeadEvent(Event):
    """An event in the dead-letter table, with its last error."""

    died_at: datetime
    error: str
    traceback: str


@dataclass(frozen=True, slots=True)
class Rule:
    """A scheduling rule: ``pause`` (users) or ``block`` (admins) for a (namespace, handler, event space)."""

    rule_type: str
    namespace: str
    handler: str
    event_space: str
    created_at: datetime
    held: int


class HandlerStatus(BaseModel):
    """What a handler has in the queue (``held``: parked by a pause or block rule), and its key path and limits."""

    model_config = ConfigDict(frozen=True)

    handler: str
    kind: str
    queued: int
    delayed: int
    locked: int
    held: int
    dead: int
    oldest_queued_seconds: float
    rules: list[str]
    key: str | None = None
    rate_per_second: float | None = None
    burst: float | None = None
    concurrency: int | None = None


class EventQueueStatus(BaseModel):
    """The queue of every registered handler (ordered by name), the totals over them, and the use of each limited
    key (``keys``)."""

    model_config = ConfigDict(frozen=True)
    COUNTS: ClassVar[tuple[str, ...]] = ("queued", "delayed", "locked", "held", "dead")

    handlers: list[HandlerStatus]
    keys: list[KeyUse] = []

    @computed_field  # type: ignore[prop-decorator]
    @property
    def totals(self) -> dict[str, int]:
        """Events of all handlers: queued, delayed, locked, held, dead."""
        return {count: sum(getattr(row, count) for row in self.handlers) for count in self.COUNTS}

    def __iter__(self) -> Iterator[HandlerStatus]:  # type: ignore[override]
        """The rows (deprecated: iterate :attr:`handlers`)."""
        return deprecated_iteration(
            self.handlers, "iterating eventqueue.status(db) is deprecated: iterate status(db).handlers"
        )


class HandlerConfig(Options):
    """Per-handler settings: how long a claim holds, how long a call may run, how often and how late a
    failing event is retried, and how many crashed runs park it."""

    error = InvalidEventQueueInput
    RENAMED: ClassVar[dict[str, str]] = {"retry_delay": "first", "max_retry_delay": "max"}

    lock_expiry: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="Seconds a claim holds without its worker "
        "renewing it (a dead worker's events are taken over after this).",
    )
    timeout: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="Seconds a call may run; then it fails (the event is retried) and is abandoned.",
    )
    max_crashes: int = Field(
        default=DEFAULT_MAX_CRASHES,
        ge=1,
        le=1000,
        description="Runs of one event that may end with the death of their worker before it is dead-lettered.",
    )
    max_retries: int = Field(
        default=3, ge=0, le=1000, description="Retries after the first attempt; then the event is dead-lettered."
    )
    backoff: Backoff = Field(
        default=RETRY_BACKOFF, description="Delay before each retry: 1 s, doubled each retry, at most 300 s by default."
    )
    key: str | None = Field(
        default=None,
        max_length=MAX_NAME_LENGTH,
        description="Where each event's key is read: 'value.account' (a path into the value), 'namespace', 'module' "
        "or 'modifier'. Limits apply per key, and keys take turns. Read when the event is emitted, by whichever "
        "process emits it, so it is a path rather than a function.",
    )
    rate_limit: RateLimit | None = Field(
        default=None, description="Starts per period per key across all workers: RateLimit(rate=10) or '10/s'."
    )
    concurrency: int | None = Field(
        default=None, ge=1, le=10_000, description="Events of one key in flight at once across all workers."
    )
    limits_version: int = Field(
        default=0,
        ge=0,
        le=MAX_VERSION,
        description="The version of rate_limit and concurrency: workers with a lower one leave the registered "
        "limits as they are (raise it with each change).",
    )
    debounce: float | None = Field(
        default=None,
        gt=0,
        le=86400,
        description="Seconds of quiet after which the events of one key that came meanwhile make one call, which "
        "receives them all in order (the handler takes a list of events).",
    )
    max_wait: float | None = Field(
        default=None, gt=0, le=86400, description="Seconds after a batch's first event when it is called anyway."
    )
    max_batch: int = Field(default=1000, ge=1, le=100_000, description="Events in one debounced call at most.")

    @field_validator("key")
    @classmethod
    def _key_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = value.split(".")
        if parts[0] not in KEY_FIELDS or "" in parts or (len(parts) > 1 and parts[0] != "value") or len(parts) > 16:
            raise ValueError(
                f"{value!r} is not a key path: 'value', 'value.<field>[.<field>...]', 'namespace', 'module' or "
                "'modifier'"
            )
        return value

    @field_validator("debounce", "max_wait", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> Any:
        return value.total_seconds() if isinstance(value, timedelta) else value

    @model_validator(mode="after")
    def _debounce_given(self) -> HandlerConfig:
        if self.max_wait is not None and self.debounce is None:
            raise ValueError("max_wait: applies to a debounced handler only (give debounce too)")
        return self

    @property
    def limits(self) -> FlowLimits:
        """The flow limits of the handler's keys."""
        return FlowLimits(rate_limit=self.rate_limit, concurrency=self.concurrency, version=self.limits_version)

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, values: Any) -> Any:
        """``retry_delay`` and ``max_retry_delay`` (deprecated): ``backoff.first`` and ``backoff.max``."""
        if not isinstance(values, dict) or "backoff" in values or not cls.RENAMED.keys() & values.keys():
            return values
        warnings.warn(
            "HandlerConfig: retry_delay and max_retry_delay are deprecated: give backoff=Backoff(first=..., max=...)",
            DeprecationWarning,
            stacklevel=4,
        )
        values = dict(values)
        values["backoff"] = {new: values.pop(old) for old, new in cls.RENAMED.items() if old in values}
        return values


class WorkerSettings(Options):
    """How an event queue worker polls, listens and claims."""

    error = InvalidEventQueueInput
    DEPRECATED_NAMES: ClassVar[Mapping[str, str]] = {"concurrency": "worker_concurrency"}

    batch_size: int = Field(default=100, ge=1, le=10_000, description="Events claimed in one statement at most.")
    worker_concurrency: int = Field(
        default=10,
        ge=1,
        le=1_000,
        description="Handler calls one worker runs at once (async def ones on its event loop, others in threads).",
    )
    isolation: Isolation = Field(
        default="thread",
        description="'process': each sync call runs in a child process, killed at its timeout.",
    )
    sweep_interval: float = Field(
        default=2.0, gt=0, le=3600, description="Seconds between sweeps when no notification comes."
    )
    listen: bool = Field(default=True, description="Wake on LISTEN/NOTIFY hints (off: sweeps only).")
    heartbeat: float = Field(
        default=5.0, gt=0, le=3600, description="Seconds of silence after which the listener checks its connection."
    )
    cron_interval: float = Field(default=1.0, gt=0, le=3600, description="Seconds between cron checks.")
    lease_ttl: float = Field(default=10.0, gt=0, le=3600, description="TTL of the worker's liveness lease.")


class EventQueueChecks(Checks):
    """Limits of the event queue's asset checks, on each handler."""

    error = InvalidEventQueueInput

    oldest_queued_seconds: Threshold = Field(
        default=Threshold(warn_at=60, error_at=600), description="Age of the oldest event due and not yet handled."
    )
    dead: Threshold = Field(default=Threshold(warn_at=1, error_at=100), description="Dead-lettered events.")
    held: Threshold = Field(
        default=Threshold(warn_at=1_000, error_at=100_000), description="Events held by a pause or block rule."
    )

    def verdicts(self, asset: list[str], row: HandlerStatus) -> list[Verdict]:
        """The checks of one handler."""
        rules = f" ({', '.join(row.rules)})" if row.rules else ""
        return self.judge(
            asset,
            {
                "oldest_queued_seconds": (
                    row.oldest_queued_seconds,
                    f"the oldest queued event waits {row.oldest_queued_seconds:.0f} s",
                ),
                "dead": (row.dead, f"{row.dead} dead-lettered events"),
                "held": (row.held, f"{row.held} events held{rules}"),
            },
        )


class EventQueueOptions(Options):
    """An event queue worker's handlers and settings, and what ``cmb_definitions(events=...)`` adds: worker
    jobs kept running by sensors, and per-handler observations.

    ``handlers``: a ``HandlerRegistry``, a ``"module:attribute"`` naming one, or a list of registries,
    handlers and cron handlers.
    """

    error = InvalidEventQueueInput

    handlers: Any = Field(description="A HandlerRegistry, or a list of registries / Handler / CronHandler.")
    workers: int = Field(default=1, ge=1, le=64, description="Worker jobs; all claim from one queue (SKIP LOCKED).")
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    observe_interval_seconds: int = Field(
        default=30, ge=5, le=86400, description="How often the status sensor observes handlers."
    )
    checks: EventQueueChecks = Field(default_factory=EventQueueChecks, description="Limits of the asset checks.")

    def registry(self):  # type: ignore[no-untyped-def]
        """The handlers as one ``HandlerRegistry``; there must be at least one handler."""
        from cmb_dagster.eventqueue.handlers import HandlerRegistry

        registry = HandlerRegistry.of(self.handlers)
        if not registry.handlers:
            raise InvalidEventQueueInput("handlers: an event queue needs at least one handler")
        return registry


# -- validation of emitted events ---------------------------------------------------------------------


def check_name(field: str, value: object) -> str:
    """``value`` as a name (namespace, handler, module, modifier), or InvalidEventQueueInput naming ``field``."""
    return inputs.check_text(value, field, max_length=MAX_NAME_LENGTH, error=InvalidEventQueueInput)


def to_json(value: object, field: str = "value") -> str:
    """``value`` as JSON text within the payload limit, or InvalidEventQueueInput naming ``field``."""
    return inputs.to_json(value, field, error=InvalidEventQueueInput)


def check_priority(value: object, field: str = "priority") -> int:
    """``value`` as a priority (higher first), or InvalidEventQueueInput naming ``field``."""
    return inputs.check_int(value, field, low=-MAX_PRIORITY, high=MAX_PRIORITY, error=InvalidEventQueueInput)


def delay_seconds(delay: float | timedelta | None) -> float:
    """``delay`` in seconds (None is 0), at most a century, or InvalidEventQueueInput naming ``delay``."""
    return inputs.check_seconds(delay, "delay", error=InvalidEventQueueInput)
