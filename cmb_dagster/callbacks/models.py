"""User-facing models of the callbacks engine: events, retry policies, schedules and settings."""

from __future__ import annotations

import ipaddress
import json
import re
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Literal
from urllib.parse import urlsplit
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

from cmb_dagster.callbacks.errors import CallbackValidationError

MAX_OWNER_LENGTH = 128
MAX_GROUP_LENGTH = 128
MAX_KEY_LENGTH = 256
MAX_URL_LENGTH = 2048
DAGSTER_SCHEME = "dagster"
_JOB_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class CallbackStatus(StrEnum):
    """Where an event is in its life: only ``pending`` events are still going to be called."""

    PENDING = "pending"
    NOTIFIED = "notified"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


def _seconds(value: Any) -> Any:
    return value.total_seconds() if isinstance(value, timedelta) else value


class RetryPolicy(BaseModel):
    """How a failing callback is retried: fast retries in process, then main retries rescheduled in the database.

    Durations are seconds (a ``timedelta`` is accepted too). The event fails once ``stop_after_delay``
    has passed since its ``originally_run_at``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    stop_after_delay: float = Field(default=86400.0, gt=0, description="Give up this long after originally_run_at.")
    fast_retries: int = Field(default=2, ge=0, le=10, description="Immediate retries before rescheduling; 0 disables.")
    backoff: Literal["constant", "exponential"] = Field(default="constant", description="How main retries space out.")
    delay: float = Field(default=60.0, gt=0, description="Constant delay, or the first exponential delay.")
    factor: float = Field(default=2.0, ge=1.0, description="Exponential growth of the delay per main retry.")
    max_delay: float | None = Field(default=None, gt=0, description="Cap of the exponential delay.")

    _to_seconds = field_validator("stop_after_delay", "delay", "max_delay", mode="before")(lambda cls, v: _seconds(v))

    @classmethod
    def constant(cls, delay: float | timedelta = 60.0, **kwargs: Any) -> RetryPolicy:
        """Main retries every ``delay``."""
        return cls(backoff="constant", delay=delay, **kwargs)

    @classmethod
    def exponential(
        cls, first_delay: float | timedelta = 60.0, factor: float = 2.0, max_delay: float | timedelta | None = None, **kwargs: Any
    ) -> RetryPolicy:
        """Main retries after ``first_delay``, then ``factor`` times longer each time, up to ``max_delay``."""
        return cls(backoff="exponential", delay=first_delay, factor=factor, max_delay=max_delay, **kwargs)

    def main_retry_delay(self, retries_done: int) -> float:
        """Seconds to wait before main retry number ``retries_done + 1``."""
        if self.backoff == "constant":
            return self.delay
        delay = self.delay * self.factor ** min(retries_done, 64)
        return min(delay, self.max_delay) if self.max_delay is not None else delay


class CallbackSettings(BaseModel):
    """Limits and tuning of the callbacks engine, shared by clients and workers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_context_bytes: int = Field(default=64 * 1024, gt=0, description="Largest context, as compact JSON.")
    allowed_hosts: tuple[str, ...] | None = Field(
        default=None,
        description="If set, callback URLs must name one of these hosts: 'api.example.com', '*.example.com' or a CIDR.",
    )
    write_batch_size: int = Field(default=500, gt=0, description="Creates written per multi-row insert, at most.")
    write_linger: float = Field(
        default=0.0, ge=0, le=0.05, description="Seconds a write waits for more creates (0: group commit)."
    )
    poll_interval: float = Field(default=1.0, gt=0, description="Seconds between polls of a bucket.")
    lookahead: float = Field(default=2.0, ge=0, le=10, description="Poll events due within this many seconds.")
    poll_batch_size: int = Field(default=1000, gt=0, description="Events fetched per poll query.")
    max_in_flight: int = Field(default=5000, gt=0, description="Events a worker holds in memory at most.")
    concurrency: int = Field(default=32, gt=0, le=512, description="Parallel callback calls per worker.")
    timeout: float = Field(default=5.0, gt=0, le=60, description="Seconds one HTTP call may take.")
    fast_retry_pause: float = Field(default=0.1, ge=0, description="Pause before the first fast retry (doubles).")
    lease_ttl: float = Field(default=15.0, gt=1, description="A dead worker's buckets are taken over after this.")

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _normalise_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        return None if value is None else tuple(str(h).strip().lower() for h in value)

    @model_validator(mode="after")
    def _timeout_fits_the_lease(self) -> CallbackSettings:
        if self.timeout + self.poll_interval >= self.lease_ttl * 2 / 3:
            raise ValueError("timeout + poll_interval must stay under 2/3 of lease_ttl, so a call ends before its lease can lapse")
        return self

    def host_allowed(self, host: str) -> bool:
        """Whether callbacks may go to ``host`` (always true without an allowlist)."""
        if self.allowed_hosts is None:
            return True
        host = host.lower()
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        for pattern in self.allowed_hosts:
            if pattern.startswith("*.") and host.endswith(pattern[1:]):
                return True
            if host == pattern:
                return True
            if address is not None and "/" in pattern:
                try:
                    if address in ipaddress.ip_network(pattern, strict=False):
                        return True
                except ValueError:
                    continue
        return False


