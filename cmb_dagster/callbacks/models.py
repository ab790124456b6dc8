"""User-facing models of the callbacks engine: events, retry policies, schedules, settings, options and status."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, ClassVar, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from cmb_dagster.callbacks import hosts
from cmb_dagster.callbacks.errors import InvalidCallbackInput
from cmb_dagster.callbacks.launches import JOB_NAME, check_dagster_context, dagster_job_name
from cmb_dagster.flow import FlowLimits
from cmb_dagster.health import Checks, Threshold, Verdict
from cmb_dagster.inputs import check_text, max_payload_bytes, to_json
from cmb_dagster.models import Backoff, Options, describe

MAX_OWNER_LENGTH = 128
MAX_GROUP_LENGTH = 128
MAX_KEY_LENGTH = 256
MAX_SCHEDULE_KEY_LENGTH = MAX_KEY_LENGTH - 40  # its events' keys append '@<fire time>'
MAX_URL_LENGTH = 2048
MAX_STOP_AFTER = 366 * 86400.0  # seconds: a year of retries at most
MAX_DELAY = 30 * 86400.0  # seconds between two main retries, at most
MAX_FACTOR = 1000.0
MAX_FAST_RETRIES = 10
FAST_RETRY_BACKOFF = Backoff(first=0.1, factor=2, max=60)
MAX_FAST_RETRY_FIRST = 10.0  # seconds: fast retries wait in the worker's memory
MAX_FAST_RETRY_PAUSE = 3600.0
EARLIEST_RUN_AT = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_RUN_AT = datetime(9000, 1, 1, tzinfo=UTC)  # far inside what Python and Postgres both store, retries included
MAX_BUCKETS = 4096  # each bucket is a row, a lease and a poll per poll_interval
MAX_TTL_DAYS = 36500  # finished events are kept at most this long
MAX_CONTEXT_BYTES = 16 * 1024 * 1024  # a context travels in the body of every call of its event
MAX_PRIORITY = 1000
MAX_OWNER_LIMITS = 1000  # entries of CallbackSettings.per_owner: each is a scope registered by every worker
HOST_SCOPE = "callbacks/host"
ENDPOINT_SCOPE = "callbacks/endpoint"  # key: the endpoint; or + "/" + endpoint, key empty (per_endpoint entries)
ANY_ENDPOINT = "*"
MAX_ENDPOINT_LIMITS = 1000  # entries of CallbackSettings.per_endpoint
OWNER_SCOPE = "callbacks/owner/"  # + owner, or + owner/group
DEFAULT_PER_HOST = FlowLimits(concurrency=64)
HOOK_GROUP = "cmb.failure"  # the group of failure hook events (reserved)
MAX_REPLAY_BATCH = 10_000  # dead letters listed or replayed per call, at most
MAX_SECRETS_REFRESH = 300.0  # seconds: a rotated or retired signing secret takes effect within this at most


class CallbackStatus(StrEnum):
    """Where an event is in its life: only ``pending`` events are still going to be called."""

    PENDING = "pending"
    NOTIFIED = "notified"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    HELD = "held"  # waiting for its endpoint's circuit breaker to close
    DISABLED = "disabled"  # kept while its endpoint is disabled; sent when it is enabled


WAITING_STATUSES = (CallbackStatus.PENDING, CallbackStatus.HELD, CallbackStatus.DISABLED)
"""Events still to be called: cancel, update and delete treat them alike."""


def _seconds(value: Any) -> Any:
    return value.total_seconds() if isinstance(value, timedelta) else value


class RetryPolicy(BaseModel):
    """How a failing callback is retried: fast retries in process, then main retries rescheduled in the database.

    Durations are seconds (a ``timedelta`` is accepted too). The event fails once ``stop_after_delay``
    has passed since its ``originally_run_at``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    stop_after_delay: float = Field(
        default=86400.0,
        gt=0,
        le=MAX_STOP_AFTER,
        allow_inf_nan=False,
        description="Give up this long after originally_run_at (at most a year).",
    )
    fast_retries: int = Field(
        default=2, ge=0, le=MAX_FAST_RETRIES, description="Immediate retries before rescheduling; 0 disables."
    )
    backoff: Literal["constant", "exponential"] = Field(default="constant", description="How main retries space out.")
    delay: float = Field(
        default=60.0,
        gt=0,
        le=MAX_DELAY,
        allow_inf_nan=False,
        description="Constant delay, or the first exponential delay (at most 30 days).",
    )
    factor: float = Field(
        default=2.0,
        ge=1.0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="Exponential growth of the delay per main retry.",
    )
    max_delay: float | None = Field(
        default=None,
        gt=0,
        le=MAX_DELAY,
        allow_inf_nan=False,
        description="Cap of the exponential delay (at most 30 days).",
    )

    _to_seconds = field_validator("stop_after_delay", "delay", "max_delay", mode="before")(lambda cls, v: _seconds(v))

    @classmethod
    def constant(cls, delay: float | timedelta = 60.0, **kwargs: Any) -> RetryPolicy:
        """Main retries every ``delay``."""
        return cls(backoff="constant", delay=delay, **kwargs)

    @classmethod
    def exponential(
        cls,
        first_delay: float | timedelta = 60.0,
        factor: float = 2.0,
        max_delay: float | timedelta | None = None,
        **kwargs: Any,
    ) -> RetryPolicy:
        """Main retries after ``first_delay``, then ``factor`` times longer each time, up to ``max_delay``."""
        return cls(backoff="exponential", delay=first_delay, factor=factor, max_delay=max_delay, **kwargs)

    def main_retry_delay(self, retries_done: int) -> float:
        """Seconds to wait before main retry number ``retries_done + 1``."""
        cap = min(self.max_delay if self.max_delay is not None else MAX_DELAY, MAX_DELAY)
        if self.backoff == "constant":
            return min(self.delay, cap)
        # in logarithms: a huge factor or retry count cannot overflow
        retries_done = max(0, retries_done)
        if retries_done * math.log(self.factor) + math.log(self.delay) >= math.log(cap):
            return cap
        return min(self.delay * self.factor**retries_done, cap)


