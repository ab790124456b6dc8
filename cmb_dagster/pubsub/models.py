"""The pub/sub engine's models: events, watermarks, lag and status, and the options of its API."""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

import psycopg
from croniter import croniter
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, computed_field, field_validator

from cmb_dagster.health import Checks, Threshold, Verdict
from cmb_dagster.inputs import BIGINT, load_reference, shorten
from cmb_dagster.isolation import DEFAULT_MAX_CRASHES
from cmb_dagster.models import Backoff, Options
from cmb_dagster.pubsub.errors import InvalidPubSubInput
from cmb_dagster.pubsub.filters import EVENT_VARIABLES, ROW_VARIABLES, filter_problem
from cmb_dagster.workers import PARTITION_BACKOFF

CONSUMER_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$"
MAX_HANDLER_PATH = 255
_DOTTED_NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
HANDLER_PATH = re.compile(rf"^(?=.{{3,{MAX_HANDLER_PATH}}}\Z){_DOTTED_NAME}:{_DOTTED_NAME}\Z")
"""'package.module:function' (or ':Class.method'), at most 255 characters."""
ZERO_SNAPSHOT = "1:1:"  # shows no txid committed: a new consumer starts from the first event
MAX_TOPIC_LENGTH = 500
MAX_TOPICS = 100


@dataclass(frozen=True, slots=True)
class Event:
    """One change on the stream: a captured row (op insert/update/delete), a row of a backfill (op snapshot)
    or a published payload.

    ``txid`` is the producing transaction on the stream's txid clock; ``topic`` is ``'schema.table'``
    for captured rows; ``key`` holds a captured row's key columns. (A dataclass, not a pydantic
    model: consumers build thousands per batch from rows Postgres has already typed.)
    """

    id: int
    txid: int
    branch_id: int
    topic: str
    op: Literal["insert", "update", "delete", "publish", "snapshot"]
    key: dict[str, Any] | None
    payload: Any
    created_at: datetime

    @property
    def version(self) -> int:
        """The version of the row a captured or snapshot event carries: of two events of one row, the one
        with the higher version holds the newer row (docs/pubsub.md, "Backfill"). It is the event's id."""
        return self.id


Handler = Callable[[psycopg.Connection, list[Event]], Awaitable[None] | None]
"""``handler(conn, events)``, a function or an ``async def`` function (awaited on the consumer's event loop)."""


def _filter(variables: tuple[str, ...]) -> AfterValidator:
    def check(text: str) -> str:
        problem = filter_problem(text, variables)
        if problem:
            raise ValueError(problem)
        return text

    return AfterValidator(check)


EventFilter = Annotated[str, _filter(EVENT_VARIABLES)]
"""A consumer's filter: an SQL/JSON path predicate over the event's payload (``$``), ``$topic``, ``$op``, ``$key``."""
RowFilter = Annotated[str, _filter(ROW_VARIABLES)]
"""A backfill's filter: an SQL/JSON path predicate over the row (``$``)."""


class Watermark(BaseModel):
    """How far one consumer of one branch has read: every event its ``snapshot`` shows committed, and,
    while ``target`` is set, the events of ``target`` up to (``txid``, ``event_id``)."""

    model_config = ConfigDict(frozen=True)

    consumer_id: str
    branch_id: int
    snapshot: str = ZERO_SNAPSHOT
    target: str | None = None
    txid: int = 0
    event_id: int = 0
    delivered: int = 0
    handler: str | None = None
    failing_event: int | None = None  # the next event, while the handler keeps failing on it
    attempts: int = 0  # failed attempts on failing_event so far
    crashes: int = 0  # deliveries of failing_event that ended with the death of their worker


