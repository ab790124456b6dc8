"""Deadlines of reactive tasks: by when a task must have run successfully, and how much time is left (no Dagster).

A deadline is a series of moments in the task's time zone, each with the moment a successful run must follow:

- ``Deadline(cron="0 9 * * *")``: each cron time is a deadline for a successful run since the cron time before;
- ``Deadline(after_chunk="9h", scale="day")``: the end of each chunk plus the offset (wall clock) is a deadline
  for a successful run since that chunk ended ("the day's partition by 09:00 next day").

A task is late when the latest deadline that passed (and was defined by then) has no successful run since its
start; a successful run makes it on time again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, ClassVar, Literal

from croniter import croniter
from pydantic import BeforeValidator, Field, PlainSerializer, model_validator

from cmb_dagster.models import Options
from cmb_dagster.reactive.errors import InvalidReactiveInput
from cmb_dagster.triggers.chunks import get_zone, parse_scale
from cmb_dagster.triggers.durations import compact_duration, human_duration, parse_duration

LONGEST_OFFSET = timedelta(days=366)
"""The longest ``after_chunk`` offset: a year's chunk may be due up to a year after it ended."""
CRON_FIELDS = 5

OnDeadline = Literal["alert", "run"]
"""What a passed deadline does: ``alert`` (its asset check fails) or ``run`` (also launches the task anyway)."""


def _offset(value: object) -> timedelta:
    try:
        offset = parse_duration(value)  # type: ignore[arg-type]
    except ValueError as error:
        raise ValueError(str(error)) from None
    if not timedelta(0) <= offset <= LONGEST_OFFSET:
        raise ValueError(f"must be from 0 to {LONGEST_OFFSET.days} days, got {value!r}")
    return offset


def _cron(value: object) -> str:
    if not isinstance(value, str) or len(value.split()) != CRON_FIELDS or not croniter.is_valid(value):
        raise ValueError(f"must be a cron expression of 5 fields such as '0 9 * * *', got {value!r}")
    return " ".join(value.split())


def _scale(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a chunk scale such as 'hour', 'day' or 'month', got {value!r}")
    return parse_scale(value).name


Offset = Annotated[
    timedelta, BeforeValidator(_offset), PlainSerializer(compact_duration, return_type=str, when_used="json")
]


@dataclass(frozen=True, slots=True)
class DeadlineState:
    """Where a task stands against its deadline at ``now``.

    ``due_at`` is the deadline that matters: the one that passed when ``late``, else the next one; a successful
    run at or after ``since`` meets it (``met``: one has). ``slack`` is ``due_at - now``: time left, or, negative,
    how late the task is.
    """

    due_at: datetime
    since: datetime
    late: bool
    met: bool
    slack: timedelta

    def text(self) -> str:
        """``'late by 1:20:00 (due 2026-11-26 09:00:00+03:00)'`` or ``'3:20:00 left (due ...)'``."""
        if self.late:
            return f"late by {self.lateness} (due {self.due_at}, no successful run since {self.since})"
        left = human_duration(_whole_seconds(self.slack))
        if self.met:
            return f"met (a successful run since {self.since}); next due {self.due_at}, in {left}"
        return f"{left} left (due {self.due_at}, for a successful run since {self.since})"

    @property
    def lateness(self) -> str:
        """How late the task is, in whole seconds: ``'1:20:00'``."""
        return human_duration(_whole_seconds(-self.slack))


class Deadline(Options):
    """By when a reactive task must have run successfully: each ``cron`` time (5 fields, in the task's time zone),
    or ``after_chunk`` after the end of each ``scale`` chunk (wall clock in the task's time zone)."""

    error: ClassVar[type[InvalidReactiveInput]] = InvalidReactiveInput

    cron: Annotated[str, BeforeValidator(_cron)] | None = Field(
        default=None, description="Each time is a deadline for a successful run since the time before."
    )
    after_chunk: Offset | None = Field(
        default=None, description="How long after each chunk ends a successful run since its end is due (0-366 days)."
    )
    scale: Annotated[str, BeforeValidator(_scale)] | None = Field(
        default=None, description="The chunks of after_chunk: '15min', 'hour', 'day', 'week', 'month', ..."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> Deadline:
        if (self.cron is None) == (self.after_chunk is None):
            raise ValueError("give either cron or after_chunk (with scale)")
        if self.after_chunk is not None and self.scale is None:
            raise ValueError("scale: after_chunk needs the chunks it counts from, e.g. scale='day'")
        if self.cron is not None and self.scale is not None:
            raise ValueError("scale: only after_chunk takes a scale, not cron")
        return self

    def describe(self, timezone: str) -> str:
        """``'cron 0 9 * * * in Europe/Moscow'``, ``'9h after each day in UTC'``."""
        if self.cron is not None:
            return f"cron {self.cron} in {timezone}"
        return f"{compact_duration(self.after_chunk)} after each {self.scale} in {timezone}"  # type: ignore[arg-type]

    def state(
        self, now: datetime, timezone: str, last_success_at: datetime | None, defined_at: datetime
    ) -> DeadlineState:
        """Where a task whose last successful run ended at ``last_success_at`` stands at ``now``; deadlines before
        ``defined_at`` (when the deadline was defined) are not enforced."""
        (passed, passed_since), (upcoming, upcoming_since) = self._around(now.astimezone(get_zone(timezone)))
        succeeded = None if last_success_at is None else _utc(last_success_at)
        if _utc(passed) >= _utc(defined_at) and (succeeded is None or succeeded < _utc(passed_since)):
            return DeadlineState(passed, passed_since, True, False, _utc(passed) - _utc(now))
        met = succeeded is not None and succeeded >= _utc(upcoming_since)
        return DeadlineState(upcoming, upcoming_since, False, met, _utc(upcoming) - _utc(now))

    def _around(self, local: datetime) -> tuple[tuple[datetime, datetime], tuple[datetime, datetime]]:
        """(the latest deadline at or before ``local``, its start), (the next deadline, its start)."""
        if self.cron is not None:
            passed = croniter(self.cron, local).get_prev(datetime)
            following = croniter(self.cron, passed).get_next(datetime)
            if following <= local:  # ``local`` is a cron time itself
                passed, following = following, croniter(self.cron, following).get_next(datetime)
            return (passed, croniter(self.cron, passed).get_prev(datetime)), (following, passed)
        zone, offset, scale = local.tzinfo, self.after_chunk, parse_scale(self.scale)  # type: ignore[arg-type]
        wall = local.replace(tzinfo=None)
        start = scale.start_of(wall - offset)  # type: ignore[operator]
        after = scale.after(start)

        def aware(moment: datetime) -> datetime:
            return moment.replace(tzinfo=zone)

        return (aware(start + offset), aware(start)), (aware(after + offset), aware(after))  # type: ignore[operator]


def _whole_seconds(duration: timedelta) -> timedelta:
    return timedelta(seconds=round(duration.total_seconds()))


def _utc(moment: datetime) -> datetime:
    """Aware datetimes of one zone compare by wall clock: compare in UTC."""
    return moment.astimezone(UTC)


def deadline_from(value: object) -> Deadline | None:
    """A task's ``deadline=``: a :class:`Deadline`, its fields as a mapping, a cron expression, or None."""
    if value is None or isinstance(value, Deadline):
        return value
    if isinstance(value, str):
        return Deadline(cron=value)
    if isinstance(value, dict):
        return Deadline(**value)
    raise InvalidReactiveInput(f"deadline: expected a Deadline, a cron expression or None, got {value!r}")