DAY = 86400.0
MAX_DISABLE_AFTER = 366 * DAY


class EndpointPolicy(Options):
    """When an endpoint's circuit breaker opens, how it probes, and when it is disabled.

    An endpoint opens after ``failure_threshold`` failed calls in a row, or when at least ``min_calls`` calls of the
    current ``window`` failed at ``failure_rate`` or more. Open, its due events are held (not called, not counted as
    attempts or failures) while one probe (its next due event) is sent per ``probe_interval``, longer after each
    failed probe; a success closes it and its held events go out, oldest first. Open for ``disable_after`` seconds
    (None: never), it is disabled: its events are kept as ``disabled`` and one notification is sent.
    """

    error = InvalidCallbackInput

    breaker: bool = Field(
        default=True,
        description="Whether an endpoint opens at all (False: every event follows its own retry policy; the "
        "endpoint's health is still kept).",
    )
    failure_threshold: int = Field(default=10, ge=1, le=1_000_000, description="Failed calls in a row that open it.")
    failure_rate: float | None = Field(
        default=0.5, gt=0, le=1, description="Share of failed calls in the window that opens it (None: not used)."
    )
    min_calls: int = Field(default=20, ge=1, le=1_000_000, description="Calls in the window before the rate counts.")
    window: float = Field(default=60.0, ge=1, le=DAY, description="Seconds over which the failure rate is counted.")
    probe_interval: Backoff = Field(
        default=Backoff(first=30.0, factor=2.0, max=3600.0),
        description="Seconds between probes of an open endpoint: first, growth per failed probe, longest.",
    )
    disable_after: float | None = Field(
        default=3 * DAY,
        gt=0,
        le=MAX_DISABLE_AFTER,
        allow_inf_nan=False,
        description="Seconds an endpoint may stay open before it is disabled (None: never).",
    )

    _to_seconds = field_validator("window", "disable_after", mode="before")(lambda cls, v: _seconds(v))

    @field_validator("probe_interval")
    @classmethod
    def _probes_wait(cls, value: Backoff) -> Backoff:
        if value.first <= 0 or value.max <= 0:
            raise ValueError("first and max must be above 0 s")
        return value

    def opens(self, consecutive_failures: int, window_calls: int, window_failures: int) -> bool:
        """Whether an endpoint with these figures opens."""
        if not self.breaker:
            return False
        if consecutive_failures >= self.failure_threshold:
            return True
        rate = self.failure_rate
        return rate is not None and window_calls >= self.min_calls and window_failures >= rate * window_calls


