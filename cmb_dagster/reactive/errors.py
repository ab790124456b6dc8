"""Errors of the reactive scheduler."""

import warnings
from typing import Any

from cmb_dagster.errors import CmbError, InvalidInput


class ReactiveError(CmbError):
    """Base class of reactive scheduler errors."""


class InvalidReactiveInput(ReactiveError, InvalidInput):
    """A reactive task, option or argument is invalid (duplicate name, bad priority, ...); the message names it."""


class SchedulerConflict(ReactiveError):
    """Another code location keeps the same scheduler name with other tasks; this one refuses to tick."""


class PartitionNotReady(ReactiveError):
    """Raised by a partition callable: the partition the values call for does not exist yet.

    The task waits ("waiting for partition ...") and is evaluated again on the next ticks; no failed attempt is
    counted and it does not back off.
    """

    def __init__(self, partition_key: str, detail: str = "") -> None:
        self.partition_key = partition_key
        self.detail = detail
        super().__init__(f"partition {partition_key} does not exist yet" + (f" ({detail})" if detail else ""))


_RENAMED = {"InvalidReactiveTask": "InvalidReactiveInput"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"{name} is deprecated: use {_RENAMED[name]}", DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
