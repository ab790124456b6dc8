"""Errors of the event queue engine."""

from cmb_dagster.errors import CmbError, InvalidInput

__all__ = ["EventQueueError", "InvalidInput", "NotDead", "UnknownHandler"]


class EventQueueError(CmbError):
    """Base class of event queue errors that are not bad input."""


class UnknownHandler(InvalidInput):
    """An event or a rule names a handler no worker has registered."""


class NotDead(InvalidInput):
    """A replay names an event that is not in the dead-letter table."""