class Lag(BaseModel):
    """How far a consumer is behind: events committed and not yet delivered, and the oldest one's age;
    the event its handler keeps failing on (``failing_event``, ``attempts``, ``last_error``), how many
    events it parked (``parked``, not replayed yet), what it was told when it registered (``notice``), and how long
    events have waited while no worker held the consumer's lease (``unserved_seconds``: nobody renews it)."""

    model_config = ConfigDict(frozen=True)

    consumer_id: str
    branch_id: int
    events: int
    seconds: float
    delivered: int
    handler: str | None
    updated_at: datetime
    failing_event: int | None = None
    attempts: int = 0
    last_error: str | None = None
    parked: int = 0
    notice: str | None = None
    unserved_seconds: float = 0
    topics: list[str] | None = None  # the topics it reads (None: all)
    where: str | None = None  # its filter on the events
    last_rewind: str | None = None  # who rewound it when, from where to where

    @property
    def problem(self) -> str | None:
        """One line saying why this consumer is stuck or what it skipped, or None."""
        parts = []
        if self.failing_event is not None:
            parts.append(
                f"stuck on event {self.failing_event} after {self.attempts} failed attempts: {self.last_error}"
            )
        if self.parked:
            parts.append(
                f"{self.parked} parked event(s): `cmb-dagster pubsub dead` lists them, `pubsub replay` retries"
            )
        if self.notice:
            parts.append(self.notice)
        return "; ".join(parts) or None


