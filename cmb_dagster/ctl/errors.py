"""Errors of the CTL store and the reactive scheduler."""

from cmb_dagster.errors import CmbError


class CtlError(CmbError):
    """Base class of CTL store and reactive scheduler errors."""


class InvalidCtlInput(CtlError, ValueError):
    """A CTL key or value is invalid (empty name, naive datetime, ...); nothing was written."""


class InvalidReactiveTask(CtlError, ValueError):
    """A reactive task definition is invalid (duplicate name, bad priority, ...)."""
