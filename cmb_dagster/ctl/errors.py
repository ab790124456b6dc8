"""Errors of the CTL store."""

from cmb_dagster.errors import CmbError, InvalidInput


class CtlError(CmbError):
    """Base class of CTL store errors."""


class InvalidCtlInput(CtlError, InvalidInput):
    """A CTL key or value is invalid (empty name, naive datetime, ...); nothing was written."""