class CallbackSettings(Options):
    """Limits and tuning of the callbacks engine, shared by clients and workers."""

    error = InvalidCallbackInput
    DEPRECATED_NAMES: ClassVar[Mapping[str, str]] = {"concurrency": "worker_concurrency"}

    max_context_bytes: int = Field(
        default_factory=lambda: min(max_payload_bytes(), MAX_CONTEXT_BYTES),
        gt=0,
        le=MAX_CONTEXT_BYTES,
        description="Largest context as compact JSON (default: the payload limit CMB_MAX_PAYLOAD_BYTES, up to 16 MiB).",
    )
    allowed_hosts: tuple[str, ...] | None = Field(
        default_factory=hosts.hosts_from_env,
        description=(
            "Targets callbacks may call: host names, '*.domain' patterns, addresses, CIDR ranges, and '*' for any "
            "host. None (the default, unless CMB_CALLBACK_ALLOWED_HOSTS is set) is '*'. Whatever the names, a call "
            "only connects to a public address, or to one an address or range of this list opens (e.g. '127.0.0.1')."
        ),
    )
    max_response_bytes: int = Field(
        default=64 * 1024, gt=0, le=16 * 1024 * 1024, description="Response bytes read at most; the rest is dropped."
    )
    write_batch_size: int = Field(
        default=500, gt=0, le=10_000, description="Creates written per multi-row insert, at most."
    )
    write_connections: int = Field(
        default=2, gt=0, le=32, description="Batches of creates written at once, each on its own connection."
    )
    write_linger: float = Field(
        default=0.0, ge=0, le=0.05, description="Seconds a write waits for more creates (0: group commit)."
    )
    create_timeout: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Seconds a create may wait for a connection, a lock and its commit before CallbackTimeout.",
    )
    poll_interval: float = Field(default=1.0, gt=0, le=60, description="Seconds between polls of a bucket.")
    lookahead: float = Field(default=2.0, ge=0, le=10, description="Poll events due within this many seconds.")
    poll_batch_size: int = Field(default=1000, gt=0, le=10_000, description="Events fetched per poll query.")
    max_in_flight: int = Field(default=5000, gt=0, le=1_000_000, description="Events a worker holds in memory at most.")
    worker_concurrency: int = Field(default=128, gt=0, le=512, description="Parallel callback calls per worker.")
    timeout: float = Field(default=5.0, gt=0, le=60, description="Seconds one HTTP call may take.")
    backoff: Backoff = Field(
        default=FAST_RETRY_BACKOFF,
        description=f"Pauses before fast retries (first at most {MAX_FAST_RETRY_FIRST:g} s, max at most "
        f"{MAX_FAST_RETRY_PAUSE:g} s: they wait in the worker's memory).",
    )
    move_batch: int = Field(
        default=5_000,
        ge=1,
        le=100_000,
        description="Pending events of a removed bucket moved to the others per transaction (new callbacks wait for "
        "each one).",
    )
    lease_ttl: float = Field(
        default=15.0,
        gt=1,
        le=3600,
        description="A dead worker's buckets are taken over, and its slots of the limits freed, after this.",
    )
    per_host: FlowLimits | None = Field(
        default=DEFAULT_PER_HOST,
        description="Limits of the calls to each destination host across all workers (None: no limit).",
    )
    secrets_refresh: float = Field(
        default=10.0,
        gt=0,
        le=MAX_SECRETS_REFRESH,
        description="Seconds a worker keeps its copy of an owner's signing secrets: a rotation or a retirement signs "
        "every call within this.",
    )
    per_owner: dict[str, FlowLimits] = Field(
        default_factory=dict,
        max_length=MAX_OWNER_LIMITS,
        description=(
            "Limits replacing per_host for the callbacks of an owner ('owner', all its groups together) or of one "
            "of its groups ('owner/group', split at the first '/'); the most specific entry applies."
        ),
    )

    per_endpoint: dict[str, FlowLimits] = Field(
        default_factory=dict,
        max_length=MAX_ENDPOINT_LIMITS,
        description=(
            "Limits replacing per_host for the calls to one endpoint ('https://host[:port]/path', the URL without its "
            "query, or the name events give it), or to each endpoint ('*'); per_owner entries come first."
        ),
    )
    endpoint_policy: EndpointPolicy = Field(
        default_factory=EndpointPolicy,
        description="Circuit breaker of each endpoint: when it opens, probes and is disabled (an owner's own policy, "
        "set by CallbackClient.set_endpoint_policy, comes first).",
    )

    @model_validator(mode="before")
    @classmethod
    def _fast_retry_pause(cls, values: Any) -> Any:
        """The deprecated ``fast_retry_pause=p``: ``backoff=Backoff(first=p, factor=2, max=60)``."""
        if not isinstance(values, dict) or "fast_retry_pause" not in values:
            return values
        warnings.warn(
            "CallbackSettings(fast_retry_pause=p) is deprecated: use backoff=Backoff(first=p, factor=2, max=60)",
            DeprecationWarning,
            stacklevel=4,
        )  # the caller of CallbackSettings(...)
        values = dict(values)
        pause = values.pop("fast_retry_pause")
        if "backoff" in values:
            raise ValueError("give backoff, not fast_retry_pause too")
        return {**values, "backoff": {"first": pause, "factor": 2, "max": FAST_RETRY_BACKOFF.max}}

    @field_validator("backoff")
    @classmethod
    def _fast_retries_stay_short(cls, value: Backoff) -> Backoff:
        if value.first > MAX_FAST_RETRY_FIRST or value.max > MAX_FAST_RETRY_PAUSE:
            raise ValueError(
                f"first must be at most {MAX_FAST_RETRY_FIRST:g} s and max at most "
                f"{MAX_FAST_RETRY_PAUSE:g} s (fast retries wait in the worker's memory)"
            )
        return value

    _normalise_hosts = field_validator("allowed_hosts", mode="before")(lambda cls, v: hosts.normalise_hosts(v))

    @model_validator(mode="after")
    def _timeout_fits_the_lease(self) -> CallbackSettings:
        if self.timeout + self.poll_interval >= self.lease_ttl * 2 / 3:
            raise ValueError(
                "timeout + poll_interval must stay under 2/3 of lease_ttl, so a call ends before its lease can lapse"
            )
        return self

    @field_validator("per_owner")
    @classmethod
    def _owner_keys(cls, value: dict[str, FlowLimits]) -> dict[str, FlowLimits]:
        for name in value:
            owner, _, group = name.partition("/")
            if not 0 < len(owner) <= MAX_OWNER_LENGTH or len(group) > MAX_GROUP_LENGTH or name.endswith("/"):
                raise ValueError(f"{name[:300]!r} is not 'owner' or 'owner/group'")
        return value

    @field_validator("per_endpoint")
    @classmethod
    def _endpoint_keys(cls, value: dict[str, FlowLimits]) -> dict[str, FlowLimits]:
        normalised = {}
        for name, limits in value.items():
            endpoint = name if name == ANY_ENDPOINT else hosts.endpoint_key(name)
            if endpoint is None:
                raise ValueError(f"{name[:300]!r} is not an http(s) URL, an endpoint name or '*'")
            normalised[endpoint] = limits
        return normalised

    def flow_scopes(self) -> dict[str, FlowLimits | None]:
        """The scopes of the callbacks' limits and their limits, as workers register them."""
        return {
            HOST_SCOPE: self.per_host,
            **{OWNER_SCOPE + name: limits for name, limits in self.per_owner.items()},
            **{_endpoint_scope(name): limits for name, limits in self.per_endpoint.items()},
        }

    def flow_key(self, owner: str, group: str, host: str | None, endpoint: str | None = None) -> tuple[str, str] | None:
        """The (scope, key) limiting a callback of ``owner``/``group`` to ``endpoint`` on ``host`` (None: none limits
        it): its owner's or group's entry of ``per_owner``, else its endpoint's of ``per_endpoint``, else
        ``per_host``."""
        for name in (f"{owner}/{group}", owner):
            limits = self.per_owner.get(name)
            if limits is not None:
                return (OWNER_SCOPE + name, "") if limits.limited else None
        if endpoint is not None:
            for name in (endpoint, ANY_ENDPOINT):
                limits = self.per_endpoint.get(name)
                if limits is not None:
                    if not limits.limited:
                        return None
                    return (ENDPOINT_SCOPE, endpoint) if name == ANY_ENDPOINT else (_endpoint_scope(name), "")
        if host is None or self.per_host is None or not self.per_host.limited:
            return None
        return HOST_SCOPE, host

    @property
    def wake_within(self) -> float:
        """Seconds: an event created or changed to be due sooner than this wakes its bucket's worker."""
        return self.poll_interval + self.lookahead

    def host_allowed(self, host: str) -> bool:
        """Whether callbacks may name ``host`` (by the name rule; addresses are checked again at call time)."""
        return hosts.host_allowed(host, self.allowed_hosts)

    def address_allowed(self, address: hosts.Address) -> bool:
        """Whether a call may connect to ``address``: a public one, or one this setting opens explicitly. An IPv6
        address that carries IPv4 ones (:func:`~cmb_dagster.callbacks.hosts.carried_ipv4`) is judged by each of
        those: a call to it reaches them."""
        return hosts.address_allowed(address, self.allowed_hosts)


