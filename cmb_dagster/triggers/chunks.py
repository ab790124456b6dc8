"""Chunk scales (``'15min'``, ``'hour'``, ``'day'``, ``'week'``, ``'month'``, ...) and chunk indices.

A chunk is a calendar interval in a time zone's wall clock: ``'day'`` starts at local
midnight, ``'week'`` on Monday (ISO), ``'6h'`` at 00:00, 06:00, 12:00 and 18:00 local time.
Two moments are compared by the difference of their chunk indices, never by the
wall-clock distance between them, so 23- and 25-hour DST days are still one day.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cmb_dagster.triggers.durations import parse_duration

MINUTES_PER_DAY = 24 * 60
_ALIASES = {"minute": "1min", "hour": "1h"}
_SUB_DAY_EXAMPLES = "5min, 10min, 15min, 20min, 30min, hour, 2h, 3h, 4h, 6h, 8h, 12h"


@dataclass(frozen=True, slots=True)
class ChunkScale:
    """A parsed chunk scale: its canonical name, how to index a local time and how to label a chunk; ``start_of``
    gives the wall-clock start of the chunk holding a local time and ``after`` the start of the next chunk."""

    name: str
    index_of: Callable[[datetime], int]
    label_of: Callable[[datetime], str]
    start_of: Callable[[datetime], datetime]
    after: Callable[[datetime], datetime]


def _minutes_scale(name: str, minutes: int) -> ChunkScale:
    per_day = MINUTES_PER_DAY // minutes

    def index_of(local: datetime) -> int:
        return local.toordinal() * per_day + (local.hour * 60 + local.minute) // minutes

    def label_of(local: datetime) -> str:
        start = (local.hour * 60 + local.minute) // minutes * minutes
        return f"{_day_label(local)} {start // 60:02d}:{start % 60:02d}"

    def start_of(local: datetime) -> datetime:
        start = (local.hour * 60 + local.minute) // minutes * minutes
        return _midnight(local) + timedelta(minutes=start)

    return ChunkScale(name, index_of, label_of, start_of, lambda start: start + timedelta(minutes=minutes))


def _midnight(local: datetime) -> datetime:
    return local.replace(hour=0, minute=0, second=0, microsecond=0)


def _months_later(start: datetime, months: int) -> datetime:
    index = start.year * 12 + start.month - 1 + months
    return start.replace(year=index // 12, month=index % 12 + 1)


def _first_month_of(local: datetime, months: int) -> datetime:
    return _midnight(local).replace(day=1, month=(local.month - 1) // months * months + 1)


def _day_label(local: datetime) -> str:
    return f"{local.year:04d}-{local.month:02d}-{local.day:02d}"  # strftime is four times slower


def _week_label(local: datetime) -> str:
    year, week, _ = local.isocalendar()
    return f"{year}-W{week:02d}"


_CALENDAR: dict[str, ChunkScale] = {
    "day": ChunkScale("day", datetime.toordinal, _day_label, _midnight, lambda start: start + timedelta(days=1)),
    # 0001-01-01 (ordinal 1) is a Monday, so this counts ISO weeks.
    "week": ChunkScale(
        "week",
        lambda local: (local.toordinal() - 1) // 7,
        _week_label,
        lambda local: _midnight(local) - timedelta(days=local.weekday()),
        lambda start: start + timedelta(weeks=1),
    ),
    "month": ChunkScale(
        "month",
        lambda local: local.year * 12 + local.month - 1,
        lambda local: f"{local.year:04d}-{local.month:02d}",
        lambda local: _first_month_of(local, 1),
        lambda start: _months_later(start, 1),
    ),
    "quarter": ChunkScale(
        "quarter",
        lambda local: local.year * 4 + (local.month - 1) // 3,
        lambda local: f"{local.year}-Q{(local.month - 1) // 3 + 1}",
        lambda local: _first_month_of(local, 3),
        lambda start: _months_later(start, 3),
    ),
    "year": ChunkScale(
        "year",
        lambda local: local.year,
        lambda local: f"{local.year}",
        lambda local: _first_month_of(local, 12),
        lambda start: _months_later(start, 12),
    ),
}


@cache
def parse_scale(value: str) -> ChunkScale:
    """Parse a chunk scale such as ``'30min'``, ``'hour'``, ``'6h'``, ``'day'``, ``'week'``, ``'month'``."""
    text = value.strip().lower()
    text = _ALIASES.get(text, text)
    if text in _CALENDAR:
        return _CALENDAR[text]
    try:
        size = parse_duration(text)
    except ValueError:
        raise ValueError(
            f"unknown chunk scale {value!r}; use minutes or hours dividing a day "
            f"({_SUB_DAY_EXAMPLES}) or one of {', '.join(_CALENDAR)}"
        ) from None
    if size == timedelta(days=1):
        return _CALENDAR["day"]
    if size == timedelta(weeks=1):
        return _CALENDAR["week"]
    if size <= timedelta() or size % timedelta(minutes=1) or size > timedelta(days=1):
        raise ValueError(
            f"chunk scale {value!r} must be whole minutes or hours up to a day, or one of {', '.join(_CALENDAR)}"
        )
    minutes = size // timedelta(minutes=1)
    if MINUTES_PER_DAY % minutes:
        raise ValueError(f"chunk scale {value!r} does not divide a day evenly; use one of {_SUB_DAY_EXAMPLES}")
    return _minutes_scale(_canonical_minutes(minutes), minutes)


def _canonical_minutes(minutes: int) -> str:
    if minutes % 60:
        return f"{minutes}min"
    return "hour" if minutes == 60 else f"{minutes // 60}h"


@cache
def get_zone(name: str) -> ZoneInfo:
    """The ``ZoneInfo`` for an IANA name such as ``'Europe/Moscow'``; ``ValueError`` if unknown."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a tzdata folder such as "Europe"
        raise ValueError(f"unknown time zone {name!r}; use an IANA name such as 'UTC' or 'Europe/Moscow'") from None


def chunk_of(moment: datetime, scale: ChunkScale, zone: ZoneInfo) -> tuple[int, datetime]:
    """Index of the chunk holding the aware ``moment``, and a local time in it (for ``scale.label_of``).

    Indices never decrease as time passes: when clocks go back (DST end), the repeated
    wall-clock interval stays in the last chunk reached before the change until the wall
    clock catches up with it.
    """
    local = moment.astimezone(zone)
    index = scale.index_of(local)
    if local.fold:
        before = _last_second_before_clocks_went_back(local, zone)
        before_index = scale.index_of(before)
        if before_index > index:
            return before_index, before
    return index, local


def _last_second_before_clocks_went_back(local: datetime, zone: ZoneInfo) -> datetime:
    """Local time one second before the backward offset change that made ``local`` ambiguous."""
    new_offset = local.utcoffset()
    shift = local.replace(fold=0).utcoffset() - new_offset
    now = local.timestamp()
    before, after = math.floor(now - shift.total_seconds()), math.ceil(now)
    while after - before > 1:
        middle = (before + after) // 2
        if datetime.fromtimestamp(middle, zone).utcoffset() == new_offset:
            after = middle
        else:
            before = middle
    return datetime.fromtimestamp(before, zone)
