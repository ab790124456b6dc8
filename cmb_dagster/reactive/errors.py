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


_RENAMED = {"InvalidReactiveTask": "InvalidReactiveInput"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"{name} is deprecated: use {_RENAMED[name]}", DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