def _endpoint_scope(name: str) -> str:
    """The flow scope of a ``per_endpoint`` entry: every endpoint's, or one endpoint's own."""
    return ENDPOINT_SCOPE if name == ANY_ENDPOINT else f"{ENDPOINT_SCOPE}/{name}"


def check_run_at(value: datetime, field: str = "run_at") -> datetime:
    """Refuse moments outside 1970..9000 UTC (Postgres and Python must both hold them, retries included)."""
    if not EARLIEST_RUN_AT <= value < LATEST_RUN_AT:
        raise InvalidCallbackInput(f"{field}: {value.isoformat()} is outside 1970-01-01..9000-01-01 UTC")
    return value


def check_context(context: Any, settings: CallbackSettings, cb_url: str) -> str | None:
    """``context`` as the compact JSON text stored (None for no context); InvalidCallbackInput if Postgres
    jsonb cannot hold it, it exceeds ``settings.max_context_bytes`` or it does not fit a dagster:// target."""
    if context is None:
        return None
    text = to_json(context, "context", error=InvalidCallbackInput, limit=settings.max_context_bytes)
    if dagster_job_name(cb_url) is not None:
        check_dagster_context(context)
    return text


_DEFAULT_RETRY = RetryPolicy()

ENVELOPE, CONTEXT = "envelope", "context"
Body = Literal["envelope", "context"]
"""What an HTTP callback's request carries: the envelope (keys, times, attempt and context) or the context alone."""
CatchUp = Literal["none", "latest", "all"]
MAX_CATCH_UP = 1000  # missed fire times of one schedule called after a downtime, at most