def check_url(url: str, settings: CallbackSettings, field: str = "cb_url") -> None:
    """Raise CallbackValidationError unless ``url`` is an http(s) URL to an allowed host or ``dagster://<job>``."""
    parts = urlsplit(url)
    if parts.scheme == DAGSTER_SCHEME:
        if not _JOB_NAME.match(parts.netloc) or parts.path not in ("", "/"):
            raise CallbackValidationError(f"{field}: {url!r} must be dagster://<job_name>")
        return
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CallbackValidationError(f"{field}: {url!r} must be an http(s) URL with a host, or dagster://<job_name>")
    if not settings.host_allowed(parts.hostname):
        raise CallbackValidationError(f"{field}: host {parts.hostname!r} is not in the allowed hosts")


def dagster_job_name(url: str) -> str | None:
    """The job of a ``dagster://<job>`` URL, None for other URLs."""
    parts = urlsplit(url)
    return parts.netloc if parts.scheme == DAGSTER_SCHEME else None


def check_context(context: Any, settings: CallbackSettings, cb_url: str) -> None:
    """Raise CallbackValidationError if ``context`` exceeds the size limit or does not fit a dagster:// target."""
    size = len(json.dumps(context, separators=(",", ":")).encode())
    if size > settings.max_context_bytes:
        raise CallbackValidationError(f"context: {size} bytes is over the limit of {settings.max_context_bytes}")
    if dagster_job_name(cb_url) is None or context is None:
        return
    if not isinstance(context, dict) or set(context) - {"run_config", "tags"}:
        raise CallbackValidationError("context: for dagster:// targets it must be {'run_config': {...}, 'tags': {...}}")
    for key in ("run_config", "tags"):
        if not isinstance(context.get(key, {}), dict):
            raise CallbackValidationError(f"context.{key}: must be an object")


class NewCallback(BaseModel):
    """An event to create: who owns it, its keys, when and where to call, and what to send."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    owner_client_id: str = Field(min_length=1, max_length=MAX_OWNER_LENGTH)
    group_key: str = Field(min_length=1, max_length=MAX_GROUP_LENGTH)
    event_key: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    run_at: AwareDatetime
    cb_url: str = Field(min_length=1, max_length=MAX_URL_LENGTH)
    context: JsonValue = None
    retry: RetryPolicy = Field(default_factory=RetryPolicy)

    def check(self, settings: CallbackSettings) -> NewCallback:
        """Apply the settings' URL allowlist and context limit; return self."""
        check_url(self.cb_url, settings)
        check_context(self.context, settings, self.cb_url)
        return self


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
    retry: RetryPolicy
    attempts: int
    main_retries: int
    last_error: str | None
    schedule_id: int | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class NewSchedule(BaseModel):
    """A cron schedule that creates an event per fire time, ``horizon`` seconds ahead."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    owner_client_id: str = Field(min_length=1, max_length=MAX_OWNER_LENGTH)
    group_key: str = Field(min_length=1, max_length=MAX_GROUP_LENGTH)
    schedule_key: str = Field(min_length=1, max_length=MAX_KEY_LENGTH - 40)  # event keys append '@<fire time>'
    cron: str
    timezone: str = "UTC"
    cb_url: str = Field(min_length=1, max_length=MAX_URL_LENGTH)
    context: JsonValue = None
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    horizon: float = Field(default=3600.0, ge=60, le=7 * 86400, description="Seconds of fire times materialized ahead.")

    _to_seconds = field_validator("horizon", mode="before")(lambda cls, v: _seconds(v))

    @field_validator("cron")
    @classmethod
    def _cron_is_valid(cls, value: str) -> str:
        if not croniter.is_valid(value):
            raise ValueError(f"{value!r} is not a valid cron expression")
        return value

    @field_validator("timezone")
    @classmethod
    def _timezone_exists(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{value!r} is not a known IANA timezone") from None
        return value

    def check(self, settings: CallbackSettings) -> NewSchedule:
        """Apply the settings' URL allowlist and context limit; return self."""
        check_url(self.cb_url, settings)
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
    retry: RetryPolicy
    horizon: float
    paused: bool
    materialized_until: datetime
    created_at: datetime


def validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """``model(**data)``, with Pydantic's errors turned into one CallbackValidationError naming the fields."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise CallbackValidationError(one_line(exc)) from None


def one_line(exc: ValidationError) -> str:
    """Pydantic errors as ``field: message; field: message``."""
    parts = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "value"
        parts.append(f"{field}: {error['msg']}")
    return "; ".join(parts)


class CallbackCounts(BaseModel):
    """How many events are in each status, how many pending ones are overdue, and the oldest overdue age."""

    pending: int
    overdue: int
    notified: int
    failed: int
    rejected: int
    cancelled: int
    oldest_overdue_seconds: float
