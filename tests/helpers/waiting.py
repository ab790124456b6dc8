"""Waiting for a condition with a deadline, instead of sleeping a fixed time."""

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition", *, interval: float = 0.02
) -> T:
    """Poll ``predicate`` until it returns something truthy (returned); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(interval)
