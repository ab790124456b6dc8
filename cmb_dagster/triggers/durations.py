"""Duration parsing and formatting: ``'30min'``, ``'2h'``, ``'1d12h'`` <-> ``timedelta``."""

from __future__ import annotations

import re
from datetime import timedelta

_UNITS: dict[str, timedelta] = {
    **dict.fromkeys(("s", "sec", "second", "seconds"), timedelta(seconds=1)),
    **dict.fromkeys(("min", "minute", "minutes"), timedelta(minutes=1)),
    **dict.fromkeys(("h", "hour", "hours"), timedelta(hours=1)),
    **dict.fromkeys(("d", "day", "days"), timedelta(days=1)),
    **dict.fromkeys(("w", "week", "weeks"), timedelta(weeks=1)),
}
_TERM = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)\s*")
_WHOLE = re.compile(r"(?:\d+(?:\.\d+)?\s*[a-z]+\s*)+")

_ZERO = timedelta()
MAX_DURATION = timedelta(days=36_525)
"""The longest duration a trigger takes: 100 years (longer ones would overflow date arithmetic)."""
DURATION_EXAMPLES = "'45s', '30min', '2h', '2d', '1w', '1h30min' or a timedelta"


def parse_duration(value: timedelta | str) -> timedelta:
    """Turn ``'2h'``, ``'1d12h'``, ``'-30min'`` or a ``timedelta`` into a ``timedelta``; ``ValueError`` otherwise."""
    if isinstance(value, timedelta):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a duration such as {DURATION_EXAMPLES}, got {value!r}")
    text = value.strip().lower()
    sign, text = (-1, text[1:].lstrip()) if text.startswith("-") else (1, text)
    if not _WHOLE.fullmatch(text):
        raise ValueError(f"cannot read duration {value!r}; use e.g. {DURATION_EXAMPLES}")
    total = timedelta()
    for number, unit in _TERM.findall(text):
        if unit not in _UNITS:
            raise ValueError(f"unknown duration unit {unit!r} in {value!r}; known units: s, min, h, d, w")
        if len(number) > 12:  # more digits than any duration up to MAX_DURATION needs, in any unit
            raise ValueError(f"duration {value!r} is too long; at most {MAX_DURATION.days} days (100 years)")
        try:
            total += float(number) * _UNITS[unit] if "." in number else int(number) * _UNITS[unit]
        except OverflowError:
            raise ValueError(f"duration {value!r} is too long; at most {MAX_DURATION.days} days (100 years)") from None
        if total > MAX_DURATION:
            raise ValueError(f"duration {value!r} is too long; at most {MAX_DURATION.days} days (100 years)")
    return sign * total


def compact_duration(value: timedelta) -> str:
    """Shortest string ``parse_duration`` reads back to ``value``, e.g. ``'1d23h36min17s'``."""
    sign = "-" if value < _ZERO else ""
    micros = abs(value) // timedelta(microseconds=1)
    seconds, micros = divmod(micros, 1_000_000)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    parts = [f"{days}d" if days else "", f"{hours}h" if hours else "", f"{minutes}min" if minutes else ""]
    if micros:
        parts.append(f"{seconds}.{micros:06d}".rstrip("0") + "s")
    elif seconds or not any(parts):
        parts.append(f"{seconds}s")
    return sign + "".join(parts)


def human_duration(value: timedelta) -> str:
    """Readable form for explanations: ``'2 days'``, ``'1 day, 23:36:17'``, ``'0:23:43'``."""
    if value < _ZERO:
        return "-" + human_duration(-value)
    text = str(value)
    return text.removesuffix(", 0:00:00")