class NewCallback(BaseModel):
    """An event to create: who owns it, its keys, when and where to call, and what to send."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    owner_client_id: str = Field(min_length=1, max_length=MAX_OWNER_LENGTH)
    group_key: str = Field(min_length=1, max_length=MAX_GROUP_LENGTH)
    event_key: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    run_at: AwareDatetime
    cb_url: str = Field(min_length=1, max_length=MAX_URL_LENGTH)
    context: JsonValue = None
    body: Body = ENVELOPE
    retry: RetryPolicy = _DEFAULT_RETRY  # frozen: one shared instance
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, strict=True)
    on_failure: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_URL_LENGTH,
        description="Called once if the event fails for good (an http(s) URL or dagster://<job>); else the owner's.",
    )
    endpoint: str | None = Field(
        default=None,
        pattern=f"^{hosts.ENDPOINT_NAME.pattern}$",
        description="The endpoint its calls count for, a name the owner gives it (letters, digits, '_', '.', '-', "
        "'/'; default: its URL without the query): events of several URLs can share one circuit breaker.",
    )

    def check(self, settings: CallbackSettings) -> NewCallback:
        """Apply the settings' URL policy and context limit, and what Postgres cannot store; return self."""
        _check_keys(self, ("owner_client_id", "group_key", "event_key"))
        if self.group_key == HOOK_GROUP:
            raise InvalidCallbackInput(f"group_key: {HOOK_GROUP!r} is the group of failure hooks")
        check_run_at(self.run_at)
        hosts.check_url(self.cb_url, settings)
        if self.on_failure is not None:
            hosts.check_url(self.on_failure, settings, "on_failure")
        check_context(self.context, settings, self.cb_url)
        self.check_body()
        return self

    def check_body(self) -> None:
        """``body='context'`` needs a context and an HTTP target; an ``endpoint`` needs an HTTP target."""
        if self.endpoint is not None and dagster_job_name(self.cb_url) is not None:
            raise InvalidCallbackInput("endpoint: a dagster:// callback has no endpoint")
        if self.body == CONTEXT and (self.context is None or dagster_job_name(self.cb_url) is not None):
            raise InvalidCallbackInput("body: 'context' sends the context as an HTTP request's body; give one")


def check_many(events: list[NewCallback], settings: CallbackSettings) -> list[NewCallback]:
    """:meth:`NewCallback.check` of every event, the text checks done once for the whole batch; return ``events``."""
    texts = "\x01".join(text for e in events for text in (e.owner_client_id, e.group_key, e.event_key))
    if "\x00" in texts or not _encodes(texts) or any(event.group_key == HOOK_GROUP for event in events):
        return [event.check(settings) for event in events]  # the first bad event names its field
    dagster_urls = set()
    for url in {event.cb_url for event in events}:
        hosts.check_url(url, settings)
        if dagster_job_name(url) is not None:
            dagster_urls.add(url)
    for url in {event.on_failure for event in events if event.on_failure is not None}:
        hosts.check_url(url, settings, "on_failure")
    each_context = not _contexts_fit([e.context for e in events if e.context is not None], settings)
    for event in events:
        check_run_at(event.run_at)
        event.check_body()
        if event.context is not None and (each_context or event.cb_url in dagster_urls):
            check_context(event.context, settings, event.cb_url)
    return events


def _contexts_fit(contexts: list[Any], settings: CallbackSettings) -> bool:
    """True when ``contexts`` encode together within the size limit, so each one does (one encoding per batch)."""
    try:
        to_json(contexts, "context", error=InvalidCallbackInput, limit=settings.max_context_bytes)
    except InvalidCallbackInput:
        return False  # one of them is bad or they are big together: checked one at a time, the first bad one is named
    return True


KEY_LENGTHS = {
    "owner_client_id": MAX_OWNER_LENGTH,
    "group_key": MAX_GROUP_LENGTH,
    "event_key": MAX_KEY_LENGTH,
    "schedule_key": MAX_SCHEDULE_KEY_LENGTH,
}
"""The longest value of each key of an event or a schedule."""