class BackfillProgress(BaseModel):
    """One backfill (:func:`cmb_dagster.pubsub.backfill`): what it publishes, and how far it got.

    ``state``: ``running`` (working, or interrupted: the same call resumes it after ``last_key``), ``failed``
    (``error``; the same call resumes it) or ``done`` (the same call with ``again=True`` starts it over)."""

    model_config = ConfigDict(frozen=True)

    id: int
    table: str
    branch_id: int
    topic: str
    where: str | None
    batch_size: int
    key_columns: list[str]
    last_key: dict[str, Any] | None  # the key of the last row published
    rows_done: int
    batches: int
    rows_skipped: int = 0  # rows passed over because the filter raised on them
    last_skip: str | None = None  # the last such row's key and the error
    state: Literal["running", "failed", "done"]
    error: str | None
    started_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class PubSubStatus(BaseModel):
    """Every registered consumer's lag (``consumers``), with the totals over them, and the backfills."""

    model_config = ConfigDict(frozen=True)

    consumers: list[Lag]
    backfills: list[BackfillProgress] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def behind(self) -> int:
        """Events committed and not yet delivered, summed over the consumers."""
        return sum(lag.events for lag in self.consumers)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def parked(self) -> int:
        """Events parked and not replayed yet, summed over the consumers."""
        return sum(lag.parked for lag in self.consumers)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def stuck(self) -> int:
        """Consumers whose handler keeps failing on an event."""
        return sum(lag.failing_event is not None for lag in self.consumers)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An event a consumer parked after ``attempts`` failures, with its last error."""

    consumer_id: str
    branch_id: int
    event: Event
    error: str
    traceback: str | None
    attempts: int
    first_failed_at: datetime
    last_failed_at: datetime
    parked_at: datetime
    replayed_at: datetime | None


class ConsumerKey(Options):
    """Which consumer: its id and the branch it reads (together, the key of its watermark)."""

    error: ClassVar[type[InvalidPubSubInput]] = InvalidPubSubInput

    consumer_id: str = Field(pattern=CONSUMER_ID_PATTERN, description="Up to 63 of A-Z a-z 0-9 _ . -")
    branch_id: int = Field(default=0, ge=BIGINT[0], le=BIGINT[1], description="The branch whose events it reads.")


class ConsumerSpec(ConsumerKey):
    """A consumer: its id, its branch, its handler, and how it delivers (the options of a ConsumerWorker)."""

    handler: str | Handler = Field(
        description="'module:function' (in Python also the function itself), called as handler(conn, events).",
    )
    batch_size: int = Field(default=1000, ge=1, le=100_000, description="Most events per handler call.")
    idle_sleep: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Seconds between polls when no event is ready; a commit's NOTIFY hint wakes the consumer sooner.",
    )
    max_attempts: int = Field(
        default=10, ge=1, le=1000, description="Failed attempts on one event before on_poison applies."
    )
    max_crashes: int = Field(
        default=DEFAULT_MAX_CRASHES,
        ge=1,
        le=1000,
        description="Deliveries of one event that end with the death of their worker before it is parked.",
    )
    handler_timeout: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="Seconds a handler call may run; then its transaction is ended and the call fails.",
    )
    on_poison: Literal["park", "stop"] = Field(
        default="park",
        description="'park': after max_attempts, move the event to the dead letters and go on; "
        "'stop': keep retrying it.",
    )
    order: Literal["snapshot", "txid"] = Field(
        default="snapshot",
        description="'snapshot': committed events at once; "
        "'txid': strict txid order, waiting for every older transaction.",
    )
    start: Literal["beginning", "now", "earliest_kept"] = Field(
        default="beginning", description="Where a consumer seen for the first time starts reading."
    )
    backoff: Backoff = Field(default=PARTITION_BACKOFF, description="Wait after a failed batch before the next one.")
    lease_ttl: float = Field(
        default=10.0, gt=0, le=3600, description="Seconds after which a standby takes over from a consumer that died."
    )
    listen: bool = Field(default=True, description="Wake on the producers' commit hints (LISTEN), not only by polling.")
    wait: bool = Field(
        default=True, description="Wait while another transaction holds the watermark (False: raise ConsumerBusy)."
    )
    topics: tuple[str, ...] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TOPICS,
        description="Deliver only events of these topics (None: every topic).",
    )
    where: EventFilter | None = Field(
        default=None,
        description="Deliver only events this SQL/JSON path predicate is true for: $ is the payload, $topic, $op and "
        "$key the event's; parsed by the database when the consumer registers.",
    )

    @field_validator("topics")
    @classmethod
    def _topics_are_bounded(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for topic in value or ():
            if not 1 <= len(topic) <= MAX_TOPIC_LENGTH or "\x00" in topic:
                raise ValueError(f"each topic must have 1 to {MAX_TOPIC_LENGTH} characters, not U+0000")
        return value

    @field_validator("handler")
    @classmethod
    def _handler_is_a_path(cls, value: str | Handler) -> str | Handler:
        if isinstance(value, str) and not HANDLER_PATH.match(value):
            raise ValueError("must be 'module:function', e.g. 'myproject.handlers:on_change'")
        return value

    @property
    def handler_path(self) -> str | None:
        """The handler as ``'module:function'``, or None for a function that cannot be loaded by name."""
        return self.handler if isinstance(self.handler, str) else handler_path(self.handler)


class BackfillSpec(Options):
    """What :func:`cmb_dagster.pubsub.backfill` publishes: the rows of ``table`` (those ``where`` is true for)
    as ``snapshot`` events of ``topic`` into ``branch_id``, ``batch_size`` rows per transaction."""

    error: ClassVar[type[InvalidPubSubInput]] = InvalidPubSubInput

    table: str = Field(min_length=1, max_length=500, description="The table, optionally schema-qualified.")
    branch_id: int = Field(default=0, ge=BIGINT[0], le=BIGINT[1], description="The branch the events go to.")
    where: RowFilter | None = Field(
        default=None, description="Only the rows this SQL/JSON path predicate over the row ($) is true for."
    )
    batch_size: int = Field(default=1000, ge=1, le=100_000, description="Rows per batch (one transaction each).")
    topic: str | None = Field(
        default=None, min_length=1, max_length=MAX_TOPIC_LENGTH, description="Default: 'schema.table'."
    )
    lock_timeout: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="Seconds a batch waits for a row a writer holds; then it is rolled back and tried again.",
    )


class PubSubChecks(Checks):
    """Limits of the pub/sub asset checks, on each consumer."""

    error: ClassVar[type[InvalidPubSubInput]] = InvalidPubSubInput

    lag_events: Threshold = Field(
        default=Threshold(warn_at=10_000, error_at=1_000_000), description="Events committed and not yet delivered."
    )
    lag_seconds: Threshold = Field(
        default=Threshold(warn_at=60, error_at=900), description="Age of the oldest event not yet delivered."
    )
    unserved_seconds: Threshold = Field(
        default=Threshold(warn_at=30, error_at=300),
        description="Seconds events have waited while no worker renewed the consumer's lease.",
    )
    parked: Threshold = Field(default=Threshold(warn_at=1), description="Events parked and not replayed yet.")

    def verdicts(self, asset: list[str], lag: Lag) -> list[Verdict]:
        """The checks of one consumer."""
        return self.judge(
            asset,
            {
                "lag_events": (lag.events, f"{lag.events} events behind"),
                "lag_seconds": (lag.seconds, f"the oldest undelivered event is {lag.seconds:.0f} s old"),
                "unserved_seconds": (
                    lag.unserved_seconds,
                    f"no worker has held the consumer for {lag.unserved_seconds:.0f} s while events wait"
                    if lag.unserved_seconds
                    else "a worker holds the consumer, or nothing waits",
                ),
                "parked": (lag.parked, f"{lag.parked} parked events"),
            },
        )


class PubSubOptions(Options):
    """What ``cmb_definitions(pubsub=...)`` adds: per consumer a job kept running and a lag asset; the trim schedule;
    the backfill job of the tables it names.

    Defaults: no consumer; trim at minute 17 of every hour; no backfill job.
    """

    error: ClassVar[type[InvalidPubSubInput]] = InvalidPubSubInput

    consumers: list[ConsumerSpec] = Field(default_factory=list, description="Consumers, each run by a job.")
    backfill_tables: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_TOPICS,
        description="Tables the backfill job may publish ('schema.table'); none: no backfill job.",
    )
    trim_cron: str = Field(default="17 * * * *", description="When delivered events are trimmed.")
    observe_interval_seconds: int = Field(
        default=60, ge=5, le=86400, description="How often the status sensor observes the consumers' lag."
    )
    checks: PubSubChecks = Field(default_factory=PubSubChecks, description="Limits of the asset checks.")

    @field_validator("backfill_tables")
    @classmethod
    def _tables_are_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for table in value:
            if not 1 <= len(table) <= MAX_TOPIC_LENGTH or "\x00" in table:
                raise ValueError(f"each table must be a name of 1 to {MAX_TOPIC_LENGTH} characters, not U+0000")
        if len(set(value)) != len(value):
            raise ValueError("a table is named twice")
        return value

    @field_validator("trim_cron")
    @classmethod
    def _cron_is_valid(cls, value: str) -> str:
        if not croniter.is_valid(value):
            raise ValueError(f"{value!r} is not a valid cron expression")
        return value


class CaptureSpec(Options):
    """What :func:`install_capture` installs on one table."""

    error: ClassVar[type[InvalidPubSubInput]] = InvalidPubSubInput

    table: str = Field(min_length=1, description="The table, optionally schema-qualified.")
    branch: str = Field(
        default="0", min_length=1, description="SQL over the row's columns (and TG_OP); NULL skips the row."
    )
    key: tuple[str, ...] | None = Field(default=None, description="Key columns; default: the primary key.")
    columns: tuple[str, ...] | None = Field(default=None, description="Payload columns; default: the whole row.")
    topic: str | None = Field(default=None, description="Default: 'schema.table'.")
    ops: tuple[Literal["insert", "update", "delete"], ...] = Field(default=("insert", "update"), min_length=1)


def handler_path(handler: Handler) -> str | None:
    """``'module:function'`` when ``handler`` can be loaded back by that name (see :func:`load_handler`), else None."""
    module = getattr(handler, "__module__", None)
    name = getattr(handler, "__qualname__", None)
    if not module or not name or module == "__main__" or _is_standard_library(module):
        return None
    path = f"{module}:{name}"
    return path if HANDLER_PATH.match(path) else None


def load_handler(path: str) -> Handler:
    """The handler a ``'module:function'`` path names.

    Rule: the path must name a callable that accepts the two positional arguments ``(conn, events)``
    (a callable whose signature cannot be read is refused), defined outside Python's standard library
    and ``builtins``: a command line or a configuration cannot make a consumer call ``os:system``.
    """
    if not HANDLER_PATH.match(path):
        raise InvalidPubSubInput(
            f"handler: {shorten(path)} must be 'module:function', at most {MAX_HANDLER_PATH} characters"
        )
    if _is_standard_library(path.partition(":")[0]):
        raise InvalidPubSubInput(f"handler: {shorten(path)} is in Python's standard library; name your own function")
    target = load_reference(path, "handler", error=InvalidPubSubInput)
    if not callable(target):
        raise InvalidPubSubInput(f"handler: {shorten(path)} is not callable")
    if _is_standard_library(getattr(target, "__module__", None) or "builtins"):
        raise InvalidPubSubInput(
            f"handler: {shorten(path)} is defined in Python's standard library; name your own function"
        )
    try:
        inspect.signature(target).bind(None, None)
    except (TypeError, ValueError):
        raise InvalidPubSubInput(f"handler: {shorten(path)} must accept the two arguments (conn, events)") from None
    return target


def _is_standard_library(module: str) -> bool:
    top = module.partition(".")[0]
    return top in sys.stdlib_module_names or top == "builtins"
