"""Errors of the reactive scheduler."""

from cmb_dagster.errors import CmbError, InvalidInput


class ReactiveError(CmbError):
    """Base class of reactive scheduler errors."""


class InvalidReactiveTask(ReactiveError, InvalidInput):
    """A reactive task definition is invalid (duplicate name, bad priority, ...); the message names it."""


class SchedulerConflict(ReactiveError):
    """Another code location keeps the same scheduler name with other tasks; this one refuses to tick."""