def check_key(value: object, field: str) -> str:
    """``value`` as the key ``field`` (of :data:`KEY_LENGTHS`): text Postgres can store, within its length."""
    return check_text(value, field, max_length=KEY_LENGTHS[field], error=InvalidCallbackInput)


def _check_keys(model: BaseModel, fields: tuple[str, ...]) -> None:
    for name in fields:
        check_key(getattr(model, name), name)


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class CallbackEvent(BaseModel):
    """A stored event as :meth:`CallbackClient.get` returns it."""

    model_config = ConfigDict(frozen=True)

    event_id: int
    bucket_id: int
    owner_client_id: str
    group_key: str
    event_key: str
    status: CallbackStatus
    run_at: datetime
    originally_run_at: datetime
    cb_url: str
    context: JsonValue = None
    body: Body = ENVELOPE
    retry: RetryPolicy | dict[str, Any]  # a dict only for a stored policy outside RetryPolicy's bounds
    attempts: int
    main_retries: int
    last_error: str | None
    schedule_id: int | None
    priority: int = 0
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    message_id: int = Field(description="Its calls' webhook-id is 'cb_<message_id>' (kept by retries and replays).")
    last_status_code: int | None = Field(default=None, description="The HTTP status of the last answer.")
    last_response: str | None = Field(default=None, description="The first bytes of the last answer's body.")
    replays: int = 0
    on_failure: str | None = None
    failure_of: int | None = Field(default=None, description="On a failure hook: the failed event's message_id.")
    endpoint_name: str | None = Field(default=None, description="The endpoint name it was created with.")

    @property
    def webhook_id(self) -> str:
        """The ``webhook-id`` header of its calls."""
        return f"cb_{self.message_id}"


class NewSchedule(BaseModel):
    """A cron schedule that creates an event per fire time, ``horizon`` seconds ahead."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    owner_client_id: str = Field(min_length=1, max_length=MAX_OWNER_LENGTH)
    group_key: str = Field(min_length=1, max_length=MAX_GROUP_LENGTH)
    schedule_key: str = Field(min_length=1, max_length=MAX_SCHEDULE_KEY_LENGTH)
    cron: str
    timezone: str = "UTC"
    cb_url: str = Field(min_length=1, max_length=MAX_URL_LENGTH)
    context: JsonValue = None
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    horizon: float = Field(default=3600.0, ge=60, le=7 * 86400, description="Seconds of fire times materialized ahead.")
    catch_up: CatchUp = Field(
        default="latest",
        description="Fire times missed while no worker called them: 'none' skips them, 'latest' calls the most "
        "recent one, 'all' the catch_up_limit most recent ones.",
    )
    catch_up_limit: int = Field(
        default=100, ge=1, le=MAX_CATCH_UP, description="With catch_up='all': missed fire times called at most."
    )
    misfire_grace: float = Field(
        default=60.0, ge=1, le=86400, description="Seconds a fire time may wait for its call before it is missed."
    )

    _to_seconds = field_validator("horizon", "misfire_grace", mode="before")(lambda cls, v: _seconds(v))

    _cron_is_valid = field_validator("cron")(lambda cls, v: _valid_cron(v))

    @field_validator("timezone")
    @classmethod
    def _timezone_exists(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{value!r} is not a known IANA timezone") from None
        return value

    def check(self, settings: CallbackSettings) -> NewSchedule:
        """Apply the settings' URL policy and context limit; return self."""
        _check_keys(self, ("owner_client_id", "group_key", "schedule_key"))
        hosts.check_url(self.cb_url, settings)
        check_context(self.context, settings, self.cb_url)
        return self


class CallbackSchedule(BaseModel):
    """A stored schedule."""

    model_config = ConfigDict(frozen=True)

    schedule_id: int
    owner_client_id: str
    group_key: str
    schedule_key: str
    cron: str
    timezone: str
    cb_url: str
    context: JsonValue = None
    retry: RetryPolicy | dict[str, Any]  # a dict only for a stored policy outside RetryPolicy's bounds
    horizon: float
    catch_up: CatchUp
    catch_up_limit: int
    misfire_grace: float
    paused: bool
    materialized_until: datetime
    created_at: datetime


def _valid_cron(value: str) -> str:
    if not croniter.is_valid(value):
        raise ValueError(f"{value!r} is not a valid cron expression")
    return value


def validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """``model(**data)``, with Pydantic's errors turned into one InvalidCallbackInput naming the fields."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidCallbackInput(describe(exc)) from None


class CallbackCounts(BaseModel):
    """How many events are in each status, how many pending ones are overdue, and the oldest overdue age."""

    pending: int
    overdue: int
    notified: int
    failed: int
    rejected: int
    cancelled: int
    held: int = 0  # waiting for an open endpoint
    disabled: int = 0  # kept while their endpoint is disabled
    oldest_overdue_seconds: float


class BucketSetCounts(BaseModel):
    """What one worker job's buckets hold: pending and overdue events, the oldest overdue age, outcomes of the last
    hour."""

    bucket_set: int
    pending: int
    overdue: int
    oldest_overdue_seconds: float
    notified_last_hour: int
    failed_last_hour: int
    rejected_last_hour: int
    dead_letters: int = 0  # failed for good and not replayed, whenever
    held: int = 0  # events waiting for an open endpoint
    disabled: int = 0  # events kept while their endpoint is disabled
    open_endpoints: int = 0  # endpoints holding events of these buckets
    disabled_endpoints: int = 0  # disabled endpoints keeping events of these buckets


class DeadLetters(BaseModel):
    """Which failed events :meth:`CallbackClient.failed` lists and :meth:`CallbackClient.replay` sends again: of an
    owner, a group or one key, failed within [since, until), oldest failure first, ``limit`` at most."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    owner_client_id: str | None = Field(default=None, min_length=1, max_length=MAX_OWNER_LENGTH)
    group_key: str | None = Field(default=None, min_length=1, max_length=MAX_GROUP_LENGTH)
    event_key: str | None = Field(default=None, min_length=1, max_length=MAX_KEY_LENGTH)
    since: AwareDatetime | None = None
    until: AwareDatetime | None = None
    limit: int = Field(default=1000, ge=1, le=MAX_REPLAY_BATCH)

    @model_validator(mode="after")
    def _keys_narrow_down(self) -> DeadLetters:
        if self.group_key is not None and self.owner_client_id is None:
            raise ValueError("group_key needs owner_client_id")
        if self.event_key is not None and self.group_key is None:
            raise ValueError("event_key needs owner_client_id and group_key")
        return self

    def params(self) -> dict[str, Any]:
        """The statement parameters of this selection."""
        return {
            "owner": self.owner_client_id,
            "group": self.group_key,
            "key": self.event_key,
            "since": self.since or "-infinity",
            "until": self.until or "infinity",
            "limit": self.limit,
        }


class SigningSecretInfo(BaseModel):
    """One signing secret of an owner as operators see it: its kind and, for an ed25519 key, the public key
    (``whpk_<base64>``) receivers verify with; never the secret itself."""

    secret_id: int
    kind: Literal["hmac", "ed25519"]
    public_key: str | None  # an ed25519 key's; None for an HMAC secret
    created_at: datetime
    expires_at: datetime | None
    retired_at: datetime | None
    active: bool


class LimitUse(BaseModel):
    """One key of the callbacks' limits (a destination host, an owner or a group): its limits and their use now."""

    scope: str
    key: str
    concurrency: int | None
    in_flight: int
    rate_per_second: float | None
    burst: float | None
    tokens: float | None


EndpointState = Literal["closed", "open", "disabled"]


class EndpointHealth(BaseModel):
    """One endpoint of an owner (``scheme://host[:port]/path``) as its circuit breaker sees it."""

    endpoint_id: int
    owner_client_id: str
    endpoint: str
    state: EndpointState
    consecutive_failures: int = Field(description="Failed calls in a row.")
    window_started_at: datetime
    window_calls: int = Field(description="Calls since window_started_at.")
    window_failures: int = Field(description="Failed calls since window_started_at.")
    last_success_at: datetime | None
    last_failure_at: datetime | None
    last_error: str | None
    last_status_code: int | None
    opened_at: datetime | None
    probes: int = Field(description="Failed probes since it opened.")
    probe_at: datetime | None = Field(description="Open: when the next probe may start.")
    disabled_at: datetime | None
    disabled_by: str | None = Field(description="'breaker' (open longer than disable_after) or 'operator'.")
    releasing: bool = Field(description="Closed, its held events being sent again.")
    updated_at: datetime
    held: int = Field(default=0, description="Its events held while it is open (or being released).")
    disabled: int = Field(default=0, description="Its events kept while it is disabled.")


class EndpointCounts(BaseModel):
    """How many endpoints are open and disabled."""

    open: int
    disabled: int


class CallbacksStatus(BaseModel):
    """What the callbacks engine reports (:func:`cmb_dagster.callbacks.admin.status`): events per status over every
    bucket, the figures of each worker job's buckets when asked for, and the limits per key with their use."""

    totals: CallbackCounts | None = None
    bucket_sets: list[BucketSetCounts] = Field(default_factory=list)
    limits: list[LimitUse] = Field(default_factory=list)
    endpoints: EndpointCounts | None = None
    unhealthy: list[EndpointHealth] = Field(
        default_factory=list, description="Open and disabled endpoints, the longest open first, at most 20."
    )


