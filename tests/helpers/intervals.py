"""Counting what overlapped: runs in flight at once, starts within a window."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def most_at_once(intervals: Iterable[tuple[Any, Any]]) -> int:
    """The most intervals ``(start, end)`` open at one moment (an end before a start at the same moment)."""
    most = now = 0
    for _, step in sorted(edge for start, end in intervals for edge in ((start, 1), (end, -1))):
        now += step
        most = max(most, now)
    return most


def most_within(starts: Sequence[Any], width: Any) -> int:
    """The most ``starts`` in any window of ``width`` (each window begins at a start)."""
    return max((sum(s <= t < s + width for t in starts) for s in starts), default=0)
