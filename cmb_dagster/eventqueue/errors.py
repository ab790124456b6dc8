"""Errors of the event queue engine."""

from cmb_dagster.errors import CmbError, InvalidInput

__all__ = ["EventQueueError", "InvalidEventQueueInput", "NotDead", "UnknownHandler"]


class EventQueueError(CmbError):
    """Base class of every event queue error."""


class InvalidEventQueueInput(EventQueueError, InvalidInput):
    """Bad input to the event queue; the message names the field. Nothing was written."""


class UnknownHandler(InvalidEventQueueInput):
    """An event or a rule names a handler no worker has registered."""


class NotDead(InvalidEventQueueInput):
    """A replay names an event that is not in the dead-letter table."""