class CallbackChecks(Checks):
    """Limits of the callbacks engine's asset checks, on each worker job's buckets."""

    error = InvalidCallbackInput

    overdue: Threshold = Field(
        default=Threshold(warn_at=1_000, error_at=100_000), description="Events due and not yet called."
    )
    oldest_overdue_seconds: Threshold = Field(
        default=Threshold(warn_at=60, error_at=600), description="Seconds the oldest overdue event is late."
    )
    failed_last_hour: Threshold = Field(
        default=Threshold(warn_at=1, error_at=100), description="Events that failed for good in the last hour."
    )
    open_endpoints: Threshold = Field(
        default=Threshold(warn_at=1), description="Open endpoints (circuit breaker) holding events of these buckets."
    )
    disabled_endpoints: Threshold = Field(
        default=Threshold(error_at=1), description="Disabled endpoints keeping events of these buckets."
    )

    def verdicts(self, asset: list[str], counts: BucketSetCounts) -> list[Verdict]:
        """The checks of one worker job's buckets."""
        return self.judge(
            asset,
            {
                "overdue": (counts.overdue, f"{counts.overdue} overdue events"),
                "oldest_overdue_seconds": (
                    counts.oldest_overdue_seconds,
                    f"the oldest overdue event is {counts.oldest_overdue_seconds:.0f} s late",
                ),
                "failed_last_hour": (counts.failed_last_hour, f"{counts.failed_last_hour} failed in the last hour"),
                "open_endpoints": (
                    counts.open_endpoints,
                    f"{counts.open_endpoints} open endpoints hold {counts.held} events",
                ),
                "disabled_endpoints": (
                    counts.disabled_endpoints,
                    f"{counts.disabled_endpoints} disabled endpoints keep {counts.disabled} events "
                    "(`cmb-dagster callbacks endpoints`)",
                ),
            },
        )


class CallbackOptions(Options):
    """What ``cmb_definitions(callbacks=...)`` adds: worker jobs with keepers, cleanup and the schedules materializer.

    Defaults: one worker job serving every bucket, cleanup at 21:00 UTC of finished events older than
    30 days, schedules materialized every 30 s.
    """

    error = InvalidCallbackInput

    workers: int = Field(
        default=1, ge=1, le=64, description="Worker jobs; job i serves buckets with id % workers == i."
    )
    settings: CallbackSettings = Field(default_factory=CallbackSettings)
    cleanup_cron: str = Field(default="0 21 * * *", description="When the cleanup runs (every evening by default).")
    cleanup_timezone: str = "UTC"
    ttl_days: int = Field(
        default=30, ge=0, le=MAX_TTL_DAYS, description="Finished events and change_log older than this are removed."
    )
    materialize_interval_seconds: int = Field(
        default=30, ge=5, le=86400, description="How often schedules are materialized."
    )
    observe_interval_seconds: int = Field(
        default=60, ge=5, le=86400, description="How often the status sensor observes each bucket set's events."
    )
    checks: CallbackChecks = Field(default_factory=CallbackChecks, description="Limits of the asset checks.")
    jobs: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="Jobs of the code location that dagster://<job> callbacks may launch (a launch sensor each); "
        "a callback to another job fails.",
    )

    _cron_is_valid = field_validator("cleanup_cron")(lambda cls, v: _valid_cron(v))

    @field_validator("jobs")
    @classmethod
    def _job_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not JOB_NAME.match(name):
                raise ValueError(f"{name!r} is not a Dagster job name (letters, digits and _)")
        return sorted(set(names))

    def worker_job_name(self, index: int, prefix: str = "cmb_") -> str:
        """Deprecated: ``cmb_dagster.jobs.worker_job_names(prefix, "callbacks_worker", workers)[index]``."""
        warnings.warn(
            "CallbackOptions.worker_job_name() is deprecated: use cmb_dagster.jobs.worker_job_names",
            DeprecationWarning,
            stacklevel=2,
        )
        return f"{prefix}callbacks_worker" + ("" if self.workers == 1 else f"_{index}_of_{self.workers}")

    def counts_asset_key(self, index: int) -> Any:
        """Deprecated: :func:`cmb_dagster.callbacks.dagster_defs.counts_asset_key`."""
        from cmb_dagster.callbacks.dagster_defs import counts_asset_key

        warnings.warn(
            "CallbackOptions.counts_asset_key(i) is deprecated: use "
            "cmb_dagster.callbacks.dagster_defs.counts_asset_key(options, i)",
            DeprecationWarning,
            stacklevel=2,
        )
        return counts_asset_key(self, index)
